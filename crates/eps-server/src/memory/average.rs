//! Averaged element ranges: a framework's buffers (BatchNorm's running
//! statistics and the like, tensors named `buffer:...`) are not trained; each
//! update sets them to the average of what the workers pushed for them, so
//! every worker pulls the same values.

use eps_fabric::prelude::*;

use super::{MemoryError, ShardMemory, forward_at, own_f32};

impl<P: Fabric> ShardMemory<P> {
    /// After an update of shard `id` that wrote buffer `parity`: the elements
    /// of `ranges` (shard-relative, end exclusive) take the mean of the
    /// contributions of `contributors` instead of the optimizer's step, in
    /// the master copy and the published buffer. The mean is taken one
    /// contribution at a time (`m += (x - m) / k`), so values every worker
    /// holds alike (a constant buffer) stay exactly what they are, whatever
    /// the worker count.
    ///
    /// The caller guarantees what [`ShardMemory::update`] does (the slots
    /// still hold the contributions), and that the update just ran.
    pub fn average_ranges(
        &mut self,
        id: u32,
        parity: usize,
        contributors: &[u32],
        ranges: &[(usize, usize)],
    ) -> Result<(), MemoryError> {
        if ranges.is_empty() || contributors.is_empty() {
            return Ok(());
        }
        let dtype = self.dtype;
        let es = dtype.size_bytes();
        // The host holds the master copy from here (a device takes it again
        // when it publishes).
        self.to_host(id)?;
        let Some(b) = self.block_mut(id) else { return Ok(()) };
        for &(lo, hi) in ranges {
            let n = hi - lo;
            let (mut raw, mut x) = (vec![0u8; n * es], vec![0f32; n]);
            let master = &mut own_f32(&mut b.state)[lo..hi];
            let slots = contributors.iter().filter_map(|&r| b.landing.get(r as usize));
            for (k, slot) in slots.enumerate() {
                // Copied out, then widened (a peer writing its slot meanwhile
                // changes only the values it sent).
                slot.read_at(lo * es, &mut raw);
                eps_agg::reduce::sum(dtype, &[&raw], &mut x, 1);
                if k == 0 {
                    master.copy_from_slice(&x);
                } else {
                    let inv = 1.0 / (k + 1) as f32;
                    master.iter_mut().zip(&x).for_each(|(m, &v)| *m += (v - *m) * inv);
                }
            }
            // A forward (to a migration target, a backup) carries these values
            // themselves, not the optimizer's gradient: its receiver copies them.
            if let Some(g) = b.grad.as_mut() {
                g.write_at(lo * 4, bytemuck::cast_slice(&own_f32(&mut b.state)[lo..hi]));
            }
        }
        self.publish(id, parity).map_err(|source| MemoryError::Device { shard: id, source })
    }

    /// As [`ShardMemory::average_ranges`], for a forwarded update (a
    /// migration target, a backup): the elements of `ranges` take the
    /// forwarded values (the source's, see `average_ranges` and
    /// `fill_forward`), bit for bit.
    pub fn average_forwarded(&mut self, id: u32, parity: usize, ranges: &[(usize, usize)]) -> Result<(), MemoryError> {
        if ranges.is_empty() {
            return Ok(());
        }
        self.to_host(id)?;
        let Some(b) = self.block_mut(id) else { return Ok(()) };
        let Some(g) = b.grad.as_ref() else { return Ok(()) };
        let from = forward_at(g.len(), b.len as usize, parity);
        for &(lo, hi) in ranges {
            let mut v = vec![0f32; hi - lo];
            g.read_at(from + lo * 4, bytemuck::cast_slice_mut(&mut v));
            own_f32(&mut b.state)[lo..hi].copy_from_slice(&v);
        }
        self.publish(id, parity).map_err(|source| MemoryError::Device { shard: id, source })
    }
}
