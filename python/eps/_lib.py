"""ctypes declarations of include/eps.h, and the loading of libeps.

This is the package's one binding: every call goes through libeps's C ABI.
The structures mirror the header field by field (a test checks them against
include/eps.h).
"""

import ctypes
import os
from ctypes import (
    POINTER,
    Structure,
    c_char_p,
    c_float,
    c_int,
    c_size_t,
    c_uint32,
    c_uint64,
    c_void_p,
)

EPS_OK = 0
STATUS_NAMES = [
    "EPS_OK",
    "EPS_ERR_INVALID_ARGUMENT",
    "EPS_ERR_NULL_POINTER",
    "EPS_ERR_INVALID_HANDLE",
    "EPS_ERR_STATE",
    "EPS_ERR_NOT_FOUND",
    "EPS_ERR_MISMATCH",
    "EPS_ERR_TIMEOUT",
    "EPS_ERR_CONTROL",
    "EPS_ERR_FABRIC",
    "EPS_ERR_LEFT",
    "EPS_ERR_UNSUPPORTED",
    "EPS_ERR_VERSION",
    "EPS_ERR_INTERNAL",
]

DTYPES = {"f32": 0, "bf16": 1, "f16": 2}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
DTYPE_BYTES = {0: 4, 1: 2, 2: 2}

# The header this binding was written against: EPS_VERSION of include/eps.h.
EPS_VERSION = 200


class WorkerOptions(Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("secret", c_char_p),
        ("transport", c_char_p),
        ("timeout_ms", c_uint32),
        ("rdma_device", c_char_p),
        ("rdma_port", c_uint32),
        ("gid_index", ctypes.c_int32),
    ]


class TensorDecl(Structure):
    _fields_ = [("name", c_char_p), ("elements", c_uint64), ("dtype", c_int)]


class WorkerInfo(Structure):
    _fields_ = [
        ("rank", c_uint32),
        ("tensor_count", c_uint32),
        ("dtype", c_int),
        ("elements", c_uint64),
        ("bytes", c_uint64),
        ("params", c_void_p),
        ("grads", c_void_p),
        ("iteration", c_uint64),
        ("steps", c_uint64),
        ("batch", c_uint32),
        ("gradient_average", c_int),
        ("seed", c_uint64),
        ("transport", c_char_p),
    ]


class TensorInfo(Structure):
    _fields_ = [
        ("name", c_char_p),
        ("elements", c_uint64),
        ("offset", c_uint64),
        ("dtype", c_int),
        ("params", c_void_p),
        ("grads", c_void_p),
    ]


class Iteration(Structure):
    _fields_ = [
        ("iteration", c_uint64),
        ("contributes", c_int),
        ("contributor_index", c_uint32),
        ("contributors", c_uint32),
        ("sample_begin", c_uint64),
        ("sample_end", c_uint64),
    ]


class WorkerStats(Structure):
    _fields_ = [
        ("pushed_bytes", c_uint64),
        ("pulled_bytes", c_uint64),
        ("comm_ns", c_uint64),
        ("iteration", c_uint64),
    ]


class Request(Structure):
    _fields_ = [("worker", c_void_p), ("id", c_uint64)]


# name -> (argument types)
_SIGNATURES = {
    "eps_version": [],
    "eps_check_version": [c_uint32],
    "eps_last_error": [],
    "eps_status_string": [c_uint32],
    "eps_worker_options_init": [POINTER(WorkerOptions)],
    "eps_worker_create": [c_char_p, POINTER(WorkerOptions), POINTER(c_void_p)],
    "eps_worker_join": [c_void_p, POINTER(TensorDecl), c_size_t],
    "eps_worker_set_initial": [c_void_p, c_void_p, c_size_t],
    "eps_worker_get_info": [c_void_p, POINTER(WorkerInfo)],
    "eps_worker_get_tensor": [c_void_p, c_uint32, POINTER(TensorInfo)],
    "eps_worker_find_tensor": [c_void_p, c_char_p, POINTER(c_uint32)],
    "eps_worker_begin": [c_void_p, c_uint64, POINTER(Iteration)],
    "eps_worker_push_start": [c_void_p, POINTER(c_uint32), c_size_t, POINTER(Request)],
    "eps_worker_pull_start": [c_void_p, POINTER(c_uint32), c_size_t, POINTER(Request)],
    "eps_worker_push_pull_start": [c_void_p, POINTER(c_uint32), c_size_t, POINTER(Request)],
    "eps_worker_push_pull": [c_void_p],
    "eps_request_test": [POINTER(Request), POINTER(c_int)],
    "eps_request_wait": [POINTER(Request), c_uint32],
    "eps_worker_members": [c_void_p, c_uint64, POINTER(c_uint32), c_size_t, POINTER(c_size_t)],
    "eps_worker_next_change": [c_void_p, c_uint64, POINTER(c_uint64)],
    "eps_worker_get_stats": [c_void_p, POINTER(WorkerStats)],
    "eps_worker_leave": [c_void_p],
    "eps_worker_finish": [c_void_p],
    "eps_worker_close": [c_void_p],
    "eps_cluster_start": [c_char_p, c_char_p, c_char_p, POINTER(c_void_p)],
    "eps_cluster_get_address": [c_void_p, ctypes.c_char_p, c_size_t],
    "eps_cluster_wait": [c_void_p, c_uint32],
    "eps_cluster_close": [c_void_p],
    "eps_scale": [c_char_p, c_char_p, c_int, c_int],
    "eps_initial_params": [c_uint64, c_uint64, POINTER(c_float), c_size_t],
    "eps_table_find": [c_void_p, c_char_p, POINTER(c_uint32)],
    "eps_table_dim": [c_void_p, c_uint32, POINTER(c_uint32)],
    "eps_sparse_pull": [c_void_p, c_uint32, POINTER(c_uint64), c_size_t, POINTER(c_float), c_size_t],
    "eps_sparse_pull_rows": [
        c_void_p,
        c_uint32,
        POINTER(c_uint64),
        c_size_t,
        POINTER(c_uint32),
        POINTER(POINTER(c_float)),
        POINTER(c_size_t),
    ],
    "eps_sparse_push": [c_void_p, c_uint32, POINTER(c_uint64), c_size_t, POINTER(c_float), c_size_t],
    "eps_sparse_flush": [c_void_p, c_uint32],
}

_RESTYPES = {
    "eps_version": c_uint32,
    "eps_last_error": c_char_p,
    "eps_status_string": c_char_p,
}


def library_path():
    """Where libeps is: $EPS_LIBRARY, else the copy installed in this package."""
    env = os.environ.get("EPS_LIBRARY")
    if env:
        return env
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "libeps.so")
    if os.path.exists(here):
        return here
    raise ImportError(
        "libeps.so is not installed with this package and EPS_LIBRARY is not set: "
        "install with `pip install ./python` from the EPS repository, or point "
        "EPS_LIBRARY at a libeps.so built by `cargo build --release -p eps-capi`"
    )


def load():
    lib = ctypes.CDLL(library_path())
    for name, args in _SIGNATURES.items():
        f = getattr(lib, name)
        f.argtypes = args
        f.restype = _RESTYPES.get(name, c_int)
    if lib.eps_check_version(EPS_VERSION) != EPS_OK:
        raise ImportError("libeps: " + lib.eps_last_error().decode())
    return lib


lib = load()
