//! The worker calls: create, join (declaring tensors), buffers, iterations,
//! non-blocking push/pull with request handles, membership, stats, finish.

use std::collections::HashMap;
use std::ffi::{CString, c_char, c_int, c_void};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use ::eps_worker as lib;
use eps_agg::DType;
use eps_proto::declare::TensorDecl;
use lib::WorkerConfig;

use crate::any::{AnyWorker, Transport};
use crate::handle::{self, Kind};
use crate::status::{Res, c_str, eps_status, eps_status::*, fail, guard, non_null};
use crate::types::*;

mod initial;
mod join;
pub use initial::eps_worker_set_initial;
pub use join::{eps_worker_create, eps_worker_join, eps_worker_join_borrowed, eps_worker_options_init};

/// A worker of a job (opaque).
#[allow(non_camel_case_types)]
pub struct eps_worker {
    state: Mutex<State>,
    /// The model's initial values, if given (`eps_worker_set_initial`).
    initial: Mutex<Option<Vec<u8>>>,
}

impl std::fmt::Debug for eps_worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("eps_worker")
    }
}

enum State {
    Created(WorkerConfig, Transport),
    Joined(Box<Joined>),
    /// Finished: the buffers (the last parameters) stay readable until close.
    Finished(Box<Joined>),
    Closed,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Push,
    Pull,
}

struct Pending {
    op: Op,
    ids: Vec<usize>,
    iteration: u64,
}

pub(crate) struct Joined {
    pub(crate) w: AnyWorker,
    /// The buffers are the caller's (`eps_worker_join_borrowed`).
    borrowed: bool,
    names: Vec<CString>,
    pending: HashMap<u64, Pending>,
    next_id: u64,
}

/// Most requests in flight per worker.
const MAX_PENDING: usize = 4096;

impl Joined {
    /// Tensor indices: all of them for (NULL, 0).
    ///
    /// # Safety
    /// `ids` is NULL or points to `n` readable `u32`s.
    unsafe fn ids(&self, ids: *const u32, n: usize) -> Res<Vec<usize>> {
        let count = self.w.tensor_count();
        if ids.is_null() {
            if n != 0 {
                return Err(fail(EPS_ERR_NULL_POINTER, format!("tensor_ids is NULL with count {n}")));
            }
            return Ok((0..count).collect());
        }
        if n > count {
            return Err(fail(EPS_ERR_INVALID_ARGUMENT, format!("{n} tensor ids for a job of {count} tensors")));
        }
        // SAFETY: not NULL, and `n` readable elements by the caller's contract.
        let s = unsafe { std::slice::from_raw_parts(ids, n) };
        s.iter()
            .map(|&i| {
                if (i as usize) < count {
                    Ok(i as usize)
                } else {
                    Err(fail(EPS_ERR_NOT_FOUND, format!("tensor id {i}: the job has {count} tensors")))
                }
            })
            .collect()
    }

    fn add(&mut self, p: Pending) -> Res<u64> {
        if self.pending.len() >= MAX_PENDING {
            return Err(fail(EPS_ERR_STATE, format!("{MAX_PENDING} requests in flight: test or wait for some first")));
        }
        self.next_id += 1;
        self.pending.insert(self.next_id, p);
        Ok(self.next_id)
    }

    /// Whether request `id` is complete (it is then released).
    fn test(&mut self, id: u64) -> Res<bool> {
        let p = self.pending.get(&id).ok_or_else(|| fail(EPS_ERR_INVALID_ARGUMENT, "unknown request (completed already?)"))?;
        let done = if self.w.iteration() > p.iteration {
            true
        } else {
            match p.op {
                Op::Push => self.w.pushes_sent(&p.ids)?,
                Op::Pull => self.w.test_pull(&p.ids)?,
            }
        };
        if done {
            self.pending.remove(&id);
        }
        Ok(done)
    }
}

fn worker<'a>(w: *mut eps_worker) -> Res<&'a eps_worker> {
    handle::get(w, Kind::Worker)
}

/// Runs `f` on a joined worker (that has not finished).
pub(crate) fn joined<R>(w: *mut eps_worker, f: impl FnOnce(&mut Joined) -> Res<R>) -> Res<R> {
    with_joined(w, false, f)
}

/// Runs `f` on a joined worker; a finished one too if `finished_ok` (the
/// calls that only read its layout, buffers and statistics).
pub(crate) fn with_joined<R>(w: *mut eps_worker, finished_ok: bool, f: impl FnOnce(&mut Joined) -> Res<R>) -> Res<R> {
    let h = worker(w)?;
    let mut st = h.state.lock().unwrap_or_else(|p| p.into_inner());
    match &mut *st {
        State::Joined(j) => f(j),
        State::Finished(j) if finished_ok => f(j),
        State::Created(..) => Err(fail(EPS_ERR_STATE, "the worker has not joined (call eps_worker_join first)")),
        State::Finished(_) => Err(fail(EPS_ERR_STATE, "the worker has finished")),
        State::Closed => Err(fail(EPS_ERR_INVALID_HANDLE, "an eps_worker that was closed already")),
    }
}

/// Writes `v` to the out-parameter `out` after a NULL check.
///
/// # Safety
/// `out` is NULL or valid for a write of `T`.
pub(crate) unsafe fn put<T>(out: *mut T, v: T, what: &str) -> Res {
    non_null(out, what)?;
    // SAFETY: not NULL, and writable by the caller's contract.
    unsafe { out.write(v) };
    Ok(())
}

pub(crate) fn secret_from_env() -> Res<String> {
    if let Ok(s) = std::env::var("EPS_JOB_SECRET")
        && !s.is_empty()
    {
        return Ok(s);
    }
    if let Some(path) = std::env::var_os("EPS_JOB_SECRET_FILE") {
        let text = std::fs::read_to_string(&path).map_err(|e| {
            fail(EPS_ERR_INVALID_ARGUMENT, format!("cannot read EPS_JOB_SECRET_FILE={}: {e}", path.to_string_lossy()))
        })?;
        return Ok(text.trim().to_string());
    }
    Err(fail(EPS_ERR_INVALID_ARGUMENT, "no job secret: set options.secret, EPS_JOB_SECRET or EPS_JOB_SECRET_FILE"))
}

/// The worker's rank, buffers and layout size.
///
/// # Safety
/// `out` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn eps_worker_get_info(w: *mut eps_worker, out: *mut eps_worker_info) -> eps_status {
    guard("eps_worker_get_info", || {
        non_null(out, "out")?;
        let info = with_joined(w, true, |j| {
            let l = j.w.layout();
            let (elements, bytes, dtype, tensor_count) = (l.total, l.bytes(), l.dtype, l.tensors.len() as u32);
            let params = j.w.params_ptr().cast::<c_void>();
            let grads = j.w.grads_bytes_mut().as_mut_ptr().cast::<c_void>();
            let spec = j.w.spec();
            Ok(eps_worker_info {
                rank: j.w.rank(),
                tensor_count,
                dtype: eps_dtype::from_dtype(dtype),
                elements,
                bytes,
                params,
                grads,
                iteration: j.w.iteration(),
                steps: spec.job.steps,
                batch: spec.job.batch,
                gradient_average: c_int::from(spec.optimizer.kind == "none"),
                seed: spec.job.seed,
                transport: j.w.transport().as_ptr(),
            })
        })?;
        // SAFETY: the caller's contract.
        unsafe { put(out, info, "out") }
    })
}

/// Tensor `index` of the job's layout, with its views of the buffers.
///
/// # Safety
/// `out` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn eps_worker_get_tensor(w: *mut eps_worker, index: u32, out: *mut eps_tensor_info) -> eps_status {
    guard("eps_worker_get_tensor", || {
        non_null(out, "out")?;
        let info = with_joined(w, true, |j| {
            let n = j.w.tensor_count();
            let t =
                j.w.layout()
                    .tensors
                    .get(index as usize)
                    .cloned()
                    .ok_or_else(|| fail(EPS_ERR_NOT_FOUND, format!("tensor index {index}: the job has {n} tensors")))?;
            let es = j.w.dtype().size_bytes() as u64;
            let dtype = eps_dtype::from_dtype(j.w.dtype());
            let off = (t.offset * es) as usize;
            // In bounds: a tensor lies inside the flat buffers (the layout
            // checked it), so the offset stays inside the parameter buffer.
            let params = j.w.params_ptr().wrapping_add(off).cast::<c_void>();
            let grads = j.w.grads_bytes_mut()[off..].as_mut_ptr().cast::<c_void>();
            Ok(eps_tensor_info {
                name: j.names[index as usize].as_ptr(),
                elements: t.elements,
                offset: t.offset,
                dtype,
                params,
                grads,
            })
        })?;
        // SAFETY: the caller's contract.
        unsafe { put(out, info, "out") }
    })
}

/// The index of the tensor named `name`.
///
/// # Safety
/// `name` is a NUL-terminated string; `index` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn eps_worker_find_tensor(w: *mut eps_worker, name: *const c_char, index: *mut u32) -> eps_status {
    guard("eps_worker_find_tensor", || {
        // SAFETY: the caller's contract.
        let name = unsafe { c_str(name, "name") }?;
        non_null(index, "index")?;
        let i = with_joined(w, true, |j| {
            j.w.layout()
                .tensors
                .iter()
                .position(|t| t.name == name)
                .ok_or_else(|| fail(EPS_ERR_NOT_FOUND, format!("no tensor is named {name:?}")))
        })?;
        // SAFETY: the caller's contract.
        unsafe { put(index, i as u32, "index") }
    })
}

/// Begins the current iteration before its gradient is computed: waits while
/// a membership change is voted on at this boundary, and says whether this
/// worker contributes and which samples are its own (`batch` per
/// contributor; 0: the spec's `job.batch`).
///
/// # Safety
/// `out` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn eps_worker_begin(w: *mut eps_worker, batch: u64, out: *mut eps_iteration) -> eps_status {
    guard("eps_worker_begin", || {
        non_null(out, "out")?;
        let it = joined(w, |j| {
            let contributes = j.w.begin()?;
            let t = j.w.iteration();
            let batch = if batch == 0 { u64::from(j.w.spec().job.batch) } else { batch };
            let m = j.w.membership();
            let set = m.contributors(t);
            let index = set.iter().position(|&r| r == j.w.rank());
            let samples = match j.w.samples(batch) {
                Some(s) => s,
                None if contributes => {
                    return Err(fail(
                        EPS_ERR_INVALID_ARGUMENT,
                        format!("batch {batch}: iteration {t}'s samples would pass index 2^64 - 1"),
                    ));
                }
                None => 0..0,
            };
            Ok(eps_iteration {
                iteration: t,
                contributes: c_int::from(contributes),
                contributor_index: index.map_or(u32::MAX, |i| i as u32),
                contributors: set.len() as u32,
                sample_begin: samples.start,
                sample_end: samples.end,
            })
        })?;
        // SAFETY: the caller's contract.
        unsafe { put(out, it, "out") }
    })
}

/// Shared body of the three non-blocking calls.
///
/// # Safety
/// `ids` is NULL or points to `count` readable `u32`s; `req` is writable.
unsafe fn start(
    name: &str,
    w: *mut eps_worker,
    ids: *const u32,
    count: usize,
    req: *mut eps_request,
    push: bool,
    pull: bool,
) -> eps_status {
    guard(name, || {
        non_null(req, "req")?;
        let id = joined(w, |j| {
            // SAFETY: the caller's contract.
            let mut list = unsafe { j.ids(ids, count) }?;
            if push && ids.is_null() && j.w.in_round() {
                // "All tensors" while some were pushed this iteration: the rest.
                list.retain(|&i| !j.w.is_pushed(i));
            }
            let t = j.w.iteration();
            if push {
                j.w.push_tensors(&list)?;
            } else if !j.w.in_round() {
                return Err(fail(EPS_ERR_STATE, "a pull with no push in this iteration (push first)"));
            } else if let Some(&i) = list.iter().find(|&&i| !j.w.is_pushed(i)) {
                return Err(fail(EPS_ERR_STATE, format!("a pull of tensor {i}, not pushed in this iteration (push it first)")));
            }
            let ids_for_test = if pull && ids.is_null() { (0..j.w.tensor_count()).collect() } else { list };
            j.add(Pending { op: if pull { Op::Pull } else { Op::Push }, ids: ids_for_test, iteration: t })
        })?;
        // SAFETY: the caller's contract.
        unsafe { put(req, eps_request { worker: w, id }, "req") }
    })
}

/// Pushes the gradients of tensors `tensor_ids` (`count` of them; NULL and 0:
/// every tensor not pushed yet in this iteration) without waiting: each shard
/// goes out once every tensor it overlaps was pushed. The request completes
/// when their gradient buffers may be written again. The first push of an
/// iteration begins it.
///
/// # Safety
/// `tensor_ids` is NULL or points to `count` readable ids; `req` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn eps_worker_push_start(
    w: *mut eps_worker,
    tensor_ids: *const u32,
    count: usize,
    req: *mut eps_request,
) -> eps_status {
    // SAFETY: the caller's contract, passed on.
    unsafe { start("eps_worker_push_start", w, tensor_ids, count, req, true, false) }
}

/// Asks for the next parameters of tensors `tensor_ids` (NULL and 0: all),
/// which must have been pushed in this iteration. The request completes when
/// they are in the parameter buffer; the iteration ends when every tensor's are.
///
/// # Safety
/// As `eps_worker_push_start`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn eps_worker_pull_start(
    w: *mut eps_worker,
    tensor_ids: *const u32,
    count: usize,
    req: *mut eps_request,
) -> eps_status {
    // SAFETY: the caller's contract, passed on.
    unsafe { start("eps_worker_pull_start", w, tensor_ids, count, req, false, true) }
}

/// `eps_worker_push_start` then `eps_worker_pull_start` of the same tensors,
/// as one request.
///
/// # Safety
/// As `eps_worker_push_start`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn eps_worker_push_pull_start(
    w: *mut eps_worker,
    tensor_ids: *const u32,
    count: usize,
    req: *mut eps_request,
) -> eps_status {
    // SAFETY: the caller's contract, passed on.
    unsafe { start("eps_worker_push_pull_start", w, tensor_ids, count, req, true, true) }
}

/// Pushes every tensor's gradient and waits for the next parameters.
#[unsafe(no_mangle)]
pub extern "C" fn eps_worker_push_pull(w: *mut eps_worker) -> eps_status {
    guard("eps_worker_push_pull", || joined(w, |j| Ok(j.w.push_pull()?)))
}

/// Sets `*done` to 1 if `req` is complete (releasing it), else 0.
///
/// # Safety
/// `req` points to a request this library filled in; `done` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn eps_request_test(req: *const eps_request, done: *mut c_int) -> eps_status {
    guard("eps_request_test", || {
        non_null(req, "req")?;
        non_null(done, "done")?;
        // SAFETY: not NULL; readable by the caller's contract.
        let r = unsafe { *req };
        let d = joined(r.worker, |j| j.test(r.id))?;
        // SAFETY: the caller's contract.
        unsafe { put(done, c_int::from(d), "done") }
    })
}

/// Waits until `req` is complete (releasing it), or `timeout_ms` passed
/// (`EPS_ERR_TIMEOUT`; the request stays in flight). 0: the worker's timeout
/// (`eps_worker_options.timeout_ms`): the call never blocks longer than that.
///
/// # Safety
/// `req` points to a request this library filled in.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn eps_request_wait(req: *const eps_request, timeout_ms: u32) -> eps_status {
    guard("eps_request_wait", || {
        non_null(req, "req")?;
        // SAFETY: not NULL; readable by the caller's contract.
        let r = unsafe { *req };
        // 0: the worker's own timeout (a stalled peer must not hold the caller for ever).
        let limit = match timeout_ms {
            0 => joined(r.worker, |j| Ok(j.w.timeout()))?,
            ms => Duration::from_millis(ms.into()),
        };
        let started = Instant::now();
        let mut spins = 0u32;
        loop {
            if joined(r.worker, |j| j.test(r.id))? {
                return Ok(());
            }
            if started.elapsed() > limit {
                return Err(fail(
                    EPS_ERR_TIMEOUT,
                    format!(
                        "request {} not complete after {} ms (a server or another worker is stalled?)",
                        r.id,
                        limit.as_millis()
                    ),
                ));
            }
            // Spin while answers may be close, then yield the core.
            spins += 1;
            if spins > 64 {
                std::thread::sleep(Duration::from_micros(50));
            } else {
                std::thread::yield_now();
            }
        }
    })
}

/// The contributors of `iteration` as far as this worker knows (as of its
/// last `eps_worker_begin`): up to `capacity` ranks into `ranks`, their
/// number into `*count` (which may exceed `capacity`).
///
/// # Safety
/// `ranks` is NULL (with capacity 0) or has room for `capacity` ranks; `count` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn eps_worker_members(
    w: *mut eps_worker,
    iteration: u64,
    ranks: *mut u32,
    capacity: usize,
    count: *mut usize,
) -> eps_status {
    guard("eps_worker_members", || {
        non_null(count, "count")?;
        if ranks.is_null() && capacity != 0 {
            return Err(fail(EPS_ERR_NULL_POINTER, format!("ranks is NULL with capacity {capacity}")));
        }
        let set = joined(w, |j| Ok(j.w.membership().contributors(iteration).to_vec()))?;
        for (i, r) in set.iter().take(capacity).enumerate() {
            // SAFETY: `i < capacity` and the buffer has room for `capacity` ranks.
            unsafe { ranks.add(i).write(*r) };
        }
        // SAFETY: the caller's contract.
        unsafe { put(count, set.len(), "count") }
    })
}

/// The first iteration after `after` at which the contributor set changes, as
/// far as this worker knows: compare `eps_worker_members` before and at it to
/// see who joined and who left. `EPS_ERR_NOT_FOUND` when no change is known.
///
/// # Safety
/// `at` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn eps_worker_next_change(w: *mut eps_worker, after: u64, at: *mut u64) -> eps_status {
    guard("eps_worker_next_change", || {
        non_null(at, "at")?;
        let next = joined(w, |j| Ok(j.w.membership().epochs().iter().map(|e| e.0).find(|&t| t > after)))?;
        let t = next.ok_or_else(|| fail(EPS_ERR_NOT_FOUND, format!("no membership change known after iteration {after}")))?;
        // SAFETY: the caller's contract.
        unsafe { put(at, t, "at") }
    })
}

/// Transfer statistics so far.
///
/// # Safety
/// `out` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn eps_worker_get_stats(w: *mut eps_worker, out: *mut eps_worker_stats) -> eps_status {
    guard("eps_worker_get_stats", || {
        non_null(out, "out")?;
        let s = with_joined(w, true, |j| {
            let s = j.w.stats();
            Ok(eps_worker_stats {
                pushed_bytes: s.pushed_bytes,
                pulled_bytes: s.pulled_bytes,
                comm_ns: s.comm.as_nanos().min(u128::from(u64::MAX)) as u64,
                iteration: j.w.iteration(),
            })
        })?;
        // SAFETY: the caller's contract.
        unsafe { put(out, s, "out") }
    })
}

/// Asks to leave the running job (BSP): the change is voted at the next
/// iteration boundary nobody has begun, and the other workers go on without
/// this one. Keep training until `eps_worker_begin` says it no longer
/// contributes, then call `eps_worker_finish`. Refused (`EPS_ERR_CONTROL`,
/// with the reason) for the last worker, or while another change is voted.
#[unsafe(no_mangle)]
pub extern "C" fn eps_worker_leave(w: *mut eps_worker) -> eps_status {
    guard("eps_worker_leave", || joined(w, |j| Ok(j.w.leave()?)))
}

/// Tells the control plane this worker is done (at the end of training, or
/// after `eps_worker_begin` said it no longer contributes). The buffers stay
/// readable, holding the last parameters pulled, until `eps_worker_close`
/// (`eps_worker_get_info`, `_get_tensor`, `_find_tensor` and `_get_stats`
/// still work); nothing can be pushed or pulled.
#[unsafe(no_mangle)]
pub extern "C" fn eps_worker_finish(w: *mut eps_worker) -> eps_status {
    guard("eps_worker_finish", || {
        let h = worker(w)?;
        let mut st = h.state.lock().unwrap_or_else(|p| p.into_inner());
        match std::mem::replace(&mut *st, State::Closed) {
            State::Joined(mut j) => {
                let r = j.w.finish_in_place();
                *st = State::Finished(j);
                r?;
                Ok(())
            }
            other => {
                let msg = match &other {
                    State::Created(..) => "the worker has not joined",
                    State::Finished(_) => "the worker has finished already",
                    _ => "an eps_worker that was closed already",
                };
                *st = other;
                Err(fail(EPS_ERR_STATE, msg))
            }
        }
    })
}

/// Releases the worker. A worker closed without `eps_worker_finish` vanishes
/// from the job: it is removed when its lease runs out. Any later call with
/// the handle, a second close included, returns `EPS_ERR_INVALID_HANDLE`.
/// With the caller's buffers (`eps_worker_join_borrowed`) it first waits until
/// no pull or push is in flight; if that times out it returns
/// `EPS_ERR_TIMEOUT` and the worker stays open (the buffers are still in use).
#[unsafe(no_mangle)]
pub extern "C" fn eps_worker_close(w: *mut eps_worker) -> eps_status {
    guard("eps_worker_close", || {
        let h = worker(w)?;
        let mut st = h.state.lock().unwrap_or_else(|p| p.into_inner());
        if let State::Joined(j) | State::Finished(j) = &mut *st
            && j.borrowed
        {
            j.w.quiesce()?;
        }
        handle::close(w, Kind::Worker)?;
        let old = std::mem::replace(&mut *st, State::Closed);
        drop(st);
        drop(old);
        Ok(())
    })
}
