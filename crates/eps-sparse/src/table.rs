//! A table's rows on one server: created on first touch, each row's values
//! and optimizer state side by side in one arena, a key index, and slots of
//! evicted rows reused. Memory follows the rows that exist, not the key space.

use crate::bucket::{BUCKETS, key_map};
use crate::index::{KeyIndex, Vacant};
use crate::pages::Spare;
use crate::{Init, RowOptimizer, SparseError};

/// The largest row dimension.
pub const MAX_DIM: usize = 1 << 16;

/// What a table is.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TableSpec {
    /// Values per row.
    pub dim: usize,
    /// The optimizer that steps pushed rows.
    pub opt: RowOptimizer,
    /// How new rows start.
    pub init: Init,
    /// The initializer's seed (the table's, the same on every server).
    pub seed: u64,
    /// Rows one server may hold (a full table creates no more: see
    /// [`RowTable::refused`]).
    pub max_rows: usize,
}

/// A row's bookkeeping.
#[derive(Clone, Copy, Debug)]
struct Meta {
    key: u64,
    /// Times the optimizer stepped it (lazy Adam's count).
    steps: u64,
    /// Times a pull or push touched it.
    touches: u32,
    /// The step it was created at, and last touched at.
    created: u64,
    last: u64,
}

/// The most rows a table holds (slots are u32, one value marks a free place
/// of the index).
const MAX_SLOTS: usize = u32::MAX as usize - 1;

/// How many keys ahead lookups ask for the lines they will need.
const AHEAD: usize = 8;

/// Bytes of one page of rows (at least one row a page).
const PAGE_BYTES: usize = 1 << 20;

/// The rows of one table held here.
#[derive(Debug)]
pub struct RowTable {
    spec: TableSpec,
    /// Values then state, per row.
    stride: usize,
    /// Rows in pages of `page_rows`: growing never copies what is held, and
    /// the slack is one page at most.
    pages: Vec<Box<[f32]>>,
    page_rows: usize,
    meta: Vec<Meta>,
    index: KeyIndex,
    /// Slots of evicted rows.
    free: Vec<u32>,
    /// The next pages, made ready off the critical path.
    spare: Spare,
    evicted: u64,
    /// Rows not created because the table was full.
    refused: u64,
    /// A bit per bucket: a row of it was created, touched, stepped,
    /// evicted, taken in or taken out since [`RowTable::clear_changed`].
    changed: Vec<u64>,
    /// A bit per slot: its row was created, touched, stepped or taken in
    /// since then.
    dirty: Vec<u64>,
    /// Keys evicted or taken out since then, when kept (see
    /// [`RowTable::keep_deletions`]).
    deleted: Option<Vec<u64>>,
    /// A bit per slot: it holds a row (scans read it, not the index).
    live: Vec<u64>,
    /// What changed since the last forward to a backup, when kept (see
    /// [`RowTable::keep_forwards`]).
    forwards: Option<forwards::Forwards>,
}

impl RowTable {
    /// An empty table.
    pub fn new(spec: TableSpec) -> Result<Self, SparseError> {
        if spec.dim == 0 || spec.dim > MAX_DIM {
            return Err(SparseError::Dim(spec.dim));
        }
        let stride = spec.dim * (1 + spec.opt.state_per_value());
        let page_rows = (PAGE_BYTES / (stride * 4)).max(1);
        Ok(Self {
            spec,
            stride,
            pages: Vec::new(),
            page_rows,
            meta: Vec::new(),
            index: KeyIndex::new(),
            free: Vec::new(),
            spare: Spare::default(),
            evicted: 0,
            refused: 0,
            changed: vec![0; BUCKETS.div_ceil(64) as usize],
            dirty: Vec::new(),
            deleted: None,
            live: Vec::new(),
            forwards: None,
        })
    }

    /// Rows held.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether it holds no row.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Rows evicted so far.
    pub fn evicted(&self) -> u64 {
        self.evicted
    }

    /// Rows not created because the table was full: their pulls got the
    /// initializer's values, their pushes were dropped.
    pub fn refused(&self) -> u64 {
        self.refused
    }

    /// The bytes of the rows held and their optimizer state.
    pub fn row_state_bytes(&self) -> usize {
        self.len() * self.stride * 4
    }

    /// What the table holds on the heap, slack included (arena, bookkeeping,
    /// index).
    pub fn heap_bytes(&self) -> usize {
        let index = self.index.heap_bytes();
        let pages = self.pages.len() * self.page_rows * self.stride * 4;
        pages + self.meta.capacity() * std::mem::size_of::<Meta>() + index + self.free.capacity() * 4
    }

    /// The row of `key`, if held.
    pub fn row(&self, key: u64) -> Option<&[f32]> {
        let s = self.index.get(key)? as usize;
        Some(&self.row_state(s)[..self.spec.dim])
    }

    fn row_state(&self, s: usize) -> &[f32] {
        let o = (s % self.page_rows) * self.stride;
        &self.pages[s / self.page_rows][o..o + self.stride]
    }

    /// Slot `s`'s values and state.
    fn row_state_mut(&mut self, s: usize) -> (&mut [f32], &mut [f32]) {
        let o = (s % self.page_rows) * self.stride;
        self.pages[s / self.page_rows][o..o + self.stride].split_at_mut(self.spec.dim)
    }

    /// A new row for `key` (not held) in `at` of the index, initialized;
    /// `None` if the table is full.
    fn create_at(&mut self, at: Vacant, key: u64, now: u64) -> Option<usize> {
        if self.len() >= self.spec.max_rows.min(MAX_SLOTS) {
            self.refused += 1;
            return None;
        }
        let s = self.new_slot(Meta { key, steps: 0, touches: 1, created: now, last: now });
        self.mark_row(s);
        let (spec, seed) = (self.spec, self.spec.seed);
        let (values, state) = self.row_state_mut(s);
        spec.init.fill(seed, key, values);
        spec.opt.init_state(state);
        self.index.fill(at, key, s as u32);
        Some(s)
    }

    /// A slot for a row with `meta` (a free one, or a new one): its values
    /// and state are the caller's to set.
    fn new_slot(&mut self, meta: Meta) -> usize {
        let s = match self.free.pop() {
            Some(s) => {
                self.meta[s as usize] = meta;
                s as usize
            }
            None => {
                self.meta.push(meta);
                if self.meta.len() > self.pages.len() * self.page_rows {
                    let page = self.spare.take(self.page_rows * self.stride);
                    self.pages.push(page);
                }
                self.meta.len() - 1
            }
        };
        self.set_live(s);
        s
    }

    /// Copies the rows of `keys` into `out` (`keys.len() * dim` values, in
    /// the order asked), creating the rows not held; `now` is the job's step.
    /// A key whose row a full table cannot create gets the initializer's
    /// values, and no row (see [`RowTable::refused`]).
    pub fn pull(&mut self, keys: &[u64], now: u64, out: &mut [f32]) -> Result<(), SparseError> {
        let dim = self.spec.dim;
        check("pull buffer", out.len(), keys.len(), dim)?;
        let mut rows = out.chunks_exact_mut(dim);
        self.each_slot(keys, now, dim, |t, k, s| {
            let Some(o) = rows.next() else { return };
            match s {
                Some(s) => o.copy_from_slice(&t.row_state(s)[..dim]),
                None => t.spec.init.fill(t.spec.seed, k, o),
            }
        });
        Ok(())
    }

    /// Finds (or creates) the row of each of `keys` in turn, touched at
    /// `now`, and hands `f` the key and its slot (`None` where a full table
    /// cannot create it), in order. Lookups are independent loads: each
    /// key's index line is asked for a few keys ahead of its lookup, and a
    /// row found has its bookkeeping and first `values` values asked for a
    /// few keys ahead of `f`, so that the cache misses overlap. (A key twice
    /// in `keys` is created once: the second finds it.)
    fn each_slot(&mut self, keys: &[u64], now: u64, values: usize, mut f: impl FnMut(&mut Self, u64, Option<usize>)) {
        self.index.reserve(keys.len());
        let mut slots: Vec<(Option<usize>, bool)> = Vec::with_capacity(keys.len());
        for (i, &k) in keys.iter().enumerate() {
            if let Some(&next) = keys.get(i + AHEAD) {
                self.index.prefetch(next);
            }
            let s = match self.index.entry(k) {
                Ok(s) => {
                    self.prefetch_row(s as usize, values);
                    (Some(s as usize), true)
                }
                Err(at) => (self.create_at(at, k, now), false),
            };
            slots.push(s);
            if let Some(j) = i.checked_sub(AHEAD) {
                self.visit(keys[j], slots[j], now, &mut f);
            }
        }
        for j in keys.len().saturating_sub(AHEAD)..keys.len() {
            self.visit(keys[j], slots[j], now, &mut f);
        }
    }

    /// Touches a row found (created ones were touched by their creation), then `f`.
    fn visit(&mut self, k: u64, (s, found): (Option<usize>, bool), now: u64, f: &mut impl FnMut(&mut Self, u64, Option<usize>)) {
        if let (Some(s), true) = (s, found) {
            let m = &mut self.meta[s];
            m.touches = m.touches.saturating_add(1);
            m.last = now;
            self.mark_row(s);
        }
        f(self, k, s)
    }

    /// Asks for slot `s`'s bookkeeping and the lines of its first `values`
    /// values and state.
    fn prefetch_row(&self, s: usize, values: usize) {
        eps_agg::prefetch(&self.meta[s]);
        let o = (s % self.page_rows) * self.stride;
        let page = &self.pages[s / self.page_rows];
        for at in (o..o + values.min(self.stride)).step_by(16) {
            eps_agg::prefetch(&page[at]);
        }
    }

    /// Steps the rows of `keys` (each once: see [`sum_duplicates`]) with
    /// their gradient rows `grads`, at learning rate `lr`; rows not held are
    /// created first (a full table drops the gradients of keys it cannot
    /// create a row for: see [`RowTable::refused`]). Nothing changes if the
    /// input is refused.
    pub fn push(&mut self, keys: &[u64], grads: &[f32], lr: f32, now: u64) -> Result<(), SparseError> {
        check("push gradients", grads.len(), keys.len(), self.spec.dim)?;
        let mut seen = key_map::<()>(keys.len());
        if let Some(k) = keys.iter().find(|k| seen.insert(**k, ()).is_some()) {
            return Err(SparseError::Duplicate(*k));
        }
        self.push_distinct(keys, grads, lr, now);
        Ok(())
    }

    /// [`RowTable::push`] of keys known to be distinct and rows of the
    /// right length (what [`crate::part::merge`] gives).
    pub(crate) fn push_distinct(&mut self, keys: &[u64], grads: &[f32], lr: f32, now: u64) {
        let (dim, opt) = (self.spec.dim, self.spec.opt);
        debug_assert_eq!(grads.len(), keys.len() * dim);
        let mut rows = grads.chunks_exact(dim);
        // (Values and state: the whole row.)
        self.each_slot(keys, now, usize::MAX, |t, _, s| {
            let (Some(g), Some(s)) = (rows.next(), s) else { return };
            let step = t.meta[s].steps;
            t.meta[s].steps += 1;
            let (values, state) = t.row_state_mut(s);
            opt.step(lr, step, values, g, state);
        });
    }

    /// Takes out the rows whose key `dest` sends somewhere: row `r` goes to
    /// `outs[dest(key)]` as a record of [`crate::moves`] (its values, state
    /// and bookkeeping), in slot order, and is no longer held here. Returns
    /// how many went to each.
    pub fn take_rows(&mut self, dest: impl Fn(u64) -> Option<usize>, outs: &mut [Vec<u8>]) -> Vec<u64> {
        let mut counts = vec![0u64; outs.len()];
        for s in 0..self.meta.len() {
            let m = self.meta[s];
            if !self.is_live(s) {
                continue;
            }
            let Some(i) = dest(m.key).filter(|&i| i < outs.len()) else { continue };
            self.write_record(s, &mut outs[i]);
            counts[i] += 1;
            self.index.remove(m.key);
            self.release(s);
            self.mark_gone(m.key);
        }
        counts
    }

    /// As [`RowTable::take_rows`], but a backup fed forwards keeps the rows
    /// taken out (they are not listed deleted, their digests still count)
    /// until [`RowTable::release_held`] with the tag of their destination,
    /// `tags[dest(key)]` (a bucket move's source: if it is lost before the
    /// target's backup has them, its backup gives them in its place).
    pub fn take_rows_held(&mut self, dest: impl Fn(u64) -> Option<usize>, outs: &mut [Vec<u8>], tags: &[u32]) -> Vec<u64> {
        let Some(mut f) = self.forwards.take() else { return self.take_rows(dest, outs) };
        let mut counts = vec![0u64; outs.len()];
        for s in 0..self.meta.len() {
            let m = self.meta[s];
            if !self.is_live(s) {
                continue;
            }
            let Some(i) = dest(m.key).filter(|&i| i < outs.len() && i < tags.len()) else { continue };
            self.write_record(s, &mut outs[i]);
            counts[i] += 1;
            // (The next forward carries it as it is now.)
            self.write_record(s, f.taken_records());
            f.held(tags[i], m.key, self.row_digest(s));
            self.index.remove(m.key);
            self.release(s);
            self.mark_taken(m.key);
        }
        self.forwards = Some(f);
        counts
    }

    /// Takes in `rows` records of [`RowTable::take_rows`] from `bytes`: each
    /// row as it was where it came from. A key already held is refused (and
    /// nothing is taken in); a full table takes them in anyway (rows are
    /// never dropped on a move).
    pub fn put_rows(&mut self, bytes: &[u8], rows: u64) -> Result<(), SparseError> {
        let rec = crate::moves::ROW_META + self.stride * 4;
        if bytes.len() as u64 != rows.saturating_mul(rec as u64) {
            return Err(SparseError::Rows(format!("{} bytes for {rows} rows of {rec} bytes", bytes.len())));
        }
        let u64_at = |r: &[u8], i: usize| u64::from_le_bytes(r[i * 8..i * 8 + 8].try_into().unwrap_or_default());
        let mut seen = key_map::<()>(rows as usize);
        let clash = |k: &u64| self.index.contains(*k) || seen.insert(*k, ()).is_some();
        if let Some(k) = bytes.chunks_exact(rec).map(|r| u64_at(r, 0)).find(clash) {
            return Err(SparseError::Rows(format!("key {k} arrived twice, or is already held here")));
        }
        for r in bytes.chunks_exact(rec) {
            let touches = u32::from_le_bytes(r[32..36].try_into().unwrap_or_default());
            let meta = Meta { key: u64_at(r, 0), steps: u64_at(r, 1), touches, created: u64_at(r, 2), last: u64_at(r, 3) };
            let s = self.new_slot(meta);
            let o = (s % self.page_rows) * self.stride;
            let dst = &mut self.pages[s / self.page_rows][o..o + self.stride];
            for (d, v) in dst.iter_mut().zip(r[crate::moves::ROW_META..].chunks_exact(4)) {
                *d = f32::from_le_bytes(v.try_into().unwrap_or_default());
            }
            self.index.insert(meta.key, s as u32);
            self.mark_row(s);
        }
        Ok(())
    }

    /// How many of the keys of `rows` records of [`RowTable::take_rows`] in
    /// `bytes` are held here (records cut short count no further).
    pub fn held_of(&self, bytes: &[u8], rows: u64) -> u64 {
        let rec = crate::moves::ROW_META + self.stride * 4;
        let key = |r: &[u8]| u64::from_le_bytes(r[..8].try_into().unwrap_or_default());
        bytes.chunks_exact(rec).take(rows as usize).filter(|r| self.index.contains(key(r))).count() as u64
    }

    /// Values and state per row.
    pub fn stride(&self) -> usize {
        self.stride
    }

    /// Evicts rows idle for more than `idle_steps` at step `now`, and rows
    /// touched fewer than `min_touches` times in their first `idle_steps`
    /// (a key seen once or twice does not keep a row). Returns how many.
    pub fn evict(&mut self, now: u64, idle_steps: u64, min_touches: u32) -> usize {
        let before = self.len();
        for s in 0..self.meta.len() {
            let m = self.meta[s];
            if !self.is_live(s) {
                continue;
            }
            let idle = now.saturating_sub(m.last) > idle_steps;
            let rare = m.touches < min_touches && now.saturating_sub(m.created) >= idle_steps;
            if idle || rare {
                self.index.remove(m.key);
                self.release(s);
                self.mark_gone(m.key);
            }
        }
        let n = before - self.len();
        self.evicted += n as u64;
        n
    }
}

fn check(what: &'static str, got: usize, keys: usize, dim: usize) -> Result<(), SparseError> {
    let want = keys * dim;
    if got == want { Ok(()) } else { Err(SparseError::Length { what, got, keys, dim, want }) }
}

/// `keys` with each duplicate's gradient rows summed into its first place, in
/// the order given (so the same inputs give the same bits, as BSP needs).
pub fn sum_duplicates(keys: &[u64], grads: &[f32], dim: usize) -> Result<(Vec<u64>, Vec<f32>), SparseError> {
    check("gradients", grads.len(), keys.len(), dim)?;
    crate::part::merge(&[(keys, grads)], dim)
}

mod changes;
mod forwards;
pub use forwards::{Forward, ForwardStats, parse_forward};
#[cfg(test)]
pub(crate) mod tests;
