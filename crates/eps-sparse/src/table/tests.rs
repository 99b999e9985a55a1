use super::*;
use crate::bucket::bucket_of;

fn spec(opt: RowOptimizer) -> TableSpec {
    TableSpec { dim: 4, opt, init: Init::Uniform { scale: 0.1 }, seed: 11, max_rows: 1000 }
}

const SGD: RowOptimizer = RowOptimizer::Dense(eps_agg::Optimizer::Sgd { weight_decay: 0.0 });

#[test]
fn rows_are_created_on_first_touch_the_same_on_every_table() {
    let (mut a, mut b) = (RowTable::new(spec(SGD)).unwrap(), RowTable::new(spec(SGD)).unwrap());
    let mut out = vec![0f32; 12];
    a.pull(&[5, 1 << 60, 5], 0, &mut out).unwrap();
    assert_eq!(a.len(), 2, "a key asked twice is one row");
    assert_eq!(out[..4], out[8..]);
    let mut one = vec![0f32; 4];
    b.pull(&[1 << 60], 3, &mut one).unwrap();
    assert_eq!(one, out[4..8], "another server creates the same row");
    assert_eq!(a.row(5).unwrap(), &out[..4]);
    assert!(a.row(6).is_none());
}

#[test]
fn a_push_steps_each_row_once_and_memory_follows_the_rows() {
    let mut t = RowTable::new(spec(SGD)).unwrap();
    let mut before = vec![0f32; 8];
    t.pull(&[1, 2], 0, &mut before).unwrap();
    let g = [1.0, 2.0, 3.0, 4.0, -1.0, -1.0, -1.0, -1.0];
    t.push(&[2, 1], &g, 0.5, 1).unwrap();
    let want1: Vec<f32> = before[..4].iter().map(|p| p + 0.5).collect(); // (lr 0.5, gradient -1)
    let want2: Vec<f32> = before[4..].iter().zip(&g[..4]).map(|(p, g)| p - 0.5 * g).collect();
    assert_eq!(t.row(1).unwrap(), &want1[..]);
    assert_eq!(t.row(2).unwrap(), &want2[..]);
    // A pushed key not held starts from its initial row.
    t.push(&[9], &[0.0; 4], 0.5, 1).unwrap();
    let mut fresh = RowTable::new(spec(SGD)).unwrap();
    let mut nine = vec![0f32; 4];
    fresh.pull(&[9], 0, &mut nine).unwrap();
    assert_eq!(t.row(9).unwrap(), &nine[..]);
    // 10,000 rows of 4 values and 2 Adam states: the bytes they need, with
    // little more for the index and bookkeeping.
    let adam = RowOptimizer::Dense(eps_agg::Optimizer::Adam {
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
        decoupled: false,
    });
    let mut big = RowTable::new(TableSpec { dim: 64, max_rows: 1 << 20, ..spec(adam) }).unwrap();
    let keys: Vec<u64> = (0..10_000u64).map(|k| k * 7919).collect();
    big.push(&keys, &vec![0.5; keys.len() * 64], 0.01, 0).unwrap();
    assert_eq!(big.row_state_bytes(), 10_000 * 64 * 3 * 4);
    let ratio = big.heap_bytes() as f64 / big.row_state_bytes() as f64;
    assert!(ratio < 1.3, "{ratio}");
}

#[test]
fn bad_input_is_refused_and_changes_nothing() {
    assert_eq!(RowTable::new(TableSpec { dim: 0, ..spec(SGD) }).unwrap_err(), SparseError::Dim(0));
    let mut t = RowTable::new(TableSpec { max_rows: 3, ..spec(SGD) }).unwrap();
    let mut out = vec![0f32; 7];
    let e = t.pull(&[1, 2], 0, &mut out).unwrap_err();
    assert!(e.to_string().contains("7 values for 2 keys of dimension 4 (want 8)"), "{e}");
    assert!(t.is_empty());
    assert_eq!(t.push(&[1, 1], &[0.0; 8], 0.1, 0).unwrap_err(), SparseError::Duplicate(1));
    assert!(t.is_empty(), "nothing created by a refused push");
    t.push(&[1, 2], &[0.0; 8], 0.1, 0).unwrap();
    // Full (3 rows): key 4 gets no row; its pull is the initializer's values,
    // its gradient is dropped; the rows held are stepped.
    let held = t.row(1).unwrap().to_vec();
    t.push(&[3, 4, 1], &[1.0; 12], 0.1, 1).unwrap();
    assert_eq!((t.len(), t.refused()), (3, 1));
    assert!(t.row(4).is_none() && t.row(3).is_some());
    assert_ne!(t.row(1).unwrap(), &held[..], "a held row is stepped");
    let mut four = [0f32; 4];
    t.pull(&[4], 2, &mut four).unwrap();
    let mut fresh = [0f32; 4];
    t.spec.init.fill(t.spec.seed, 4, &mut fresh);
    assert_eq!((four, t.refused(), t.len()), (fresh, 2, 3), "a full table answers with the initial row");
}

#[test]
fn idle_and_rarely_touched_rows_are_evicted_and_come_back_fresh() {
    let mut t = RowTable::new(spec(SGD)).unwrap();
    let mut out = vec![0f32; 4];
    for now in 0..10 {
        t.pull(&[1], now, &mut out).unwrap(); // hot
    }
    t.pull(&[2], 0, &mut out).unwrap(); // idle since step 0
    t.pull(&[3], 8, &mut out).unwrap(); // touched once, young
    let initial = t.row(2).unwrap().to_vec();
    t.push(&[2], &[1.0; 4], 1.0, 0).unwrap();
    assert_eq!(t.evict(9, 5, 0), 1, "only the idle row");
    assert!(t.row(2).is_none() && t.row(1).is_some() && t.row(3).is_some());
    // Touched once in its first 5 steps: rare.
    assert_eq!(t.evict(13, 5, 2), 1);
    assert!(t.row(3).is_none() && t.row(1).is_some());
    assert_eq!(t.evicted(), 2);
    // An evicted key comes back as a new row (its slot reused).
    t.pull(&[2], 14, &mut out).unwrap();
    assert_eq!(out, initial);
    assert_eq!(t.len(), 2);
}

#[test]
fn duplicates_are_summed_in_the_order_given() {
    let (k, g) = sum_duplicates(&[7, 3, 7, 7], &[1.0, 10.0, 0.5, 0.25], 1).unwrap();
    assert_eq!((k, g), (vec![7, 3], vec![1.75, 10.0]));
    assert!(sum_duplicates(&[1], &[1.0, 2.0], 1).is_err());
}

#[test]
fn a_copy_of_rows_restores_them_bit_for_bit_and_changed_buckets_name_what_moved() {
    let adam = RowOptimizer::Dense(eps_agg::Optimizer::Adam {
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
        decoupled: false,
    });
    let mut t = RowTable::new(spec(adam)).unwrap();
    let keys: Vec<u64> = (0..200).map(|k| k * 7919).collect();
    let mut out = vec![0f32; keys.len() * 4];
    t.pull(&keys, 1, &mut out).unwrap();
    let g: Vec<f32> = (0..keys.len() * 4).map(|i| (i % 13) as f32 * 0.01 - 0.05).collect();
    t.push(&keys, &g, 0.1, 2).unwrap();
    t.push(&keys[..50], &g[..200], 0.1, 3).unwrap();
    // Every bucket touched is named, and only those.
    let mut touched: Vec<u32> = keys.iter().map(|&k| bucket_of(k)).collect();
    touched.sort_unstable();
    touched.dedup();
    assert_eq!(t.changed_buckets(), touched);
    let (held, dirty) = t.bucket_counts();
    assert_eq!((0..BUCKETS).filter(|&b| held[b as usize] > 0).collect::<Vec<_>>(), touched, "the buckets with rows");
    assert_eq!((held.iter().sum::<u64>(), dirty), (keys.len() as u64, held.clone()), "every row changed");

    // Half the buckets copied, then taken in by a fresh table: the same
    // values, state and bookkeeping (the copy of the copy is the same bytes).
    let half = |b: u32| b % 2 == 0;
    let mut bytes = Vec::new();
    let n = t.copy_rows(|b, _| half(b), &mut bytes);
    assert_eq!(n as usize, keys.iter().filter(|&&k| half(bucket_of(k))).count());
    assert_eq!(t.len(), keys.len(), "copying takes nothing out");
    let mut u = RowTable::new(spec(adam)).unwrap();
    assert_eq!(u.held_of(&bytes, n), 0, "none held before");
    u.put_rows(&bytes, n).unwrap();
    assert_eq!(u.held_of(&bytes, n), n, "every one held after");
    let rec = bytes.len() / n as usize;
    assert_eq!(u.held_of(&bytes[..rec * 3], 3), 3);
    let mut again = Vec::new();
    assert_eq!(u.copy_rows(|_, _| true, &mut again), n);
    assert_eq!(again, bytes);
    for &k in keys.iter().filter(|&&k| half(bucket_of(k))) {
        assert_eq!(u.row(k).unwrap(), t.row(k).unwrap(), "key {k}");
    }
    // Both step the same next: the Adam state and step counts came along.
    let k = *keys.iter().find(|&&k| half(bucket_of(k))).unwrap();
    t.push(&[k], &[0.3, -0.2, 0.1, 0.05], 0.1, 4).unwrap();
    u.push(&[k], &[0.3, -0.2, 0.1, 0.05], 0.1, 4).unwrap();
    assert_eq!(u.row(k).unwrap(), t.row(k).unwrap());

    // Rows made in another order copy to the same records, in another order.
    let mut r = RowTable::new(spec(adam)).unwrap();
    let rev: Vec<u64> = keys.iter().rev().copied().collect();
    r.pull(&rev, 1, &mut out).unwrap();
    let mut s = RowTable::new(spec(adam)).unwrap();
    s.pull(&keys, 1, &mut out).unwrap();
    assert_eq!(records(&r), records(&s));

    // After a checkpoint took them, only what changes again is named: a
    // push, an eviction, rows taken out.
    t.clear_changed();
    assert!(t.changed_buckets().is_empty());
    t.push(&[keys[3]], &[0.1; 4], 0.1, 5).unwrap();
    assert_eq!(t.changed_buckets(), vec![bucket_of(keys[3])]);
    t.clear_changed();
    let gone = t.evict(100, 10, 0);
    assert_eq!(gone, keys.len(), "all idle");
    assert_eq!(t.changed_buckets(), touched);
    assert!(t.bucket_counts().0.iter().all(|&h| h == 0), "no bucket holds a row");
    u.clear_changed();
    let mut outs = vec![Vec::new()];
    u.take_rows(|_| Some(0), &mut outs);
    assert_eq!(u.changed_buckets().len(), touched.iter().filter(|&&b| half(b)).count());
}

/// A checkpoint's changes: the rows changed since it took them, and the
/// keys deleted, put over a copy of what it took, give the table.
#[test]
fn changes_over_a_copy_give_the_table() {
    let mut t = RowTable::new(spec(RowOptimizer::Adagrad { eps: 1e-8, initial_accumulator: 0.1, weight_decay: 0.0 })).unwrap();
    t.keep_deletions();
    let keys: Vec<u64> = (0..300).map(|k| k * 104_729).collect();
    let mut out = vec![0f32; keys.len() * 4];
    t.pull(&keys, 1, &mut out).unwrap();
    t.push(&keys, &vec![0.25; keys.len() * 4], 0.1, 1).unwrap();
    let mut base = Vec::new();
    let n = t.copy_rows(|_, _| true, &mut base);
    t.clear_changed();
    let (_, dirty) = t.bucket_counts();
    assert!(dirty.iter().all(|&d| d == 0) && t.deleted().is_empty() && t.changed_buckets().is_empty());
    // Some rows step, some are new, and the idle ones are evicted.
    t.push(&keys[..40], &vec![-0.5; 40 * 4], 0.1, 30).unwrap();
    let fresh: Vec<u64> = (1..20).map(|k| k * 7 + 1).collect();
    t.pull(&fresh, 30, &mut vec![0f32; fresh.len() * 4]).unwrap();
    let gone = t.evict(31, 20, 0);
    assert_eq!((gone, t.deleted().len()), (keys.len() - 40, keys.len() - 40));
    let (_, dirty) = t.bucket_counts();
    assert_eq!(dirty.iter().sum::<u64>(), 40 + fresh.len() as u64, "the stepped rows and the new ones");
    let mut delta = Vec::new();
    let changed = t.copy_rows(|_, d| d, &mut delta);
    // The copy, then the deletions, then the changes.
    let mut u = RowTable::new(t.spec).unwrap();
    u.put_rows(&base, n).unwrap();
    u.remove_keys(t.deleted());
    u.put_rows_over(&delta, changed).unwrap();
    assert_eq!((u.len(), records(&u)), (t.len(), records(&t)));
    assert!(u.put_rows_over(&delta[1..], changed).is_err(), "a record cut short");
}

/// Every row's record ([`RowTable::copy_rows`]), by key.
pub(crate) fn records(t: &RowTable) -> Vec<Vec<u8>> {
    let mut bytes = Vec::new();
    t.copy_rows(|_, _| true, &mut bytes);
    let mut r: Vec<Vec<u8>> = bytes.chunks_exact(crate::moves::ROW_META + t.stride() * 4).map(<[u8]>::to_vec).collect();
    r.sort();
    r
}
