//! Synthetic traces, deterministic for a seed (the shipped ones in `traces/`
//! are made by `eps sim generate`).

use crate::trace::JobSpec;

/// splitmix64, for reproducible traces without a dependency.
#[derive(Debug)]
pub struct Rng(u64);

impl Rng {
    /// Seeded.
    pub fn new(seed: u64) -> Self {
        Self(seed ^ 0x5DEE_CE66_D1CE_4E5B)
    }
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Uniform integer in [lo, hi].
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }
    /// Exponential with mean `mean`.
    pub fn exp(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.unit()).ln()
    }
}

/// Feedback-driven exploration: bursts of hyper-parameter-search jobs (a
/// user submits a sweep, looks at every job's first results and kills most),
/// a few long jobs between them.
pub fn exploration(seed: u64, jobs: usize) -> Vec<JobSpec> {
    let mut r = Rng::new(seed);
    let mut out = Vec::with_capacity(jobs);
    let mut t = 0.0;
    let mut sweep = 0;
    while out.len() < jobs {
        // A sweep: 6 to 16 variants of one model, submitted within a minute.
        let n = (r.range(6, 16) as usize).min(jobs - out.len());
        // Parameter-server workloads: large (embedding-heavy) models whose
        // iterations are dominated by communication.
        let param_bytes = [64_000_000u64, 256_000_000, 512_000_000][r.range(0, 2) as usize];
        let compute = 0.05 + r.unit() * 0.45;
        let batch = [32u32, 64][r.range(0, 1) as usize];
        let samples = r.range(20, 60) * 10_000;
        for k in 0..n {
            let long = r.unit() < 0.15;
            let kill = !long && r.unit() < 0.85;
            out.push(JobSpec {
                name: format!("sweep{sweep}-{k}"),
                submit_s: (t + r.unit() * 60.0).round(),
                param_bytes,
                compute_ms_per_sample: (compute * 100.0).round() / 100.0,
                batch,
                samples: if long { samples * 4 } else { samples },
                feedback_samples: samples / 10,
                kill_after_feedback: kill,
                workers: (1, if long { 8 } else { 4 }),
                servers: (1, if long { 4 } else { 2 }),
            });
        }
        sweep += 1;
        t += r.exp(900.0);
    }
    out.sort_by(|a, b| a.submit_s.total_cmp(&b.submit_s));
    out
}

/// A steady mixed load: Poisson arrivals of jobs of every size, half run to
/// completion.
pub fn steady(seed: u64, jobs: usize) -> Vec<JobSpec> {
    let mut r = Rng::new(seed);
    let mut t = 0.0;
    (0..jobs)
        .map(|k| {
            t += r.exp(30.0);
            let samples = r.range(10, 100) * 10_000;
            let maxw = [2u32, 4, 8][r.range(0, 2) as usize];
            JobSpec {
                name: format!("job{k}"),
                submit_s: t.round(),
                param_bytes: [4_000_000u64, 16_000_000, 64_000_000, 256_000_000][r.range(0, 3) as usize],
                compute_ms_per_sample: ((0.2 + r.unit() * 2.0) * 100.0).round() / 100.0,
                batch: 64,
                samples,
                feedback_samples: samples / 5,
                kill_after_feedback: r.unit() < 0.5,
                workers: (1, maxw),
                servers: (1, (maxw / 2).max(1)),
            }
        })
        .collect()
}

/// A trace as CSV text, with its header.
pub fn to_csv(jobs: &[JobSpec], comment: &str) -> String {
    let mut s = format!("# {comment}\n{}\n", crate::trace::header());
    for j in jobs {
        s.push_str(&j.to_csv());
        s.push('\n');
    }
    s
}
