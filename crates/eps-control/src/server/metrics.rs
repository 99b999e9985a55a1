//! What the control plane reports to the process's metrics
//! (`eps_metrics::global()`), labelled with its job: the job's figures,
//! refreshed every tick of the service loop.

use eps_metrics::Gauge;

use crate::job::{Figures, SERVER_STATES};

/// The control plane's series.
#[derive(Clone, Debug)]
pub(super) struct Metrics {
    epoch: Gauge,
    iteration: Gauge,
    slowest: Gauge,
    workers: Gauge,
    changes: Gauge,
    servers: Vec<Gauge>,
    in_flight: Gauge,
    done: Gauge,
    splits: Gauge,
    bytes: Gauge,
    leader: Gauge,
}

impl Metrics {
    pub fn new(job: &str) -> Self {
        let r = eps_metrics::global();
        let l: &[(&str, &str)] = &[("job", job)];
        Metrics {
            epoch: r.gauge("eps_control_map_epoch", "The shard map's epoch.", l),
            iteration: r.gauge("eps_control_iteration", "The furthest training worker's iteration.", l),
            slowest: r.gauge("eps_control_slowest_iteration", "The slowest training worker's iteration.", l),
            workers: r.gauge("eps_control_workers", "Workers contributing now.", l),
            changes: r.gauge("eps_control_membership_changes", "Worker membership changes committed.", l),
            servers: SERVER_STATES
                .iter()
                .map(|s| r.gauge("eps_control_servers", "Servers by state.", &[("job", job), ("state", s)]))
                .collect(),
            in_flight: r.gauge("eps_control_migrations_in_flight", "Shard migrations in flight.", l),
            done: r.gauge("eps_control_migrations_done", "Shard migrations done (whole-shard moves included).", l),
            splits: r.gauge("eps_control_splits_done", "Shard splits done.", l),
            bytes: r.gauge("eps_control_parameter_bytes", "Parameter bytes placed on servers.", l),
            leader: r.gauge("eps_control_leader", "1 while this control plane serves the job.", l),
        }
    }

    /// Sets every series from `f`.
    pub fn publish(&self, f: &Figures) {
        self.epoch.set(f.epoch as f64);
        self.iteration.set(f.iteration as f64);
        self.slowest.set(f.slowest as f64);
        self.workers.set(f.workers as f64);
        self.changes.set(f.membership_changes as f64);
        for (g, n) in self.servers.iter().zip(f.servers) {
            g.set(n as f64);
        }
        self.in_flight.set(f.migrations_in_flight as f64);
        self.done.set(f.migrations_done as f64);
        self.splits.set(f.splits as f64);
        self.bytes.set(f.bytes as f64);
        self.leader.set(1.0);
    }
}
