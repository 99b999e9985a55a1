//! `eps sched calibrate`: measures on this machine, with real EPS processes,
//! the constants of the scheduler's cluster model (`eps_bench::calibrate`),
//! and writes them as the TOML `eps sim --cluster` reads.

use std::fmt::Write as _;
use std::path::PathBuf;

use eps_sched::ClusterModel;

/// `eps sched calibrate`'s arguments.
#[derive(clap::Args, Debug)]
pub struct CalibrateArgs {
    /// Where to write the model (TOML); default: stdout.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Smaller sizes and fewer rounds (seconds instead of about a minute).
    #[arg(long)]
    pub quick: bool,
}

/// Runs the measurements and writes the model.
pub fn run(a: CalibrateArgs) -> Result<(), String> {
    let c = eps_bench::calibrate::measure(a.quick)?;
    let (model, fit, size) = (&c.model, &c.fit, c.size);
    let rescales = fit.rescales;
    let mut t = String::new();
    let _ = writeln!(
        t,
        "# The scheduler's cluster model, measured by `eps sched calibrate{}`.",
        if a.quick { " --quick" } else { "" }
    );
    let _ = writeln!(
        t,
        "# push/pull of {} MiB: {:.2} ms per iteration; of 4 KiB: {:.3} ms; sum of two f32 inputs: {:.2} GB/s; migration: {:.2} GB/s.",
        size >> 20,
        c.big_ms,
        c.tiny_ms,
        c.sum_gbytes_per_s,
        c.migration_gbytes_per_s
    );
    let _ = writeln!(
        t,
        "# A live job's start to its first iteration and the training time a rescale costs: medians (of {rescales} rescales)."
    );
    let _ = writeln!(
        t,
        "# Its iterations took {:.3} ms more than the model's transfers, sums and compute with one worker, and {:.3} ms more per further worker ({} allocations timed).",
        fit.extra_s * 1e3,
        fit.per_worker_s * 1e3,
        fit.segments
    );
    let _ = writeln!(t, "server_bytes_per_s = {:.0}", model.server_bytes_per_s);
    let _ = writeln!(t, "worker_bytes_per_s = {:.0}", model.worker_bytes_per_s);
    let _ = writeln!(t, "agg_elements_per_s = {:.0}", model.agg_elements_per_s);
    let _ = writeln!(t, "iteration_overhead_s = {:.6}", model.iteration_overhead_s);
    let _ = writeln!(t, "worker_overhead_s = {:.6}", model.worker_overhead_s);
    let _ = writeln!(t, "migration_bytes_per_s = {:.0}", model.migration_bytes_per_s);
    let _ = writeln!(t, "rescale_pause_s = {:.4}", model.rescale_pause_s);
    let _ = writeln!(t, "start_pause_s = {:.4}", model.start_pause_s);
    // What is written must read back.
    ClusterModel::from_toml(&t).map_err(|e| format!("the measured model is not usable ({e}):\n{t}"))?;
    match &a.out {
        Some(p) => {
            std::fs::write(p, &t).map_err(|e| format!("cannot write {}: {e}", p.display()))?;
            eps_proto::say!("eps sched calibrate: wrote {}", p.display());
        }
        None => print!("{t}"),
    }
    Ok(())
}
