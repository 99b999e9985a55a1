//! `eps_worker_set_initial`: the model's own initial values, for a job whose
//! servers start from rank 0's (`model.init = "worker"`).

use std::ffi::c_void;

use super::{State, eps_worker, worker};
use crate::status::{Res, eps_status, eps_status::*, fail, guard, non_null};

/// Gives the model's initial values, before `eps_worker_join`: every tensor
/// end to end in declaration order, in the job's element type (as in the
/// parameter buffer), `bytes` in all. They are copied now and checked at
/// join against the tensors (their size, and every value finite) before the
/// worker takes a rank. If this worker becomes rank 0 of a job whose servers
/// start from a worker's values (`model.init = "worker"`: the default for
/// a job whose tensors a framework declares), they are the job's first
/// parameters, and every worker's first pull returns them; otherwise the
/// first pull replaces them.
///
/// # Safety
/// `values` is NULL or points to `bytes` readable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn eps_worker_set_initial(w: *mut eps_worker, values: *const c_void, bytes: usize) -> eps_status {
    guard("eps_worker_set_initial", || {
        non_null(values, "values")?;
        let h = worker(w)?;
        let st = h.state.lock().unwrap_or_else(|p| p.into_inner());
        if !matches!(&*st, State::Created(..)) {
            return Err(fail(EPS_ERR_STATE, "initial values are given before eps_worker_join"));
        }
        // SAFETY: the caller's contract: `bytes` readable bytes at `values`.
        let v = unsafe { std::slice::from_raw_parts(values.cast::<u8>(), bytes) }.to_vec();
        *h.initial.lock().unwrap_or_else(|p| p.into_inner()) = Some(v);
        Ok(())
    })
}

/// The initial values given, checked against declared tensors (before the
/// worker registers) when there are any.
pub(super) fn take_checked(h: &eps_worker, decl: Option<&[eps_proto::declare::TensorDecl]>) -> Res<Option<Vec<u8>>> {
    let Some(v) = h.initial.lock().unwrap_or_else(|p| p.into_inner()).take() else { return Ok(None) };
    if let Some(d) = decl
        && let Some(t) = d.first()
    {
        let tensors: Vec<(&str, u64)> = d.iter().map(|t| (t.name.as_str(), t.elements)).collect();
        ::eps_worker::check_initial(t.dtype, &tensors, &v).map_err(|e| fail(EPS_ERR_INVALID_ARGUMENT, e.to_string()))?;
    }
    Ok(Some(v))
}
