"""The cost of the C ABI: push_pull of one model driven from Python through
libeps, against the Rust worker's push_pull, in the same run.

    python -m eps.bench --size 100MB --rounds 3 --json

(``python -m eps.bench --ddp`` runs EPS against PyTorch's DDP instead: see
``eps.ddp``.)

Each round starts two identical jobs with ``eps up`` (one server, one worker,
the soft transport, SGD on the servers, one f32 tensor of SIZE bytes): one
trained by ``eps worker --bench-iters`` (Rust), one by this process through
``eps.Worker.push_pull`` (Python -> ctypes -> libeps), in alternating order.
Each worker times ITERS push_pulls after 3 warm-up ones; the figure per round
is the median iteration. ``ratio`` is Python's throughput over Rust's: the
median over rounds of each round's ratio (its two figures are taken back to
back, so the machine's other load weighs on both alike); 1.0 means the ABI
costs nothing measurable.
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import eps

WARMUP = 3


def parse_size(s):
    m = re.fullmatch(r"(\d+)\s*(B|KB|MB|GB|KiB|MiB|GiB)?", s.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"{s!r} is not a size (e.g. 100MB, 64MiB)")
    unit = {None: 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[m.group(2)]
    return int(m.group(1)) * unit


def find_eps(given):
    for c in [given, os.environ.get("EPS_BIN"), shutil.which("eps")]:
        if c:
            return c
    repo = Path(__file__).resolve().parents[2] / "target" / "release" / "eps"
    if repo.exists():
        return str(repo)
    sys.exit("eps.bench: no eps binary: pass --eps or set EPS_BIN")


class Job:
    """`eps up` with the benchmark's spec; its environment for workers."""

    def __init__(self, eps_bin, spec_path):
        env = {k: v for k, v in os.environ.items() if k != "EPS_JOB_SECRET"}
        cmd = [eps_bin, "up", "--spec", spec_path, "--transport", "soft", "--aggregator", "cpu"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
        for _ in range(2):
            k, v = self.proc.stdout.readline().strip().split("=", 1)
            env[k] = v
        self.env = env

    def close(self):
        try:
            self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.terminate()


def rust_round(eps_bin, spec_path, iters):
    job = Job(eps_bin, spec_path)
    try:
        cmd = [eps_bin, "worker", "--control", job.env["EPS_CONTROL"], "--bench-iters", str(iters), "--transport", "soft"]
        out = subprocess.run(cmd, env=job.env, capture_output=True, text=True, timeout=900)
        if out.returncode != 0:
            sys.exit(f"eps.bench: the Rust worker failed:\n{out.stderr[-2000:]}")
        for line in out.stdout.splitlines():
            if line.startswith("EPS_REPORT "):
                r = json.loads(line[len("EPS_REPORT "):])
                if r.get("report") == "bench" and r.get("rank") == 0 and "p50_ms" in r:
                    return float(r["p50_ms"])
        sys.exit(f"eps.bench: the Rust worker did not report:\n{out.stdout[-2000:]}")
    finally:
        job.close()


def python_round(eps_bin, spec_path, iters):
    job = Job(eps_bin, spec_path)
    try:
        secret = open(job.env["EPS_JOB_SECRET_FILE"]).read().strip()
        w = eps.Worker(job.env["EPS_CONTROL"], secret, timeout_ms=600000).join()
        for _ in range(WARMUP):
            w.push_pull()
        ms = []
        for _ in range(iters):
            t = time.perf_counter()
            w.push_pull()
            ms.append((time.perf_counter() - t) * 1e3)
        w.finish()
        w.close()
        return statistics.median(ms)
    finally:
        job.close()


def main():
    if "--ddp" in sys.argv[1:]:
        sys.argv.remove("--ddp")
        from eps import ddp

        return ddp.main()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=parse_size, default=parse_size("100MB"), help="model bytes, f32 (default 100MB)")
    p.add_argument("--iters", type=int, default=10, help="timed push_pulls per worker and round (default 10)")
    p.add_argument("--rounds", type=int, default=9, help="rounds, each timing both workers (default 9)")
    p.add_argument("--shard-bytes", type=parse_size, default=parse_size("4MiB"), help="shard size (default 4MiB)")
    p.add_argument("--eps", help="the eps binary (default: $EPS_BIN, PATH, target/release/eps)")
    p.add_argument("--json", action="store_true", help="end with one JSON line of results")
    a = p.parse_args()
    if a.size < 4096 or a.size % 4 or a.iters < 1 or a.rounds < 1:
        p.error("--size must be a multiple of 4 of at least 4096; --iters and --rounds at least 1")
    eps_bin = find_eps(a.eps)
    spec = (
        f'[job]\nname = "abi-bench"\nworkers = 1\nservers = 1\nsteps = {a.iters + WARMUP}\n'
        f"shard_bytes = {min(a.shard_bytes, -(-a.size // 4096) * 4096)}\n"
        f'[model]\ntensors = [{{ name = "params", elements = {a.size // 4} }}]\n'
        f'[optimizer]\nkind = "sgd"\nlr = 0.0001\n'
    )
    rust, py = [], []
    with tempfile.TemporaryDirectory() as d:
        spec_path = os.path.join(d, "job.toml")
        Path(spec_path).write_text(spec)
        for r in range(a.rounds):
            order = [("rust", rust_round), ("python", python_round)]
            if r % 2:
                order.reverse()
            for name, f in order:
                ms = f(eps_bin, spec_path, a.iters)
                (rust if name == "rust" else py).append(ms)
                print(f"eps.bench: round {r + 1}: {name} push_pull of {a.size / 1e6:.0f} MB: {ms:.2f} ms", file=sys.stderr)
    rust_ms, py_ms = statistics.median(rust), statistics.median(py)
    gbs = lambda ms: 2 * a.size / (ms / 1e3) / 1e9  # noqa: E731 (pushed + pulled bytes)
    # Each round's two figures were taken back to back: their ratio cancels
    # most of what the machine's other load does to both; the median of
    # those ratios is the figure.
    ratio = statistics.median(r / p for r, p in zip(rust, py))
    print(
        f"push_pull of {a.size / 1e6:.0f} MB: Rust {rust_ms:.2f} ms ({gbs(rust_ms):.2f} GB/s), "
        f"Python through libeps {py_ms:.2f} ms ({gbs(py_ms):.2f} GB/s); throughput ratio Python/Rust {ratio:.3f} "
        f"(median of {a.rounds} rounds' ratios)"
    )
    if a.json:
        print(
            json.dumps(
                {
                    "size_bytes": a.size,
                    "iters": a.iters,
                    "rounds": a.rounds,
                    "rust_iter_ms_p50": rust_ms,
                    "python_iter_ms_p50": py_ms,
                    "rust_gbytes_per_s": gbs(rust_ms),
                    "python_gbytes_per_s": gbs(py_ms),
                    "rust_rounds_ms": rust,
                    "python_rounds_ms": py,
                    "ratio": ratio,
                }
            )
        )


if __name__ == "__main__":
    main()
