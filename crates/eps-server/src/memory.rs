//! A server's shard memory: two published versions per shard (registered, readable
//! by peers), one gradient landing slot per worker per shard (registered, writable
//! by peers), and the f32 master parameters and optimizer state (private).

use eps_agg::{AggError, Aggregator, DType, Optimizer, StepScalars};
use eps_fabric::prelude::*;
use eps_proto::layout::{Layout, Shard};

/// Elements per fused sum/step/publish pass (fits the L2 cache with its inputs).
pub const FUSE_BLOCK: usize = 16 * 1024;
/// Most contributions one update sums.
pub const MAX_WORKERS: usize = 64;

/// What one update computes with.
#[derive(Clone, Copy, Debug)]
pub struct UpdateArgs<'a> {
    /// The aggregator.
    pub agg: &'a dyn Aggregator,
    /// The optimizer.
    pub opt: &'a Optimizer,
    /// Per-step scalars.
    pub scalars: StepScalars,
    /// Factor applied to the sum (1 / workers).
    pub scale: f32,
    /// Threads to split the shard over (1 or 2).
    pub threads: usize,
}

/// One thread's share of an update: elements `[0, master.len())` of a range.
struct Part<'a> {
    slots: [&'a [u8]; MAX_WORKERS],
    n_slots: usize,
    master: &'a mut [f32],
    state: &'a mut [f32],
    dst: &'a mut [u8],
    grad: &'a mut [f32],
}

/// Sums, steps and publishes one part block by block: element-wise math, so blocks
/// and parts give the same bits as whole-shard calls, with less memory traffic.
fn fused(u: &UpdateArgs<'_>, dtype: DType, k: usize, p: Part<'_>) -> Result<(), AggError> {
    let es = dtype.size_bytes();
    let len = p.master.len();
    let mut start = 0;
    while start < len {
        let end = (start + FUSE_BLOCK).min(len);
        let mut inputs: [&[u8]; MAX_WORKERS] = [&[]; MAX_WORKERS];
        for (x, s) in inputs.iter_mut().zip(&p.slots[..p.n_slots]) {
            *x = &s[start * es..end * es];
        }
        let grad = &mut p.grad[..end - start];
        u.agg.reduce(dtype, &inputs[..p.n_slots], u.scale, grad)?;
        u.agg.step(u.opt, u.scalars, &mut p.master[start..end], grad, &mut p.state[start * k..end * k])?;
        eps_agg::reduce::narrow(dtype, &p.master[start..end], &mut p.dst[start * es..end * es]);
        start = end;
    }
    Ok(())
}

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
    /// Scratch for the averaged gradient of one block, per computing thread.
    grads: [Vec<f32>; 2],
    /// Optimizer state values per parameter.
    pub state_k: usize,
}

/// Why memory could not be set up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MemoryError {
    /// Registering a region with the fabric failed.
    #[error("cannot register {what}: {bytes} bytes for {shards} shards x {copies} copies")]
    Register {
        /// Which region.
        what: &'static str,
        /// How many bytes were asked for.
        bytes: u64,
        /// Shards on this server.
        shards: usize,
        /// Copies per shard (versions or workers).
        copies: u32,
        /// The fabric's error.
        #[source]
        source: FabricError,
    },
    /// Private host memory (master parameters, optimizer state) could not be had.
    #[error("cannot allocate {what}: {bytes} bytes of host memory")]
    Host {
        /// Which buffer.
        what: &'static str,
        /// How many bytes were asked for.
        bytes: u64,
    },
}

/// A zeroed `Vec<f32>` of `n` elements, or an error naming `what` and the size.
fn try_zeroed(n: usize, what: &'static str) -> Result<Vec<f32>, MemoryError> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| MemoryError::Host { what, bytes: n as u64 * 4 })?;
    v.resize(n, 0.0);
    Ok(v)
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
        for s in layout.shards_of(server) {
            let bytes = s.len as usize * es;
            places.push(ShardPlace { shard: *s, pub_off, land_off, elem_off, bytes });
            pub_off += 2 * bytes;
            land_off += bytes;
            elem_off += s.len as usize;
        }
        let n = places.len();
        let published = pd.alloc_mr(pub_off.max(1), Access::LOCAL_WRITE | Access::REMOTE_READ).map_err(|source| {
            MemoryError::Register { what: "published parameters", bytes: pub_off as u64, shards: n, copies: 2, source }
        })?;
        let landing = (0..workers)
            .map(|_| pd.alloc_mr(land_off.max(1), Access::LOCAL_WRITE | Access::REMOTE_WRITE))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|source| MemoryError::Register {
                what: "gradient landing slots",
                bytes: land_off as u64 * workers as u64,
                shards: n,
                copies: workers,
                source,
            })?;
        let mut master = try_zeroed(elem_off, "f32 master parameters")?;
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
            state: try_zeroed(elem_off * state_k, "optimizer state")?,
            grads: [vec![0f32; FUSE_BLOCK], vec![0f32; FUSE_BLOCK]],
            state_k,
        })
    }

    /// Byte offset of published buffer `parity` of local shard `i`.
    pub fn pub_offset(&self, i: usize, parity: usize) -> usize {
        let p = &self.places[i];
        p.pub_off + parity * p.bytes
    }

    /// Applies one update to local shard `i`: sums the slots of `contributors` (in
    /// that order), steps the optimizer on the master copy, and writes published
    /// buffer `parity`, split over `u.threads` threads by element range.
    ///
    /// # Safety
    /// No WRITE into the contributors' slots of this shard may be in flight (their
    /// pushes completed, and none may push the shard again before the server says
    /// so: a pull answer in BSP, a credit otherwise), and no pull may be reading or
    /// being written from buffer `parity` (`ShardSync::can_publish`).
    pub unsafe fn update(&mut self, i: usize, parity: usize, contributors: &[u32], u: &UpdateArgs<'_>) -> Result<(), AggError> {
        let p = self.places[i];
        let (len, k, dtype) = (p.shard.len as usize, self.state_k, self.dtype);
        let es = dtype.size_bytes();
        let ShardMemory { published, landing, master, state, grads, .. } = self;
        let mut slots: [&[u8]; MAX_WORKERS] = [&[]; MAX_WORKERS];
        for (x, &r) in slots.iter_mut().zip(contributors) {
            // SAFETY: the caller excludes writers of these slots (see above).
            *x = unsafe { &landing[r as usize].as_slice()[p.land_off..p.land_off + p.bytes] };
        }
        let off = p.pub_off + parity * p.bytes;
        // SAFETY: the caller guarantees no pull uses this buffer; peers only READ the
        // published region, and no other reference to it exists meanwhile.
        let dst = unsafe { &mut published.as_mut_slice()[off..off + p.bytes] };
        let m = &mut master[p.elem_off..p.elem_off + len];
        let st = &mut state[p.elem_off * k..(p.elem_off + len) * k];
        let [g0, g1] = grads;
        let n_slots = contributors.len().min(MAX_WORKERS);
        if u.threads < 2 || len < 4 * FUSE_BLOCK {
            return fused(u, dtype, k, Part { slots, n_slots, master: m, state: st, dst, grad: g0 });
        }
        let mid = (len / 2).div_ceil(FUSE_BLOCK) * FUSE_BLOCK;
        let (m0, m1) = m.split_at_mut(mid);
        let (st0, st1) = st.split_at_mut(mid * k);
        let (d0, d1) = dst.split_at_mut(mid * es);
        let slots1: [&[u8]; MAX_WORKERS] = std::array::from_fn(|r| if r < n_slots { &slots[r][mid * es..] } else { &[][..] });
        std::thread::scope(|s| {
            let h = s.spawn(|| fused(u, dtype, k, Part { slots: slots1, n_slots, master: m1, state: st1, dst: d1, grad: g1 }));
            let a = fused(u, dtype, k, Part { slots, n_slots, master: m0, state: st0, dst: d0, grad: g0 });
            let b = h.join().unwrap_or(Ok(()));
            a.and(b)
        })
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

#[cfg(test)]
mod tests {
    use super::*;
    use eps_proto::layout::Layout;
    use eps_proto::spec::TensorSpec;

    #[test]
    fn too_much_memory_is_a_clear_error() {
        let pd = SoftDevice::open().unwrap().alloc_pd();
        let tensors = [TensorSpec { name: "huge".into(), elements: 1 << 40 }];
        let layout = Layout::new(&tensors, DType::F32, 1 << 30, 1).unwrap();
        let opt = Optimizer::Sgd { weight_decay: 0.0 };
        let e = ShardMemory::new(&pd, &layout, 0, 2, &opt, |_| 0.0).unwrap_err();
        let msg = format!("{e}: {}", std::error::Error::source(&e).map(|s| s.to_string()).unwrap_or_default());
        assert!(msg.contains("published parameters") && msg.contains("879609"), "says how much: {msg}");
        assert!(msg.contains("cannot allocate"), "says why: {msg}");
    }
}
