use super::*;
use crate::{Init, RowOptimizer, TableSpec};

fn table() -> RowTable {
    let opt = RowOptimizer::Adagrad { eps: 1e-8, initial_accumulator: 0.1, weight_decay: 0.0 };
    let mut t = RowTable::new(TableSpec { dim: 4, opt, init: Init::Uniform { scale: 0.1 }, seed: 5, max_rows: 1 << 20 }).unwrap();
    t.keep_deletions();
    t
}

/// A table read back from saves as a resume reads them: for each bucket its
/// whole file, then its changes, in version order.
fn read_back(files: &BTreeMap<u64, Saved>, latest: u64) -> RowTable {
    let s = &files[&latest];
    let mut whole: BTreeMap<u64, Vec<u32>> = s.earlier.iter().map(|(v, (w, _))| (*v, w.clone())).collect();
    let mut changes: BTreeMap<u64, Vec<u32>> = s.earlier.iter().map(|(v, (_, c))| (*v, c.clone())).collect();
    whole.entry(latest).or_default().extend(&s.whole);
    changes.entry(latest).or_default().extend(&s.changes);
    let mut t = table();
    let rec = crate::moves::ROW_META + t.stride() * 4;
    for (v, f) in files.range(..=latest) {
        let pick = |buckets: &[u32]| -> (Vec<u8>, u64) {
            let r: Vec<&[u8]> = f
                .records
                .chunks_exact(rec)
                .filter(|r| buckets.contains(&bucket_of(u64::from_le_bytes(r[..8].try_into().unwrap()))))
                .collect();
            (r.concat(), r.len() as u64)
        };
        let (w, n) = pick(whole.get(v).map_or(&[], |b| b));
        t.put_rows(&w, n).unwrap();
        let c = changes.get(v).map_or(&[][..], |b| b);
        let gone: Vec<u64> = f.deleted.iter().copied().filter(|&k| c.contains(&bucket_of(k))).collect();
        t.remove_keys(&gone);
        let (d, n) = pick(c);
        t.put_rows_over(&d, n).unwrap();
    }
    t
}

fn same(a: &RowTable, b: &RowTable) {
    let (x, y) = (crate::table::tests::records(a), crate::table::tests::records(b));
    assert!(x == y, "the rows read back differ ({} and {} rows)", a.len(), b.len());
}

#[test]
fn saves_write_what_changed_and_read_back_to_the_table() {
    let mut t = table();
    let keys: Vec<u64> = (0..20_000).collect();
    t.push(&keys, &vec![0.5; keys.len() * 4], 0.1, 0).unwrap();
    let mine = vec![true; BUCKETS as usize];
    let mut saves = Saves::default();
    let mut files = BTreeMap::new();
    let mut ok = vec![];
    let save = |t: &mut RowTable, saves: &mut Saves, v: u64, ok: &[u64], files: &mut BTreeMap<u64, Saved>| {
        let s = saves.save(Vec::new(), t, v, &mine, true, |u| ok.contains(&u));
        t.clear_changed();
        files.insert(v, s.clone());
        s
    };
    // The first save writes every bucket whole.
    let s = save(&mut t, &mut saves, 10, &ok, &mut files);
    assert_eq!((s.rows, s.whole.len(), s.changes.len()), (20_000, BUCKETS as usize, 0));
    ok.push(10);
    // A few rows step, one is evicted: their changes alone.
    t.push(&keys[..50], &vec![0.25; 200], 0.1, 15).unwrap();
    t.remove_keys(&[19_999]);
    let s = save(&mut t, &mut saves, 20, &ok, &mut files);
    // (Empty buckets are written whole: nothing to write, no older file read.)
    let empty: Vec<u32> = (0..BUCKETS).filter(|&b| t.bucket_counts().0[b as usize] == 0).collect();
    assert_eq!((s.rows, s.deleted.clone(), s.whole.clone()), (50, vec![19_999], empty.clone()));
    assert!(s.changes.len() <= 51 && s.earlier[&10].0.len() + empty.len() == BUCKETS as usize && s.earlier[&10].1.is_empty());
    same(&read_back(&files, 20), &t);
    // The file of 20 was not written: the buckets whose chains read it are
    // written whole.
    t.push(&keys[..1], &[0.1; 4], 0.1, 25).unwrap();
    let s = save(&mut t, &mut saves, 30, &ok, &mut files);
    let redo: std::collections::BTreeSet<u32> = files[&20].changes.iter().chain(&empty).copied().collect();
    assert_eq!(s.whole, redo.into_iter().collect::<Vec<_>>());
    same(&read_back(&files, 30), &t);
    ok.extend([20, 30]);
    // Nothing changed: every chain is read as it is.
    let s = save(&mut t, &mut saves, 40, &ok, &mut files);
    assert!(s.rows == 0 && s.changes.is_empty() && s.earlier[&30].0.len() > 40, "nothing changed, the chains are read");
    same(&read_back(&files, 40), &t);
    // A bucket stepped all over again and again: once its changes outweigh
    // it, it is written whole.
    let b0: Vec<u64> = keys.iter().copied().filter(|&k| bucket_of(k) == bucket_of(7)).collect();
    let mut rewritten = None;
    for v in [50, 60, 70] {
        t.push(&b0, &vec![0.1; b0.len() * 4], 0.1, v).unwrap();
        let s = save(&mut t, &mut saves, v, &ok, &mut files);
        ok.push(v);
        if s.whole.contains(&bucket_of(7)) {
            rewritten.get_or_insert(v);
        }
        same(&read_back(&files, v), &t);
    }
    assert_eq!(rewritten, Some(60), "whole at the second rewrite of every row");
    // A bucket that leaves forgets its chain; a save elsewhere writes all whole.
    let mut gone = mine.clone();
    gone[bucket_of(7) as usize] = false;
    let s = saves.save(Vec::new(), &t, 80, &gone, true, |u| ok.contains(&u));
    assert!(
        !s.whole.contains(&bucket_of(7))
            && !s.earlier.values().any(|(w, c)| w.contains(&bucket_of(7)) || c.contains(&bucket_of(7)))
    );
    let s = saves.save(Vec::new(), &t, 90, &mine, true, |u| ok.contains(&u));
    assert!(s.whole.contains(&bucket_of(7)), "back here: whole");
    let s = saves.save(Vec::new(), &t, 95, &mine, false, |_| true);
    assert_eq!((s.whole.len(), s.rows, s.earlier.len()), (BUCKETS as usize, t.len() as u64, 0));
}
