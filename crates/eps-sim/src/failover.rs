//! The control plane crashes and a standby takes over: it replays the store
//! (every record the leader persisted, as `eps control` persists them: each
//! request that changed the job, the workers' reports of newer epochs, lost
//! servers, expired leases) into a fresh `Job` and serves from there. The
//! replayed job must be the one that crashed: the same map, epoch, orders and
//! status; a difference is a state change the store does not hold, and the
//! run fails.

use eps_control::job::Job;
use eps_proto::JobSpec;
use eps_proto::control::{ControlMsg, Refusal};

use crate::World;

/// What the control plane keeps in its store.
#[derive(Clone, Debug, Default)]
pub(crate) struct Store {
    /// The spec the job was made from.
    pub(crate) spec_text: String,
    /// The records after it, in order.
    pub(crate) records: Vec<ControlMsg>,
}

impl World {
    /// Applies `m` to the job as the control plane applies a request, and
    /// keeps it in the store if it changed the job.
    pub(crate) fn apply_recorded(&mut self, m: &ControlMsg) -> Result<ControlMsg, Refusal> {
        let r = self.job.apply(m);
        if r.is_ok() {
            self.store.records.push(m.clone());
        }
        r
    }

    /// A worker's map request reports the epoch it routes with.
    pub(crate) fn adopted(&mut self, rank: u32, epoch: u64) {
        if let Some(record) = self.job.adopt(rank, epoch) {
            self.store.records.push(record);
        }
        self.after_ctl();
    }

    /// The control plane crashes; a standby replays the store and leads.
    pub(crate) fn fail_over(&mut self) {
        let replayed = JobSpec::from_toml(&self.store.spec_text)
            .map_err(|e| e.to_string())
            .and_then(|spec| Job::new(&spec, &self.store.spec_text));
        let mut job = match replayed {
            Ok(job) => job,
            Err(e) => return self.fail(format!("control failover: the stored spec does not make a job: {e}")),
        };
        for (i, m) in self.store.records.iter().enumerate() {
            if let Err(e) = job.apply(m) {
                return self.fail(format!("control failover: record {i} ({m:?}) does not replay: {e}"));
            }
        }
        if let Some(what) = differs(&self.job, &job, &self.orders_after) {
            return self.fail(format!(
                "control failover: the standby's job, replayed from {} records, is not the one that crashed: {what}",
                self.store.records.len()
            ));
        }
        self.note(format!("control plane crashed; a standby replayed {} records and leads", self.store.records.len()));
        self.report.control_failovers += 1;
        self.job = job;
        self.after_ctl();
    }
}

/// How the replayed job `b` differs from the one that crashed, `a`, as its
/// clients see it (servers that carried out the orders up to `after`).
fn differs(a: &Job, b: &Job, after: &[u64]) -> Option<String> {
    if a.job_map() != b.job_map() {
        return Some(format!("map {:?}, replayed {:?}", a.job_map(), b.job_map()));
    }
    if a.orders_issued() != b.orders_issued() {
        return Some(format!("{} orders issued, replayed {}", a.orders_issued(), b.orders_issued()));
    }
    for (r, &after) in after.iter().enumerate() {
        let (x, y) = (a.orders_for(r as u32, after), b.orders_for(r as u32, after));
        if x != y {
            return Some(format!("server {r}'s orders after {after}: {x:?}, replayed {y:?}"));
        }
    }
    let checks = [
        ("status", a.status(), b.status()),
        ("leased workers", format!("{:?}", a.leased_workers()), format!("{:?}", b.leased_workers())),
        ("awaited workers", format!("{:?}", a.awaited_workers()), format!("{:?}", b.awaited_workers())),
        ("lost servers", format!("{:?}", a.lost_servers()), format!("{:?}", b.lost_servers())),
        ("migrations", format!("{:?}", a.migrations()), format!("{:?}", b.migrations())),
    ];
    checks.into_iter().find(|(_, x, y)| x != y).map(|(what, x, y)| format!("{what}: {x}, replayed {y}"))
}
