//! Creating a worker (its options) and joining the job: the tensors it
//! declares, or buffers the caller lends.

use super::*;

impl eps_worker_options {
    /// Every option at its default.
    fn defaults(struct_size: usize) -> Self {
        eps_worker_options {
            struct_size,
            secret: std::ptr::null(),
            transport: std::ptr::null(),
            timeout_ms: 0,
            rdma_device: std::ptr::null(),
            rdma_port: 0,
            gid_index: -1,
        }
    }
}

/// Sets every option to its default and `struct_size` to this header's size.
///
/// # Safety
/// `opts` is NULL or points to writable memory for an `eps_worker_options`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn eps_worker_options_init(opts: *mut eps_worker_options) -> eps_status {
    guard("eps_worker_options_init", || {
        // SAFETY: the caller's contract.
        unsafe { put(opts, eps_worker_options::defaults(size_of::<eps_worker_options>()), "opts") }
    })
}

/// What `eps_worker_create` takes from the options.
struct Options {
    secret: Option<String>,
    transport: Transport,
    timeout_ms: u32,
}

/// Reads the caller's options: only the first `struct_size` bytes (an older
/// header's smaller struct leaves the later fields at their defaults).
///
/// # Safety
/// `opts` is NULL or an initialized options struct of its `struct_size`.
unsafe fn read_options(opts: *const eps_worker_options) -> Res<Options> {
    let env_transport = std::env::var("EPS_TRANSPORT").ok().filter(|t| !t.is_empty());
    let mut out = Options {
        secret: None,
        transport: Transport { kind: env_transport.unwrap_or_else(|| "auto".into()), ..Transport::default() },
        timeout_ms: 0,
    };
    if opts.is_null() {
        return Ok(out);
    }
    // SAFETY: not NULL; the caller initialized it. Only `struct_size` is read
    // before it is checked.
    let size = unsafe { (*opts).struct_size };
    let full = size_of::<eps_worker_options>();
    if size < size_of::<usize>() || size > 1 << 16 {
        return Err(fail(EPS_ERR_VERSION, format!("opts.struct_size is {size}: call eps_worker_options_init first")));
    }
    let mut o = eps_worker_options::defaults(size);
    // SAFETY: the caller's struct has `min(size, full)` readable bytes.
    unsafe { std::ptr::copy_nonoverlapping(opts.cast::<u8>(), (&raw mut o).cast::<u8>(), size.min(full)) };
    // A field cut by `size` is not there at all: back to its default.
    let d = eps_worker_options::defaults(size);
    let cut = |offset: usize, len: usize| size < offset + len;
    let ptr = size_of::<*const c_char>();
    if cut(std::mem::offset_of!(eps_worker_options, secret), ptr) {
        o.secret = d.secret;
    }
    if cut(std::mem::offset_of!(eps_worker_options, transport), ptr) {
        o.transport = d.transport;
    }
    if cut(std::mem::offset_of!(eps_worker_options, timeout_ms), 4) {
        o.timeout_ms = d.timeout_ms;
    }
    if cut(std::mem::offset_of!(eps_worker_options, rdma_device), ptr) {
        o.rdma_device = d.rdma_device;
    }
    if cut(std::mem::offset_of!(eps_worker_options, rdma_port), 4) {
        o.rdma_port = d.rdma_port;
    }
    if cut(std::mem::offset_of!(eps_worker_options, gid_index), 4) {
        o.gid_index = d.gid_index;
    }
    if !o.secret.is_null() {
        // SAFETY: the caller's contract.
        out.secret = Some(unsafe { c_str(o.secret, "opts.secret") }?.to_string());
    }
    if !o.transport.is_null() {
        // SAFETY: the caller's contract.
        out.transport.kind = unsafe { c_str(o.transport, "opts.transport") }?.to_string();
    }
    if !["soft", "shm", "rdma", "auto"].contains(&out.transport.kind.as_str()) {
        return Err(fail(
            EPS_ERR_INVALID_ARGUMENT,
            format!("transport {:?}: use \"soft\", \"shm\", \"rdma\" or \"auto\"", out.transport.kind),
        ));
    }
    if out.transport.kind == "rdma" && !cfg!(feature = "rdma") {
        return Err(fail(
            EPS_ERR_UNSUPPORTED,
            "this libeps was built without the rdma transport (feature `rdma`): use \"soft\" or \"auto\"",
        ));
    }
    if !o.rdma_device.is_null() {
        // SAFETY: the caller's contract.
        out.transport.device = Some(unsafe { c_str(o.rdma_device, "opts.rdma_device") }?.to_string());
    }
    if o.rdma_port > 255 {
        return Err(fail(
            EPS_ERR_INVALID_ARGUMENT,
            format!("opts.rdma_port {} is not a port number (1-255, 0: any)", o.rdma_port),
        ));
    }
    out.transport.port = (o.rdma_port != 0).then_some(o.rdma_port as u8);
    out.transport.gid_index = u32::try_from(o.gid_index).ok();
    out.timeout_ms = o.timeout_ms;
    Ok(out)
}

/// Creates a worker of the job whose control plane is at `control`
/// (`"HOST:PORT"`; NULL: the `EPS_CONTROL` environment variable). Nothing is
/// contacted until `eps_worker_join`.
///
/// # Safety
/// `control` is NULL or a NUL-terminated string; `opts` is NULL (defaults) or
/// an initialized options struct; `out` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn eps_worker_create(
    control: *const c_char,
    opts: *const eps_worker_options,
    out: *mut *mut eps_worker,
) -> eps_status {
    guard("eps_worker_create", || {
        non_null(out, "out")?;
        // SAFETY: the caller's contract.
        let control = unsafe { crate::status::control_arg(control) }?;
        // SAFETY: the caller's contract.
        let o = unsafe { read_options(opts) }?;
        let secret = match o.secret {
            Some(s) => s,
            None => secret_from_env()?,
        };
        let secret = eps_fabric::Secret::new(secret).map_err(|e| fail(EPS_ERR_INVALID_ARGUMENT, e.to_string()))?;
        let timeout = Duration::from_millis(if o.timeout_ms == 0 { 120_000 } else { o.timeout_ms.into() });
        let cfg = WorkerConfig { control, secret, timeout };
        let h = Box::new(eps_worker { state: Mutex::new(State::Created(cfg, o.transport)), initial: Mutex::new(None) });
        // SAFETY: `out` is not NULL (checked) and writable by contract.
        unsafe { out.write(handle::give(Kind::Worker, h)) };
        Ok(())
    })
}

/// Joins the job: declares `tensors` (`count` of them; NULL and 0 when the
/// job's spec names its tensors), registers its buffers, connects to every
/// server and pulls the current parameters (a worker joining a running job
/// gets the parameters of the iteration it starts at). The first
/// declaration fixes a job's layout; a different one fails with
/// `EPS_ERR_MISMATCH`, naming the first difference in `eps_last_error`.
///
/// # Safety
/// `tensors` is NULL or points to `count` declarations whose names are
/// NUL-terminated strings.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn eps_worker_join(w: *mut eps_worker, tensors: *const eps_tensor_decl, count: usize) -> eps_status {
    // SAFETY: the caller's contract, passed on.
    guard("eps_worker_join", || unsafe { join(w, tensors, count, None) })
}

/// As `eps_worker_join`, with parameter and gradient buffers the caller owns
/// (a framework's memory), registered in place instead of the library's:
/// `params` and `grads` each hold `bytes` bytes, which must be the sum of
/// the tensors' elements times the element size (tensors lie end to end in
/// declaration order). The parameters pulled at join overwrite `params`.
///
/// # Safety
/// As `eps_worker_join`; and both buffers stay valid, and are not freed,
/// until `eps_worker_close` returned `EPS_OK` (it first waits until no pull
/// or push is in flight; servers write into `params` during a pull).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn eps_worker_join_borrowed(
    w: *mut eps_worker,
    tensors: *const eps_tensor_decl,
    count: usize,
    params: *mut c_void,
    grads: *mut c_void,
    bytes: usize,
) -> eps_status {
    guard("eps_worker_join_borrowed", || {
        non_null(params, "params")?;
        non_null(grads, "grads")?;
        if params == grads {
            return Err(fail(EPS_ERR_INVALID_ARGUMENT, "params and grads are the same buffer"));
        }
        // SAFETY: the caller's contract, passed on.
        unsafe { join(w, tensors, count, Some((params.cast(), grads.cast(), bytes))) }
    })
}

/// The body of both joins.
///
/// # Safety
/// As `eps_worker_join_borrowed` (for `borrowed`) and `eps_worker_join`.
unsafe fn join(
    w: *mut eps_worker,
    tensors: *const eps_tensor_decl,
    count: usize,
    borrowed: Option<(*mut u8, *mut u8, usize)>,
) -> Res {
    {
        let h = worker(w)?;
        let mut st = h.state.lock().unwrap_or_else(|p| p.into_inner());
        let (cfg, transport) = match &*st {
            State::Created(cfg, t) => (cfg.clone(), t.clone()),
            State::Joined(_) => return Err(fail(EPS_ERR_STATE, "the worker has joined already")),
            State::Finished(_) => return Err(fail(EPS_ERR_STATE, "the worker has finished")),
            State::Closed => return Err(fail(EPS_ERR_INVALID_HANDLE, "an eps_worker that was closed already")),
        };
        let decl = if tensors.is_null() {
            if count != 0 {
                return Err(fail(EPS_ERR_NULL_POINTER, format!("tensors is NULL with count {count}")));
            }
            None
        } else {
            let mut v = Vec::with_capacity(count.min(eps_proto::declare::MAX_TENSORS + 1));
            for i in 0..count {
                // Fields are read through raw pointers, never a reference: the
                // C caller may have put any value in the enum field.
                // SAFETY: `tensors` is not NULL and has `count` elements.
                let t = unsafe { tensors.add(i) };
                // SAFETY: in bounds (above); plain reads of C-layout fields.
                let (name, elements, code) = unsafe {
                    (
                        (&raw const (*t).name).read(),
                        (&raw const (*t).elements).read(),
                        (&raw const (*t).dtype).cast::<u32>().read(),
                    )
                };
                // SAFETY: the caller's contract.
                let name = unsafe { c_str(name, &format!("tensors[{i}].name")) }?.to_string();
                let dtype = u8::try_from(code)
                    .ok()
                    .and_then(DType::from_code)
                    .ok_or_else(|| fail(EPS_ERR_INVALID_ARGUMENT, format!("tensors[{i}].dtype is {code}, not an eps_dtype")))?;
                v.push(TensorDecl { name, elements, dtype });
                if v.len() > eps_proto::declare::MAX_TENSORS {
                    break;
                }
            }
            eps_proto::declare::validate(&v).map_err(|m| fail(EPS_ERR_INVALID_ARGUMENT, m))?;
            Some(v)
        };
        if let (Some((_, _, len)), Some(d)) = (borrowed, &decl) {
            // Checked before the worker takes a rank in the job.
            let want: u64 = d.iter().map(|t| t.elements.saturating_mul(t.dtype.size_bytes() as u64)).fold(0, u64::saturating_add);
            if len as u64 != want {
                return Err(fail(
                    EPS_ERR_INVALID_ARGUMENT,
                    format!(
                        "the buffers hold {len} bytes; the declared tensors take {want} (elements times element size, end to end)"
                    ),
                ));
            }
        }
        let initial = initial::take_checked(h, decl.as_deref())?;
        let mut reg = lib::register_declaring(&cfg, decl.as_deref())?;
        if let Some(v) = initial {
            reg = reg.with_initial(v)?;
        }
        // SAFETY: the caller's contract (see eps_worker_join_borrowed).
        let w = unsafe { AnyWorker::join(&transport, &cfg, reg, borrowed) }?;
        let names = w
            .layout()
            .tensors
            .iter()
            .map(|t| CString::new(t.name.clone()).map_err(|_| fail(EPS_ERR_INVALID_ARGUMENT, "a tensor name holds a NUL byte")))
            .collect::<Res<Vec<_>>>()?;
        *st = State::Joined(Box::new(Joined { w, borrowed: borrowed.is_some(), names, pending: HashMap::new(), next_id: 0 }));
        Ok(())
    }
}
