//! `eps bench replicas`: what a backup of every shard costs. Runs the same
//! job with `replicas = 1` and `replicas = 2`, alternating, and reports the
//! median training throughput of each, their ratio, and the CPU time the
//! whole cluster (control plane, servers, workers) spent per sample: on a
//! machine whose cores the job keeps busy, the throughput ratio follows the
//! CPU ratio, and the CPU a backup adds (its own optimizer step on every
//! forward, the forward's copies) is what limits it.

use std::path::PathBuf;

use crate::bench::Json;
use crate::train::cluster::soft_args;
use crate::train::{Overrides, build_spec_or, default_spec};

/// What to run.
#[derive(clap::Args, Debug)]
pub struct ReplicasArgs {
    /// Job spec (TOML); default: `eps train`'s built-in job of `--model`.
    #[arg(long)]
    spec: Option<PathBuf>,
    /// The built-in job without `--spec`: synthetic, or ctr (its sparse
    /// table's rows are backed up too).
    #[arg(long, default_value = "synthetic")]
    model: String,
    /// Runs of each (alternating); medians are reported.
    #[arg(long, default_value_t = 3)]
    runs: u32,
    /// Steps per run.
    #[arg(long, default_value_t = 300)]
    steps: u64,
    /// Server processes (2 at least: a backup lives on another server).
    #[arg(long, default_value_t = 3)]
    servers: u32,
    /// Worker processes.
    #[arg(long, default_value_t = 2)]
    workers: u32,
    /// Also print one JSON object with the results as the last line of stdout.
    #[arg(long)]
    json: bool,
}

/// One run's figures.
struct Run {
    samples_per_s: f64,
    /// CPU seconds (user + system) of every process of the run.
    cpu_s: f64,
    /// Of which in the kernel (the soft transport's copies and polling).
    sys_s: f64,
    /// Wall seconds of the whole run (start-up included).
    wall_s: f64,
    samples: f64,
}

/// CPU seconds (user, system) of this process's children that ended (and
/// theirs), from `/proc/self/stat` (in USER_HZ ticks, 100 a second on Linux).
fn children_cpu_s() -> Result<(f64, f64), String> {
    let stat = std::fs::read_to_string("/proc/self/stat").map_err(|e| format!("cannot read /proc/self/stat: {e}"))?;
    // Fields after the command name (which may hold spaces, in parentheses).
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or_default();
    let f: Vec<&str> = rest.split_whitespace().collect();
    // cutime and cstime are fields 16 and 17 of the line, 14 and 15 after it.
    let tick = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).ok_or("an unexpected /proc/self/stat");
    Ok((tick(13)? / 100.0, tick(14)? / 100.0))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs the benchmark.
pub fn run(a: ReplicasArgs) -> Result<(), String> {
    if a.runs == 0 || a.steps == 0 {
        return Err("--runs and --steps must be 1 at least".into());
    }
    if a.servers < 2 {
        return Err("--servers must be 2 at least (a shard's backup lives on another server)".into());
    }
    let default = default_spec(&a.model)?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut runs: [Vec<Run>; 2] = [Vec::new(), Vec::new()];
    for i in 0..a.runs {
        // Alternating which goes first, so that drift in the machine's load
        // falls on both.
        let order = if i % 2 == 0 { [1, 2] } else { [2, 1] };
        for r in order {
            let o = Overrides {
                workers: Some(a.workers),
                servers: Some(a.servers),
                steps: Some(a.steps),
                replicas: Some(r),
                ..Default::default()
            };
            let (spec, text) = build_spec_or(a.spec.as_deref(), default, &o).map_err(|e| e.to_string())?;
            let ((u0, s0), t0) = (children_cpu_s()?, std::time::Instant::now());
            let rep = crate::train::run(&spec, &text, a.steps, &[], &soft_args(), |_, _| {}).map_err(|e| e.to_string())?;
            let ((u1, s1), wall_s) = (children_cpu_s()?, t0.elapsed().as_secs_f64());
            let (cpu_s, sys_s) = (u1 - u0 + s1 - s0, s1 - s0);
            let samples = rep.steps as f64 * f64::from(spec.job.batch) * f64::from(a.workers);
            eps_proto::say!(
                "eps bench replicas: run {}/{} with replicas = {r}: {:.0} samples/s; {:.2} CPU s ({:.2} of {cores} cores busy over {:.1} s)",
                i + 1,
                a.runs,
                rep.samples_per_s,
                cpu_s,
                cpu_s / wall_s,
                wall_s
            );
            runs[r as usize - 1].push(Run { samples_per_s: rep.samples_per_s, cpu_s, sys_s, wall_s, samples });
        }
    }
    let rate = |k: usize| median(runs[k].iter().map(|r| r.samples_per_s).collect());
    let cpu_per_k = |k: usize| median(runs[k].iter().map(|r| r.cpu_s / r.samples * 1000.0).collect());
    let busy = |k: usize| median(runs[k].iter().map(|r| r.cpu_s / r.wall_s).collect());
    let sys = |k: usize| median(runs[k].iter().map(|r| r.sys_s / r.cpu_s).collect());
    let (ratio, cpu_ratio) = (rate(1) / rate(0), cpu_per_k(1) / cpu_per_k(0));
    println!("{:>9} {:>12} {:>20} {:>12} {:>12}", "replicas", "samples/s", "CPU ms/1000 samples", "in kernel", "cores busy");
    for k in 0..2 {
        println!("{:>9} {:>12.0} {:>20.1} {:>11.0}% {:>12.2}", k + 1, rate(k), cpu_per_k(k) * 1000.0, sys(k) * 100.0, busy(k));
    }
    println!(
        "throughput with 2 replicas: {ratio:.3}x that with 1 (medians of {} runs each); CPU per sample {cpu_ratio:.3}x; {cores} cores",
        a.runs
    );
    if a.json {
        let j = Json::new()
            .num("samples_per_s_replicas_1", rate(0))
            .num("samples_per_s_replicas_2", rate(1))
            .num("ratio", ratio)
            .num("cpu_s_per_1000_samples_replicas_1", cpu_per_k(0))
            .num("cpu_s_per_1000_samples_replicas_2", cpu_per_k(1))
            .num("cpu_ratio", cpu_ratio)
            .num("kernel_share_replicas_1", sys(0))
            .num("kernel_share_replicas_2", sys(1))
            .num("cores_busy_replicas_1", busy(0))
            .num("cores_busy_replicas_2", busy(1))
            .int("cores", cores as u64)
            .int("runs", u64::from(a.runs));
        println!("{}", j.finish());
    }
    Ok(())
}
