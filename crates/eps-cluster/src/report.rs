//! What a cluster's processes tell the `eps` command that started them (`eps
//! train`, `eps soak`, the benchmarks, the scheduler's live runs): one typed
//! report per stdout line, `EPS_REPORT {json}`, written and read by serde.
//! Other lines pass through as they are.

use serde::{Deserialize, Serialize};

/// How a report line starts.
pub const PREFIX: &str = "EPS_REPORT ";

/// One report.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "report", rename_all = "snake_case")]
pub enum Report {
    /// The lowest-ranked contributor, every `--progress-every` steps.
    Progress(Progress),
    /// A worker's push_pull latencies over the last interval (`eps soak`).
    Latency(Latency),
    /// A worker at its end.
    Done(Box<Done>),
    /// A server registered as `rank`.
    Server { rank: u32 },
    /// What a server's sparse tables held at its end (`eps bench sparse`).
    ServerSparse(ServerSparse),
    /// A benchmark worker's timings.
    Bench(Bench),
    /// The pulls `eps bench migrate`'s worker timed.
    Pulls(Pulls),
}

/// Training progress.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Progress {
    /// Steps done.
    pub step: u64,
    /// Samples the job trained so far (every worker's).
    #[serde(default)]
    pub samples: u64,
    /// Mean loss and accuracy since the last report.
    #[serde(default)]
    pub loss: f64,
    #[serde(default)]
    pub acc: f64,
    #[serde(default)]
    pub elapsed_s: f64,
    /// This worker's bytes pushed and pulled so far.
    #[serde(default)]
    pub pushed: u64,
    #[serde(default)]
    pub pulled: u64,
    /// Contributors of the step.
    #[serde(default)]
    pub workers: u64,
}

/// Push_pull latencies over an interval, microseconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Latency {
    pub rank: u32,
    /// Seconds since the worker started.
    pub t_s: f64,
    pub n: u64,
    pub p50_us: u64,
    pub p99_us: u64,
    pub max_us: u64,
}

/// A worker's results.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Done {
    pub rank: u32,
    /// Steps it took part in, from `first_step`.
    pub steps: u64,
    pub first_step: u64,
    /// It was scaled away before the end.
    pub left: bool,
    pub samples: u64,
    pub elapsed_s: f64,
    pub pushed: u64,
    pub pulled: u64,
    /// Time in push_pull.
    pub comm_s: f64,
    /// Its push_pull latencies over the whole run, microseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency_us: Option<Quantiles>,
    /// The evaluation: from the lowest-ranked contributor of the last step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Evaluation>,
}

/// p50, p99 and max.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Quantiles {
    pub p50: u64,
    pub p99: u64,
    pub max: u64,
}

/// The trained parameters, evaluated on held-out samples.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Evaluation {
    /// Who contributed when (`Membership`'s text).
    pub membership: String,
    pub final_loss: f64,
    pub final_accuracy: f64,
    pub teacher_accuracy: f64,
    /// SHA-256 of the parameters (hex, first 16 bytes).
    pub params_checksum: String,
    /// The click-through task's AUC, and its teacher's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_auc: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub teacher_auc: Option<f64>,
    /// Checksum of rows of its sparse table.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sparse_checksum: Option<String>,
    /// A digest per `shard_bytes` of parameters (`eps soak`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunk_digests: Option<String>,
}

/// A server's sparse tables at its end.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ServerSparse {
    pub rank: u32,
    pub rows: u64,
    pub row_state_bytes: u64,
    pub heap_bytes: u64,
    pub rss_start_bytes: u64,
    pub rss_end_bytes: u64,
    pub pulled_keys: u64,
    pub stepped_keys: u64,
    pub evicted: u64,
    pub refused: u64,
}

/// A benchmark worker's median timings, milliseconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Bench {
    pub rank: u32,
    /// `eps bench pushpull`: one push_pull.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub p50_ms: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub p99_ms: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_ms: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_ms: Option<f64>,
    /// `eps bench sparse`: a sparse pull and push, and the distinct keys of a batch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pull_ms: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub push_ms: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub distinct: Option<f64>,
}

/// `eps bench migrate`'s pulls: when each started (unix microseconds) and
/// how long it took (microseconds); the first failure, if one failed.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Pulls {
    pub samples: Vec<(u64, u64)>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed: Option<String>,
}

impl Report {
    /// The report's line.
    pub fn line(&self) -> String {
        // (Serializing these plain structs cannot fail.)
        format!("{PREFIX}{}", serde_json::to_string(self).unwrap_or_default())
    }

    /// Prints the report's line on stdout, flushed (a supervisor reads it as it comes).
    pub fn print(&self) {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{}", self.line());
        let _ = out.flush();
    }

    /// The report of a line, if it is one.
    pub fn parse(line: &str) -> Option<Self> {
        serde_json::from_str(line.strip_prefix(PREFIX)?).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_round_trip_and_other_lines_are_not_reports() {
        let done = Report::Done(Box::new(Done {
            rank: 1,
            steps: 5,
            samples: 160,
            elapsed_s: 0.5,
            latency_us: Some(Quantiles { p50: 10, p99: 20, max: 30 }),
            result: Some(Evaluation { params_checksum: "ab".into(), final_auc: Some(0.75), ..Evaluation::default() }),
            ..Done::default()
        }));
        let all = [
            Report::Progress(Progress { step: 3, loss: 0.25, workers: 2, ..Progress::default() }),
            done,
            Report::Server { rank: 2 },
            Report::Bench(Bench { rank: 0, p50_ms: Some(1.5), ..Bench::default() }),
            Report::Pulls(Pulls { samples: vec![(1, 2), (3, 4)], failed: Some("a \"pull\" timed out".into()) }),
        ];
        for r in all {
            let l = r.line();
            assert!(l.starts_with("EPS_REPORT {\"report\":") && !l.contains('\n'), "{l}");
            assert_eq!(Report::parse(&l), Some(r));
        }
        assert_eq!(Report::parse(r#"EPS_REPORT {"report":"server","rank":7}"#), Some(Report::Server { rank: 7 }));
        assert_eq!(Report::parse("step 3/10 loss 0.1"), None);
        assert_eq!(Report::parse("EPS_REPORT {not json"), None);
    }
}
