"""Sparse tables from Python: pulls and pushes by key through libeps, the
torch EmbeddingBag over them (its pushed rows are torch's own gradient,
averaged and stepped by the servers), what is refused, and the
click-through example reaching its teacher's AUC."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import eps
import eps.torch as et

REPO = Path(__file__).resolve().parents[2]
SECRET = "sparse-test-secret"


def spec(workers=2, lr=0.5):
    return (
        f"[job]\nworkers = {workers}\nservers = 2\nsteps = 3\n[model]\ndeclare = true\n"
        f'[[model.tables]]\nname = "t"\ndim = 4\noptimizer = "sgd"\nlr = {lr}\nkey_limit = 1000\nmax_keys = 64\n'
        '[optimizer]\nkind = "sgd"\nlr = 0.1\n'
    )


def test_embedding_bag_pushes_torchs_gradient_and_the_servers_average_and_step(run_workers):
    cl = eps.Cluster(spec(), SECRET)
    got = {}

    def work(_k):
        torch.manual_seed(0)
        bag = et.EmbeddingBag("t", mode="mean")
        m = torch.nn.ModuleDict({"bag": bag, "out": torch.nn.Linear(4, 1)})
        dm = et.DistributedModel(m, eps.Worker(cl.address, SECRET))
        r = dm.rank
        ids = torch.tensor([3, 7, 3, 900 + r, 7, 7])
        offsets = torch.tensor([0, 2, 3])
        dm.begin()
        before = dm.worker.sparse_pull("t", [3, 7, 900, 901])
        # The reference: torch's own EmbeddingBag over the same rows.
        w = torch.from_numpy(before.copy()).requires_grad_(True)
        local = {3: 0, 7: 1, 900: 2, 901: 3}
        ref = torch.nn.functional.embedding_bag(torch.tensor([local[int(i)] for i in ids]), w, offsets, mode="mean")
        out = bag(ids, offsets)
        assert torch.equal(out, ref)
        scale = torch.tensor([[1.0], [-2.0], [0.5 + r]])
        (out * scale).sum().backward()
        (ref * scale).sum().backward()
        dm.step()
        after = dm.worker.sparse_pull("t", [3, 7, 900, 901])
        got[r] = (before, w.grad.numpy().copy(), after)
        dm.finish()

    run_workers(cl, work)
    before, g0, after = got[0]
    _, g1, after1 = got[1]
    assert np.array_equal(after, after1), "both workers pull the same rows"
    avg = (g0 + g1) * np.float32(0.5)
    assert np.allclose(after, before - np.float32(0.5) * avg, rtol=1e-6, atol=1e-7)
    assert not np.array_equal(after[2], before[2]) and not np.array_equal(after[3], before[3])


def test_pulls_pushes_and_what_is_refused(run_workers):
    cl = eps.Cluster(spec(workers=1), SECRET)

    def work(_k):
        w = eps.Worker(cl.address, SECRET).join([("d", 8, "f32")])
        t = w.table("t")
        assert w.table_dim("t") == 4 and w.table_dim(t) == 4
        view, index = w.sparse_pull_rows(t, [5, 9, 5])
        assert view.shape == (2, 4) and list(index) == [0, 1, 0] and not view.flags.writeable
        rows = view.copy()
        copy = w.sparse_pull(t, [9, 5])
        assert np.array_equal(copy, rows[[1, 0]])
        assert np.array_equal(view, copy), "the view is the row buffer: valid until the next pull"
        with pytest.raises(eps.EpsError, match="NOT_FOUND"):
            w.table("nope")
        with pytest.raises(ValueError, match="negative"):
            w.sparse_pull(t, [-1])
        with pytest.raises(eps.EpsError, match="key_limit 1000"):
            w.sparse_pull(t, [1000])
        with pytest.raises(eps.EpsError, match="INVALID_ARGUMENT"):
            w.sparse_push(t, [5, 9], np.ones((2, 3), np.float32))
        with pytest.raises(eps.EpsError, match="max_keys is 64"):
            w.sparse_pull(t, np.arange(65))
        w.sparse_push(t, [5], np.ones((1, 4), np.float32))
        with pytest.raises(eps.EpsError, match="pushed twice"):
            w.sparse_push(t, [9], np.ones((1, 4), np.float32))
        w.sparse_flush(t)
        w.push_pull()
        after = w.sparse_pull(t, [5, 9])
        assert np.allclose(after[0], copy[1] - 0.5) and np.array_equal(after[1], copy[0]), "only key 5 was stepped"
        for _ in range(2):
            w.push_pull()
        w.finish()
        w.close()

    run_workers(cl, work, n=1)


def test_the_ctr_example_reaches_its_teachers_auc():
    cmd = [sys.executable, str(REPO / "examples" / "torch" / "train_ctr.py"), "--workers", "2", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(r)
    assert r["teacher_auc"] > 0.75 and r["teacher_auc"] - r["final_auc"] < 0.01
