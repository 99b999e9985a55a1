//! A server's shard memory: two published versions per shard (registered, readable
//! by peers), one gradient landing slot per worker per shard (registered, writable
//! by peers), and the f32 master parameters and optimizer state (private).

use eps_agg::{DType, Optimizer};
use eps_fabric::prelude::*;
use eps_proto::layout::{Layout, Shard};

/// Where one local shard lives.
#[derive(Clone, Copy, Debug)]
pub struct ShardPlace {
    /// The shard.
    pub shard: Shard,
    /// Byte offset of its two published buffers in the published region.
    pub pub_off: usize,
    /// Byte offset of its landing slot in each worker's landing region.
    pub land_off: usize,
    /// Element offset of its master parameters / gradient scratch.
    pub elem_off: usize,
    /// Bytes of one copy of the shard in the wire dtype.
    pub bytes: usize,
}

/// All memory of one server.
#[derive(Debug)]
pub struct ShardMemory {
    /// Wire dtype.
    pub dtype: DType,
    /// Workers.
    pub workers: u32,
    /// Local shards in local-index order.
    pub places: Vec<ShardPlace>,
    /// Published parameters: per shard, buffer 0 then buffer 1.
    pub published: SoftMr,
    /// Landing slots, one region per worker (so a worker can only ever overwrite its
    /// own slots): per shard, one slot.
    pub landing: Vec<SoftMr>,
    /// f32 master parameters of all local shards, end to end.
    pub master: Vec<f32>,
    /// Optimizer state, `state_k` values per parameter, interleaved, shards end to end.
    pub state: Vec<f32>,
    /// Scratch for the averaged gradient of one shard.
    pub grad: Vec<f32>,
    /// Optimizer state values per parameter.
    pub state_k: usize,
}

/// Why memory could not be set up.
#[derive(Debug, thiserror::Error)]
#[error("cannot register {what}: {bytes} bytes for {shards} shards x {copies} copies")]
pub struct MemoryError {
    /// Which region.
    pub what: &'static str,
    /// How many bytes were asked for.
    pub bytes: u64,
    /// Shards on this server.
    pub shards: usize,
    /// Copies per shard (versions or workers).
    pub copies: u32,
    /// The fabric's error.
    #[source]
    pub source: FabricError,
}

impl ShardMemory {
    /// Allocates and registers memory for `server`'s shards; master parameters start
    /// at `init(global_index)`.
    pub fn new(
        pd: &SoftPd,
        layout: &Layout,
        server: u32,
        workers: u32,
        opt: &Optimizer,
        init: impl Fn(u64) -> f32,
    ) -> Result<Self, MemoryError> {
        let es = layout.dtype.size_bytes();
        let mut places = Vec::new();
        let n_local = layout.shards_of(server).count();
        let mut pub_off = eps_proto::layout::stamp_area_bytes(n_local) as usize;
        let (mut land_off, mut elem_off) = (0usize, 0usize);
        let mut max_len = 0usize;
        for s in layout.shards_of(server) {
            let bytes = s.len as usize * es;
            places.push(ShardPlace { shard: *s, pub_off, land_off, elem_off, bytes });
            pub_off += 2 * bytes;
            land_off += bytes;
            elem_off += s.len as usize;
            max_len = max_len.max(s.len as usize);
        }
        let n = places.len();
        let published = pd.alloc_mr(pub_off.max(1), Access::LOCAL_WRITE | Access::REMOTE_READ).map_err(|source| MemoryError {
            what: "published parameters",
            bytes: pub_off as u64,
            shards: n,
            copies: 2,
            source,
        })?;
        let landing = (0..workers)
            .map(|_| pd.alloc_mr(land_off.max(1), Access::LOCAL_WRITE | Access::REMOTE_WRITE))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|source| MemoryError {
                what: "gradient landing slots",
                bytes: land_off as u64 * workers as u64,
                shards: n,
                copies: workers,
                source,
            })?;
        let mut master = vec![0f32; elem_off];
        for p in &places {
            for i in 0..p.shard.len as usize {
                master[p.elem_off + i] = init(p.shard.start + i as u64);
            }
        }
        let state_k = opt.state_per_param();
        Ok(Self {
            dtype: layout.dtype,
            workers,
            places,
            published,
            landing,
            master,
            state: vec![0f32; elem_off * state_k],
            grad: vec![0f32; max_len],
            state_k,
        })
    }

    /// Byte offset of published buffer `parity` of local shard `i`.
    pub fn pub_offset(&self, i: usize, parity: usize) -> usize {
        let p = &self.places[i];
        p.pub_off + parity * p.bytes
    }

    /// Worker `w`'s landed contribution for local shard `i`.
    ///
    /// # Safety
    /// No WRITE into that slot may be in flight: the worker's push for the shard has
    /// completed and it may not push the shard again before the server says so (a
    /// pull answer in BSP, a credit otherwise).
    pub unsafe fn slot(&self, i: usize, w: u32) -> &[u8] {
        let p = &self.places[i];
        // SAFETY: the caller excludes writers of this range (see above).
        unsafe { &self.landing[w as usize].as_slice()[p.land_off..p.land_off + p.bytes] }
    }

    /// Writes elements `range` (shard-relative) of local shard `i`'s master
    /// parameters into the published buffer at byte offset `buf_off`.
    ///
    /// The caller guarantees no pull is being written from that buffer.
    pub fn publish_range(&mut self, i: usize, buf_off: usize, range: std::ops::Range<usize>) {
        let p = self.places[i];
        let es = self.dtype.size_bytes();
        let src = &self.master[p.elem_off + range.start..p.elem_off + range.end];
        // SAFETY: peers only READ this region, and the consistency state machine
        // guarantees no pull (WRITE from here) is in flight on this buffer; no other
        // reference to the region exists while the slice lives.
        let dst = unsafe { &mut self.published.as_mut_slice()[buf_off + range.start * es..buf_off + range.end * es] };
        eps_agg::reduce::narrow(self.dtype, src, dst);
    }

    /// Sets the version stamp of buffer `parity` of local shard `i` (readers that
    /// RDMA-READ the buffer check it before and after; see `STAMP_WRITING`).
    pub fn set_stamp(&mut self, i: usize, parity: usize, value: u64) {
        std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
        let off = 16 * i + 8 * parity;
        // SAFETY: the stamp lies inside the stamp area at the start of the published
        // region (sized for every local shard); peers only read it. A volatile store
        // keeps it in program order with the buffer writes around it.
        unsafe {
            let base = self.published.as_mut_slice().as_mut_ptr();
            std::ptr::write_volatile(base.add(off).cast::<[u8; 8]>(), value.to_le_bytes());
        }
        std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
    }

    /// Writes local shard `i`'s master parameters into published buffer `parity`.
    ///
    /// The caller guarantees no pull is being written from that buffer (the shard's
    /// `ShardSync::can_publish`).
    pub fn publish(&mut self, i: usize, parity: usize) {
        let p = self.places[i];
        let off = self.pub_offset(i, parity);
        let src = &self.master[p.elem_off..p.elem_off + p.shard.len as usize];
        // SAFETY: peers only READ this region, and the consistency state machine
        // guarantees no pull (WRITE from here) is in flight on this buffer; no other
        // reference to the region exists while the slice lives.
        let dst = unsafe { &mut self.published.as_mut_slice()[off..off + p.bytes] };
        eps_agg::reduce::narrow(self.dtype, src, dst);
    }
}
