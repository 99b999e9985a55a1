//! A shard's first values from a worker (`model.init = "worker"`).

use eps_agg::AggError;
use eps_fabric::prelude::*;

use super::{MemoryError, ShardMemory, own_f32};

impl<P: Fabric> ShardMemory<P> {
    /// Shard `id` starts from the values worker `rank` wrote into its landing
    /// slot (its initial parameters, in the wire dtype): they are copied out,
    /// widened into the master copy, and published into buffer `parity`.
    /// The optimizer state stays zero.
    ///
    /// The caller guarantees the values have landed, the worker writes the
    /// slot again only after a pull it asks for later (answered after this),
    /// and no pull is being written from buffer `parity`.
    pub fn seed(&mut self, id: u32, rank: u32, parity: usize) -> Result<(), MemoryError> {
        let dtype = self.dtype;
        // The host holds the master copy from here (a device takes it again
        // when it publishes).
        self.to_host(id)?;
        let device = |source: AggError| MemoryError::Device { shard: id, source };
        let Some(b) = self.block_mut(id) else { return Ok(()) };
        let Some(slot) = b.landing.get(rank as usize) else { return Ok(()) };
        let mut src = vec![0u8; b.bytes];
        slot.read_at(0, &mut src);
        let len = b.len as usize;
        eps_agg::reduce::sum(dtype, &[&src], &mut own_f32(&mut b.state)[..len], 1);
        self.publish(id, parity).map_err(device)
    }
}
