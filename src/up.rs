//! `eps up`: a control plane and the servers of a job as child processes, for
//! workers that come from elsewhere (a framework's training processes joining
//! through libeps or the Python package).
//!
//! Its stdout holds only `KEY=VALUE` lines workers read from their
//! environment: `EPS_CONTROL=HOST:PORT` first, then `EPS_JOB_SECRET_FILE=PATH`
//! when it generated the secret. Everything else goes to stderr.

use std::io::Write as _;
use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
use std::path::PathBuf;

use crate::roles::crate_error;
use crate::train::{Launch, LocalCluster, Overrides, build_spec_or, cluster::ChildArgs};
use crate::units::format_size;

/// The job `eps up` runs without `--spec`: the tensors are declared by the
/// first worker to join.
pub const UP_SPEC: &str = r#"
[job]
name = "framework"
workers = 2
servers = 2
steps = 1000000
consistency = "bsp"

[model]
declare = true

[optimizer]
kind = "adam"
lr = 0.001
"#;

/// `eps up`'s arguments.
#[derive(clap::Args, Debug)]
pub struct UpArgs {
    /// Job spec (TOML). Without it: BSP, Adam on the servers (lr 0.001), tensors
    /// declared by the first worker to join. A spec may name its tensors or say
    /// `declare = true` in `[model]`.
    #[arg(long)]
    pub spec: Option<PathBuf>,
    /// Workers the job waits for (framework processes) [default job: 2].
    #[arg(long)]
    pub workers: Option<u32>,
    /// Server processes to start [default job: 2].
    #[arg(long)]
    pub servers: Option<u32>,
    /// Worker ranks the job may admit over its life: more than --workers lets
    /// workers join while it trains (BSP) [default: --workers].
    #[arg(long)]
    pub max_workers: Option<u32>,
    /// Server-side optimizer: none (servers publish the averaged gradient; the
    /// framework keeps its own optimizer), sgd, momentum, nesterov, adam, adamw.
    #[arg(long)]
    pub optimizer: Option<String>,
    /// Base learning rate of the server-side optimizer.
    #[arg(long)]
    pub lr: Option<f64>,
    /// Training iterations (sets the end of a cosine learning-rate decay).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Consistency model: bsp, ssp or asp.
    #[arg(long)]
    pub consistency: Option<String>,
    /// The control plane's address (`IP:PORT`; port 0 picks a free one).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: String,
    /// The data-plane transport of the servers (workers choose their own).
    #[command(flatten)]
    pub fabric: crate::transport::TransportFlags,
    #[command(flatten)]
    pub agg: crate::aggregator::AggregatorFlag,
}

/// Runs `eps up` until every server and worker of the job has finished, or
/// Ctrl-C.
pub fn run(a: UpArgs) -> Result<(), String> {
    let o = Overrides {
        workers: a.workers,
        servers: a.servers,
        steps: a.steps,
        consistency: a.consistency.clone(),
        optimizer: a.optimizer.clone(),
        lr: a.lr,
        max_workers: a.max_workers,
        ..Overrides::default()
    };
    let (spec, text) = build_spec_or(a.spec.as_deref(), UP_SPEC, &o).map_err(|e| crate_error(&e))?;
    let chosen = crate::transport::choose(&a.fabric, Some(&spec.fabric))?;
    let agg = crate::aggregator::choose(&a.agg, spec.job.aggregator.as_deref())?;
    let from_env = std::env::var("EPS_JOB_SECRET").ok().filter(|s| !s.is_empty());
    let secret = match &from_env {
        Some(s) => s.clone(),
        None => eps_fabric::auth::nonce()
            .map_err(|e| format!("cannot generate a job secret: {e}"))?
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect(),
    };
    let children = ChildArgs {
        both: a.fabric.child_args(&chosen),
        servers: vec!["--aggregator".into(), agg.name().into()],
        ..Default::default()
    };
    let how = Launch { listen: a.listen.clone(), secret: Some(secret.clone()), workers: false, nodes: Vec::new() };
    let cluster = LocalCluster::launch(&spec, &text, &[], &children, &how).map_err(|e| crate_error(&e))?;
    println!("EPS_CONTROL={}", cluster.control_addr());
    if from_env.is_none() {
        let path = write_secret(&cluster, &secret)?;
        println!("EPS_JOB_SECRET_FILE={}", path.display());
    }
    let _ = std::io::stdout().flush();
    let model = match spec.layout() {
        Ok(l) => format!("model {} parameters ({}) in {} shards", l.total, format_size(l.bytes()), l.shards.len()),
        Err(_) => "tensors declared by the first worker to join".into(),
    };
    let opt = spec.optimizer().map_err(|e| e.to_string())?;
    eps_proto::say!(
        "eps up: job {:?} at {}: {} servers ({} transport, {} aggregator) waiting for {} workers; {}, optimizer {}; {}",
        spec.job.name,
        cluster.control_addr(),
        spec.job.servers,
        chosen.name(),
        agg.name(),
        spec.job.workers,
        spec.job.consistency.name(),
        opt.name(),
        model
    );
    eps_proto::say!(
        "eps up: workers need EPS_CONTROL and {} in their environment; Ctrl-C stops the job",
        if from_env.is_some() { "EPS_JOB_SECRET" } else { "EPS_JOB_SECRET_FILE" }
    );
    match cluster.supervise(None, |_| {}) {
        Ok(_) => {
            eps_proto::say!("eps up: the job has finished; every server has exited");
            Ok(())
        }
        Err(e) => Err(crate_error(&e)),
    }
}

/// Writes the secret into the cluster's directory, readable by this user only.
fn write_secret(cluster: &LocalCluster, secret: &str) -> Result<PathBuf, String> {
    let dir = cluster.dir();
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .map_err(|e| format!("cannot restrict {}: {e}", dir.display()))?;
    let path = dir.join("job.secret");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .map_err(|e| format!("cannot create {}: {e}", path.display()))?;
    f.write_all(secret.as_bytes()).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    Ok(path)
}
