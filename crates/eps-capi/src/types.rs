//! The plain-data types of the worker calls: options, declarations, layout
//! and iteration information, statistics, request values.

use std::ffi::{c_char, c_int, c_void};

use eps_agg::DType;

use crate::worker::eps_worker;

/// Element types.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum eps_dtype {
    /// IEEE binary32.
    EPS_DTYPE_F32 = 0,
    /// bfloat16.
    EPS_DTYPE_BF16 = 1,
    /// IEEE binary16.
    EPS_DTYPE_F16 = 2,
}

impl eps_dtype {
    pub(crate) fn from_dtype(d: DType) -> Self {
        match d {
            DType::F32 => Self::EPS_DTYPE_F32,
            DType::Bf16 => Self::EPS_DTYPE_BF16,
            DType::F16 => Self::EPS_DTYPE_F16,
        }
    }
}

/// Options of `eps_worker_create`. Initialize with `eps_worker_options_init`,
/// then set what differs: the library reads only the first `struct_size`
/// bytes, so a program built against an older header (a smaller struct)
/// keeps working, the fields it lacks taking their defaults.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct eps_worker_options {
    /// `sizeof(eps_worker_options)` as the caller knows it (set by init).
    pub struct_size: usize,
    /// The job secret; NULL: `EPS_JOB_SECRET`, else the file named by
    /// `EPS_JOB_SECRET_FILE` (as `eps up` prints it). Copied by create.
    pub secret: *const c_char,
    /// `"soft"` (verbs semantics over TCP), `"shm"` (shared memory with servers
    /// on this host, run as this user, which must be on shm too), `"rdma"` (an
    /// RDMA device; a library built without the `rdma` feature refuses it with
    /// `EPS_ERR_UNSUPPORTED`) or `"auto"` (rdma when a device is usable, else
    /// shm to servers on this host and soft to the others, per connection).
    /// NULL: `EPS_TRANSPORT`, else auto. `eps_worker_info` says which.
    pub transport: *const c_char,
    /// Milliseconds to wait for the control plane, the servers and each
    /// transfer (0: 120000).
    pub timeout_ms: u32,
    /// The RDMA device (`"mlx5_0"`, `"rxe0"`); NULL: `EPS_RDMA_DEVICE`, else
    /// the first device with an active port.
    pub rdma_device: *const c_char,
    /// Its port, from 1; 0: `EPS_RDMA_PORT`, else its first active port.
    pub rdma_port: u32,
    /// The GID index; -1: `EPS_RDMA_GID_INDEX`, else the first RoCE v2 GID
    /// with an IPv4 address.
    pub gid_index: i32,
}

/// A tensor as a worker declares it at join.
#[repr(C)]
#[derive(Debug)]
pub struct eps_tensor_decl {
    /// Its name, NUL-terminated UTF-8, unique in the model (copied by join).
    pub name: *const c_char,
    /// Number of elements (at least 1).
    pub elements: u64,
    /// Element type (every tensor of a job has the same).
    pub dtype: eps_dtype,
}

/// The worker as a whole, after join.
#[repr(C)]
#[derive(Debug)]
pub struct eps_worker_info {
    /// This worker's rank in the job.
    pub rank: u32,
    /// Tensors in the job's layout (indices `0..tensor_count`).
    pub tensor_count: u32,
    /// The job's element type.
    pub dtype: eps_dtype,
    /// Elements of the flat parameter space (all tensors, with alignment).
    pub elements: u64,
    /// Bytes of each of the two buffers.
    pub bytes: u64,
    /// The flat parameter buffer (registered memory the servers write into).
    pub params: *mut c_void,
    /// The flat gradient buffer (registered memory pushes read from).
    pub grads: *mut c_void,
    /// The iteration the next push belongs to.
    pub iteration: u64,
    /// `job.steps` of the job's spec.
    pub steps: u64,
    /// `job.batch` of the job's spec (samples per worker per iteration).
    pub batch: u32,
    /// 1 when the job's servers publish the averaged gradient instead of
    /// parameters (`optimizer.kind = "none"`: the framework's optimizer
    /// steps); 0 when they run the optimizer.
    pub gradient_average: c_int,
    /// `job.seed`: the servers' initial parameters are
    /// `eps_initial_params(seed, ...)`.
    pub seed: u64,
    /// The transport this worker runs on: `"soft"`, `"shm"`, `"soft+shm"` (auto:
    /// shm to servers on this host, soft to the others) or `"rdma"` (static).
    pub transport: *const c_char,
}

/// One tensor of the job's layout.
#[repr(C)]
#[derive(Debug)]
pub struct eps_tensor_info {
    /// Its name (owned by the worker handle; valid until it is closed).
    pub name: *const c_char,
    /// Number of elements.
    pub elements: u64,
    /// First element in the flat buffers.
    pub offset: u64,
    /// Element type.
    pub dtype: eps_dtype,
    /// Its parameters inside the parameter buffer.
    pub params: *mut c_void,
    /// Its gradient inside the gradient buffer.
    pub grads: *mut c_void,
}

/// What `eps_worker_begin` tells of the current iteration.
#[repr(C)]
#[derive(Debug)]
pub struct eps_iteration {
    /// The iteration.
    pub iteration: u64,
    /// 1 if this worker contributes to it; 0 if it left the job at this
    /// boundary (it then calls `eps_worker_finish`).
    pub contributes: c_int,
    /// Its position among the iteration's contributors (in rank order).
    pub contributor_index: u32,
    /// How many workers contribute to the iteration (the gradient average's
    /// divisor).
    pub contributors: u32,
    /// First sample of its data partition: the iteration's samples are dealt
    /// out in rank order, `batch` per contributor, so no sample of a data
    /// epoch is skipped or seen twice while workers join and leave.
    pub sample_begin: u64,
    /// One past its last sample.
    pub sample_end: u64,
}

/// Transfer statistics.
#[repr(C)]
#[derive(Debug)]
pub struct eps_worker_stats {
    /// Gradient bytes pushed.
    pub pushed_bytes: u64,
    /// Parameter bytes pulled.
    pub pulled_bytes: u64,
    /// Nanoseconds from each iteration's first push to its last pull.
    pub comm_ns: u64,
    /// The iteration the next push belongs to.
    pub iteration: u64,
}

/// A non-blocking push or pull in flight, completed by `eps_request_test` or
/// `eps_request_wait`. A plain value: copy it freely; it is released by the
/// call that reports it complete (testing it again is `EPS_ERR_INVALID_ARGUMENT`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct eps_request {
    /// The worker it belongs to.
    pub worker: *mut eps_worker,
    /// Its number within that worker (0 is never used).
    pub id: u64,
}
