#!/usr/bin/env python3
"""A click-through model over EPS: embedding bags in a sparse table, an MLP.

    python examples/torch/train_ctr.py --workers 2 --json

Generates a synthetic click log with a known teacher (numpy, seeded): each
sample has --fields categorical fields, each a bag of 1 to 3 ids drawn
zipf(--zipf) from --vocab ids per field, and 8 dense features; the teacher
gives each (field, id) and each dense feature a weight, and a click is drawn
from the sigmoid of the bags' mean weights plus the dense part. The student
pools each bag with eps.torch.EmbeddingBag (the rows live in the job's
sparse table ``ids``, pulled by key each step; their gradients are pushed as
sparse rows) and scores [bags, dense] with an MLP whose parameters
eps.torch.DistributedModel keeps on the servers (Adam there).

The job is hosted in this process (eps.Cluster: a control plane and two
servers on threads) and the workers train on threads, each through its own
libeps worker. Prints the held-out AUC against the teacher's; --json ends
with one line: final_auc, teacher_auc, steps, workers.
"""

import argparse
import json
import threading

import numpy as np
import torch

import eps
import eps.torch as et

SECRET = "ctr-example"
DENSE = 8
DIM = 8


def spec(a):
    return f"""
[job]
workers = {a.workers}
servers = 2
steps = {a.steps}
batch = {a.batch}
[model]
declare = true
[[model.tables]]
name = "ids"
dim = {DIM}
optimizer = "adagrad"
lr = 0.3
init_scale = 0.05
max_keys = {a.batch * a.fields * 3}
[optimizer]
kind = "adam"
lr = 0.01
"""


class ClickLog:
    """Samples ``0..n`` of the synthetic log: bags (ids per field), dense
    features, clicks, and the teacher's click probability."""

    def __init__(self, n, fields, vocab, zipf, seed):
        rng = np.random.default_rng(seed)
        p = np.arange(1, vocab + 1, dtype=np.float64) ** -zipf
        self.fields, self.vocab = fields, vocab
        self.sizes = rng.integers(1, 4, size=(n, fields))
        self.ids = rng.choice(vocab, size=(n, fields, 3), p=p / p.sum())
        self.dense = (rng.uniform(-1, 1, size=(n, DENSE)) * np.sqrt(3)).astype(np.float32)
        theta = np.random.default_rng(1000).uniform(-1.5, 1.5, size=(fields, vocab))
        u = np.random.default_rng(2000).uniform(-0.4, 0.4, size=DENSE)
        logit = self.dense @ u - 0.4
        for f in range(fields):
            w = theta[f][self.ids[:, f, :]]
            mask = np.arange(3)[None, :] < self.sizes[:, f : f + 1]
            logit = logit + (w * mask).sum(1) / self.sizes[:, f]
        self.p = 1 / (1 + np.exp(-logit))
        self.click = (rng.uniform(size=n) < self.p).astype(np.float32)

    def batch(self, idx):
        """(ids, offsets, dense, clicks) of samples ``idx``: one bag per
        (sample, field), ids keyed by field."""
        sizes = self.sizes[idx].reshape(-1)
        keys = [
            (f << 40) | int(i)
            for s in idx
            for f in range(self.fields)
            for i in self.ids[s, f, : self.sizes[s, f]]
        ]
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        return (
            torch.tensor(keys, dtype=torch.int64),
            torch.from_numpy(offsets.astype(np.int64)),
            torch.from_numpy(self.dense[idx]),
            torch.from_numpy(self.click[idx]),
        )


class Ctr(torch.nn.Module):
    def __init__(self, fields, hidden):
        super().__init__()
        self.fields = fields
        self.bags = et.EmbeddingBag("ids", mode="mean")
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(fields * DIM + DENSE, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)
        )

    def forward(self, ids, offsets, dense):
        pooled = self.bags(ids, offsets).view(-1, self.fields * DIM)
        return self.mlp(torch.cat([pooled, dense], 1)).squeeze(1)


def auc(scores, clicks):
    """The chance a click scores above a non-click (ties count a half)."""
    order = np.argsort(scores, kind="mergesort")
    s, c = np.asarray(scores)[order], np.asarray(clicks)[order]
    ranks = np.empty(len(s))
    i = 0
    while i < len(s):
        j = i
        while j < len(s) and s[j] == s[i]:
            j += 1
        ranks[i:j] = (i + 1 + j) / 2
        i = j
    pos = c.sum()
    neg = len(c) - pos
    return float((ranks[c == 1].sum() - pos * (pos + 1) / 2) / (pos * neg))


def work(a, address, train, test, out):
    torch.manual_seed(0)
    m = Ctr(a.fields, a.hidden)
    dm = et.DistributedModel(m, eps.Worker(address, SECRET))
    loss_fn = torch.nn.BCEWithLogitsLoss()
    n = len(train.click)
    for _, (idx,) in et.ElasticLoader(dm, (torch.arange(n),), batch=a.batch, steps=a.steps, seed=3):
        ids, offsets, dense, y = train.batch(idx.numpy())
        loss_fn(m(ids, offsets, dense), y).backward()
        dm.step()
    if dm.rank == 0:
        m.eval()
        scores = []
        with torch.no_grad():
            for first in range(0, len(test.click), 1024):
                idx = np.arange(first, min(first + 1024, len(test.click)))
                ids, offsets, dense, _ = test.batch(idx)
                scores.append(m(ids, offsets, dense).numpy())
        out["final_auc"] = auc(np.concatenate(scores), test.click)
        out["teacher_auc"] = auc(test.p, test.click)
    dm.finish()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--fields", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--zipf", type=float, default=1.05)
    ap.add_argument("--hidden", type=int, default=16)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    train = ClickLog(a.steps * a.batch * a.workers, a.fields, a.vocab, a.zipf, seed=1)
    test = ClickLog(20_000, a.fields, a.vocab, a.zipf, seed=2)
    cluster = eps.Cluster(spec(a), SECRET)
    out, errors = {}, []

    def guarded():
        try:
            work(a, cluster.address, train, test, out)
        except BaseException as e:  # noqa: BLE001 (re-raised below)
            errors.append(e)

    ts = [threading.Thread(target=guarded) for _ in range(a.workers)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    if errors:
        raise errors[0]
    cluster.wait(30000)
    cluster.close()
    print(f"held-out AUC {out['final_auc']:.4f} (teacher {out['teacher_auc']:.4f}) after {a.steps} steps on {a.workers} workers")
    if a.json:
        print(json.dumps({"final_auc": out["final_auc"], "teacher_auc": out["teacher_auc"], "steps": a.steps, "workers": a.workers}))


if __name__ == "__main__":
    main()
