//! The first parameters from worker 0 (`model.init = "worker"`): the job's
//! rank 0 writes its initial values of every shard into its landing slot on
//! the shard's server, before it asks for its first pull on the same
//! connection; the servers start from them and every worker's first pull
//! returns them (DDP broadcasts rank 0's parameters at start the same way).

use eps_agg::DType;
use eps_fabric::prelude::*;
use eps_proto::imm::{Imm, ImmKind};

use crate::{Registration, Worker, WorkerError};

/// Work-request id bit of a seed WRITE (posted unsignaled: only a failure
/// completes).
pub(crate) const WR_SEED: u64 = 1 << 59;

impl Registration {
    /// The model's initial values (every tensor end to end, in the job's
    /// dtype, as in the parameter buffer). If this worker is rank 0 of a job
    /// whose servers take a worker's values (`model.init = "worker"`), they
    /// are the job's version 0; otherwise the first pull replaces them.
    /// Refused unless they are the layout's size and every value is finite.
    pub fn with_initial(mut self, values: Vec<u8>) -> Result<Self, WorkerError> {
        let tensors: Vec<(&str, u64)> = self.layout.tensors.iter().map(|t| (t.name.as_str(), t.elements)).collect();
        check_initial(self.layout.dtype, &tensors, &values)?;
        self.initial = Some(values);
        Ok(self)
    }
}

/// Checks a model's initial values against its tensors (name, elements; end
/// to end in this order, of `dtype`): the right size, every value finite.
pub fn check_initial(dtype: DType, tensors: &[(&str, u64)], values: &[u8]) -> Result<(), WorkerError> {
    let es = dtype.size_bytes();
    let want = tensors.iter().map(|t| t.1 as usize * es).sum::<usize>();
    if values.len() != want {
        return Err(WorkerError::BadValues(format!(
            "the initial values hold {} bytes; the tensors take {want} (elements times element size, end to end)",
            values.len()
        )));
    }
    let mut wide = vec![0f32; (values.len() / es).min(1 << 16)];
    let per = wide.len().max(1);
    for (k, chunk) in values.chunks(per * es).enumerate() {
        let w = &mut wide[..chunk.len() / es];
        eps_agg::reduce::sum(dtype, &[chunk], w, 1);
        if let Some(i) = w.iter().position(|x| !x.is_finite()) {
            let at = (k * per + i) as u64;
            let (mut from, mut name) = (0u64, "?");
            for &(n, e) in tensors {
                if at < from + e {
                    name = n;
                    break;
                }
                from += e;
            }
            return Err(WorkerError::BadValues(format!(
                "initial value {} of tensor {name:?} is {}: the servers take finite values only",
                at - from,
                w[i]
            )));
        }
    }
    Ok(())
}

impl<P: Fabric> Worker<P> {
    /// Sends the job's first values to the servers (rank 0 of a seeded job):
    /// the parameter buffer's, or, when it holds none (`values` false), a
    /// zero-length seed that keeps the servers' initialiser.
    pub(crate) fn seed(&mut self, values: bool) -> Result<(), WorkerError> {
        let es = self.layout.dtype.size_bytes() as u64;
        for sid in self.map.shards_at(0) {
            let (start, len) = (self.map.routes[sid].start, self.map.routes[sid].len);
            let (owner, slot) = self.slot_at(self.route(sid, 0))?;
            let imm = Imm { kind: ImmKind::Forward, shard: sid as u32, seq: 0 }.encode();
            self.post_retrying(|w| {
                let whole = [Sge::new(&w.params, start * es, (len * es) as u32)];
                let sg: &[Sge<'_, P::Mr>] = if values { &whole } else { &[] };
                let wr = SendWr { wr_id: WR_SEED | sid as u64, op: SendOp::WriteImm(slot, imm), sg, signaled: false };
                Ok(w.qp(owner)?.post_send(&wr)?)
            })?;
        }
        Ok(())
    }
}
