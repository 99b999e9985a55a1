//! The elastic shard map: which server owns which range of the flat space, under an
//! epoch that grows with every change, and the planning of scale events (adding a
//! server: split and move shards onto it until bytes are balanced; removing one:
//! move everything off it). Pure functions; the control plane drives them.

use std::collections::BTreeMap;

use crate::layout::{Layout, SHARD_ALIGN_BYTES};

/// One shard of the map.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapShard {
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
}

impl ShardMap {
    /// Epoch 0: the static placement of `layout`.
    pub fn from_layout(layout: &Layout) -> Self {
        Self {
            epoch: 0,
            servers: (0..layout.servers).collect(),
            shards: layout.shards.iter().map(|s| MapShard { start: s.start, len: s.len, owner: s.server }).collect(),
            elem_bytes: layout.dtype.size_bytes() as u64,
        }
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

    /// Splits shard `i` at its aligned midpoint (both halves keep the owner).
    /// Returns false when the shard is one alignment unit or less.
    pub fn split(&mut self, i: usize) -> bool {
        let s = self.shards[i];
        let a = self.align();
        let half = (s.len / 2).div_ceil(a) * a;
        if half == 0 || half >= s.len {
            return false;
        }
        self.shards[i].len = half;
        self.shards.insert(i + 1, MapShard { start: s.start + half, len: s.len - half, owner: s.owner });
        true
    }

    /// Plans adding server `new`: splits applied to this map (the caller migrates the
    /// returned moves and then bumps the epoch with [`ShardMap::apply_moves`]).
    /// Bytes end balanced to within one shard of the largest remaining size.
    pub fn plan_add(&mut self, new: u32) -> Result<Vec<Move>, PlanError> {
        self.plan_add_inner(new, true)
    }

    /// Like [`ShardMap::plan_add`], moving whole shards only (no splits): balanced
    /// to within one shard.
    pub fn plan_add_whole(&mut self, new: u32) -> Result<Vec<Move>, PlanError> {
        self.plan_add_inner(new, false)
    }

    fn plan_add_inner(&mut self, new: u32, split: bool) -> Result<Vec<Move>, PlanError> {
        if self.servers.contains(&new) {
            return Err(PlanError::AlreadyMember(new));
        }
        let total: u64 = self.shards.iter().map(|s| s.len * self.elem_bytes).sum();
        let target = total / (self.servers.len() as u64 + 1);
        let mut load = self.bytes_per_server();
        let mut taken = 0u64;
        let mut moves = Vec::new();
        let mut moved: Vec<bool> = vec![false; self.shards.len()];
        // Bounded: every round either moves a shard or splits one, and splitting
        // stops at one alignment unit.
        for _ in 0..(4 * self.shards.len() + 64 * 64) {
            let deficit = target.saturating_sub(taken);
            if deficit == 0 {
                break;
            }
            // The most loaded server gives its largest shard that is not moving.
            let Some((&donor, _)) = load.iter().max_by_key(|(s, b)| (**b, u32::MAX - **s)) else { break };
            let Some(i) = (0..self.shards.len())
                .filter(|&i| self.shards[i].owner == donor && !moved[i])
                .max_by_key(|&i| (self.shards[i].len, u64::MAX - self.shards[i].start))
            else {
                break;
            };
            let bytes = self.shards[i].len * self.elem_bytes;
            if split && bytes > deficit && bytes > self.align() * self.elem_bytes && self.split(i) {
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
        Ok(moves)
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
        assert!(!m.split(0), "one alignment unit cannot split");
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
                    let moves = m.plan_add(new).unwrap();
                    let mut servers = m.servers.clone();
                    servers.push(new);
                    m = m.apply_moves(&moves, servers);
                    let load = m.bytes_per_server();
                    let biggest = m.shards.iter().map(|s| s.len * 4).max().unwrap();
                    let fair = load.values().sum::<u64>() / load.len() as u64;
                    assert!(load[&new] + biggest >= fair, "seed {seed}: new server got {} of a fair {fair}", load[&new]);
                }
                assert_eq!(m.epoch, epoch + 1);
                m.check(total).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
            }
        }
    }

    #[test]
    fn planning_errors() {
        let mut m = map(10_000, 8192, 1);
        assert_eq!(m.plan_add(0), Err(PlanError::AlreadyMember(0)));
        assert_eq!(m.plan_remove(5), Err(PlanError::NotMember(5)));
        assert_eq!(m.plan_remove(0), Err(PlanError::LastServer));
    }
}
