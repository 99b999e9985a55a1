//! One update of a shard: the fused sum, optimizer step and publish over
//! blocks that fit the cache, split over up to two threads; a forwarded
//! update (a migration target, a backup); an iteration without contributions.

use eps_agg::{AggError, Aggregator, DType, Optimizer, StepScalars};
use eps_fabric::prelude::*;
use eps_proto::layout::published_offset;

use super::{FUSE_BLOCK, MAX_WORKERS, ShardMemory, forward_at, on_device, out_to, own_f32, own_mut};

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

/// Where one thread's update steps the master values.
enum Master<'a> {
    /// In the master region.
    InPlace(&'a mut [f32]),
    /// Read from `input` (the master region, or the f32 published buffer the last
    /// update wrote), stepped block by block in `scratch`, and written to the
    /// published buffer only.
    Beside { input: &'a [f32], scratch: &'a mut [f32] },
}

impl Master<'_> {
    fn len(&self) -> usize {
        match self {
            Master::InPlace(m) => m.len(),
            Master::Beside { input, .. } => input.len(),
        }
    }

    /// Splits at element `mid`; the second half gets `scratch`.
    fn split_at<'b>(self, mid: usize, scratch: &'b mut [f32]) -> (Master<'b>, Master<'b>)
    where
        Self: 'b,
    {
        match self {
            Master::InPlace(m) => {
                let (a, b) = m.split_at_mut(mid);
                (Master::InPlace(a), Master::InPlace(b))
            }
            Master::Beside { input, scratch: s0 } => {
                let (a, b) = input.split_at(mid);
                (Master::Beside { input: a, scratch: s0 }, Master::Beside { input: b, scratch })
            }
        }
    }
}

/// One thread's share of an update: elements `[0, master.len())` of a range
/// that starts at element `first` of the shard.
struct Part<'a, M> {
    slots: [Option<&'a M>; MAX_WORKERS],
    n_slots: usize,
    first: usize,
    /// Where each block of the contributions is copied out of the slots.
    copies: &'a mut Vec<u8>,
    master: Master<'a>,
    state: &'a mut [f32],
    dst: &'a mut [u8],
    grad: &'a mut [f32],
    /// Where the averaged gradient is copied for forwarding, when migrating.
    fwd: Option<&'a mut [f32]>,
}

/// Sums, steps and publishes one part block by block: element-wise math, so blocks
/// and parts give the same bits as whole-shard calls, with less memory traffic.
fn fused<M: HostRegion>(u: &UpdateArgs<'_>, dtype: DType, k: usize, mut p: Part<'_, M>) -> Result<(), AggError> {
    let es = dtype.size_bytes();
    let len = p.master.len();
    let block = block_elems(p.n_slots, es);
    let mut start = 0;
    while start < len {
        let end = (start + block).min(len);
        let n = (end - start) * es;
        // The contributions are copied out of the landing slots first: what a
        // peer writes into its slot meanwhile cannot reach the sum half-way.
        p.copies.resize(p.n_slots * n, 0);
        for (c, s) in p.copies.chunks_exact_mut(n).zip(&p.slots[..p.n_slots]) {
            if let Some(s) = s {
                s.read_at((p.first + start) * es, c);
            }
        }
        let mut inputs: [&[u8]; MAX_WORKERS] = [&[]; MAX_WORKERS];
        for (x, c) in inputs.iter_mut().zip(p.copies.chunks_exact(n)) {
            *x = c;
        }
        let grad = &mut p.grad[..end - start];
        u.agg.reduce(dtype, &inputs[..p.n_slots], u.scale, grad)?;
        if let Some(f) = p.fwd.as_deref_mut() {
            f[start..end].copy_from_slice(grad);
        }
        let st = &mut p.state[start * k..end * k];
        let out = &mut p.dst[start * es..end * es];
        match &mut p.master {
            Master::InPlace(m) => {
                u.agg.step(u.opt, u.scalars, &mut m[start..end], grad, st)?;
                eps_agg::reduce::narrow(dtype, &m[start..end], out);
            }
            Master::Beside { input, scratch } => {
                let t = &mut scratch[..end - start];
                t.copy_from_slice(&input[start..end]);
                u.agg.step(u.opt, u.scalars, t, grad, st)?;
                eps_agg::reduce::narrow(dtype, t, out);
            }
        }
        start = end;
    }
    Ok(())
}

/// Elements per block of an update with `n_slots` contributions of `es` bytes:
/// their copies stay within about 512 KiB (the L2 cache), at most
/// [`FUSE_BLOCK`]. Blocks do not change the bits (element-wise math).
fn block_elems(n_slots: usize, es: usize) -> usize {
    (512 * 1024 / (n_slots.max(1) * es)).clamp(1024, FUSE_BLOCK)
}

impl<P: Fabric> ShardMemory<P> {
    /// Applies one update to shard `id`: sums the slots of `contributors` (in that
    /// order), steps the optimizer on the master copy, and writes published buffer
    /// `parity`, split over `u.threads` threads by element range. When the shard has
    /// a gradient buffer, the averaged gradient is copied into it for forwarding.
    ///
    /// The caller guarantees, for the result to be right: the contributors'
    /// pushes of this shard completed and none pushes it again before the server
    /// says so (a pull answer in BSP, a credit otherwise); no pull is reading or
    /// being written from buffer `parity` (`ShardSync::can_publish`); and no
    /// WRITE from the gradient buffer (a forward) is in flight. The contributions
    /// are copied out of the slots block by block, so a peer that breaks the rule
    /// changes only the values it sent.
    pub fn update(&mut self, id: u32, parity: usize, contributors: &[u32], u: &UpdateArgs<'_>) -> Result<(), AggError> {
        let (k, dtype) = (self.state_k, self.dtype);
        let es = dtype.size_bytes();
        let Some(b) = self.blocks.get_mut(id as usize).and_then(Option::as_mut) else { return Ok(()) };
        let len = b.len as usize;
        // f32 on the host: the step reads the master values where the last
        // update left them and writes the published buffer only.
        let out_of_place = dtype == DType::F32 && b.dev.is_none() && b.latest != Some(parity);
        if !out_of_place {
            b.materialize();
        }
        let off = published_offset(b.bytes as u64, parity) as usize;
        let n_slots = contributors.len().min(MAX_WORKERS);
        if let Some((dev, owns)) = b.dev.as_mut() {
            on_device(dev.as_mut(), owns, &mut own_f32(&mut b.state)[..len * (1 + k)])?;
            let mut fwd = b.grad.as_mut().map(|_| vec![0f32; len]);
            // A device copies the contributions from the slots' memory itself,
            // by DMA, from their spans (none when they are its own, attached).
            let mut inputs = Vec::with_capacity(n_slots);
            for &r in &contributors[..n_slots] {
                let host = match (b.direct, b.landing.get(r as usize)) {
                    (false, Some(slot)) => Some(slot.span().map_err(|e| AggError::Device(e.to_string()))?),
                    _ => None,
                };
                inputs.push((r as usize, host));
            }
            let out = out_to(b.direct, &mut b.published, off, b.bytes);
            dev.update(&inputs, u.scale, u.opt, u.scalars, fwd.as_deref_mut(), out)?;
            if let (Some(f), Some(g)) = (fwd, b.grad.as_mut()) {
                g.write_at(0, bytemuck::cast_slice(&f));
            }
            return Ok(());
        }
        let mut slots: [Option<&P::Mr>; MAX_WORKERS] = [None; MAX_WORKERS];
        for (x, &r) in slots.iter_mut().zip(contributors) {
            *x = b.landing.get(r as usize);
        }
        // The averaged gradient for forwarding: in place in a buffer of this
        // server's own, else gathered here and copied in after.
        let mut gathered = None;
        let fwd: Option<&mut [f32]> = match b.grad.as_mut() {
            Some(g) if g.view().is_ok() => Some(bytemuck::cast_slice_mut(own_mut(g))),
            Some(_) => Some(gathered.insert(vec![0f32; len]).as_mut_slice()),
            None => None,
        };
        let (m, st) = own_f32(&mut b.state).split_at_mut(len);
        let st = &mut st[..len * k];
        let [g0, g1] = &mut self.grads;
        let [s0, s1] = &mut self.scratch;
        let [c0, c1] = &mut self.copies;
        let (master, dst) = if out_of_place {
            let from = b.latest.replace(parity);
            let h = published_offset(b.bytes as u64, 0) as usize;
            let publ = own_mut(&mut b.published);
            let (lo, hi) = publ.split_at_mut(h + b.bytes);
            let (dst, prev) = if parity == 0 { (&mut lo[h..], &hi[..b.bytes]) } else { (&mut hi[..b.bytes], &lo[h..]) };
            // The master values: where the last update left them, else the region.
            let input: &[f32] = if from.is_some() { bytemuck::cast_slice(prev) } else { m };
            (Master::Beside { input, scratch: s0 }, dst)
        } else {
            (Master::InPlace(m), &mut own_mut(&mut b.published)[off..off + b.bytes])
        };
        let r = if u.threads < 2 || len < 4 * FUSE_BLOCK {
            fused(u, dtype, k, Part { slots, n_slots, first: 0, copies: c0, master, state: st, dst, grad: g0, fwd })
        } else {
            let mid = (len / 2).div_ceil(FUSE_BLOCK) * FUSE_BLOCK;
            let (m0, m1) = master.split_at(mid, s1);
            let (st0, st1) = st.split_at_mut(mid * k);
            let (d0, d1) = dst.split_at_mut(mid * es);
            let (f0, f1) = match fwd {
                Some(f) => {
                    let (a, b) = f.split_at_mut(mid);
                    (Some(a), Some(b))
                }
                None => (None, None),
            };
            std::thread::scope(|s| {
                let h = s.spawn(|| {
                    let p1 = Part { slots, n_slots, first: mid, copies: c1, master: m1, state: st1, dst: d1, grad: g1, fwd: f1 };
                    fused(u, dtype, k, p1)
                });
                let p0 = Part { slots, n_slots, first: 0, copies: c0, master: m0, state: st0, dst: d0, grad: g0, fwd: f0 };
                let a = fused(u, dtype, k, p0);
                let b = h.join().unwrap_or(Ok(()));
                a.and(b)
            })
        };
        if let (Some(f), Some(g)) = (gathered, b.grad.as_mut()) {
            g.write_at(0, bytemuck::cast_slice(&f));
        }
        r
    }

    /// Applies a forwarded update to shard `id` (a migration target): the optimizer
    /// step with the averaged gradient in the shard's gradient buffer, then publishes
    /// into buffer `parity`. The same element-wise code as [`ShardMemory::update`],
    /// so the result is bitwise the source's.
    ///
    /// The caller guarantees, for the result to be right: the forward has landed
    /// and the source writes the gradient buffer (or, for a backup's two halves,
    /// this version's half) again only after our acknowledgement; no pull uses
    /// buffer `parity`. The gradient is copied out block by block.
    pub fn apply_forwarded(&mut self, id: u32, parity: usize, u: &UpdateArgs<'_>) -> Result<(), AggError> {
        let (k, dtype) = (self.state_k, self.dtype);
        let es = dtype.size_bytes();
        let Some(b) = self.blocks.get_mut(id as usize).and_then(Option::as_mut) else { return Ok(()) };
        b.materialize();
        let Some(g) = b.grad.as_ref() else { return Ok(()) };
        let len = b.len as usize;
        let from = forward_at(g.len(), len, parity);
        let off = published_offset(b.bytes as u64, parity) as usize;
        let all = own_f32(&mut b.state);
        if let Some((dev, owns)) = b.dev.as_mut() {
            on_device(dev.as_mut(), owns, &mut all[..len * (1 + k)])?;
            let mut grad = vec![0f32; len];
            g.read_at(from, bytemuck::cast_slice_mut(&mut grad));
            let out = out_to(b.direct, &mut b.published, off, b.bytes);
            return dev.apply(&grad, u.opt, u.scalars, out);
        }
        let dst = &mut own_mut(&mut b.published)[off..off + b.bytes];
        let (m, st) = all.split_at_mut(len);
        let st = &mut st[..len * k];
        let grad = &mut self.grads[0];
        let mut start = 0;
        while start < len {
            let end = (start + FUSE_BLOCK).min(len);
            let gb = &mut grad[..end - start];
            g.read_at(from + start * 4, bytemuck::cast_slice_mut(gb));
            u.agg.step(u.opt, u.scalars, &mut m[start..end], gb, &mut st[start * k..end * k])?;
            eps_agg::reduce::narrow(dtype, &m[start..end], &mut dst[start * es..end * es]);
            start = end;
        }
        Ok(())
    }

    /// Publishes into buffer `parity` of shard `id` a copy of the other buffer
    /// (the current version): an iteration without contributions, whose
    /// parameters carry over; the master copy and optimizer state stay.
    ///
    /// The caller guarantees no pull uses buffer `parity` (as for
    /// [`ShardMemory::update`]).
    pub fn carry(&mut self, id: u32, parity: usize) {
        let Some(b) = self.block_mut(id) else { return };
        let src = published_offset(b.bytes as u64, 1 - parity) as usize;
        let dst = published_offset(b.bytes as u64, parity) as usize;
        if b.latest.is_some() {
            // Both buffers hold the master values now: the next update, which
            // writes the other one, reads them from this one.
            b.latest = Some(parity);
        }
        if b.direct {
            let mut v = vec![0u8; b.bytes];
            b.published.read_at(src, &mut v);
            b.published.write_at(dst, &v);
            return;
        }
        own_mut(&mut b.published).copy_within(src..src + b.bytes, dst);
    }
}
