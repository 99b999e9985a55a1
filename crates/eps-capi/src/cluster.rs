//! A job hosted inside the calling process (a control plane and its servers
//! on threads, soft transport, CPU aggregation), for embedding and tests; and
//! the scale call `eps scale` makes, for any job.

use std::ffi::{c_char, c_int};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use eps_control::{ControlClient, ControlService};
use eps_proto::JobSpec;
use eps_proto::control::ControlMsg;

use crate::handle::{self, Kind};
use crate::status::{Res, c_str, chain, eps_status, eps_status::*, fail, from_control, guard, non_null};

/// A job hosted in this process (opaque).
#[allow(non_camel_case_types)]
pub struct eps_cluster {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    /// Threads (control plane and servers) still running.
    running: Arc<AtomicUsize>,
    /// The first failure of a hosted thread.
    failure: Arc<std::sync::Mutex<Option<String>>>,
}

impl std::fmt::Debug for eps_cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("eps_cluster").field("addr", &self.addr).finish()
    }
}

fn secret_arg(secret: *const c_char) -> Res<eps_fabric::Secret> {
    // SAFETY: the callers pass the C caller's string on under the same contract.
    let s = unsafe { c_str(secret, "secret") }?;
    eps_fabric::Secret::new(s).map_err(|e| fail(EPS_ERR_INVALID_ARGUMENT, e.to_string()))
}

/// Starts a job inside this process: a control plane listening on `listen`
/// (`"IP:PORT"`, port 0 for any; NULL: `127.0.0.1:0`) for the job spec
/// `spec_toml` (TOML text, as `eps control --spec` reads; `[model] declare =
/// true` lets the first worker declare the tensors), and `job.servers`
/// servers on threads, with the job secret `secret`. Workers join it like any
/// job; `eps_cluster_get_address` tells where.
///
/// # Safety
/// `spec_toml` and `secret` are NUL-terminated strings; `listen` is NULL or
/// one; `out` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn eps_cluster_start(
    spec_toml: *const c_char,
    listen: *const c_char,
    secret: *const c_char,
    out: *mut *mut eps_cluster,
) -> eps_status {
    guard("eps_cluster_start", || {
        non_null(out, "out")?;
        // SAFETY: the caller's contract.
        let text = unsafe { c_str(spec_toml, "spec_toml") }?;
        let listen = if listen.is_null() {
            "127.0.0.1:0"
        } else {
            // SAFETY: the caller's contract.
            unsafe { c_str(listen, "listen") }?
        };
        let listen: SocketAddr =
            listen.parse().map_err(|_| fail(EPS_ERR_INVALID_ARGUMENT, format!("listen address {listen:?} is not IP:PORT")))?;
        let secret = secret_arg(secret)?;
        let spec = JobSpec::from_toml(text).map_err(|e| fail(EPS_ERR_INVALID_ARGUMENT, e.to_string()))?;
        let store = Box::new(eps_control::store::MemStore::default());
        let svc =
            ControlService::bind(listen, &spec, text, secret.clone(), store).map_err(|e| fail(from_control(&e), chain(&e)))?;
        let addr = svc.local_addr();
        let stop = Arc::new(AtomicBool::new(false));
        let running = Arc::new(AtomicUsize::new(1 + spec.job.servers as usize));
        let failure = Arc::new(std::sync::Mutex::new(None));
        let note = |running: &Arc<AtomicUsize>, failure: &Arc<std::sync::Mutex<Option<String>>>, r: Result<(), String>| {
            if let Err(e) = r {
                failure.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e);
            }
            running.fetch_sub(1, Ordering::AcqRel);
        };
        {
            let (stop, running, failure) = (stop.clone(), running.clone(), failure.clone());
            std::thread::Builder::new()
                .name("eps-control".into())
                .spawn(move || {
                    note(&running, &failure, svc.run_until(&stop).map_err(|e| format!("control plane: {}", chain(&e))))
                })
                .map_err(|e| fail(EPS_ERR_INTERNAL, format!("cannot start a thread: {e}")))?;
        }
        for i in 0..spec.job.servers {
            let cfg = eps_server::ServerConfig {
                control: addr.into(),
                secret: secret.clone(),
                listen_ip: addr.ip(),
                aggregator: Arc::new(eps_agg::CpuAggregator::new(1)),
                device: None,
                accept_timeout: Duration::from_secs(120),
                update_threads: 1,
            };
            let (running, failure) = (running.clone(), failure.clone());
            std::thread::Builder::new()
                .name(format!("eps-server-{i}"))
                .spawn(move || {
                    note(&running, &failure, eps_server::run(&cfg).map(|_| ()).map_err(|e| format!("server: {}", chain(&e))))
                })
                .map_err(|e| fail(EPS_ERR_INTERNAL, format!("cannot start a thread: {e}")))?;
        }
        let h = Box::new(eps_cluster { addr, stop, running, failure });
        // SAFETY: `out` is not NULL (checked) and writable by contract.
        unsafe { out.write(handle::give(Kind::Cluster, h)) };
        Ok(())
    })
}

/// Writes the control plane's address (`"IP:PORT"`, NUL-terminated) into
/// `buf` of `capacity` bytes (64 always suffice).
///
/// # Safety
/// `buf` has room for `capacity` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn eps_cluster_get_address(c: *mut eps_cluster, buf: *mut c_char, capacity: usize) -> eps_status {
    guard("eps_cluster_get_address", || {
        let c = handle::get(c, Kind::Cluster)?;
        non_null(buf, "buf")?;
        let s = c.addr.to_string();
        if s.len() + 1 > capacity {
            return Err(fail(
                EPS_ERR_INVALID_ARGUMENT,
                format!("the address needs {} bytes; capacity is {capacity}", s.len() + 1),
            ));
        }
        // SAFETY: `buf` has room for `capacity >= len + 1` bytes (checked).
        unsafe {
            std::ptr::copy_nonoverlapping(s.as_ptr(), buf.cast::<u8>(), s.len());
            buf.add(s.len()).write(0);
        }
        Ok(())
    })
}

/// Waits until the hosted job has finished (every worker and server did), or
/// `timeout_ms` passed (`EPS_ERR_TIMEOUT`; 0 waits without a limit). A
/// control plane or server that failed is reported (`EPS_ERR_CONTROL`).
#[unsafe(no_mangle)]
pub extern "C" fn eps_cluster_wait(c: *mut eps_cluster, timeout_ms: u32) -> eps_status {
    guard("eps_cluster_wait", || {
        let c = handle::get(c, Kind::Cluster)?;
        let started = Instant::now();
        while c.running.load(Ordering::Acquire) > 0 {
            if timeout_ms != 0 && started.elapsed() > Duration::from_millis(timeout_ms.into()) {
                return Err(fail(EPS_ERR_TIMEOUT, format!("the hosted job has not finished after {timeout_ms} ms")));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        match c.failure.lock().unwrap_or_else(|p| p.into_inner()).clone() {
            Some(e) => Err(fail(EPS_ERR_CONTROL, e)),
            None => Ok(()),
        }
    })
}

/// Stops the hosted control plane (servers then exit once they see it gone)
/// and releases the handle. Any later call with it returns
/// `EPS_ERR_INVALID_HANDLE`.
#[unsafe(no_mangle)]
pub extern "C" fn eps_cluster_close(c: *mut eps_cluster) -> eps_status {
    guard("eps_cluster_close", || {
        let c = handle::close(c, Kind::Cluster)?;
        c.stop.store(true, Ordering::Release);
        Ok(())
    })
}

/// How long `eps_scale` asks again while the worker change waits for another
/// (as `eps scale` does).
const SCALE_WAIT: Duration = Duration::from_secs(120);

/// Asks the control plane at `control` (NULL: `EPS_CONTROL`) to grow or
/// shrink a running BSP job, as `eps scale` does: `servers` and `workers`
/// are the wanted counts, negative to leave one as it is. Joining workers
/// take new ranks (up to `job.max_workers`) and start at the next iteration
/// boundary nobody has begun: create and join them after this call.
/// Counts past the bounds of every job (1024 servers, 64 worker ranks) are
/// refused (`EPS_ERR_INVALID_ARGUMENT`) before anything is asked. Blocks
/// while the worker change waits for a scale event under way (up to 120 s;
/// then `EPS_ERR_CONTROL`).
///
/// # Safety
/// `control` is NULL or a NUL-terminated string; `secret` is NULL (the
/// environment, as for workers) or one.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn eps_scale(control: *const c_char, secret: *const c_char, servers: c_int, workers: c_int) -> eps_status {
    guard("eps_scale", || {
        // SAFETY: the caller's contract.
        let addr = unsafe { crate::status::control_arg(control) }?;
        let secret = if secret.is_null() {
            eps_fabric::Secret::new(crate::worker::secret_from_env()?)
                .map_err(|e| fail(EPS_ERR_INVALID_ARGUMENT, e.to_string()))?
        } else {
            secret_arg(secret)?
        };
        if servers == 0 || workers == 0 {
            return Err(fail(EPS_ERR_INVALID_ARGUMENT, "a job needs at least one server and one worker (negative: unchanged)"));
        }
        // The bounds every job has, checked before anything is asked: a
        // refusal of one count must not leave the other half done.
        let (max_s, max_w) = (eps_proto::spec::MAX_SERVERS, eps_proto::spec::MAX_ELASTIC_WORKERS);
        if u32::try_from(servers).is_ok_and(|s| s > max_s) {
            return Err(fail(EPS_ERR_INVALID_ARGUMENT, format!("servers {servers}: a job has at most {max_s}")));
        }
        if u32::try_from(workers).is_ok_and(|w| w > max_w) {
            return Err(fail(EPS_ERR_INVALID_ARGUMENT, format!("workers {workers}: a job admits at most {max_w} worker ranks")));
        }
        let mut ctl =
            ControlClient::connect(addr, &secret, Duration::from_secs(10)).map_err(|e| fail(from_control(&e), chain(&e)))?;
        let failed = |e: eps_control::ControlError| fail(from_control(&e), chain(&e));
        if let Ok(servers) = u32::try_from(servers) {
            ctl.call(&ControlMsg::Scale { servers }).map_err(failed)?;
        }
        if let Ok(workers) = u32::try_from(workers) {
            // After a server change, the worker change waits for its moves.
            let deadline = Instant::now() + SCALE_WAIT;
            ctl.call_when_possible(&ControlMsg::ScaleWorkers { workers }, deadline).map_err(failed)?;
        }
        Ok(())
    })
}
