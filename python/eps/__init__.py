"""EPS, the elastic parameter server, from Python.

A thin layer over libeps (the C ABI): a :class:`Worker` joins a job started by
``eps up`` (or hosted in this process by :class:`Cluster`), declares its
tensors, and trains on NumPy views of EPS's registered buffers -- no copy per
step. ``eps.torch`` builds PyTorch data-parallel training on it.

    import eps
    w = eps.Worker()                         # EPS_CONTROL, EPS_JOB_SECRET(_FILE)
    w.join([("w", 1000, "f32"), ("b", 10, "f32")])
    p, g = w.params(0), w.grads(0)           # numpy views of tensor "w"
    while True:
        it = w.begin()
        if it is None or it.iteration >= w.info.steps:
            break
        g[:] = ...                           # the gradient, from p
        w.push_pull()
    w.finish(); w.close()
"""

import ctypes
import operator
import weakref
from dataclasses import dataclass

import numpy as np

from ._lib import (
    DTYPE_BYTES,
    DTYPE_NAMES,
    DTYPES,
    EPS_OK,
    STATUS_NAMES,
    Iteration as _Iteration,
    Request as _Request,
    TensorDecl as _TensorDecl,
    TensorInfo as _TensorInfo,
    WorkerInfo as _WorkerInfo,
    WorkerOptions as _WorkerOptions,
    WorkerStats as _WorkerStats,
    lib as _c,
)

__all__ = ["Cluster", "EpsArgumentError", "EpsError", "Iteration", "Request", "Worker", "initial_params", "scale", "version"]


class EpsError(RuntimeError):
    """A libeps call failed: ``status`` is the status name, the message says
    which call, what and why."""

    def __init__(self, status, message):
        self.status = STATUS_NAMES[status] if 0 <= status < len(STATUS_NAMES) else str(status)
        super().__init__(f"{self.status}: {message}")


_INVALID = STATUS_NAMES.index("EPS_ERR_INVALID_ARGUMENT")
_NOT_FOUND = STATUS_NAMES.index("EPS_ERR_NOT_FOUND")
_INVALID_HANDLE = STATUS_NAMES.index("EPS_ERR_INVALID_HANDLE")


def _check(status):
    if status != EPS_OK:
        raise EpsError(status, _c.eps_last_error().decode(errors="replace"))


class EpsArgumentError(EpsError, ValueError):
    """An argument refused before it reached libeps (``EPS_ERR_INVALID_ARGUMENT``):
    an :class:`EpsError`, and a ``ValueError`` as Python code expects."""


def _bad(what, why):
    return EpsArgumentError(_INVALID, f"{what}: {why}")


def _enc(s, what="a string argument"):
    if s is None:
        return None
    b = str(s).encode()
    if b"\0" in b:
        # C would see the text up to the NUL only: another value than given.
        raise _bad(what, "contains a NUL character")
    return b


def _uint(what, value, bits):
    """``value`` as an unsigned integer of ``bits`` bits, or :class:`EpsError`
    (ctypes would wrap a negative or too large one silently)."""
    try:
        v = operator.index(value)
    except TypeError:
        raise _bad(what, f"{value!r} is not an integer") from None
    if not 0 <= v < 1 << bits:
        raise _bad(what, f"{v} is not between 0 and 2^{bits} - 1")
    return v


def _cint(what, value):
    """``value`` as a C int (32 bits, signed), or :class:`EpsError`."""
    try:
        v = operator.index(value)
    except TypeError:
        raise _bad(what, f"{value!r} is not an integer") from None
    if not -(1 << 31) <= v < 1 << 31:
        raise _bad(what, f"{v} does not fit a C int")
    return v


def version():
    """libeps's version as (major, minor, patch)."""
    v = _c.eps_version()
    return (v // 10000, v // 100 % 100, v % 100)


@dataclass(frozen=True)
class Iteration:
    """What :meth:`Worker.begin` tells of the current iteration."""

    iteration: int
    #: This worker's position among the iteration's contributors.
    index: int
    #: How many workers contribute (the gradient average's divisor).
    contributors: int
    #: Its samples of the global sample stream (``batch`` per contributor,
    #: dealt out in rank order: none skipped or seen twice as workers change).
    samples: range


@dataclass(frozen=True)
class TensorInfo:
    name: str
    elements: int
    offset: int
    dtype: str


class Request:
    """A push or pull in flight; complete it with :meth:`wait` or :meth:`test`."""

    def __init__(self, worker, raw):
        self._worker = worker
        self._raw = raw
        self.done = False

    def test(self):
        """True once complete (without waiting)."""
        if self.done:
            return True
        d = ctypes.c_int(0)
        _check(_c.eps_request_test(ctypes.byref(self._raw), ctypes.byref(d)))
        self.done = bool(d.value)
        return self.done

    def wait(self, timeout_ms=0):
        """Waits until complete (``timeout_ms`` 0: the worker's timeout)."""
        if not self.done:
            _check(_c.eps_request_wait(ctypes.byref(self._raw), _uint("timeout_ms", timeout_ms, 32)))
            self.done = True


def _ids(ids):
    if ids is None:
        return None, 0
    try:
        ids = [_uint("tensor id", i, 32) for i in ids]
    except TypeError:
        raise _bad("ids", f"{ids!r} is not a list of tensor ids") from None
    return (ctypes.c_uint32 * len(ids))(*ids), len(ids)


class Worker:
    """A worker of an EPS job.

    ``control`` is the control plane's ``HOST:PORT`` (default: ``EPS_CONTROL``),
    ``secret`` the job secret (default: ``EPS_JOB_SECRET``, else the file
    named by ``EPS_JOB_SECRET_FILE``, as ``eps up`` prints them),
    ``transport`` ``"soft"``, ``"shm"`` (servers on this host, on shm), ``"rdma"`` or ``"auto"`` (default:
    ``EPS_TRANSPORT``, else auto; ``info.transport`` says which). Not
    thread-safe beyond what libeps guarantees: calls are serialized.
    """

    def __init__(self, control=None, secret=None, timeout_ms=0, transport=None, rdma_device=None):
        opts = _WorkerOptions()
        _check(_c.eps_worker_options_init(ctypes.byref(opts)))
        # Kept alive for the call.
        self._strings = (_enc(secret, "secret"), _enc(transport, "transport"), _enc(rdma_device, "rdma_device"))
        opts.secret, opts.transport, opts.rdma_device = self._strings
        opts.timeout_ms = _uint("timeout_ms", timeout_ms, 32)
        h = ctypes.c_void_p()
        _check(_c.eps_worker_create(_enc(control, "control"), ctypes.byref(opts), ctypes.byref(h)))
        self._h = h
        self._info = None
        self._tensors = []
        # Weak references to the ctypes arrays over the worker's registered
        # memory (every view holds one): the memory outlives them all.
        self._views = []

    # -- joining ---------------------------------------------------------

    def join(self, tensors=None, initial=None):
        """Joins the job, declaring ``tensors`` (``(name, elements, dtype)``
        tuples, dtype ``"f32"``, ``"bf16"`` or ``"f16"``; None when the job's
        spec names its tensors). Pulls the current parameters.

        ``initial``: the model's own values (any buffer of the tensors' bytes
        end to end, e.g. a NumPy array of the job's dtype). If this worker
        becomes rank 0 of a job whose servers start from a worker's values
        (``model.init = "worker"``, the default when a framework declares the
        tensors), they are the job's first parameters; else the first pull
        replaces them."""
        if initial is not None:
            try:
                view = memoryview(initial).cast("B")
            except TypeError:
                raise _bad("initial", "give a contiguous buffer (bytes, a NumPy array...)") from None
            buf = (ctypes.c_char * len(view)).from_buffer_copy(view)
            _check(_c.eps_worker_set_initial(self._h, buf, len(view)))
        if tensors is None:
            _check(_c.eps_worker_join(self._h, None, 0))
        else:
            try:
                tensors = [tuple(t) for t in tensors]
            except TypeError:
                raise _bad("tensors", "give (name, elements, dtype) tuples") from None
            arr = (_TensorDecl * len(tensors))()
            names = []
            for i, t in enumerate(tensors):
                if len(t) != 3:
                    raise _bad(f"tensor {i}", f"{t!r} is not (name, elements, dtype)")
                name, elements, dtype = t
                if not isinstance(dtype, str) or dtype not in DTYPES:
                    raise _bad(f"tensor {name!r}", f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
                names.append(_enc(name, f"tensor {i}'s name"))
                arr[i] = _TensorDecl(names[-1], _uint(f"tensor {name!r}'s elements", elements, 64), DTYPES[dtype])
            _check(_c.eps_worker_join(self._h, arr, len(tensors)))
        info = _WorkerInfo()
        _check(_c.eps_worker_get_info(self._h, ctypes.byref(info)))
        self._info = info
        self._tensors = []
        for i in range(info.tensor_count):
            t = _TensorInfo()
            _check(_c.eps_worker_get_tensor(self._h, i, ctypes.byref(t)))
            self._tensors.append((TensorInfo(t.name.decode(), t.elements, t.offset, DTYPE_NAMES[t.dtype]), t.params, t.grads))
        return self

    @property
    def info(self):
        """The worker's rank, layout size, steps and batch of the spec, and
        whether servers publish averaged gradients (``gradient_average``)."""
        if self._info is None:
            raise EpsError(4, "the worker has not joined (call join first)")
        return self._info

    @property
    def rank(self):
        return self.info.rank

    @property
    def tensors(self):
        """The job's tensors, in layout order."""
        return [t for t, _, _ in self._tensors]

    def index(self, name):
        """The index of the tensor named ``name``."""
        i = ctypes.c_uint32()
        _check(_c.eps_worker_find_tensor(self._h, _enc(name, "name"), ctypes.byref(i)))
        return i.value

    # -- zero-copy views ---------------------------------------------------

    def _where(self, which, index):
        """(address, elements, dtype) of a buffer, whole or of tensor ``index``."""
        if self._h is None:
            raise EpsError(_INVALID_HANDLE, "the worker is closed: its buffers are gone")
        if which not in ("params", "grads"):
            raise _bad("which", f"{which!r}: say \"params\" or \"grads\"")
        if index is None:
            return getattr(self.info, which), self.info.elements, DTYPE_NAMES[self.info.dtype]
        i = _uint("tensor index", index, 32)
        if i >= len(self._tensors):
            # (A negative or past-the-end index must not pick another tensor.)
            raise EpsError(_NOT_FOUND, f"tensor index {i}: the job has {len(self._tensors)} tensors")
        t, p, g = self._tensors[i]
        return (p if which == "params" else g), t.elements, t.dtype

    def buffer(self, which, index=None):
        """A ctypes byte array over a registered buffer (``"params"`` or
        ``"grads"``), whole or of tensor ``index``: the memory behind views."""
        ptr, n, dtype = self._where(which, index)
        buf = (ctypes.c_uint8 * (n * DTYPE_BYTES[DTYPES[dtype]])).from_address(ptr)
        buf._eps_owner = self  # a view over it keeps the worker (and its memory) alive
        self._track(buf)
        return buf

    def _track(self, buf):
        self._views = [r for r in self._views if r() is not None]
        self._views.append(weakref.ref(buf))

    def _view(self, which, index):
        _, n, dtype = self._where(which, index)
        np_dtype = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}[dtype]
        return np.frombuffer(self.buffer(which, index), dtype=np_dtype, count=n)

    def params(self, index=None):
        """A NumPy view of the parameters (all, or of tensor ``index``); bf16
        as raw uint16. Written by the servers during a pull: read it between
        pulls."""
        return self._view("params", index)

    def grads(self, index=None):
        """A NumPy view of the gradient buffer (all, or of tensor ``index``).
        Leave a pushed tensor's gradient alone until its push completed."""
        return self._view("grads", index)

    # -- iterations ----------------------------------------------------------

    def begin(self, batch=0):
        """Begins the current iteration: None if this worker left the job at
        this boundary (then :meth:`finish`), else its :class:`Iteration`."""
        it = _Iteration()
        _check(_c.eps_worker_begin(self._h, _uint("batch", batch, 64), ctypes.byref(it)))
        if not it.contributes:
            return None
        return Iteration(it.iteration, it.contributor_index, it.contributors, range(it.sample_begin, it.sample_end))

    def _start(self, fn, ids):
        arr, n = _ids(ids)
        r = _Request()
        _check(fn(self._h, arr, n, ctypes.byref(r)))
        return Request(self, r)

    def push(self, ids=None):
        """Pushes the gradients of tensors ``ids`` (None: all not pushed yet in
        this iteration) without waiting."""
        return self._start(_c.eps_worker_push_start, ids)

    def pull(self, ids=None):
        """Asks for the next parameters of tensors ``ids`` (pushed already)."""
        return self._start(_c.eps_worker_pull_start, ids)

    def push_pull_start(self, ids=None):
        return self._start(_c.eps_worker_push_pull_start, ids)

    def push_pull(self):
        """Pushes every tensor and waits for the next parameters."""
        _check(_c.eps_worker_push_pull(self._h))

    # -- sparse tables -------------------------------------------------------

    def table(self, name):
        """The index of the sparse table named ``name`` (the ``table`` the
        sparse calls take; they take the name too)."""
        t = ctypes.c_uint32()
        _check(_c.eps_table_find(self._h, _enc(name, "name"), ctypes.byref(t)))
        return t.value

    def _table(self, table):
        return self.table(table) if isinstance(table, str) else _uint("table", table, 32)

    def table_dim(self, table):
        """Values per row of sparse table ``table``."""
        d = ctypes.c_uint32()
        _check(_c.eps_table_dim(self._h, self._table(table), ctypes.byref(d)))
        return d.value

    @staticmethod
    def _keys(keys):
        try:
            k = np.asarray(keys)
        except (TypeError, ValueError) as e:
            raise _bad("keys", str(e)) from None
        if k.dtype.kind == "i" and k.size and k.min() < 0:
            raise _bad("keys", "sparse table keys must not be negative")
        if k.dtype.kind not in "iu":
            raise _bad("keys", f"sparse table keys must be integers, not {k.dtype}")
        k = np.ascontiguousarray(k.reshape(-1), dtype=np.uint64)
        return k, k.ctypes.data_as(ctypes.POINTER(ctypes.c_uint64))

    def sparse_pull(self, table, keys):
        """The rows of ``keys`` (a key may repeat) as of the current
        iteration: a new float32 array of shape ``(len(keys), dim)``."""
        t = self._table(table)
        k, kp = self._keys(keys)
        out = np.empty((len(k), self.table_dim(t)), dtype=np.float32)
        fp = out.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        _check(_c.eps_sparse_pull(self._h, t, kp, len(k), fp, out.size))
        return out

    def sparse_pull_rows(self, table, keys):
        """The rows of ``keys`` without a copy here: ``(rows, index)``,
        ``rows`` a read-only float32 view ``(distinct keys, dim)`` of the
        worker's row buffer (the rows copied out of the registered memory
        the servers wrote them into), ``index[i]`` the row of ``keys[i]``.
        The view is valid until the table's next pull."""
        t = self._table(table)
        k, kp = self._keys(keys)
        dim = self.table_dim(t)
        index = np.empty(len(k), dtype=np.uint32)
        ip = index.ctypes.data_as(ctypes.POINTER(ctypes.c_uint32))
        rows, n = ctypes.POINTER(ctypes.c_float)(), ctypes.c_size_t()
        _check(_c.eps_sparse_pull_rows(self._h, t, kp, len(k), ip, ctypes.byref(rows), ctypes.byref(n)))
        if n.value == 0:
            return np.empty((0, dim), dtype=np.float32), index
        buf = (ctypes.c_float * (n.value * dim)).from_address(ctypes.addressof(rows.contents))
        buf._eps_owner = self  # the view keeps the worker (and its memory) alive
        self._track(buf)
        view = np.frombuffer(buf, dtype=np.float32).reshape(n.value, dim)
        view.flags.writeable = False
        return view, index

    def sparse_push(self, table, keys, grads):
        """Pushes this iteration's gradient rows of ``keys`` (``grads`` of
        shape ``(len(keys), dim)``; a repeated key's rows are summed). Once
        per table and iteration, before :meth:`push_pull` returns."""
        t = self._table(table)
        k, kp = self._keys(keys)
        try:
            g = np.ascontiguousarray(grads, dtype=np.float32)
        except (TypeError, ValueError) as e:
            raise _bad("grads", str(e)) from None
        gp = g.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        _check(_c.eps_sparse_push(self._h, t, kp, len(k), gp, g.size))

    def sparse_flush(self, table):
        """Waits until the servers applied this worker's last push of ``table``."""
        _check(_c.eps_sparse_flush(self._h, self._table(table)))

    # -- membership and statistics -----------------------------------------

    def members(self, iteration):
        """The ranks contributing to ``iteration``, as far as this worker knows."""
        cap = 64
        while True:
            arr = (ctypes.c_uint32 * cap)()
            n = ctypes.c_size_t()
            _check(_c.eps_worker_members(self._h, _uint("iteration", iteration, 64), arr, cap, ctypes.byref(n)))
            if n.value <= cap:
                return list(arr[: n.value])
            cap = n.value

    def next_change(self, after):
        """The first iteration after ``after`` where the contributors change, or None."""
        at = ctypes.c_uint64()
        status = _c.eps_worker_next_change(self._h, _uint("after", after, 64), ctypes.byref(at))
        if status == 5:  # EPS_ERR_NOT_FOUND
            return None
        _check(status)
        return at.value

    def stats(self):
        s = _WorkerStats()
        _check(_c.eps_worker_get_stats(self._h, ctypes.byref(s)))
        return {"pushed_bytes": s.pushed_bytes, "pulled_bytes": s.pulled_bytes, "comm_s": s.comm_ns / 1e9, "iteration": s.iteration}

    def leave(self):
        """Asks to leave the running job: keep training until :meth:`begin`
        returns None, then :meth:`finish`."""
        _check(_c.eps_worker_leave(self._h))

    def finish(self):
        """Tells the job this worker is done; views stay readable until close."""
        _check(_c.eps_worker_finish(self._h))

    def close(self):
        """Releases the worker (idempotent here). Views of its buffers stay
        readable: the registered memory is released once the last is gone."""
        if self._h is None:
            return
        h, self._h = self._h, None
        alive = [b for b in (r() for r in self._views) if b is not None]
        self._views = []
        if not alive:
            _check(_c.eps_worker_close(h))
            return
        left = [len(alive)]

        def gone():
            left[0] -= 1
            if left[0] == 0:
                _c.eps_worker_close(h)

        for b in alive:
            weakref.finalize(b, gone)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Cluster:
    """A job hosted in this process: a control plane and ``job.servers``
    servers on threads (soft transport, CPU), for tests and embedding."""

    def __init__(self, spec_toml, secret, listen="127.0.0.1:0"):
        h = ctypes.c_void_p()
        _check(_c.eps_cluster_start(_enc(spec_toml, "spec_toml"), _enc(listen, "listen"), _enc(secret, "secret"), ctypes.byref(h)))
        self._h = h
        buf = ctypes.create_string_buffer(64)
        _check(_c.eps_cluster_get_address(h, buf, 64))
        self.address = buf.value.decode()

    def wait(self, timeout_ms=0):
        _check(_c.eps_cluster_wait(self._h, _uint("timeout_ms", timeout_ms, 32)))

    def close(self):
        if self._h is not None:
            _check(_c.eps_cluster_close(self._h))
            self._h = None


def scale(control=None, secret=None, servers=-1, workers=-1):
    """Grows or shrinks a running BSP job, as ``eps scale`` does (-1: unchanged)."""
    _check(_c.eps_scale(_enc(control, "control"), _enc(secret, "secret"), _cint("servers", servers), _cint("workers", workers)))


def initial_params(seed, first, count):
    """The servers' initial values of elements ``first..first+count`` for a
    job with seed ``seed`` (float32 array)."""
    seed, first = _uint("seed", seed, 64), _uint("first", first, 64)
    count = _uint("count", count, 64)
    if count > 1 << 40:
        raise _bad("count", f"{count}: a job has at most 2^40 elements")
    try:
        out = np.empty(count, dtype=np.float32)
    except MemoryError:
        raise _bad("count", f"{count} floats do not fit in memory") from None
    _check(_c.eps_initial_params(seed, first, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), count))
    return out
