//! `eps control`, `eps server`, `eps worker`: the three roles as commands.

use std::io::Write as _;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use eps_control::ControlService;
use eps_control::store::FileStore;
use eps_etcd::store::EtcdTarget;
use eps_proto::JobSpec;

use crate::advertise::{advertised, ready_line};
use crate::error::chain as crate_error;
use crate::secret::from_env as secret_from_env;
use crate::transport::{self, OnFabric, TransportFlags};

/// `--metrics ADDR` of a role: serves the process's metrics and a health
/// check there (nothing without it), and says where.
pub fn serve_metrics(role: &str, addr: Option<SocketAddr>) -> Result<(), String> {
    let Some(addr) = addr else { return Ok(()) };
    transport_probes();
    let what = format!("eps {role}");
    let health: eps_metrics::Health = Arc::new(move || Ok(format!("{what} (pid {})", std::process::id())));
    let e = eps_metrics::serve(addr, health).map_err(|e| format!("--metrics {addr}: {e}"))?;
    let shown = if e.addr().ip().is_unspecified() { advertised(e.addr()) } else { e.addr() };
    eps_proto::say!("eps {role}: metrics on http://{shown}/metrics (health: /healthz)");
    Ok(())
}

/// The transport's figures, whichever provider runs: memory registered,
/// and completions in error by kind.
fn transport_probes() {
    let r = eps_metrics::global();
    r.probe("eps_fabric_registered_bytes", "Bytes of memory in live registered regions.", &[], || {
        eps_fabric::stats::registered_bytes() as f64
    });
    for (status, kind) in eps_fabric::stats::ERROR_KINDS {
        r.probe_counter(
            "eps_fabric_completion_errors_total",
            "Work completions that ended in error, by kind (flushed: a connection that failed or closed).",
            &[("kind", kind)],
            move || eps_fabric::stats::errors(status) as f64,
        );
    }
}

/// Exits this process when its parent goes away (used for the processes `eps train`
/// starts, so a killed driver never leaves a cluster behind).
pub fn exit_with_parent() {
    let parent = std::os::unix::process::parent_id();
    std::thread::spawn(move || {
        loop {
            std::thread::sleep(Duration::from_millis(200));
            if std::os::unix::process::parent_id() != parent {
                eps_proto::say!("eps: parent process {parent} is gone; exiting");
                std::process::exit(3);
            }
        }
    });
}

/// `eps control` (`-` for the spec: read it from stdin).
pub fn control(listen: SocketAddr, spec_path: &Path, state_dir: &Path, etcd: Option<&EtcdTarget>) -> Result<(), String> {
    let text = if spec_path == Path::new("-") {
        std::io::read_to_string(std::io::stdin()).map_err(|e| format!("cannot read the job spec from stdin: {e}"))?
    } else {
        std::fs::read_to_string(spec_path).map_err(|e| format!("cannot read job spec {}: {e}", spec_path.display()))?
    };
    let (spec, text) = crate::jobspec::parse(&text).map_err(|e| format!("{}: {e}", spec_path.display()))?;
    control_spec(listen, &spec, &text, state_dir, etcd)
}

/// `eps control` for a spec already read (a resumed job's).
pub fn control_spec(
    listen: SocketAddr,
    spec: &JobSpec,
    text: &str,
    state_dir: &Path,
    etcd: Option<&EtcdTarget>,
) -> Result<(), String> {
    if let Some(target) = etcd {
        crate::slurm::log_step("control");
        return crate::ha::control(listen, spec, text, target);
    }
    let secret = secret_from_env(Some(spec))?;
    let store =
        FileStore::open(state_dir).map_err(|e| format!("cannot open the state directory {}: {e}", state_dir.display()))?;
    crate::slurm::log_step("control");
    let svc = ControlService::bind(listen, spec, text, secret, Box::new(store)).map_err(|e| crate_error(&e))?;
    let addr = ready_line(svc.local_addr());
    eps_proto::say!(
        "eps control: job {:?} on {}: waiting for {} servers and {} workers (state in {})",
        spec.job.name,
        addr,
        spec.job.servers,
        spec.job.workers,
        state_dir.display()
    );
    svc.run().map_err(|e| crate_error(&e))?;
    if std::env::var_os("EPS_DISCARD_STATE").is_some_and(|v| v == "1") {
        // A launcher that runs it on a node it cannot clean up itself
        // (Slurm): the job ended, nothing will restart from this state.
        let _ = std::fs::remove_dir_all(state_dir);
    }
    Ok(())
}

/// `--listen-ip` of `eps server`: an address, or `route`, the address this
/// host reaches the control plane from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ListenIp {
    /// This address.
    At(IpAddr),
    /// The local address of the route to the control plane.
    Route,
}

impl std::str::FromStr for ListenIp {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "route" => Ok(ListenIp::Route),
            ip => ip.parse().map(ListenIp::At).map_err(|_| format!("{ip:?}: an IP address, or `route`")),
        }
    }
}

/// The local address of the route to `to` (no packet is sent).
fn route_to(to: SocketAddr) -> Result<IpAddr, String> {
    let any: SocketAddr = if to.is_ipv4() { ([0, 0, 0, 0], 0).into() } else { (std::net::Ipv6Addr::UNSPECIFIED, 0).into() };
    let s = std::net::UdpSocket::bind(any).map_err(|e| format!("--listen-ip route: {e}"))?;
    s.connect(to).map_err(|e| format!("--listen-ip route: no route to the control plane {to}: {e}"))?;
    s.local_addr().map(|a| a.ip()).map_err(|e| format!("--listen-ip route: {e}"))
}

/// `eps server`: registers, takes the transport from the flags, the environment
/// or the job spec, and serves until the control plane retires it.
pub fn server(
    control: eps_control::ControlAddrs,
    listen_ip: Option<ListenIp>,
    threads: usize,
    timeout: Duration,
    fabric: &TransportFlags,
    agg: &crate::aggregator::AggregatorFlag,
) -> Result<(), String> {
    crate::slurm::log_step("server");
    let ip = match listen_ip {
        Some(ListenIp::At(ip)) => ip,
        Some(ListenIp::Route) => route_to(control.first())?,
        None => IpAddr::from([127, 0, 0, 1]),
    };
    let mut cfg = eps_server::ServerConfig {
        control,
        secret: secret_from_env(None)?,
        listen_ip: ip,
        aggregator: Arc::new(eps_agg::CpuAggregator::new(1)),
        device: None,
        accept_timeout: timeout,
        update_threads: if threads == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()) } else { threads },
    };
    let reg = eps_server::register(&cfg).map_err(|e| crate_error(&e))?;
    // For a supervisor (`eps train`): which rank this process serves.
    crate::report::Report::Server { rank: reg.rank() }.print();
    let chosen = transport::choose(fabric, Some(&reg.spec().fabric))?;
    let kind = crate::aggregator::choose(agg, reg.spec().job.aggregator.as_deref())?;
    let built = crate::aggregator::build(kind, 1)?;
    (cfg.aggregator, cfg.device) = (built.agg.clone(), built.device.clone());
    // An explicit --listen-ip wins; else the provider's own address (rdma).
    if !matches!(listen_ip, Some(ListenIp::At(_)))
        && let Some(ip) = chosen.listen_ip()?
    {
        cfg.listen_ip = ip;
    }
    struct Serve {
        cfg: eps_server::ServerConfig,
        reg: eps_server::Registration,
        built: crate::aggregator::Built,
    }
    impl OnFabric for Serve {
        type Out = Result<eps_server::ServerSummary, eps_server::ServerError>;
        fn run<P: eps_fabric::Fabric>(self, pd: P) -> Self::Out {
            let direct = self.built.direct();
            eps_server::run_direct(&self.cfg, self.reg, pd, direct)
        }
        #[cfg(feature = "rdma")]
        fn run_rdma(self, pd: eps_rdma::RdmaPd) -> Self::Out {
            let direct = self.built.direct_rdma(&pd);
            eps_server::run_direct(&self.cfg, self.reg, pd, direct)
        }
    }
    let s = transport::run_on(&chosen, Serve { cfg, reg, built })?.map_err(|e| crate_error(&e))?;
    if s.sparse_rss_start_bytes > 0 {
        // For a supervisor (`eps bench sparse`): what the sparse tables hold.
        crate::report::Report::ServerSparse(crate::report::ServerSparse {
            rank: s.rank,
            rows: s.sparse_rows,
            row_state_bytes: s.sparse_row_state_bytes,
            heap_bytes: s.sparse_heap_bytes,
            rss_start_bytes: s.sparse_rss_start_bytes,
            rss_end_bytes: s.sparse_rss_end_bytes,
            pulled_keys: s.sparse_pulled_keys,
            stepped_keys: s.sparse_stepped_keys,
            evicted: s.sparse_evicted,
            refused: s.sparse_refused,
        })
        .print();
    }
    eps_proto::say!(
        "eps server {}: {} shards, {} parameters, {} updates applied, {} pulls served, {} protocol violations ({} transport, {} aggregator){}",
        s.rank,
        s.shards,
        s.elements,
        s.updates,
        s.pulls,
        s.violations,
        chosen.name(),
        kind.name(),
        if s.sparse_rss_start_bytes > 0 {
            format!(
                "; sparse tables: {} rows ({} with optimizer state), {} evicted, {} refused (table full), {} taken in and {} given away with their buckets",
                s.sparse_rows,
                crate::units::format_size(s.sparse_row_state_bytes),
                s.sparse_evicted,
                s.sparse_refused,
                s.sparse_rows_in,
                s.sparse_rows_out
            )
        } else {
            String::new()
        }
    );
    Ok(())
}

/// `eps worker`: the built-in task, or the worker side of a benchmark, on the
/// transport the flags, the environment or the job spec name.
pub fn worker(
    control: eps_control::ControlAddrs,
    pace: crate::train::worker::Pace,
    bench: WorkerBench,
    timeout: Duration,
    fabric: &TransportFlags,
) -> Result<(), String> {
    crate::slurm::log_step("worker");
    let cfg = eps_worker::WorkerConfig { control, secret: secret_from_env(None)?, timeout };
    let reg = eps_worker::register(&cfg).map_err(|e| crate_error(&e))?;
    let chosen = transport::choose(fabric, Some(&reg.spec().fabric))?;
    struct Work {
        cfg: eps_worker::WorkerConfig,
        reg: eps_worker::Registration,
        bench: WorkerBench,
        pace: crate::train::worker::Pace,
    }
    impl OnFabric for Work {
        type Out = Result<(), String>;
        fn run<P: eps_fabric::Fabric>(self, pd: P) -> Self::Out {
            let w = eps_worker::Worker::join_on(&self.cfg, self.reg, pd).map_err(|e| crate_error(&e))?;
            match self.bench {
                WorkerBench::PushPull { iters } => {
                    crate::bench::pushpull::run_worker(w, iters.max(1)).map_err(|e| crate_error(&e))
                }
                WorkerBench::Migrate { pulls_per_step } => {
                    crate::bench::migrate::run_worker(w, pulls_per_step.max(1)).map_err(|e| crate_error(&e))
                }
                WorkerBench::Sparse { args } => crate::bench::sparse::run_worker(w, &args).map_err(|e| crate_error(&e)),
                WorkerBench::None => crate::train::worker::run(w, self.pace).map_err(|e| crate_error(&e)),
            }
        }
    }
    transport::run_on(&chosen, Work { cfg, reg, bench, pace })?
}

/// What an `eps worker` process runs instead of the built-in task, for a benchmark.
#[derive(Clone, Debug)]
pub enum WorkerBench {
    /// Train the built-in task.
    None,
    /// `eps bench pushpull`: time this many push_pull iterations.
    PushPull {
        /// Measured iterations.
        iters: u64,
    },
    /// `eps bench migrate`: train, and time pulls of shard 0 between steps.
    Migrate {
        /// Timed pulls per step.
        pulls_per_step: u32,
    },
    /// `eps bench sparse`: time sparse pulls and pushes (ITERS,KEYS,ROWS,ZIPF).
    Sparse {
        /// The benchmark's parameters.
        args: String,
    },
}

/// `eps status`: asks the control plane for the job's state and prints it
/// (one JSON object with `json`); with `watch`, again every that many
/// seconds until Ctrl-C (the screen cleared first on a terminal).
pub fn status(control: eps_control::ControlAddrs, json: bool, watch: Option<f64>) -> Result<(), String> {
    use eps_proto::control::ControlMsg;
    let secret = secret_from_env(None)?;
    let ask = if json { ControlMsg::StatusJson } else { ControlMsg::Status };
    let connect = || eps_control::ControlClient::connect(&control, &secret, Duration::from_secs(10)).map_err(|e| crate_error(&e));
    let mut c = connect()?;
    let every = match watch {
        Some(s) if s.is_finite() && s >= 0.1 => Some(Duration::from_secs_f64(s)),
        Some(_) => return Err("--watch takes seconds, at least 0.1".into()),
        None => None,
    };
    let tty = std::io::IsTerminal::is_terminal(&std::io::stdout());
    loop {
        let answer = match c.call(&ask) {
            Ok(ControlMsg::StatusReport { text }) => Ok(text),
            Ok(_) => Err("unexpected answer from the control plane".to_string()),
            Err(e) => Err(crate_error(&e)),
        };
        match (answer, every) {
            (Ok(text), None) => {
                let _ = writeln!(std::io::stdout(), "{text}");
                return Ok(());
            }
            (Err(e), None) => return Err(e),
            (Ok(text), Some(_)) => {
                let clear = if tty && !json { "\x1b[H\x1b[2J" } else { "" };
                let gap = if !tty && !json { "\n" } else { "" };
                // A reader that went away (`| head`) ends the watch quietly.
                if writeln!(std::io::stdout(), "{clear}{text}{gap}").is_err() {
                    return Ok(());
                }
            }
            // Watching: a control plane restarting is waited for.
            (Err(e), Some(_)) => {
                eps_proto::say!("eps status: {e}; trying again");
                if let Ok(n) = connect() {
                    c = n;
                }
            }
        }
        let _ = std::io::Write::flush(&mut std::io::stdout());
        std::thread::sleep(every.expect("watching"));
    }
}

/// `eps scale`: asks the control plane for `servers` servers and/or `workers`
/// workers.
pub fn scale(control: eps_control::ControlAddrs, servers: Option<u32>, workers: Option<u32>) -> Result<(), String> {
    use eps_proto::control::ControlMsg;
    if servers.is_none() && workers.is_none() {
        return Err("say what to scale: --servers N and/or --workers N".into());
    }
    // The bounds of every job, before anything is asked: a refusal of one
    // count must not leave the other half done.
    let (max_s, max_w) = (eps_proto::spec::MAX_SERVERS, eps_proto::spec::MAX_ELASTIC_WORKERS);
    if let Some(s) = servers.filter(|&s| s == 0 || s > max_s) {
        return Err(format!("--servers {s}: a job has between 1 and {max_s} servers"));
    }
    if let Some(w) = workers.filter(|&w| w == 0 || w > max_w) {
        return Err(format!("--workers {w}: a job has between 1 and {max_w} worker ranks"));
    }
    let secret = secret_from_env(None)?;
    let mut c = eps_control::ControlClient::connect(&control, &secret, Duration::from_secs(10)).map_err(|e| crate_error(&e))?;
    if let Some(servers) = servers {
        c.call(&ControlMsg::Scale { servers }).map_err(|e| crate_error(&e))?;
        println!("scaling to {servers} servers; start any new ones with `eps server --control {control}`");
    }
    if let Some(workers) = workers {
        // With --servers too, the migrations just ordered must end first.
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        loop {
            match c.call(&ControlMsg::ScaleWorkers { workers }) {
                Err(eps_control::ControlError::Rejected(r))
                    if servers.is_some() && r.code.is_temporary() && std::time::Instant::now() < deadline =>
                {
                    std::thread::sleep(Duration::from_millis(50));
                }
                r => break r.map(drop).map_err(|e| crate_error(&e))?,
            };
        }
        println!(
            "scaling to {workers} workers at the next iteration boundary; start any new ones with `eps worker --control {control}`"
        );
    }
    println!("follow with `eps status --control {control}`");
    Ok(())
}
