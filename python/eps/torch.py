"""PyTorch data-parallel training over EPS.

Wrap a model in one call and keep the training loop::

    import eps, eps.torch
    model = Net()
    dm = eps.torch.DistributedModel(model)          # joins the job of EPS_CONTROL
    opt = torch.optim.Adam(model.parameters())      # only when the job's
                                                    # optimizer is "none"
    for it, (x, y) in eps.torch.ElasticLoader(dm, (xs, ys), batch=32, steps=steps):
        loss = loss_fn(model(x), y)
        loss.backward()                             # pushes tensor by tensor
        dm.step()                                   # waits for the pulls
        if dm.gradient_average:
            opt.step()                              # p.grad is the average
    dm.finish()

The parameters and gradients of the model become views of EPS's registered
buffers (``p.data`` and ``p.grad``), so a step copies nothing. During the
backward pass each parameter's gradient is pushed as soon as autograd has
accumulated it (shards go out once all their tensors are in), overlapping
communication with the rest of the backward pass, as DDP's buckets do.

Two kinds of job:

- a server-side optimizer (``sgd``, ``adam``...): the servers hold the
  parameters; ``p.data`` is a view of the parameter buffer, which each pull
  refreshes. The first worker's model values are the job's first
  parameters (``model.init = "worker"``, the default when the model
  declares the tensors; ``"servers"`` keeps the servers' seeded
  initialiser, the same bits whatever the model holds). A worker joining
  mid-training starts from the current parameters.
- ``optimizer.kind = "none"``: the servers publish the averaged gradient;
  ``step()`` makes ``p.grad`` a view of it and the framework's optimizer
  steps. The parameters stay the model's own: start every worker from the
  same values (same seed). A worker cannot join such a job mid-training
  (the optimizer state lives in the workers).
"""

import numpy as np
import torch

import eps

_TORCH_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
_FROM_NAME = {v: k for k, v in _TORCH_DTYPES.items()}


def _view(buf, elements, dtype, shape):
    """A tensor over a ctypes buffer, no copy (it keeps the buffer alive)."""
    return torch.frombuffer(buf, dtype=dtype, count=elements).view(shape)


class DistributedModel:
    """``model``'s parameters as views of an EPS worker's buffers.

    ``worker`` is an :class:`eps.Worker` that has not joined (default: one
    for ``EPS_CONTROL``); the model's parameters that require gradients are
    declared, in ``named_parameters()`` order, and the worker joins.
    ``overlap`` pushes each gradient as autograd produces it (one backward per
    step); without it ``step()`` pushes them all.

    ``buffers="average"`` (the default) keeps the model's floating-point
    buffers (BatchNorm's running statistics and the like) the same on every
    worker, as DDP does: they are tensors of the job named ``buffer:NAME``,
    and each step sets them to the average of the workers' values (DDP copies
    rank 0's instead; with the same data everywhere the two agree, and
    averaging keeps what every worker saw). They become views of EPS's
    parameter buffer, like the parameters; a job's first step starts from
    each worker's own, a worker joining later takes the job's current ones.
    ``buffers=None`` leaves them to
    each worker. Buffers of another dtype than the parameters' (BatchNorm's
    integer batch count) stay each worker's own.
    """

    def __init__(self, model, worker=None, overlap=True, timeout_ms=0, buffers="average"):
        self.model = model
        self.worker = worker if worker is not None else eps.Worker(timeout_ms=timeout_ms)
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no parameters that require gradients")
        dtypes = {p.dtype for _, p in self.params}
        if len(dtypes) != 1 or next(iter(dtypes)) not in _TORCH_DTYPES:
            raise ValueError(f"EPS jobs have one element type (f32, bf16 or f16); the model has {sorted(map(str, dtypes))}")
        self.dtype = next(iter(dtypes))
        name = _TORCH_DTYPES[self.dtype]
        if buffers not in ("average", None):
            raise ValueError(f"buffers={buffers!r}: give \"average\" or None")
        # (module, attribute) of each buffer kept in step, by its full name.
        self.buffers = []
        if buffers == "average":
            for full, b in model.named_buffers():
                if b is not None and b.dtype == self.dtype and b.numel() > 0:
                    owner, _, leaf = full.rpartition(".")
                    self.buffers.append((full, model.get_submodule(owner) if owner else model, leaf, b))
        # The model's own values go along: rank 0's are the job's first
        # parameters when its servers take a worker's (``model.init``).
        values = [p.detach().reshape(-1) for _, p in self.params] + [b.detach().reshape(-1) for *_, b in self.buffers]
        flat = torch.cat(values).contiguous()
        raw = flat.view(torch.int16) if flat.element_size() == 2 else flat
        decl = [(n, p.numel(), name) for n, p in self.params]
        decl += [(f"buffer:{full}", b.numel(), name) for full, _, _, b in self.buffers]
        self.worker.join(decl, initial=raw.numpy())
        del flat, raw
        self.gradient_average = bool(self.worker.info.gradient_average)
        self._grad_views = []
        self._param_views = []
        for i, (n, p) in enumerate(self.params):
            t = self.worker.tensors[i]
            if t.name != n or t.elements != p.numel():
                raise eps.EpsError(6, f"tensor {i} of the job is {t.name!r} ({t.elements}), the model's is {n!r} ({p.numel()})")
            g = _view(self.worker.buffer("grads", i), t.elements, self.dtype, p.shape)
            pv = _view(self.worker.buffer("params", i), t.elements, self.dtype, p.shape)
            self._grad_views.append(g)
            self._param_views.append(pv)
            if not self.gradient_average:
                # The servers' parameters, pulled at join, in place of the
                # model's own: every worker trains the same values.
                p.data = pv
        # Buffers: views of the parameter buffer too (pulls write the
        # average there), their local values pushed from the gradient buffer.
        self._buffer_views = []
        for j, (full, owner, leaf, b) in enumerate(self.buffers):
            i = len(self.params) + j
            t = self.worker.tensors[i]
            if t.name != f"buffer:{full}" or t.elements != b.numel():
                raise eps.EpsError(6, f"tensor {i} of the job is {t.name!r} ({t.elements}), the model's is buffer:{full!r} ({b.numel()})")
            g = _view(self.worker.buffer("grads", i), t.elements, self.dtype, b.shape)
            pv = _view(self.worker.buffer("params", i), t.elements, self.dtype, b.shape)
            if self.worker.info.iteration == 0:
                # A job's first step starts from the model's own buffers
                # (BatchNorm's are the same everywhere); it averages them. A
                # worker joining later takes the job's current ones.
                pv.copy_(b)
            owner._buffers[leaf] = pv
            self._buffer_views.append((g, pv))
        # EPS's embedding modules in the model pull and push through this worker.
        for m in model.modules():
            if isinstance(m, _SparseModule):
                m.bind(self.worker)
        self._hooks = []
        self._pushed = set()
        self._requests = []
        if overlap:
            for i, (_, p) in enumerate(self.params):
                self._hooks.append(p.register_hook(self._once(i)))
                self._hooks.append(p.register_post_accumulate_grad_hook(self._hook(i)))
        self.zero_grad()

    @property
    def rank(self):
        return self.worker.rank

    def _install_grad(self, i):
        p, g = self.params[i][1], self._grad_views[i]
        if p.grad is None or p.grad.data_ptr() != g.data_ptr():
            p.grad = g

    def _hook(self, i):
        def push(p):
            g = self._grad_views[i]
            if p.grad is not None and p.grad.data_ptr() != g.data_ptr():
                # The loop replaced .grad (zero_grad(set_to_none=True)): copy.
                g.copy_(p.grad)
                p.grad = g
            self._pushed.add(i)
            self._requests.append(self.worker.push([i]))

        return push

    def _once(self, i):
        def check(grad):
            if i in self._pushed:
                # Refused before autograd accumulates it: the gradient's push
                # may still be reading the buffer.
                raise RuntimeError(
                    f"parameter {self.params[i][0]!r} got a second gradient in one step: with overlap=True each step "
                    "runs one backward (use DistributedModel(..., overlap=False) to accumulate over micro-batches)"
                )
            return grad

        return check

    def zero_grad(self):
        """Zeroes the gradient views (making them ``p.grad`` again)."""
        for i in range(len(self.params)):
            self._install_grad(i)
            self._grad_views[i].zero_()

    def begin(self, batch=0):
        """Begins the iteration: its :class:`eps.Iteration` (samples to train
        on), or None if this worker left the job. Clears the gradients: with
        ``overlap`` they are set to None (autograd makes each afresh and its
        hook copies it into EPS's buffer once, instead of the buffer being
        zeroed and added to), else the buffers are zeroed."""
        it = self.worker.begin(batch)
        if it is not None:
            if self._hooks:
                for _, p in self.params:
                    p.grad = None
            else:
                self.zero_grad()
        return it

    def step(self):
        """Pushes what the backward pass did not, and waits for the next
        parameters (server-side optimizer) or the averaged gradient, which
        becomes ``p.grad`` for the framework's optimizer."""
        # The buffers' values of this step (a forward updated them in place).
        for g, pv in self._buffer_views:
            g.copy_(pv)
        rest = [i for i in range(len(self.params) + len(self.buffers)) if i not in self._pushed]
        for i in (i for i in rest if i < len(self.params)):
            # A parameter without a gradient this step contributes zeros; one
            # whose gradient autograd made elsewhere is copied in.
            p, g = self.params[i][1], self._grad_views[i]
            if p.grad is None:
                g.zero_()
            elif p.grad.data_ptr() != g.data_ptr():
                g.copy_(p.grad)
            p.grad = g
        if rest:
            self._requests.append(self.worker.push(rest))
        self.worker.pull().wait()
        # The pushes completed with the pull; release their requests.
        for r in self._requests:
            r.test()
        self._requests.clear()
        self._pushed.clear()
        if self.gradient_average:
            for (_, p), avg in zip(self.params, self._param_views):
                p.grad = avg

    def finish(self):
        """Leaves the job: the model keeps its last parameters (copied out of
        EPS's memory), the worker finishes and closes."""
        for h in self._hooks:
            h.remove()
        for _, p in self.params:
            p.data = p.data.clone()
            p.grad = None
        for _, owner, leaf, _ in self.buffers:
            owner._buffers[leaf] = owner._buffers[leaf].clone()
        self.worker.finish()
        self.worker.close()


class _SparseModule(torch.nn.Module):
    """What EPS's embedding modules share: a sparse table of the job, rows
    pulled by key for each forward, their gradients pushed as sparse rows
    when the backward pass reaches them."""

    def __init__(self, table, worker=None):
        super().__init__()
        self.table_name = table
        self.worker = None
        if worker is not None:
            self.bind(worker)

    def bind(self, worker):
        """Uses ``worker`` (joined) for this module's pulls and pushes
        (:class:`DistributedModel` binds the modules of its model)."""
        self.worker = worker
        self.table = worker._table(self.table_name)
        self.dim = worker.table_dim(self.table)

    def _rows(self, ids):
        """The distinct rows of ``ids`` as a leaf tensor whose gradient is
        pushed, and each id's row index."""
        if self.worker is None:
            raise RuntimeError(f"the EPS table {self.table_name!r} has no worker: wrap the model in DistributedModel or bind one")
        keys = ids.detach().reshape(-1).cpu().numpy()
        rows, index = self.worker.sparse_pull_rows(self.table, keys)
        distinct = np.empty(len(rows), dtype=np.uint64)
        distinct[index] = keys
        weight = torch.from_numpy(rows.copy()).requires_grad_(self.training)
        if self.training:
            worker, table = self.worker, self.table

            def push(grad):
                worker.sparse_push(table, distinct, grad.detach().cpu().numpy())

            weight.register_hook(push)
        return weight, torch.from_numpy(index.astype(np.int64)).to(ids.device)


class EmbeddingBag(_SparseModule):
    """``torch.nn.EmbeddingBag`` over a sparse table of the EPS job: each
    forward pulls the rows of the ids it is given (each distinct id once,
    written by the servers into the worker's registered buffer), pools them
    (``mode`` ``"mean"`` or ``"sum"``), and the backward pass pushes one
    gradient row per distinct id: no dense gradient of the table is ever
    made. One forward per table and step (BSP pushes a table once per
    iteration). ``input`` and ``offsets`` are as ``torch.nn.EmbeddingBag``'s
    (1-D ids with bag offsets, or 2-D fixed-size bags)."""

    def __init__(self, table, mode="mean", worker=None):
        if mode not in ("mean", "sum"):
            raise ValueError(f"mode {mode!r}: EPS bags pool by mean or sum")
        super().__init__(table, worker)
        self.mode = mode

    def forward(self, input, offsets=None, per_sample_weights=None):
        weight, index = self._rows(input)
        return torch.nn.functional.embedding_bag(
            index.view(input.shape), weight, offsets, mode=self.mode, per_sample_weights=per_sample_weights
        )


class Embedding(_SparseModule):
    """``torch.nn.Embedding`` over a sparse table of the EPS job: the rows
    of ``input``'s ids (any shape), pulled for each forward; their gradient
    rows are pushed by the backward pass. One forward per table and step."""

    def forward(self, input):
        weight, index = self._rows(input)
        return torch.nn.functional.embedding(index.view(input.shape), weight)


class ElasticLoader:
    """Batches of in-memory tensors that follow the job's membership: each
    iteration (begun by ``dm.begin``) yields this worker's samples of it, so
    that as workers join and leave no sample of a data epoch is skipped or
    seen twice. Iterating stops at ``steps`` or when this worker left::

        for it, (x, y) in eps.torch.ElasticLoader(dm, (xs, ys), batch=32, steps=300):
            loss_fn(model(x), y).backward()
            dm.step()
    """

    def __init__(self, dm, tensors, batch, steps, seed=0, shuffle=True):
        n = {len(t) for t in tensors}
        if len(n) != 1:
            raise ValueError(f"the tensors have different lengths: {sorted(n)}")
        self.dm, self.tensors, self.batch, self.steps = dm, tensors, batch, steps
        self.sampler = ElasticSampler(n.pop(), seed=seed, shuffle=shuffle)

    def __iter__(self):
        while True:
            it = self.dm.begin(self.batch)
            if it is None or it.iteration >= self.steps:
                return
            idx = torch.from_numpy(self.sampler.indices(it))
            yield it, tuple(t[idx] for t in self.tensors)


class ElasticSampler:
    """Dataset indices for an iteration's samples.

    EPS deals each iteration's samples out to its contributors (``batch``
    each, in rank order) from one global stream, so within a data epoch no
    sample is skipped or seen twice while workers join and leave. Sample
    ``s`` of the stream is position ``s % n`` of data epoch ``s // n``, whose
    order is a permutation seeded by ``(seed, epoch)``.
    """

    def __init__(self, n, seed=0, shuffle=True):
        if n <= 0:
            raise ValueError("the dataset is empty")
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self._perms = {}

    def _perm(self, epoch):
        if not self.shuffle:
            return np.arange(self.n)
        if epoch not in self._perms:
            self._perms = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.n)}
        return self._perms[epoch]

    def indices(self, samples):
        """Dataset indices of a range of stream samples (``Iteration.samples``)."""
        if isinstance(samples, eps.Iteration):
            samples = samples.samples
        s = np.arange(samples.start, samples.stop)
        out = np.empty(len(s), dtype=np.int64)
        for epoch in np.unique(s // self.n):
            m = (s // self.n) == epoch
            out[m] = self._perm(int(epoch))[s[m] % self.n]
        return out


def initial_params(model, seed):
    """Sets ``model``'s parameters (that require gradients, in
    ``named_parameters()`` order) to the values EPS servers start a job with
    seed ``seed`` from, so a single-process run can start where EPS starts."""
    first = 0
    with torch.no_grad():
        for _, p in model.named_parameters():
            if not p.requires_grad:
                continue
            v = eps.initial_params(seed, first, p.numel())
            p.copy_(torch.from_numpy(v).view(p.shape).to(p.dtype))
            first += p.numel()
