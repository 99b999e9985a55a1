//! Pulls other than the one `push_pull` makes: a read-only pull of one shard, the
//! first pull of a worker that joins, and the RDMA-READ pulls of ASP.

use std::time::Instant;

use eps_fabric::prelude::*;
use eps_proto::Consistency;
use eps_proto::layout::published_offset;

use crate::{WR_READ, Worker, WorkerError};

impl<P: Fabric> Worker<P> {
    /// Pulls shard `sid` again at the version this worker holds (BSP and SSP), from
    /// whichever server serves that version now: during a migration the old owner
    /// up to the cutover version, the new one after it. A server that no longer serves it
    /// answers "moved", and the pull is asked again with the newer map. This is a
    /// read-only pull: it does not advance the iteration.
    pub fn pull_shard(&mut self, sid: usize) -> Result<(), WorkerError> {
        if self.mode == Consistency::Asp {
            return Err(WorkerError::Unsupported("pull_shard in ASP (pulls are RDMA READs there; use push_pull)"));
        }
        if self.open.is_some() {
            return Err(WorkerError::Unsupported("pull_shard while an iteration's pushes are in flight (pull them first)"));
        }
        let start = Instant::now();
        self.adopt_newest()?;
        if sid >= self.map.routes.len() {
            return Err(WorkerError::Length { what: "shard id", expected: self.map.routes.len(), got: sid });
        }
        if !self.map.routes[sid].alive(self.iteration) {
            return Err(WorkerError::Unsupported("pull_shard of a shard that was split (pull its parts)"));
        }
        self.report_routing()?;
        let need = self.iteration;
        // The old owner while this worker still routes to it (before the cutover:
        // the new owner may still be catching up), then the owner. From the
        // cutover on the owner serves the version, and `report_routing` (above)
        // may already have let the old owner retire.
        let mut old_gone = false;
        for _attempt in 0..64 {
            self.pulled = 0;
            self.pull_moved = 0;
            self.pulls_moved.clear();
            let route = &self.map.routes[sid];
            let ep = match &route.previous {
                Some((p, at)) if !old_gone && need < *at => p,
                _ => &route.owner,
            };
            let from_old = ep.owner != route.owner.owner;
            let to = self.slot_at(ep)?;
            self.post_pull_req(sid, to, need)?;
            self.wait_until(|w| w.pulled >= 1 || w.pull_moved >= 1, "a pull answer from the server")?;
            if self.pulled >= 1 {
                self.stats.comm += start.elapsed();
                self.metrics.pulled_in(start.elapsed());
                return Ok(());
            }
            if from_old {
                old_gone = true; // released since: the owner in this map serves it
            } else {
                self.refresh_map()?;
            }
        }
        Err(WorkerError::Timeout("a server that serves the shard (every one answered \"moved\")"))
    }

    /// Pulls every shard once `need` is met (see `ShardSync::on_pull`). A server
    /// that no longer serves the version (a migration moved the shard meanwhile)
    /// answers "pull moved": the pull is asked again of the owner in the newest map.
    pub(crate) fn pull(&mut self, need: u64) -> Result<(), WorkerError> {
        let start = Instant::now();
        self.start_round(need);
        for sid in self.round.clone() {
            let to = self.slot_at(self.route(sid, need.saturating_sub(1)))?;
            self.post_pull_req(sid, to, need)?;
            self.outstanding[sid] += 1;
        }
        for _round in 0..64 {
            self.wait_until(|w| w.round_done() || !w.pulls_moved.is_empty(), "pull answers from the servers")?;
            if self.round_done() {
                self.stats.comm += start.elapsed();
                self.metrics.pulled_in(start.elapsed());
                return Ok(());
            }
            self.ask_again(need)?;
        }
        Err(WorkerError::Timeout("a server that serves the first version (every one answered \"pull moved\")"))
    }

    /// ASP pull: RDMA-READ every shard's newest published buffer straight into the
    /// parameter buffer, checking its version stamp before and after (a buffer the
    /// server rewrote meanwhile is read again). The server does no work for it.
    pub(crate) fn read_pull(&mut self) -> Result<(), WorkerError> {
        let start = Instant::now();
        let es = self.layout.dtype.size_bytes() as u64;
        let mut todo: Vec<usize> = self.map.shards_at(self.iteration);
        let mut chosen = vec![(0usize, 0u64); self.map.routes.len()];
        for _round in 0..1000 {
            // 1. Stamps of every shard still to read, then pick each one's newest buffer.
            self.read_stamps(&todo)?;
            for &sid in &todo {
                let (a, b) = self.stamp(sid);
                let valid = |v: u64| v != eps_proto::layout::STAMP_WRITING;
                chosen[sid] = match (valid(a), valid(b)) {
                    (true, true) if b > a => (1, b),
                    (true, _) => (0, a),
                    (false, true) => (1, b),
                    (false, false) => (0, u64::MAX),
                };
            }
            // 2. The buffers.
            let ready: Vec<usize> = todo.iter().copied().filter(|&sid| chosen[sid].1 != u64::MAX).collect();
            self.reads_done = 0;
            for &sid in &ready {
                let route = &self.map.routes[sid];
                let (ep, start, len) = (&route.owner, route.start, route.len);
                let off = published_offset(len * es, chosen[sid].0);
                let from = RemoteAddr { addr: ep.published_addr + off, rkey: ep.published_rkey };
                let sg = [Sge::new(&self.params, start * es, (len * es) as u32)];
                self.post_read(ep.owner, from, &sg)?;
                self.count_pulled(len * es);
            }
            let k = ready.len();
            self.wait_until(|w| w.reads_done >= k, "RDMA READs of the published parameters")?;
            // 3. Stamps again: keep the shards whose buffer did not change.
            self.read_stamps(&todo)?;
            todo.retain(|&sid| {
                let (a, b) = self.stamp(sid);
                let now = if chosen[sid].0 == 0 { a } else { b };
                now != chosen[sid].1 || chosen[sid].1 == u64::MAX
            });
            if todo.is_empty() {
                self.stats.comm += start.elapsed();
                self.metrics.pulled_in(start.elapsed());
                return Ok(());
            }
        }
        Err(WorkerError::Timeout("a consistent read of the published parameters"))
    }

    fn stamp(&self, sid: usize) -> (u64, u64) {
        let mut b = [0u8; 16];
        self.stamps.read_at(16 * sid, &mut b);
        (u64::from_le_bytes(b[..8].try_into().expect("8")), u64::from_le_bytes(b[8..].try_into().expect("8")))
    }

    fn read_stamps(&mut self, shards: &[usize]) -> Result<(), WorkerError> {
        self.reads_done = 0;
        for &sid in shards {
            let ep = &self.map.routes[sid].owner;
            let from = RemoteAddr { addr: ep.published_addr, rkey: ep.published_rkey };
            let sg = [Sge::new(&self.stamps, 16 * sid as u64, 16)];
            self.post_read(ep.owner, from, &sg)?;
        }
        let k = shards.len();
        self.wait_until(|w| w.reads_done >= k, "RDMA READs of the published parameters")
    }

    fn post_read(&self, server: u32, from: RemoteAddr, sg: &[Sge<'_, P::Mr>]) -> Result<(), WorkerError> {
        loop {
            match self.qp(server)?.post_send(&SendWr { wr_id: WR_READ, op: SendOp::Read(from), sg, signaled: true }) {
                Err(FabricError::QueueFull { .. }) => {
                    // Drive the queue without taking completions (wait_until counts them).
                    self.cq.poll(&mut [])?;
                    std::thread::yield_now();
                }
                r => return Ok(r?),
            }
        }
    }
}
