//! `eps bench`: the subcommands' flags, and running them.

use std::path::PathBuf;

use clap::Subcommand;
use eps_agg::DType;

use crate::bench::Json;
use crate::error::chain as error_chain;
use crate::units::{format_size, parse_size};
use eps_bench::agg::AggBench;
use eps_bench::fabric::{self, FabricBench, Op};

/// Runs an `eps bench` subcommand.
pub fn run(c: BenchCmd) -> Result<(), String> {
    match c {
        BenchCmd::Pushpull(a) => bench_pushpull(a),
        BenchCmd::Migrate(a) => bench_migrate(a),
        BenchCmd::Fabric(a) => bench_fabric(a),
        BenchCmd::Agg(a) => bench_agg(a),
        BenchCmd::Replicas(a) => crate::bench::replicas::run(a),
        BenchCmd::Sparse(a) => crate::bench::sparse_cli::run(a),
        BenchCmd::Gpu(a) => match a.emit_ptx {
            Some(dir) => crate::bench::gpu::emit_ptx(&dir),
            None => crate::bench::gpu::run(a.size, a.reps, a.json),
        },
        BenchCmd::FabricPeer { op, size, depth, transport, rdma } => fabric_peer(op.into(), size, depth, &transport, &rdma),
    }
}

/// `eps bench fabric-peer`: the peer process of `eps bench fabric`, on the
/// transport (and RDMA device) its parent chose.
fn fabric_peer(op: Op, size: u64, depth: u32, transport: &str, named: &crate::rdma::Named) -> Result<(), String> {
    let lo = std::net::IpAddr::from([127, 0, 0, 1]);
    let r = match transport {
        "rdma" => {
            let (pd, ip) = crate::rdma::bench_pd(named)?;
            fabric::peer_on(pd, ip, op, size, depth)
        }
        "shm" => eps_fabric::shm::ShmDevice::open()
            .map_err(fabric::BenchError::from)
            .and_then(|d| fabric::peer_on(d.alloc_pd(), lo, op, size, depth)),
        _ => eps_fabric::soft::SoftDevice::open()
            .map_err(fabric::BenchError::from)
            .and_then(|d| fabric::peer_on(d.alloc_pd(), lo, op, size, depth)),
    };
    r.map_err(|e| error_chain(&e))
}

#[derive(Subcommand, Debug)]
pub enum BenchCmd {
    /// Bandwidth and latency of one fabric operation, perftest style.
    ///
    /// Starts a peer process on 127.0.0.1 and measures between the two. With
    /// --depth > 1 it keeps that many operations in flight (bandwidth); with
    /// --depth 1 it runs ping-pong style (latency). Latency is from posting one
    /// signaled operation to its completion at the initiator: for a WRITE that
    /// includes the target's acknowledgement, a full round trip (not halved).
    Fabric(FabricArgs),
    /// Throughput of the N-way gradient sum against memory bandwidth.
    ///
    /// Sums --workers inputs of --size bytes each into an f32 accumulator (rank
    /// order, f32 accumulation) and, in the same run, times a plain `c = a + b` over
    /// f32 arrays of --size bytes. gbytes_per_s counts the inputs read plus the
    /// accumulator written; mem_gbytes_per_s counts 2 reads + 1 write.
    Agg(AggArgs),
    /// GB/s of the GPU kernels against the device-to-device copy rate (needs
    /// `--features cuda` and a GPU).
    ///
    /// In one run: a device-to-device copy of --size bytes (bytes read + written),
    /// an 8-way f32 sum of --size-byte inputs (8 reads + 1 write), and a fused Adam
    /// step over --size bytes of parameters (7 f32 values moved per parameter);
    /// medians of --reps repetitions timed with CUDA events.
    Gpu(GpuArgs),
    /// What a backup of every shard costs: training throughput with
    /// `replicas = 2` against 1.
    ///
    /// Runs `eps train`'s job (or --spec) --runs times with each, alternating,
    /// and reports the median samples/s of each and their ratio, with the CPU
    /// time every process of the run spent per sample (from /proc) and how many
    /// cores it kept busy: where the job keeps the cores busy, the throughput
    /// ratio follows the CPU ratio.
    Replicas(crate::bench::replicas::ReplicasArgs),
    /// Pulls and pushes of a sparse table's rows by key through real processes.
    ///
    /// Starts a control plane, --servers servers and --workers workers on
    /// 127.0.0.1 with one table of --dim values per row. Each step a worker
    /// draws --keys ids (zipf with exponent --zipf over 0..--rows, repeats
    /// included), pulls their rows, pushes a gradient row per id and waits
    /// until the servers applied it. Reports the median pull and push (ids/s;
    /// GB/s counts the distinct rows' bytes moved) against the fabric's 4 MiB
    /// WRITE bandwidth (depth 8) measured in the same run, and the servers'
    /// memory: what it grew by from before the first row against the rows'
    /// bytes with optimizer state.
    Sparse(crate::bench::sparse_cli::SparseArgs),
    /// Push + pull iterations of a model through real processes.
    ///
    /// Starts a control plane, --servers servers and --workers workers on 127.0.0.1
    /// with a model of --size bytes (f32, SGD), times each worker's push_pull, and
    /// measures the fabric's 4 MiB WRITE bandwidth (depth 8) in the same run.
    /// gbytes_per_s counts gradient bytes pushed plus parameter bytes pulled per
    /// worker per second at the median iteration time.
    Pushpull(PushPullArgs),
    /// Pull latency while a shard migrates between two server processes.
    ///
    /// Starts a control plane, one server and one worker on 127.0.0.1 with a model
    /// of two shards of --shard-bytes each (f32, SGD). The worker trains (one
    /// push_pull per step) and between steps pulls the first shard
    /// --pulls-per-step times, timing each pull. After --steady-steps the job
    /// scales to two servers and that shard migrates whole onto the new one
    /// (snapshot, forwarded updates,
    /// cutover at an iteration boundary, release) while the pulls go on; --gap-steps
    /// after each migration finished it shrinks back to one (the shard moves home)
    /// or grows again, --migrations times in all.
    ///
    /// Reports pulls_failed (must be 0), the pull latency p99 before the first
    /// migration and while any is in flight, the max during them, the median
    /// migration's duration and phases, its throughput (bytes the source sent /
    /// duration; the snapshot alone / its copy phase), and the fabric's 4 MiB WRITE
    /// bandwidth (depth 8) measured in the same run. --plot draws pull latency over
    /// time with the phases shaded.
    Migrate(MigrateArgs),
    /// (internal) The peer process of `eps bench fabric`.
    #[command(hide = true)]
    FabricPeer {
        #[arg(long, value_enum)]
        op: OpArg,
        #[arg(long, value_parser = parse_size)]
        size: u64,
        #[arg(long)]
        depth: u32,
        #[arg(long, default_value = "soft")]
        transport: String,
        #[command(flatten)]
        rdma: crate::rdma::Named,
    },
}

/// `--op`: the operation `eps bench fabric` measures.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum OpArg {
    /// RDMA WRITE into the peer's registered memory.
    Write,
    /// RDMA READ from the peer's registered memory.
    Read,
    /// SEND into a RECV the peer has posted.
    Send,
}

impl From<OpArg> for Op {
    fn from(a: OpArg) -> Op {
        match a {
            OpArg::Write => Op::Write,
            OpArg::Read => Op::Read,
            OpArg::Send => Op::Send,
        }
    }
}

/// Most measured iterations a benchmark takes (a count from the command line
/// that the warm-up is added to must not wrap).
pub(crate) const MAX_ITERS: u64 = 1_000_000_000;

#[derive(clap::Args, Debug)]
pub struct FabricArgs {
    /// Operation to measure.
    #[arg(long, value_enum, default_value = "write")]
    op: OpArg,
    /// Bytes per operation; suffixes KiB, MiB, GiB (or K, M, G) are binary, kB, MB, GB decimal.
    #[arg(long, value_parser = parse_size, default_value = "64KiB")]
    size: u64,
    /// Number of measured operations (a warm-up of a tenth, at most 1000, runs first).
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..=MAX_ITERS))]
    iters: u64,
    /// Operations kept in flight: 1 measures latency, more measures bandwidth.
    #[arg(long, default_value_t = 1)]
    depth: u32,
    /// Transport provider: `soft` (userspace verbs over TCP with io_uring), `shm`
    /// (shared memory; also measures one thread's memcpy of --size in the same run
    /// and reports the ratio), `rdma` (an RDMA device; fails, saying what it found,
    /// when none can be used), or `auto` (rdma when usable, else soft; it says which).
    #[arg(long, default_value = "soft")]
    transport: String,
    /// The RDMA device for `--transport rdma|auto`.
    #[command(flatten)]
    rdma: crate::rdma::Named,
    /// Also print one JSON object with the results as the last line of stdout.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args, Debug)]
pub struct GpuArgs {
    /// Only write the kernels' PTX for sm_80 and sm_90 into this directory (needs
    /// NVRTC, not a GPU), for builds with EPS_CUDA_PTX_DIR.
    #[arg(long, hide = true)]
    emit_ptx: Option<PathBuf>,
    /// Bytes per buffer; suffixes KiB, MiB, GiB (binary) or kB, MB, GB.
    #[arg(long, value_parser = parse_size, default_value = "256MiB")]
    size: u64,
    /// Timed repetitions per figure (after a warm-up).
    #[arg(long, default_value_t = 20)]
    reps: usize,
    /// Also print one JSON object with the results as the last line of stdout.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args, Debug)]
pub struct AggArgs {
    /// Element type of the inputs: f32, bf16 or f16 (accumulation is always f32).
    #[arg(long, default_value = "f32", value_parser = parse_dtype)]
    dtype: DType,
    /// Number of inputs to sum (one per worker).
    #[arg(long, default_value_t = 8)]
    workers: usize,
    /// Bytes of each input (e.g. 64MiB).
    #[arg(long, value_parser = parse_size, default_value = "64MiB")]
    size: u64,
    /// Threads (0: one per core; at most 1024).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u16).range(0..=1024))]
    threads: u16,
    /// Timed repetitions; medians are reported.
    #[arg(long, default_value_t = 7)]
    reps: usize,
    /// Also print one JSON object with the results as the last line of stdout.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args, Debug)]
pub struct PushPullArgs {
    /// Model bytes (f32 parameters), e.g. 64MiB.
    #[arg(long, value_parser = parse_size, default_value = "64MiB")]
    size: u64,
    /// Worker processes.
    #[arg(long, default_value_t = 1)]
    workers: u32,
    /// Server processes.
    #[arg(long, default_value_t = 1)]
    servers: u32,
    /// Measured iterations (after 3 warm-up iterations).
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=MAX_ITERS))]
    iters: u64,
    /// Target shard size (the unit of pipelining).
    #[arg(long, value_parser = parse_size, default_value = "4MiB")]
    shard_bytes: u64,
    /// Transport of the servers and workers, and of the fabric WRITE reference
    /// measured in the same run: `soft` (TCP) or `shm` (shared memory).
    #[arg(long, default_value = "soft", value_parser = ["soft", "shm"])]
    transport: String,
    /// Also print one JSON object with the results as the last line of stdout.
    #[arg(long)]
    json: bool,
}

fn bench_pushpull(a: PushPullArgs) -> Result<(), String> {
    use eps_bench::pushpull::{PushPullBench, run};
    eps_proto::say!(
        "eps bench pushpull: size={} workers={} servers={} iters={} transport={}",
        format_size(a.size),
        a.workers,
        a.servers,
        a.iters,
        a.transport
    );
    let cfg = PushPullBench {
        size: a.size,
        workers: a.workers,
        servers: a.servers,
        iters: a.iters,
        shard_bytes: a.shard_bytes,
        shm: a.transport == "shm",
    };
    let r = run(&cfg).map_err(|e| error_chain(&e))?;
    let ratio = r.gbytes_per_s / r.fabric_write_gbytes_per_s;
    println!(
        "{:>10} {:>8} {:>8} {:>12} {:>10} {:>16} {:>8}",
        "size", "workers", "servers", "iter ms p50", "GB/s", "fabric write GB/s", "ratio"
    );
    println!(
        "{:>10} {:>8} {:>8} {:>12.2} {:>10.3} {:>16.3} {:>8.3}",
        format_size(a.size),
        a.workers,
        a.servers,
        r.iter_ms_p50,
        r.gbytes_per_s,
        r.fabric_write_gbytes_per_s,
        ratio
    );
    if let Some((poll, block)) = r.pingpong {
        let round_us = r.iter_ms_p50 * 1e3;
        println!(
            "round p50 {:.1} us, p99 {:.1} us ({:.2}x p50); 64 B TCP ping-pong on loopback: polling p50 {:.1} us \
             (round/ping-pong {:.1}x), blocking p50 {:.1} us ({:.1}x)",
            round_us,
            r.iter_ms_p99 * 1e3,
            r.iter_ms_p99 / r.iter_ms_p50,
            poll.p50_us,
            round_us / poll.p50_us,
            block.p50_us,
            round_us / block.p50_us
        );
    }
    let metrics_share = r.metrics_ns_per_round / (r.iter_ms_p50 * 1e6);
    println!(
        "metrics: {:.0} ns of recording per round ({:.5} of the round; counters, the latency histogram, gauges)",
        r.metrics_ns_per_round, metrics_share
    );
    if a.json {
        let j = Json::new()
            .int("size_bytes", a.size)
            .int("workers", a.workers as u64)
            .int("servers", a.servers as u64)
            .int("iters", a.iters)
            .str("transport", &a.transport)
            .num("iter_ms_p50", r.iter_ms_p50)
            .num("iter_ms_p99", r.iter_ms_p99)
            .num("gbytes_per_s", r.gbytes_per_s)
            .num("fabric_write_gbytes_per_s", r.fabric_write_gbytes_per_s)
            .num("ratio", ratio)
            .num("metrics_ns_per_round", r.metrics_ns_per_round)
            .num("metrics_share_of_round", metrics_share);
        let j = match r.pingpong {
            Some((poll, block)) => j
                .num("pingpong_poll_us_p50", poll.p50_us)
                .num("pingpong_poll_us_p99", poll.p99_us)
                .num("pingpong_block_us_p50", block.p50_us)
                .num("pingpong_block_us_p99", block.p99_us)
                .num("round_over_pingpong_poll", r.iter_ms_p50 * 1e3 / poll.p50_us),
            None => j,
        }
        .finish();
        println!("{j}");
    }
    Ok(())
}

#[derive(clap::Args, Debug)]
pub struct MigrateArgs {
    /// Bytes of the migrating shard, e.g. 64MiB (a multiple of 4KiB).
    #[arg(long, value_parser = parse_size, default_value = "64MiB")]
    shard_bytes: u64,
    /// Timed pulls of the shard between two training steps.
    #[arg(long, default_value_t = 4)]
    pulls_per_step: u32,
    /// Training steps before the first scale event (the steady phase).
    #[arg(long, default_value_t = 40)]
    steady_steps: u64,
    /// Migrations of the shard (alternately onto a new server and back).
    #[arg(long, default_value_t = 6)]
    migrations: u32,
    /// Training steps between two scale events.
    #[arg(long, default_value_t = 8)]
    gap_steps: u64,
    /// Training steps after the last one.
    #[arg(long, default_value_t = 20)]
    after_steps: u64,
    /// Draw pull latency over time, migration phases shaded, into this PNG file.
    #[arg(long, value_name = "FILE.png")]
    plot: Option<PathBuf>,
    /// Also print one JSON object with the results as the last line of stdout.
    #[arg(long)]
    json: bool,
}

fn bench_migrate(a: MigrateArgs) -> Result<(), String> {
    use eps_bench::migrate::{MigrateBench, run};
    let cfg = MigrateBench {
        shard_bytes: a.shard_bytes,
        steady_steps: a.steady_steps,
        migrations: a.migrations,
        gap_steps: a.gap_steps,
        after_steps: a.after_steps,
        pulls_per_step: a.pulls_per_step,
    };
    eps_proto::say!(
        "eps bench migrate: shard {} migrating {} times, first after {} steps, then every {}; {} timed pulls per step",
        format_size(a.shard_bytes),
        a.migrations,
        a.steady_steps,
        a.gap_steps,
        a.pulls_per_step
    );
    let r = run(&cfg).map_err(|e| error_chain(&e))?;
    let ratio_p99 = r.pull_lat_us_p99_during / r.pull_lat_us_p99_steady.max(1e-9);
    let ratio_bw = r.migration_gbytes_per_s / r.fabric_write_gbytes_per_s.max(1e-9);
    println!(
        "pulls {} (failed {}): steady {} p50 {:.0} us p99 {:.0} us; during migration {} p99 {:.0} us max {:.0} us ({:.2}x steady p99)",
        r.pulls,
        r.pulls_failed,
        r.steady_pulls,
        r.pull_lat_us_p50_steady,
        r.pull_lat_us_p99_steady,
        r.during_pulls,
        r.pull_lat_us_p99_during,
        r.pull_lat_us_max_during,
        ratio_p99
    );
    println!(
        "{} migrations, median {:.1} ms (preparing {:.1}, copying {:.1}, cutover {:.1}): {} bytes, {:.3} GB/s = {:.2}x fabric write {:.3} GB/s; snapshot alone {:.3} GB/s",
        r.migrations.len(),
        r.migration_ms,
        r.preparing_ms,
        r.copying_ms,
        r.cutover_ms,
        r.migrations.first().map_or(0, |m| m.bytes),
        r.migration_gbytes_per_s,
        ratio_bw,
        r.fabric_write_gbytes_per_s,
        r.snapshot_gbytes_per_s
    );
    if let Some(f) = &r.failure {
        println!("first failed pull: {f}");
    }
    if let Some(path) = &a.plot {
        crate::bench::plot::migration(path, &r).map_err(|e| format!("--plot {}: {e}", path.display()))?;
        println!("plot written to {}", path.display());
    }
    if a.json {
        let j = Json::new()
            .int("shard_bytes", a.shard_bytes)
            .int("pulls", r.pulls)
            .int("pulls_failed", r.pulls_failed)
            .int("steady_pulls", r.steady_pulls)
            .int("during_pulls", r.during_pulls)
            .num("pull_lat_us_p50_steady", r.pull_lat_us_p50_steady)
            .num("pull_lat_us_p99_steady", r.pull_lat_us_p99_steady)
            .num("pull_lat_us_p99_during", r.pull_lat_us_p99_during)
            .num("pull_lat_us_max_during", r.pull_lat_us_max_during)
            .num("p99_during_over_steady", ratio_p99)
            .num("migration_ms", r.migration_ms)
            .num("preparing_ms", r.preparing_ms)
            .num("copying_ms", r.copying_ms)
            .num("cutover_ms", r.cutover_ms)
            .int("migrations", r.migrations.len() as u64)
            .int("migration_bytes", r.migrations.first().map_or(0, |m| m.bytes))
            .num("migration_gbytes_per_s", r.migration_gbytes_per_s)
            .num("snapshot_gbytes_per_s", r.snapshot_gbytes_per_s)
            .num("fabric_write_gbytes_per_s", r.fabric_write_gbytes_per_s)
            .num("migration_over_fabric", ratio_bw)
            .finish();
        println!("{j}");
    }
    if r.pulls_failed > 0 {
        return Err(format!("{} pulls failed during the benchmark", r.pulls_failed));
    }
    Ok(())
}

fn parse_dtype(s: &str) -> Result<DType, String> {
    DType::parse(s).ok_or_else(|| format!("unknown dtype {s:?}: use f32, bf16 or f16"))
}

fn bench_agg(a: AggArgs) -> Result<(), String> {
    let cfg = AggBench { dtype: a.dtype, workers: a.workers, size: a.size, threads: a.threads.into(), reps: a.reps };
    eps_proto::say!("eps bench agg: dtype={} workers={} size={} reps={}", a.dtype.name(), a.workers, format_size(a.size), a.reps);
    let r = eps_bench::agg::run(&cfg).map_err(|e| error_chain(&e))?;
    println!(
        "{:<6} {:>8} {:>10} {:>8} {:>12} {:>12} {:>8}",
        "dtype", "workers", "size", "threads", "sum GB/s", "mem GB/s", "ratio"
    );
    println!(
        "{:<6} {:>8} {:>10} {:>8} {:>12.2} {:>12.2} {:>8.3}",
        a.dtype.name(),
        a.workers,
        format_size(a.size),
        r.threads,
        r.gbytes_per_s,
        r.mem_gbytes_per_s,
        r.ratio
    );
    if a.json {
        let j = Json::new()
            .str("dtype", a.dtype.name())
            .int("workers", a.workers as u64)
            .int("size_bytes", a.size)
            .int("threads", r.threads as u64)
            .num("gbytes_per_s", r.gbytes_per_s)
            .num("mem_gbytes_per_s", r.mem_gbytes_per_s)
            .num("ratio", r.ratio)
            .num("sum_ms_p50", r.sum_s * 1e3)
            .finish();
        println!("{j}");
    }
    Ok(())
}

fn bench_fabric(a: FabricArgs) -> Result<(), String> {
    let named = a.rdma.clone();
    let transport = crate::transport::for_bench(&a.transport, &named)?;
    let cfg = FabricBench { op: a.op.into(), size: a.size, iters: a.iters, depth: a.depth };
    let op = format!("{:?}", a.op).to_lowercase();
    eps_proto::say!(
        "eps bench fabric: op={op} size={} iters={} depth={} transport={transport} (peer process on this machine)",
        format_size(a.size),
        a.iters,
        a.depth
    );
    // On shm the limit is one thread's memcpy of the same size, measured before
    // and after (the machine is shared and noisy).
    let memcpy = || fabric::memcpy_gbytes_per_s(a.size, 21).map_err(|e| error_chain(&e));
    let before = if transport == "shm" { Some(memcpy()?) } else { None };
    let r = match transport {
        "rdma" => {
            let (pd, _) = crate::rdma::bench_pd(&named)?;
            fabric::run_on(pd, &cfg, "rdma", &named.args())
        }
        "shm" => fabric::run_shm(&cfg),
        _ => fabric::run(&cfg),
    }
    .map_err(|e| error_chain(&e))?;
    let memcpy_gbs = match before {
        Some(b) => Some(0.5 * (b + memcpy()?)),
        None => None,
    };
    println!(
        "{:<10} {:>10} {:>8} {:>6} {:>10} {:>10} {:>10} {:>10}",
        "op", "size", "iters", "depth", "GB/s", "p50 us", "p99 us", "max us"
    );
    println!(
        "{:<10} {:>10} {:>8} {:>6} {:>10.3} {:>10.2} {:>10.2} {:>10.2}",
        op,
        format_size(a.size),
        a.iters,
        a.depth,
        r.bw_gbytes_per_s,
        r.lat_us_p50,
        r.lat_us_p99,
        r.lat_us_max
    );
    if let Some(m) = memcpy_gbs {
        println!(
            "single-thread memcpy of {}: {m:.3} GB/s; shm {op} / memcpy = {:.2}",
            format_size(a.size),
            r.bw_gbytes_per_s / m
        );
    }
    if a.json {
        let mut j = Json::new()
            .str("op", &op)
            .int("size_bytes", a.size)
            .int("iters", a.iters)
            .int("depth", a.depth as u64)
            .str("transport", transport)
            .num("bw_gbytes_per_s", r.bw_gbytes_per_s)
            .num("lat_us_p50", r.lat_us_p50)
            .num("lat_us_p99", r.lat_us_p99)
            .num("lat_us_max", r.lat_us_max)
            .num("elapsed_s", r.elapsed.as_secs_f64());
        if let Some(m) = memcpy_gbs {
            j = j.num("memcpy_gbytes_per_s", m).num("ratio_to_memcpy", r.bw_gbytes_per_s / m);
        }
        println!("{}", j.finish());
    }
    Ok(())
}
