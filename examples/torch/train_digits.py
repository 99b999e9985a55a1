#!/usr/bin/env python3
"""An MLP on scikit-learn's bundled handwritten digits, data-parallel over EPS.

    python examples/torch/train_digits.py --workers 2              # eps up + 2 workers
    python examples/torch/train_digits.py --workers 2 --local      # the same, one process
    python examples/torch/train_digits.py --workers 2 --join-at 100
    python examples/torch/train_digits.py --optimizer torch-adam

Without --local it starts `eps up` (found with --eps, $EPS_BIN, on PATH, or
in the repository's target/release) and N copies of itself as workers
(--worker), which join through libeps (`import eps`) and train with
eps.torch.DistributedModel. --join-at STEP grows the job by one worker once
rank 0 has done STEP steps. --local trains the same model, from the same
initial values, on the same samples (each step's batch is what all workers
together take) with the same hyper-parameters in plain PyTorch.

--optimizer server-adam: the servers run Adam (the parameters live there);
torch-adam: the servers average gradients (optimizer "none") and each worker
steps torch.optim.Adam. --json ends with one line: final_accuracy, steps,
workers.
"""

import argparse
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_digits

SEED = 1  # the EPS job's seed (its servers' initial parameters)


def data():
    """Train and test splits of the digits (fixed, no download)."""
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(x))
    x = torch.tensor(x[order] / 16.0, dtype=torch.float32)
    y = torch.tensor(y[order], dtype=torch.int64)
    n = int(len(x) * 0.8)
    return x[:n], y[:n], x[n:], y[n:]


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def accuracy(m, x, y):
    with torch.no_grad():
        return float((m(x).argmax(1) == y).float().mean())


def contributors_at(a, t):
    return a.workers + (1 if a.join_at is not None and t >= a.join_at else 0)


def run_local(a):
    import eps.torch as et

    xtr, ytr, xte, yte = data()
    m = model()
    if a.optimizer == "server-adam":
        et.initial_params(m, SEED)  # where the EPS servers start
    opt = torch.optim.Adam(m.parameters(), lr=a.lr)
    sampler = et.ElasticSampler(len(xtr), seed=0)
    first = 0
    for t in range(a.steps):
        n = a.batch * contributors_at(a, t)
        idx = sampler.indices(range(first, first + n))
        first += n
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(m(xtr[idx]), ytr[idx])
        loss.backward()
        opt.step()
    return {"final_accuracy": accuracy(m, xte, yte), "steps": a.steps, "workers": contributors_at(a, a.steps - 1)}


def run_worker(a):
    import eps
    import eps.torch as et

    xtr, ytr, xte, yte = data()
    m = model()  # the same initial values on every worker (seeded)
    dm = et.DistributedModel(m, eps.Worker(timeout_ms=120000))
    opt = torch.optim.Adam(m.parameters(), lr=a.lr) if dm.gradient_average else None
    sampler = et.ElasticSampler(len(xtr), seed=0)
    most = 0
    while True:
        it = dm.begin(a.batch)
        if it is None or it.iteration >= a.steps:
            break
        most = max(most, it.contributors)
        idx = sampler.indices(it)
        loss = torch.nn.functional.cross_entropy(m(xtr[idx]), ytr[idx])
        loss.backward()  # pushes each gradient as autograd produces it
        dm.step()
        if opt is not None:
            opt.step()  # p.grad is the average of every worker's gradient
        if dm.rank == 0:
            print(f"step {it.iteration + 1} loss {float(loss):.4f}", flush=True)
    acc = accuracy(m, xte, yte)
    rank = dm.rank
    dm.finish()
    if rank == 0:
        print(json.dumps({"final_accuracy": acc, "steps": a.steps, "workers": most}), flush=True)


def find_eps(a):
    for c in [a.eps, os.environ.get("EPS_BIN"), shutil.which("eps")]:
        if c:
            return c
    repo = Path(__file__).resolve().parents[2] / "target" / "release" / "eps"
    if repo.exists():
        return str(repo)
    sys.exit("train_digits: no eps binary: pass --eps, set EPS_BIN, or `cargo build --release`")


def run_cluster(a):
    """eps up, then the workers (and the joiner), as processes."""
    import eps

    kind = "adam" if a.optimizer == "server-adam" else "none"
    cmd = [find_eps(a), "up", "--workers", str(a.workers), "--servers", str(a.servers), "--steps", str(a.steps)]
    cmd += ["--optimizer", kind, "--lr", str(a.lr), "--transport", "soft", "--aggregator", "cpu"]
    if a.join_at is not None:
        cmd += ["--max-workers", str(a.workers + 1)]
    env = {k: v for k, v in os.environ.items() if k != "EPS_JOB_SECRET"}
    up = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env, text=True)
    try:
        for _ in range(2):
            k, v = up.stdout.readline().strip().split("=", 1)
            env[k] = v
        me = [sys.executable, os.path.abspath(__file__), "--worker"] + a.forward
        lines = queue.Queue()

        def start():
            w = subprocess.Popen(me, env=env, stdout=subprocess.PIPE, text=True)
            threading.Thread(target=lambda: [lines.put(l.strip()) for l in w.stdout] and None, daemon=True).start()
            return w

        workers = [start() for _ in range(a.workers)]
        result, joined = None, a.join_at is None
        while any(w.poll() is None for w in workers) or not lines.empty():
            try:
                line = lines.get(timeout=0.1)
            except queue.Empty:
                continue
            if line.startswith("{"):
                result = json.loads(line)  # rank 0's last line
            elif not joined and line.startswith("step ") and int(line.split()[1]) >= a.join_at:
                eps.scale(env["EPS_CONTROL"], open(env["EPS_JOB_SECRET_FILE"]).read().strip(), workers=a.workers + 1)
                workers.append(start())
                joined = True
                print(f"train_digits: a worker joins after step {line.split()[1]}", file=sys.stderr)
        time.sleep(0.2)
        while not lines.empty():
            line = lines.get()
            if line.startswith("{"):
                result = json.loads(line)
        codes = [w.wait() for w in workers]
        if any(codes):
            sys.exit(f"train_digits: a worker failed (exit codes {codes})")
        up.wait(timeout=60)
        if result is None:
            sys.exit("train_digits: rank 0 reported no result")
        return result
    finally:
        if up.poll() is None:
            up.terminate()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--servers", type=int, default=2, help="server processes (default 2)")
    p.add_argument("--steps", type=int, default=300, help="training iterations (default 300)")
    p.add_argument("--batch", type=int, default=32, help="samples per worker per step (default 32)")
    p.add_argument("--lr", type=float, default=0.01, help="Adam's learning rate (default 0.01)")
    p.add_argument("--optimizer", choices=["server-adam", "torch-adam"], default="server-adam")
    p.add_argument("--join-at", type=int, default=None, metavar="STEP", help="add a worker after STEP steps")
    p.add_argument("--local", action="store_true", help="train the same in one process, without EPS")
    p.add_argument("--json", action="store_true", help="end with one JSON line of results")
    p.add_argument("--eps", help="the eps binary (default: $EPS_BIN, PATH, target/release/eps)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.workers < 1 or a.steps < 1 or a.batch < 1:
        p.error("--workers, --steps and --batch must be at least 1")
    if a.join_at is not None and not 0 < a.join_at < a.steps:
        p.error("--join-at must be between 1 and --steps - 1")
    if a.join_at is not None and a.optimizer == "torch-adam" and not a.local:
        p.error("--join-at needs --optimizer server-adam: with torch-adam the optimizer state lives in the workers")
    a.forward = ["--steps", str(a.steps), "--batch", str(a.batch), "--lr", str(a.lr), "--optimizer", a.optimizer]
    if a.worker:
        return run_worker(a)
    started = time.time()
    r = run_local(a) if a.local else run_cluster(a)
    where = "plain PyTorch, one process" if a.local else f"EPS, {a.workers} workers" + (f" (+1 at step {a.join_at})" if a.join_at else "")
    print(f"train_digits: {where}, {a.optimizer}: test accuracy {r['final_accuracy']:.4f} after {r['steps']} steps ({time.time() - started:.1f} s)")
    if a.json:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
