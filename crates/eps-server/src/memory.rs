//! A server's shard memory, one block per shard so that shards can arrive and leave
//! while the job runs: two published versions (registered, readable by peers), one
//! gradient landing slot per worker (registered, writable by that worker only), the
//! f32 master parameters followed by the optimizer state (registered so that a
//! migration can send or receive them in one WRITE), and, while the shard migrates,
//! an f32 gradient buffer (the source forwards each averaged gradient from it; the
//! target receives into it).
//!
//! The server reads and writes these bytes through eps-fabric's safe calls only:
//! the master/state region, the published copies and a source's forward buffer
//! are registered for their owner alone (no LOCAL_WRITE, no REMOTE_WRITE), so
//! the fabric gives views of them; what peers write (landing slots, forwarded
//! gradients, a snapshot's inbox) is copied out block by block before it is
//! used, so a peer racing its own buffer changes only the values it sent.
//!
//! With a device, the master copy and optimizer state live in its memory between
//! updates; with [`DirectRegions`] as well, so do the landing slots and the
//! published copies (GPU memory the NIC reaches in place, GPUDirect RDMA): the
//! server then never touches those bytes with the CPU except through copies
//! (`read_at`/`write_at`: stamps, a carried-over version, a forwarded
//! contribution).

use std::sync::Arc;

use eps_agg::{AggError, Attached, DType, DeviceShard, Optimizer, Out, ShardDevice};
use eps_fabric::prelude::*;
use eps_proto::layout::{PUBLISHED_HEADER, STAMP_WRITING, published_offset};

/// Elements per fused sum/step/publish pass (fits the L2 cache with its inputs).
pub const FUSE_BLOCK: usize = 16 * 1024;
/// Most contributions one update sums.
pub const MAX_WORKERS: usize = eps_proto::spec::MAX_WORKERS as usize;

/// Memory of a shard device's own, registered with the fabric, that the device
/// reads contributions from and publishes into in place: landing slots and
/// published copies that peers reach with no copy through host memory (a GPU's
/// memory registered with the NIC through a dmabuf: GPUDirect RDMA).
pub trait DirectRegions<P: Fabric>: Send + Sync + std::fmt::Debug {
    /// What the memory is, for the log.
    fn describe(&self) -> String;

    /// `bytes` of the device's memory registered with `pd` for `access`; the
    /// region's `addr()` is its address in the device's memory (what
    /// `DeviceShard::attach` takes).
    fn alloc(&self, pd: &P, bytes: usize, access: Access) -> Result<P::Mr, FabricError>;
}

/// Host memory as a device's own, for `eps_agg::HostDevice` (whose addresses are
/// host addresses): the direct path with the CPU as the device, to run and test
/// it anywhere.
#[derive(Clone, Copy, Debug, Default)]
pub struct HostRegions;

impl<P: Fabric> DirectRegions<P> for HostRegions {
    fn describe(&self) -> String {
        "host memory, used in place by the host device".into()
    }
    fn alloc(&self, pd: &P, bytes: usize, access: Access) -> Result<P::Mr, FabricError> {
        pd.alloc_mr(bytes, access)
    }
}

/// The memory of one shard.
#[derive(Debug)]
pub struct ShardBlock<P: Fabric> {
    /// With a device: the shard's device memory, and whether it holds the current
    /// master copy and state (else `state` does). First, so that it is dropped
    /// (ending the device's copies from the landing slots) before them.
    dev: Option<(Box<dyn DeviceShard>, bool)>,
    /// The landing slots and published copies are the device's memory, attached
    /// to `dev` (the CPU reaches them only through `read_at`/`write_at`).
    direct: bool,
    /// Global shard id.
    pub id: u32,
    /// First element in the flat space.
    pub start: u64,
    /// Elements.
    pub len: u64,
    /// Bytes of one copy in the wire dtype.
    pub bytes: usize,
    /// Stamps, then published buffer 0 and buffer 1.
    pub published: P::Mr,
    /// Landing slots, one region per worker rank.
    pub landing: Vec<P::Mr>,
    /// f32 master parameters (`len`), then the optimizer state (`len * state_k`),
    /// then the snapshot tail: registered for this server alone.
    pub state: P::Mr,
    /// Where a peer's snapshot of the master/state region lands (a shard that
    /// arrives by migration, a new backup), remotely writable, until
    /// [`ShardMemory::take_snapshot`] copies it into `state`.
    pub inbox: Option<P::Mr>,
    /// f32 gradient buffer of a migration (source: forwarded from; target: received
    /// into).
    pub grad: Option<P::Mr>,
    /// `Some(parity)`: the current master values are the f32 published buffer
    /// `parity` (an f32 update on the host writes its result there only, one
    /// pass less over memory), and the master region is stale until
    /// [`ShardMemory::to_host`] copies them back.
    latest: Option<usize>,
}

impl<P: Fabric> ShardBlock<P> {
    /// Copies the master values back from the published buffer that holds them,
    /// if it is one (see `latest`).
    fn materialize(&mut self) {
        let Some(q) = self.latest.take() else { return };
        let (len, bytes) = (self.len as usize, self.bytes);
        let off = published_offset(bytes as u64, q) as usize;
        // (Only a host update out of place sets `latest`: never direct.)
        own_mut(&mut self.state)[..len * 4].copy_from_slice(&own(&self.published)[off..off + bytes]);
    }
}

/// The bytes of a region the block registered for itself alone (see the module
/// docs): an invariant of this file, so a refusal is a bug here.
fn own<M: HostRegion>(mr: &M) -> &[u8] {
    mr.view().expect("a shard's own region has a view")
}

/// As [`own`], mutably.
fn own_mut<M: HostRegion>(mr: &mut M) -> &mut [u8] {
    mr.view_mut().expect("a shard's own region has a view")
}

/// The master/state region as f32 values.
fn own_f32<M: HostRegion>(mr: &mut M) -> &mut [f32] {
    bytemuck::cast_slice_mut(own_mut(mr))
}

/// All shards of one server.
#[derive(Debug)]
pub struct ShardMemory<P: Fabric> {
    /// Wire dtype.
    pub dtype: DType,
    /// Workers (landing slots per shard).
    pub workers: u32,
    /// Optimizer state values per parameter.
    pub state_k: usize,
    pd: P,
    /// By global shard id: the shard's block, if held here.
    blocks: Vec<Option<ShardBlock<P>>>,
    /// Scratch for the averaged gradient of one block, per computing thread.
    grads: [Vec<f32>; 2],
    /// Scratch for the master values of one block stepped beside the master
    /// region, per computing thread.
    scratch: [Vec<f32>; 2],
    /// Scratch for one block of the contributions copied out of the landing
    /// slots, per computing thread.
    copies: [Vec<u8>; 2],
    /// Where master copies and optimizer state live between updates, if not here.
    device: Option<Arc<dyn ShardDevice>>,
    /// The device's own memory for landing slots and published copies, if used.
    direct: Option<Arc<dyn DirectRegions<P>>>,
}

/// Why memory could not be set up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MemoryError {
    /// Registering a region with the fabric failed.
    #[error("cannot register {what} of shard {shard}: {bytes} bytes")]
    Register {
        /// Which region.
        what: &'static str,
        /// Global shard id.
        shard: u32,
        /// How many bytes were asked for.
        bytes: u64,
        /// The fabric's error.
        #[source]
        source: FabricError,
    },
    /// The device failed (allocating, or copying a shard's master copy and state).
    #[error("shard {shard} on the device")]
    Device {
        /// Global shard id.
        shard: u32,
        /// The device's error.
        #[source]
        source: AggError,
    },
}

/// Bytes after the optimizer state in the master/state region: the version of a
/// snapshot (u64), then the per-worker clocks of an SSP/ASP shard (u64 each, up to
/// `MAX_WORKERS`), padded.
const SNAPSHOT_TAIL: usize = 8 + 8 * MAX_WORKERS + 56;

/// How a new block starts.
#[allow(missing_debug_implementations)]
#[derive(Clone, Copy)]
pub enum Origin<'a> {
    /// Initial parameters from `init(global_index)`, zero optimizer state.
    Init(&'a dyn Fn(u64) -> f32),
    /// Arrives by migration: the source writes the master values and state into
    /// the inbox and its forwards into the gradient buffer (it is given their
    /// keys).
    Incoming,
    /// A backup: initial parameters from `init(global_index)`, and a gradient
    /// buffer of two halves (by version parity) the owner writes its forwards
    /// into.
    Backup(&'a dyn Fn(u64) -> f32),
    /// A new backup that starts from its owner's snapshot, written into the
    /// inbox; forwards as for [`Origin::Backup`].
    BackupFromSnapshot,
}

impl<P: Fabric> ShardMemory<P> {
    /// An empty set of shards; their master copies and state live on `device`
    /// between updates when one is given.
    pub fn new(
        pd: &P,
        dtype: DType,
        workers: u32,
        opt: &Optimizer,
        total_shards: usize,
        device: Option<Arc<dyn ShardDevice>>,
    ) -> Self {
        Self {
            dtype,
            workers,
            state_k: opt.state_per_param(),
            pd: pd.clone(),
            blocks: (0..total_shards).map(|_| None).collect(),
            grads: [vec![0f32; FUSE_BLOCK], vec![0f32; FUSE_BLOCK]],
            scratch: [vec![0f32; FUSE_BLOCK], vec![0f32; FUSE_BLOCK]],
            copies: [Vec::new(), Vec::new()],
            device,
            direct: None,
        }
    }

    /// Puts the landing slots and published copies of shards added from now on in
    /// the device's own memory (`regions`), used there in place. Needs a device.
    pub fn with_direct(mut self, regions: Arc<dyn DirectRegions<P>>) -> Self {
        if self.device.is_some() {
            self.direct = Some(regions);
        }
        self
    }

    /// Whether shards added from now on have their landing slots and published
    /// copies in the device's memory.
    pub fn is_direct(&self) -> bool {
        self.direct.is_some()
    }

    /// Brings shard `id`'s master/state region up to date from the device (a no-op
    /// without one, or when it is current).
    ///
    /// The caller guarantees no WRITE into or from the region is in flight.
    pub fn to_host(&mut self, id: u32) -> Result<(), MemoryError> {
        let k = self.state_k;
        let Some(b) = self.block_mut(id) else { return Ok(()) };
        b.materialize();
        let Some((dev, owns)) = b.dev.as_mut().filter(|(_, owns)| *owns) else { return Ok(()) };
        let all = own_f32(&mut b.state);
        dev.download(&mut all[..b.len as usize * (1 + k)]).map_err(|source| MemoryError::Device { shard: id, source })?;
        *owns = false;
        Ok(())
    }

    fn alloc(&self, id: u32, what: &'static str, bytes: usize, access: Access) -> Result<P::Mr, MemoryError> {
        self.pd.alloc_mr(bytes.max(1), access).map_err(|source| MemoryError::Register {
            what,
            shard: id,
            bytes: bytes as u64,
            source,
        })
    }

    /// A landing slot or the published copies: in the device's memory when direct.
    fn alloc_shared(&self, id: u32, what: &'static str, bytes: usize, access: Access) -> Result<P::Mr, MemoryError> {
        let Some(d) = &self.direct else { return self.alloc(id, what, bytes, access) };
        d.alloc(&self.pd, bytes.max(1), access).map_err(|source| MemoryError::Register {
            what,
            shard: id,
            bytes: bytes as u64,
            source,
        })
    }

    /// Allocates and registers the memory of shard `id` (`len` elements from
    /// `start`).
    pub fn add(&mut self, id: u32, start: u64, len: u64, origin: Origin<'_>) -> Result<(), MemoryError> {
        let bytes = len as usize * self.dtype.size_bytes();
        // Peers only READ the published copies: registered so, the fabric gives
        // this server views of them. In the device's memory, the device writes
        // them (and the server never views them).
        let access = if self.is_direct() { Access::LOCAL_WRITE | Access::REMOTE_READ } else { Access::REMOTE_READ };
        let published = self.alloc_shared(id, "published parameters", PUBLISHED_HEADER as usize + 2 * bytes, access)?;
        let landing = (0..self.workers)
            .map(|_| self.alloc_shared(id, "gradient landing slots", bytes, Access::LOCAL_WRITE | Access::REMOTE_WRITE))
            .collect::<Result<Vec<_>, _>>()?;
        let state_bytes = len as usize * (1 + self.state_k) * 4 + SNAPSHOT_TAIL;
        let incoming = matches!(origin, Origin::Incoming);
        let backup = matches!(origin, Origin::Backup(_) | Origin::BackupFromSnapshot);
        let state = self.alloc(id, "master parameters and optimizer state", state_bytes, Access::NONE)?;
        // A snapshot lands beside the state and is copied in once it is whole.
        let inbox = if matches!(origin, Origin::Incoming | Origin::BackupFromSnapshot) {
            let rw = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
            Some(self.alloc(id, "snapshot inbox", state_bytes, rw)?)
        } else {
            None
        };
        let grad_access = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
        // A backup receives forwards into two halves by version parity: the next
        // may land while the last is applied (it is acknowledged on arrival).
        let halves = if backup { 2 } else { 1 };
        let grad = if incoming || backup {
            Some(self.alloc(id, "forwarded gradient buffer", halves * len as usize * 4, grad_access)?)
        } else {
            None
        };
        let dev = match &self.device {
            Some(d) => Some((
                d.alloc(self.dtype, len as usize, self.state_k).map_err(|source| MemoryError::Device { shard: id, source })?,
                false,
            )),
            None => None,
        };
        let direct = self.direct.is_some() && dev.is_some();
        let mut b = ShardBlock::<P> { dev, direct, id, start, len, bytes, published, landing, state, inbox, grad, latest: None };
        if let (Some((d, _)), true) = (b.dev.as_mut(), direct) {
            // The device keeps the spans: the memory stays while it may use it.
            // Workers write a slot only between the updates that use it, and the
            // consistency state machine keeps pulls off the buffer an update
            // writes (the protocol's rules for every landing slot and published
            // buffer).
            let dev_err = |source| MemoryError::Device { shard: id, source };
            let fab_err = |e: FabricError| MemoryError::Device { shard: id, source: AggError::Device(e.to_string()) };
            for (r, slot) in b.landing.iter().enumerate() {
                d.attach(Attached::Slot(r), slot.span().map_err(fab_err)?).map_err(dev_err)?;
            }
            d.attach(Attached::Published, b.published.span().map_err(fab_err)?).map_err(dev_err)?;
        } else if let Some((d, _)) = b.dev.as_mut() {
            for slot in &b.landing {
                // Pinning is an optimization: an error leaves copies working.
                if let Ok(span) = slot.span() {
                    let _ = d.pin(span);
                }
            }
        }
        if let Origin::Init(init) | Origin::Backup(init) = origin {
            for (i, m) in own_f32(&mut b.state)[..len as usize].iter_mut().enumerate() {
                *m = init(start + i as u64);
            }
        }
        if self.blocks.len() <= id as usize {
            self.blocks.resize_with(id as usize + 1, || None);
        }
        self.blocks[id as usize] = Some(b);
        Ok(())
    }

    /// Splits shard `id` (at version `version`, published in buffer `parity`) into
    /// new blocks `parts` = `[(lo, elements), (hi, elements)]`, which together
    /// cover it in order: each gets its range of the master copy and optimizer
    /// state, and publishes `version` into its buffer `parity` (the bits the
    /// parent published there, narrowed from the same master values). The parent
    /// stays until the caller removes it; on error nothing changed.
    ///
    /// The caller guarantees no WRITE into or from the parent's master/state region
    /// is in flight (no migration), and that no update runs meanwhile.
    pub fn split(&mut self, id: u32, parity: usize, version: u64, parts: [(u32, u64); 2]) -> Result<(), MemoryError> {
        let Some(p) = self.get(id) else { return Ok(()) };
        let (start, len) = (p.start, p.len);
        if parts[0].1 + parts[1].1 != len || parts.iter().any(|&(pid, n)| n == 0 || pid == id) {
            return Ok(());
        }
        self.to_host(id)?;
        let k = self.state_k;
        let mut made = Vec::with_capacity(2);
        let mut at = start;
        for &(pid, n) in &parts {
            if let Err(e) = self.add(pid, at, n, Origin::Init(&|_| 0.0)) {
                for m in made {
                    self.remove(m);
                }
                return Err(e);
            }
            made.push(pid);
            at += n;
        }
        for &(pid, _) in &parts {
            let Some(mut child) = self.remove(pid) else { continue };
            let Some(p) = self.get(id) else { continue };
            let (off, n) = ((child.start - start) as usize, child.len as usize);
            let src: &[f32] = bytemuck::cast_slice(own(&p.state));
            let dst = own_f32(&mut child.state);
            dst[..n].copy_from_slice(&src[off..off + n]);
            dst[n..n + n * k].copy_from_slice(&src[len as usize + off * k..len as usize + (off + n) * k]);
            self.blocks[pid as usize] = Some(child);
            self.publish(pid, parity).map_err(|source| MemoryError::Device { shard: pid, source })?;
            self.set_stamp(pid, parity, version);
            self.set_stamp(pid, 1 - parity, STAMP_WRITING);
        }
        Ok(())
    }

    /// A copy of shard `id`'s f32 master values followed by its optimizer state
    /// (`len * (1 + state_k)` values), brought from the device first if they
    /// live there: what a checkpoint saves.
    ///
    /// The caller guarantees no WRITE into the region is in flight and that no
    /// update runs meanwhile.
    pub fn copy_state(&mut self, id: u32) -> Result<Option<Vec<f32>>, MemoryError> {
        self.to_host(id)?;
        let k = self.state_k;
        let Some(b) = self.get(id) else { return Ok(None) };
        let all: &[f32] = bytemuck::cast_slice(own(&b.state));
        Ok(Some(all[..b.len as usize * (1 + k)].to_vec()))
    }

    /// Fills shard `id`'s master values and optimizer state (`fill(master,
    /// state)`; the state interleaved, `state_k` values per element) before the
    /// shard is published: a shard restored from a checkpoint.
    ///
    /// The caller guarantees the region's keys are not given out yet.
    pub fn restore<E>(&mut self, id: u32, fill: impl FnOnce(&mut [f32], &mut [f32]) -> Result<(), E>) -> Result<(), E> {
        let k = self.state_k;
        let Some(b) = self.block_mut(id) else { return Ok(()) };
        b.latest = None;
        let len = b.len as usize;
        let (master, rest) = own_f32(&mut b.state).split_at_mut(len);
        fill(master, &mut rest[..len * k])
    }

    /// Frees shard `id`'s memory (its regions are deregistered at once).
    pub fn remove(&mut self, id: u32) -> Option<ShardBlock<P>> {
        self.blocks.get_mut(id as usize)?.take()
    }

    /// Shard `id`'s block, if held here.
    pub fn get(&self, id: u32) -> Option<&ShardBlock<P>> {
        self.blocks.get(id as usize)?.as_ref()
    }

    fn block_mut(&mut self, id: u32) -> Option<&mut ShardBlock<P>> {
        self.blocks.get_mut(id as usize)?.as_mut()
    }

    /// Ids of the shards held, ascending.
    pub fn held(&self) -> impl Iterator<Item = u32> + '_ {
        self.blocks.iter().flatten().map(|b| b.id)
    }

    /// Writes `version` into the tail of shard `id`'s master/state region, so that a
    /// snapshot WRITE of the region carries it.
    ///
    /// The caller guarantees no WRITE from or into the region is in flight.
    pub fn set_snapshot_version(&mut self, id: u32, version: u64, clocks: &[u64]) {
        let Some(b) = self.block_mut(id) else { return };
        let all = own_mut(&mut b.state);
        let tail = all.len() - SNAPSHOT_TAIL;
        all[tail..tail + 8].copy_from_slice(&version.to_le_bytes());
        for (i, c) in clocks.iter().take(MAX_WORKERS).enumerate() {
            all[tail + 8 + 8 * i..tail + 16 + 8 * i].copy_from_slice(&c.to_le_bytes());
        }
    }

    /// The snapshot version in shard `id`'s master/state region (after it landed),
    /// and its per-worker clocks (`workers` of them).
    pub fn snapshot_version(&self, id: u32) -> Option<(u64, Vec<u64>)> {
        let b = self.get(id)?;
        let mut t = vec![0u8; SNAPSHOT_TAIL];
        let from = b.inbox.as_ref().unwrap_or(&b.state);
        from.read_at(from.len() - SNAPSHOT_TAIL, &mut t);
        let word = |i: usize| u64::from_le_bytes(t[8 * i..8 * i + 8].try_into().unwrap_or([0; 8]));
        let clocks = (0..(self.workers as usize).min(MAX_WORKERS)).map(|i| word(1 + i)).collect();
        Some((word(0), clocks))
    }

    /// The snapshot in shard `id`'s inbox has landed whole: copies it into the
    /// master/state region and frees the inbox (its keys stop working). A no-op
    /// without an inbox.
    ///
    /// The caller guarantees the snapshot WRITE completed (its notice came after
    /// it on the same queue pair).
    pub fn take_snapshot(&mut self, id: u32) {
        let Some(b) = self.block_mut(id) else { return };
        let Some(inbox) = b.inbox.take() else { return };
        inbox.read_at(0, own_mut(&mut b.state));
    }

    /// SSP/ASP migration source: puts worker `worker`'s contribution in shard
    /// `id`'s gradient buffer, widened to f32 and scaled by `scale` (the update the
    /// target applies for it), to be forwarded.
    ///
    /// The caller guarantees the contribution has landed, the worker does not push
    /// the shard again before it is credited, and no forward WRITE from the
    /// gradient buffer is in flight.
    pub fn fill_forward(&mut self, id: u32, worker: u32, scale: f32, averaged: &[(usize, usize)]) {
        let dtype = self.dtype;
        let Some(b) = self.block_mut(id) else { return };
        let Some(slot) = b.landing.get(worker as usize) else { return };
        let Some(g) = b.grad.as_mut() else { return };
        // The contribution is copied out of the slot first, and the forward is
        // copied into the gradient buffer.
        let mut src = vec![0u8; b.bytes];
        slot.read_at(0, &mut src);
        let mut dst = vec![0f32; b.len as usize];
        eps_agg::reduce::sum(dtype, &[&src], &mut dst, 1);
        // (Averaged tensors carry the contribution itself: it stands.)
        let mut at = 0;
        for &(lo, hi) in averaged.iter().chain(std::iter::once(&(dst.len(), dst.len()))) {
            dst[at..lo].iter_mut().for_each(|x| *x *= scale);
            at = hi;
        }
        g.write_at(0, bytemuck::cast_slice(&dst));
    }

    /// With a device: starts copying worker `rank`'s contribution to shard `id` to
    /// the device now, while others are still on the wire (the update that sums it
    /// uses this copy).
    ///
    /// The caller guarantees the push landed and the worker writes the slot again
    /// only after the update that sums it (it waits for a pull answer or a credit).
    pub fn stage(&mut self, id: u32, rank: u32) -> Result<(), AggError> {
        let Some(b) = self.block_mut(id).filter(|b| !b.direct) else { return Ok(()) };
        let (Some((dev, _)), Some(slot)) = (b.dev.as_mut(), b.landing.get(rank as usize)) else { return Ok(()) };
        // The slot is not written before the update that uses the copy (the
        // caller); the device keeps the span until then.
        dev.stage(rank as usize, slot.span().map_err(|e| AggError::Device(e.to_string()))?)
    }

    /// Gives shard `id` a gradient buffer to forward from (migration source).
    pub fn add_forward_buffer(&mut self, id: u32) -> Result<(), MemoryError> {
        let len = self.get(id).map_or(0, |b| b.len as usize);
        let mr = self.alloc(id, "migration gradient buffer", len * 4, Access::NONE)?;
        if let Some(b) = self.block_mut(id) {
            b.grad = Some(mr);
        }
        Ok(())
    }

    /// Drops shard `id`'s gradient buffer (the migration is over).
    pub fn drop_forward_buffer(&mut self, id: u32) {
        if let Some(b) = self.block_mut(id) {
            b.grad = None;
        }
    }

    /// Sets the version stamp of buffer `parity` of shard `id` (readers that
    /// RDMA-READ the buffer check it before and after; see `STAMP_WRITING`).
    pub fn set_stamp(&mut self, id: u32, parity: usize, value: u64) {
        let Some(b) = self.block_mut(id) else { return };
        // The fences keep the stamp after the buffer's bytes before it, and
        // before the bytes an update writes after it, in the order peers' READs
        // may see them.
        std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
        b.published.write_at(8 * parity, &value.to_le_bytes());
        std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
    }

    /// Writes shard `id`'s master parameters into published buffer `parity`.
    ///
    /// The caller guarantees no pull is being written from that buffer (the shard's
    /// `ShardSync::can_publish`) and no WRITE into or from the master/state region
    /// is in flight.
    pub fn publish(&mut self, id: u32, parity: usize) -> Result<(), AggError> {
        let (dtype, k) = (self.dtype, self.state_k);
        let Some(b) = self.block_mut(id) else { return Ok(()) };
        b.materialize();
        let off = published_offset(b.bytes as u64, parity) as usize;
        let ShardBlock { published, state, len, bytes, dev, direct, .. } = b;
        if let Some((dev, owns)) = dev.as_mut() {
            on_device(dev.as_mut(), owns, &mut own_f32(state)[..*len as usize * (1 + k)])?;
            return dev.publish(out_to(*direct, published, off, *bytes));
        }
        let master: &[f32] = &bytemuck::cast_slice(own(state))[..*len as usize];
        eps_agg::reduce::narrow(dtype, master, &mut own_mut(published)[off..off + *bytes]);
        Ok(())
    }
}

/// Where the forward of version parity `parity` starts in a gradient buffer of
/// `g_len` bytes for a shard of `len` elements: a backup's buffer has two
/// halves, one per parity; any other, one.
fn forward_at(g_len: usize, len: usize, parity: usize) -> usize {
    if g_len >= 2 * len * 4 { parity * len * 4 } else { 0 }
}

/// Where a device shard publishes bytes `off..off + len` of a published region:
/// in place when it is the device's memory (`direct`), else through the host view.
fn out_to<M: HostRegion>(direct: bool, published: &mut M, off: usize, len: usize) -> Out<'_> {
    if direct {
        return Out::Attached(off);
    }
    Out::Host(&mut own_mut(published)[off..off + len])
}

/// Makes the device hold the current master copy and state (`host`'s, when the
/// host held it): in debug builds the host copy is then poisoned, so a read of it
/// that skipped `to_host` shows (NaN parameters).
fn on_device(dev: &mut dyn DeviceShard, owns: &mut bool, host: &mut [f32]) -> Result<(), AggError> {
    if !*owns {
        dev.upload(host)?;
        *owns = true;
        if cfg!(debug_assertions) {
            host.fill(f32::NAN);
        }
    }
    Ok(())
}

mod average;
mod update;
pub use update::UpdateArgs;
mod seed;
#[cfg(test)]
mod tests;
