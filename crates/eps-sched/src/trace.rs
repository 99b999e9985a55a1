//! Job traces: CSV with a header line naming the columns
//!
//! `name,submit_s,param_bytes,compute_ms_per_sample,batch,samples,feedback_samples,kill_after_feedback,min_workers,max_workers,min_servers,max_servers`
//!
//! one job per line (`#` starts a comment line). `samples` is the training to
//! completion, `feedback_samples` the training after which the user looks at
//! the job, `kill_after_feedback` 1 when the user then kills it. `batch` is
//! samples per worker per iteration.

/// One job of a trace.
#[derive(Clone, Debug, PartialEq)]
pub struct JobSpec {
    /// Its name (unique in the trace).
    pub name: String,
    /// When it is submitted, seconds from the trace's start.
    pub submit_s: f64,
    /// Model bytes (f32 parameters).
    pub param_bytes: u64,
    /// Compute per sample on one worker, milliseconds.
    pub compute_ms_per_sample: f64,
    /// Samples per worker per iteration.
    pub batch: u32,
    /// Samples to completion.
    pub samples: u64,
    /// Samples after which the user looks at the job.
    pub feedback_samples: u64,
    /// The user kills the job at its feedback.
    pub kill_after_feedback: bool,
    /// Fewest and most workers.
    pub workers: (u32, u32),
    /// Fewest and most servers.
    pub servers: (u32, u32),
}

/// The columns, in order.
pub const COLUMNS: [&str; 12] = [
    "name",
    "submit_s",
    "param_bytes",
    "compute_ms_per_sample",
    "batch",
    "samples",
    "feedback_samples",
    "kill_after_feedback",
    "min_workers",
    "max_workers",
    "min_servers",
    "max_servers",
];

/// What is wrong with a trace.
#[derive(Debug, thiserror::Error, PartialEq)]
#[non_exhaustive]
pub enum TraceError {
    /// The header is not the columns.
    #[error("trace header: expected the columns {expected}, got {got:?}")]
    Header {
        /// The columns wanted.
        expected: String,
        /// The line found.
        got: String,
    },
    /// A field is missing or unusable.
    #[error("trace line {line}, column `{column}`: {reason}")]
    Field {
        /// 1-based line number.
        line: usize,
        /// The column.
        column: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// The trace holds no job.
    #[error("the trace holds no job")]
    Empty,
}

impl JobSpec {
    /// Checks the fields' values; an error names the field and says why.
    pub fn validate(&self) -> Result<(), (&'static str, &'static str)> {
        if !(self.submit_s.is_finite() && self.submit_s >= 0.0) {
            return Err(("submit_s", "must be a time from 0 on"));
        }
        if !(self.compute_ms_per_sample.is_finite() && self.compute_ms_per_sample >= 0.0) {
            return Err(("compute_ms_per_sample", "must not be negative"));
        }
        if self.param_bytes == 0 || self.batch == 0 || self.samples == 0 {
            return Err((
                if self.param_bytes == 0 {
                    "param_bytes"
                } else if self.batch == 0 {
                    "batch"
                } else {
                    "samples"
                },
                "must be at least 1",
            ));
        }
        if self.feedback_samples == 0 || self.feedback_samples > self.samples {
            return Err(("feedback_samples", "must be between 1 and `samples`"));
        }
        if self.workers.0 == 0 || self.workers.0 > self.workers.1 {
            return Err(("min_workers", "must be at least 1 and at most max_workers"));
        }
        if self.servers.0 == 0 || self.servers.0 > self.servers.1 {
            return Err(("min_servers", "must be at least 1 and at most max_servers"));
        }
        Ok(())
    }

    /// The smallest allocation it may run at.
    pub fn min_alloc(&self) -> crate::Alloc {
        crate::Alloc { workers: self.workers.0, servers: self.servers.0 }
    }

    /// The allocation it asks for.
    pub fn max_alloc(&self) -> crate::Alloc {
        crate::Alloc { workers: self.workers.1, servers: self.servers.1 }
    }

    /// Samples until the job ends: at its feedback when the user kills it
    /// then, else all of them.
    pub fn end_samples(&self) -> u64 {
        if self.kill_after_feedback { self.feedback_samples.min(self.samples) } else { self.samples }
    }

    /// A job for tests.
    #[allow(clippy::too_many_arguments)]
    pub fn test(
        name: &str,
        submit_s: f64,
        param_bytes: u64,
        compute_ms_per_sample: f64,
        batch: u32,
        samples: u64,
        feedback_samples: u64,
        kill_after_feedback: bool,
        workers: (u32, u32),
        servers: (u32, u32),
    ) -> Self {
        Self {
            name: name.into(),
            submit_s,
            param_bytes,
            compute_ms_per_sample,
            batch,
            samples,
            feedback_samples,
            kill_after_feedback,
            workers,
            servers,
        }
    }

    /// The job as a CSV line (the inverse of the parser).
    pub fn to_csv(&self) -> String {
        format!(
            "{},{},{},{},{},{},{},{},{},{},{},{}",
            self.name,
            self.submit_s,
            self.param_bytes,
            self.compute_ms_per_sample,
            self.batch,
            self.samples,
            self.feedback_samples,
            u8::from(self.kill_after_feedback),
            self.workers.0,
            self.workers.1,
            self.servers.0,
            self.servers.1
        )
    }
}

fn field<T: std::str::FromStr>(line: usize, column: &'static str, s: &str) -> Result<T, TraceError> {
    s.trim().parse().map_err(|_| TraceError::Field { line, column, reason: format!("{s:?} is not a valid value") })
}

/// Parses a trace, sorted by submit time (ties keep the file's order).
pub fn parse(text: &str) -> Result<Vec<JobSpec>, TraceError> {
    let mut lines = text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty() && !l.trim_start().starts_with('#'));
    let expected = COLUMNS.join(",");
    let header = lines.next().map(|(_, l)| l.trim().to_string()).unwrap_or_default();
    if header.split(',').map(str::trim).collect::<Vec<_>>() != COLUMNS {
        return Err(TraceError::Header { expected, got: header });
    }
    let mut jobs = Vec::new();
    let mut names = std::collections::HashSet::new();
    for (i, l) in lines {
        let n = i + 1;
        let f: Vec<&str> = l.split(',').collect();
        if f.len() != COLUMNS.len() {
            return Err(TraceError::Field {
                line: n,
                column: COLUMNS[f.len().min(COLUMNS.len() - 1)],
                reason: format!("{} fields; expected {}", f.len(), COLUMNS.len()),
            });
        }
        let bad = |column: &'static str, reason: &str| TraceError::Field { line: n, column, reason: reason.into() };
        let name = f[0].trim().to_string();
        if name.is_empty() || !names.insert(name.clone()) {
            return Err(bad("name", "empty, or a name already used"));
        }
        let kill: u8 = field(n, "kill_after_feedback", f[7])?;
        let j = JobSpec {
            name,
            submit_s: field(n, "submit_s", f[1])?,
            param_bytes: field(n, "param_bytes", f[2])?,
            compute_ms_per_sample: field(n, "compute_ms_per_sample", f[3])?,
            batch: field(n, "batch", f[4])?,
            samples: field(n, "samples", f[5])?,
            feedback_samples: field(n, "feedback_samples", f[6])?,
            kill_after_feedback: match kill {
                0 => false,
                1 => true,
                _ => return Err(bad("kill_after_feedback", "must be 0 or 1")),
            },
            workers: (field(n, "min_workers", f[8])?, field(n, "max_workers", f[9])?),
            servers: (field(n, "min_servers", f[10])?, field(n, "max_servers", f[11])?),
        };
        j.validate().map_err(|(column, reason)| bad(column, reason))?;
        jobs.push(j);
    }
    if jobs.is_empty() {
        return Err(TraceError::Empty);
    }
    jobs.sort_by(|a, b| a.submit_s.total_cmp(&b.submit_s));
    Ok(jobs)
}

/// The header line.
pub fn header() -> String {
    COLUMNS.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_round_trips() {
        let j = JobSpec::test("hp-1", 2.5, 4_000_000, 1.5, 32, 64_000, 6_400, true, (1, 4), (1, 2));
        let text = format!("# a comment\n{}\n{}\n", header(), j.to_csv());
        assert_eq!(parse(&text).unwrap(), vec![j]);
    }

    #[test]
    fn errors_name_line_and_column() {
        let h = header();
        let cases = [
            ("name,submit\n".to_string(), "trace header"),
            (format!("{h}\na,1,100,1,32,10,5,0,1,2,1,1\na,1,100,1,32,10,5,0,1,2,1,1"), "line 3, column `name`"),
            (format!("{h}\na,x,100,1,32,10,5,0,1,2,1,1"), "column `submit_s`"),
            (format!("{h}\na,1,100,1,32,10,50,0,1,2,1,1"), "column `feedback_samples`"),
            (format!("{h}\na,1,100,1,32,10,5,2,1,2,1,1"), "column `kill_after_feedback`"),
            (format!("{h}\na,1,100,1,32,10,5,0,3,2,1,1"), "column `min_workers`"),
            (format!("{h}\na,1,100,1,32,10,5,0,1,2,0,1"), "column `min_servers`"),
            (format!("{h}\na,1,100,1,32,10,5,0,1,2,1"), "11 fields"),
            (h.clone(), "no job"),
        ];
        for (text, want) in cases {
            let e = parse(&text).unwrap_err().to_string();
            assert!(e.contains(want), "{text:?}: {e}");
        }
    }
}
