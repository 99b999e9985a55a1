//! Waiting for completions: reaping the completion queue (pull answers,
//! "moved" answers, hello acknowledgements, push completions), and what a
//! round that waits too long says it waits for.

use std::time::{Duration, Instant};

use eps_fabric::prelude::*;
use eps_proto::Consistency;
use eps_proto::imm::{Imm, ImmKind, widen_seq};

use crate::{WR_HELLO, WR_PUSH, WR_READ, Worker, WorkerError};

/// How long a round waits with nothing coming before it says what it waits for.
const STALL_REPORT: Duration = Duration::from_secs(10);

impl<P: Fabric> Worker<P> {
    /// Reaps completions until `done` holds: spinning (and yielding) while they
    /// flow, sleeping on the CQ after 200 us without any, or as long as twice
    /// the recent rounds' gaps when those are under 5 ms ([`eps_fabric::Spin`]);
    /// fails after the worker's timeout.
    pub(crate) fn wait_until(&mut self, done: impl Fn(&Self) -> bool, what: &'static str) -> Result<(), WorkerError> {
        let deadline = Instant::now() + self.timeout;
        let mut looked = Instant::now();
        let mut told = false;
        while !done(self) {
            if let Some(e) = self.sparse.lost_error() {
                return Err(e);
            }
            // A lost server's table rows: its stand-in gets what it owed.
            self.take_over_rows()?;
            if self.reap()? {
                self.spin.worked();
            } else if Instant::now() > deadline {
                return Err(WorkerError::Timeout(what));
            } else if self.spin.spinning() {
                // Spinning, it gives way to any thread that can run (the
                // progress threads that bring what it waits for, on a
                // machine with few cores).
                std::thread::yield_now();
            } else {
                self.cq.wait(Duration::from_millis(1));
                if looked.elapsed() > Duration::from_millis(50) {
                    looked = Instant::now();
                    self.notice_lost_servers();
                }
                if !told && self.spin.last().elapsed() > STALL_REPORT {
                    told = true;
                    eps_proto::say!("eps worker {}: nothing came for {:?}: {}", self.rank, STALL_REPORT, self.waiting_for(what));
                }
            }
        }
        Ok(())
    }

    /// What a stalled round waits for, for its report.
    fn waiting_for(&self, what: &str) -> String {
        let t = self.iteration;
        let shards: Vec<String> = self
            .round
            .iter()
            .filter(|&&s| !self.round_pulled[s] || self.outstanding[s] > 0 || self.sending[s] > 0)
            .take(16)
            .map(|&s| {
                format!(
                    "shard {s} on server {} (pulled {}, {} answers owed, {} sends)",
                    self.route(s, t).owner,
                    self.round_pulled[s],
                    self.outstanding[s],
                    self.sending[s]
                )
            })
            .collect();
        let tables = self.sparse.owed();
        let sparse = if tables.is_empty() { String::new() } else { format!("; sparse pull answers owed: {}", tables.join(", ")) };
        format!("waiting for {what} at iteration {t}, epoch {}: {}{sparse}", self.map.epoch, shards.join("; "))
    }

    /// Polls once; counts pull answers, "moved" answers and acknowledged hellos.
    /// True if anything came.
    pub(crate) fn reap(&mut self) -> Result<bool, WorkerError> {
        let mut wc = [Completion::EMPTY; 64];
        let k = self.cq.poll(&mut wc)?;
        for c in &wc[..k] {
            let server = self.qp_rank.get(&c.qp_num).copied().unwrap_or(u32::MAX);
            if !c.status.is_ok() {
                if c.wr_id == WR_HELLO {
                    // Answered by its failure: `connect` stops waiting for it
                    // (the server is handled as lost below, or the error
                    // ends the worker).
                    self.hellos_acked += 1;
                }
                if c.wr_id & (0xF << 60) == crate::sparse::WR_SPARSE && c.wr_id & crate::sparse::WR_SPARSE_PULL == 0 {
                    // A push that failed is sent again to the stand-in, if any.
                    self.sparse.sent((c.wr_id & 0xFFFF) as usize, server);
                }
                if self.lost.contains(&server) {
                    continue;
                }
                if self.spec.job.replicas > 1 && (self.routes_to(server) || self.sparse.holds(server)) {
                    // Its shards' backups take over: this round goes there again.
                    self.lose_server(server);
                    self.report_unreachable(server);
                    continue;
                }
                if !self.routes_to(server) && !self.sparse.holds(server) {
                    // A server this worker no longer routes to left the job: its
                    // connection's posted receives are flushed. Nothing was lost.
                    if let Some(q) = self.qps.get_mut(server as usize) {
                        *q = None;
                    }
                    continue;
                }
                // Servers cut off a worker the job removed (its lease lapsed): its
                // pushes in flight fail as well as its posted receives, in either order.
                if let Some(iteration) = self.removed_at() {
                    return Err(WorkerError::Removed { rank: self.rank, iteration });
                }
                if matches!(c.opcode, WcOpcode::Recv | WcOpcode::RecvWithImm) {
                    return Err(WorkerError::ServerGone { server, iteration: self.iteration, epoch: self.map.epoch });
                }
                let what = if c.wr_id & crate::seed::WR_SEED != 0 && c.wr_id & (3 << 62) == 0 {
                    "sending the initial values"
                } else if c.wr_id & (3 << 62) == WR_PUSH {
                    "push"
                } else {
                    "pull"
                };
                return Err(WorkerError::Transfer { what, shard: (c.wr_id & 0xFFFF_FFFF) as u32, status: c.status });
            }
            match c.opcode {
                WcOpcode::RecvWithImm => {
                    if let Ok(q) = self.qp(server) {
                        q.post_recv(&RecvWr { wr_id: 0, sg: &[] })?;
                    }
                    if let Some(m) = c.imm.and_then(Imm::decode)
                        && let Some(table) = eps_proto::layout::sparse_table(m.shard)
                    {
                        self.sparse.on_imm(server, table, m);
                        continue;
                    }
                    if self.lost.contains(&server) {
                        // A server treated as lost (its connection failed, or a
                        // map left it out): what it sent before its connection
                        // was closed here is stale, and this round's requests
                        // went to its shards' new owners (`lose_server`). An
                        // answer counted now could close a later round.
                        continue;
                    }
                    let Some(m) = c.imm.and_then(Imm::decode).filter(|m| (m.shard as usize) < self.credit.len()) else {
                        continue;
                    };
                    let sid = m.shard as usize;
                    match m.kind {
                        ImmKind::PullDone => {
                            self.pulled += 1;
                            self.round_pulled[sid] = true;
                            self.outstanding[sid] = self.outstanding[sid].saturating_sub(1);
                            self.count_pulled(c.byte_len as u64);
                            if self.mode == Consistency::Bsp {
                                self.credit[sid] = true;
                            }
                        }
                        ImmKind::Credit => self.credit[sid] = true,
                        ImmKind::PullMoved => {
                            self.pull_moved += 1;
                            self.outstanding[sid] = self.outstanding[sid].saturating_sub(1);
                            self.pulls_moved.push((sid, server));
                            if let Some(i) = self.owed.iter().position(|&o| o == (sid, server)) {
                                self.owed.swap_remove(i);
                            }
                        }
                        ImmKind::Moved => {
                            self.credit[sid] = true;
                            self.owed.push((sid, server));
                            self.moved.push((sid, widen_seq(m.seq, self.iteration), server));
                        }
                        _ => {}
                    }
                }
                _ if c.wr_id == WR_HELLO => self.hellos_acked += 1,
                _ if c.wr_id & (0xF << 60) == crate::sparse::WR_SPARSE && c.wr_id & crate::sparse::WR_SPARSE_PULL == 0 => {
                    self.sparse.sent((c.wr_id & 0xFFFF) as usize, server)
                }
                _ if c.wr_id & (3 << 62) == WR_PUSH => {
                    if let Some(n) = self.sending.get_mut((c.wr_id & 0xFFFF_FFFF) as usize) {
                        *n = n.saturating_sub(1);
                    }
                }
                WcOpcode::Read if c.wr_id == WR_READ => self.reads_done += 1,
                _ => {}
            }
        }
        Ok(k > 0)
    }
}
