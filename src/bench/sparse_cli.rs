//! `eps bench sparse`: its flags, and the reports of its three measurements.

use std::path::PathBuf;

use crate::bench::Json;
use crate::bench::cli::MAX_ITERS;
use crate::error::chain as error_chain;
use crate::units::format_size;

#[derive(clap::Args, Debug)]
pub struct SparseArgs {
    /// Size of the key space: ids are drawn from 0..ROWS (e.g. 100M).
    #[arg(long, value_parser = crate::units::parse_count, default_value = "100M")]
    rows: u64,
    /// Values per row (f32).
    #[arg(long, default_value_t = 64)]
    dim: u32,
    /// Ids per batch, repeats included (e.g. 65536 or 64K).
    #[arg(long, value_parser = crate::units::parse_count, default_value = "65536")]
    keys: u64,
    /// Zipf exponent of the ids (1.0 and above: heavily skewed).
    #[arg(long, default_value_t = 1.05)]
    zipf: f64,
    /// Measured steps (after 2 warm-up steps).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..=MAX_ITERS))]
    iters: u64,
    /// Worker processes.
    #[arg(long, default_value_t = 1)]
    workers: u32,
    /// Server processes.
    #[arg(long, default_value_t = 1)]
    servers: u32,
    /// The row-wise optimizer: sgd, momentum, nesterov, adam, adamw or adagrad.
    #[arg(long, default_value = "adagrad")]
    optimizer: String,
    /// Measure one table in this process instead (no fabric, no other
    /// process): a pull's cost per new row and per held row, on a table of
    /// 500,000 rows, pulls of --keys distinct ids, --iters of each.
    #[arg(long)]
    table: bool,
    /// Measure one server's checkpoint of the table instead, in this
    /// process: the table after --steps steps of --keys ids saved whole, then
    /// incrementally after each --every further steps (--iters saves): bytes
    /// written, time to copy the rows out against a memcpy of those bytes,
    /// and time to write and fsync them (into --dir).
    #[arg(long, conflicts_with = "table")]
    checkpoint: bool,
    /// --checkpoint: steps before the whole save.
    #[arg(long, default_value_t = 100, requires = "checkpoint", value_parser = clap::value_parser!(u64).range(1..=MAX_ITERS))]
    steps: u64,
    /// --checkpoint: steps between two incremental saves (the job's checkpoint_every).
    #[arg(long, default_value_t = 10, requires = "checkpoint", value_parser = clap::value_parser!(u64).range(1..=MAX_ITERS))]
    every: u64,
    /// --checkpoint: where the files are written (removed after) [the temporary directory].
    #[arg(long, requires = "checkpoint")]
    dir: Option<PathBuf>,
    /// Also print one JSON object with the results as the last line of stdout.
    #[arg(long)]
    json: bool,
}

/// Runs `eps bench sparse`.
pub fn run(a: SparseArgs) -> Result<(), String> {
    use eps_bench::sparse::{SparseBench, run};
    if a.table {
        return crate::bench::rows::bench(a.dim, a.keys, a.iters, &a.optimizer, a.json);
    }
    if a.checkpoint {
        return checkpoint(&a);
    }
    let keys = u32::try_from(a.keys).map_err(|_| format!("--keys {}: at most {}", a.keys, eps_proto::spec::MAX_KEYS))?;
    eps_proto::say!(
        "eps bench sparse: rows={} dim={} keys={} zipf={} workers={} servers={} iters={} optimizer={}",
        a.rows,
        a.dim,
        a.keys,
        a.zipf,
        a.workers,
        a.servers,
        a.iters,
        a.optimizer
    );
    let cfg = SparseBench {
        rows: a.rows,
        dim: a.dim,
        keys,
        zipf: a.zipf,
        iters: a.iters,
        workers: a.workers,
        servers: a.servers,
        optimizer: a.optimizer.clone(),
    };
    let r = run(&cfg).map_err(|e| error_chain(&e))?;
    let (pull_ratio, push_ratio) =
        (r.pull_gbytes_per_s / r.fabric_write_gbytes_per_s, r.push_gbytes_per_s / r.fabric_write_gbytes_per_s);
    let mem_ratio = r.server_rss_growth_bytes as f64 / r.row_state_bytes as f64;
    println!("{:>6} {:>10} {:>10} {:>12} {:>10} {:>8}", "", "ms p50", "Mkeys/s", "row GB/s", "fabric", "ratio");
    println!(
        "{:>6} {:>10.2} {:>10.2} {:>12.3} {:>10.3} {:>8.3}",
        "pull",
        r.pull_ms_p50,
        r.pull_keys_per_s / 1e6,
        r.pull_gbytes_per_s,
        r.fabric_write_gbytes_per_s,
        pull_ratio
    );
    println!(
        "{:>6} {:>10.2} {:>10.2} {:>12.3} {:>10.3} {:>8.3}",
        "push",
        r.push_ms_p50,
        r.push_keys_per_s / 1e6,
        r.push_gbytes_per_s,
        r.fabric_write_gbytes_per_s,
        push_ratio
    );
    println!(
        "distinct ids per batch {:.0}; rows held {}, {} with optimizer state; server memory grew {} ({mem_ratio:.3}x), {} resident at the end; tables' own count {}",
        r.distinct_p50,
        r.rows_held,
        format_size(r.row_state_bytes),
        format_size(r.server_rss_growth_bytes),
        format_size(r.server_rss_bytes),
        format_size(r.table_heap_bytes)
    );
    if a.json {
        let j = Json::new()
            .int("rows", a.rows)
            .int("dim", a.dim.into())
            .int("keys", a.keys)
            .num("zipf", a.zipf)
            .int("workers", a.workers.into())
            .int("servers", a.servers.into())
            .int("iters", a.iters)
            .num("distinct_keys_p50", r.distinct_p50)
            .num("pull_ms_p50", r.pull_ms_p50)
            .num("push_ms_p50", r.push_ms_p50)
            .num("pull_keys_per_s", r.pull_keys_per_s)
            .num("push_keys_per_s", r.push_keys_per_s)
            .num("pull_gbytes_per_s", r.pull_gbytes_per_s)
            .num("push_gbytes_per_s", r.push_gbytes_per_s)
            .num("fabric_write_gbytes_per_s", r.fabric_write_gbytes_per_s)
            .num("pull_ratio", pull_ratio)
            .num("push_ratio", push_ratio)
            .int("rows_held", r.rows_held)
            .int("row_state_bytes", r.row_state_bytes)
            .int("server_rss_bytes", r.server_rss_bytes)
            .int("server_rss_growth_bytes", r.server_rss_growth_bytes)
            .num("memory_ratio", mem_ratio)
            .int("table_heap_bytes", r.table_heap_bytes)
            .finish();
        println!("{j}");
    }
    Ok(())
}

/// `--checkpoint`: one table's checkpoint, whole and incremental.
fn checkpoint(a: &SparseArgs) -> Result<(), String> {
    use eps_bench::ckpt::{CkptBench, run};
    let keys = usize::try_from(a.keys).map_err(|_| format!("--keys {}: too many", a.keys))?;
    let saves = u32::try_from(a.iters).map_err(|_| format!("--iters {}: too many", a.iters))?;
    let dir = a.dir.clone().unwrap_or_else(std::env::temp_dir).join(format!("eps-bench-ckpt-{}", std::process::id()));
    eps_proto::say!(
        "eps bench sparse --checkpoint: rows={} dim={} keys={} zipf={} optimizer={}; a whole save after {} steps, then {saves} incremental ones every {} steps, into {}",
        a.rows,
        a.dim,
        a.keys,
        a.zipf,
        a.optimizer,
        a.steps,
        a.every,
        dir.display()
    );
    let table = eps_bench::rows::table_spec(a.dim, &a.optimizer)?;
    let cfg = CkptBench { table, rows: a.rows, keys, zipf: a.zipf, steps: a.steps, every: a.every, saves, dir };
    let r = run(&cfg)?;
    let memcpy_s = |bytes: u64| bytes as f64 / (r.memcpy_gbytes_per_s * 1e9);
    println!("{:>12} {:>10} {:>10} {:>9} {:>10} {:>9}", "save", "rows", "bytes", "copy ms", "x memcpy", "write ms");
    let line = |what: String, s: &eps_bench::ckpt::SaveCost| {
        println!(
            "{what:>12} {:>10} {:>10} {:>9.1} {:>10.1} {:>9.1}",
            s.rows,
            format_size(s.bytes),
            s.copy_s * 1e3,
            s.copy_s / memcpy_s(s.bytes),
            s.write_s * 1e3
        );
    };
    line(format!("whole @{}", a.steps), &r.whole);
    for (i, s) in r.incremental.iter().enumerate() {
        line(format!("+{} steps", (i as u64 + 1) * a.every), s);
    }
    let mut inc: Vec<f64> = r.incremental.iter().map(|s| s.bytes as f64 / r.whole.bytes as f64).collect();
    inc.sort_by(f64::total_cmp);
    let median = inc[inc.len() / 2];
    println!(
        "{} rows held at the whole save; an incremental save writes {median:.3} of the whole's bytes (median); one thread copies {:.2} GB/s (64 MiB memcpy, same run)",
        r.rows_held, r.memcpy_gbytes_per_s
    );
    if a.json {
        let med = |f: fn(&eps_bench::ckpt::SaveCost) -> f64| {
            let mut v: Vec<f64> = r.incremental.iter().map(f).collect();
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let j = Json::new()
            .int("rows", a.rows)
            .int("dim", a.dim.into())
            .int("keys", a.keys)
            .num("zipf", a.zipf)
            .int("steps", a.steps)
            .int("every", a.every)
            .int("rows_held", r.rows_held)
            .int("whole_bytes", r.whole.bytes)
            .num("whole_copy_ms", r.whole.copy_s * 1e3)
            .num("whole_write_ms", r.whole.write_s * 1e3)
            .num("incremental_bytes_p50", med(|s| s.bytes as f64))
            .num("incremental_copy_ms_p50", med(|s| s.copy_s * 1e3))
            .num("incremental_write_ms_p50", med(|s| s.write_s * 1e3))
            .num("incremental_ratio", median)
            .num("memcpy_gbytes_per_s", r.memcpy_gbytes_per_s)
            .finish();
        println!("{j}");
    }
    Ok(())
}
