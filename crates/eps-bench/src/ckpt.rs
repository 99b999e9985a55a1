//! `eps bench sparse --checkpoint`: what a server's checkpoint of one table
//! costs, in this process: the table of `eps bench sparse` (zipf ids over a
//! key space, pulled and pushed a batch a step) after `steps` steps, saved
//! whole, then incrementally after each further `every` steps, as servers
//! save into the job's own directory (`eps_sparse::saves`): the bytes
//! written, the time to copy the rows out (what training waits for),
//! against one thread's memcpy of the same bytes measured in the same run,
//! and the time to write and fsync the file. As on a server, a save copies
//! into the buffer of the save before (the first into fresh memory).

use std::path::Path;
use std::time::Instant;

use eps_proto::checkpoint::RowsHeader;
use eps_sparse::saves::{Saved, Saves};
use eps_sparse::zipf::Zipf;
use eps_sparse::{RowTable, TableSpec};

use crate::fabric;

/// Parameters of one run.
#[derive(Clone, Debug)]
pub struct CkptBench {
    /// The table.
    pub table: TableSpec,
    /// Size of the key space, ids per batch (with repeats), zipf exponent.
    pub rows: u64,
    pub keys: usize,
    pub zipf: f64,
    /// Steps before the whole save, and between incremental ones.
    pub steps: u64,
    pub every: u64,
    /// Incremental saves measured.
    pub saves: u32,
    /// Where the files are written (removed after).
    pub dir: std::path::PathBuf,
}

/// One save measured.
#[derive(Clone, Copy, Debug, Default)]
pub struct SaveCost {
    /// Bytes of the file.
    pub bytes: u64,
    /// Rows in it.
    pub rows: u64,
    /// Seconds to plan and copy the rows out (training waits this long).
    pub copy_s: f64,
    /// Seconds to write and fsync the file.
    pub write_s: f64,
}

/// What one run measured.
#[derive(Clone, Debug, Default)]
pub struct CkptReport {
    /// Rows the table held at the whole save.
    pub rows_held: u64,
    /// The whole save.
    pub whole: SaveCost,
    /// The incremental saves, in order.
    pub incremental: Vec<SaveCost>,
    /// One thread's memcpy speed in this run (1e9 B/s).
    pub memcpy_gbytes_per_s: f64,
}

/// Runs the benchmark.
pub fn run(cfg: &CkptBench) -> Result<CkptReport, String> {
    if cfg.keys == 0 || cfg.steps == 0 || cfg.every == 0 || cfg.saves == 0 {
        return Err("--keys, --steps, --every and --saves must be at least 1".into());
    }
    let mut t = RowTable::new(TableSpec { max_rows: usize::MAX, ..cfg.table }).map_err(|e| e.to_string())?;
    t.keep_deletions();
    let mut ids = Zipf::new(cfg.rows, cfg.zipf, 1).ok_or_else(|| format!("--rows {} --zipf {}: no ids", cfg.rows, cfg.zipf))?;
    let dim = cfg.table.dim;
    let (mut batch, mut out, grads) = (vec![0u64; cfg.keys], vec![0f32; cfg.keys * dim], vec![1e-3f32; cfg.keys * dim]);
    let mut step = |t: &mut RowTable, now: u64| -> Result<(), String> {
        ids.fill(&mut batch);
        t.pull(&batch, now, &mut out).map_err(|e| e.to_string())?;
        // As a server steps a push: each id once, its rows summed.
        let (keys, rows) = eps_sparse::table::sum_duplicates(&batch, &grads, dim).map_err(|e| e.to_string())?;
        t.push(&keys, &rows, 0.01, now).map_err(|e| e.to_string())
    };
    let mine = vec![true; eps_proto::buckets::BUCKETS as usize];
    let mut saves = Saves::default();
    let mut written = Vec::new();
    let mut now = 0;
    // The records' buffer of a save is the next one's, as on a server (its
    // pages are touched already: the copy does not wait for page faults).
    let mut spare = Vec::new();
    let mut save = |t: &mut RowTable, now: u64, written: &mut Vec<u64>| -> Result<SaveCost, String> {
        let t0 = Instant::now();
        let s = saves.save(std::mem::take(&mut spare), t, now, &mine, true, |v| written.contains(&v));
        t.clear_changed();
        let copy_s = t0.elapsed().as_secs_f64();
        let (bytes, write_s) = write(&cfg.dir, t.stride(), now, &s)?;
        written.push(now);
        spare = s.records;
        Ok(SaveCost { bytes, rows: s.rows, copy_s, write_s })
    };
    for _ in 0..cfg.steps {
        step(&mut t, now)?;
        now += 1;
    }
    let rows_held = t.len() as u64;
    let whole = save(&mut t, now, &mut written)?;
    let mut incremental = Vec::new();
    for _ in 0..cfg.saves {
        for _ in 0..cfg.every {
            step(&mut t, now)?;
            now += 1;
        }
        incremental.push(save(&mut t, now, &mut written)?);
    }
    let _ = std::fs::remove_dir_all(&cfg.dir);
    let memcpy_gbytes_per_s = fabric::memcpy_gbytes_per_s(64 << 20, 5).map_err(|e| e.to_string())?;
    Ok(CkptReport { rows_held, whole, incremental, memcpy_gbytes_per_s })
}

/// Writes a save's file as a server does; its bytes and the seconds taken.
fn write(dir: &Path, stride: usize, version: u64, s: &Saved) -> Result<(u64, f64), String> {
    let h = RowsHeader { version, table: 0, stride: stride as u32, rows: s.rows, deleted: s.deleted.len() as u64 };
    let path = dir.join(eps_proto::checkpoint::dir_name(version)).join("table-0.bin");
    let t0 = Instant::now();
    eps_control_client::checkpoint::write_atomic(&path, &[&h.encode(), &s.records, bytemuck::cast_slice(&s.deleted)])?;
    let bytes = (eps_proto::checkpoint::PIECE_HEADER + s.records.len() + s.deleted.len() * 8) as u64;
    Ok((bytes, t0.elapsed().as_secs_f64()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_run_writes_less_incrementally() {
        let dir = std::env::temp_dir().join(format!("eps-bench-ckpt-{}", std::process::id()));
        let table = crate::rows::table_spec(8, "adagrad").unwrap();
        let cfg = CkptBench { table, rows: 1_000_000, keys: 2000, zipf: 1.05, steps: 20, every: 2, saves: 2, dir: dir.clone() };
        let r = run(&cfg).unwrap();
        assert!(r.rows_held > 1000 && r.whole.rows == r.rows_held, "{r:?}");
        assert!(r.incremental.iter().all(|s| s.bytes < r.whole.bytes / 2 && s.rows > 0), "{r:?}");
        assert!(!dir.exists(), "the files are removed");
        assert!(run(&CkptBench { every: 0, ..cfg }).is_err());
    }
}
