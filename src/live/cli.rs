//! `eps sched run`: a trace replayed with real EPS jobs on this machine under
//! one or more policies, each run set against the simulator's prediction of
//! it (fidelity), and the parameters of rescaled jobs checked against static
//! runs.

use std::path::PathBuf;

use eps_sched::policy::{NAMES, by_name_timed};
use eps_sched::sim::{JobRecord, Summary};
use eps_sched::{JobSpec, Timing, sim};

use super::{Config, LiveJob, LiveRun, Trace, launcher};
use crate::sim::{check_fits, load_model, load_trace, print_header, print_jobs, print_row, summary_json};

/// `eps sched run`'s arguments.
#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// The trace (CSV, as `eps sim`'s; sizes this machine can hold: see
    /// bench/traces/live.csv).
    #[arg(long)]
    pub trace: PathBuf,
    /// Policies, comma-separated, run one after the other on the same trace:
    /// static, optimus, pollux, eps.
    #[arg(long, default_value = "eps", value_delimiter = ',', value_parser = clap::builder::PossibleValuesParser::new(NAMES))]
    pub policy: Vec<String>,
    #[command(flatten)]
    pub cluster_of: crate::sim::Cluster,
    /// Seconds here per second of the trace: submit times, compute per sample
    /// and the scheduler's clocks (decision tick, least interval between two
    /// growths; 30 s and 10 s at 1) are multiplied by it.
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// The cluster model (TOML; default: the built-in figures, measured here).
    #[arg(long)]
    pub cluster: Option<PathBuf>,
    /// How jobs' processes are started: `local` (child processes of this one)
    /// or `slurm` (job steps of the allocation this runs in, whose nodes and
    /// CPUs are then the scheduler's slots: one per CPU).
    #[arg(long, default_value = "local", value_parser = clap::builder::PossibleValuesParser::new(["local", "slurm"]))]
    pub launcher: String,
    /// After each run, train every job that ran to completion on the same
    /// workers again, statically, and compare the final parameters' checksums
    /// (a server rescale must not change a bit).
    #[arg(long)]
    pub verify: bool,
    #[command(flatten)]
    pub out: crate::sim::Report,
    /// Print no event lines.
    #[arg(long)]
    pub quiet: bool,
}

/// How the simulator's prediction compares with a live run, per job.
#[derive(Clone, Debug)]
pub struct Fidelity {
    /// (job, live submit-to-end seconds, simulated).
    pub jobs: Vec<(String, f64, f64)>,
    /// Median over jobs of |simulated - live| / live.
    pub median_rel_err: f64,
}

/// Compares `live` with the simulator's run of the same (scaled) trace.
pub fn fidelity(live: &[LiveJob], sim: &[JobRecord]) -> Fidelity {
    let mut jobs = Vec::new();
    for j in live {
        let r = &j.record;
        let Some(s) = sim.iter().find(|s| s.name == r.name) else { continue };
        if let (Some(le), Some(se)) = (r.end_s, s.end_s) {
            jobs.push((r.name.clone(), le - r.submit_s, se - s.submit_s));
        }
    }
    let errs: Vec<f64> = jobs.iter().map(|(_, l, s)| (s - l).abs() / l.max(1e-9)).collect();
    Fidelity { jobs, median_rel_err: super::median(&errs).unwrap_or(f64::NAN) }
}

/// The outcome of [`verify`].
#[derive(Clone, Debug, Default)]
pub struct Verified {
    /// Jobs checked whose servers were rescaled.
    pub rescaled: u32,
    /// Jobs checked that kept their servers.
    pub kept: u32,
    /// Jobs whose workers changed (a static run has other contributors).
    pub skipped: u32,
    /// Jobs whose checksum differs: (job, live, static).
    pub mismatched: Vec<(String, String, String)>,
}

/// Trains each job of `jobs` that ran to completion on the same workers
/// again, statically, and compares the checksums.
pub fn verify(jobs: &[LiveJob], specs: &[JobSpec], verbose: bool) -> Result<Verified, String> {
    let mut v = Verified::default();
    for j in jobs.iter().filter(|j| !j.record.killed && j.error.is_none()) {
        let (Some(sum), Some(l), Some(spec)) = (&j.checksum, &j.launch, specs.iter().find(|s| s.name == j.record.name)) else {
            continue;
        };
        if j.membership.as_deref().is_none_or(|m| m.contains(';')) {
            v.skipped += 1;
            continue;
        }
        let per = u64::from(l.spec.job.workers) * u64::from(spec.batch);
        let steps = spec.samples.div_ceil(per);
        let text: String = l
            .text
            .lines()
            .map(|x| if x.starts_with("steps = ") { format!("steps = {steps}\n") } else { format!("{x}\n") })
            .collect();
        let (static_spec, text) = crate::jobspec::parse(&text).map_err(|e| e.to_string())?;
        let r = crate::train::run(&static_spec, &text, steps.max(1), &[], &crate::train::cluster::soft_args(), |_, _| {})
            .map_err(|e| format!("static run of {}: {}", j.record.name, crate::error::chain(&e)))?;
        if verbose {
            eps_proto::say!(
                "eps sched: {} ({} servers changed: {}) live {sum}, static {}",
                j.record.name,
                l.spec.job.servers,
                j.servers_changed,
                r.params_checksum
            );
        }
        if &r.params_checksum != sum {
            v.mismatched.push((j.record.name.clone(), sum.clone(), r.params_checksum));
        } else if j.servers_changed {
            v.rescaled += 1;
        } else {
            v.kept += 1;
        }
    }
    Ok(v)
}

/// Runs `eps sched run`.
pub fn run(a: RunArgs) -> Result<(), String> {
    if !(a.time_scale.is_finite() && a.time_scale > 0.0) {
        return Err("--time-scale must be a positive number".into());
    }
    let mut jobs = load_trace(&a.trace)?;
    for j in &mut jobs {
        j.submit_s *= a.time_scale;
        j.compute_ms_per_sample *= a.time_scale;
    }
    jobs.sort_by(|x, y| x.submit_s.total_cmp(&y.submit_s));
    let (slots, nodes) = super::cluster(&a.launcher, &a.cluster_of, 8)?;
    check_fits(&jobs, slots)?;
    let model = load_model(a.cluster.as_deref())?;
    let timing = Timing::default().scaled(a.time_scale);
    let launcher = launcher::by_name(&a.launcher).ok_or_else(|| format!("unknown launcher {}", a.launcher))?;
    let cfg = Config { slots, nodes: nodes.clone(), model: model.clone(), timing, launcher, verbose: !a.quiet };
    let t0 = jobs.first().map_or(0.0, |j| j.submit_s);
    eps_proto::say!(
        "eps sched run: {} jobs from {} on {} slots, {} launcher, time scale {}",
        jobs.len(),
        a.trace.display(),
        slots,
        cfg.launcher.name(),
        a.time_scale
    );
    let mut runs: Vec<(Summary, Vec<JobRecord>)> = Vec::new();
    let mut lines = Vec::new();
    let mut failed = Vec::new();
    for name in &a.policy {
        let mut p = by_name_timed(name, timing).ok_or_else(|| format!("unknown policy {name}"))?;
        eps_proto::say!("eps sched run: policy {name}");
        let live: LiveRun = super::run(&mut Trace::new(jobs.clone()), &cfg, p.as_mut(), t0)?;
        let mut sp = by_name_timed(name, timing).expect("known");
        let (_, sim_rec) = sim::run_with(
            &jobs,
            slots,
            &model,
            sp.as_mut(),
            &sim::Options { tick_s: timing.tick_s, nodes: nodes.clone(), ..Default::default() },
        )
        .map_err(|e| e.to_string())?;
        let fid = fidelity(&live.jobs, &sim_rec);
        let ver = if a.verify { Some(verify(&live.jobs, &jobs, !a.quiet)?) } else { None };
        for j in &live.jobs {
            if let Some(e) = &j.error {
                failed.push(format!("{name}: job {}: {e}", j.record.name));
            } else if j.record.end_s.is_none() {
                failed.push(format!("{name}: job {} never ended", j.record.name));
            }
        }
        if let Some(v) = &ver {
            for (job, l, s) in &v.mismatched {
                failed.push(format!("{name}: job {job} ended with params_checksum {l}, a static run with {s}"));
            }
        }
        if a.out.jobs {
            print_jobs(name, &live.summary_records());
            for (job, l, s) in &fid.jobs {
                eps_proto::say!("  {name} {job}: submit-to-end live {l:.1} s, simulated {s:.1} s");
            }
        }
        lines.push(Line {
            summary: live.summary.clone(),
            fid,
            ver,
            settle: median(&live.rescale_s),
            pause: median(&live.pause_s),
            start: median(&live.start_s),
        });
        runs.push((live.summary, live.jobs.iter().map(|j| j.record.clone()).collect()));
    }
    if a.out.json {
        for Line { summary: s, fid, ver, settle, pause, start } in &lines {
            let mut j = summary_json(s, slots)
                .num("time_scale", a.time_scale)
                .num("fidelity_median_rel_err", fid.median_rel_err)
                .int("fidelity_jobs", fid.jobs.len() as u64)
                .num("rescale_settle_median_s", settle.0)
                .num("rescale_pause_median_s", pause.0)
                .int("rescales_measured", pause.1 as u64)
                .num("start_median_s", start.0);
            if let Some(v) = ver {
                j = j
                    .int("verified_rescaled", v.rescaled.into())
                    .int("verified_kept", v.kept.into())
                    .int("verify_skipped", v.skipped.into())
                    .int("verify_mismatched", v.mismatched.len() as u64);
            }
            println!("{}", j.finish());
        }
    } else {
        print_header();
        for l in &lines {
            print_row(&l.summary);
        }
        for Line { summary: s, fid, ver, settle, pause, start } in &lines {
            println!(
                "{}: simulator vs live, submit-to-end per job: median error {:.1}% over {} jobs",
                s.policy,
                fid.median_rel_err * 100.0,
                fid.jobs.len(),
            );
            println!(
                "{}: a job's first iteration {:.2} s after its start; rescales settled in {:.2} s and paused training {:.3} s (medians of {})",
                s.policy, start.0, settle.0, pause.0, pause.1
            );
            if let Some(v) = ver {
                println!(
                    "{}: params_checksum equal to a static run for {} jobs with rescaled servers and {} without ({} mismatched; {} skipped: their workers changed)",
                    s.policy,
                    v.rescaled,
                    v.kept,
                    v.mismatched.len(),
                    v.skipped
                );
            }
        }
    }
    if let Some(p) = &a.out.plot {
        crate::sim_plot::draw(p, slots, &runs)?;
        eps_proto::say!("eps sched run: plot in {}", p.display());
    }
    if failed.is_empty() { Ok(()) } else { Err(format!("{} problem(s):\n  {}", failed.len(), failed.join("\n  "))) }
}

/// One run's figures for the report.
struct Line {
    summary: Summary,
    fid: Fidelity,
    ver: Option<Verified>,
    /// (median, count) of settle times, pauses, start delays.
    settle: (f64, usize),
    pause: (f64, usize),
    start: (f64, usize),
}

/// The median of `v` (0 when empty) and its length.
fn median(v: &[f64]) -> (f64, usize) {
    (super::median(v).unwrap_or(0.0), v.len())
}
