//! An SSP or ASP worker, as `eps-worker` runs one: each iteration it pushes
//! every shard once the server has applied its previous contribution there
//! (the credit frees its landing slot), then asks (SSP) for a version holding
//! every worker's contributions up to the staleness bound, or reads (ASP)
//! whatever the server publishes now. The job's workers and servers stay as
//! they started here.

use eps_proto::Consistency;

use super::{SimWorker, WState};
use crate::net::{Msg, Node};
use crate::{World, token, units};

impl SimWorker {
    /// Handles one delivery in an SSP/ASP job.
    pub(super) fn handle_async(&mut self, w: &mut World, from: Node, msg: Msg) {
        let rank = self.rank;
        match (msg, self.state) {
            (Msg::Map(m), _) => self.on_map(w, *m),
            (Msg::Credit { shard }, _) => {
                let Some(c) = self.credit.get_mut(shard as usize) else {
                    return w.fail(format!("worker {rank}: a credit for unknown shard {shard}"));
                };
                *c = true;
                if matches!(self.state, WState::Waiting | WState::Refreshing) {
                    self.push_ready(w);
                    self.step_async(w);
                }
            }
            (Msg::PullDone { shard, v, value } | Msg::ReadDone { shard, v, value }, WState::InitialPull) => {
                self.answered(shard, from);
                self.took(w, shard, v, &value);
                if self.round_done() {
                    self.begin(w);
                }
            }
            (Msg::PullDone { shard, v, value }, WState::Waiting | WState::Refreshing) => {
                self.answered(shard, from);
                let r = &self.map.routes[shard as usize];
                w.check_stale(rank, units(r.start, r.len), v, self.need_async(w));
                self.took(w, shard, v, &value);
                self.step_async(w);
            }
            (Msg::ReadDone { shard, v, value }, WState::Waiting | WState::Refreshing) => {
                self.took(w, shard, v, &value);
                self.step_async(w);
            }
            (Msg::PullMoved { shard }, WState::InitialPull | WState::Waiting | WState::Refreshing) => {
                // Asked of a server that gave the shard away (or is giving it):
                // again, of the owner of a newer map.
                self.refused(shard, from);
                self.ask_again_async(w);
            }
            (Msg::Tick, WState::Computing) => self.push_all_async(w),
            (Msg::SparseRows { v, rows }, WState::Computing) => self.on_sparse_rows(w, v, rows),
            (Msg::SparseCredit, _) => self.on_sparse_credit(w, from),
            (m, s) => w.fail(format!("worker {rank} ({:?}) in state {s:?} got {m:?}", w.mode)),
        }
    }

    /// SSP: the slowest clock a pull after pushing iteration `t` asks for.
    fn need_async(&self, w: &World) -> u64 {
        eps_core::route::need_after_push(w.mode, w.staleness, self.t)
    }

    /// The first values: SSP asks for any version, ASP reads.
    pub(super) fn first_pull_async(&mut self, w: &mut World) {
        for s in self.round.clone() {
            let owner = self.map.routes[s as usize].owner.owner;
            if w.mode == Consistency::Asp {
                self.read(w, s, owner);
            } else {
                self.ask(w, s, owner, 0);
            }
        }
    }

    fn read(&mut self, w: &mut World, shard: u32, owner: u32) {
        w.send(self.me(), Node::Server(owner), Msg::Read { w: self.rank, shard });
        self.outstanding[shard as usize] += 1;
    }

    /// Refused pulls and reads go again to the shard's owner in our map, or,
    /// if that owner refused, in a newer one (waited for if none is out yet).
    pub(super) fn ask_again_async(&mut self, w: &mut World) {
        let need = if self.state == WState::InitialPull { 0 } else { self.need_async(w) };
        for (s, from) in std::mem::take(&mut self.pull_refused) {
            let owner = self.map.routes[s as usize].owner.owner;
            if Node::Server(owner) == from && !self.take_newer_map(w) {
                self.pull_refused.push((s, from));
                continue;
            }
            let owner = self.map.routes[s as usize].owner.owner;
            if w.mode == Consistency::Asp {
                self.read(w, s, owner);
            } else {
                self.ask(w, s, owner, need);
            }
        }
        if !self.pull_refused.is_empty() && self.state == WState::Waiting {
            self.state = WState::Refreshing;
        }
    }

    /// Computed iteration `t` from whatever versions it holds: pushes, by
    /// the newest map (with no push in flight, it routes by that one from now).
    pub(super) fn push_all_async(&mut self, w: &mut World) {
        // The table's push first (it waits for the last one's credits).
        if !self.sparse_push(w) {
            return;
        }
        let t = self.t;
        self.adopt_newest();
        w.adopted(self.rank, self.map.epoch);
        for u in 0..self.have.len() {
            self.tokens[u] = token(self.rank, t, u, self.have[u].1);
        }
        self.start_round(t);
        self.unpushed = self.round.clone();
        self.state = WState::Waiting;
        self.push_ready(w);
        self.step_async(w);
    }

    /// Pushes the shards of the round whose landing slot is free.
    fn push_ready(&mut self, w: &mut World) {
        let t = self.t;
        for s in std::mem::take(&mut self.unpushed) {
            if !self.credit[s as usize] {
                self.unpushed.push(s);
                continue;
            }
            self.credit[s as usize] = false;
            let r = &self.map.routes[s as usize];
            let (owner, us) = (r.owner.owner, units(r.start, r.len));
            let digest = self.tokens[us.clone()].to_vec();
            w.pushed_digest(self.rank, us.start, t, &digest);
            w.send(self.me(), Node::Server(owner), Msg::Push { w: self.rank, shard: s, t, token: digest });
            if w.mode == Consistency::Asp {
                self.read(w, s, owner);
            } else {
                let need = self.need_async(w);
                self.ask(w, s, owner, need);
            }
        }
    }

    /// The round ends once every shard is pushed and answered; the last one
    /// once its pushes are applied too (`Worker::finish` waits for their
    /// credits: the servers have everything before the job ends).
    pub(super) fn step_async(&mut self, w: &mut World) {
        if !self.unpushed.is_empty() || !self.round_done() {
            return;
        }
        if self.t + 1 < w.steps {
            self.t += 1;
            self.begin(w);
        } else if self.credit.iter().all(|&c| c) && self.sparse_settled() {
            self.t += 1;
            self.finish(w, WState::Done);
        }
    }
}
