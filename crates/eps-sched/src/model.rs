//! The cluster model: how fast a job trains with W workers and S servers, and
//! what a rescale costs. Its constants come from measurements of real EPS
//! processes (`eps sched calibrate`); the defaults are `bench/cluster.toml`'s,
//! measured on a 2-core machine over loopback (medians of three runs).

use serde::Deserialize;

use crate::trace::JobSpec;

/// Constants of the cluster model (`cluster.toml`).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterModel {
    /// Bytes per second one server moves in each direction (pushes in, pulls out).
    #[serde(default = "d_server_bw")]
    pub server_bytes_per_s: f64,
    /// Bytes per second one worker moves in each direction.
    #[serde(default = "d_worker_bw")]
    pub worker_bytes_per_s: f64,
    /// f32 elements per second one server sums and steps.
    #[serde(default = "d_agg")]
    pub agg_elements_per_s: f64,
    /// Fixed cost of an iteration (round trips, scheduling), seconds.
    #[serde(default = "d_overhead")]
    pub iteration_overhead_s: f64,
    /// What each worker beyond the first adds to a BSP iteration, seconds: an
    /// iteration waits for the slowest of its workers.
    #[serde(default = "d_worker_overhead")]
    pub worker_overhead_s: f64,
    /// Bytes per second a shard migration moves.
    #[serde(default = "d_mig")]
    pub migration_bytes_per_s: f64,
    /// The pause every rescale costs a job (membership vote, new epoch), seconds.
    #[serde(default = "d_pause")]
    pub rescale_pause_s: f64,
    /// Seconds from a job's start to its first iteration (processes started,
    /// registration), before its workers pull the parameters.
    #[serde(default = "d_start")]
    pub start_pause_s: f64,
    /// The cluster's network between nodes (`[cluster]`).
    #[serde(default)]
    pub cluster: Network,
}

/// The network between nodes (`[cluster]` of the model file).
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Network {
    /// Gigabytes per second a node sends (and receives) to the others: a job
    /// whose workers and servers are on different nodes moves the bytes
    /// between them through it, shared by the node's processes. Without it
    /// nodes cost nothing (one machine, or a network as fast as the
    /// processes).
    pub node_bandwidth_gbytes_per_s: Option<f64>,
}

fn d_server_bw() -> f64 {
    1.615e9
}
fn d_worker_bw() -> f64 {
    1.615e9
}
fn d_agg() -> f64 {
    2.196e9
}
fn d_overhead() -> f64 {
    0.001623
}
fn d_worker_overhead() -> f64 {
    0.000875
}
fn d_mig() -> f64 {
    9.77e8
}
fn d_pause() -> f64 {
    0.0054
}
fn d_start() -> f64 {
    0.0510
}

impl Default for ClusterModel {
    fn default() -> Self {
        toml::from_str("").expect("every field has a default")
    }
}

/// A job's allocation: workers and servers (one slot each).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Alloc {
    /// Workers.
    pub workers: u32,
    /// Servers.
    pub servers: u32,
}

impl Alloc {
    /// Slots taken.
    pub fn slots(self) -> u32 {
        self.workers + self.servers
    }
}

impl ClusterModel {
    /// Parses `cluster.toml`; every field has a default.
    pub fn from_toml(text: &str) -> Result<Self, String> {
        let m: ClusterModel = toml::from_str(text).map_err(|e| e.to_string().trim().replace('\n', " "))?;
        let fields = [
            ("server_bytes_per_s", m.server_bytes_per_s),
            ("worker_bytes_per_s", m.worker_bytes_per_s),
            ("agg_elements_per_s", m.agg_elements_per_s),
            ("migration_bytes_per_s", m.migration_bytes_per_s),
        ];
        if let Some((f, _)) = fields.iter().find(|(_, v)| !(v.is_finite() && *v > 0.0)) {
            return Err(format!("`{f}` must be a positive number"));
        }
        if !(m.iteration_overhead_s >= 0.0 && m.worker_overhead_s >= 0.0 && m.rescale_pause_s >= 0.0 && m.start_pause_s >= 0.0) {
            return Err(
                "`iteration_overhead_s`, `worker_overhead_s`, `rescale_pause_s` and `start_pause_s` must not be negative".into(),
            );
        }
        if m.cluster.node_bandwidth_gbytes_per_s.is_some_and(|b| !(b.is_finite() && b > 0.0)) {
            return Err("`[cluster] node_bandwidth_gbytes_per_s` must be a positive number".into());
        }
        Ok(m)
    }

    /// Seconds per BSP iteration of `job` on `a`, spread over nodes as
    /// `per_node` says (workers and servers per node): as
    /// [`ClusterModel::iteration_s`], with the transfers no faster than the
    /// busiest node's share of the bytes between nodes allows. Every worker
    /// pushes `1/S` of the parameters to each server and pulls as much back,
    /// so a node with `w` of the `W` workers and `s` of the `S` servers
    /// sends `P/S * (w * (S - s) + s * (W - w))` bytes to the others (and
    /// receives as many).
    pub fn iteration_on_nodes_s(&self, job: &JobSpec, a: Alloc, per_node: &[Alloc]) -> f64 {
        let base = self.iteration_s(job, a);
        let Some(gbps) = self.cluster.node_bandwidth_gbytes_per_s else { return base };
        let (w, s) = (f64::from(a.workers.max(1)), f64::from(a.servers.max(1)));
        let per = job.param_bytes as f64 / s;
        let busiest = per_node
            .iter()
            .map(|n| {
                per * (f64::from(n.workers) * (s - f64::from(n.servers)) + f64::from(n.servers) * (w - f64::from(n.workers)))
            })
            .fold(0.0f64, f64::max);
        let cross = busiest / (gbps * 1e9);
        let transfer = self.transfer_s(job, a);
        if cross <= transfer { base } else { base - transfer + cross }
    }

    /// Samples per second of `job` on `a` spread over nodes as `per_node`.
    pub fn throughput_on_nodes(&self, job: &JobSpec, a: Alloc, per_node: &[Alloc]) -> f64 {
        if a.workers == 0 || a.servers == 0 {
            return 0.0;
        }
        f64::from(a.workers) * f64::from(job.batch) / self.iteration_on_nodes_s(job, a, per_node)
    }

    /// The slower of the workers' and the servers' transfers of an iteration.
    fn transfer_s(&self, job: &JobSpec, a: Alloc) -> f64 {
        let w = f64::from(a.workers.max(1));
        let s = f64::from(a.servers.max(1));
        let p = job.param_bytes as f64;
        (p / self.worker_bytes_per_s).max(p * w / (s * self.server_bytes_per_s))
    }

    /// Seconds per BSP iteration of `job` on `a` (compute, then the slower of
    /// the workers' and the servers' transfers, aggregation, the fixed cost).
    pub fn iteration_s(&self, job: &JobSpec, a: Alloc) -> f64 {
        let w = f64::from(a.workers.max(1));
        let s = f64::from(a.servers.max(1));
        let p = job.param_bytes as f64;
        let compute = job.compute_ms_per_sample * 1e-3 * f64::from(job.batch);
        let agg = (p / 4.0) * w / (s * self.agg_elements_per_s);
        compute + self.transfer_s(job, a) + agg + self.iteration_overhead_s + self.worker_overhead_s * (w - 1.0)
    }

    /// Samples per second of `job` on `a` (0 without a worker or a server).
    pub fn throughput(&self, job: &JobSpec, a: Alloc) -> f64 {
        if a.workers == 0 || a.servers == 0 {
            return 0.0;
        }
        f64::from(a.workers) * f64::from(job.batch) / self.iteration_s(job, a)
    }

    /// Seconds from a job's start to its first iteration: its processes
    /// start, then its workers pull the parameters.
    pub fn start_s(&self, job: &JobSpec) -> f64 {
        self.start_pause_s + job.param_bytes as f64 / self.worker_bytes_per_s
    }

    /// Seconds a job pauses to go from `from` to `to`: the vote's pause, the
    /// parameters a joining worker pulls, the bytes servers hand over.
    pub fn rescale_s(&self, job: &JobSpec, from: Alloc, to: Alloc) -> f64 {
        if from == to {
            return 0.0;
        }
        let p = job.param_bytes as f64;
        let moved = if from.servers == to.servers {
            0.0
        } else {
            p * f64::from(from.servers.abs_diff(to.servers)) / f64::from(from.servers.max(to.servers).max(1))
        };
        let join = if to.workers > from.workers { p / self.worker_bytes_per_s } else { 0.0 };
        self.rescale_pause_s + moved / self.migration_bytes_per_s + join
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job() -> JobSpec {
        JobSpec::test("j", 0.0, 100_000_000, 2.0, 32, 100_000, 10_000, false, (1, 8), (1, 4))
    }

    #[test]
    fn more_workers_train_faster_until_the_servers_saturate() {
        let m = ClusterModel::default();
        let j = job();
        let tp = |w, s| m.throughput(&j, Alloc { workers: w, servers: s });
        assert!(tp(2, 1) > tp(1, 1));
        assert!(tp(4, 2) > tp(4, 1), "servers relieve the bottleneck");
        // Diminishing returns: the 8th worker adds less than the 2nd.
        assert!(tp(8, 1) - tp(7, 1) < tp(2, 1) - tp(1, 1));
        assert_eq!(tp(0, 1), 0.0);
        assert!(m.rescale_s(&j, Alloc { workers: 2, servers: 1 }, Alloc { workers: 2, servers: 2 }) > m.rescale_pause_s);
        assert_eq!(m.rescale_s(&j, Alloc { workers: 2, servers: 1 }, Alloc { workers: 2, servers: 1 }), 0.0);
    }

    #[test]
    fn a_job_spread_over_nodes_is_no_faster_than_its_busiest_node_allows() {
        let j = job();
        let a = Alloc { workers: 4, servers: 2 };
        let together = [a, Alloc::default()];
        let spread = [Alloc { workers: 4, servers: 0 }, Alloc { workers: 0, servers: 2 }];
        let m = ClusterModel::default();
        assert_eq!(m.throughput_on_nodes(&j, a, &spread), m.throughput(&j, a), "no network given: nodes cost nothing");
        let m = ClusterModel::from_toml("[cluster]\nnode_bandwidth_gbytes_per_s = 0.5\n").unwrap();
        assert_eq!(m.throughput_on_nodes(&j, a, &together), m.throughput(&j, a), "on one node");
        // Spread: every push and pull crosses; the node of the 4 workers sends
        // 4 x 100 MB an iteration through 0.5 GB/s (0.8 s).
        let slow = m.iteration_on_nodes_s(&j, a, &spread);
        assert!((slow - m.iteration_s(&j, a) - (0.8 - m.transfer_s(&j, a))).abs() < 1e-9, "{slow}");
        let half = [Alloc { workers: 2, servers: 1 }, Alloc { workers: 2, servers: 1 }];
        assert!(m.iteration_on_nodes_s(&j, a, &half) < slow, "half the bytes cross when each node has half of both");
        let fast = ClusterModel::from_toml("[cluster]\nnode_bandwidth_gbytes_per_s = 1000.0\n").unwrap();
        assert_eq!(fast.throughput_on_nodes(&j, a, &spread), fast.throughput(&j, a), "a fast network costs nothing");
        assert!(
            ClusterModel::from_toml("[cluster]\nnode_bandwidth_gbytes_per_s = 0.0\n").unwrap_err().contains("node_bandwidth")
        );
    }

    #[test]
    fn bad_models_are_refused_naming_the_field() {
        assert!(ClusterModel::from_toml("server_bytes_per_s = -1.0").unwrap_err().contains("server_bytes_per_s"));
        assert!(ClusterModel::from_toml("bandwidth = 1.0").unwrap_err().contains("bandwidth"));
        assert_eq!(ClusterModel::from_toml("").unwrap(), ClusterModel::default());
    }
}
