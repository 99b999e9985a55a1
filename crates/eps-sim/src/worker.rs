//! A worker as the simulation runs it: the decisions of `eps-worker` (join and
//! its first pull, `begin` with its membership hold, push and pull of every shard,
//! "moved" answers and map refreshes) and of its map watcher (long poll, votes).

use eps_proto::control::{ControlMsg, JobMap, Role};
use eps_proto::membership::Membership;

use crate::World;
use crate::net::{Msg, Node, h2};

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
    /// Per shard: (version, value) of the parameters held.
    pub(crate) have: Vec<(u64, u64)>,
    tokens: Vec<u64>,
    /// Per shard: the map epoch its last push was routed with.
    push_epoch: Vec<u64>,
    /// First pull: answers with data so far.
    pulled: usize,
    /// Per shard, in the current round: pull answered with data.
    round_pulled: Vec<bool>,
    /// Per shard, in the current round: pull requests not answered yet.
    outstanding: Vec<u32>,
    /// "Pull moved" answers of the round not handled yet: (shard, server).
    pull_refused: Vec<(u32, Node)>,
    moved: Vec<(u32, u64)>,
    /// First pull: shards refused by the owner of our map, waiting for a newer map.
    refused: Vec<u32>,
}

impl SimWorker {
    pub(crate) fn new(rank: u32, map: JobMap, shards: usize) -> Self {
        let wm = Membership::from_epochs(map.membership.clone()).expect("the control plane's membership is valid");
        Self {
            rank,
            state: WState::AwaitAdmit,
            t: 0,
            start: 0,
            newest_epoch: map.epoch,
            reported: map.epoch,
            map,
            newest: None,
            wm,
            next: 0,
            hold: None,
            voted: 0,
            have: vec![(0, 0); shards],
            tokens: vec![0; shards],
            push_epoch: vec![0; shards],
            pulled: 0,
            round_pulled: vec![false; shards],
            outstanding: vec![0; shards],
            pull_refused: Vec::new(),
            moved: Vec::new(),
            refused: Vec::new(),
        }
    }

    /// Its map and round, for a stall report.
    pub(crate) fn describe(&self) -> String {
        let routes: Vec<String> = self
            .map
            .routes
            .iter()
            .map(|r| match &r.previous {
                Some((p, at)) => format!("{}<{at}:{}", p.owner, r.owner.owner),
                None => r.owner.owner.to_string(),
            })
            .collect();
        format!(
            "map epoch {} routes [{}], newest {}, hold {:?}, pulled {} moved {:?} refused {:?} outstanding {:?}",
            self.map.epoch,
            routes.join(" "),
            self.newest_epoch,
            self.hold,
            self.pulled,
            self.moved,
            self.pull_refused,
            self.outstanding
        )
    }

    /// Whether this worker's current round routes anything to server `rank`.
    pub(crate) fn routes_to(&self, rank: u32) -> bool {
        self.map.routes.iter().any(|r| r.for_iteration(self.t).owner == rank)
    }

    /// Whether the worker still takes part (its watcher runs).
    pub(crate) fn live(&self) -> bool {
        !matches!(self.state, WState::Done | WState::Left | WState::Crashed)
    }

    fn me(&self) -> Node {
        Node::Worker(self.rank)
    }

    /// The version of `shard` this worker needs next.
    pub(crate) fn need(&self, shard: usize) -> u64 {
        match self.state {
            WState::AwaitAdmit | WState::InitialPull => self.start,
            _ => self.have[shard].0 + 1,
        }
    }

    /// `Worker::join` after registering: waits for the change that admits it.
    pub(crate) fn try_admit(&mut self, w: &mut World) {
        if let Some(m) = self.newest.take().filter(|m| m.epoch > self.map.epoch) {
            self.map = m;
        }
        let admitted = self.map.membership.last().is_some_and(|(_, set)| set.contains(&self.rank));
        if self.map.proposal != 0 && !admitted {
            return;
        }
        let Some(m) = Membership::from_epochs(self.map.membership.clone()) else {
            return w.fail(format!("worker {}: invalid membership in the map", self.rank));
        };
        let Some(start) = m.joined_at(self.rank) else {
            return w.fail(format!("worker {}: registered but contributes to no iteration ({:?})", self.rank, m.epochs()));
        };
        self.wm = m;
        (self.start, self.t, self.next) = (start, start, start);
        if start >= w.steps {
            // Admitted after the last step: nothing to train.
            return self.finish(w, WState::Done);
        }
        self.state = WState::InitialPull;
        self.pulled = 0;
        let me = self.me();
        for s in 0..self.have.len() {
            let owner = self.map.routes[s].for_iteration(start.saturating_sub(1)).owner;
            w.send(me, Node::Server(owner), Msg::PullReq { w: self.rank, shard: s as u32, need: start });
        }
    }

    /// Handles one delivery.
    pub(crate) fn handle(&mut self, w: &mut World, from: Node, msg: Msg) {
        if !self.live() {
            return;
        }
        let rank = self.rank;
        match (msg, self.state) {
            (Msg::Map(m), _) => self.on_map(w, *m),
            (Msg::PullDone { shard, v, value }, WState::InitialPull) => {
                if v != self.start {
                    return w.fail(format!("worker {rank}: first pull of shard {shard} gave version {v}, not {}", self.start));
                }
                self.have[shard as usize] = (v, value);
                self.pulled += 1;
                if self.pulled == self.have.len() {
                    self.begin(w);
                }
            }
            (Msg::PullMoved { shard }, WState::InitialPull) => {
                // `Worker::pull`: ask the owner of the newest map; if it was the
                // owner that refused, wait for a newer map first.
                if let Some(m) = self.newest.take().filter(|m| m.epoch > self.map.epoch) {
                    self.map = m;
                }
                let owner = self.map.routes[shard as usize].owner.owner;
                if from == Node::Server(owner) {
                    if w.job.epoch() > self.map.epoch {
                        self.map = w.job.job_map();
                    } else {
                        self.refused.push(shard);
                        return;
                    }
                }
                self.ask_first(w, shard);
            }
            (Msg::PullDone { shard, v, value }, WState::Waiting | WState::Refreshing) => {
                // BSP: exactly the next version, unless this worker does not
                // contribute to the next iteration (it leaves there, and the others
                // need not wait for it to publish the version after).
                let leaving = !self.wm.contributors(self.t + 1).contains(&rank);
                if v != self.t + 1 && !(v > self.t + 1 && leaving) {
                    return w.fail(format!("worker {rank}: pull of shard {shard} gave version {v} in iteration {}", self.t));
                }
                let s = shard as usize;
                self.have[s] = (v, value);
                self.round_pulled[s] = true;
                self.outstanding[s] = self.outstanding[s].saturating_sub(1);
                self.step(w);
            }
            (Msg::Moved { shard, t }, WState::Waiting | WState::Refreshing) => {
                self.moved.push((shard, t));
                self.step(w);
            }
            (Msg::PullMoved { shard }, WState::Waiting | WState::Refreshing) => {
                let s = shard as usize;
                self.outstanding[s] = self.outstanding[s].saturating_sub(1);
                self.pull_refused.push((shard, from));
                self.step(w);
            }
            (Msg::Tick, WState::Computing) => self.push_all(w),
            (m, s) => w.fail(format!("worker {rank} in state {s:?} got {m:?}")),
        }
    }

    /// Asks the owner of `shard` in our map for the version this worker starts at.
    fn ask_first(&mut self, w: &mut World, shard: u32) {
        let owner = self.map.routes[shard as usize].owner.owner;
        let me = self.me();
        w.send(me, Node::Server(owner), Msg::PullReq { w: self.rank, shard, need: self.start });
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
            WState::InitialPull if !self.refused.is_empty() => {
                if let Some(m) = self.newest.take().filter(|m| m.epoch > self.map.epoch) {
                    self.map = m;
                }
                for s in std::mem::take(&mut self.refused) {
                    self.ask_first(w, s);
                }
            }
            WState::Refreshing => {
                self.state = WState::Waiting;
                self.step(w);
            }
            _ => {}
        }
    }

    /// `Worker::finish`: done training (`Done`) or scaled away (`Left`).
    fn finish(&mut self, w: &mut World, state: WState) {
        self.state = state;
        w.gone(self.rank);
        if let Err(e) = w.ctl(&ControlMsg::Finished { role: Role::Worker, rank: self.rank }) {
            w.fail(format!("worker {}: finish refused: {e}", self.rank));
        }
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
        let me = self.me();
        w.timer(me, 1, 8);
    }

    /// `push_pull`: every shard's gradient to the owner of this iteration.
    fn push_all(&mut self, w: &mut World) {
        if let Some(m) = self.newest.take().filter(|m| m.epoch > self.map.epoch) {
            self.map = m;
        }
        // Every answer of the previous round came: nothing older is in flight; and
        // once no route of this iteration is a previous owner, no drained server
        // is needed any more.
        let t = self.t;
        if self.map.routes.iter().all(|r| r.previous.as_ref().is_none_or(|(_, at)| t >= *at)) {
            self.reported = self.map.epoch;
        }
        w.adopted(self.rank, self.reported);
        self.round_pulled.iter_mut().for_each(|p| *p = false);
        self.outstanding.iter_mut().for_each(|o| *o = 0);
        self.pull_refused.clear();
        self.moved.clear();
        for s in 0..self.have.len() {
            let (v, value) = self.have[s];
            if v != self.t {
                return w.fail(format!("worker {}: iteration {} computed from version {v} of shard {s}", self.rank, self.t));
            }
            self.tokens[s] = h2(h2(u64::from(self.rank), self.t), h2(s as u64, value));
            self.push_shard(w, s as u32, self.t);
        }
        self.state = WState::Waiting;
    }

    fn push_shard(&mut self, w: &mut World, shard: u32, t: u64) {
        let owner = self.map.routes[shard as usize].for_iteration(t).owner;
        self.push_epoch[shard as usize] = self.map.epoch;
        let (me, to) = (self.me(), Node::Server(owner));
        w.send(me, to, Msg::Push { w: self.rank, shard, t, token: self.tokens[shard as usize] });
        w.send(me, to, Msg::PullReq { w: self.rank, shard, need: t + 1 });
        self.outstanding[shard as usize] += 1;
    }

    /// Takes a map newer than ours (the watcher's, or the control plane's right
    /// now, as `refresh_map`'s long poll would return it); false if none exists.
    fn take_newer_map(&mut self, w: &mut World) -> bool {
        if let Some(m) = self.newest.take().filter(|m| m.epoch > self.map.epoch) {
            self.map = m;
            return true;
        }
        if w.job.epoch() > self.map.epoch {
            self.map = w.job.job_map();
            return true;
        }
        false
    }

    /// The `push_pull` loop after an answer: moved pushes go again to the new
    /// owner, refused pulls are asked again of the owner (unless another request
    /// for the shard is in flight), and the round ends once every shard has its
    /// data and nothing is in flight. Waits for a newer map where one is needed.
    fn step(&mut self, w: &mut World) {
        if !self.moved.is_empty() {
            // A map newer than the one those pushes used, if ours is not.
            let used = self.moved.iter().map(|&(s, _)| self.push_epoch[s as usize]).min().unwrap_or(0);
            if used >= self.map.epoch && !self.take_newer_map(w) {
                self.state = WState::Refreshing;
                return;
            }
            for (s, t) in std::mem::take(&mut self.moved) {
                self.push_shard(w, s, t);
            }
        }
        for (s, from) in std::mem::take(&mut self.pull_refused) {
            let i = s as usize;
            if self.round_pulled[i] || self.outstanding[i] > 0 {
                continue;
            }
            if let Some(m) = self.newest.take().filter(|m| m.epoch > self.map.epoch) {
                self.map = m;
            }
            if Node::Server(self.map.routes[i].owner.owner) == from && !self.take_newer_map(w) {
                self.pull_refused.push((s, from));
                self.state = WState::Refreshing;
                continue;
            }
            let owner = self.map.routes[i].owner.owner;
            let me = self.me();
            w.send(me, Node::Server(owner), Msg::PullReq { w: self.rank, shard: s, need: self.t + 1 });
            self.outstanding[i] += 1;
        }
        if !self.pull_refused.is_empty() {
            return;
        }
        self.state = WState::Waiting;
        let done = self.round_pulled.iter().all(|&p| p) && self.outstanding.iter().all(|&o| o == 0);
        if done && self.moved.is_empty() {
            self.t += 1;
            if self.t >= w.steps {
                self.finish(w, WState::Done);
            } else {
                self.begin(w);
            }
        }
    }
}
