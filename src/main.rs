//! The `eps` command line.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use eps::bench::Json;
use eps::roles::{WorkerBench, crate_error as error_chain};
use eps::units::format_size;

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
    Train(Box<TrainArgs>),
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
    /// asked, a static PS cluster), `optimus` (marginal gain) and `eps` (new jobs
    /// start at once on slots taken from running ones; freed slots go back).
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
    Script(eps::slurm::ScriptArgs),
}

#[derive(clap::Args, Debug)]
struct TrainArgs {
    /// Job spec (TOML); without it, the built-in job of --model.
    #[arg(long)]
    spec: Option<PathBuf>,
    /// The built-in job: `synthetic` (a linear classifier with a hashed
    /// embedding, all dense) or `ctr` (click-through: embedding bags in a
    /// sparse table, an MLP; reports AUC against the teacher's). With
    /// --spec, the spec's preset must be this model.
    #[arg(long, default_value = "synthetic")]
    model: String,
    /// Worker processes [built-in job: 2].
    #[arg(long)]
    workers: Option<u32>,
    /// Server processes [built-in job: 2].
    #[arg(long)]
    servers: Option<u32>,
    /// Training iterations [built-in job: 700].
    #[arg(long)]
    steps: Option<u64>,
    /// Consistency model: bsp, ssp or asp [built-in job: bsp].
    #[arg(long)]
    consistency: Option<String>,
    /// Optimizer: sgd, momentum, nesterov, adam, adamw [built-in job: adam].
    #[arg(long)]
    optimizer: Option<String>,
    /// Wire dtype of gradients and parameters: f32, bf16, f16 [built-in job: f32].
    #[arg(long)]
    dtype: Option<String>,
    /// Base learning rate [built-in job: 0.01, cosine decay after 20 warm-up steps].
    #[arg(long)]
    lr: Option<f64>,
    /// Samples per worker per iteration [built-in job: 512].
    #[arg(long)]
    batch: Option<u32>,
    /// Print progress every this many steps.
    #[arg(long, default_value_t = 50)]
    progress_every: u64,
    /// Also print one JSON object with the results as the last line of stdout.
    #[arg(long)]
    json: bool,
    /// Scale events while training runs, e.g. "200:servers=3,300:workers=3,450:servers=1":
    /// when step 200 is done the job grows to 3 servers (shards migrate onto the
    /// new one while pulls go on), at 300 a third worker joins (job.max_workers
    /// must allow it), at 450 the job shrinks to 1 server. BSP jobs only.
    #[arg(long, value_name = "STEP:servers=N|workers=N,...")]
    scale_plan: Option<String>,
    /// Copies of every shard: 2 keeps a backup of each on the next server,
    /// updated before each version is served; if a server dies its backups
    /// take over and training goes on with nothing lost (BSP) [default: 1].
    #[arg(long, value_name = "N")]
    replicas: Option<u32>,
    /// Write a checkpoint every N iterations into --checkpoint-dir.
    #[arg(long, value_name = "N")]
    checkpoint_every: Option<u64>,
    /// Where checkpoints go (one `ckpt-ITERATION` directory each).
    #[arg(long, value_name = "DIR")]
    checkpoint_dir: Option<PathBuf>,
    /// Complete checkpoints kept; older ones are removed [default: 3].
    #[arg(long, value_name = "N")]
    keep: Option<u32>,
    /// Resume from the newest complete checkpoint in DIR: the checkpoint's job
    /// goes on (--workers, --servers and --steps may change it) and ends as the
    /// uninterrupted run would have.
    #[arg(long, value_name = "DIR", conflicts_with = "spec")]
    resume: Option<PathBuf>,
    /// The data-plane transport of every server and worker (one choice for all).
    #[command(flatten)]
    fabric: eps::transport::TransportFlags,
    #[command(flatten)]
    agg: eps::aggregator::AggregatorFlag,
    /// How the processes start: `local` (child processes on 127.0.0.1) or
    /// `slurm` (each a job step of the Slurm allocation this runs in, with
    /// the CPUs and GPUs of the spec's [slurm]; the transport and aggregator
    /// are then chosen by each process on its node).
    #[arg(long, default_value = "local", value_parser = clap::builder::PossibleValuesParser::new(["local", "slurm"]))]
    launcher: String,
    /// Every process serves Prometheus metrics (`/metrics`) and a health
    /// check (`/healthz`) on a port of its own; each says where on stderr.
    #[arg(long)]
    metrics: bool,
    /// Keep the job's state in etcd, etcd://HOST:PORT[,HOST:PORT...][/PREFIX],
    /// instead of a file of the cluster's (removed from etcd when the job
    /// ends). The first stdout line is then EPS_CONTROL=ADDR,... (every
    /// control plane; clients find the leader).
    #[arg(long, value_name = "URL")]
    store: Option<eps_etcd::store::EtcdTarget>,
    /// Control planes of the job (with --store etcd://...): one leads, the
    /// others stand by; when the leader dies one of them takes over within
    /// seconds and training goes on.
    #[arg(long, value_name = "N", default_value_t = 1, requires = "store")]
    control_planes: u32,
}

fn train(a: TrainArgs) -> Result<(), String> {
    let o = eps::train::Overrides {
        workers: a.workers,
        servers: a.servers,
        steps: a.steps,
        consistency: a.consistency,
        optimizer: a.optimizer,
        dtype: a.dtype,
        lr: a.lr,
        batch: a.batch,
        replicas: a.replicas,
        ..Default::default()
    };
    let mut o = o;
    eps::checkpoint::train_overrides(a.checkpoint_every, a.checkpoint_dir.as_deref(), a.keep, &mut o)?;
    let plan = eps::train::scale::parse_plan(a.scale_plan.as_deref().unwrap_or(""))?;
    let default = eps::train::default_spec(&a.model)?;
    let build = |o: &eps::train::Overrides| match &a.resume {
        Some(dir) => eps::checkpoint::resume_spec(dir, o),
        None => eps::train::build_model_spec(a.spec.as_deref(), default, o).map_err(|e| error_chain(&e)),
    };
    let (mut spec, mut text) = build(&o)?;
    match spec.model.preset.as_deref() {
        None => return Err("`eps train` runs a built-in task; this checkpoint's job declares its own tensors (resume it with `eps control --resume`)".into()),
        Some(p) if p != a.model => {
            return Err(format!("the spec's model.preset is {p:?} but --model is {:?}: give --model {p}", a.model));
        }
        Some(_) => {}
    }
    let workers_change = plan.iter().any(|e| matches!(e.target, eps::train::scale::Target::Workers(_)));
    if workers_change && spec.job.consistency != eps_proto::Consistency::Bsp {
        return Err("--scale-plan with workers= needs a BSP job (SSP and ASP jobs keep their workers; servers= works)".into());
    }
    // Joins take new worker ranks: the plan decides how many the job may admit,
    // unless the spec says it.
    let ranks = eps::train::scale::ranks_needed(&plan, spec.job.workers);
    match spec.job.max_workers {
        Some(m) if ranks > m => {
            return Err(format!(
                "--scale-plan needs {ranks} worker ranks over the job's life (joins take new ranks) but job.max_workers is {m}"
            ));
        }
        None if ranks > spec.job.workers => {
            let o = eps::train::Overrides { max_workers: Some(ranks), ..o };
            (spec, text) = build(&o)?;
        }
        _ => {}
    }
    let layout = spec.layout().map_err(|e| e.to_string())?;
    let opt = spec.optimizer().map_err(|e| e.to_string())?;
    for t in &spec.model.tables {
        eps_proto::say!("eps train: sparse table {:?}: rows of {} values, created on first touch", t.name, t.dim);
    }
    eps_proto::say!(
        "eps train: {} workers, {} servers, {} steps, {}, {}, {}; model {} parameters ({}) in {} shards",
        spec.job.workers,
        spec.job.servers,
        spec.job.steps,
        spec.job.consistency.name(),
        opt.name(),
        spec.job.dtype,
        layout.total,
        format_size(layout.bytes()),
        layout.shards.len()
    );
    let (mut children, transport, aggregator) = if a.launcher == "slurm" {
        let steps = eps::slurm::Steps::in_allocation(&spec.job.name, &spec.slurm)?;
        let (c, t, g) = eps::train::cluster::slurm_args(&a.fabric, &a.agg, &spec, steps);
        eps_proto::say!("eps train: transport {t} and aggregator {g}, chosen by each process on its node");
        (c, t, g)
    } else {
        let chosen = eps::transport::choose_local(&a.fabric, Some(&spec.fabric))?;
        eps_proto::say!("eps train: {} transport for every server and worker", chosen.name());
        let agg = eps::aggregator::choose(&a.agg, spec.job.aggregator.as_deref())?;
        eps_proto::say!("eps train: {} aggregator on every server", agg.name());
        let children = eps::train::cluster::ChildArgs {
            both: a.fabric.child_args(&chosen),
            servers: vec!["--aggregator".into(), agg.name().into()],
            ..Default::default()
        };
        (children, chosen.name().to_string(), agg.name().to_string())
    };
    children.metrics = a.metrics;
    if !(1..=7).contains(&a.control_planes) {
        return Err(format!("--control-planes {}: give 1 to 7 (one leads, the others stand by)", a.control_planes));
    }
    if a.store.is_some() && a.launcher == "slurm" {
        return Err("--store with --launcher slurm is not supported yet: run etcd-backed control planes with `eps control --store` steps of your own, or drop --store".into());
    }
    if let Some(t) = &a.store {
        eps_proto::say!(
            "eps train: the job's state in {t}; {} control plane{}",
            a.control_planes,
            if a.control_planes == 1 { "" } else { "s (one leads, the others stand by)" }
        );
    }
    (children.etcd, children.control_planes) = (a.store, a.control_planes);
    let bar = eps::progress::Progress::new(spec.job.steps, "eps train");
    let r = eps::train::run(&spec, &text, a.progress_every.max(1), &plan, &children, |step, l| bar.update(step, l))
        .map_err(|e| error_chain(&e))?;
    drop(bar);
    match (r.final_auc, r.teacher_auc) {
        (Some(auc), Some(teacher)) => println!(
            "trained {} steps in {:.1} s: held-out AUC {auc:.4} (teacher {teacher:.4}), accuracy {:.4}, log loss {:.4}",
            r.steps, r.elapsed_s, r.final_accuracy, r.final_loss
        ),
        _ => println!(
            "trained {} steps in {:.1} s: held-out accuracy {:.4} (teacher {:.4}), loss {:.4}",
            r.steps, r.elapsed_s, r.final_accuracy, r.teacher_accuracy, r.final_loss
        ),
    }
    println!(
        "{:.0} samples/s; push {:.2} GB/s, pull {:.2} GB/s (all workers); params checksum {}",
        r.samples_per_s, r.push_gbytes_per_s, r.pull_gbytes_per_s, r.params_checksum
    );
    if a.json {
        let j = Json::new()
            .int("steps", r.steps)
            .num("final_loss", r.final_loss)
            .num("final_accuracy", r.final_accuracy)
            .num("teacher_accuracy", r.teacher_accuracy)
            .str("params_checksum", &r.params_checksum)
            .str("transport", &transport)
            .str("aggregator", &aggregator)
            .str("launcher", &a.launcher)
            .num("samples_per_s", r.samples_per_s)
            .num("push_gbytes_per_s", r.push_gbytes_per_s)
            .num("pull_gbytes_per_s", r.pull_gbytes_per_s)
            .num("elapsed_s", r.elapsed_s)
            .int("workers", spec.job.workers as u64)
            .int("servers", spec.job.servers as u64)
            .str("consistency", spec.job.consistency.name())
            .str("optimizer", opt.name())
            .str("dtype", &spec.job.dtype)
            .int("scale_events", r.scale_events)
            .int("migrations", r.migrations)
            .int("splits", r.splits)
            .int("bucket_moves", r.bucket_moves)
            .int("membership_changes", r.membership_changes)
            .str("membership", &r.membership)
            .int("resumed_at", spec.resume.as_ref().map_or(0, |r| r.iteration))
            .int("rollbacks", r.rollbacks)
            .int("iterations_lost", r.iterations_lost);
        let j = match (r.final_auc, r.teacher_auc, &r.sparse_checksum) {
            (Some(auc), Some(teacher), Some(sum)) => {
                j.num("final_auc", auc).num("teacher_auc", teacher).str("sparse_checksum", sum).finish()
            }
            _ => j.finish(),
        };
        println!("{j}");
    }
    Ok(())
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
        Cmd::Train(a) => train(*a),
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
        Cmd::Slurm(SlurmCmd::Script(a)) => eps::slurm::script(&a),
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
