//! Averaged element ranges: a framework's buffers (BatchNorm's running
//! statistics and the like, tensors named `buffer:...`) are not trained; each
//! update sets them to the average of what the workers pushed for them, so
//! every worker pulls the same values.

use eps_fabric::prelude::*;

use super::{MemoryError, ShardMemory, own_f32};

impl<P: Fabric> ShardMemory<P> {
    /// After an update of shard `id` that wrote buffer `parity`: the elements
    /// of `ranges` (shard-relative, end exclusive) take the contributions of
    /// `contributors` summed and times `scale` instead of the optimizer's
    /// step, in the master copy and the published buffer.
    ///
    /// The caller guarantees what [`ShardMemory::update`] does (the slots
    /// still hold the contributions), and that the update just ran.
    pub fn average_ranges(
        &mut self,
        id: u32,
        parity: usize,
        contributors: &[u32],
        scale: f32,
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
            let copies: Vec<Vec<u8>> = contributors
                .iter()
                .filter_map(|&r| b.landing.get(r as usize))
                .map(|slot| {
                    let mut v = vec![0u8; n * es];
                    slot.read_at(lo * es, &mut v);
                    v
                })
                .collect();
            let inputs: Vec<&[u8]> = copies.iter().map(Vec::as_slice).collect();
            let master = &mut own_f32(&mut b.state)[lo..hi];
            eps_agg::reduce::sum(dtype, &inputs, master, 1);
            master.iter_mut().for_each(|x| *x *= scale);
        }
        self.publish(id, parity).map_err(|source| MemoryError::Device { shard: id, source })
    }

    /// As [`ShardMemory::average_ranges`], for a forwarded update (a
    /// migration target, a backup): the elements of `ranges` take the
    /// forwarded averaged gradient, times `unscale`.
    pub fn average_forwarded(
        &mut self,
        id: u32,
        parity: usize,
        ranges: &[(usize, usize)],
        unscale: f32,
    ) -> Result<(), MemoryError> {
        if ranges.is_empty() {
            return Ok(());
        }
        self.to_host(id)?;
        let Some(b) = self.block_mut(id) else { return Ok(()) };
        let Some(g) = b.grad.as_ref() else { return Ok(()) };
        // A backup's buffer has two halves: the one of this version's parity.
        let len = b.len as usize;
        let from = if g.len() >= 2 * len * 4 { parity * len * 4 } else { 0 };
        for &(lo, hi) in ranges {
            let mut v = vec![0f32; hi - lo];
            g.read_at(from + lo * 4, bytemuck::cast_slice_mut(&mut v));
            let master = &mut own_f32(&mut b.state)[lo..hi];
            for (m, x) in master.iter_mut().zip(v) {
                *m = x * unscale;
            }
        }
        self.publish(id, parity).map_err(|source| MemoryError::Device { shard: id, source })
    }
}
