//! What a server reports to the process's metrics (`eps_metrics::global()`),
//! labelled with its job and rank: counters as its summary counts them, and
//! what it holds, refreshed by the event loop every 100 ms.

use eps_metrics::{Counter, Gauge, Histogram};

/// A server's series.
#[derive(Clone, Debug)]
pub(crate) struct Metrics {
    pub updates: Counter,
    pub pulls: Counter,
    pub violations: Counter,
    pub moved: Counter,
    pub migrated_in: Counter,
    pub migrated_out: Counter,
    pub splits: Counter,
    /// Bytes (parameters and state) of the shards migrated away.
    pub migrated_bytes: Counter,
    /// A migration away, whole and by phase: total, setup, snapshot, and
    /// forwarding or relaying to the cutover.
    pub migration_phases: [Histogram; 4],
    pub shards: Gauge,
    pub bytes: Gauge,
}

impl Metrics {
    pub fn new(job: &str, rank: u32) -> Self {
        let r = eps_metrics::global();
        let rank = rank.to_string();
        let l: &[(&str, &str)] = &[("job", job), ("rank", &rank)];
        let dir = |d: &str| -> Counter {
            r.counter(
                "eps_server_migrations_total",
                "Shards migrated, by direction (in: received, out: handed over).",
                &[("job", job), ("rank", &rank), ("direction", d)],
            )
        };
        Metrics {
            updates: r.counter(
                "eps_server_updates_total",
                "Updates applied (a shard's sum, step and publish; sparse included).",
                l,
            ),
            pulls: r.counter("eps_server_pulls_total", "Pull answers written.", l),
            violations: r.counter(
                "eps_server_protocol_violations_total",
                "Protocol violations by workers (each closed that worker's connection).",
                l,
            ),
            moved: r.counter("eps_server_moved_total", "Requests answered \"moved\" (routed by an old shard map).", l),
            migrated_in: dir("in"),
            migrated_out: dir("out"),
            splits: r.counter("eps_server_splits_total", "Shards split here.", l),
            migrated_bytes: r.counter(
                "eps_server_migrated_bytes_total",
                "Bytes of parameters and optimizer state of the shards migrated away.",
                l,
            ),
            migration_phases: ["total", "setup", "snapshot", "cutover"].map(|p| {
                r.histogram(
                    "eps_server_migration_seconds",
                    "Shard migrations away from this server: whole, and by phase (setup, snapshot, forwarding or relaying to the cutover).",
                    &[("job", job), ("rank", &rank), ("phase", p)],
                )
            }),
            shards: r.gauge("eps_server_shards", "Dense shards held.", l),
            bytes: r.gauge("eps_server_parameter_bytes", "Bytes of the dense parameters held (f32 master copies).", l),
        }
    }
}
