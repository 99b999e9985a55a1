//! `eps sim grid`: every policy over workloads x loads x cluster sizes, and
//! where `eps` is beaten.

use std::path::PathBuf;

use eps_sched::grid::{self, CONTENDED_UTILIZATION};
use eps_sched::policy::NAMES;
use eps_sched::{JobSpec, Timing, synth, trace};

use crate::json::Json;

/// The Philly-derived workloads shipped in `bench/traces`, built in.
const PHILLY: [(&str, &str); 3] = [
    ("philly-w2", include_str!("../bench/traces/philly-w2.csv")),
    ("philly-w3", include_str!("../bench/traces/philly-w3.csv")),
    ("philly-w4", include_str!("../bench/traces/philly-w4.csv")),
];

/// `eps sim grid`'s arguments.
#[derive(clap::Args, Debug)]
pub struct GridArgs {
    /// Traces (CSV, or the Pollux/Philly workload format with --models);
    /// repeat the flag for several [default: the three Philly-derived
    /// workloads of bench/traces, built in]
    #[arg(long = "trace")]
    pub traces: Vec<PathBuf>,
    /// Generated traces as KIND:SEED (exploration or steady, 200 jobs each),
    /// comma-separated, e.g. exploration:101,steady:202; with no --trace they
    /// replace the built-in workloads.
    #[arg(long, value_delimiter = ',')]
    pub generated: Vec<String>,
    /// Loads: arrivals this many times as dense as the trace's.
    #[arg(long, value_delimiter = ',', default_value = "2,4,8")]
    pub loads: Vec<f64>,
    /// Cluster sizes in slots (one node each).
    #[arg(long, value_delimiter = ',', default_value = "16,32,64")]
    pub slots: Vec<u32>,
    /// One cluster of nodes instead of --slots, e.g. n1:8,n2:8,n3:8,n4:8
    /// (jobs spread over nodes pay the model's `[cluster]
    /// node_bandwidth_gbytes_per_s`).
    #[arg(long, value_name = "NAME:SLOTS,...")]
    pub nodes: Option<String>,
    /// The cluster model (TOML; default: built-in figures).
    #[arg(long)]
    pub cluster: Option<PathBuf>,
    /// The model table of a Pollux/Philly-format trace (see `eps sim --help`).
    #[arg(long)]
    pub models: Option<PathBuf>,
    /// One JSON line per cell instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// The workloads a grid runs: named job lists.
fn workloads(a: &GridArgs) -> Result<Vec<(String, Vec<JobSpec>)>, String> {
    let mut out = Vec::new();
    for p in &a.traces {
        let name = p.file_stem().map_or_else(|| p.display().to_string(), |s| s.to_string_lossy().into_owned());
        out.push((name, crate::sim::load_any_trace(p, a.models.as_deref())?));
    }
    for g in &a.generated {
        let bad = || format!("--generated {g:?}: expected KIND:SEED with KIND exploration or steady, e.g. exploration:101");
        let (kind, seed) = g.split_once(':').ok_or_else(bad)?;
        let seed: u64 = seed.trim().parse().map_err(|_| bad())?;
        let jobs = match kind.trim() {
            "exploration" => synth::exploration(seed, 200),
            "steady" => synth::steady(seed, 200),
            _ => return Err(bad()),
        };
        out.push((format!("{}-{seed}", kind.trim()), jobs));
    }
    if out.is_empty() {
        for (name, text) in PHILLY {
            out.push((name.to_string(), trace::parse(text).map_err(|e| format!("built-in {name}: {e}"))?));
        }
    }
    Ok(out)
}

/// Runs `eps sim grid`.
pub fn run(a: GridArgs) -> Result<(), String> {
    if let Some(l) = a.loads.iter().find(|l| !(l.is_finite() && **l > 0.0)) {
        return Err(format!("--loads: {l} is not a positive number"));
    }
    if a.loads.is_empty() || a.slots.is_empty() || a.slots.contains(&0) {
        return Err("--loads and --slots need at least one value each, and slots at least 1".into());
    }
    let model = crate::sim::load_model(a.cluster.as_deref())?;
    let work = workloads(&a)?;
    let nodes = match &a.nodes {
        Some(t) => eps_sched::placement::parse_nodes(t).map_err(|e| format!("--nodes: {e}"))?,
        None => Vec::new(),
    };
    let sizes: Vec<u32> = if nodes.is_empty() { a.slots.clone() } else { vec![nodes.iter().map(|n| n.slots).sum()] };
    let total = (work.len() * a.loads.len() * sizes.len()) as u64;
    let bar = crate::progress::Progress::new(total, "eps sim grid");
    if !a.json {
        println!(
            "{:<16} {:>5} {:>5} {:>6}  {:<31}  {:<31}  eps beaten by",
            "workload", "load", "slots", "util", "feedback avg s: st/opt/pol/eps", "avg JCT s: st/opt/pol/eps"
        );
    }
    let (mut contended, mut clean, mut least_static) = (0u32, 0u32, f64::INFINITY);
    let mut done = 0u64;
    for (name, jobs) in &work {
        for &load in &a.loads {
            for &slots in &sizes {
                bar.tick(done, &format!("{name} at {load}x on {slots} slots"));
                done += 1;
                let Some(c) =
                    grid::cell(name, jobs, load, slots, &nodes, &model, &NAMES, Timing::default()).map_err(|e| e.to_string())?
                else {
                    eps_proto::say!("eps sim grid: {name} does not fit {slots} slots (a job's minimum is larger); skipped");
                    continue;
                };
                let beaten = c.beaten_by();
                if c.contended() {
                    contended += 1;
                    clean += u32::from(beaten.is_empty());
                    least_static = least_static.min(c.static_over_eps().unwrap_or(f64::INFINITY));
                }
                if a.json {
                    print_json(&c, &beaten);
                } else {
                    print_row(&c, &beaten);
                }
            }
        }
    }
    drop(bar);
    if !a.json {
        println!(
            "contended cells (static's utilization above {CONTENDED_UTILIZATION}): {contended}; eps has the lowest average \
             feedback and JCT of every baseline in {clean}; static's feedback over eps's at least {least_static:.1}x"
        );
    }
    Ok(())
}

fn fmt4(c: &grid::Cell, f: fn(&eps_sched::Summary) -> f64) -> String {
    c.runs.iter().map(|s| format!("{:.0}", f(s))).collect::<Vec<_>>().join("/")
}

fn print_row(c: &grid::Cell, beaten: &[String]) {
    let util = c.run("static").map_or(f64::NAN, |s| s.utilization);
    let mark = if !c.contended() {
        "(not contended)".to_string()
    } else if beaten.is_empty() {
        "-".into()
    } else {
        beaten.join(", ")
    };
    println!(
        "{:<16} {:>4}x {:>5} {:>6.2}  {:<31}  {:<31}  {mark}",
        c.workload,
        c.load,
        c.slots,
        util,
        fmt4(c, |s| s.avg_feedback_latency_s),
        fmt4(c, |s| s.avg_jct_s)
    );
}

fn print_json(c: &grid::Cell, beaten: &[String]) {
    let mut j = Json::new().str("workload", &c.workload).num("load", c.load).int("slots", c.slots.into());
    for s in &c.runs {
        j = j
            .num(&format!("{}_avg_feedback_latency_s", s.policy), s.avg_feedback_latency_s)
            .num(&format!("{}_avg_jct_s", s.policy), s.avg_jct_s)
            .num(&format!("{}_utilization", s.policy), s.utilization);
    }
    let beaten: Vec<String> = beaten.iter().map(|b| format!("\"{b}\"")).collect();
    println!(
        "{}",
        j.raw("contended", if c.contended() { "true" } else { "false" })
            .raw("eps_beaten_by", &format!("[{}]", beaten.join(",")))
            .finish()
    );
}
