//! Checkpoints and the roll-back after a server crash in a job without
//! replicas, as `eps-server` saves and `eps train` rolls back: every shard is
//! saved when it applies a version that is a multiple of the checkpoint
//! interval (owners, migration targets and backups alike); a checkpoint is
//! complete once its pieces cover every unit. A crash throws every process
//! away; the job starts again from the newest complete checkpoint on one
//! server fewer, with the spec's workers, under a control plane resumed from
//! it. Iterations from the checkpoint on are trained again, so the reference
//! forgets what the lost run did from there.

use std::collections::BTreeMap;

use eps_control::job::Job;
use eps_proto::JobSpec;
use eps_proto::spec::ResumeSection;

use crate::net::{Msg, Net, Node};
use crate::{TICK, World};

/// The checkpoints of a run.
#[derive(Debug, Default)]
pub(crate) struct Checkpoints {
    /// Every `every` versions (0: none).
    every: u64,
    /// Pieces saved, by version: unit -> value.
    saved: BTreeMap<u64, BTreeMap<usize, u64>>,
    /// The newest complete one: (version, value per unit, contributor sets
    /// before it, as its manifest records them).
    complete: Option<(u64, Vec<u64>, String)>,
}

impl Checkpoints {
    /// Every `every` versions (0: none).
    pub(crate) fn every(every: u64) -> Self {
        Self { every, ..Self::default() }
    }
}

impl World {
    /// Server `server` applied version `v` of `shard` (units from `first`):
    /// saved if a checkpoint is due. Pieces of one version must agree.
    pub(crate) fn save_if_due(&mut self, server: u32, shard: u32, first: usize, v: u64, value: &[u64]) {
        let every = self.ckpt.every;
        if every == 0 || v == 0 || v % every != 0 {
            return;
        }
        let pieces = self.ckpt.saved.entry(v).or_default();
        for (u, &x) in (first..).zip(value) {
            match pieces.insert(u, x) {
                Some(y) if y != x => {
                    return self.fail(format!(
                        "server {server} saved unit {u} (shard {shard}) at version {v} as {x:x}, another piece holds {y:x}"
                    ));
                }
                _ => {}
            }
        }
        if pieces.len() == self.units && self.ckpt.complete.as_ref().is_none_or(|c| c.0 < v) {
            let values = pieces.values().copied().collect();
            let membership = self.job.checkpoint_record(v).membership;
            self.note(format!("checkpoint at version {v} complete"));
            self.ckpt.complete = Some((v, values, membership));
        }
    }

    /// Every piece saved holds the value published for its version: a
    /// checkpoint never records an update that was not served.
    pub(crate) fn check_pieces(&mut self) {
        let mut bad = None;
        for (&v, pieces) in &self.ckpt.saved {
            for (&u, &x) in pieces {
                if let Some(&y) = self.published.get(&(u, v))
                    && y != x
                {
                    bad = Some(format!("the checkpoint at version {v} holds unit {u} as {x:x}, version {v} was served as {y:x}"));
                }
            }
        }
        if let Some(b) = bad {
            self.fail(b);
        }
    }

    /// A server of a job without replicas crashes: the job rolls back to its
    /// newest complete checkpoint (if it has one, at most twice a run).
    pub(crate) fn try_crash_and_roll_back(&mut self) {
        let Some((at, values, membership)) = self.ckpt.complete.clone() else { return };
        let live: Vec<u32> = self.job.job_map().servers.iter().map(|(r, _)| *r).collect();
        if live.is_empty() || self.report.rollbacks >= 2 || at >= self.steps || self.job.migrations_in_flight() > 0 {
            return;
        }
        let victim = live[self.rng.range(0, live.len() as u64 - 1) as usize];
        self.check_pieces();
        let servers = (live.len() as u32).saturating_sub(1).max(1);
        let reached = self.workers.values().flatten().map(|w| w.t).max().unwrap_or(0);
        self.note(format!(
            "server {victim} crashed: rolling back from iteration {reached} to the checkpoint at {at} on {servers} servers"
        ));
        self.report.server_crashes += 1;
        self.report.rollbacks += 1;
        // What the lost run did from the checkpoint on is done again.
        self.published.retain(|&(_, v), _| v <= at);
        self.accepted.retain(|&(_, _, t)| t < at);
        // A worker removed after the checkpoint: its pushes before it count
        // where they landed (as the checkpoint holds them), none after it.
        self.lost = std::mem::take(&mut self.lost).into_iter().map(|(r, first)| (r, first.min(at))).collect();
        self.ckpt.saved.retain(|&v, _| v <= at);
        let r = ResumeSection { from: "sim".into(), iteration: at, membership };
        let text = match JobSpec::set_resume(&self.spec_text(servers), Some(&r)) {
            Ok(t) => t,
            Err(e) => return self.fail(format!("resumed spec: {e}")),
        };
        let made = JobSpec::from_toml(&text).map_err(|e| e.to_string()).and_then(|spec| {
            let layout = spec.layout().map_err(|e| e.to_string())?;
            Ok((Job::new(&spec, &text)?, layout))
        });
        let (job, layout) = match made {
            Ok(x) => x,
            Err(e) => return self.fail(format!("resuming at {at}: {e}")),
        };
        // Every process of the lost run is gone, and what it had in flight.
        let now = self.net.now;
        self.net = Net::new(self.net.max_delay);
        self.net.now = now;
        self.job = job;
        // (A new job, from the resumed spec: a new store.)
        self.store = crate::failover::Store { spec_text: text, records: Vec::new() };
        self.first = at;
        self.servers.clear();
        self.down.clear();
        self.orders_after.clear();
        self.workers.clear();
        self.watching.clear();
        self.seen.clear();
        self.epoch_sent = 0;
        for s in 0..servers {
            let mine: Vec<(u32, u64, u64)> = layout.shards_of(s).map(|s| (s.id, s.start, s.len)).collect();
            self.start_server_at(at, &values, &mine, &[]);
        }
        for _ in 0..self.workers0 {
            self.start_worker();
        }
        // (The scale plan's next event is sent by the caller.)
        self.net.send_after(Node::Ctl, Node::Ctl, Msg::Tick, TICK);
    }
}
