//! Jobs with a sparse table (half of those without replicas, in every
//! consistency: tables have no backups yet). A row is stood in for by a
//! 64-bit digest per key, as a unit of a dense tensor is. Each iteration
//! every worker pulls the rows of a few keys drawn from the seed (routed by
//! the bucket map of the iteration), then pushes a gradient digest for
//! each, computed from the row it pulled. Under BSP a server steps a key
//! once per iteration with its contributors' gradients merged in rank
//! order; under SSP/ASP it adds each push as it comes. When servers are added or removed, the control
//! plane moves buckets (a vote, then `Buckets`, `RowsOut`, `FetchRows`,
//! `RowsTaken`, `FreeRows`), and the rows of the keys that have been
//! touched travel.
//!
//! Under BSP the world checks that every pull answer of version `v` equals
//! the one-process reference at `v` (the committed contributor sets, the
//! keys each worker drew); under SSP/ASP, that each contribution is applied
//! exactly once, as pushed. At the end every key's row must be in exactly
//! one place, equal to the reference (BSP) or to its initial value plus
//! every contribution (SSP/ASP).

use super::*;

/// Keys of the table: few enough that the workers' keys collide, spread
/// over the buckets by their hash as any keys are.
const KEYS: u64 = 48;

/// Version 0 of key `k`'s row.
pub(crate) fn row_init(k: u64) -> u64 {
    mix(0x5BA_45E ^ k)
}

/// Worker `r`'s gradient digest for key `k` in iteration `t`, from the row
/// it pulled (version `t`).
pub(crate) fn row_token(r: u32, t: u64, k: u64, row: u64) -> u64 {
    h2(h2(u64::from(r) | 0x100, t), h2(k, row))
}

/// The world's record of a job's table.
#[derive(Debug, Default)]
pub(crate) struct SparseWorld {
    /// Drawn keys differ between seeds.
    salt: u64,
    /// Rows a source took out for a target, until freed: (source, target).
    blobs: BTreeMap<(u32, u32), Vec<(u64, u64)>>,
    /// Rows READ by their target, not freed yet.
    read: BTreeSet<(u32, u32)>,
    /// Rows not READ when their source exited (a move whose cutover is
    /// the job's end): the job's last rows; nobody READs them.
    exited: BTreeMap<(u32, u32), Vec<(u64, u64)>>,
    /// Each row value pull answers gave, by (key, version).
    seen: BTreeMap<(u64, u64), u64>,
    /// Pushes a server took: (worker, iteration, key).
    accepted: BTreeSet<(u32, u64, u64)>,
    /// SSP/ASP: each contribution pushed, by (worker, iteration, key), and
    /// how many times a server applied it.
    pushed: BTreeMap<(u32, u64, u64), u64>,
    applied: BTreeMap<(u32, u64, u64), u32>,
    /// Bucket moves whose every row arrived.
    pub(crate) moves: u64,
}

impl SparseWorld {
    pub(crate) fn new(salt: u64) -> Self {
        Self { salt, ..Self::default() }
    }

    /// The keys worker `r` looks up in iteration `t`: one to four, distinct,
    /// sorted.
    pub(crate) fn keys(&self, r: u32, t: u64) -> Vec<u64> {
        let h = h2(h2(self.salt, u64::from(r)), t);
        let n = 1 + h % 4;
        let mut keys: Vec<u64> = (0..n).map(|j| mix(h2(h, j)) % KEYS).collect();
        keys.sort_unstable();
        keys.dedup();
        keys
    }
}

impl World {
    /// A server took worker `r`'s push of iteration `t` for `keys`.
    pub(crate) fn sparse_accept(&mut self, r: u32, t: u64, keys: &[u64]) {
        if let Some(s) = self.sparse.as_mut() {
            s.accepted.extend(keys.iter().map(|&k| (r, t, k)));
        }
    }

    /// SSP/ASP: worker `r` pushed `rows` (key and gradient digest) for
    /// iteration `t`.
    pub(crate) fn sparse_pushed(&mut self, r: u32, t: u64, rows: &[(u64, u64)]) {
        if let Some(s) = self.sparse.as_mut().filter(|_| self.mode != Consistency::Bsp) {
            s.pushed.extend(rows.iter().map(|&(k, d)| ((r, t, k), d)));
        }
    }

    /// SSP/ASP: a server applied worker `r`'s push of iteration `t`: each
    /// row once, as pushed.
    pub(crate) fn sparse_applied(&mut self, r: u32, t: u64, rows: &[(u64, u64)]) {
        let Some(s) = self.sparse.as_mut() else { return };
        let mut bad = None;
        for &(k, d) in rows {
            *s.applied.entry((r, t, k)).or_insert(0) += 1;
            if s.pushed.get(&(r, t, k)) != Some(&d) {
                bad = Some(format!("worker {r}'s row {k} of iteration {t} applied is not the one it pushed"));
            }
        }
        if let Some(b) = bad {
            self.fail(b);
        }
    }

    /// The end of an SSP/ASP run: every contribution applied once, and each
    /// key's row, in exactly one place, its initial value plus them all.
    pub(crate) fn check_sparse_end_async(&mut self) {
        let Some(s) = self.sparse.as_ref() else { return };
        let mut bad = None;
        for (key, n) in &s.applied {
            if *n != 1 {
                bad = Some(format!("worker {}'s row {} of iteration {} applied {n} times", key.0, key.2, key.1));
            }
        }
        if let Some(key) = s.pushed.keys().find(|k| !s.applied.contains_key(k)) {
            bad = Some(format!("worker {}'s row {} of iteration {} was never applied", key.0, key.2, key.1));
        }
        for k in 0..KEYS {
            let row = s.pushed.iter().filter(|((_, _, x), _)| *x == k).fold(row_init(k), |a, (_, &d)| a.wrapping_add(d));
            if let Some(b) = s.misplaced(&self.servers, k, row) {
                bad = Some(b);
            }
        }
        if let Some(b) = bad {
            self.fail(b);
        }
    }

    /// A pull answer of version `v` gave `rows`: the same value as every
    /// other answer of that version of each key.
    /// (BSP only: an SSP/ASP part's version counts the updates it applied,
    /// which differ between servers.)
    pub(crate) fn sparse_seen(&mut self, r: u32, v: u64, rows: &[(u64, u64)]) {
        let Some(s) = self.sparse.as_mut().filter(|_| self.mode == Consistency::Bsp) else { return };
        for &(k, x) in rows {
            if let Some(&y) = s.seen.get(&(k, v))
                && y != x
            {
                return self.fail(format!("worker {r} pulled version {v} of key {k} as {x:x}, another answer gave {y:x}"));
            }
            s.seen.insert((k, v), x);
        }
    }

    /// Server `from` took out `rows` for server `to`.
    pub(crate) fn rows_out(&mut self, from: u32, to: u32, rows: Vec<(u64, u64)>) {
        let Some(s) = self.sparse.as_mut() else { return };
        if s.blobs.insert((from, to), rows).is_some() {
            self.fail(format!("server {from} took rows out for server {to} twice"));
        }
    }

    /// What a READ of the rows server `from` took out for server `to`
    /// finds; they are the target's from now on.
    pub(crate) fn rows_read(&mut self, from: u32, to: u32) -> Option<Vec<(u64, u64)>> {
        let s = self.sparse.as_mut()?;
        let rows = s.blobs.get(&(from, to)).cloned()?;
        s.read.insert((from, to));
        Some(rows)
    }

    /// Server `from` freed the rows it took out for server `to`.
    pub(crate) fn free_rows(&mut self, from: u32, to: u32) {
        let Some(s) = self.sparse.as_mut() else { return };
        s.read.remove(&(from, to));
        if s.blobs.remove(&(from, to)).is_none() {
            self.fail(format!("server {from} told to free rows for server {to} it never took out"));
        }
    }

    /// Server `rank` exits: the rows it took out are gone with it.
    pub(crate) fn rows_exit(&mut self, rank: u32) {
        let Some(s) = self.sparse.as_mut() else { return };
        let mine: Vec<(u32, u32)> = s.blobs.keys().copied().filter(|&(a, _)| a == rank).collect();
        for key in mine {
            if let Some(rows) = s.blobs.remove(&key)
                && !s.read.remove(&key)
            {
                s.exited.insert(key, rows);
            }
        }
    }

    /// A server took in the last rows of a bucket move.
    pub(crate) fn sparse_moved(&mut self) {
        if let Some(s) = self.sparse.as_mut() {
            s.moves += 1;
        }
    }

    /// The end: every pull answer equals the reference, and every key's
    /// row is in exactly one place, equal to the reference at the last
    /// version: on a server, or taken out for a move whose cutover is the
    /// job's end (its target may retire before it READs them).
    pub(crate) fn check_sparse_end(&mut self, m: &Membership) {
        let Some(s) = self.sparse.as_ref() else { return };
        let mut bad = None;
        for k in 0..KEYS {
            let mut row = row_init(k);
            for t in 0..self.steps {
                let mut d = 0u64;
                let mut touched = false;
                for &r in m.contributors(t) {
                    let gone = self.lost.iter().any(|&(x, at)| x == r && t < at);
                    if !s.keys(r, t).contains(&k) || (gone && !s.accepted.contains(&(r, t, k))) {
                        continue;
                    }
                    d = h2(d, h2(u64::from(r), row_token(r, t, k, row)));
                    touched = true;
                }
                if touched {
                    row = h2(h2(row, t), d);
                }
                if let Some(&got) = s.seen.get(&(k, t + 1))
                    && got != row
                {
                    bad = Some(format!("a pull of version {} of key {k} gave {got:x}; the reference is {row:x}", t + 1));
                }
            }
            if let Some(b) = s.misplaced(&self.servers, k, row) {
                bad = Some(format!("{b} (the reference for the contributor sets {:?}, lost {:?})", m.epochs(), self.lost));
            }
        }
        if let Some(b) = bad {
            self.fail(b);
        }
    }
}

impl SparseWorld {
    /// Unless key `k`'s row is in exactly one place (on a server, or taken
    /// out for a move whose cutover is the job's end), equal to `row`: where
    /// it is.
    fn misplaced(&self, servers: &[Option<crate::server::SimServer>], k: u64, row: u64) -> Option<String> {
        let held = servers.iter().flatten().filter_map(|sv| Some((format!("server {}", sv.rank), *sv.table()?.rows().get(&k)?)));
        let unread = self.blobs.iter().filter(|(key, _)| !self.read.contains(key));
        let moving = unread.chain(&self.exited).filter_map(|(&(a, b), rows)| {
            rows.iter().find(|&&(x, _)| x == k).map(|&(_, v)| (format!("rows from server {a} to {b}"), v))
        });
        let places: Vec<(String, u64)> = held.chain(moving).collect();
        match &places[..] {
            [] if row == row_init(k) => None,
            [(_, got)] if *got == row => None,
            _ => Some(format!("row {k} ends as {places:x?}; it should be {row:x}")),
        }
    }
}
