//! `eps sim`: the multi-job scheduler's trace-driven simulator (`eps-sched`),
//! and `eps sim generate`, which writes the synthetic traces.

use std::path::PathBuf;

use eps_sched::policy::{NAMES, by_name};
use eps_sched::{ClusterModel, JobSpec, pollux, sim, synth, trace};

use crate::json::Json;

/// `eps sim`'s arguments.
#[derive(clap::Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct SimArgs {
    #[command(subcommand)]
    pub cmd: Option<SimCmd>,
    /// The trace: EPS's CSV (columns in the README), or the Pollux/Philly
    /// workload format `name,time,application,num_replicas,batch_size`, read
    /// with --models.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// The model table of a Pollux/Philly-format trace (TOML, one table per
    /// application: param_bytes, compute_ms_per_sample, samples,
    /// feedback_fraction [0.05], kill_fraction [0.6]) [default: built in,
    /// for bert, cifar10, deepspeech2, imagenet, ncf and yolov3]
    #[arg(long)]
    pub models: Option<PathBuf>,
    /// Arrivals this many times as dense as the trace's (submit times
    /// divided by it).
    #[arg(long, default_value_t = 1.0)]
    pub load: f64,
    /// Policy: static (FIFO at the sizes asked), optimus (marginal gain), eps.
    #[arg(long, default_value = "eps", value_parser = clap::builder::PossibleValuesParser::new(NAMES))]
    pub policy: String,
    /// Run every policy on the trace, one table.
    #[arg(long)]
    pub compare: bool,
    #[command(flatten)]
    pub cluster_of: Cluster,
    /// The cluster model (TOML; default: built-in figures).
    #[arg(long)]
    pub cluster: Option<PathBuf>,
    #[command(flatten)]
    pub out: Report,
    /// Each job's real speed differs from the model's by a factor between
    /// 1/(1+X) and 1+X, drawn per job from --seed; policies plan with the
    /// model until a job has run 2 s, then with its measured speed.
    #[arg(long, default_value_t = 0.0)]
    pub noise: f64,
    /// Seed of the speed factors (--noise): a run is the same for a seed.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// The cluster a scheduler runs on: a number of slots, or nodes with theirs.
#[derive(clap::Args, Debug)]
pub struct Cluster {
    /// Slots (one worker or server process each), on one node [default: 48
    /// for `eps sim`, 8 for `eps sched run` and `serve`].
    #[arg(long, conflicts_with = "nodes")]
    pub slots: Option<u32>,
    /// Nodes with their slots, e.g. node1:16,node2:16 (jobs' processes are
    /// placed on them, a job kept on as few nodes as it can).
    #[arg(long, value_name = "NAME:SLOTS,...")]
    pub nodes: Option<String>,
}

impl Cluster {
    /// The slots and the nodes (one node without --nodes).
    pub fn resolve(&self, default_slots: u32) -> Result<(u32, Vec<eps_sched::placement::Node>), String> {
        match &self.nodes {
            Some(t) => {
                let n = eps_sched::placement::parse_nodes(t).map_err(|e| format!("--nodes: {e}"))?;
                Ok((n.iter().map(|n| n.slots).sum(), n))
            }
            None => {
                let s = self.slots.unwrap_or(default_slots);
                if s == 0 {
                    return Err("--slots must be at least 1".into());
                }
                Ok((s, eps_sched::placement::one_node(s)))
            }
        }
    }
}

/// How a scheduler run (simulated or live) is reported.
#[derive(clap::Args, Debug)]
pub struct Report {
    /// Also print each job's times.
    #[arg(long)]
    pub jobs: bool,
    /// One JSON line per policy.
    #[arg(long)]
    pub json: bool,
    /// Draw slots allocated over time and the feedback-latency distribution
    /// of each policy's run into this PNG.
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

/// `eps sim generate` and `eps sim grid`.
#[derive(clap::Subcommand, Debug)]
pub enum SimCmd {
    /// Every policy over workloads x loads x cluster sizes (default: the
    /// three built-in Philly-derived workloads at 2x, 4x, 8x their arrival
    /// rate on 16, 32 and 64 slots); says in which contended cells a
    /// baseline beats `eps` on average feedback latency or JCT.
    Grid(crate::sim_grid::GridArgs),
    /// Print a synthetic trace (CSV) on stdout.
    Generate {
        /// exploration (bursts of hyper-parameter sweeps, most jobs killed at
        /// their feedback) or steady (Poisson arrivals of mixed jobs).
        #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(["exploration", "steady"]))]
        kind: String,
        /// Jobs.
        #[arg(long, default_value_t = 200)]
        jobs: usize,
        /// Seed.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Arrivals this many times as dense (submit times divided by it), to
        /// load a larger cluster as the default traces load 48 slots.
        #[arg(long, default_value_t = 1.0)]
        load: f64,
    },
}

/// Runs `eps sim`.
pub fn run(a: SimArgs) -> Result<(), String> {
    if let Some(SimCmd::Grid(g)) = a.cmd {
        return crate::sim_grid::run(g);
    }
    if let Some(SimCmd::Generate { kind, jobs, seed, load }) = a.cmd {
        if jobs == 0 {
            return Err("--jobs must be at least 1".into());
        }
        if !(load.is_finite() && load > 0.0) {
            return Err("--load must be a positive number".into());
        }
        let (mut t, what) = match kind.as_str() {
            "steady" => (synth::steady(seed, jobs), "steady mixed load"),
            _ => (synth::exploration(seed, jobs), "feedback-driven exploration"),
        };
        for j in &mut t {
            j.submit_s = (j.submit_s / load * 1000.0).round() / 1000.0;
        }
        let cmd = format!("eps sim generate --kind {kind} --jobs {jobs} --seed {seed} --load {load}");
        print!("{}", synth::to_csv(&t, &format!("{what}: {cmd}")));
        return Ok(());
    }
    let path = a.trace.ok_or("--trace FILE is needed (or `eps sim generate` to make one)")?;
    if !(a.load.is_finite() && a.load > 0.0) {
        return Err("--load must be a positive number".into());
    }
    let jobs = eps_sched::grid::compressed(&load_any_trace(&path, a.models.as_deref())?, a.load);
    let model = load_model(a.cluster.as_deref())?;
    let (slots, nodes) = a.cluster_of.resolve(48)?;
    check_fits(&jobs, slots)?;
    if !(a.noise.is_finite() && a.noise >= 0.0) {
        return Err("--noise must be 0 or more".into());
    }
    let opts = sim::Options { noise: a.noise, seed: a.seed, nodes, ..sim::Options::default() };
    let policies: Vec<&str> = if a.compare { NAMES.to_vec() } else { vec![a.policy.as_str()] };
    eps_proto::say!("eps sim: {} jobs from {} on {slots} slots", jobs.len(), path.display());
    if !a.out.json {
        print_header();
    }
    let mut runs = Vec::new();
    let bar = crate::progress::Progress::new(policies.len() as u64, "eps sim");
    for (i, name) in policies.into_iter().enumerate() {
        bar.tick(i as u64, &format!("simulating {name}"));
        let mut p = by_name(name).ok_or_else(|| format!("unknown policy {name}"))?;
        let started = std::time::Instant::now();
        let (s, rec) = sim::run_with(&jobs, slots, &model, p.as_mut(), &opts).map_err(|e| e.to_string())?;
        let took = started.elapsed().as_secs_f64();
        if a.out.jobs {
            print_jobs(name, &rec);
        }
        if a.out.json {
            println!("{}", summary_json(&s, slots).num("simulated_in_s", took).finish());
        } else {
            print_row(&s);
        }
        runs.push((s, rec));
    }
    drop(bar);
    if let Some(p) = &a.out.plot {
        crate::sim_plot::draw(p, slots, &runs)?;
        eps_proto::say!("eps sim: plot in {}", p.display());
    }
    Ok(())
}

/// Reads and parses a trace file (EPS's CSV).
pub fn load_trace(path: &std::path::Path) -> Result<Vec<JobSpec>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    trace::parse(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// Reads a trace in EPS's CSV or, by its header, the Pollux/Philly format
/// with the model table at `models` (default: the built-in one).
pub fn load_any_trace(path: &std::path::Path, models: Option<&std::path::Path>) -> Result<Vec<JobSpec>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    if !pollux::is_pollux(&text) {
        if let Some(m) = models {
            return Err(format!(
                "--models {} applies to a trace in the Pollux format ({}); {} is not one",
                m.display(),
                pollux::COLUMNS.join(","),
                path.display()
            ));
        }
        return trace::parse(&text).map_err(|e| format!("{}: {e}", path.display()));
    }
    let table = match models {
        Some(m) => {
            let t = std::fs::read_to_string(m).map_err(|e| format!("cannot read {}: {e}", m.display()))?;
            pollux::parse_models(&t).map_err(|e| format!("{}: {e}", m.display()))?
        }
        None => pollux::parse_models(pollux::BUILT_IN).map_err(|e| format!("the built-in model table: {e}"))?,
    };
    pollux::parse(&text, &table).map_err(|e| format!("{}: {e}", path.display()))
}

/// Reads a cluster model file, or the built-in figures without one.
pub fn load_model(path: Option<&std::path::Path>) -> Result<ClusterModel, String> {
    match path {
        Some(p) => {
            let t = std::fs::read_to_string(p).map_err(|e| format!("cannot read {}: {e}", p.display()))?;
            ClusterModel::from_toml(&t).map_err(|e| format!("{}: {e}", p.display()))
        }
        None => Ok(ClusterModel::default()),
    }
}

/// Refuses a cluster too small for some job's minimum.
pub fn check_fits(jobs: &[JobSpec], slots: u32) -> Result<(), String> {
    match jobs.iter().find(|j| j.min_alloc().slots() > slots) {
        Some(j) => Err(format!("job {} needs at least {} slots; the cluster has {slots}", j.name, j.min_alloc().slots())),
        None => Ok(()),
    }
}

/// The table's header (one row per policy run).
pub fn print_header() {
    println!(
        "{:<8} {:>14} {:>14} {:>10} {:>11} {:>7} {:>9} {:>13}",
        "policy", "feedback avg s", "feedback p95 s", "avg JCT s", "makespan s", "util", "rescales", "max wait s"
    );
}

/// One row of the table.
pub fn print_row(s: &sim::Summary) {
    println!(
        "{:<8} {:>14.1} {:>14.1} {:>10.1} {:>11.1} {:>7.3} {:>9} {:>13.1}",
        s.policy,
        s.avg_feedback_latency_s,
        s.p95_feedback_latency_s,
        s.avg_jct_s,
        s.makespan_s,
        s.utilization,
        s.rescales,
        s.max_queue_wait_s
    );
}

/// Each job's times, on stderr.
pub fn print_jobs(policy: &str, rec: &[sim::JobRecord]) {
    for r in rec {
        let f = |v: Option<f64>| v.map_or("-".into(), |x| format!("{x:.1}"));
        eps_proto::say!(
            "  {policy} {}: submit {:.1} start {} feedback {} {} {} rescales {} nodes {}",
            r.name,
            r.submit_s,
            f(r.start_s),
            f(r.feedback_s),
            if r.killed { "killed" } else { "finished" },
            f(r.end_s),
            r.rescales,
            r.max_nodes
        );
    }
}

/// The run's figures as JSON fields (more may be added before `finish`).
pub fn summary_json(s: &sim::Summary, slots: u32) -> Json {
    Json::new()
        .str("policy", &s.policy)
        .int("jobs", s.jobs as u64)
        .int("slots", slots.into())
        .num("avg_feedback_latency_s", s.avg_feedback_latency_s)
        .num("p95_feedback_latency_s", s.p95_feedback_latency_s)
        .num("avg_jct_s", s.avg_jct_s)
        .num("makespan_s", s.makespan_s)
        .num("utilization", s.utilization)
        .int("rescales", s.rescales)
        .num("max_queue_wait_s", s.max_queue_wait_s)
}
