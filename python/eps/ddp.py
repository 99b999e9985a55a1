"""EPS against PyTorch's DistributedDataParallel, side by side in one run.

    python -m eps.bench --ddp [--rounds 3] [--steps 30] [--json]

Each round runs the same training three ways, in an order that alternates
from round to round: two processes with DDP over gloo; two processes with
``eps.torch.DistributedModel`` against ``eps up`` (one server, SGD on the
server); and two processes that only compute (no communication: the floor).
The model is an MLP of 25 M parameters (1024-4096-4096-1024), batch 32, SGD
(lr 0.01), MSE to fixed targets, one torch thread per process; every
process of a kind starts from the same values (DDP broadcasts rank 0's, EPS
seeds its servers from rank 0's). After WARMUP steps each process times
STEPS steps and the phases of each; the figure of a round is rank 0's
median step. ``ratio`` is EPS's steps per second over DDP's: the median
over rounds of each round's ratio. ``max_abs_diff`` compares the final
parameters of EPS and DDP (rank 0's) after the same steps on the same data.
The CPU rows say how busy the machine was: the whole machine's CPU time per
step (every process: workers, servers, gloo's threads) and rank 0's own.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

WARMUP = 5
SIZES = (1024, 4096, 4096, 1024)
BATCH = 32
LR = 0.01


def _model(torch):
    torch.manual_seed(1234)
    layers = []
    for i, (a, b) in enumerate(zip(SIZES, SIZES[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(SIZES) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def _batch(torch, rank, step):
    g = torch.Generator().manual_seed(rank * 100003 + step)
    return torch.randn(BATCH, SIZES[0], generator=g), torch.randn(BATCH, SIZES[-1], generator=g)


def worker(mode, rank, steps, port):
    """One training process; prints one JSON line of its timings."""
    import torch

    torch.set_num_threads(1)
    model = _model(torch)
    loss_fn = torch.nn.functional.mse_loss
    phases = {}

    def mark(name, t0):
        phases.setdefault(name, []).append((time.perf_counter() - t0) * 1e3)
        return time.perf_counter()

    if mode == "ddp":
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        net = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(net.parameters(), lr=LR)
    elif mode == "eps":
        import eps.torch as et

        dm = et.DistributedModel(model, timeout_ms=600000)
        net = model
    else:
        net = model
        opt = torch.optim.SGD(net.parameters(), lr=LR)
    steps_ms = []
    busy = None
    for step in range(WARMUP + steps):
        if step == WARMUP:
            busy, cpu = _machine_busy_ms(), time.process_time()
        x, y = _batch(torch, rank, step)
        start = t = time.perf_counter()
        if mode == "eps":
            dm.begin()
            t = mark("begin", t)
        else:
            opt.zero_grad(set_to_none=True)
            t = mark("zero_grad", t)
        loss = loss_fn(net(x), y)
        t = mark("forward", t)
        loss.backward()
        t = mark("backward", t)
        if mode == "eps":
            dm.step()
            t = mark("step (wait for pulls)", t)
        else:
            opt.step()
            t = mark("optimizer", t)
        steps_ms.append((time.perf_counter() - start) * 1e3)
    # The whole machine's CPU time (every process: workers, servers, gloo's
    # threads) and this process's, per timed step.
    machine = (_machine_busy_ms() - busy) / steps
    own = (time.process_time() - cpu) * 1e3 / steps
    params = [p.detach().clone() for p in model.parameters()]
    if mode == "eps":
        dm.finish()
    elif mode == "ddp":
        import torch.distributed as dist

        dist.destroy_process_group()
    out = {"mode": mode, "rank": rank, "step_ms": statistics.median(steps_ms[WARMUP:])}
    out["phases_ms"] = {k: statistics.median(v[WARMUP:]) for k, v in phases.items()}
    out["cpu_ms"] = {"machine": machine, "this process": own}
    out["checksum"] = float(sum(p.double().sum() for p in params))
    if rank == 0 and os.environ.get("EPS_DDP_PARAMS"):
        torch.save(params, os.environ["EPS_DDP_PARAMS"])
    print(json.dumps(out), flush=True)


def _machine_busy_ms():
    """CPU time the machine's cores spent busy so far (ms, from /proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return (sum(v[:8]) - idle) * 1e3 / os.sysconf("SC_CLK_TCK")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_pair(mode, steps, env):
    port = _free_port()
    cmd = [sys.executable, "-m", "eps.ddp", "--worker", mode, "--steps", str(steps), "--port", str(port)]
    procs = [subprocess.Popen([*cmd, "--rank", str(r)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=1800) for p in procs]
    res = []
    for p, (out, err) in zip(procs, outs):
        if p.returncode != 0:
            sys.exit(f"eps.bench --ddp: a {mode} worker failed:\n{err[-3000:]}")
        res.append(json.loads(out.strip().splitlines()[-1]))
    return sorted(res, key=lambda r: r["rank"])


def _eps_pair(eps_bin, steps, env, shard_bytes=None):
    cmd = [eps_bin, "up", "--workers", "2", "--servers", "1", "--optimizer", "sgd", "--lr", str(LR), "--steps", str(WARMUP + steps)]
    if shard_bytes:
        spec = os.path.join(env["EPS_BENCH_DIR"], "job.toml")
        with open(spec, "w") as f:
            f.write(f'[job]\nname = "ddp-bench"\nshard_bytes = {shard_bytes}\n[model]\ndeclare = true\n')
        cmd += ["--spec", spec]
    up = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        env = dict(env)
        for _ in range(2):
            k, v = up.stdout.readline().strip().split("=", 1)
            env[k] = v
        return _run_pair("eps", steps, env)
    finally:
        try:
            up.wait(timeout=60)
        finally:
            if up.poll() is None:
                up.terminate()


def compare(eps_bin, rounds, steps, as_json, shard_bytes=None):
    import tempfile

    import torch

    env = {k: v for k, v in os.environ.items() if k != "EPS_JOB_SECRET"}
    runs = {"ddp": [], "eps": [], "alone": []}
    finals = {}
    with tempfile.TemporaryDirectory() as d:
        for r in range(rounds):
            order = ["ddp", "eps", "alone"]
            order = order[r % 3 :] + order[: r % 3]
            for mode in order:
                e = dict(env, EPS_DDP_PARAMS=os.path.join(d, f"{mode}.pt"), EPS_BENCH_DIR=d)
                res = _eps_pair(eps_bin, steps, e, shard_bytes) if mode == "eps" else _run_pair(mode, steps, e)
                runs[mode].append(res[0])
                print(f"eps.bench --ddp: round {r + 1}: {mode}: {res[0]['step_ms']:.1f} ms a step (rank 0)", file=sys.stderr)
            for mode in ("ddp", "eps"):
                finals[mode] = torch.load(os.path.join(d, f"{mode}.pt"))
    step = {m: statistics.median(x["step_ms"] for x in v) for m, v in runs.items()}
    ratio = statistics.median(dr["step_ms"] / er["step_ms"] for dr, er in zip(runs["ddp"], runs["eps"]))
    diff = max(float((a - b).abs().max()) for a, b in zip(finals["ddp"], finals["eps"]))
    print(f"steps per second: DDP (gloo) {1e3 / step['ddp']:.2f}, EPS {1e3 / step['eps']:.2f}, compute alone {1e3 / step['alone']:.2f}")
    print(f"EPS / DDP: {ratio:.3f} (median of {rounds} rounds); EPS step / compute alone: {step['eps'] / step['alone']:.2f}")
    print(f"final parameters, EPS against DDP: max |difference| {diff:.3g}")
    names = []
    for m in ("alone", "ddp", "eps"):
        for k in runs[m][0]["phases_ms"]:
            if k not in names:
                names.append(k)
    print(f"{'phase (ms, rank 0, median)':<28}{'alone':>10}{'DDP':>10}{'EPS':>10}")
    for k in names + ["step"]:
        row = []
        for m in ("alone", "ddp", "eps"):
            if k == "step":
                row.append(step[m])
            else:
                v = [x["phases_ms"][k] for x in runs[m] if k in x["phases_ms"]]
                row.append(statistics.median(v) if v else None)
        print(f"{k:<28}" + "".join(f"{'-' if v is None else format(v, '.1f'):>10}" for v in row))
    for k in ("this process", "machine"):
        row = [statistics.median(x["cpu_ms"][k] for x in runs[m]) for m in ("alone", "ddp", "eps")]
        print(f"{'CPU per step, ' + k:<28}" + "".join(f"{v:>10.1f}" for v in row))
    print(f"({os.cpu_count()} cores: a step of S ms has at most {os.cpu_count()} x S ms of CPU)")
    if as_json:
        print(json.dumps({"step_ms": step, "ratio": ratio, "max_abs_diff": diff, "rounds": runs}))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=30, help="timed steps per process and run (default 30)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each running DDP, EPS and compute alone (default 3)")
    p.add_argument("--shard-bytes", type=int, help="EPS's job.shard_bytes (default: eps up's)")
    p.add_argument("--eps", help="the eps binary (default: $EPS_BIN, PATH, target/release/eps)")
    p.add_argument("--json", action="store_true", help="end with one JSON line of results")
    a = p.parse_args()
    if a.worker:
        return worker(a.worker, a.rank, a.steps, a.port)
    if a.steps < 1 or a.rounds < 1:
        p.error("--steps and --rounds must be at least 1")
    from eps.bench import find_eps

    compare(find_eps(a.eps), a.rounds, a.steps, a.json, a.shard_bytes)


if __name__ == "__main__":
    main()
