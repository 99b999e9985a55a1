//! `eps up`: a control plane and the servers of a job as child processes, for
//! workers that come from elsewhere (a framework's training processes joining
//! through libeps or the Python package).
//!
//! Its stdout holds only `KEY=VALUE` lines workers read from their
//! environment: `EPS_CONTROL=HOST:PORT` first, then `EPS_JOB_SECRET_FILE=PATH`
//! when it generated the secret. Everything else goes to stderr.

use std::io::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::error::chain as crate_error;
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
    /// Where the first parameters come from: worker (the first worker's model
    /// values, as DDP broadcasts rank 0's) or servers (the servers' seeded
    /// initialiser: the same bits whatever the model holds)
    /// [default: worker for a job whose tensors the workers declare].
    #[arg(long, value_name = "worker|servers")]
    pub init: Option<String>,
    /// Base learning rate of the server-side optimizer.
    #[arg(long)]
    pub lr: Option<f64>,
    /// Iterations the job runs at most; framework workers may stop sooner
    /// (a learning-rate schedule given in --spec ends here) [default job: 1000000].
    #[arg(long)]
    pub steps: Option<u64>,
    /// Seconds to wait for the job's first workers to join: past it, `eps up`
    /// names the ranks missing, stops the job and exits with an error
    /// [default: no limit; workers may come whenever they are ready].
    #[arg(long, value_name = "SECONDS", value_parser = parse_seconds)]
    pub join_timeout: Option<f64>,
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
        init: a.init.clone(),
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
        let path = crate::secret::write(cluster.dir(), &secret)?;
        println!("EPS_JOB_SECRET_FILE={}", path.display());
    }
    let _ = std::io::stdout().flush();
    let model = match spec.layout() {
        Ok(l) => format!("model {} parameters ({}) in {} shards", l.total, format_size(l.bytes()), l.shards.len()),
        Err(_) => "tensors declared by the first worker to join".into(),
    };
    let opt = spec.optimizer().map_err(|e| e.to_string())?;
    let init = if spec.seeded_by_worker() { "the first worker's model values" } else { "the servers' initialiser" };
    let wait = match a.join_timeout {
        Some(t) => format!("for up to {t} s, --join-timeout"),
        None => "with no time limit, --join-timeout".to_string(),
    };
    eps_proto::say!(
        "eps up: job {:?} at {}: {} servers ({} transport, {} aggregator) waiting for {} workers ({wait}); {}, optimizer {}, first parameters from {init}; {}",
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
    let timed_out = Arc::new(AtomicBool::new(false));
    let joins = JoinWatch {
        addr: cluster.control_addr().to_string(),
        secret,
        want: spec.job.workers,
        timeout: a.join_timeout.map(Duration::from_secs_f64),
        stop: cluster.stop_handle(),
        timed_out: timed_out.clone(),
    };
    std::thread::spawn(move || joins.run());
    match cluster.supervise(None, |_| {}) {
        Ok(_) => {
            eps_proto::say!("eps up: the job has finished; every server has exited");
            Ok(())
        }
        Err(_) if timed_out.load(Ordering::SeqCst) => Err(format!(
            "the job's first workers did not all join within --join-timeout {} s; the job was stopped (see the ranks named above)",
            a.join_timeout.unwrap_or_default()
        )),
        Err(e) => Err(crate_error(&e)),
    }
}

fn parse_seconds(s: &str) -> Result<f64, String> {
    match s.trim().trim_end_matches('s').parse::<f64>() {
        Ok(t) if t.is_finite() && t > 0.0 => Ok(t),
        _ => Err(format!("{s:?} is not a number of seconds above 0 (e.g. 60 or 2.5)")),
    }
}

/// Follows the job's first workers joining: says every 30 s who is still
/// missing, and past the join timeout names them and stops the cluster.
struct JoinWatch {
    addr: String,
    secret: String,
    want: u32,
    timeout: Option<Duration>,
    stop: Arc<AtomicBool>,
    timed_out: Arc<AtomicBool>,
}

/// How often `eps up` says which workers it still waits for.
const JOIN_REPORT: Duration = Duration::from_secs(30);

impl JoinWatch {
    fn run(self) {
        let start = Instant::now();
        let mut told = start;
        let mut client = None;
        loop {
            std::thread::sleep(Duration::from_millis(250));
            let Some(missing) = self.missing(&mut client) else {
                client = None;
                continue;
            };
            if missing.is_empty() {
                return;
            }
            let waited = start.elapsed();
            if self.timeout.is_some_and(|t| waited > t) {
                eps_proto::say!(
                    "eps up: after {:.1} s (--join-timeout), {} of the job's {} workers had not joined (ranks {missing:?}); stopping the job. Workers join with EPS_CONTROL={} and the job secret in their environment",
                    waited.as_secs_f64(),
                    missing.len(),
                    self.want,
                    self.addr
                );
                self.timed_out.store(true, Ordering::SeqCst);
                self.stop.store(true, Ordering::SeqCst);
                return;
            }
            if told.elapsed() > JOIN_REPORT {
                told = Instant::now();
                eps_proto::say!(
                    "eps up: {:.0} s on, waiting for {} of {} workers (ranks {missing:?})",
                    waited.as_secs_f64(),
                    missing.len(),
                    self.want
                );
            }
        }
    }

    /// The job's first ranks that have not registered yet (None: the
    /// control plane did not answer this time).
    fn missing(&self, client: &mut Option<eps_control::ControlClient>) -> Option<Vec<u64>> {
        use eps_proto::control::ControlMsg;
        if client.is_none() {
            let addr: eps_control::ControlAddrs = self.addr.parse().ok()?;
            let secret = eps_fabric::Secret::new(self.secret.as_str()).ok()?;
            *client = Some(eps_control::ControlClient::connect(addr, &secret, Duration::from_secs(2)).ok()?);
        }
        let c = client.as_mut()?;
        let ControlMsg::StatusReport { text } = c.call(&ControlMsg::StatusJson).ok()? else { return None };
        let st: serde_json::Value = serde_json::from_str(&text).ok()?;
        let rows = st.get("workers")?.as_array()?;
        let ranks = rows.iter().filter_map(|w| {
            let rank = w.get("rank")?.as_u64()?;
            (rank < u64::from(self.want) && w.get("state")?.as_str()? == "admitted").then_some(rank)
        });
        Some(ranks.collect())
    }
}
