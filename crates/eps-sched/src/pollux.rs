//! Public workload traces in the Pollux/Philly format
//!
//! `name,time,application,num_replicas,batch_size`
//!
//! (the Pollux artifact's `workload-N.csv`, jobs of the Microsoft Philly
//! trace), read with a model table that gives each application what the
//! trace lacks: parameter bytes, compute per sample, samples to completion,
//! the share of them after which the user looks, and how many of its jobs
//! the user kills there.
//!
//! A row becomes a [`JobSpec`]: submitted at `time`; 1 to `num_replicas`
//! workers, each with `batch_size / num_replicas` samples per iteration; 1
//! to `ceil(num_replicas / 4)` servers; killed at its feedback when a hash
//! of its name falls below the application's `kill_fraction` (the same jobs
//! in every run).

use std::collections::BTreeMap;

use serde::Deserialize;

use crate::trace::{JobSpec, TraceError};

/// The columns of the format, in order.
pub const COLUMNS: [&str; 5] = ["name", "time", "application", "num_replicas", "batch_size"];

/// What the trace does not say about one application.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct App {
    /// Model bytes (f32 parameters).
    pub param_bytes: u64,
    /// Compute per sample on one worker, milliseconds.
    pub compute_ms_per_sample: f64,
    /// Samples to completion.
    pub samples: u64,
    /// Share of `samples` after which the user looks at the job.
    #[serde(default = "d_feedback")]
    pub feedback_fraction: f64,
    /// Share of its jobs the user kills at their feedback.
    #[serde(default = "d_kill")]
    pub kill_fraction: f64,
}

fn d_feedback() -> f64 {
    0.05
}
fn d_kill() -> f64 {
    0.6
}

/// The model table: applications by name (`--models FILE.toml`, one table
/// per application).
pub type Models = BTreeMap<String, App>;

/// The built-in table: the six applications of the Pollux workloads, with
/// public figures (parameter counts of the models, rough per-sample compute,
/// the training lengths of their reference runs).
pub const BUILT_IN: &str = r#"
[bert]
param_bytes = 440000000
compute_ms_per_sample = 25.0
samples = 180000
[cifar10]
param_bytes = 44800000
compute_ms_per_sample = 0.4
samples = 2500000
[deepspeech2]
param_bytes = 152000000
compute_ms_per_sample = 15.0
samples = 300000
[imagenet]
param_bytes = 102400000
compute_ms_per_sample = 3.0
samples = 6400000
feedback_fraction = 0.02
[ncf]
param_bytes = 4000000
compute_ms_per_sample = 0.01
samples = 20000000
[yolov3]
param_bytes = 248000000
compute_ms_per_sample = 20.0
samples = 250000
"#;

/// Parses a model table; every application's figures are checked.
pub fn parse_models(text: &str) -> Result<Models, String> {
    let m: Models = toml::from_str(text).map_err(|e| e.to_string().trim().replace('\n', " "))?;
    for (name, a) in &m {
        let bad = |what: &str| Err(format!("application {name}: {what}"));
        if a.param_bytes == 0 || a.samples == 0 {
            return bad("`param_bytes` and `samples` must be at least 1");
        }
        if !(a.compute_ms_per_sample.is_finite() && a.compute_ms_per_sample >= 0.0) {
            return bad("`compute_ms_per_sample` must be 0 or more");
        }
        if !(a.feedback_fraction > 0.0 && a.feedback_fraction <= 1.0) {
            return bad("`feedback_fraction` must be above 0 and at most 1");
        }
        if !(0.0..=1.0).contains(&a.kill_fraction) {
            return bad("`kill_fraction` must be between 0 and 1");
        }
    }
    if m.is_empty() {
        return Err("the model table names no application".into());
    }
    Ok(m)
}

/// Whether `text` starts (after comments) with this format's header.
pub fn is_pollux(text: &str) -> bool {
    text.lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with('#'))
        .is_some_and(|h| h.split(',').map(str::trim).eq(COLUMNS))
}

/// A number in [0, 1) from `name` (FNV-1a, then a 64-bit finaliser).
fn unit(name: &str) -> f64 {
    let mut x: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        x = (x ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    (x >> 11) as f64 / (1u64 << 53) as f64
}

/// Parses a trace of this format with `models`, sorted by submit time.
pub fn parse(text: &str, models: &Models) -> Result<Vec<JobSpec>, TraceError> {
    let mut lines = text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty() && !l.trim_start().starts_with('#'));
    let header = lines.next().map(|(_, l)| l.trim().to_string()).unwrap_or_default();
    if !header.split(',').map(str::trim).eq(COLUMNS) {
        return Err(TraceError::Header { expected: COLUMNS.join(","), got: header });
    }
    let mut jobs = Vec::new();
    let mut names = std::collections::HashSet::new();
    for (i, l) in lines {
        let line = i + 1;
        let bad = |column: &'static str, reason: String| TraceError::Field { line, column, reason };
        let f: Vec<&str> = l.split(',').map(str::trim).collect();
        if f.len() != COLUMNS.len() {
            return Err(bad(COLUMNS[f.len().min(COLUMNS.len() - 1)], format!("{} fields; expected {}", f.len(), COLUMNS.len())));
        }
        let name = f[0].to_string();
        if name.is_empty() || !names.insert(name.clone()) {
            return Err(bad("name", "empty, or a name already used".into()));
        }
        let time: f64 = f[1]
            .parse()
            .ok()
            .filter(|t: &f64| t.is_finite() && *t >= 0.0)
            .ok_or_else(|| bad("time", format!("{:?} is not a time in seconds", f[1])))?;
        let app = models.get(f[2]).ok_or_else(|| {
            let known: Vec<&str> = models.keys().map(String::as_str).collect();
            bad("application", format!("{:?} is not in the model table (it has {})", f[2], known.join(", ")))
        })?;
        let replicas: u32 = f[3]
            .parse()
            .ok()
            .filter(|&r| r >= 1)
            .ok_or_else(|| bad("num_replicas", format!("{:?} is not a whole number >= 1", f[3])))?;
        let batch: u32 = f[4]
            .parse()
            .ok()
            .filter(|&b| b >= 1)
            .ok_or_else(|| bad("batch_size", format!("{:?} is not a whole number >= 1", f[4])))?;
        let feedback = ((app.samples as f64 * app.feedback_fraction).round() as u64).clamp(1, app.samples);
        let j = JobSpec {
            submit_s: time,
            param_bytes: app.param_bytes,
            compute_ms_per_sample: app.compute_ms_per_sample,
            batch: (batch / replicas).max(1),
            samples: app.samples,
            feedback_samples: feedback,
            kill_after_feedback: unit(&name) < app.kill_fraction,
            workers: (1, replicas),
            servers: (1, replicas.div_ceil(4)),
            name,
        };
        j.validate().map_err(|(column, reason)| bad(column, reason.into()))?;
        jobs.push(j);
    }
    if jobs.is_empty() {
        return Err(TraceError::Empty);
    }
    jobs.sort_by(|a, b| a.submit_s.total_cmp(&b.submit_s));
    Ok(jobs)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TRACE: &str = "name,time,application,num_replicas,batch_size\n\
        cifar10-0,498,cifar10,4,2048\n\
        ncf-1,12,ncf,1,32768\n\
        bert-2,30,bert,8,384\n";

    #[test]
    fn rows_become_jobs_with_the_model_table_and_bad_input_says_where() {
        let m = parse_models(BUILT_IN).unwrap();
        assert!(is_pollux(TRACE) && !is_pollux(&crate::trace::header()));
        let jobs = parse(TRACE, &m).unwrap();
        assert_eq!(jobs.iter().map(|j| j.name.as_str()).collect::<Vec<_>>(), ["ncf-1", "bert-2", "cifar10-0"], "by time");
        let c = &jobs[2];
        assert_eq!((c.submit_s, c.param_bytes, c.batch, c.workers, c.servers), (498.0, 44_800_000, 512, (1, 4), (1, 1)));
        assert_eq!((c.samples, c.feedback_samples), (2_500_000, 125_000));
        assert_eq!(jobs[1].servers, (1, 2));
        // The same jobs are killed on every parse; about the fraction of many.
        let many: String = (0..1000).map(|i| format!("j{i},{i},ncf,1,64\n")).collect();
        let parsed = parse(&format!("{}\n{many}", COLUMNS.join(",")), &m).unwrap();
        let killed = parsed.iter().filter(|j| j.kill_after_feedback).count();
        assert!((540..660).contains(&killed), "{killed} of 1000 killed at 0.6");
        assert_eq!(parse(TRACE, &m).unwrap(), jobs);

        let e = parse("name,time,application,num_replicas,batch_size\nx,1,gpt9,2,8\n", &m).unwrap_err().to_string();
        assert!(e.contains("line 2") && e.contains("gpt9") && e.contains("cifar10"), "{e}");
        let e = parse("name,time,application,num_replicas,batch_size\nx,1,ncf,0,8\n", &m).unwrap_err().to_string();
        assert!(e.contains("num_replicas"), "{e}");
        assert!(parse("name,time\n", &m).is_err());
        assert!(
            parse_models("[a]\nparam_bytes = 1\ncompute_ms_per_sample = 1.0\nsamples = 10\nkill_fraction = 2.0\n")
                .unwrap_err()
                .contains("kill_fraction")
        );
        assert!(parse_models("[a]\nparams = 1\n").is_err());
    }
}
