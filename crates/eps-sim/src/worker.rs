//! A worker as the simulation runs it: the decisions of `eps-worker` (join and
//! its first pull, `begin` with its membership hold, push and pull of every shard
//! of the iteration, "moved" answers, map refreshes and the parts of split shards)
//! and of its map watcher (long poll, votes), and what it does when a server
//! of a job with replicas crashes (`lose_server`).

mod asynchronous;
mod sparse;

use std::collections::{BTreeMap, BTreeSet};

use eps_core::route::{self, PullAgain};
use eps_proto::control::{ControlMsg, JobMap, Role};
use eps_proto::membership::Membership;

use crate::net::{Msg, Node};
use crate::{World, token, units};

/// Where a worker is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WState {
    /// Registered for a join still being voted on.
    AwaitAdmit,
    /// Pulling the parameters it starts from.
    InitialPull,
    /// `begin` waits for a membership vote to end.
    Blocked,
    /// Computing its gradient.
    Computing,
    /// Waiting for pull answers.
    Waiting,
    /// A push was answered "moved": waiting for a newer map.
    Refreshing,
    /// Trained to the last step.
    Done,
    /// Scaled away at a boundary.
    Left,
    /// Vanished (killed): sends and answers nothing more.
    Crashed,
}

/// One worker.
#[derive(Debug)]
pub(crate) struct SimWorker {
    pub(crate) rank: u32,
    pub(crate) state: WState,
    /// Current iteration.
    pub(crate) t: u64,
    start: u64,
    map: JobMap,
    newest: Option<JobMap>,
    newest_epoch: u64,
    /// The epoch reported as routed with (at the start of the last round).
    reported: u64,
    /// The watcher's membership, hold and last vote.
    wm: Membership,
    next: u64,
    hold: Option<u64>,
    voted: u64,
    /// Per alignment unit: (version, value) of the parameters held.
    pub(crate) have: Vec<(u64, u64)>,
    /// Per unit: this iteration's gradient digest.
    tokens: Vec<u64>,
    /// The shards of the current round (first pull or push_pull).
    round: Vec<u32>,
    /// Per shard id, in the current round: pull answered with data.
    round_pulled: Vec<bool>,
    /// Per shard id, in the current round: pull requests not answered yet.
    outstanding: Vec<u32>,
    /// "Pull moved" answers of the round not handled yet: (shard, server).
    pull_refused: Vec<(u32, Node)>,
    /// Pushes answered "moved": (shard, iteration, the server that answered).
    moved: Vec<(u32, u64, Node)>,
    /// Pull requests not answered yet, per (shard, server).
    asked: BTreeMap<(u32, u32), u32>,
    /// Servers whose connection failed.
    lost: BTreeSet<u32>,
    /// The job keeps two replicas of every shard.
    pub(crate) replicated: bool,
    /// SSP/ASP, per shard id: its landing slot is free (the last push was
    /// applied); and the shards of the round not pushed yet for want of it.
    credit: Vec<bool>,
    unpushed: Vec<u32>,
    /// The job's sparse table, if it has one.
    pub(crate) table: Option<sparse::WTable>,
}

pub(crate) use sparse::WTable;

impl SimWorker {
    pub(crate) fn new(rank: u32, map: JobMap, units: usize) -> Self {
        let wm = Membership::from_epochs(map.membership.clone()).expect("the control plane's membership is valid");
        let mut w = Self {
            rank,
            state: WState::AwaitAdmit,
            t: 0,
            start: 0,
            newest_epoch: map.epoch,
            reported: map.epoch,
            map: map.clone(),
            newest: None,
            wm,
            next: 0,
            hold: None,
            voted: 0,
            have: vec![(0, 0); units],
            tokens: vec![0; units],
            round: Vec::new(),
            round_pulled: Vec::new(),
            outstanding: Vec::new(),
            pull_refused: Vec::new(),
            moved: Vec::new(),
            asked: BTreeMap::new(),
            lost: BTreeSet::new(),
            replicated: false,
            credit: Vec::new(),
            unpushed: Vec::new(),
            table: None,
        };
        w.set_map(map);
        w
    }

    /// Routes with `m` (shards made by splits get their per-shard state).
    fn set_map(&mut self, m: JobMap) {
        let n = m.routes.len();
        self.map = m;
        self.round_pulled.resize(n, false);
        self.outstanding.resize(n, 0);
        self.credit.resize(n, true);
    }

    /// Takes the watcher's map if it is newer than ours.
    fn adopt_newest(&mut self) {
        if let Some(m) = self.newest.take().filter(|m| m.epoch > self.map.epoch) {
            self.adopt_map(m);
        }
    }

    /// Its map and round, for a stall report.
    pub(crate) fn describe(&self) -> String {
        let routes: Vec<String> = self
            .map
            .routes
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let owner = match &r.previous {
                    Some((p, at)) => format!("{}<{at}:{}", p.owner, r.owner.owner),
                    None => r.owner.owner.to_string(),
                };
                format!("{i}@{}+{}[{},{}):{owner}", r.start, r.len, r.from, r.until)
            })
            .collect();
        format!(
            "map epoch {} routes [{}], newest {}, hold {:?}, round {:?} pulled {:?} moved {:?} refused {:?} outstanding {:?} asked {:?} lost {:?}{}",
            self.map.epoch,
            routes.join(" "),
            self.newest_epoch,
            self.hold,
            self.round,
            self.round.iter().map(|&s| self.round_pulled[s as usize]).collect::<Vec<_>>(),
            self.moved,
            self.pull_refused,
            self.outstanding,
            self.asked,
            self.lost,
            self.table.as_ref().map_or(String::new(), |t| format!(", {}", t.describe()))
        )
    }

    /// `Worker::routes_to`: whether this worker still needs server `rank`.
    pub(crate) fn routes_to(&self, rank: u32) -> bool {
        route::routes_to(&self.map, self.t, rank)
    }

    /// Whether the worker still takes part (its watcher runs).
    pub(crate) fn live(&self) -> bool {
        !matches!(self.state, WState::Done | WState::Left | WState::Crashed)
    }

    fn me(&self) -> Node {
        Node::Worker(self.rank)
    }

    /// The version of alignment unit `unit` this worker needs next.
    pub(crate) fn need(&self, unit: usize) -> u64 {
        match self.state {
            WState::AwaitAdmit | WState::InitialPull => self.start,
            _ => self.have[unit].0 + 1,
        }
    }

    /// Starts a round over the map's shards of iteration `t`.
    fn start_round(&mut self, t: u64) {
        self.round_pulled.iter_mut().for_each(|p| *p = false);
        self.outstanding.iter_mut().for_each(|o| *o = 0);
        self.pull_refused.clear();
        self.moved.clear();
        self.round = self.map.shards_at(t).into_iter().map(|s| s as u32).collect();
    }

    fn replace_in_round(&mut self, shard: u32, parts: &[usize]) {
        self.round.retain(|&s| s != shard);
        for &p in parts {
            if !self.round.contains(&(p as u32)) {
                self.round.push(p as u32);
            }
        }
    }

    fn round_done(&self) -> bool {
        self.round.iter().all(|&s| self.round_pulled[s as usize]) && self.outstanding.iter().all(|&o| o == 0)
    }

    /// `Worker::join` after registering: waits for the change that admits it.
    pub(crate) fn try_admit(&mut self, w: &mut World) {
        self.adopt_newest();
        let admitted = self.map.membership.last().is_some_and(|(_, set)| set.contains(&self.rank));
        if self.map.proposal != 0 && !admitted {
            return;
        }
        let Some(m) = Membership::from_epochs(self.map.membership.clone()) else {
            return w.fail(format!("worker {}: invalid membership in the map", self.rank));
        };
        let Some(joined) = m.joined_at(self.rank) else {
            return w.fail(format!("worker {}: registered but contributes to no iteration ({:?})", self.rank, m.epochs()));
        };
        // A job resumed from a checkpoint starts at the checkpoint's iteration.
        let start = joined.max(w.first);
        self.wm = m;
        (self.start, self.t, self.next) = (start, start, start);
        if start >= w.steps {
            // Admitted after the last step: nothing to train.
            return self.finish(w, WState::Done);
        }
        self.state = WState::InitialPull;
        self.start_round(start);
        if w.mode != eps_proto::Consistency::Bsp {
            return self.first_pull_async(w);
        }
        for s in self.round.clone() {
            let owner = self.map.routes[s as usize].for_iteration(start.saturating_sub(1)).owner;
            self.ask(w, s, owner, start);
        }
    }

    /// Asks server `owner` for version `need` of `shard`; one that failed
    /// counts as a refusal (a map that routes elsewhere is waited for).
    fn ask(&mut self, w: &mut World, shard: u32, owner: u32, need: u64) -> bool {
        if self.lost.contains(&owner) {
            self.pull_refused.push((shard, Node::Server(owner)));
            return false;
        }
        w.send(self.me(), Node::Server(owner), Msg::PullReq { w: self.rank, shard, need });
        self.outstanding[shard as usize] += 1;
        *self.asked.entry((shard, owner)).or_insert(0) += 1;
        true
    }

    /// A pull request was answered "pull moved" by `from`: asked again later.
    fn refused(&mut self, shard: u32, from: Node) {
        self.answered(shard, from);
        let s = shard as usize;
        self.outstanding[s] = self.outstanding[s].saturating_sub(1);
        self.pull_refused.push((shard, from));
    }

    /// A pull answer from `from` came.
    fn answered(&mut self, shard: u32, from: Node) {
        let Node::Server(s) = from else { return };
        if let Some(n) = self.asked.get_mut(&(shard, s)) {
            *n -= 1;
            if *n == 0 {
                self.asked.remove(&(shard, s));
            }
        }
    }

    /// `Worker::lose_server`: server `s`'s connection failed (a job with
    /// replicas promotes its shards' backups in a new epoch). This round's
    /// requests to it that were not answered are made again to the new owners:
    /// the push and its pull (the backup applied every version anyone pulled).
    fn lose_server(&mut self, w: &mut World, s: u32) {
        if !self.mark_lost(s) {
            return;
        }
        match self.state {
            WState::InitialPull => {
                self.ask_again(w, self.start);
            }
            WState::Waiting | WState::Refreshing => self.step(w),
            _ => {}
        }
    }

    /// `lose_server`'s bookkeeping; false if `s` was lost already.
    fn mark_lost(&mut self, s: u32) -> bool {
        if !self.lost.insert(s) {
            return false;
        }
        let t = self.t;
        let owed: Vec<(u32, u32)> = self.asked.iter().filter(|((_, x), _)| *x == s).map(|(&(sh, _), &n)| (sh, n)).collect();
        for (shard, n) in owed {
            self.asked.remove(&(shard, s));
            let i = shard as usize;
            self.outstanding[i] = self.outstanding[i].saturating_sub(n);
            if !self.round.contains(&shard) || self.round_pulled[i] {
                continue;
            }
            match self.state {
                WState::InitialPull => self.pull_refused.push((shard, Node::Server(s))),
                _ if self.moved.iter().any(|m| m.0 == shard && m.1 == t) => {}
                _ => self.moved.push((shard, t, Node::Server(s))),
            }
        }
        true
    }

    /// `Worker::adopt`: with replicas, a server the new map leaves out was
    /// declared lost; if this round still waits on it, its requests go again
    /// (its connection need not have failed where this worker could see it).
    fn adopt_map(&mut self, m: JobMap) {
        if self.replicated {
            for s in route::left_out(&self.map, &m) {
                let waits_on = self.asked.keys().any(|&(_, x)| x == s);
                if self.routes_to(s) || waits_on {
                    self.mark_lost(s);
                }
            }
        }
        self.set_map(m);
    }

    /// `Worker::notice_lost_servers` (its wait loop looks every 50 ms): the
    /// watcher's map leaves out a server ours routes to.
    fn notice_lost_servers(&mut self, w: &mut World) {
        let Some(newest) = self.newest.as_ref().filter(|m| self.replicated && m.epoch > self.map.epoch) else { return };
        for s in route::left_out(&self.map, newest) {
            if self.live() && !self.lost.contains(&s) && self.routes_to(s) {
                self.lose_server(w, s);
            }
        }
    }

    /// Takes in a pull answer: the shard's units now hold version `v`.
    fn took(&mut self, w: &mut World, shard: u32, v: u64, value: &[u64]) {
        let Some(r) = self.map.routes.get(shard as usize) else {
            return w.fail(format!("worker {}: pull answer for unknown shard {shard}", self.rank));
        };
        let us = units(r.start, r.len);
        if us.len() != value.len() {
            return w.fail(format!("worker {}: pull of shard {shard} gave {} unit values", self.rank, value.len()));
        }
        for (u, &x) in us.zip(value) {
            self.have[u] = (v, x);
        }
        let s = shard as usize;
        self.round_pulled[s] = true;
        self.outstanding[s] = self.outstanding[s].saturating_sub(1);
    }

    /// Handles one delivery.
    pub(crate) fn handle(&mut self, w: &mut World, from: Node, msg: Msg) {
        if !self.live() {
            return;
        }
        // A server this worker treats as lost: its connection was closed
        // here, and what it sent before that is gone with it.
        if let Node::Server(s) = from
            && self.lost.contains(&s)
        {
            return;
        }
        if w.mode != eps_proto::Consistency::Bsp {
            return self.handle_async(w, from, msg);
        }
        let rank = self.rank;
        match (msg, self.state) {
            (Msg::Map(m), _) => self.on_map(w, *m),
            (Msg::ServerGone { s }, _) => self.lose_server(w, s),
            (Msg::PullDone { shard, v, value }, WState::InitialPull) => {
                self.answered(shard, from);
                if v != self.start {
                    return w.fail(format!("worker {rank}: first pull of shard {shard} gave version {v}, not {}", self.start));
                }
                self.took(w, shard, v, &value);
                if self.round_done() {
                    self.begin(w);
                }
            }
            (Msg::PullMoved { shard }, WState::InitialPull) => {
                self.refused(shard, from);
                self.ask_again(w, self.start);
            }
            (Msg::PullDone { shard, v, value }, WState::Waiting | WState::Refreshing) => {
                self.answered(shard, from);
                // BSP: exactly the next version, unless this worker does not
                // contribute to the next iteration (it leaves there, and the others
                // need not wait for it to publish the version after).
                let leaving = !self.wm.contributors(self.t + 1).contains(&rank);
                if v != self.t + 1 && !(v > self.t + 1 && leaving) {
                    return w.fail(format!("worker {rank}: pull of shard {shard} gave version {v} in iteration {}", self.t));
                }
                self.took(w, shard, v, &value);
                self.step(w);
            }
            (Msg::Moved { shard, t }, WState::Waiting | WState::Refreshing) => {
                self.moved.push((shard, t, from));
                self.step(w);
            }
            (Msg::PullMoved { shard }, WState::Waiting | WState::Refreshing) => {
                self.refused(shard, from);
                self.step(w);
            }
            (Msg::Tick, WState::Computing) => self.push_all(w),
            (Msg::SparseRows { v, rows }, WState::Computing) => self.on_sparse_rows(w, v, rows),
            (Msg::SparseCredit, _) => self.on_sparse_credit(w, from),
            (m, s) => w.fail(format!("worker {rank} in state {s:?} got {m:?}")),
        }
    }

    /// `Worker::ask_again`: refused pulls (for version `need`) go to the owner of
    /// the newest map, or to the parts of a shard split meanwhile; if it was the
    /// owner that refused, after a newer map. False if one waits for a map.
    fn ask_again(&mut self, w: &mut World, need: u64) -> bool {
        let mut waits = false;
        for (s, from) in std::mem::take(&mut self.pull_refused) {
            let i = s as usize;
            if !self.round.contains(&s) || self.round_pulled[i] || self.outstanding[i] > 0 {
                continue;
            }
            self.adopt_newest();
            let Node::Server(refused) = from else {
                w.fail(format!("worker {}: a pull refused by {from:?}", self.rank));
                continue;
            };
            let mut again = route::pull_again(&self.map, self.rank, i, need, Some(refused));
            if again == PullAgain::NewerMap {
                if !self.take_newer_map(w) {
                    self.pull_refused.push((s, from));
                    waits = true;
                    continue;
                }
                again = route::pull_again(&self.map, self.rank, i, need, None);
            }
            let cover = match again {
                PullAgain::Ask(cover) => cover,
                // Leaving at `need`: that version is not used.
                PullAgain::Unused | PullAgain::NewerMap => {
                    self.round_pulled[i] = true;
                    continue;
                }
            };
            if cover != [i] {
                self.replace_in_round(s, &cover);
            }
            for c in cover {
                let owner = self.map.routes[c].owner.owner;
                waits |= !self.ask(w, c as u32, owner, need);
            }
        }
        !waits
    }

    /// The watcher takes in a map: membership, proposal and vote; then whatever
    /// the training thread waited for.
    fn on_map(&mut self, w: &mut World, m: JobMap) {
        if m.epoch <= self.newest_epoch {
            return;
        }
        self.newest_epoch = m.epoch;
        if let Some(ms) = Membership::from_epochs(m.membership.clone())
            && ms.epochs().len() >= self.wm.epochs().len()
        {
            self.wm = ms;
        }
        if m.proposal != 0 && m.proposal != self.voted {
            self.voted = m.proposal;
            self.hold = Some(self.next);
            let vote = ControlMsg::Vote { role: Role::Worker, rank: self.rank, id: m.proposal, hold: self.next };
            if let Err(e) = w.ctl(&vote) {
                return w.fail(format!("worker {}: vote refused: {e}", self.rank));
            }
        } else if m.proposal != self.voted {
            self.hold = None;
        }
        self.newest = Some(m);
        w.adopted(self.rank, self.reported);
        match self.state {
            WState::AwaitAdmit => self.try_admit(w),
            WState::Blocked => self.begin(w),
            WState::InitialPull if !self.pull_refused.is_empty() && w.mode != eps_proto::Consistency::Bsp => {
                self.ask_again_async(w);
            }
            WState::InitialPull if !self.pull_refused.is_empty() => {
                self.ask_again(w, self.start);
            }
            WState::Refreshing if w.mode != eps_proto::Consistency::Bsp => {
                self.state = WState::Waiting;
                self.ask_again_async(w);
            }
            WState::Refreshing => {
                self.state = WState::Waiting;
                self.step(w);
            }
            _ => {}
        }
        // (After whatever the map let the worker do: it may have adopted it.)
        self.notice_lost_servers(w);
    }

    /// `Worker::finish`: done training (`Done`) or scaled away (`Left`).
    fn finish(&mut self, w: &mut World, state: WState) {
        self.state = state;
        w.gone(self.rank);
        if let Err(e) = w.ctl(&ControlMsg::Finished { role: Role::Worker, rank: self.rank }) {
            w.fail(format!("worker {}: finish refused: {e}", self.rank));
        }
        w.worker_finished();
    }

    /// `Worker::begin`: waits while a vote holds this iteration; leaves if this
    /// worker does not contribute to it; else computes.
    fn begin(&mut self, w: &mut World) {
        if self.hold.is_some_and(|h| self.t >= h) {
            self.state = WState::Blocked;
            return;
        }
        self.next = self.next.max(self.t + 1);
        if !self.wm.contributors(self.t).contains(&self.rank) {
            return self.finish(w, WState::Left);
        }
        self.state = WState::Computing;
        // (With a table, it computes once its rows are in.)
        if !self.sparse_pull(w) {
            let me = self.me();
            w.timer(me, 1, 8);
        }
    }

    /// `push_pull`: every shard of this iteration to its owner.
    fn push_all(&mut self, w: &mut World) {
        self.adopt_newest();
        // The table's push first (it waits for the last one's credits).
        if !self.sparse_push(w) {
            return;
        }
        // Every answer of the previous round came: nothing older is in flight; and
        // once no route of this iteration is a previous owner, no drained server
        // is needed any more.
        let t = self.t;
        if route::settled(&self.map, t) {
            self.reported = self.map.epoch;
        }
        w.adopted(self.rank, self.reported);
        for u in 0..self.have.len() {
            let (v, value) = self.have[u];
            if v != t {
                return w.fail(format!("worker {}: iteration {t} computed from version {v} of unit {u}", self.rank));
            }
            self.tokens[u] = token(self.rank, t, u, value);
        }
        self.start_round(t);
        for s in self.round.clone() {
            self.push_shard(w, s, t);
        }
        self.state = WState::Waiting;
        if !self.moved.is_empty() {
            // (Shards of a server that failed: pushed again once a map routes
            // them elsewhere.)
            self.step(w);
        }
    }

    fn push_shard(&mut self, w: &mut World, shard: u32, t: u64) {
        let r = &self.map.routes[shard as usize];
        let owner = r.for_iteration(t).owner;
        let token = self.tokens[units(r.start, r.len)].to_vec();
        let (me, to) = (self.me(), Node::Server(owner));
        if self.lost.contains(&owner) {
            self.moved.push((shard, t, to));
            return;
        }
        w.send(me, to, Msg::Push { w: self.rank, shard, t, token });
        self.ask(w, shard, owner, t + 1);
    }

    /// Takes a map newer than ours (the watcher's, or the control plane's right
    /// now, as `refresh_map`'s long poll would return it); false if none exists.
    fn take_newer_map(&mut self, w: &mut World) -> bool {
        if let Some(m) = self.newest.take().filter(|m| m.epoch > self.map.epoch) {
            self.adopt_map(m);
            return true;
        }
        if w.job.epoch() > self.map.epoch {
            self.adopt_map(w.job.job_map());
            return true;
        }
        false
    }

    /// The `push_pull` loop after an answer: moved pushes go again to the new
    /// owner (or to the parts of a shard split meanwhile), refused pulls are asked
    /// again, and the round ends once every shard of the round has its data and
    /// nothing is in flight. Waits for a newer map where one is needed.
    fn step(&mut self, w: &mut World) {
        if !self.moved.is_empty() {
            // A newer map if ours still routes a push to the server that refused it.
            self.adopt_newest();
            let stale = self.moved.iter().any(|&(s, t, from)| {
                let r = &self.map.routes[s as usize];
                r.alive(t) && Node::Server(r.for_iteration(t).owner) == from
            });
            if stale && !self.take_newer_map(w) {
                self.state = WState::Refreshing;
                return;
            }
            for (s, t, _) in std::mem::take(&mut self.moved) {
                let cover = self.map.covering(s as usize, t);
                if cover.is_empty() || cover == [s as usize] {
                    self.push_shard(w, s, t);
                    continue;
                }
                self.replace_in_round(s, &cover);
                for c in cover {
                    self.push_shard(w, c as u32, t);
                }
            }
            if !self.moved.is_empty() {
                // Still routed to a server that failed: a newer map comes.
                self.state = WState::Refreshing;
                return;
            }
        }
        if !self.ask_again(w, self.t + 1) {
            self.state = WState::Refreshing;
            return;
        }
        self.state = WState::Waiting;
        if self.round_done() && self.moved.is_empty() {
            self.t += 1;
            if self.t >= w.steps {
                self.finish(w, WState::Done);
            } else {
                self.begin(w);
            }
        }
    }
}
