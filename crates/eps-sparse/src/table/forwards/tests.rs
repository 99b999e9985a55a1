use super::*;
use crate::table::TableSpec;
use crate::{Init, RowOptimizer};

fn table() -> RowTable {
    let adam = RowOptimizer::Dense(eps_agg::Optimizer::Adam {
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
        decoupled: false,
    });
    RowTable::new(TableSpec { dim: 4, opt: adam, init: Init::Uniform { scale: 0.1 }, seed: 3, max_rows: 10_000 }).unwrap()
}

/// Forwards `owner`'s changes at `version` into `backup`, checking the digest.
fn forward(owner: &mut RowTable, backup: &mut RowTable, version: u64, full: bool) -> ForwardStats {
    let mut blob = Vec::new();
    let stats = owner.write_forward(version, full, true, &mut blob);
    let f = parse_forward(&blob, owner.stride()).unwrap();
    assert_eq!((f.version, f.full, f.rows, f.deleted.len() as u64), (version, full, stats.rows, stats.deleted));
    if f.full {
        *backup = table();
    }
    backup.take_forward(&f).unwrap();
    assert_eq!(f.digest, Some(backup.digest()), "the backup holds the owner's rows after version {version}");
    stats
}

/// An owner keeping forwards with rows 0..90, and its backup holding them
/// (version 1).
fn owner_and_backup_of_90_rows() -> (RowTable, RowTable, Vec<u64>) {
    let (mut owner, mut backup) = (table(), table());
    owner.keep_forwards();
    let keys: Vec<u64> = (0..90).collect();
    let mut out = vec![0f32; 4 * keys.len()];
    owner.pull(&keys, 0, &mut out).unwrap();
    forward(&mut owner, &mut backup, 1, true);
    (owner, backup, keys)
}

#[test]
fn a_backup_fed_forwards_holds_the_owners_rows_through_pulls_steps_evictions_and_moves() {
    let (mut owner, mut backup) = (table(), table());
    owner.keep_forwards();
    let mut out = vec![0f32; 4 * 64];
    for step in 0..40u64 {
        let keys: Vec<u64> = (0..64).map(|i| (i * 7 + step * 13) % 300).collect();
        owner.pull(&keys, step, &mut out).unwrap();
        let distinct: Vec<u64> = {
            let mut k = keys.clone();
            k.sort_unstable();
            k.dedup();
            k
        };
        let grads: Vec<f32> = distinct.iter().flat_map(|&k| [k as f32 * 1e-3, -0.5, 0.25, step as f32]).collect();
        owner.push(&distinct, &grads, 0.01, step).unwrap();
        if step % 5 == 4 {
            owner.evict(step + 1, 3, 2);
        }
        if step == 20 {
            // Rows leave (a bucket move) and others come in.
            let mut outs = vec![Vec::new()];
            let n = owner.take_rows(|k| (k % 3 == 0).then_some(0), &mut outs)[0];
            let mut other = table();
            other.put_rows(&outs[0], n).unwrap();
            let mut back = vec![Vec::new()];
            let m = other.take_rows(|k| (k % 2 == 0).then_some(0), &mut back)[0];
            owner.put_rows(&back[0], m).unwrap();
        }
        let s = forward(&mut owner, &mut backup, step + 1, step == 0);
        // Only what changed travels.
        assert!(s.rows <= owner.len() as u64, "{s:?}");
    }
    assert!(owner.evicted() > 0, "evictions were forwarded");
    assert_eq!(owner.len(), backup.len());
    // Nothing changed: an empty forward.
    let s = forward(&mut owner, &mut backup, 41, false);
    assert_eq!((s.rows, s.deleted), (0, 0));
    // A new backup starts from a full forward.
    let mut fresh = table();
    let s = forward(&mut owner, &mut fresh, 41, true);
    assert_eq!(s.rows, owner.len() as u64);
}

#[test]
fn the_digest_tells_rows_apart_and_ignores_where_they_sit() {
    let (mut a, mut b) = (table(), table());
    let mut out = vec![0f32; 8];
    a.pull(&[1, 2], 0, &mut out).unwrap();
    b.pull(&[2, 1], 0, &mut out).unwrap();
    assert_eq!(a.digest(), b.digest(), "the same rows in other slots");
    b.push(&[1], &[0.0, 0.0, 0.0, 1e-30], 0.1, 0).unwrap();
    let d = b.digest();
    assert_ne!(a.digest(), d, "one value's bits differ");
    a.push(&[1], &[0.0, 0.0, 0.0, 1e-30], 0.1, 0).unwrap();
    assert_eq!(a.digest(), d);
    a.pull(&[1], 1, &mut out[..4]).unwrap();
    assert_ne!(a.digest(), d, "a touch counts");
}

#[test]
fn damaged_forwards_are_refused() {
    let mut t = table();
    t.keep_forwards();
    t.pull(&[1, 2, 3], 0, &mut [0f32; 12]).unwrap();
    let mut blob = Vec::new();
    t.write_forward(1, false, false, &mut blob);
    let stride = t.stride();
    assert!(parse_forward(&blob, stride).is_ok());
    assert!(parse_forward(&blob[..blob.len() - 1], stride).is_err(), "short");
    assert!(parse_forward(&blob[..10], stride).is_err(), "no header");
    assert!(parse_forward(&blob, stride + 1).is_err(), "another table's rows");
    let mut bad = blob.clone();
    bad[0] ^= 1;
    assert!(parse_forward(&bad, stride).unwrap_err().to_string().contains("not a forward"));
    let mut huge = blob.clone();
    huge[32..40].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(parse_forward(&huge, stride).is_err(), "a row count that overflows");
}

/// Rows a bucket move takes out stay on the backup (their digests still
/// count) until their target has them and they are released, tag by tag.
#[test]
fn rows_taken_out_held_stay_on_the_backup_until_released() {
    let (mut owner, mut backup, keys) = owner_and_backup_of_90_rows();
    // Stepped, then taken out before the next forward: the backup gets them
    // as they were taken out.
    owner.push(&keys, &vec![0.5; 4 * keys.len()], 0.1, 1).unwrap();
    let stepped = owner.row(1).unwrap().to_vec();
    let mut outs = vec![Vec::new(), Vec::new()];
    let n = owner.take_rows_held(|k| [None, Some(0), Some(1)][(k % 3) as usize], &mut outs, &[7, 8]);
    assert_eq!(n, vec![30, 30]);
    assert_eq!(owner.len(), 30);
    let s = forward(&mut owner, &mut backup, 2, false);
    assert_eq!((s.deleted, backup.len()), (0, 90), "the backup keeps the rows taken out");
    assert_eq!(backup.row(1).unwrap(), &stepped[..], "as they were taken out");
    owner.release_held(7);
    let s = forward(&mut owner, &mut backup, 3, false);
    assert_eq!((s.deleted, backup.len()), (30, 60), "target 7's rows go");
    assert!(backup.row(1).is_none() && backup.row(2).is_some());
    owner.release_held(8);
    forward(&mut owner, &mut backup, 4, false);
    assert_eq!(backup.len(), 30);
    assert_eq!(backup.digest(), owner.digest());
}

/// Rows taken out and released before the next forward: that forward
/// deletes them on the backup and does not carry them in again.
#[test]
fn rows_taken_out_and_released_before_the_next_forward_leave_the_backup() {
    let (mut owner, mut backup, _) = owner_and_backup_of_90_rows();
    let mut outs = vec![Vec::new(), Vec::new()];
    owner.take_rows_held(|k| [None, Some(0), Some(1)][(k % 3) as usize], &mut outs, &[7, 8]);
    owner.release_held(7);
    let s = forward(&mut owner, &mut backup, 2, false);
    assert_eq!((s.deleted, s.rows, backup.len()), (30, 30, 60), "target 8's held, target 7's gone");
    assert!(backup.row(1).is_none() && backup.row(2).is_some());
}
