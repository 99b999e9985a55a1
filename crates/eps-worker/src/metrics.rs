//! What a worker reports to the process's metrics (`eps_metrics::global()`),
//! labelled with its job and rank.

use std::time::Duration;

use eps_fabric::Fabric;
use eps_metrics::{Counter, Gauge, Histogram};

use crate::Worker;

/// A worker's series.
#[derive(Clone, Debug)]
pub(crate) struct Metrics {
    pushed: Counter,
    pulled: Counter,
    pushes: Counter,
    pulls: Counter,
    rounds: Histogram,
    pull_latency: Histogram,
    iterations: Counter,
    iteration: Gauge,
    epoch: Gauge,
}

impl Metrics {
    pub fn new(job: &str, rank: u32) -> Self {
        let r = eps_metrics::global();
        let rank = rank.to_string();
        let l: &[(&str, &str)] = &[("job", job), ("rank", &rank)];
        Metrics {
            pushed: r.counter("eps_worker_pushed_bytes_total", "Gradient bytes pushed (dense and sparse).", l),
            pulled: r.counter("eps_worker_pulled_bytes_total", "Parameter bytes pulled (dense and sparse).", l),
            pushes: r.counter("eps_worker_pushes_total", "Gradient pushes to shards (dense and sparse).", l),
            pulls: r.counter("eps_worker_pulls_total", "Parameter pulls of shards answered (dense and sparse).", l),
            pull_latency: r.histogram(
                "eps_worker_pull_seconds",
                "A pull on its own (pull_shard, the pulls of a round, an ASP read): from asking to every answer in.",
                l,
            ),
            rounds: r.histogram(
                "eps_worker_push_pull_seconds",
                "An iteration's round: from its first push to every shard's new parameters in.",
                l,
            ),
            iterations: r.counter("eps_worker_iterations_total", "Iterations whose round ended.", l),
            iteration: r.gauge("eps_worker_iteration", "The next iteration.", l),
            epoch: r.gauge("eps_worker_map_epoch", "The epoch of the shard map the worker routes by.", l),
        }
    }

    /// A pull on its own ended after `took`.
    pub fn pulled_in(&self, took: Duration) {
        self.pull_latency.observe(took);
    }

    /// A round ended after `took`; the worker is at `iteration`, `epoch`.
    pub fn round(&self, took: Duration, iteration: u64, epoch: u64) {
        self.rounds.observe(took);
        self.iterations.inc();
        self.iteration.set(iteration as f64);
        self.epoch.set(epoch as f64);
    }
}

impl<P: Fabric> Worker<P> {
    /// `n` gradient bytes pushed: its stats and its metrics.
    pub(crate) fn count_pushed(&mut self, n: u64) {
        self.stats.pushed_bytes += n;
        self.metrics.pushed.add(n);
        self.metrics.pushes.inc();
    }

    /// `n` parameter bytes pulled: its stats and its metrics.
    pub(crate) fn count_pulled(&mut self, n: u64) {
        self.stats.pulled_bytes += n;
        self.metrics.pulled.add(n);
        self.metrics.pulls.inc();
    }
}
