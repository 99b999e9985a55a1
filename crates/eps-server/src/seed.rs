//! The first parameters from worker 0 (`model.init = "worker"`).
//!
//! A shard that takes a seed starts unpublished: pull requests wait (kept in
//! `Held::seed`), moves and splits wait, and a push is a violation (no honest
//! worker pushes before its first pull). Worker 0 writes its initial values of
//! the shard into its landing slot with a `Forward` immediate (the kind a
//! worker sends for nothing else), before it asks for its own first pull on
//! the same connection; the server copies them into the master copy, publishes
//! version 0, and answers the pulls that waited.

use eps_fabric::prelude::*;
use eps_proto::hello::Hello;

use crate::{Server, ServerError};

/// A pull request that came before the seed: its connection, its worker and
/// the low bits of the version it asked for.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PullAsked {
    pub(crate) ci: usize,
    pub(crate) hello: Hello,
    pub(crate) seq: u16,
}

/// The rank whose initial values seed the job.
pub(crate) const SEEDER: u32 = 0;

impl<P: Fabric> Server<P> {
    /// Whether shard `id` still waits for its seed.
    pub(crate) fn awaiting_seed(&self, id: u32) -> bool {
        self.shards.get(id as usize).and_then(Option::as_ref).is_some_and(|h| h.seed.is_some())
    }

    /// A pull request for shard `id` while it waits for its seed: kept.
    /// Returns false when the shard does not wait (answer it as usual).
    pub(crate) fn keep_pull_for_seed(&mut self, ci: usize, hello: Hello, id: u32, seq: u16) -> bool {
        match self.held_mut(id).and_then(|h| h.seed.as_mut()) {
            Some(asked) => {
                asked.push(PullAsked { ci, hello, seq });
                true
            }
            None => false,
        }
    }

    /// Worker 0 was removed before every shard here had its values: those
    /// still waiting start from the servers' initialiser (published at start).
    pub(crate) fn seeder_gone(&mut self) -> Result<(), ServerError> {
        let waiting: Vec<u32> = (0..self.shards.len() as u32).filter(|&id| self.awaiting_seed(id)).collect();
        if waiting.is_empty() {
            return Ok(());
        }
        eps_proto::say!(
            "eps server {}: worker {SEEDER} was removed before its initial values of shards {waiting:?} came; they start from the servers' initialiser",
            self.rank
        );
        for id in waiting {
            let asked = self.held_mut(id).and_then(|h| h.seed.take()).unwrap_or_default();
            self.seeded_now(id, asked)?;
        }
        Ok(())
    }

    /// Shard `id` has its first values: the pulls that waited are answered,
    /// and a move or split ordered meanwhile goes ahead.
    fn seeded_now(&mut self, id: u32, asked: Vec<PullAsked>) -> Result<(), ServerError> {
        for p in asked {
            if self.conns[p.ci].alive {
                self.pull_asked(p.ci, p.hello, id, p.seq)?;
            }
        }
        self.start_parked_moves(id)?;
        self.try_split(id)
    }

    /// Worker `h` wrote `len` bytes of initial values of shard `id`.
    pub(crate) fn on_seed(&mut self, ci: usize, h: Hello, id: u32, len: u32) -> Result<(), ServerError> {
        let Some(asked) = self.held_mut(id).and_then(|held| held.seed.take()) else {
            self.violation(ci, &format!("sent initial values of shard {id}, which takes none (model.init, or seeded already)"));
            return Ok(());
        };
        let want = self.mem.get(id).map_or(0, |b| b.bytes);
        let why = if h.rank != SEEDER {
            Some(format!("sent initial values of shard {id}; only rank {SEEDER} seeds a job"))
        } else if len != 0 && len as usize != want {
            Some(format!("sent {len} bytes of initial values of shard {id} (expected {want})"))
        } else {
            None
        };
        if let Some(why) = why {
            if let Some(held) = self.held_mut(id) {
                held.seed = Some(asked);
            }
            self.violation(ci, &why);
            return Ok(());
        }
        // (Zero bytes: the worker had no values; the servers' initialiser's
        // stand, published at start.)
        if len > 0 {
            self.mem.seed(id, h.rank, eps_proto::sync::ShardSync::parity(0))?;
            self.seeded.0 += 1;
        } else {
            self.seeded.1 += 1;
        }
        if !self.shards.iter().flatten().any(|s| s.seed.is_some()) {
            let what = match self.seeded {
                (n, 0) => format!("its {n} shards start from worker {SEEDER}'s initial values"),
                (0, n) => format!("worker {SEEDER} gave no initial values: its {n} shards start from the servers' initialiser"),
                (n, k) => format!(
                    "{n} shards start from worker {SEEDER}'s initial values, {k} (given none) from the servers' initialiser"
                ),
            };
            eps_proto::say!("eps server {}: {what} (model.init = \"worker\")", self.rank);
        }
        self.seeded_now(id, asked)
    }
}
