//! Rows moved between servers with their buckets: one blob per source and
//! target, READ by the target from the source's registered memory. It is
//! `EPSR`, a u32 count of sections, then per table a section: the table's
//! index (u32), its values-and-state per row (u32), a row count (u64), and
//! the rows as [`crate::RowTable::take_rows`] writes them: key, step count,
//! step created, step last touched (u64 each), touches (u32), 4 bytes of
//! padding, then the row's values and state (f32).

use crate::SparseError;

/// Bytes of a row record before its values.
pub const ROW_META: usize = 40;
const MAGIC: &[u8; 4] = b"EPSR";
const SECTION: usize = 16;

/// An empty blob.
pub fn start() -> Vec<u8> {
    let mut out = MAGIC.to_vec();
    out.extend_from_slice(&0u32.to_le_bytes());
    out
}

/// Appends a section of table `table` (`stride` values per row) whose
/// `rows` records are `records`.
pub fn section(out: &mut Vec<u8>, table: u32, stride: usize, rows: u64, records: &[u8]) {
    out.extend_from_slice(&table.to_le_bytes());
    out.extend_from_slice(&(stride as u32).to_le_bytes());
    out.extend_from_slice(&rows.to_le_bytes());
    out.extend_from_slice(records);
    let n = u32::from_le_bytes(out[4..8].try_into().unwrap_or_default()) + 1;
    out[4..8].copy_from_slice(&n.to_le_bytes());
}

/// One table's rows in a blob.
#[derive(Debug, PartialEq, Eq)]
pub struct Section<'a> {
    /// The table's index.
    pub table: u32,
    /// How many rows.
    pub rows: u64,
    /// Their records.
    pub records: &'a [u8],
}

/// The sections of `blob`, each checked against `strides` (the values and
/// state per row of each of the job's tables): every length, every table
/// index, no table twice, nothing after the last.
pub fn sections<'a>(blob: &'a [u8], strides: &[usize]) -> Result<Vec<Section<'a>>, SparseError> {
    let bad = |why: String| SparseError::Rows(why);
    if blob.len() < 8 || &blob[..4] != MAGIC {
        return Err(bad(format!("a blob of {} bytes without its header", blob.len())));
    }
    let n = u32::from_le_bytes(blob[4..8].try_into().unwrap_or_default()) as usize;
    let mut at = 8;
    let mut out: Vec<Section<'a>> = Vec::with_capacity(n.min(strides.len()));
    for _ in 0..n {
        let h = blob.get(at..at + SECTION).ok_or_else(|| bad("a section cut short".into()))?;
        let table = u32::from_le_bytes(h[..4].try_into().unwrap_or_default());
        let stride = u32::from_le_bytes(h[4..8].try_into().unwrap_or_default()) as usize;
        let rows = u64::from_le_bytes(h[8..].try_into().unwrap_or_default());
        let want = strides.get(table as usize).ok_or_else(|| bad(format!("table {table}, which the job lacks")))?;
        if stride != *want || out.iter().any(|s| s.table == table) {
            return Err(bad(format!("table {table} twice, or with {stride} values a row (it has {want})")));
        }
        let len = rows.checked_mul((ROW_META + stride * 4) as u64).filter(|&l| l <= (blob.len() - at - SECTION) as u64);
        let len = len.ok_or_else(|| bad(format!("table {table}: {rows} rows do not fit the blob")))? as usize;
        at += SECTION;
        out.push(Section { table, rows, records: &blob[at..at + len] });
        at += len;
    }
    if at != blob.len() {
        return Err(bad(format!("{} bytes after the last section", blob.len() - at)));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Init, RowOptimizer, RowTable, TableSpec};

    fn spec() -> TableSpec {
        let adam = eps_agg::Optimizer::Adam { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, decoupled: false };
        let opt = RowOptimizer::Dense(adam);
        TableSpec { dim: 4, opt, init: Init::Uniform { scale: 0.1 }, seed: 9, max_rows: 1 << 20 }
    }

    #[test]
    fn rows_move_with_their_state_and_come_out_the_same() {
        let mut a = RowTable::new(spec()).unwrap();
        let keys: Vec<u64> = (0..100).collect();
        let grads: Vec<f32> = (0..400).map(|i| (i % 7) as f32 * 0.25 - 0.5).collect();
        for now in 0..3 {
            a.push(&keys, &grads, 0.1, now).unwrap();
        }
        let mut reference = RowTable::new(spec()).unwrap();
        for now in 0..3 {
            reference.push(&keys, &grads, 0.1, now).unwrap();
        }
        let mut outs = vec![Vec::new()];
        let counts = a.take_rows(|k| (k % 2 == 1).then_some(0), &mut outs);
        assert_eq!((counts[0], a.len()), (50, 50));
        let mut blob = start();
        section(&mut blob, 1, a.stride(), counts[0], &outs[0]);
        let s = sections(&blob, &[8, a.stride()]).unwrap();
        assert_eq!((s.len(), s[0].table, s[0].rows), (1, 1, 50));
        let mut b = RowTable::new(spec()).unwrap();
        b.put_rows(s[0].records, s[0].rows).unwrap();
        assert_eq!(
            b.put_rows(s[0].records, s[0].rows),
            Err(SparseError::Rows("key 1 arrived twice, or is already held here".into()))
        );
        // Both halves step on as the table that never split does.
        for now in 3..5 {
            a.push(&keys[..50].iter().copied().filter(|k| k % 2 == 0).collect::<Vec<_>>(), &[0.5; 100], 0.1, now).unwrap();
            b.push(&keys.iter().copied().filter(|k| k % 2 == 1).collect::<Vec<_>>(), &[0.5; 200], 0.1, now).unwrap();
            let even: Vec<u64> = keys[..50].iter().copied().filter(|k| k % 2 == 0).collect();
            let odd: Vec<u64> = keys.iter().copied().filter(|k| k % 2 == 1).collect();
            reference.push(&[even, odd].concat(), &[0.5; 300], 0.1, now).unwrap();
        }
        for k in keys {
            let row = if k % 2 == 1 { b.row(k) } else { a.row(k) };
            assert_eq!(
                row.map(|r| r.iter().map(|v| v.to_bits()).collect::<Vec<_>>()),
                reference.row(k).map(|r| r.iter().map(|v| v.to_bits()).collect()),
                "key {k}"
            );
        }
    }

    #[test]
    fn bad_blobs_are_refused() {
        let mut blob = start();
        section(&mut blob, 0, 8, 1, &[0u8; ROW_META + 32]);
        assert!(sections(&blob, &[8]).is_ok());
        assert!(sections(&blob, &[4]).is_err(), "another stride");
        assert!(sections(&blob, &[]).is_err(), "a table the job lacks");
        assert!(sections(&blob[..blob.len() - 1], &[8]).is_err(), "cut short");
        let mut longer = blob.clone();
        longer.push(0);
        assert!(sections(&longer, &[8]).is_err(), "trailing bytes");
        let mut twice = blob.clone();
        section(&mut twice, 0, 8, 0, &[]);
        assert!(sections(&twice, &[8]).is_err(), "a table twice");
        assert!(sections(b"EPSX\0\0\0\0", &[8]).is_err(), "magic");
        let mut huge = start();
        section(&mut huge, 0, 8, u64::MAX / 2, &[]);
        assert!(sections(&huge, &[8]).is_err(), "a row count that overflows");
    }
}
