//! `eps soak`: a local elastic job with backups (8 workers, 4 servers,
//! `replicas = 2`, BSP; `--model ctr`: one whose embeddings are rows of a
//! sparse table) trains under a stream of faults for a few minutes (see
//! [`faults`]), then the same steps run again without faults. The verdict:
//!
//! - `errors`: faults the job did not recover from, processes that failed;
//! - `lost_updates`: parameter chunks (`shard_bytes` each) whose final bits
//!   differ from the fault-free run's. In BSP every version of a chunk
//!   depends on the one before, so one update lost or applied twice anywhere
//!   leaves its chunk different at the end; with a table, its rows' checksum
//!   must be the fault-free run's too;
//! - `rss_growth_ratio`: per role (control plane, servers, workers), the
//!   summed resident memory of their own (anonymous and shared, not the
//!   code's file pages) at the end against the same after warm-up, with as
//!   many servers; the largest;
//! - push_pull latency: each worker's whole-run p50 and p99.

mod plot;

use std::path::PathBuf;

pub use eps_cluster::soak::{self, Lat, ROLES, SOAK_SPEC, Soaked, Tick, faults};

use crate::json::Json;

/// The largest growth of resident memory that passes.
const RSS_GROWTH_LIMIT: f64 = 1.10;

/// `eps soak` flags.
#[derive(clap::Args, Debug)]
pub struct SoakArgs {
    /// Minutes of training under faults, roughly: a short calibration run
    /// sets the steps. The fault-free run of the same steps comes after.
    #[arg(long, default_value_t = 5.0)]
    pub minutes: f64,
    /// Train exactly this many steps instead (no calibration).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Mean seconds between two faults (each waits for the job to recover
    /// from the one before).
    #[arg(long, default_value_t = 4.0)]
    pub every_s: f64,
    /// Worker processes.
    #[arg(long, default_value_t = 8)]
    pub workers: u32,
    /// Server processes at the start (3 at least: a kill leaves two).
    #[arg(long, default_value_t = 4)]
    pub servers: u32,
    /// The faults to inject, comma-separated: server_kill, scale_out,
    /// scale_in, server_stall, worker_stall, control_kill (2 at most),
    /// server_cut (every data connection to a live server cut with `ss -K`:
    /// root only, skipped otherwise).
    #[arg(long, default_value = "server_kill,scale_out,scale_in,server_stall,worker_stall,control_kill,server_cut")]
    pub faults: String,
    /// Seed of the fault schedule.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// The job: `synthetic` (dense tensors) or `ctr` (click-through
    /// prediction whose embeddings are rows of a sparse table, backed up
    /// too; the table rows must end as in the fault-free run as well).
    #[arg(long, default_value = "synthetic", value_parser = ["synthetic", "ctr"])]
    pub model: String,
    /// Draw resident memory and push_pull latency over time, faults marked,
    /// into this PNG file.
    #[arg(long, value_name = "FILE.png")]
    pub plot: Option<PathBuf>,
    /// Also print one JSON object with the results as the last line of stdout.
    #[arg(long)]
    pub json: bool,
}

/// Runs `eps soak`: the checks of the flags, the run under faults, the
/// reference run, the verdict.
pub fn run(a: SoakArgs) -> Result<(), String> {
    if !(a.minutes.is_finite() && a.minutes > 0.0) {
        return Err("--minutes must be a positive number".into());
    }
    if !(a.every_s.is_finite() && a.every_s > 0.0) {
        return Err("--every-s must be a positive number of seconds".into());
    }
    if a.servers < 3 {
        return Err("--servers must be 3 at least (a server killed leaves two to hold each shard and its backup)".into());
    }
    if a.workers == 0 {
        return Err("--workers must be 1 at least".into());
    }
    let kinds = soak::fault_kinds(&a.faults)?;
    let tables = a.model == "ctr";
    let c = soak::SoakConfig { workers: a.workers, servers: a.servers, every_s: a.every_s, seed: a.seed, tables };
    let steps = match a.steps {
        Some(0) => return Err("--steps must be 1 at least".into()),
        Some(s) => s,
        None => soak::calibrated_steps(&c, a.minutes)?,
    };
    let soaked = soak::soak(&c, steps, kinds)?;
    eps_proto::say!("eps soak: the same {steps} steps without faults (the reference)");
    let reference = soak::reference(&c, steps)?;
    let report = Report::new(&a, steps, &soaked, &reference);
    report.print(&soaked);
    if let Some(path) = &a.plot {
        plot::draw(path, &soaked).map_err(|e| format!("--plot {}: {e}", path.display()))?;
        println!("plot written to {}", path.display());
    }
    if a.json {
        println!("{}", report.json(&soaked));
    }
    report.verdict()
}

/// The soak's figures.
struct Report {
    steps: u64,
    errors: Vec<String>,
    lost_updates: u64,
    chunks: u64,
    reference: soak::Reference,
    /// The table rows differ from the fault-free run's.
    rows_differ: bool,
    /// Per role (NaN: no sample to compare).
    rss_growth: [f64; 3],
    p50_us: f64,
    p99_us: f64,
}

impl Report {
    fn new(a: &SoakArgs, steps: u64, s: &Soaked, reference: &soak::Reference) -> Self {
        let (lost_updates, chunks) = differing_chunks(&s.digests, &reference.digests);
        let mut p50: Vec<f64> = s.worker_lat.iter().map(|l| l.0).collect();
        p50.sort_by(f64::total_cmp);
        let p99 = s.worker_lat.iter().map(|l| l.1).fold(f64::NAN, f64::max);
        Self {
            steps,
            errors: s.faults.errors.clone(),
            lost_updates,
            chunks,
            reference: reference.clone(),
            rows_differ: s.rows_checksum != reference.rows_checksum,
            rss_growth: rss_growth(&s.ticks, steps * 15 / 100, steps * 90 / 100, s.quiet_from, a.servers),
            p50_us: p50.get(p50.len() / 2).copied().unwrap_or(f64::NAN),
            p99_us: p99,
        }
    }

    fn rss_growth_ratio(&self) -> f64 {
        self.rss_growth.iter().copied().filter(|x| x.is_finite()).fold(f64::NAN, f64::max)
    }

    fn recoveries(s: &Soaked) -> u64 {
        s.faults.faults.iter().filter(|f| f.recovered_s.is_some()).count() as u64
    }

    fn print(&self, s: &Soaked) {
        let f = &s.faults.faults;
        println!("eps soak: {} steps in {:.0} s, {:.0} samples/s", self.steps, s.seconds, s.samples_per_s);
        let kinds: Vec<String> =
            faults::Kind::ALL.iter().map(|k| format!("{} {}", f.iter().filter(|x| x.kind == *k).count(), k.name())).collect();
        println!("  faults injected: {} ({})", f.len(), kinds.join(", "));
        let worst = f.iter().filter_map(|x| x.recovered_s).fold(0.0, f64::max);
        println!("  recoveries:      {} (slowest {worst:.1} s)", Self::recoveries(s));
        println!("  errors:          {}", self.errors.len());
        for e in &self.errors {
            println!("    {e}");
        }
        println!(
            "  lost updates:    {} of {} parameter chunks differ from the fault-free run ({} vs {})",
            self.lost_updates, self.chunks, s.checksum, self.reference.checksum
        );
        if !self.reference.rows_checksum.is_empty() {
            let same = if self.rows_differ { "differ from" } else { "the same as" };
            println!("  table rows:      {same} the fault-free run's ({} vs {})", s.rows_checksum, self.reference.rows_checksum);
        }
        let g: Vec<String> = ROLES.iter().zip(self.rss_growth).map(|(r, x)| format!("{r} {x:.3}")).collect();
        println!("  RSS growth:      {:.3} (after warm-up to the end: {})", self.rss_growth_ratio(), g.join(", "));
        println!("  push_pull:       p50 {:.0} us (median worker), p99 {:.0} us (worst worker)", self.p50_us, self.p99_us);
    }

    fn json(&self, s: &Soaked) -> String {
        let f = &s.faults.faults;
        let mut kinds = Json::new();
        for k in faults::Kind::ALL {
            kinds = kinds.int(k.name(), f.iter().filter(|x| x.kind == k).count() as u64);
        }
        let mut growth = Json::new();
        for (r, x) in ROLES.iter().zip(self.rss_growth) {
            growth = growth.num(r, x);
        }
        Json::new()
            .int("steps", self.steps)
            .num("seconds", s.seconds)
            .int("errors", self.errors.len() as u64)
            .int("faults_injected", f.len() as u64)
            .raw("faults", &kinds.finish())
            .int("recoveries", Self::recoveries(s))
            .num("recovery_s_max", f.iter().filter_map(|x| x.recovered_s).fold(0.0, f64::max))
            .int("lost_updates", self.lost_updates)
            .int("chunks", self.chunks)
            .str("params_checksum", &s.checksum)
            .str("reference_checksum", &self.reference.checksum)
            .str("sparse_checksum", &s.rows_checksum)
            .str("reference_sparse_checksum", &self.reference.rows_checksum)
            .num("rss_growth_ratio", self.rss_growth_ratio())
            .raw("rss_growth", &growth.finish())
            .num("push_pull_p50_us", self.p50_us)
            .num("push_pull_p99_us", self.p99_us)
            .num("samples_per_s", s.samples_per_s)
            .finish()
    }

    fn verdict(&self) -> Result<(), String> {
        let mut bad = Vec::new();
        if !self.errors.is_empty() {
            bad.push(format!("{} errors", self.errors.len()));
        }
        if self.lost_updates > 0 {
            bad.push(format!("{} lost updates", self.lost_updates));
        }
        if self.rows_differ {
            bad.push("the table rows differ from the fault-free run's".into());
        }
        let g = self.rss_growth_ratio();
        if !g.is_finite() {
            bad.push("no resident-memory samples to compare (a longer soak has them)".into());
        } else if g > RSS_GROWTH_LIMIT {
            bad.push(format!("resident memory grew {g:.3}x (the limit is {RSS_GROWTH_LIMIT})"));
        }
        if bad.is_empty() { Ok(()) } else { Err(format!("the soak failed: {}", bad.join(", "))) }
    }
}

/// Of two runs' comma-separated chunk digests: how many differ (all of them
/// when the run under faults reported none), and how many there are.
fn differing_chunks(soaked: &str, reference: &str) -> (u64, u64) {
    let (mine, theirs): (Vec<&str>, Vec<&str>) = (soaked.split(',').collect(), reference.split(',').collect());
    let chunks = theirs.len() as u64;
    if mine.len() != theirs.len() {
        return (chunks, chunks);
    }
    (mine.iter().zip(&theirs).filter(|(x, y)| x != y).count() as u64, chunks)
}

/// Per role: the median summed RSS of the samples after `quiet_from` (no
/// more faults) from step `end_from` on, over the median of those between
/// 60% of the warm-up (`warm` steps) and its end (the first sample after that
/// window's start when none fell in it); only samples with `servers` servers
/// count. When faults ran into the last samples (a short soak), the samples
/// from step `end_from` on stand for the end.
fn rss_growth(ticks: &[Tick], warm: u64, end_from: u64, quiet_from: f64, servers: u32) -> [f64; 3] {
    let median = |mut v: Vec<u64>| {
        v.sort_unstable();
        v.get(v.len() / 2).map(|&x| x as f64)
    };
    let ok = |t: &&Tick| t.procs[1] == servers;
    let mut before: Vec<&Tick> = ticks.iter().filter(ok).filter(|t| t.step >= warm * 6 / 10 && t.step < warm).collect();
    if before.is_empty() {
        // No sample in the window (it went by between two ticks, or a fault
        // held it): the first one after its start.
        before = ticks.iter().filter(ok).filter(|t| t.step >= warm * 6 / 10).min_by_key(|t| t.step).into_iter().collect();
    }
    let mut after: Vec<&Tick> = ticks.iter().filter(ok).filter(|t| t.t >= quiet_from && t.step >= end_from).collect();
    if after.is_empty() {
        after = ticks.iter().filter(ok).filter(|t| t.step >= end_from).collect();
    }
    let mut g = [f64::NAN; 3];
    for (r, x) in g.iter_mut().enumerate() {
        if let (Some(b), Some(e)) =
            (median(before.iter().map(|t| t.rss[r]).collect()), median(after.iter().map(|t| t.rss[r]).collect()))
        {
            *x = e / b.max(1.0);
        }
    }
    g
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_that_differ_count_as_lost_updates() {
        assert_eq!(differing_chunks("aa,bb,cc", "aa,bb,cc"), (0, 3));
        assert_eq!(differing_chunks("aa,bx,cc", "aa,bb,cc"), (1, 3));
        assert_eq!(differing_chunks("", "aa,bb,cc"), (3, 3), "no digests from the soak: every chunk counts");
    }

    #[test]
    fn rss_growth_compares_the_ends_with_as_many_servers() {
        let tick =
            |t: f64, step: u64, server: u64, servers: u32| Tick { t, step, rss: [10, server, 100], procs: [1, servers, 8] };
        let ticks = vec![
            tick(0.0, 5, 40, 4),
            tick(1.0, 10, 40, 4),
            tick(2.0, 40, 90, 5), // a fault: not compared
            tick(3.0, 90, 44, 4), // before the faults ended
            tick(4.0, 95, 44, 4),
            tick(5.0, 99, 400, 3), // other server count
        ];
        let g = rss_growth(&ticks, 15, 90, 3.5, 4);
        assert_eq!(g, [1.0, 1.1, 1.0]);
        // Faults until the end: the samples from step 90 on stand for it.
        assert_eq!(rss_growth(&ticks, 15, 90, 10.0, 4), [1.0, 1.1, 1.0]);
        let none = rss_growth(&ticks, 15, 100, 3.5, 4);
        assert!(none.iter().all(|x| x.is_nan()), "no sample at the end: {none:?}");
        // No sample in the warm-up's window (steps 30..50 went by between
        // ticks): the first one after its start stands for it.
        let sparse = vec![tick(0.0, 5, 40, 4), tick(1.0, 60, 50, 4), tick(4.0, 95, 55, 4)];
        assert_eq!(rss_growth(&sparse, 50, 90, 3.5, 4), [1.0, 1.1, 1.0]);
    }
}
