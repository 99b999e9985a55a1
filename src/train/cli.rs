//! `eps train`'s flags, and the job they make.

use std::path::PathBuf;

use crate::error::chain as error_chain;
use crate::json::Json;
use crate::units::format_size;

#[derive(clap::Args, Debug)]
pub struct TrainArgs {
    /// Job spec (TOML); without it, the built-in job of --model.
    #[arg(long)]
    pub spec: Option<PathBuf>,
    /// The built-in job: `synthetic` (a linear classifier with a hashed
    /// embedding, all dense) or `ctr` (click-through: embedding bags in a
    /// sparse table, an MLP; reports AUC against the teacher's). With
    /// --spec or --resume, the spec's preset (given, it must be this)
    /// [default: synthetic].
    #[arg(long)]
    pub model: Option<String>,
    /// Worker processes [built-in job: 2].
    #[arg(long)]
    pub workers: Option<u32>,
    /// Server processes [built-in job: 2].
    #[arg(long)]
    pub servers: Option<u32>,
    /// Training iterations [built-in job: 700].
    #[arg(long)]
    pub steps: Option<u64>,
    /// Consistency model: bsp, ssp or asp [built-in job: bsp].
    #[arg(long)]
    pub consistency: Option<String>,
    /// Optimizer: sgd, momentum, nesterov, adam, adamw [built-in job: adam].
    #[arg(long)]
    pub optimizer: Option<String>,
    /// Wire dtype of gradients and parameters: f32, bf16, f16 [built-in job: f32].
    #[arg(long)]
    pub dtype: Option<String>,
    /// Base learning rate [built-in job: 0.01, cosine decay after 20 warm-up steps].
    #[arg(long)]
    pub lr: Option<f64>,
    /// Samples per worker per iteration [built-in job: 512].
    #[arg(long)]
    pub batch: Option<u32>,
    /// Print progress every this many steps.
    #[arg(long, default_value_t = 50)]
    pub progress_every: u64,
    /// Also print one JSON object with the results as the last line of stdout.
    #[arg(long)]
    pub json: bool,
    /// Scale events while training runs, e.g. "200:servers=3,300:workers=3,450:servers=1":
    /// when step 200 is done the job grows to 3 servers (shards migrate onto the
    /// new one while pulls go on), at 300 a third worker joins (job.max_workers
    /// must allow it), at 450 the job shrinks to 1 server. BSP jobs only.
    #[arg(long, value_name = "STEP:servers=N|workers=N,...")]
    pub scale_plan: Option<String>,
    /// Copies of every shard: 2 keeps a backup of each on the next server,
    /// updated before each version is served; if a server dies its backups
    /// take over and training goes on with nothing lost (BSP) [default: 1].
    #[arg(long, value_name = "N")]
    pub replicas: Option<u32>,
    /// Write a checkpoint every N iterations into --checkpoint-dir.
    #[arg(long, value_name = "N")]
    pub checkpoint_every: Option<u64>,
    /// Where checkpoints go (one `ckpt-ITERATION` directory each).
    #[arg(long, value_name = "DIR")]
    pub checkpoint_dir: Option<PathBuf>,
    /// Complete checkpoints kept; older ones are removed [default: 3].
    #[arg(long, value_name = "N")]
    pub keep: Option<u32>,
    /// Resume from the newest complete checkpoint in DIR: the checkpoint's job
    /// goes on (--workers, --servers and --steps may change it) and ends as the
    /// uninterrupted run would have.
    #[arg(long, value_name = "DIR", conflicts_with = "spec")]
    pub resume: Option<PathBuf>,
    /// The data-plane transport of every server and worker (one choice for all).
    #[command(flatten)]
    pub fabric: crate::transport::TransportFlags,
    #[command(flatten)]
    pub agg: crate::aggregator::AggregatorFlag,
    /// How the processes start: `local` (child processes on 127.0.0.1) or
    /// `slurm` (each a job step of the Slurm allocation this runs in, with
    /// the CPUs and GPUs of the spec's [slurm]; the transport and aggregator
    /// are then chosen by each process on its node).
    #[arg(long, default_value = "local", value_parser = clap::builder::PossibleValuesParser::new(["local", "slurm"]))]
    pub launcher: String,
    /// Every process serves Prometheus metrics (`/metrics`) and a health
    /// check (`/healthz`) on a port of its own; each says where on stderr.
    #[arg(long)]
    pub metrics: bool,
    /// Keep the job's state in etcd, etcd://HOST:PORT[,HOST:PORT...][/PREFIX],
    /// instead of a file of the cluster's (removed from etcd when the job
    /// ends). The first stdout line is then EPS_CONTROL=ADDR,... (every
    /// control plane; clients find the leader).
    #[arg(long, value_name = "URL")]
    pub store: Option<eps_etcd::store::EtcdTarget>,
    /// Control planes of the job (with --store etcd://...): one leads, the
    /// others stand by; when the leader dies one of them takes over within
    /// seconds and training goes on.
    #[arg(long, value_name = "N", default_value_t = 1, requires = "store")]
    pub control_planes: u32,
}

/// Runs `eps train` with its flags.
pub fn train(a: TrainArgs) -> Result<(), String> {
    let o = crate::train::Overrides {
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
    crate::checkpoint::train_overrides(a.checkpoint_every, a.checkpoint_dir.as_deref(), a.keep, &mut o)?;
    let plan = crate::train::scale::parse_plan(a.scale_plan.as_deref().unwrap_or(""))?;
    let default = crate::train::default_spec(a.model.as_deref().unwrap_or("synthetic"))?;
    let build = |o: &crate::train::Overrides| match &a.resume {
        Some(dir) => crate::checkpoint::resume_spec(dir, o),
        None => crate::train::build_model_spec(a.spec.as_deref(), default, o).map_err(|e| error_chain(&e)),
    };
    let (mut spec, mut text) = build(&o)?;
    let kind = crate::jobspec::TaskSection::of(&spec).map_err(|e| e.to_string())?.map(|t| t.kind);
    match kind.as_deref() {
        None => return Err("`eps train` runs a built-in task; this checkpoint's job declares its own tensors (resume it with `eps control --resume`)".into()),
        Some(p) if a.model.as_deref().is_some_and(|m| m != p) => {
            let m = a.model.as_deref().unwrap_or_default();
            return Err(format!("the spec's model.preset is {p:?} but --model is {m:?}: give --model {p}, or leave it out"));
        }
        Some(_) => {}
    }
    if let Some(e) = plan.iter().find(|e| e.step >= spec.job.steps) {
        return Err(format!(
            "--scale-plan: the event at step {} comes when the job's {} steps are done; an event must come before the last step",
            e.step, spec.job.steps
        ));
    }
    let workers_change = plan.iter().any(|e| matches!(e.target, crate::train::scale::Target::Workers(_)));
    if workers_change && spec.job.consistency != eps_proto::Consistency::Bsp {
        return Err("--scale-plan with workers= needs a BSP job (SSP and ASP jobs keep their workers; servers= works)".into());
    }
    // Joins take new worker ranks: the plan decides how many the job may admit,
    // unless the spec says it.
    let ranks = crate::train::scale::ranks_needed(&plan, spec.job.workers);
    match spec.job.max_workers {
        Some(m) if ranks > m => {
            return Err(format!(
                "--scale-plan needs {ranks} worker ranks over the job's life (joins take new ranks) but job.max_workers is {m}"
            ));
        }
        None if ranks > spec.job.workers => {
            let o = crate::train::Overrides { max_workers: Some(ranks), ..o };
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
        let steps = crate::slurm::Steps::in_allocation(&spec.job.name, &spec.slurm)?;
        let (c, t, g) = slurm_args(&a.fabric, &a.agg, &spec, steps);
        eps_proto::say!("eps train: transport {t} and aggregator {g}, chosen by each process on its node");
        (c, t, g)
    } else {
        let chosen = crate::transport::choose_local(&a.fabric, Some(&spec.fabric))?;
        eps_proto::say!("eps train: {} transport for every server and worker", chosen.name());
        let agg = crate::aggregator::choose(&a.agg, spec.job.aggregator.as_deref())?;
        eps_proto::say!("eps train: {} aggregator on every server", agg.name());
        let children = crate::train::cluster::ChildArgs {
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
    let bar = crate::progress::Progress::new(spec.job.steps, "eps train");
    let r = crate::train::run(&spec, &text, a.progress_every.max(1), &plan, &children, |step, l| bar.update(step, l))
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

/// The flags of a cluster whose processes are Slurm job steps: the
/// transport and aggregator asked (flags, else the environment, which steps
/// inherit, else the spec, which the roles read), not probed here: each
/// process chooses on its own node. Returns them with the names asked.
pub fn slurm_args(
    fabric: &crate::transport::TransportFlags,
    agg: &crate::aggregator::AggregatorFlag,
    spec: &eps_proto::JobSpec,
    steps: eps_cluster::slurm::Steps,
) -> (eps_cluster::cluster::ChildArgs, String, String) {
    let transport = crate::transport::requested(fabric, Some(&spec.fabric));
    let aggregator = crate::aggregator::requested(agg, spec.job.aggregator.as_deref());
    let mut both: Vec<String> = fabric.transport.iter().flat_map(|t| ["--transport".to_string(), t.clone()]).collect();
    both.extend(fabric.rdma.args());
    let servers = agg.aggregator.iter().flat_map(|g| ["--aggregator".to_string(), g.clone()]).collect();
    (eps_cluster::cluster::ChildArgs { both, servers, slurm: Some(steps), ..Default::default() }, transport, aggregator)
}
