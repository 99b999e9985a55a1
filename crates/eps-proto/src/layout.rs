//! The flat parameter space, its shards and their placement on servers.
//!
//! Tensors are laid end to end; the space is cut into shards of a target size, each
//! starting on a 4 KiB boundary of the wire dtype; shard `i` lives on server
//! `i % servers` at first (the shard map of the control plane moves them later).
//! Every process derives the same layout from the spec, so only the spec travels.

use eps_agg::DType;

use crate::spec::TensorSpec;

/// Byte alignment of shard boundaries in the wire dtype.
pub const SHARD_ALIGN_BYTES: u64 = 4096;
/// Ids of the immediate's 13-bit shard field kept for sparse tables, two per
/// table (see [`sparse_id`] and [`stand_in_id`]).
pub const SPARSE_IDS: u32 = 64;
/// Most sparse tables a job may have: half of [`SPARSE_IDS`].
pub const TABLE_IDS: u32 = SPARSE_IDS / 2;
/// Most shards a job can have (the immediate's shard field is 13 bits, its
/// last [`SPARSE_IDS`] values name sparse tables).
pub const MAX_SHARDS: u32 = (1 << 13) - SPARSE_IDS;

/// The immediate's shard id of sparse table `table` (its index in the spec).
pub fn sparse_id(table: u16) -> u32 {
    debug_assert!(u32::from(table) < TABLE_IDS);
    MAX_SHARDS + u32::from(table)
}

/// The immediate's shard id of sparse table `table` as a stand-in serves it:
/// a lost server's buckets, served by the server that kept its rows (the
/// worker counts its answers as the lost server's).
pub fn stand_in_id(table: u16) -> u32 {
    sparse_id(table) + TABLE_IDS
}

/// The sparse table an immediate's shard id names, if it names one
/// ([`sparse_id`] or [`stand_in_id`]).
pub fn sparse_table(id: u32) -> Option<u16> {
    (MAX_SHARDS..MAX_SHARDS + SPARSE_IDS).contains(&id).then(|| ((id - MAX_SHARDS) % TABLE_IDS) as u16)
}

/// Whether a sparse table's shard id is a stand-in's ([`stand_in_id`]).
pub fn is_stand_in(id: u32) -> bool {
    id >= MAX_SHARDS + TABLE_IDS
}

/// Most shards a job whose layout has `initial` shards holds at once: splits
/// (when servers are added) stop there. Servers and workers size their queues
/// for it.
pub fn live_shard_cap(initial: usize) -> usize {
    (2 * initial + 16).min(MAX_SHARDS as usize)
}

/// Most elements a job's dense parameters may have in all (2^40: 4 TiB of
/// f32, more than [`MAX_SHARDS`] shards of the largest shard size hold). Every
/// byte size and offset derived from a layout then fits a `u64` with room.
pub const MAX_ELEMENTS: u64 = 1 << 40;

/// The tensors' elements added up, checked: `None` when a tensor or the sum
/// passes [`MAX_ELEMENTS`] (the sum of counts from outside must not wrap).
pub fn total_elements<'a>(elements: impl IntoIterator<Item = &'a u64>) -> Option<u64> {
    elements.into_iter().try_fold(0u64, |sum, &n| sum.checked_add(n).filter(|&t| t <= MAX_ELEMENTS))
}

/// Stamp of a published buffer that is being rewritten (or holds no version yet).
pub const STAMP_WRITING: u64 = u64::MAX;

/// Bytes at the start of a shard's published region before its two buffers: the
/// version stamps of buffer 0 and buffer 1 (two u64), padded to a cache line.
pub const PUBLISHED_HEADER: u64 = 64;

/// Byte offset of published buffer `parity` of a shard of `bytes` bytes within the
/// shard's published region.
pub fn published_offset(bytes: u64, parity: usize) -> u64 {
    PUBLISHED_HEADER + parity as u64 * bytes
}

/// How the name of an averaged tensor begins: a framework's buffer
/// (BatchNorm's running statistics and the like), not trained: each update
/// sets it to the average of what the workers pushed for it.
pub const AVERAGED_PREFIX: &str = "buffer:";

/// A tensor's place in the flat space.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// Name.
    pub name: String,
    /// First element.
    pub offset: u64,
    /// Elements.
    pub elements: u64,
}

/// A contiguous range of the flat space owned by one server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    /// Global index.
    pub id: u32,
    /// First element.
    pub start: u64,
    /// Elements.
    pub len: u64,
    /// Owning server rank.
    pub server: u32,
    /// Index among the owning server's shards.
    pub local: u32,
}

/// The whole layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Wire dtype.
    pub dtype: DType,
    /// Tensors in declaration order.
    pub tensors: Vec<TensorInfo>,
    /// Total elements.
    pub total: u64,
    /// Shards in order of `start`.
    pub shards: Vec<Shard>,
    /// Number of servers.
    pub servers: u32,
}

/// Why a layout cannot be built.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum LayoutError {
    /// The model has no elements.
    #[error("the model has no parameters")]
    Empty,
    /// Too many shards.
    #[error("{shards} shards exceeds the limit of {MAX_SHARDS}; raise job.shard_bytes")]
    TooManyShards {
        /// Shards.
        shards: u64,
    },
    /// The tensors' elements add up past [`MAX_ELEMENTS`].
    #[error("the tensors' elements add up past {MAX_ELEMENTS} (2^40), the most a job may have")]
    TooLarge,
}

impl Layout {
    /// Lays out `tensors` with shards of about `shard_bytes` on `servers` servers.
    pub fn new(tensors: &[TensorSpec], dtype: DType, shard_bytes: u64, servers: u32) -> Result<Self, LayoutError> {
        let total = total_elements(tensors.iter().map(|t| &t.elements)).ok_or(LayoutError::TooLarge)?;
        let mut infos = Vec::with_capacity(tensors.len());
        let mut offset = 0u64;
        for t in tensors {
            infos.push(TensorInfo { name: t.name.clone(), offset, elements: t.elements });
            // Cannot wrap: the sum of every count is at most MAX_ELEMENTS.
            offset += t.elements;
        }
        if total == 0 {
            return Err(LayoutError::Empty);
        }
        let es = dtype.size_bytes() as u64;
        let align = SHARD_ALIGN_BYTES / es;
        let per = (shard_bytes / es / align).max(1) * align;
        let count = total.div_ceil(per);
        let servers = servers.max(1);
        if count > MAX_SHARDS as u64 {
            return Err(LayoutError::TooManyShards { shards: count });
        }
        let shards = (0..count)
            .map(|i| {
                let start = i * per;
                Shard {
                    id: i as u32,
                    start,
                    len: per.min(total - start),
                    server: (i % servers as u64) as u32,
                    local: (i / servers as u64) as u32,
                }
            })
            .collect();
        Ok(Self { dtype, tensors: infos, total, shards, servers })
    }

    /// Shards of one server, in local-index order.
    pub fn shards_of(&self, server: u32) -> impl Iterator<Item = &Shard> {
        self.shards.iter().filter(move |s| s.server == server)
    }

    /// The server holding the backup of a shard owned by `owner` (with two
    /// replicas): the next server.
    pub fn backup_server(&self, owner: u32) -> u32 {
        (owner + 1) % self.servers.max(1)
    }

    /// Shards whose backup server `server` holds.
    pub fn backups_of(&self, server: u32) -> impl Iterator<Item = &Shard> {
        self.shards.iter().filter(move |s| self.servers > 1 && self.backup_server(s.server) == server)
    }

    /// Elements held by one server.
    pub fn elements_of(&self, server: u32) -> u64 {
        self.shards_of(server).map(|s| s.len).sum()
    }

    /// Bytes of the whole model in the wire dtype.
    pub fn bytes(&self) -> u64 {
        self.total * self.dtype.size_bytes() as u64
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The element ranges (start, end) of averaged tensors ([`AVERAGED_PREFIX`]).
    pub fn averaged(&self) -> Vec<(u64, u64)> {
        let avg = self.tensors.iter().filter(|t| t.name.starts_with(AVERAGED_PREFIX));
        avg.map(|t| (t.offset, t.offset + t.elements)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(n: u64) -> Vec<TensorSpec> {
        vec![TensorSpec { name: "a".into(), elements: n / 3 }, TensorSpec { name: "b".into(), elements: n - n / 3 }]
    }

    #[test]
    fn shards_cover_the_space_aligned_and_balanced() {
        for dtype in [DType::F32, DType::Bf16] {
            for servers in [1, 2, 3, 7] {
                let l = Layout::new(&t(10_000_019), dtype, 1 << 20, servers).unwrap();
                let mut next = 0;
                for s in &l.shards {
                    assert_eq!(s.start, next);
                    assert_eq!(s.start * dtype.size_bytes() as u64 % SHARD_ALIGN_BYTES, 0);
                    assert!(s.len > 0);
                    next += s.len;
                    assert_eq!(l.shards_of(s.server).nth(s.local as usize), Some(s));
                }
                assert_eq!(next, l.total);
                let per: Vec<u64> = (0..servers).map(|r| l.elements_of(r)).collect();
                let (mx, mn) = (per.iter().max().unwrap(), per.iter().min().unwrap());
                assert!(mx - mn <= (1 << 20) / dtype.size_bytes() as u64, "{per:?}");
            }
        }
        assert_eq!(l_err(), LayoutError::Empty);
    }

    fn l_err() -> LayoutError {
        Layout::new(&[], DType::F32, 4096, 1).unwrap_err()
    }

    #[test]
    fn elements_that_add_up_past_the_limit_are_refused_not_wrapped() {
        // 2^63 + 2^63 wraps to 0 in u64, and 2^64 - 8 + 16 to 8.
        let wrap =
            |a: u64, b: u64| vec![TensorSpec { name: "a".into(), elements: a }, TensorSpec { name: "b".into(), elements: b }];
        for (a, b) in [(1 << 63, 1 << 63), (u64::MAX - 7, 16), (MAX_ELEMENTS, 1), (MAX_ELEMENTS + 1, 0)] {
            let e = Layout::new(&wrap(a, b), DType::F32, 1 << 30, 1).unwrap_err();
            assert_eq!(e, LayoutError::TooLarge, "{a} + {b}");
        }
        assert_eq!(total_elements(&[MAX_ELEMENTS - 1, 1]), Some(MAX_ELEMENTS));
        assert_eq!(total_elements(&[u64::MAX, u64::MAX]), None);
    }

    #[test]
    fn too_many_shards_is_an_error() {
        let e = Layout::new(&t(1 << 30), DType::F32, 4096, 1).unwrap_err();
        assert!(matches!(e, LayoutError::TooManyShards { .. }));
    }
}
