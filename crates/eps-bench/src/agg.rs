//! `eps bench agg`: the N-way gradient sum against this machine's memory bandwidth,
//! both measured by this binary in the same run.

use std::time::Instant;

use eps_agg::{Aggregator, CpuAggregator, DType, reduce};

/// Parameters of one run.
#[derive(Clone, Debug)]
pub struct AggBench {
    /// Element type of the inputs.
    pub dtype: DType,
    /// Number of inputs (workers).
    pub workers: usize,
    /// Bytes of each input.
    pub size: u64,
    /// Threads (0: one per core).
    pub threads: usize,
    /// Timed repetitions of each measurement (the median is reported).
    pub reps: usize,
}

/// What one run measured.
#[derive(Clone, Debug)]
pub struct AggReport {
    /// Bytes read plus bytes written by the sum per second (1e9 B/s): N x SIZE of
    /// inputs plus the f32 accumulator (SIZE for f32, 2 x SIZE for 16-bit inputs).
    pub gbytes_per_s: f64,
    /// `c = a + b` over f32 arrays of SIZE bytes, counted as 2 reads + 1 write.
    pub mem_gbytes_per_s: f64,
    /// `gbytes_per_s / mem_gbytes_per_s`.
    pub ratio: f64,
    /// Threads used.
    pub threads: usize,
    /// Median time of one sum, seconds.
    pub sum_s: f64,
}

/// Why the benchmark cannot run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AggBenchError {
    /// Bad parameters.
    #[error("invalid benchmark configuration: {0}")]
    Config(&'static str),
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Runs the sum and the memory-bandwidth loop, interleaved, and reports medians.
pub fn run(cfg: &AggBench) -> Result<AggReport, AggBenchError> {
    let es = cfg.dtype.size_bytes() as u64;
    if cfg.workers == 0 || cfg.workers > 1024 {
        return Err(AggBenchError::Config("--workers must be between 1 and 1024"));
    }
    if cfg.size < es || cfg.size % es != 0 {
        return Err(AggBenchError::Config("--size must be a positive multiple of the element size"));
    }
    if cfg.size > 4 << 30 {
        return Err(AggBenchError::Config("--size is at most 4GiB"));
    }
    let n = (cfg.size / es) as usize;
    let agg = CpuAggregator::new(cfg.threads);
    let threads = agg.threads();
    // Inputs hold small varied values; every page is touched before timing.
    let seedv: Vec<f32> = (0..n.min(4096)).map(|i| ((i % 97) as f32 - 48.0) / 64.0).collect();
    let inputs: Vec<Vec<u8>> = (0..cfg.workers)
        .map(|_| {
            let mut b = vec![0u8; cfg.size as usize];
            for (chunk, out) in seedv.chunks(seedv.len()).cycle().zip(b.chunks_mut(seedv.len() * es as usize)) {
                reduce::narrow(cfg.dtype, &chunk[..out.len() / es as usize], out);
            }
            b
        })
        .collect();
    let refs: Vec<&[u8]> = inputs.iter().map(|x| &x[..]).collect();
    let mut out = vec![1f32; n];
    let m = (cfg.size / 4).max(1) as usize;
    let a = vec![1f32; m];
    let b = vec![2f32; m];
    let mut c = vec![0f32; m];
    let (mut sum_t, mut mem_t) = (Vec::new(), Vec::new());
    for _ in 0..cfg.reps.max(1) {
        let t = Instant::now();
        agg.reduce(cfg.dtype, &refs, 1.0, &mut out).expect("buffers sized above");
        sum_t.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        add_arrays(&a, &b, &mut c, threads);
        mem_t.push(t.elapsed().as_secs_f64());
    }
    std::hint::black_box((&out, &c));
    let sum_s = median(sum_t);
    let mem_s = median(mem_t);
    let sum_bytes = cfg.workers as f64 * cfg.size as f64 + n as f64 * 4.0;
    let mem_bytes = 3.0 * m as f64 * 4.0;
    let gbytes_per_s = sum_bytes / sum_s / 1e9;
    let mem_gbytes_per_s = mem_bytes / mem_s / 1e9;
    Ok(AggReport { gbytes_per_s, mem_gbytes_per_s, ratio: gbytes_per_s / mem_gbytes_per_s, threads, sum_s })
}

/// `c = a + b`, split over `threads` threads: the memory-bandwidth reference.
fn add_arrays(a: &[f32], b: &[f32], c: &mut [f32], threads: usize) {
    let per = c.len().div_ceil(threads.max(1));
    std::thread::scope(|s| {
        for ((c, a), b) in c.chunks_mut(per).zip(a.chunks(per)).zip(b.chunks(per)) {
            s.spawn(move || {
                for ((c, a), b) in c.iter_mut().zip(a).zip(b) {
                    *c = *a + *b;
                }
            });
        }
    });
}
