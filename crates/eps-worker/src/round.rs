//! One iteration's round of pushes and pulls, whole or tensor by tensor.
//!
//! [`Worker::push_pull`] pushes every shard and waits for the next parameters.
//! A framework that overlaps communication with its backward pass instead
//! pushes tensors as their gradients are ready ([`Worker::push_tensors`]): a
//! shard goes out once every tensor it overlaps was pushed (shards are ranges
//! of the flat parameter space and may span tensors). It then waits for the
//! parameters of some tensors or all ([`Worker::pull_tensors`]), or polls
//! ([`Worker::test_pull`]). The round ends, and the iteration advances, once
//! every shard's new parameters are in.

use std::ops::Range;
use std::time::Instant;

use eps_fabric::prelude::*;
use eps_proto::Consistency;

use crate::{Worker, WorkerError};

/// The round in progress.
#[derive(Debug)]
pub(crate) struct Open {
    started: Instant,
    /// By tensor index: pushed in this round.
    pushed: Vec<bool>,
    /// By global shard id (as of the round's start): tensors overlapping it
    /// not pushed yet, and whether it went out. Shards a split made during the
    /// round are pushed when the "moved" answer reveals them, not from here.
    pending: Vec<u32>,
    shard_pushed: Vec<bool>,
}

/// Element ranges overlap.
fn overlaps(a: &Range<u64>, b: &Range<u64>) -> bool {
    a.start < b.end && b.start < a.end
}

impl<P: Fabric> Worker<P> {
    /// Pushes this iteration's gradients and pulls the parameters of the next one,
    /// shard by shard, all shards in flight at once. Returns when every shard's new
    /// parameters are in the buffer. Routes with the newest shard map; a push the
    /// old owner answers "moved" is sent again to the new one.
    pub fn push_pull(&mut self) -> Result<(), WorkerError> {
        let all: Vec<usize> = (0..self.layout.tensors.len()).collect();
        let unpushed: Vec<usize> = match &self.open {
            Some(o) => all.iter().copied().filter(|&i| !o.pushed[i]).collect(),
            None => all.clone(),
        };
        self.push_tensors(&unpushed)?;
        self.pull_tensors(&all)
    }

    /// The number of tensors (indices for [`Worker::push_tensors`] are `0..n`,
    /// in the layout's order).
    pub fn tensor_count(&self) -> usize {
        self.layout.tensors.len()
    }

    /// Pushes the gradients of tensors `ids` (indices into the layout's
    /// tensors) of the current iteration, without waiting: every shard whose
    /// tensors have all been pushed goes out now. The first push of an
    /// iteration begins it ([`Worker::begin`]). A tensor is pushed once per
    /// iteration; its gradient must stay unchanged until the iteration's pull
    /// completes.
    pub fn push_tensors(&mut self, ids: &[usize]) -> Result<(), WorkerError> {
        let n = self.layout.tensors.len();
        if let Some(&bad) = ids.iter().find(|&&i| i >= n) {
            return Err(WorkerError::Length { what: "tensor index", expected: n, got: bad });
        }
        self.open_round()?;
        let open = self.open.as_ref().ok_or(WorkerError::Unexpected)?;
        let mut seen = vec![false; n];
        for &i in ids {
            if open.pushed[i] || std::mem::replace(&mut seen[i], true) {
                return Err(WorkerError::Unsupported("a tensor was pushed twice in one iteration"));
            }
        }
        let t = self.iteration;
        for &i in ids {
            let r = self.tensor_span(i);
            let spans: Vec<(usize, Range<u64>)> = self.round.iter().map(|&s| (s, self.shard_span(s))).collect();
            let open = self.open.as_mut().ok_or(WorkerError::Unexpected)?;
            let mut due = Vec::new();
            for (sid, span) in spans {
                if sid < open.pending.len() && !open.shard_pushed[sid] && overlaps(&r, &span) {
                    open.pending[sid] = open.pending[sid].saturating_sub(1);
                    if open.pending[sid] == 0 {
                        open.shard_pushed[sid] = true;
                        due.push(sid);
                    }
                }
            }
            open.pushed[i] = true;
            for sid in due {
                self.wait_until(|w| w.credit[sid], "a credit for the landing slot")?;
                self.push_shard(sid, t)?;
            }
        }
        Ok(())
    }

    /// Waits until the next parameters of tensors `ids` are in the parameter
    /// buffer (each must have been pushed in this iteration). The iteration
    /// ends once every tensor's are. With no round open it returns at once.
    pub fn pull_tensors(&mut self, ids: &[usize]) -> Result<(), WorkerError> {
        if !self.check_pushed(ids)? {
            return Ok(());
        }
        self.sparse_fill()?;
        if self.mode == Consistency::Asp {
            return self.asp_pull();
        }
        let t = self.iteration;
        loop {
            self.wait_until(
                |w| w.pulled_all(ids) || !w.moved.is_empty() || !w.pulls_moved.is_empty(),
                "pull answers from the servers",
            )
            .map_err(|e| match e {
                WorkerError::Timeout(_) => WorkerError::PullTimeout { iteration: t, missing: self.unanswered(t) },
                e => e,
            })?;
            if self.moved.is_empty() && self.pulls_moved.is_empty() {
                break;
            }
            self.handle_moved(t)?;
        }
        self.close_if_done();
        Ok(())
    }

    /// Whether the next parameters of tensors `ids` are in, without waiting
    /// (it reaps what has arrived and acts on "moved" answers). In ASP the
    /// pull is a read that this call makes, waiting for it.
    pub fn test_pull(&mut self, ids: &[usize]) -> Result<bool, WorkerError> {
        if !self.check_pushed(ids)? {
            return Ok(true);
        }
        // (Not yet, rather than a wait for a sparse table's credit.)
        if !self.sparse_fill_ready()? {
            return Ok(false);
        }
        if self.mode == Consistency::Asp {
            self.asp_pull()?;
            return Ok(true);
        }
        let t = self.iteration;
        self.reap()?;
        if !self.moved.is_empty() || !self.pulls_moved.is_empty() {
            self.handle_moved(t)?;
        }
        let done = self.pulled_all(ids);
        if done {
            self.close_if_done();
        }
        Ok(done)
    }

    /// Whether tensor `i` was pushed in the open round.
    pub fn is_pushed(&self, i: usize) -> bool {
        self.open.as_ref().is_some_and(|o| o.pushed.get(i).copied().unwrap_or(false))
    }

    /// Whether a round is open: some tensor was pushed in this iteration and
    /// the iteration's pulls are not all in.
    pub fn in_round(&self) -> bool {
        self.open.is_some()
    }

    /// Whether the gradient pushes of tensors `ids` have all left this
    /// worker's buffer (their WRITEs completed): the gradient buffer of those
    /// tensors may be written again.
    pub fn pushes_sent(&mut self, ids: &[usize]) -> Result<bool, WorkerError> {
        if !self.check_pushed(ids)? {
            return Ok(true);
        }
        self.reap()?;
        let shards: Vec<usize> = self.shards_of(ids);
        Ok(shards.iter().all(|&s| self.sending.get(s).copied().unwrap_or(0) == 0))
    }

    /// Element range of tensor `i`.
    fn tensor_span(&self, i: usize) -> Range<u64> {
        let t = &self.layout.tensors[i];
        t.offset..t.offset + t.elements
    }

    /// Element range of shard `sid`.
    fn shard_span(&self, sid: usize) -> Range<u64> {
        let r = &self.map.routes[sid];
        r.start..r.start + r.len
    }

    /// The round's shards overlapping tensors `ids`.
    fn shards_of(&self, ids: &[usize]) -> Vec<usize> {
        let spans: Vec<Range<u64>> = ids.iter().map(|&i| self.tensor_span(i)).collect();
        self.round.iter().copied().filter(|&s| spans.iter().any(|r| overlaps(r, &self.shard_span(s)))).collect()
    }

    /// Checks the indices; whether a round is open (without one, nothing is
    /// in flight: the buffers hold the newest parameters this worker pulled).
    /// In an open round, every tensor asked for must have been pushed.
    fn check_pushed(&self, ids: &[usize]) -> Result<bool, WorkerError> {
        let n = self.layout.tensors.len();
        if let Some(&bad) = ids.iter().find(|&&i| i >= n) {
            return Err(WorkerError::Length { what: "tensor index", expected: n, got: bad });
        }
        let Some(open) = &self.open else { return Ok(false) };
        if ids.iter().any(|&i| !open.pushed[i]) {
            return Err(WorkerError::Unsupported("a pull of a tensor not pushed in this iteration (push it first)"));
        }
        Ok(true)
    }

    /// Every round shard overlapping `ids` has its data and no request in flight.
    fn pulled_all(&self, ids: &[usize]) -> bool {
        self.shards_of(ids).iter().all(|&s| self.round_pulled[s] && self.outstanding[s] == 0)
    }

    /// Opens the iteration's round unless one is open (closing a finished one).
    fn open_round(&mut self) -> Result<(), WorkerError> {
        // A round whose answers all came in ends here if its pull was never
        // asked for: its sparse tables are pushed (empty) first, as a pull
        // would have, so that no table misses an iteration.
        if self.round_complete() {
            self.sparse_fill()?;
        }
        self.close_if_done();
        if self.open.is_some() {
            return Ok(());
        }
        if !self.begin()? {
            return Err(WorkerError::Left(self.iteration));
        }
        let started = Instant::now();
        self.adopt_newest()?;
        self.report_routing()?;
        let t = self.iteration;
        self.start_round(t);
        let ids = self.map.routes.len();
        let mut pending = vec![0u32; ids];
        let spans: Vec<Range<u64>> = (0..self.layout.tensors.len()).map(|i| self.tensor_span(i)).collect();
        for &sid in &self.round {
            let s = self.shard_span(sid);
            pending[sid] = spans.iter().filter(|r| overlaps(r, &s)).count() as u32;
        }
        self.sending.resize(ids, 0);
        let shard_pushed = pending.iter().map(|&p| p == 0).collect();
        self.open = Some(Open { started, pushed: vec![false; self.layout.tensors.len()], pending, shard_pushed });
        // Shards that overlap no tensor (alignment padding only) go out at once.
        for sid in self.round.clone() {
            if self.open.as_ref().is_some_and(|o| o.pending[sid] == 0) {
                self.wait_until(|w| w.credit[sid], "a credit for the landing slot")?;
                self.push_shard(sid, t)?;
            }
        }
        Ok(())
    }

    /// Whether a round is open with every tensor pushed and every shard's
    /// parameters in.
    fn round_complete(&self) -> bool {
        self.open.as_ref().is_some_and(|o| o.pushed.iter().all(|&p| p))
            && self.round_done()
            && self.moved.is_empty()
            && self.pulls_moved.is_empty()
    }

    /// Ends the round once every shard's parameters are in.
    fn close_if_done(&mut self) {
        if self.round_complete()
            && let Some(o) = self.open.take()
        {
            self.iteration += 1;
            self.stats.comm += o.started.elapsed();
            self.metrics.round(o.started.elapsed(), self.iteration, self.map.epoch);
        }
    }

    /// ASP: once every tensor is pushed, reads the newest parameters of every
    /// shard (RDMA READs) and ends the round.
    fn asp_pull(&mut self) -> Result<(), WorkerError> {
        if !self.open.as_ref().is_some_and(|o| o.pushed.iter().all(|&p| p)) {
            return Err(WorkerError::Unsupported("in ASP a pull reads every tensor: push them all first"));
        }
        self.read_pull()?;
        if let Some(o) = self.open.take() {
            self.iteration += 1;
            self.stats.comm += o.started.elapsed();
            self.metrics.round(o.started.elapsed(), self.iteration, self.map.epoch);
        }
        Ok(())
    }

    /// Acts on "moved" answers: pushes again where the newest map says (a
    /// split's parts for a shard split meanwhile), and asks refused pulls again.
    fn handle_moved(&mut self, t: u64) -> Result<(), WorkerError> {
        if !self.moved.is_empty() {
            // Routed with an old epoch: push where the newest map says; if
            // it still routes a push to the server that refused it, fetch
            // a newer one first.
            self.adopt_newest()?;
            let stale = self
                .moved
                .iter()
                .any(|&(sid, it, from)| self.map.routes[sid].alive(it) && self.map.routes[sid].for_iteration(it).owner == from);
            // (A lost server's shards move once the control plane promotes their
            // backups: maps may come before that one.)
            let mut stale = stale;
            while stale {
                self.refresh_map()?;
                stale = self.moved.iter().any(|&(sid, it, from)| {
                    self.map.routes[sid].alive(it) && self.map.routes[sid].for_iteration(it).owner == from
                });
            }
            for (sid, it, _) in std::mem::take(&mut self.moved) {
                // A shard split at or before `it`: push its parts.
                let cover = self.map.covering(sid, it);
                if cover.is_empty() || cover == [sid] {
                    self.push_shard(sid, it)?;
                    continue;
                }
                self.replace_in_round(sid, &cover);
                for c in cover {
                    self.wait_until(|w| w.credit[c], "a credit for the landing slot")?;
                    self.push_shard(c, it)?;
                }
            }
        }
        // A pull refused while its push was taken (a migration cut over
        // meanwhile), or after the shard was split: ask again.
        self.ask_again(self.need_after_push(t))
    }
}
