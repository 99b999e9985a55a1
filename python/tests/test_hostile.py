"""Every entry point of the package with arguments a caller should not give:
each raises :class:`eps.EpsError` with the status and a message, never
another exception, a silently wrapped value or a crash of the interpreter
(ctypes would wrap a negative or too large integer and cut a string at a
NUL without a word)."""

import gc

import numpy as np
import pytest

import eps

SECRET = "python-hostile-secret"
SPEC = (
    "[job]\nworkers = 1\nservers = 1\nsteps = 100\nshard_bytes = 4096\n"
    "[model]\ndeclare = true\n[[model.tables]]\nname = \"emb\"\ndim = 2\noptimizer = \"sgd\"\nmax_keys = 8\n"
    "[optimizer]\nkind = \"none\"\n"
)


def refused(fn, *args, status="EPS_ERR_INVALID_ARGUMENT", **kw):
    with pytest.raises(eps.EpsError) as e:
        fn(*args, **kw)
    assert e.value.status == status, e.value
    assert str(e.value).startswith(status + ": ") and len(str(e.value)) > len(status) + 4
    return e.value


def test_every_entry_point_refuses_bad_arguments_with_eps_error():
    # Module functions.
    refused(eps.initial_params, -1, 0, 4)
    refused(eps.initial_params, 0, 2**64 - 2, 4)  # the indices would wrap (libeps)
    refused(eps.initial_params, 0, 0, -1)
    refused(eps.initial_params, 0, 0, 2**50)
    refused(eps.initial_params, "seed", 0, 4)
    assert eps.initial_params(7, 2**64 - 4, 4).shape == (4,)
    refused(eps.scale, "127.0.0.1:1", SECRET, 2**40, -1)
    refused(eps.scale, "127.0.0.1:1", "a\0b", 2, -1)
    refused(eps.Cluster, "[job]\nworkerz = 1\n", SECRET)
    refused(eps.Cluster, SPEC, "sec\0ret")
    refused(eps.Cluster, "[job]\n[model]\ntensors = [{ name = \"a\", elements = 9223372036854775807 },"
            " { name = \"b\", elements = 9223372036854775807 }, { name = \"c\", elements = 2 }]\n", SECRET)

    cl = eps.Cluster(SPEC, SECRET)
    refused(cl.wait, -1)
    refused(cl.wait, 2**32)
    refused(eps.scale, cl.address, SECRET, 5000, -1)
    refused(eps.scale, cl.address, SECRET, -1, 2**31)
    refused(eps.Worker, cl.address, SECRET, timeout_ms=-1)
    refused(eps.Worker, cl.address, SECRET, timeout_ms="soon")
    refused(eps.Worker, "127.0.0.1:1\0garbage", SECRET)
    w = eps.Worker(cl.address, SECRET, timeout_ms=5000)

    # Declarations.
    refused(w.join, "fc.weight")
    refused(w.join, [("w", 10)])
    refused(w.join, [("w", -5, "f32")])
    refused(w.join, [("w", 2**64, "f32")])
    refused(w.join, [("w", 10, "f64")])
    refused(w.join, [("w", 10, 3)])
    refused(w.join, [("w\0x", 10, "f32")])
    refused(w.join, [("a", 2**63, "f32"), ("b", 2**63, "f32")])  # the sum wraps (libeps)
    refused(w.push_pull, status="EPS_ERR_STATE")
    w.join([("w", 1000, "f32"), ("b", 10, "f32")])

    # Tensors, views, iterations.
    refused(w.params, -1)  # Python's indexing would pick the last tensor
    refused(w.params, 2, status="EPS_ERR_NOT_FOUND")
    refused(w.params, 2**40)
    refused(w.params, "w")
    refused(w.buffer, "weights")
    refused(w.index, "nope", status="EPS_ERR_NOT_FOUND")
    refused(w.index, "w\0")
    refused(w.begin, -1)
    refused(w.begin, 2**64)
    refused(w.begin, 1.5)
    refused(w.push, [99], status="EPS_ERR_NOT_FOUND")
    refused(w.push, [-1])
    refused(w.push, 7)
    refused(w.pull, [0], status="EPS_ERR_STATE")
    r = w.push([0])
    refused(r.wait, -1)
    refused(w.members, -1)
    refused(w.next_change, -5)

    # Sparse tables.
    refused(w.table, "nope", status="EPS_ERR_NOT_FOUND")
    refused(w.sparse_pull, -1, [1])
    refused(w.sparse_pull, 7, [1], status="EPS_ERR_NOT_FOUND")
    refused(w.sparse_pull, "emb", [-1])
    refused(w.sparse_pull, "emb", ["a"])
    refused(w.sparse_pull, "emb", list(range(9)))
    refused(w.sparse_push, "emb", [1], "zz")
    refused(w.sparse_push, "emb", [1], np.zeros(3, dtype=np.float32))

    # A correct round still works after all that.
    w.grads(1)[:] = np.arange(10, dtype=np.float32)
    w.push([1]).wait()
    w.pull().wait()
    assert np.array_equal(w.params(1), np.arange(10, dtype=np.float32))

    # After close: views taken before stay readable; new ones are refused.
    view = w.params(1)
    w.finish()
    w.close()
    refused(w.params, 0, status="EPS_ERR_INVALID_HANDLE")
    refused(w.push_pull, status="EPS_ERR_NULL_POINTER")
    gc.collect()
    assert np.array_equal(view, np.arange(10, dtype=np.float32))
    del view
    gc.collect()
    cl.wait(30000)
    cl.close()
