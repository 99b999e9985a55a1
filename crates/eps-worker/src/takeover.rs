//! Sparse tables after a server that held rows was lost (`job.replicas =
//! 2`): the server that kept its rows in step stands in for it (see the
//! server's `stand_in.rs`), and this worker sends the stand-in what the lost
//! server had not answered, once the job map names it:
//! 1. again, each pull of the last two versions the lost server answered
//!    (its part of the pull), with no reply address: the stand-in's copy
//!    may lack their bookkeeping (rows created and touched); one at a time,
//!    each acknowledged, as they land in the same region;
//! 2. the last push, if the lost server had not credited it;
//! 3. the pull it had not answered.
//!
//! From then on the lost server's buckets go to the stand-in, with the
//! stand-in's immediates; its answers count as the lost server's.

use eps_fabric::prelude::*;
use eps_proto::imm::ImmKind;
use eps_sparse::wire::{self, HEADER, Header};

use crate::sparse::{Staged, Table, Tables, pull_offset};
use crate::{Worker, WorkerError};

impl<P: Fabric> Tables<P> {
    /// Server `server` was lost: whether it held rows of the tables (the
    /// newest bucket map names it). With replicas, a stand-in is awaited.
    pub(crate) fn lose(&mut self, server: u32) -> bool {
        // Its connection is dropped with the WRITEs on it.
        for t in &mut self.tables {
            if let Some(n) = t.sending.get_mut(server as usize) {
                *n = 0;
            }
        }
        // The rows it stood in for, while the newest bucket map still names
        // their lost server, went with it: the control plane names them
        // lost (or their next server), and they are awaited again.
        let stood_in: Vec<u32> = self.heirs.iter().filter(|h| h.1 == server).map(|h| h.0).collect();
        self.heirs.retain(|h| h.1 != server);
        for x in stood_in {
            if self.holds(x) && self.replicas > 1 && !self.pending.contains(&x) {
                self.pending.push(x);
            }
        }
        let held = self.holds(server) && self.awaits(server) && self.heir_of(server).is_none();
        if held && self.replicas > 1 {
            if !self.pending.contains(&server) {
                self.pending.push(server);
            }
        } else if held {
            self.lost.get_or_insert(server);
        }
        held
    }

    /// Lost server `server` had given every row away after it applied every
    /// push it was sent (the control plane names it its own heir): its
    /// credits are in. A pull it did not answer is lost: the tables stop.
    fn gave_away(&mut self, server: u32) -> Result<(), WorkerError> {
        if self.tables.iter().any(|t| t.owed.contains(&server)) {
            self.rows_lost(server);
            return Err(self.lost_error().unwrap_or(WorkerError::Unexpected));
        }
        for t in &mut self.tables {
            if let Some(c) = t.credit.get_mut(server as usize) {
                *c = true;
            }
        }
        self.pending.retain(|&p| p != server);
        Ok(())
    }

    /// No server took lost server `server`'s rows over: the tables stop.
    pub(crate) fn rows_lost(&mut self, server: u32) {
        self.lost.get_or_insert(server);
    }

    /// The stand-in serving lost server `server`'s rows, if any.
    pub(crate) fn heir_of(&self, server: u32) -> Option<u32> {
        self.heirs.iter().find(|h| h.0 == server).map(|h| h.1)
    }

    /// The lost server a stand-in's immediate from server `server` speaks for.
    /// (A server stands in for one lost server at a time: the latest.)
    pub(crate) fn lost_for(&self, server: u32) -> Option<u32> {
        self.heirs.iter().rev().find(|h| h.1 == server).map(|h| h.0)
    }

    /// The table `table`, for sending again.
    pub(crate) fn table_mut(&mut self, table: usize) -> &mut Table<P> {
        &mut self.tables[table]
    }

    /// Why the tables cannot go on, if a server that held rows was lost and
    /// no server took its rows over (the job keeps no replicas, or their
    /// backup was not whole or was lost too): the job stops here rather
    /// than wait for rows no server serves.
    pub(crate) fn lost_error(&self) -> Option<WorkerError> {
        let s = self.lost?;
        let table = self.tables.first().map_or(String::new(), |t| t.decl.name.clone());
        let why = if self.replicas > 1 {
            format!(
                "server {s}, which held rows of the sparse tables, was lost, and no whole backup of its rows was left to \
                 take over, so the job stops: resume it from its last checkpoint (--resume)"
            )
        } else {
            format!(
                "server {s}, which held rows of the sparse tables, was lost; without replicas (--replicas 2) nothing \
                 takes its rows over, so the job stops: resume it from its last checkpoint (--resume)"
            )
        };
        Some(WorkerError::Sparse { table, why })
    }
}

impl<P: Fabric> Table<P> {
    /// A push WRITE goes on the connection to server `conn`.
    pub(crate) fn sending_to(&mut self, conn: u32) {
        if self.sending.len() <= conn as usize {
            self.sending.resize(conn as usize + 1, 0);
        }
        self.sending[conn as usize] += 1;
    }

    /// Whether every push WRITE completed.
    pub(crate) fn sent_all(&self) -> bool {
        self.sending.iter().all(|&n| n == 0)
    }

    /// A pull of version `next` begins: the last one (answered) is kept,
    /// each server's part copied, and those older than `next - 1` dropped.
    pub(crate) fn log_last_pull(&mut self, next: u64) {
        if let Some(seq) = self.pull_seq.take() {
            let parts = self
                .pull_posts
                .iter()
                .map(|&(s, at, n)| {
                    let mut b = vec![0u8; n];
                    self.pull_out.read_at(at, &mut b);
                    (s, b)
                })
                .collect();
            self.log.push((seq, parts));
        }
        self.log.retain(|(seq, _)| seq + 1 >= next);
    }

    /// The parts for server `lost` of the pulls it answered that a stand-in
    /// may lack: the logged ones, and the last one if it was answered.
    fn answered_by(&self, lost: u32) -> Vec<(u64, Vec<u8>)> {
        let mut out: Vec<(u64, Vec<u8>)> =
            self.log.iter().flat_map(|(seq, parts)| parts.iter().filter(|p| p.0 == lost).map(|p| (*seq, p.1.clone()))).collect();
        if let Some(seq) = self.pull_seq.filter(|_| !self.owed.contains(&lost)) {
            for &(s, at, n) in self.pull_posts.iter().filter(|p| p.0 == lost) {
                let mut b = vec![0u8; n];
                self.pull_out.read_at(at, &mut b);
                out.push((seq, b));
                debug_assert_eq!(s, lost);
            }
        }
        out
    }
}

impl<P: Fabric> Worker<P> {
    /// Sends the stand-ins of lost servers that held rows what those had
    /// not answered, once the job map names them (waiting for it).
    pub(crate) fn take_over_rows(&mut self) -> Result<(), WorkerError> {
        if self.sparse.taking_over || self.sparse.pending.is_empty() {
            return Ok(());
        }
        // (What it waits for below must not begin another.)
        self.sparse.taking_over = true;
        let r = self.take_over_pending();
        self.sparse.taking_over = false;
        r
    }

    fn take_over_pending(&mut self) -> Result<(), WorkerError> {
        while let Some(&lost) = self.sparse.pending.first() {
            let deadline = std::time::Instant::now() + self.timeout;
            // (A server cut off from the workers alone is declared lost once
            // two peers say so.)
            if !self.map.heirs.iter().any(|h| h.0 == lost) {
                self.report_unreachable(lost);
            }
            let heir = loop {
                self.adopt_newest()?;
                // (A stand-in lost too is named as such once the control
                // plane hears of it.)
                let gone = |w: &Self, h: u32| w.lost.contains(&h) || w.sparse.pending.contains(&h);
                match self.map.heirs.iter().find(|h| h.0 == lost) {
                    Some(&(_, Some(h))) if h == lost => break None,
                    Some(&(_, Some(h))) if !gone(self, h) => break Some(h),
                    Some(&(_, None)) => {
                        self.sparse.rows_lost(lost);
                        return Err(self.sparse.lost_error().unwrap_or(WorkerError::Unexpected));
                    }
                    _ if std::time::Instant::now() > deadline => {
                        return Err(WorkerError::Timeout("a server to take over a lost server's table rows"));
                    }
                    _ => match self.refresh_map() {
                        Err(WorkerError::Timeout(_)) => {}
                        r => r?,
                    },
                }
            };
            let Some(heir) = heir else {
                eps_proto::say!("eps worker {}: lost server {lost} had given its table rows away", self.rank);
                self.sparse.gave_away(lost)?;
                continue;
            };
            eps_proto::say!("eps worker {}: server {heir} serves lost server {lost}'s table rows", self.rank);
            self.connect(heir)?;
            self.sparse.pending.retain(|&p| p != lost);
            self.sparse.heirs.push((lost, heir));
            self.send_again(lost)?;
        }
        Ok(())
    }

    /// Sends lost server `lost`'s stand-in what it had not answered (see the
    /// module's doc).
    fn send_again(&mut self, lost: u32) -> Result<(), WorkerError> {
        for table in 0..self.sparse.len() as u16 {
            let Some((addr, rkey)) = self.sparse_landing(lost, table)? else { return Err(WorkerError::Unexpected) };
            let t = self.sparse.table_mut(table as usize);
            let off = pull_offset(&t.decl) as u64;
            let again = t.answered_by(lost);
            let owed = t.owed.contains(&lost);
            t.owed.retain(|&s| s != lost);
            for (seq, mut bytes) in again {
                let Some(mut h) = Header::decode(&bytes) else { return Err(WorkerError::Unexpected) };
                h.reply_addr = wire::NO_REPLY;
                h.reply_rkey = 0;
                bytes[..HEADER].copy_from_slice(&h.encode());
                if self.sparse.again_out.as_ref().is_none_or(|m| m.len() < bytes.len()) {
                    self.sparse.again_out = Some(self.pd.alloc_mr(bytes.len().next_power_of_two(), Access::NONE)?);
                }
                if let Some(m) = self.sparse.again_out.as_mut() {
                    m.write_at(0, &bytes);
                }
                self.sparse.again = Some(table);
                let to = RemoteAddr { addr: addr + off, rkey };
                self.post_sparse(lost, table, Staged::Again, to, ImmKind::PullReq, seq, 0, bytes.len())?;
                let heir = self.sparse.heir_of(lost);
                // (A stand-in lost meanwhile: see `Tables::lose`.)
                self.wait_until(
                    |w| w.sparse.again.is_none() || w.sparse.heir_of(lost) != heir,
                    "a stand-in to take a pull again",
                )?;
                if self.sparse.again.take().is_some() {
                    return Ok(());
                }
            }
            let t = self.sparse.table_mut(table as usize);
            let push = t.push_posts.iter().find(|p| p.0 == lost).copied();
            if let (Some((_, at, n)), Some(seq)) = (push, t.pushed_at)
                && t.credit.get(lost as usize) == Some(&false)
            {
                let heir = self.sparse.heir_of(lost).unwrap_or(lost);
                let t = self.sparse.table_mut(table as usize);
                t.sending_to(heir);
                self.post_sparse(lost, table, Staged::Push, RemoteAddr { addr, rkey }, ImmKind::Push, seq, at, n)?;
            }
            if owed {
                let t = self.sparse.table_mut(table as usize);
                t.owed.push(lost);
                let pull = t.pull_posts.iter().find(|p| p.0 == lost).copied();
                if let (Some((_, at, n)), Some(seq)) = (pull, t.pull_seq) {
                    let to = RemoteAddr { addr: addr + off, rkey };
                    self.post_sparse(lost, table, Staged::Pull, to, ImmKind::PullReq, seq, at, n)?;
                }
            }
        }
        Ok(())
    }
}
