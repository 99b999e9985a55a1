//! A table's key index: key to row slot, in one flat array probed linearly
//! from the key's mixed bits, at most half full. A lookup is one cache line
//! most of the time; a caller with a batch of keys asks for the lines of the
//! keys a few places ahead ([`KeyIndex::prefetch`]), so that their misses
//! overlap instead of coming one by one.
//! Removal shifts the entries after it back (no tombstones: lookups stay as
//! short as the load allows).

use crate::bucket::mix;

/// One place of the index: a key and its row's slot (`EMPTY`: free).
#[derive(Clone, Copy, Debug)]
#[repr(C, align(16))]
struct Entry {
    key: u64,
    slot: u32,
}

const EMPTY: u32 = u32::MAX;
const FREE: Entry = Entry { key: 0, slot: EMPTY };
/// How many keys ahead [`KeyIndex::number`] asks for lines.
const AHEAD: usize = 8;
/// Places before the first growth.
const MIN_PLACES: usize = 16;

/// A free place of the index, for one key (see [`KeyIndex::entry`]).
#[derive(Debug)]
pub struct Vacant(usize);

/// Key to slot, for keys of any value; slots are below `u32::MAX`.
#[derive(Clone, Debug)]
pub struct KeyIndex {
    places: Vec<Entry>,
    len: usize,
}

impl Default for KeyIndex {
    fn default() -> Self {
        Self::new()
    }
}

impl KeyIndex {
    /// An empty index.
    pub fn new() -> Self {
        Self { places: Vec::new(), len: 0 }
    }

    /// Keys held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no key.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes it holds on the heap.
    pub fn heap_bytes(&self) -> usize {
        self.places.capacity() * std::mem::size_of::<Entry>()
    }

    fn home(&self, key: u64) -> usize {
        // The low bits of the mix: a server's keys share the top bits (those
        // name the buckets it owns).
        mix(key) as usize & (self.places.len() - 1)
    }

    /// The place of `key`, or of the free place where it would go.
    fn find(&self, key: u64) -> (usize, bool) {
        let mask = self.places.len() - 1;
        let mut i = self.home(key);
        loop {
            let e = self.places[i];
            if e.slot == EMPTY {
                return (i, false);
            }
            if e.key == key {
                return (i, true);
            }
            i = (i + 1) & mask;
        }
    }

    /// The slot of `key`, if held.
    pub fn get(&self, key: u64) -> Option<u32> {
        if self.places.is_empty() {
            return None;
        }
        match self.find(key) {
            (i, true) => Some(self.places[i].slot),
            _ => None,
        }
    }

    /// Whether `key` is held.
    pub fn contains(&self, key: u64) -> bool {
        self.get(key).is_some()
    }

    /// The slot of `key` if held, else the place where [`KeyIndex::fill`]
    /// puts it. The place stays valid while nothing is inserted or removed;
    /// call [`KeyIndex::reserve`] first (a vacant place needs room).
    pub fn entry(&self, key: u64) -> Result<u32, Vacant> {
        debug_assert!(!self.places.is_empty() && (self.len + 1) * 2 <= self.places.len(), "reserve first");
        match self.find(key) {
            (i, true) => Ok(self.places[i].slot),
            (i, false) => Err(Vacant(i)),
        }
    }

    /// Puts `key` with `slot` where [`KeyIndex::entry`] said it goes.
    pub fn fill(&mut self, at: Vacant, key: u64, slot: u32) {
        debug_assert!(self.places[at.0].slot == EMPTY && slot != EMPTY);
        self.places[at.0] = Entry { key, slot };
        self.len += 1;
    }

    /// Numbers the distinct keys of `keys` in first-seen order, going on
    /// from the keys held (an index that holds only numbered keys): calls
    /// `f(i, n, new)` for each position `i`, `n` its key's number, `new`
    /// whether the key was first seen there. Each key's line is asked for a
    /// few keys ahead of its lookup.
    pub fn number(&mut self, keys: &[u64], mut f: impl FnMut(usize, u32, bool)) {
        self.reserve(keys.len());
        for (i, &k) in keys.iter().enumerate() {
            if let Some(&next) = keys.get(i + AHEAD) {
                self.prefetch(next);
            }
            match self.entry(k) {
                Ok(n) => f(i, n, false),
                Err(place) => {
                    let n = self.len as u32;
                    self.fill(place, k, n);
                    f(i, n, true)
                }
            }
        }
    }

    /// Asks for `key`'s home line ahead of its lookup.
    pub fn prefetch(&self, key: u64) {
        if self.places.is_empty() {
            return;
        }
        let e: *const Entry = &self.places[self.home(key)];
        eps_agg::prefetch(e);
    }

    /// Sets `key`'s slot; returns the one it replaced.
    pub fn insert(&mut self, key: u64, slot: u32) -> Option<u32> {
        // (Slots are below a table's `max_rows`, which is below this mark.)
        debug_assert!(slot != EMPTY, "slot {slot} is the index's free mark");
        // At most half full: probes stay short.
        if (self.len + 1) * 2 > self.places.len() {
            self.grow((self.len + 1) * 2);
        }
        match self.find(key) {
            (i, true) => Some(std::mem::replace(&mut self.places[i].slot, slot)),
            (i, false) => {
                self.places[i] = Entry { key, slot };
                self.len += 1;
                None
            }
        }
    }

    /// Forgets every key, keeping the room.
    pub fn clear(&mut self) {
        self.places.fill(FREE);
        self.len = 0;
    }

    /// Room for `n` more keys without growing.
    pub fn reserve(&mut self, n: usize) {
        let want = (self.len + n) * 2;
        if want > self.places.len() {
            self.grow(want);
        }
    }

    /// Removes `key`; returns its slot. The entries after it in its run move
    /// back to where a lookup finds them without it.
    pub fn remove(&mut self, key: u64) -> Option<u32> {
        if self.places.is_empty() {
            return None;
        }
        let (mut hole, found) = self.find(key);
        if !found {
            return None;
        }
        let slot = self.places[hole].slot;
        let mask = self.places.len() - 1;
        let mut i = hole;
        loop {
            i = (i + 1) & mask;
            let e = self.places[i];
            if e.slot == EMPTY {
                break;
            }
            // `e` may fill the hole if its home is not within (hole, i].
            let home = self.home(e.key);
            if (i.wrapping_sub(home) & mask) >= (i.wrapping_sub(hole) & mask) {
                self.places[hole] = e;
                hole = i;
            }
        }
        self.places[hole] = FREE;
        self.len -= 1;
        Some(slot)
    }

    /// Rebuilds with at least `want` places (a power of two).
    fn grow(&mut self, want: usize) {
        let n = want.next_power_of_two().max(MIN_PLACES);
        let old = std::mem::replace(&mut self.places, vec![FREE; n]);
        self.len = 0;
        for e in old.into_iter().filter(|e| e.slot != EMPTY) {
            let (i, _) = self.find(e.key);
            self.places[i] = e;
            self.len += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against a standard map, through inserts, replacements and removals
    /// that wrap around the end of the array and break runs in the middle.
    #[test]
    fn it_agrees_with_a_standard_map_through_inserts_and_removals() {
        let mut idx = KeyIndex::new();
        let mut reference = std::collections::HashMap::new();
        let mut state = 12345u64;
        let mut next = || {
            state = mix(state.wrapping_add(0x9e37_79b9_7f4a_7c15));
            state
        };
        for step in 0..200_000u32 {
            // A small key space: collisions, long runs, keys coming back.
            let key = (next() % 5000).wrapping_add(if step % 7 == 0 { u64::MAX - 3 } else { 0 });
            if next() % 3 == 0 {
                assert_eq!(idx.remove(key), reference.remove(&key), "remove {key}");
            } else {
                let slot = step % 1_000_000;
                assert_eq!(idx.insert(key, slot), reference.insert(key, slot), "insert {key}");
            }
            assert_eq!(idx.len(), reference.len());
        }
        let keys: Vec<u64> = (0..6000).chain((0..5000).map(|k: u64| k.wrapping_add(u64::MAX - 3))).collect();
        for &k in &keys {
            assert_eq!(idx.get(k), reference.get(&k).copied(), "get {k}");
        }
        assert!(idx.places.len() >= 2 * idx.len());
        let room = idx.places.len();
        idx.clear();
        assert_eq!((idx.len(), idx.get(keys[0]), idx.places.len()), (0, None, room));
        // Found, or placed where `entry` says.
        idx.reserve(10);
        for k in [1u64 << 40, (1 << 40) + 1] {
            let Err(at) = idx.entry(k) else { panic!("{k} is not held") };
            idx.fill(at, k, 77);
            assert_eq!((idx.entry(k).ok(), idx.get(k)), (Some(77), Some(77)));
        }
    }

    #[test]
    fn an_empty_index_finds_nothing() {
        let mut idx = KeyIndex::new();
        assert_eq!((idx.get(7), idx.remove(7), idx.len()), (None, None, 0));
        idx.prefetch(7);
    }
}
