"""The Python package over libeps: the binding matches the header, NumPy and
torch tensors are views of registered memory, errors carry their status and
message, the elastic sampler deals samples out exactly once per epoch."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import eps
from eps import _lib

REPO = Path(__file__).resolve().parents[2]
SECRET = "python-test-secret"


def spec(workers=1, servers=1, optimizer="none", max_workers=None):
    extra = f"max_workers = {max_workers}\n" if max_workers else ""
    return (
        f"[job]\nworkers = {workers}\nservers = {servers}\nsteps = 100\nshard_bytes = 4096\n{extra}"
        f"[model]\ndeclare = true\n[optimizer]\nkind = \"{optimizer}\"\nlr = 0.1\n"
    )


def header_structs():
    """struct name -> field names, from include/eps.h."""
    text = (REPO / "include" / "eps.h").read_text()
    out = {}
    for name, body in re.findall(r"typedef struct (\w+) \{(.*?)\} \1;", text, re.S):
        body = re.sub(r"/\*\*.*?\*/", "", body, flags=re.S)
        out[name] = re.findall(r"(\w+);", body)
    return out


def test_the_binding_matches_the_header():
    structs = header_structs()
    pairs = {
        "eps_worker_options": _lib.WorkerOptions,
        "eps_tensor_decl": _lib.TensorDecl,
        "eps_worker_info": _lib.WorkerInfo,
        "eps_tensor_info": _lib.TensorInfo,
        "eps_iteration": _lib.Iteration,
        "eps_worker_stats": _lib.WorkerStats,
        "eps_request": _lib.Request,
    }
    for c, py in pairs.items():
        assert structs[c] == [f for f, _ in py._fields_], c
    text = (REPO / "include" / "eps.h").read_text()
    for name in _lib._SIGNATURES:
        assert re.search(rf"\b{name}\(", text), name
    major = int(re.search(r"#define EPS_VERSION_MAJOR (\d+)", text).group(1))
    minor = int(re.search(r"#define EPS_VERSION_MINOR (\d+)", text).group(1))
    patch = int(re.search(r"#define EPS_VERSION_PATCH (\d+)", text).group(1))
    assert _lib.EPS_VERSION == major * 10000 + minor * 100 + patch
    assert eps.version() == (major, minor, patch)
    statuses = re.findall(r"^\s*(EPS_(?:OK|ERR_\w+)) = (\d+),", text, re.M)
    assert [n for n, _ in statuses] == _lib.STATUS_NAMES


def test_numpy_views_are_the_registered_buffers_and_none_publishes_the_average(run_workers):
    cl = eps.Cluster(spec(workers=2), SECRET)
    out = {}

    def work(k):
        w = eps.Worker(cl.address, SECRET).join([("w", 3000, "f32"), ("b", 7, "f32")])
        t = w.tensors
        assert [x.name for x in t] == ["w", "b"] and t[1].offset == 3000
        p, g = w.params(0), w.grads(0)
        assert p.ctypes.data == w.info.params and g.ctypes.data == w.info.grads
        assert w.params(1).ctypes.data == w.info.params + 3000 * 4
        for step in range(3):
            it = w.begin(batch=4)
            assert it.contributors == 2
            w.grads()[:] = np.arange(3007, dtype=np.float32) + w.rank * 10 + step
            w.push_pull()
            out[(w.rank, step)] = w.params().copy()
        assert w.stats()["iteration"] == 3
        w.finish()
        assert w.params(1)[0] == out[(w.rank, 2)][3000]  # readable until close
        w.close()
        w.close()  # idempotent in Python

    run_workers(cl, work)
    for step in range(3):
        want = np.arange(3007, dtype=np.float32) + 5 + step  # mean of rank 0 and rank 1
        assert np.array_equal(out[(0, step)], want) and np.array_equal(out[(1, step)], want)


WRONG_ADDRESS = """
import eps, time
t = time.monotonic()
try:
    eps.Worker(timeout_ms=5000).join([("w", 10, "f32")])
except eps.EpsError as e:
    print(f"{time.monotonic() - t:.2f} {e}")
"""


def test_a_wrong_control_address_fails_within_the_timeout_naming_it():
    env = dict(os.environ, EPS_CONTROL="127.0.0.1:1", EPS_JOB_SECRET="x")
    t = time.monotonic()
    out = subprocess.run([sys.executable, "-c", WRONG_ADDRESS], env=env, capture_output=True, text=True, timeout=60)
    assert time.monotonic() - t < 20
    took, _, err = out.stdout.strip().partition(" ")
    assert float(took) < 8, out.stdout
    assert "EPS_ERR_CONTROL" in err and "127.0.0.1:1" in err, out.stdout
    # Said while it keeps trying, not only at the end.
    assert "cannot reach the control plane at 127.0.0.1:1" in out.stderr and "trying again for up to" in out.stderr, out.stderr


def test_errors_carry_status_and_message():
    cl = eps.Cluster(spec(), SECRET)
    w = eps.Worker(cl.address, SECRET)
    with pytest.raises(eps.EpsError, match="EPS_ERR_STATE.*not joined"):
        w.push_pull()
    w.join([("w", 10, "f32")])
    other = eps.Worker(cl.address, SECRET)
    with pytest.raises(eps.EpsError, match=r'EPS_ERR_MISMATCH.*\("w"\) has 10 elements in the job but 11'):
        other.join([("w", 11, "f32")])
    with pytest.raises(ValueError, match="dtype"):
        other.join([("w", 10, "f64")])
    # Initial values are checked against the tensors before a rank is taken.
    bad = np.zeros(10, np.float32)
    bad[7] = np.nan
    with pytest.raises(eps.EpsError, match=r'EPS_ERR_INVALID_ARGUMENT.*initial value 7 of tensor "w" is NaN'):
        other.join([("w", 10, "f32")], initial=bad)
    with pytest.raises(eps.EpsError, match="EPS_ERR_INVALID_ARGUMENT.*hold 36 bytes; the tensors take 40"):
        other.join([("w", 10, "f32")], initial=np.zeros(9, np.float32))
    with pytest.raises(eps.EpsError, match="EPS_ERR_NOT_FOUND"):
        w.index("nope")
    with pytest.raises(eps.EpsError, match="EPS_ERR_STATE"):
        w.pull([0])
    with pytest.raises(eps.EpsError, match="EPS_ERR_INVALID_ARGUMENT"):
        eps.Worker("not-an-address", SECRET)
    with pytest.raises(eps.EpsError, match="EPS_ERR_CONTROL.*last worker"):
        w.leave()
    w.push_pull()
    w.finish()
    w.close()
    other.close()
    cl.wait(30000)
    cl.close()


def test_requests_overlap_pushes_per_tensor():
    cl = eps.Cluster(spec(optimizer="sgd"), SECRET)
    w = eps.Worker(cl.address, SECRET).join([("a", 5000, "f32"), ("b", 5000, "f32")])
    before = w.params().copy()
    w.grads()[:] = 1.0
    r1 = w.push([1])
    r2 = w.push_pull_start([0])
    rest = w.pull()
    rest.wait()
    r1.wait()
    r2.wait()
    assert r2.test()
    # SGD with lr 0.1 on a gradient of ones, averaged over one worker.
    assert np.allclose(w.params(), before - 0.1)
    w.finish()
    w.close()
    cl.wait(30000)
    cl.close()


def test_elastic_sampler_deals_each_sample_once_per_epoch():
    from eps.torch import ElasticSampler

    n = 103
    s = ElasticSampler(n, seed=3)
    seen, first = [], 0
    for t in range(40):
        k = 4 * (2 + t % 3)  # contributors change between iterations
        seen.extend(s.indices(range(first, first + k)))
        first += k
    for e in range(len(seen) // n):
        assert sorted(seen[e * n : (e + 1) * n]) == list(range(n))
    assert not np.array_equal(s.indices(range(0, n)), s.indices(range(n, 2 * n)))
