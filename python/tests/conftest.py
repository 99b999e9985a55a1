"""Shared by the tests: workers on threads against a job hosted in the process."""

import threading

import pytest


def _run_workers(cluster, work, n=2):
    """Runs ``work(k)`` for k in 0..n on threads, re-raises the first failure,
    then waits for the hosted job to finish and closes it."""
    errors = []

    def guarded(k):
        try:
            work(k)
        except BaseException as e:  # noqa: BLE001 (re-raised on the test's thread)
            errors.append(e)

    ts = [threading.Thread(target=guarded, args=(k,)) for k in range(n)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    if errors:
        raise errors[0]
    cluster.wait(30000)
    cluster.close()


@pytest.fixture
def run_workers():
    return _run_workers
