//! The elastic shard map: which server owns which range of the flat space, under an
//! epoch that grows with every change, and the planning of scale events (adding a
//! server: split and move shards onto it until bytes are balanced; removing one:
//! move everything off it). Pure functions; the control plane drives them.

use std::collections::BTreeMap;

use crate::layout::{Layout, SHARD_ALIGN_BYTES};

/// One shard of the map.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapShard {
    /// Global shard id (stable: a split gives both parts new ids).
    pub id: u32,
    /// First element.
    pub start: u64,
    /// Elements.
    pub len: u64,
    /// Owning server rank.
    pub owner: u32,
}

/// A move of one shard between servers, planned by a scale event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Move {
    /// First element of the shard (in the map after the plan's splits).
    pub start: u64,
    /// Its elements.
    pub len: u64,
    /// Current owner.
    pub from: u32,
    /// New owner.
    pub to: u32,
}

/// A split planned by a scale event: shard `shard` is cut at element `mid` into
/// new shards `lo` (below) and `hi`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Split {
    /// The shard cut.
    pub shard: u32,
    /// First element of the upper part.
    pub mid: u64,
    /// Id of the lower part.
    pub lo: u32,
    /// Id of the upper part.
    pub hi: u32,
}

/// The shard map at one epoch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardMap {
    /// Grows with every change; data-plane requests name the epoch they were routed with.
    pub epoch: u64,
    /// Live servers, ascending.
    pub servers: Vec<u32>,
    /// Shards in order of `start`, covering the space exactly.
    pub shards: Vec<MapShard>,
    /// Bytes per element of the wire dtype.
    pub elem_bytes: u64,
    /// The id the next split part gets.
    pub next_id: u32,
}

/// Why a scale event cannot be planned.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    /// The server is already in the map.
    #[error("server {0} is already a member")]
    AlreadyMember(u32),
    /// The server is not in the map.
    #[error("server {0} is not a member")]
    NotMember(u32),
    /// Removing the last server would leave shards without an owner.
    #[error("cannot remove the last server")]
    LastServer,
    /// No live shard has that id.
    #[error("no shard has id {0}")]
    NoShard(u32),
    /// The shard is one alignment unit, or the split would not fall between
    /// alignment boundaries inside it.
    #[error("shard {0} cannot be split there")]
    Unsplittable(u32),
    /// Shard ids are spent (the data plane's immediates carry 13 bits).
    #[error("no shard ids left")]
    NoIds,
}

impl ShardMap {
    /// Epoch 0: the static placement of `layout`.
    pub fn from_layout(layout: &Layout) -> Self {
        Self {
            epoch: 0,
            servers: (0..layout.servers).collect(),
            shards: layout.shards.iter().map(|s| MapShard { id: s.id, start: s.start, len: s.len, owner: s.server }).collect(),
            elem_bytes: layout.dtype.size_bytes() as u64,
            next_id: layout.shards.len() as u32,
        }
    }

    /// Index (in `shards`) of the live shard with id `id`.
    pub fn index_of(&self, id: u32) -> Option<usize> {
        self.shards.iter().position(|s| s.id == id)
    }

    /// Where shard `i` splits: its aligned midpoint (an element), if it can.
    pub fn midpoint(&self, i: usize) -> Option<u64> {
        let s = self.shards.get(i)?;
        let a = self.align();
        let half = (s.len / 2).div_ceil(a) * a;
        (half > 0 && half < s.len).then_some(s.start + half)
    }

    /// Splits the live shard `id` at element `mid` into new shards `lo` and `hi`
    /// (same owner); `next_id` moves past both.
    pub fn split_at(&mut self, id: u32, mid: u64, lo: u32, hi: u32) -> Result<(), PlanError> {
        let i = self.index_of(id).ok_or(PlanError::NoShard(id))?;
        let s = self.shards[i];
        if mid <= s.start || mid >= s.start + s.len || mid % self.align() != 0 {
            return Err(PlanError::Unsplittable(id));
        }
        if lo.max(hi) >= crate::layout::MAX_SHARDS || lo == hi || self.index_of(lo).is_some() || self.index_of(hi).is_some() {
            return Err(PlanError::NoIds);
        }
        self.shards[i] = MapShard { id: lo, start: s.start, len: mid - s.start, owner: s.owner };
        self.shards.insert(i + 1, MapShard { id: hi, start: mid, len: s.start + s.len - mid, owner: s.owner });
        self.next_id = self.next_id.max(lo.max(hi) + 1);
        Ok(())
    }

    /// Elements per alignment unit (shard boundaries fall on multiples of it).
    pub fn align(&self) -> u64 {
        (SHARD_ALIGN_BYTES / self.elem_bytes).max(1)
    }

    /// Index of the shard holding `element`.
    pub fn shard_of(&self, element: u64) -> Option<usize> {
        let i = self.shards.partition_point(|s| s.start + s.len <= element);
        (i < self.shards.len() && self.shards[i].start <= element).then_some(i)
    }

    /// Bytes held per live server (servers without shards included, at 0).
    pub fn bytes_per_server(&self) -> BTreeMap<u32, u64> {
        let mut m: BTreeMap<u32, u64> = self.servers.iter().map(|&s| (s, 0)).collect();
        for s in &self.shards {
            *m.entry(s.owner).or_default() += s.len * self.elem_bytes;
        }
        m
    }

    /// Splits shard `i` at its aligned midpoint into two new ids (both parts keep
    /// the owner). Returns false when the shard is one alignment unit or less, or
    /// ids are spent.
    pub fn split(&mut self, i: usize) -> bool {
        let Some(mid) = self.midpoint(i) else { return false };
        let (id, lo) = (self.shards[i].id, self.next_id);
        self.split_at(id, mid, lo, lo + 1).is_ok()
    }

    /// Plans adding server `new`: splits applied to this map (the caller migrates the
    /// returned moves and then bumps the epoch with [`ShardMap::apply_moves`]).
    /// The new server ends with at least seven eighths of a fair share, or within
    /// one shard of it when shards are one alignment unit.
    pub fn plan_add(&mut self, new: u32) -> Result<Vec<Move>, PlanError> {
        Ok(self.plan_add_inner(new, true)?.1)
    }

    /// Like [`ShardMap::plan_add`], also returning the splits it made, in order
    /// (applying them in that order to the original map with
    /// [`ShardMap::split_at`] gives the planned map, ids included).
    pub fn plan_add_splits(&mut self, new: u32) -> Result<(Vec<Split>, Vec<Move>), PlanError> {
        self.plan_add_inner(new, true)
    }

    /// Like [`ShardMap::plan_add`], moving whole shards only (no splits): balanced
    /// to within one shard.
    pub fn plan_add_whole(&mut self, new: u32) -> Result<Vec<Move>, PlanError> {
        Ok(self.plan_add_inner(new, false)?.1)
    }

    fn plan_add_inner(&mut self, new: u32, split: bool) -> Result<(Vec<Split>, Vec<Move>), PlanError> {
        if self.servers.contains(&new) {
            return Err(PlanError::AlreadyMember(new));
        }
        let total: u64 = self.shards.iter().map(|s| s.len * self.elem_bytes).sum();
        let target = total / (self.servers.len() as u64 + 1);
        let mut load = self.bytes_per_server();
        let mut taken = 0u64;
        let mut moves = Vec::new();
        let mut splits = Vec::new();
        let mut moved: Vec<bool> = vec![false; self.shards.len()];
        // Bounded: every round either moves a shard or splits one, and splitting
        // stops at one alignment unit.
        for _ in 0..(4 * self.shards.len() + 64 * 64) {
            let deficit = target.saturating_sub(taken);
            if deficit == 0 {
                break;
            }
            // The most loaded server gives its largest shard that is not moving and
            // fits the deficit, else its smallest one above it (to split, or to
            // take if that overshoots less than leaving the deficit).
            let Some((&donor, _)) = load.iter().max_by_key(|(s, b)| (**b, u32::MAX - **s)) else { break };
            let mine = (0..self.shards.len()).filter(|&i| self.shards[i].owner == donor && !moved[i]);
            let fits = |i: &usize| self.shards[*i].len * self.elem_bytes <= deficit;
            let key = |i: &usize| (self.shards[*i].len, u64::MAX - self.shards[*i].start);
            let best = mine.clone().filter(fits).max_by_key(key);
            let Some(i) = best.or_else(|| mine.min_by_key(|i| (self.shards[*i].len, self.shards[*i].start))) else {
                break;
            };
            let bytes = self.shards[i].len * self.elem_bytes;
            // Split only while the deficit is more than an eighth of the fair
            // share: evening out the last few bytes is not worth the shards.
            let worth = deficit.saturating_mul(8) > target;
            let cut =
                Split { shard: self.shards[i].id, mid: self.midpoint(i).unwrap_or(0), lo: self.next_id, hi: self.next_id + 1 };
            if split && worth && bytes > deficit && bytes > self.align() * self.elem_bytes && self.split(i) {
                splits.push(cut);
                moved.insert(i + 1, false);
                continue;
            }
            if bytes > deficit.saturating_mul(2) {
                break; // taking it would overshoot more than leaving the deficit
            }
            let s = self.shards[i];
            moves.push(Move { start: s.start, len: s.len, from: donor, to: new });
            moved[i] = true;
            *load.get_mut(&donor).expect("donor is a member") -= bytes;
            taken += bytes;
        }
        Ok((splits, moves))
    }

    /// Plans removing server `gone`: each of its shards, largest first, goes to the
    /// least loaded remaining server.
    pub fn plan_remove(&self, gone: u32) -> Result<Vec<Move>, PlanError> {
        self.plan_remove_many(&[gone])
    }

    /// Plans removing several servers at once: their shards, largest first, go to
    /// the least loaded server that stays.
    pub fn plan_remove_many(&self, gone: &[u32]) -> Result<Vec<Move>, PlanError> {
        if let Some(&g) = gone.iter().find(|g| !self.servers.contains(g)) {
            return Err(PlanError::NotMember(g));
        }
        if self.servers.iter().all(|s| gone.contains(s)) {
            return Err(PlanError::LastServer);
        }
        let mut load = self.bytes_per_server();
        load.retain(|s, _| !gone.contains(s));
        let mut mine: Vec<MapShard> = self.shards.iter().copied().filter(|s| gone.contains(&s.owner)).collect();
        mine.sort_by_key(|s| (std::cmp::Reverse(s.len), s.start));
        let mut moves = Vec::with_capacity(mine.len());
        for s in mine {
            let (&to, _) = load.iter().min_by_key(|(r, b)| (**b, **r)).expect("another server remains");
            *load.get_mut(&to).expect("member") += s.len * self.elem_bytes;
            moves.push(Move { start: s.start, len: s.len, from: s.owner, to });
        }
        Ok(moves)
    }

    /// The map after `moves` completed and membership became `servers`: the next
    /// epoch.
    pub fn apply_moves(&self, moves: &[Move], servers: Vec<u32>) -> ShardMap {
        let mut next = self.clone();
        for m in moves {
            if let Some(i) = next.shard_of(m.start).filter(|&i| next.shards[i].start == m.start && next.shards[i].len == m.len) {
                next.shards[i].owner = m.to;
            }
        }
        next.servers = servers;
        next.servers.sort_unstable();
        next.epoch += 1;
        next
    }

    /// Checks the map's invariants: shards cover `[0, total)` in order, start on
    /// alignment boundaries, and belong to live servers.
    pub fn check(&self, total: u64) -> Result<(), String> {
        let mut next = 0;
        for (i, s) in self.shards.iter().enumerate() {
            if s.start != next {
                return Err(format!("shard {i} starts at {} instead of {next}", s.start));
            }
            if s.len == 0 {
                return Err(format!("shard {i} is empty"));
            }
            if s.start % self.align() != 0 {
                return Err(format!("shard {i} starts off alignment"));
            }
            if !self.servers.contains(&s.owner) {
                return Err(format!("shard {i} belongs to server {} which is not a member", s.owner));
            }
            if s.id >= self.next_id || self.shards[..i].iter().any(|x| x.id == s.id) {
                return Err(format!("shard {i} has id {}, used twice or not below next_id", s.id));
            }
            next += s.len;
        }
        if next != total {
            return Err(format!("shards cover {next} of {total} elements"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::TensorSpec;
    use eps_agg::DType;

    fn map(elements: u64, shard_bytes: u64, servers: u32) -> ShardMap {
        let l = Layout::new(&[TensorSpec { name: "x".into(), elements }], DType::F32, shard_bytes, servers).unwrap();
        ShardMap::from_layout(&l)
    }

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = crate::init::mix(self.0);
            self.0
        }
    }

    #[test]
    fn lookup_and_split() {
        let mut m = map(10_000, 8192, 2);
        assert_eq!(m.shard_of(0), Some(0));
        assert_eq!(m.shard_of(2048), Some(1));
        assert_eq!(m.shard_of(9_999), Some(m.shards.len() - 1));
        assert_eq!(m.shard_of(10_000), None);
        let n = m.shards.len();
        assert!(m.split(0));
        assert_eq!(m.shards.len(), n + 1);
        assert_eq!((m.shards[0].len, m.shards[1].start), (1024, 1024));
        assert_eq!((m.shards[0].id, m.shards[1].id, m.next_id), (n as u32, n as u32 + 1, n as u32 + 2));
        assert_eq!(m.index_of(n as u32 + 1), Some(1));
        assert!(!m.split(0), "one alignment unit cannot split");
        assert_eq!(m.split_at(0, 1024, 90, 91), Err(PlanError::NoShard(0)), "shard 0 is gone");
        assert_eq!(m.split_at(1, 2100, 90, 91), Err(PlanError::Unsplittable(1)), "off alignment");
        assert_eq!(m.split_at(1, 3072, 8191, 8192), Err(PlanError::NoIds));
        m.check(10_000).unwrap();
    }

    /// Random sequences of additions and removals keep the map whole and balanced.
    #[test]
    fn scale_events_keep_the_map_whole_and_balanced() {
        for seed in 0..100u64 {
            let mut r = Rng(seed + 1);
            let total = 50_000 + r.next() % 1_000_000;
            let shard_bytes = 4096 << (r.next() % 8);
            let mut m = map(total, shard_bytes, 1 + (r.next() % 4) as u32);
            let mut next_rank = m.servers.len() as u32;
            for _ in 0..12 {
                let epoch = m.epoch;
                if r.next() % 3 == 0 && m.servers.len() > 1 {
                    let gone = m.servers[(r.next() % m.servers.len() as u64) as usize];
                    let moves = m.plan_remove(gone).unwrap();
                    assert!(moves.iter().all(|mv| mv.from == gone && mv.to != gone));
                    let servers = m.servers.iter().copied().filter(|&s| s != gone).collect();
                    m = m.apply_moves(&moves, servers);
                    assert!(m.shards.iter().all(|s| s.owner != gone), "seed {seed}");
                } else {
                    let new = next_rank;
                    next_rank += 1;
                    let mut plan = m.clone();
                    let (splits, moves) = plan.plan_add_splits(new).unwrap();
                    // The splits, done one by one on the map, give the plan's map.
                    for sp in &splits {
                        m.split_at(sp.shard, sp.mid, sp.lo, sp.hi).unwrap();
                    }
                    assert_eq!(m, plan, "seed {seed}");
                    let mut servers = m.servers.clone();
                    servers.push(new);
                    m = m.apply_moves(&moves, servers);
                    let load = m.bytes_per_server();
                    let biggest = m.shards.iter().map(|s| s.len * 4).max().unwrap();
                    let fair = load.values().sum::<u64>() / load.len() as u64;
                    let got = load[&new];
                    assert!(got * 8 >= fair * 7 || got + biggest >= fair, "seed {seed}: new server got {got} of a fair {fair}");
                    assert!(got <= fair + biggest, "seed {seed}: new server got {got}, more than a fair {fair}");
                }
                assert_eq!(m.epoch, epoch + 1);
                m.check(total).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
            }
        }
    }

    /// Adding a server splits no more shards than the balance needs.
    #[test]
    fn an_added_server_splits_few_shards() {
        // 5 shards on 2 servers (3 + 2), one added: one whole shard and one half.
        let mut m = map(5 * 16384, 65536, 2);
        let (splits, moves) = m.plan_add_splits(2).unwrap();
        assert_eq!(splits.len(), 1, "{splits:?}");
        assert_eq!(moves.len(), 2, "{moves:?}");
        // One shard on one server: split once, move half.
        let mut m = map(16384, 65536, 1);
        let (splits, moves) = m.plan_add_splits(1).unwrap();
        assert_eq!((splits.len(), moves.len()), (1, 1));
        assert_eq!(moves[0].len, 8192);
        // Two equal shards: one moves whole.
        let mut m = map(2 * 16384, 65536, 1);
        let (splits, moves) = m.plan_add_splits(1).unwrap();
        assert_eq!((splits.len(), moves.len(), moves[0].start), (0, 1, 0));
    }

    #[test]
    fn planning_errors() {
        let mut m = map(10_000, 8192, 1);
        assert_eq!(m.plan_add(0), Err(PlanError::AlreadyMember(0)));
        assert_eq!(m.plan_remove(5), Err(PlanError::NotMember(5)));
        assert_eq!(m.plan_remove(0), Err(PlanError::LastServer));
    }
}
