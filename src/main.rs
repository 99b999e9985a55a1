//! The `eps` command line.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use eps::roles::WorkerBench;

/// EPS: an elastic parameter server for distributed ML training.
///
/// Workers push gradients and pull parameters through registered memory with RDMA
/// verbs semantics; the `soft` transport provides those semantics over TCP with
/// io_uring, so everything runs on commodity machines.
#[derive(Parser, Debug)]
#[command(name = "eps", version = concat!(env!("CARGO_PKG_VERSION"), " (", env!("EPS_BUILD_TARGET"), ", ", env!("EPS_BUILD_PROFILE"), ")"))]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
    /// How logs are written on stderr: `text` (lines) or `json` (one object
    /// per line: ts, level, role, pid, msg, and for scale events,
    /// migrations, failovers and peers cut off, `event` and its ids). A
    /// local cluster's processes log the same way [default: the
    /// EPS_LOG_FORMAT environment variable, else text].
    #[arg(long, global = true, value_name = "FORMAT")]
    log_format: Option<eps_metrics::log::LogFormat>,
}

/// `eps sched ...`.
#[derive(Subcommand, Debug)]
enum SchedCmd {
    /// Measure the scheduler's cluster model here with real EPS processes
    /// (push/pull bandwidth, an iteration's fixed cost, aggregation rate,
    /// migration throughput; then a live job rescaled every 1.5 s: its start
    /// delay, rescale pauses, and what each further worker adds to an
    /// iteration) and write it for `eps sim --cluster` and `eps sched run`.
    Calibrate(eps::calibrate::CalibrateArgs),
    /// Replay a trace with real EPS jobs on this machine, started, rescaled
    /// and killed by a policy (or several, one after the other).
    ///
    /// Each job is the built-in synthetic task at the trace's model size and
    /// batch; its workers sleep out the trace's compute time per sample and
    /// stop after its samples; a job whose trace row says so is killed at its
    /// feedback. Prints the simulator's table for each run, how far the
    /// simulator's per-job times are from the measured ones, and (--verify)
    /// whether jobs whose servers were rescaled end with a static run's
    /// parameters. `eps sched run --trace bench/traces/live.csv --policy
    /// static,eps --time-scale 0.2 --verify`.
    Run(eps::live::cli::RunArgs),
    /// Serve as this machine's scheduler: run the jobs `eps submit` sends,
    /// started, rescaled and killed by the policy, until Ctrl-C (which stops
    /// every job). Prints `EPS_SCHED=SOCKET` first.
    Serve(eps::live::serve::ServeArgs),
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Train the built-in synthetic task on a local cluster (the main job).
    ///
    /// Starts a control plane, --servers servers and --workers workers as separate
    /// processes on 127.0.0.1 with the embedded file-backed store, trains, and prints
    /// progress and a summary. Ctrl-C, or any process failing, stops them all.
    Train(Box<eps::train::cli::TrainArgs>),
    /// Start a job for a framework's workers: a control plane and its servers.
    ///
    /// Starts the control plane and --servers servers as child processes and
    /// waits for --workers workers to join through libeps or the Python package
    /// (`import eps`). Prints `EPS_CONTROL=HOST:PORT` as its first line, then,
    /// unless EPS_JOB_SECRET is set, `EPS_JOB_SECRET_FILE=PATH` (a secret it
    /// generated, readable by this user only): export them for the workers.
    /// Stops when every worker and server has finished, or on Ctrl-C.
    Up(eps::up::UpArgs),
    /// Simulate the multi-job scheduler on a trace: `static` (FIFO at the sizes
    /// asked, a static PS cluster), `optimus` (marginal gain), `pollux`
    /// (goodput) and `eps` (new jobs start at once on slots taken from running
    /// ones; freed slots go back).
    ///
    /// `eps sim --trace bench/traces/exploration.csv --compare` prints one row
    /// per policy: feedback latency (submit to the job's feedback samples), JCT
    /// of the jobs run to completion, makespan, utilization, rescales, the
    /// longest queue wait. `eps sim generate` writes synthetic traces.
    Sim(eps::sim::SimArgs),
    /// Train a local job with backups under faults for a few minutes, and
    /// check that nothing was lost.
    ///
    /// 8 workers and 4 servers with `replicas = 2` train while, every few
    /// seconds, a server is killed (and replaced), the servers scale out or
    /// in, a server or a worker stops for less than its lease, or the control
    /// plane is killed. Then the same steps run without faults. Reports
    /// errors, faults and recoveries, lost updates (parameter chunks whose
    /// bits differ from the fault-free run), resident-memory growth and
    /// push_pull latency; exits non-zero unless errors and lost updates are 0
    /// and memory grew 10% at most.
    Soak(eps::soak::SoakArgs),
    /// The multi-job scheduler on this machine.
    #[command(subcommand)]
    Sched(SchedCmd),
    /// Submit a job to the scheduler (`eps sched serve`).
    ///
    /// The file is TOML with the trace's columns as keys: name, param_bytes,
    /// compute_ms_per_sample, batch, samples, feedback_samples, min_workers,
    /// max_workers, min_servers, max_servers (and kill_after_feedback = true to
    /// have it killed at its feedback).
    Submit {
        /// The job (TOML).
        file: PathBuf,
        /// The scheduler's socket [default: as `eps sched serve`'s].
        #[arg(long)]
        socket: Option<PathBuf>,
    },
    /// List the scheduler's jobs: state, allocation, samples, times.
    Jobs {
        /// The scheduler's socket [default: as `eps sched serve`'s].
        #[arg(long)]
        socket: Option<PathBuf>,
    },
    /// Kill a queued or running job of the scheduler; its slots go to the others.
    Kill {
        /// The job's name.
        job: String,
        /// The scheduler's socket [default: as `eps sched serve`'s].
        #[arg(long)]
        socket: Option<PathBuf>,
    },
    /// Run the control plane of one job (membership, placement; never on the data path).
    ///
    /// With --resume, the job continues from the newest complete checkpoint in
    /// DIR (its spec, parameters, optimizer state and data position), on any
    /// number of servers and workers.
    Control {
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1:7100")]
        listen: SocketAddr,
        /// The job spec (TOML; `-`: read it from stdin).
        #[arg(long, required_unless_present = "resume", conflicts_with = "resume")]
        spec: Option<PathBuf>,
        /// Resume from the newest complete checkpoint in this directory (or this
        /// checkpoint's own directory).
        #[arg(long, value_name = "DIR")]
        resume: Option<PathBuf>,
        /// With --resume: servers of the resumed job [default: the checkpoint's spec's].
        #[arg(long, requires = "resume")]
        servers: Option<u32>,
        /// With --resume: workers of the resumed job [default: the checkpoint's spec's].
        #[arg(long, requires = "resume")]
        workers: Option<u32>,
        /// With --resume: the iteration the job ends at [default: the checkpoint's spec's].
        #[arg(long, requires = "resume")]
        steps: Option<u64>,
        /// Directory of the fsync'd state log (the embedded store).
        #[arg(long, default_value = "eps-state")]
        state_dir: PathBuf,
        /// Keep the job's state in etcd instead:
        /// etcd://HOST:PORT[,HOST:PORT...][/PREFIX] (default prefix /eps).
        /// Several `eps control` of one job (same spec and secret) against
        /// one etcd: one leads, the others stand by and take over within
        /// seconds when it dies.
        #[arg(long, value_name = "URL", conflicts_with = "state_dir")]
        store: Option<eps_etcd::store::EtcdTarget>,
        /// Serve Prometheus metrics (`/metrics`) and a health check
        /// (`/healthz`) over HTTP on this address (port 0: any; it says which).
        #[arg(long, value_name = "ADDR")]
        metrics: Option<SocketAddr>,
        /// Exit when the parent process exits.
        #[arg(long, hide = true)]
        exit_with_parent: bool,
    },
    /// Run a parameter server of the job whose control plane is at --control.
    ///
    /// The job secret comes from EPS_JOB_SECRET, or the file EPS_JOB_SECRET_FILE names.
    Server {
        /// The control plane's address, or its addresses (leader and
        /// standbys, any order): HOST:PORT[,HOST:PORT...].
        #[arg(long, value_name = "ADDRS", env = "EPS_CONTROL")]
        control: eps_control::ControlAddrs,
        /// IP to accept workers on (the port is picked by the OS), or `route`:
        /// the address this host reaches the control plane from (what the
        /// Slurm launcher gives) [default: 127.0.0.1 on the soft transport;
        /// on rdma, unless an IP is given, the RDMA device's GID address].
        #[arg(long, value_name = "IP|route")]
        listen_ip: Option<eps::roles::ListenIp>,
        #[command(flatten)]
        fabric: eps::transport::TransportFlags,
        #[command(flatten)]
        agg: eps::aggregator::AggregatorFlag,
        /// Threads an update of a large shard is split over, at most 2 (0: one per core).
        #[arg(long, default_value_t = 1)]
        threads: usize,
        /// Serve Prometheus metrics (`/metrics`) and a health check
        /// (`/healthz`) over HTTP on this address (port 0: any; it says which).
        #[arg(long, value_name = "ADDR")]
        metrics: Option<SocketAddr>,
        /// Seconds to wait for the control plane and for every worker to connect.
        #[arg(long, default_value_t = 120)]
        timeout: u64,
        /// Exit when the parent process exits.
        #[arg(long, hide = true)]
        exit_with_parent: bool,
    },
    /// Run a worker on the built-in synthetic task of the job at --control.
    ///
    /// The job secret comes from EPS_JOB_SECRET, or the file EPS_JOB_SECRET_FILE names. Models
    /// other than the built-in one use the eps-worker library (or libeps) instead.
    Worker {
        /// The control plane's address, or its addresses (leader and
        /// standbys, any order): HOST:PORT[,HOST:PORT...].
        #[arg(long, value_name = "ADDRS", env = "EPS_CONTROL")]
        control: eps_control::ControlAddrs,
        /// Print progress every this many steps (rank 0).
        #[arg(long, default_value_t = 50)]
        progress_every: u64,
        /// Serve Prometheus metrics (`/metrics`) and a health check
        /// (`/healthz`) over HTTP on this address (port 0: any; it says which).
        #[arg(long, value_name = "ADDR")]
        metrics: Option<SocketAddr>,
        #[command(flatten)]
        fabric: eps::transport::TransportFlags,
        /// Seconds to wait for the control plane, the plan and each transfer.
        #[arg(long, default_value_t = 120)]
        timeout: u64,
        /// (internal) Stop once the job has trained this many samples (the
        /// scheduler's live runs).
        #[arg(long, hide = true)]
        until_samples: Option<u64>,
        /// (internal) Each step computes for at least this many milliseconds per
        /// sample of the batch (an accelerator's time, slept).
        #[arg(long, hide = true, default_value_t = 0.0)]
        compute_ms_per_sample: f64,
        /// (internal) Print push_pull latencies every this many milliseconds
        /// (`eps soak`).
        #[arg(long, hide = true, default_value_t = 0)]
        latency_every_ms: u64,
        /// (internal) Report a digest per shard_bytes of the final parameters
        /// (`eps soak`).
        #[arg(long, hide = true)]
        chunk_digests: bool,
        /// (internal) Time this many push_pull iterations instead of training.
        #[arg(long, hide = true)]
        bench_iters: Option<u64>,
        /// (internal) Train, timing this many pulls of shard 0 after each step.
        #[arg(long, hide = true, conflicts_with = "bench_iters")]
        bench_migrate: Option<u32>,
        /// (internal) Time sparse pulls and pushes (ITERS,KEYS,ROWS,ZIPF).
        #[arg(long, hide = true, conflicts_with_all = ["bench_iters", "bench_migrate"])]
        bench_sparse: Option<String>,
        /// Exit when the parent process exits.
        #[arg(long, hide = true)]
        exit_with_parent: bool,
    },
    /// Show the state of the job whose control plane is at --control.
    ///
    /// The job secret comes from EPS_JOB_SECRET, or the file EPS_JOB_SECRET_FILE names.
    Status {
        /// The control plane's address, or its addresses (leader and
        /// standbys, any order): HOST:PORT[,HOST:PORT...].
        #[arg(long, value_name = "ADDRS", env = "EPS_CONTROL")]
        control: eps_control::ControlAddrs,
        /// One JSON object: health (`healthy`, `problems`), the leader
        /// (`leader`: address and pid), epoch, iteration and rate, every
        /// worker and server with its state, health and lease age.
        #[arg(long)]
        json: bool,
        /// Show it again every SECS seconds until Ctrl-C.
        #[arg(long, value_name = "SECS", num_args = 0..=1, default_missing_value = "2")]
        watch: Option<f64>,
    },
    /// Take a checkpoint of a running job and wait until it is complete.
    ///
    /// The control plane picks an iteration no worker has begun; every server
    /// saves its shards when it publishes that version (training pauses only
    /// for the copy), and the manifest is written last, so a torn checkpoint is
    /// never taken for a good one. Resume with `eps train --resume DIR` or `eps
    /// control --resume DIR`. The job secret comes from EPS_JOB_SECRET, or the file EPS_JOB_SECRET_FILE names.
    Checkpoint {
        /// The control plane's address, or its addresses (leader and
        /// standbys, any order): HOST:PORT[,HOST:PORT...].
        #[arg(long, value_name = "ADDRS", env = "EPS_CONTROL")]
        control: eps_control::ControlAddrs,
        /// Directory of the job's checkpoints [default: the spec's job.checkpoint_dir].
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Seconds to wait for the checkpoint.
        #[arg(long, default_value_t = 600)]
        timeout: u64,
    },
    /// Grow or shrink the servers and/or workers of a running job (BSP).
    ///
    /// Servers, growing: the control plane makes room for the new servers; start
    /// them with `eps server --control ADDR` and shards migrate onto them until
    /// bytes are balanced. Shrinking: the highest-ranked servers hand their shards
    /// to the others, then exit. Training and pulls go on throughout.
    ///
    /// Workers: the change is voted at the next iteration boundary nobody has
    /// begun; joining workers take new ranks (up to job.max_workers over the
    /// job's life) and start at that boundary (start them with `eps worker
    /// --control ADDR`); leaving workers are the highest ranks, they exit there.
    /// `eps status` shows both. The job secret comes from EPS_JOB_SECRET, or the file EPS_JOB_SECRET_FILE names.
    #[command(arg_required_else_help = true)]
    Scale {
        /// The control plane's address, or its addresses (leader and
        /// standbys, any order): HOST:PORT[,HOST:PORT...].
        #[arg(long, value_name = "ADDRS", env = "EPS_CONTROL")]
        control: eps_control::ControlAddrs,
        /// Wanted number of servers.
        #[arg(long)]
        servers: Option<u32>,
        /// Wanted number of workers.
        #[arg(long)]
        workers: Option<u32>,
    },
    /// Measure the system: fabric, aggregation, push/pull through real processes.
    #[command(subcommand)]
    Bench(eps::bench::cli::BenchCmd),
    /// RDMA devices for the `rdma` transport (built with the `rdma` feature).
    #[command(subcommand)]
    Rdma(RdmaCmd),
    /// Running through Slurm (`eps train --launcher slurm` inside an allocation).
    #[command(subcommand)]
    Slurm(SlurmCmd),
}

/// `eps slurm ...`.
#[derive(Subcommand, Debug)]
enum SlurmCmd {
    /// Print an sbatch script that runs a job: the allocation its roles
    /// need (from the spec's [job] and [slurm]), a fresh job secret, and
    /// `eps train --launcher slurm` on the spec, which the script carries.
    ///
    /// `eps slurm script --spec job.toml --time 2:00:00 > job.sbatch && sbatch
    /// job.sbatch`. Flags after `--` go to `eps train` (e.g. `--
    /// --scale-plan 200:servers=4`).
    Script(eps::train::sbatch::ScriptArgs),
}

#[derive(Subcommand, Debug)]
enum RdmaCmd {
    /// List this machine's RDMA devices, their ports and GIDs, and the device, port
    /// and GID the `rdma` transport would use.
    ///
    /// Anything not named is chosen by a fixed rule: the first device with an active
    /// port, its first active port, and on Ethernet (RoCE) the first RoCE v2 GID (an
    /// IPv4-mapped one first), on InfiniBand GID 0. EPS_RDMA_DEVICE, EPS_RDMA_PORT and
    /// EPS_RDMA_GID_INDEX name them too. Exits non-zero, saying what it found, when
    /// no device can be used.
    Devices {
        #[command(flatten)]
        rdma: eps::rdma::Named,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
}

fn main() -> ExitCode {
    use clap::{CommandFactory, FromArgMatches};
    let matches = Cli::command().get_matches();
    let role = matches.subcommand_name().unwrap_or("eps").to_string();
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(c) => c,
        Err(e) => e.exit(),
    };
    let format = match cli.log_format {
        Some(f) => f,
        None => match std::env::var("EPS_LOG_FORMAT").ok().filter(|v| !v.is_empty()).map(|v| v.parse()) {
            None => eps_metrics::log::LogFormat::Text,
            Some(Ok(f)) => f,
            Some(Err(e)) => {
                eps_proto::say!("eps: error: EPS_LOG_FORMAT: {e}");
                return ExitCode::FAILURE;
            }
        },
    };
    eps_metrics::log::init(format, &role);
    let res = match cli.cmd {
        Cmd::Train(a) => eps::train::cli::train(*a),
        Cmd::Up(a) => eps::up::run(a),
        Cmd::Sim(a) => eps::sim::run(a),
        Cmd::Soak(a) => eps::soak::run(a),
        Cmd::Sched(SchedCmd::Calibrate(a)) => eps::calibrate::run(a),
        Cmd::Sched(SchedCmd::Run(a)) => eps::live::cli::run(a),
        Cmd::Sched(SchedCmd::Serve(a)) => eps::live::serve::serve(a),
        Cmd::Submit { file, socket } => match std::fs::read_to_string(&file) {
            Ok(text) => eps::live::serve::request(socket, "submit", &text).map_err(|e| format!("{}: {e}", file.display())),
            Err(e) => Err(format!("cannot read {}: {e}", file.display())),
        },
        Cmd::Jobs { socket } => eps::live::serve::request(socket, "jobs", ""),
        Cmd::Kill { job, socket } => eps::live::serve::request(socket, &format!("kill {job}"), ""),
        Cmd::Control { listen, spec, resume, servers, workers, steps, state_dir, store, metrics, exit_with_parent } => {
            if exit_with_parent {
                eps::roles::exit_with_parent();
            }
            eps::roles::serve_metrics("control", metrics).and_then(|()| match (spec, resume) {
                (_, Some(dir)) => {
                    let o = eps::train::Overrides { servers, workers, steps, ..Default::default() };
                    eps::checkpoint::resume_spec(&dir, &o)
                        .and_then(|(spec, text)| eps::roles::control_spec(listen, &spec, &text, &state_dir, store.as_ref()))
                }
                (Some(spec), None) => eps::roles::control(listen, &spec, &state_dir, store.as_ref()),
                (None, None) => Err("give --spec FILE or --resume DIR".into()),
            })
        }
        Cmd::Checkpoint { control, dir, timeout } => {
            eps::checkpoint::take(control, dir.as_deref(), Duration::from_secs(timeout.max(1)))
        }
        Cmd::Server { control, listen_ip, fabric, agg, threads, metrics, timeout, exit_with_parent } => {
            if exit_with_parent {
                eps::roles::exit_with_parent();
            }
            eps::roles::serve_metrics("server", metrics).and_then(|()| {
                eps::roles::server(control, listen_ip, threads, Duration::from_secs(timeout.max(1)), &fabric, &agg)
            })
        }
        Cmd::Worker {
            control,
            progress_every,
            fabric,
            timeout,
            until_samples,
            compute_ms_per_sample,
            latency_every_ms,
            chunk_digests,
            bench_iters,
            bench_migrate,
            bench_sparse,
            metrics,
            exit_with_parent,
        } => {
            if exit_with_parent {
                eps::roles::exit_with_parent();
            }
            if let Err(e) = eps::roles::serve_metrics("worker", metrics) {
                eps_proto::say!("eps: error: {e}");
                return ExitCode::FAILURE;
            }
            let bench = match (bench_iters, bench_migrate, bench_sparse) {
                (Some(iters), _, _) => WorkerBench::PushPull { iters },
                (_, Some(pulls_per_step), _) => WorkerBench::Migrate { pulls_per_step },
                (_, _, Some(args)) => WorkerBench::Sparse { args },
                _ => WorkerBench::None,
            };
            let pace = eps::train::worker::Pace {
                every: progress_every.max(1),
                until_samples,
                compute_ms_per_sample,
                latency_every_ms,
                chunk_digests,
            };
            if compute_ms_per_sample.is_finite() && compute_ms_per_sample >= 0.0 {
                eps::roles::worker(control, pace, bench, Duration::from_secs(timeout.max(1)), &fabric)
            } else {
                Err("--compute-ms-per-sample must be a number of milliseconds, 0 or more".into())
            }
        }
        Cmd::Bench(c) => eps::bench::cli::run(c),
        Cmd::Status { control, json, watch } => eps::roles::status(control, json, watch),
        Cmd::Rdma(RdmaCmd::Devices { rdma, json }) => eps::rdma::devices(&rdma, json),
        Cmd::Slurm(SlurmCmd::Script(a)) => eps::train::sbatch::script(&a),
        Cmd::Scale { control, servers, workers } => eps::roles::scale(control, servers, workers),
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(target: "eps", "eps: error: {e}");
            ExitCode::FAILURE
        }
    }
}
