//! `eps bench sparse --table`: one table's pull in this process, no fabric
//! and no other process: the cost of a row created by the pull (never seen
//! before) and of a row the table holds, against a memory copy of a row's
//! bytes (values and optimizer state) at the speed one thread copies 64 MiB,
//! measured in the same run.

use std::time::Instant;

use eps_sparse::{RowTable, TableSpec};

use crate::fabric;

/// Rows the table holds before the measured pulls.
pub const HELD: u64 = 500_000;

/// Parameters of one run.
#[derive(Clone, Debug)]
pub struct RowsBench {
    /// The table: its dimension, optimizer (whose state sits beside each
    /// row) and initializer.
    pub table: TableSpec,
    /// Distinct ids per pull.
    pub keys: usize,
    /// Measured pulls of each kind.
    pub iters: u64,
}

/// The table a job declares as `[[model.tables]]` with `dim` and
/// `optimizer` (a row-wise one's name) and defaults otherwise.
pub fn table_spec(dim: u32, optimizer: &str) -> Result<TableSpec, String> {
    let text = format!(
        "[job]\nname = \"rows\"\nworkers = 1\nservers = 1\nsteps = 1\n[model]\n\
         tensors = [{{ name = \"dense\", elements = 1 }}]\n\
         [[model.tables]]\nname = \"emb\"\ndim = {dim}\noptimizer = \"{optimizer}\"\n"
    );
    let spec = eps_proto::JobSpec::from_toml(&text).map_err(|e| format!("--dim {dim} --optimizer {optimizer}: {e}"))?;
    eps_sparse::decl::tables(&spec).first().map(|t| t.spec).ok_or_else(|| "no table declared".to_string())
}

/// What one run measured.
#[derive(Clone, Debug, Default)]
pub struct RowsReport {
    /// Median ns per row of a pull of ids never seen.
    pub new_ns: f64,
    /// Median ns per row of a pull of ids held.
    pub held_ns: f64,
    /// Bytes of a row with its optimizer state.
    pub row_bytes: usize,
    /// ns for one thread to copy `row_bytes` at its 64 MiB memcpy speed.
    pub memcpy_row_ns: f64,
}

/// A 64-bit mix: ids spread over the key space, distinct for distinct inputs.
fn id(n: u64) -> u64 {
    let mut x = n.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Runs the benchmark.
pub fn run(cfg: &RowsBench) -> Result<RowsReport, String> {
    if cfg.keys == 0 || cfg.iters == 0 {
        return Err("--keys and --iters must be at least 1".into());
    }
    let dim = cfg.table.dim;
    let mut t = RowTable::new(TableSpec { max_rows: usize::MAX, ..cfg.table }).map_err(|e| e.to_string())?;
    let mut out = vec![0f32; cfg.keys * dim];
    let mut next = 0u64;
    while next < HELD {
        let n = (HELD - next).min(cfg.keys as u64);
        let batch: Vec<u64> = (next..next + n).map(id).collect();
        t.pull(&batch, 0, &mut out[..batch.len() * dim]).map_err(|e| e.to_string())?;
        next += n;
    }
    let (mut new_ns, mut held_ns) = (Vec::new(), Vec::new());
    let per_row = |t0: Instant| t0.elapsed().as_nanos() as f64 / cfg.keys as f64;
    for i in 0..cfg.iters {
        let fresh: Vec<u64> = (next..next + cfg.keys as u64).map(id).collect();
        next += cfg.keys as u64;
        let t0 = Instant::now();
        t.pull(&fresh, i, &mut out).map_err(|e| e.to_string())?;
        new_ns.push(per_row(t0));
        // Distinct ids among the first HELD, spread over them.
        let held: Vec<u64> = (0..cfg.keys as u64).map(|j| id((j * 7_919 + i * 104_729) % HELD)).collect();
        let t0 = Instant::now();
        t.pull(&held, i, &mut out).map_err(|e| e.to_string())?;
        held_ns.push(per_row(t0));
    }
    let row_bytes = t.stride() * 4;
    let gbytes = fabric::memcpy_gbytes_per_s(64 << 20, 5).map_err(|e| e.to_string())?;
    Ok(RowsReport {
        new_ns: median(&mut new_ns),
        held_ns: median(&mut held_ns),
        row_bytes,
        memcpy_row_ns: row_bytes as f64 / gbytes,
    })
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Held ids are distinct (7919 is prime to HELD's factors, and so is
    /// the step), so a "held" pull creates nothing and measures lookups.
    #[test]
    fn held_ids_are_distinct_and_held() {
        let ids: std::collections::HashSet<u64> = (0..65_536u64).map(|j| (j * 7_919 + 3 * 104_729) % HELD).collect();
        assert_eq!(ids.len(), 65_536);
        assert!(ids.iter().all(|&i| i < HELD));
    }

    #[test]
    fn a_small_run_reports_both_costs() {
        let table = table_spec(8, "adagrad").unwrap();
        let r = run(&RowsBench { table, keys: 1000, iters: 3 }).unwrap();
        assert!(r.new_ns > 0.0 && r.held_ns > 0.0 && r.memcpy_row_ns > 0.0, "{r:?}");
        assert_eq!(r.row_bytes, 8 * 2 * 4);
        assert!(run(&RowsBench { table, keys: 0, iters: 3 }).is_err());
        let e = table_spec(8, "lamb").unwrap_err();
        assert!(e.contains("lamb"), "{e}");
    }
}
