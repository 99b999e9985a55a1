//! `eps sched serve`'s flags, and the requests `eps submit`, `eps jobs` and
//! `eps kill` send it. The service is `eps_cluster::live::serve`.

use std::path::PathBuf;

use eps_sched::Timing;
use eps_sched::policy::{NAMES, by_name_timed};

pub use eps_cluster::live::serve::{default_socket, parse_submission, request};

use super::{Config, launcher};

/// `eps sched serve`'s arguments.
#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub cluster_of: crate::sim::Cluster,
    /// Policy: static, optimus, pollux, eps.
    #[arg(long, default_value = "eps", value_parser = clap::builder::PossibleValuesParser::new(NAMES))]
    pub policy: String,
    /// The Unix socket to take requests on [default: $XDG_RUNTIME_DIR/eps-sched.sock,
    /// else /tmp/eps-sched-UID.sock].
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// The cluster model (TOML; default: the built-in figures, measured here).
    #[arg(long)]
    pub cluster: Option<PathBuf>,
    /// The scheduler's clocks times this (decision tick and least interval
    /// between two growths are 30 s and 10 s at 1).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// How jobs' processes are started: `local` or `slurm` (job steps of the
    /// allocation this runs in; its nodes and CPUs are the slots).
    #[arg(long, default_value = "local", value_parser = clap::builder::PossibleValuesParser::new(["local", "slurm"]))]
    pub launcher: String,
}

/// Runs `eps sched serve` until Ctrl-C (which stops every job).
pub fn serve(a: ServeArgs) -> Result<(), String> {
    let (slots, nodes) = super::cluster(&a.launcher, &a.cluster_of, 8)?;
    if !(a.time_scale.is_finite() && a.time_scale > 0.0) {
        return Err("--time-scale must be a positive number".into());
    }
    let model = crate::sim::load_model(a.cluster.as_deref())?;
    let timing = Timing::default().scaled(a.time_scale);
    let mut policy = by_name_timed(&a.policy, timing).ok_or_else(|| format!("unknown policy {}", a.policy))?;
    let path = a.socket.unwrap_or_else(default_socket);
    let launcher = launcher::by_name(&a.launcher).ok_or_else(|| format!("unknown launcher {}", a.launcher))?;
    let cfg = Config { slots, nodes, model, timing, launcher, verbose: true };
    eps_cluster::live::serve::serve_on(&path, &cfg, policy.as_mut(), &a.policy)
}
