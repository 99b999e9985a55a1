"""eps.torch: a model's parameters and gradients are views of EPS's buffers,
a step equals the same math done by hand, the digits example trains as well
through EPS as in one process (server-side Adam, the framework's Adam, and a
worker joining mid-training), the first worker's model values are the job's,
and workers may come long after `eps up`."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import eps
import eps.torch as et

REPO = Path(__file__).resolve().parents[2]
SECRET = "torch-test-secret"


def spec(optimizer, workers=2):
    return (
        f"[job]\nworkers = {workers}\nservers = 2\nsteps = 10\nshard_bytes = 4096\n"
        f'[model]\ndeclare = true\n[optimizer]\nkind = "{optimizer}"\nlr = 0.5\n'
    )


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(30, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3))


def test_parameters_and_gradients_are_views_and_a_step_is_the_servers_sgd(run_workers):
    cl = eps.Cluster(spec("sgd"), SECRET)
    results = {}

    def work(_k):
        m = net()
        dm = et.DistributedModel(m, eps.Worker(cl.address, SECRET))
        for (name, p), i in zip(m.named_parameters(), range(4)):
            buf_p = dm.worker.buffer("params", i)
            buf_g = dm.worker.buffer("grads", i)
            import ctypes

            assert p.data.data_ptr() == ctypes.addressof(buf_p), name
            assert p.grad.data_ptr() == ctypes.addressof(buf_g), name
        x = torch.randn(8, 30, generator=torch.Generator().manual_seed(dm.rank))
        it = dm.begin()
        before = [p.detach().clone() for p in m.parameters()]
        torch.nn.functional.mse_loss(m(x), torch.zeros(8, 3)).backward()
        mine = [p.grad.clone() for p in m.parameters()]
        dm.step()
        results[dm.rank] = (before, mine, [p.detach().clone() for p in m.parameters()], it.contributors)
        dm.finish()
        assert all(p.grad is None for p in m.parameters())

    run_workers(cl, work)
    b0, g0, a0, n = results[0]
    _, g1, a1, _ = results[1]
    assert n == 2
    for before, x, y, after0, after1 in zip(b0, g0, g1, a0, a1):
        want = before - 0.5 * ((x + y) * 0.5)
        assert torch.allclose(after0, want, atol=1e-6) and torch.equal(after0, after1)


def test_optimizer_none_gives_the_framework_the_averaged_gradient(run_workers):
    cl = eps.Cluster(spec("none"), SECRET)
    grads = {}

    def work(_k):
        m = net()
        dm = et.DistributedModel(m, eps.Worker(cl.address, SECRET))
        assert dm.gradient_average
        x = torch.randn(8, 30, generator=torch.Generator().manual_seed(dm.rank))
        dm.begin()
        torch.nn.functional.mse_loss(m(x), torch.zeros(8, 3)).backward()
        mine = [p.grad.clone() for p in m.parameters()]
        dm.step()
        grads[dm.rank] = (mine, [p.grad.clone() for p in m.parameters()])
        dm.finish()

    run_workers(cl, work)
    for x, y, avg in zip(grads[0][0], grads[1][0], grads[0][1]):
        assert torch.allclose(avg, (x + y) * 0.5, atol=1e-7)


def eps_bin():
    b = os.environ.get("EPS_BIN") or str(REPO / "target" / "release" / "eps")
    if not Path(b).exists():
        pytest.fail(f"no eps binary at {b}: set EPS_BIN or build with cargo build --release")
    return b


def digits(*args):
    cmd = [sys.executable, str(REPO / "examples" / "torch" / "train_digits.py"), "--json", "--eps", eps_bin(), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "args",
    [
        ["--optimizer", "server-adam"],
        ["--optimizer", "torch-adam"],
        ["--optimizer", "server-adam", "--join-at", "100"],
    ],
    ids=["server-adam", "torch-adam", "join-at-100"],
)
def test_digits_through_eps_match_one_process(args):
    local = digits("--workers", "2", "--local", *args)
    dist = digits("--workers", "2", *args)
    print(f"{args}: local {local}, eps {dist}")
    assert dist["steps"] == local["steps"] == 300
    assert dist["workers"] == local["workers"] == (3 if "--join-at" in args else 2)
    assert local["final_accuracy"] > 0.9
    assert abs(dist["final_accuracy"] - local["final_accuracy"]) <= 0.01


def test_the_abi_bench_runs_and_reports_its_fields():
    cmd = [sys.executable, "-m", "eps.bench", "--size", "4MB", "--rounds", "2", "--iters", "3", "--json", "--eps", eps_bin()]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd="/")
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["size_bytes"] == 4_000_000 and len(r["rust_rounds_ms"]) == len(r["python_rounds_ms"]) == 2
    assert r["rust_iter_ms_p50"] > 0 and r["python_iter_ms_p50"] > 0 and r["ratio"] > 0


def test_the_elastic_loader_follows_membership_and_a_second_backward_is_refused(run_workers):
    cl = eps.Cluster(spec("sgd"), SECRET)
    seen = {}

    def work(_k):
        m = net()
        dm = et.DistributedModel(m, eps.Worker(cl.address, SECRET))
        xs = torch.arange(50, dtype=torch.float32).repeat(30, 1).T.contiguous()  # sample i is all i
        ys = torch.zeros(50, 3)
        rows = []
        for it, (x, y) in et.ElasticLoader(dm, (xs, ys), batch=5, steps=4, shuffle=False):
            assert x.shape == (5, 30) and it.contributors == 2
            rows += [int(v) for v in x[:, 0]]
            loss = torch.nn.functional.mse_loss(m(x / 50), y)
            loss.backward(retain_graph=True)
            if it.iteration == 3 and dm.rank == 0:
                before = [p.grad.clone() for p in m.parameters()]
                with pytest.raises(RuntimeError, match="second gradient in one step"):
                    loss.backward()
                # Refused before anything was accumulated into the buffers.
                assert all(torch.equal(b, p.grad) for b, p in zip(before, m.parameters()))
            dm.step()
        seen[dm.rank] = rows
        dm.finish()

    run_workers(cl, work)
    # 4 iterations x 2 workers x 5 samples: the first 40 of the stream, once each.
    assert sorted(seen[0] + seen[1]) == list(range(40))
    assert seen[0][:5] == [0, 1, 2, 3, 4] and seen[1][:5] == [5, 6, 7, 8, 9]


def layer_norm_net(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(30, 40), torch.nn.LayerNorm(40), torch.nn.Linear(40, 3))


@pytest.mark.parametrize("init", ["worker", "servers"])
def test_the_first_workers_model_values_seed_the_servers(run_workers, init):
    # Workers with different seeds: rank 0's values are the job's (DDP
    # broadcasts rank 0's); "servers" keeps the servers' initialiser.
    text = spec("sgd")
    if init == "servers":
        text = text.replace("declare = true\n", 'declare = true\ninit = "servers"\n')
    cl = eps.Cluster(text, SECRET)
    got = {}

    def work(k):
        m = layer_norm_net(seed=10 + k)
        own = [p.detach().clone() for p in m.parameters()]
        dm = et.DistributedModel(m, eps.Worker(cl.address, SECRET))
        got[dm.rank] = (own, [p.detach().clone() for p in m.parameters()])
        dm.begin()
        torch.nn.functional.mse_loss(m(torch.randn(4, 30)), torch.zeros(4, 3)).backward()
        dm.step()
        dm.finish()

    run_workers(cl, work)
    (own0, first0), (own1, first1) = got[0], got[1]
    assert all(torch.equal(a, b) for a, b in zip(first0, first1)), "every worker starts from the same values"
    ln_weight = first0[2]
    if init == "worker":
        assert all(torch.equal(a, b) for a, b in zip(first0, own0)), "rank 0's first pull is its own values"
        assert not torch.equal(first1[0], own1[0])
        assert torch.equal(ln_weight, torch.ones(40)), "LayerNorm starts at 1, as torch made it"
    else:
        assert ln_weight.abs().max() <= 0.01, "the servers' initialiser: uniform in +-0.01"


LATE_WORKER = """
import sys, torch, eps, eps.torch as et
torch.manual_seed(int(sys.argv[1]))
m = torch.nn.Sequential(torch.nn.Linear(30, 40), torch.nn.LayerNorm(40), torch.nn.Linear(40, 3))
dm = et.DistributedModel(m)
for it in range(3):
    dm.begin()
    torch.nn.functional.mse_loss(m(torch.randn(8, 30)), torch.zeros(8, 3)).backward()
    dm.step()
dm.finish()
print(float(sum(p.double().sum() for p in m.parameters())))
"""


def test_workers_that_come_15_s_after_eps_up_train_and_everything_ends_quietly():
    up = subprocess.Popen(
        [eps_bin(), "up", "--workers", "2", "--servers", "1", "--optimizer", "sgd", "--lr", "0.1", "--steps", "3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        env = dict(os.environ)
        for line in (up.stdout.readline(), up.stdout.readline()):
            k, v = line.strip().split("=", 1)
            env[k] = v
        assert "EPS_CONTROL" in env and "EPS_JOB_SECRET_FILE" in env
        env.pop("EPS_JOB_SECRET", None)
        time.sleep(15)  # past the 10 s lease a rank used to get before it registered
        ws = [
            subprocess.Popen([sys.executable, "-c", LATE_WORKER, str(k)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for k in range(2)
        ]
        outs = [w.communicate(timeout=300) for w in ws]
        for w, (out, err) in zip(ws, outs):
            assert w.returncode == 0, err[-3000:]
            assert "dropped the connection" not in err and "reconnect" not in err, err[-3000:]
        sums = [float(out.strip().splitlines()[-1]) for out, _ in outs]
        assert sums[0] == sums[1], f"the workers end with the same parameters: {sums}"
        _, err = up.communicate(timeout=60)
        assert up.returncode == 0, err[-3000:]
        assert "the job has finished" in err, err[-3000:]
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


@pytest.mark.parametrize("optimizer,workers", [("sgd", 3), ("none", 2)])
def test_batchnorm_buffers_end_the_same_on_every_worker(run_workers, optimizer, workers):
    cl = eps.Cluster(spec(optimizer, workers), SECRET)
    got = {}

    def work(k):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(30, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 3))
        # A float buffer every worker holds alike stays exactly what it is.
        m.register_buffer("scale", torch.full((5,), 0.1))
        dm = et.DistributedModel(m, eps.Worker(cl.address, SECRET))
        opt = torch.optim.SGD(m.parameters(), lr=0.1) if dm.gradient_average else None
        gen = torch.Generator().manual_seed(100 + dm.rank)
        local = []
        for _ in range(3):
            dm.begin()
            x = torch.randn(8, 30, generator=gen) * (1 + 3 * dm.rank)  # different statistics per worker
            torch.nn.functional.mse_loss(m(x), torch.zeros(8, 3)).backward()
            local.append(m[1].running_var.clone())  # this worker's own, after its forward
            dm.step()
            if opt:
                opt.step()
        got[dm.rank] = (local, m[1].running_mean.clone(), m[1].running_var.clone(), int(m[1].num_batches_tracked))
        assert torch.equal(m.scale, torch.full((5,), 0.1))
        dm.finish()
        assert torch.equal(m[1].running_var, got[dm.rank][2]), "the model keeps its buffers after finish"

    run_workers(cl, work, workers)
    (l0, mean0, var0, n0), (l1, mean1, var1, n1) = got[0], got[1]
    assert all(torch.equal(got[r][1], mean0) and torch.equal(got[r][2], var0) for r in got), "identical on every worker"
    own = [got[r][0][-1] for r in range(workers)]
    assert torch.allclose(var0, sum(own) / workers, atol=1e-6), "the average of the workers' own"
    assert not torch.allclose(l0[-1], l1[-1]), "the workers' own statistics differed"
    assert n0 == n1 == 3


def test_the_ddp_side_by_side_runs_and_reports_its_fields():
    cmd = [sys.executable, "-m", "eps.bench", "--ddp", "--rounds", "1", "--steps", "2", "--json", "--eps", eps_bin()]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd="/")
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(r["step_ms"]) == {"ddp", "eps", "alone"} and r["ratio"] > 0
    assert r["max_abs_diff"] < 1e-5, "EPS trains what DDP trains"
    assert "backward" in r["rounds"]["eps"][0]["phases_ms"] and r["rounds"]["eps"][0]["cpu_ms"]["machine"] > 0
    assert "phase (ms, rank 0, median)" in out.stdout
