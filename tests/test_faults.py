"""liveness.py: a lost rank or host ends the job within seconds, with one line naming it.

The watcher's logic on a fake store and clock (no processes), then the real thing across two hosts
(scripts/multihost.sh's network namespaces, torchrun, gloo): a rank killed with SIGKILL, a host whose
link goes down, and serve.py whose follower is killed under an open streamed request. The multi-host
tests need root (ip netns) and are skipped, with the script's reason, where namespaces cannot be made.
Run: python -m pytest -q tests/test_faults.py
"""
import io
import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

import liveness
from conftest import ROOT, TEST_DEVICE, run_script
from liveness import GONE, LOST_S, SUSPECT_S, Monitor


class FakeStore:
    """torch.distributed.Store's calls that liveness uses, in a dict; `up` False: unreachable."""

    def __init__(self):
        self.data, self.up = {}, True

    def reach(self):
        if not self.up:
            raise RuntimeError("connection refused")

    def add(self, key, n):
        self.reach()
        self.data[key] = self.data.get(key, 0) + n
        return self.data[key]

    def set(self, key, value):
        self.reach()
        self.data[key] = value.encode()

    def get(self, key):
        self.reach()
        return self.data[key]

    def check(self, keys):
        self.reach()
        return all(k in self.data for k in keys)


class Job:
    """Two ranks' monitors over one fake store, on hosts 10.77.0.1 (the store's) and 10.77.0.2, with
    a fake clock: tick(s) moves it a second at a time and beats the ranks in `alive`."""

    def __init__(self):
        self.now, self.store, self.alive = 0.0, FakeStore(), {0, 1}
        self.ranks = [Monitor(self.store, r, 2, "10.77.0.1", clock=lambda: self.now) for r in range(2)]
        for r, monitor in enumerate(self.ranks):
            self.store.set(monitor.key("host", r), f"{os.uname().nodename} 10.77.0.{r + 1}")

    def tick(self, seconds: float):
        for _ in range(int(seconds)):
            self.now += 1.0
            for r in sorted(self.alive, reverse=True):  # rank 0 reads what rank 1 wrote this second
                self.ranks[r].beat()


@pytest.fixture
def job():
    return Job()


def test_a_rank_whose_counter_stops_is_lost_after_LOST_S(job):
    job.tick(3)
    job.alive = {0}  # rank 1 is killed
    job.tick(LOST_S - 1)
    assert job.ranks[0].lost(job.now) is None
    job.tick(1)
    assert job.ranks[0].lost(job.now) == f"lost rank 1 (host 10.77.0.2): no heartbeat for {LOST_S:.0f} s"


def test_after_a_failed_collective_a_stopped_rank_is_named_sooner(job):
    job.tick(3)
    job.alive = {0}
    job.ranks[0].suspect = True
    job.tick(SUSPECT_S)
    assert job.ranks[0].lost(job.now) == f"lost rank 1 (host 10.77.0.2): no heartbeat for {SUSPECT_S:.0f} s"


def test_a_rank_that_reads_nothing_blames_no_one(job):
    """A rank whose own beating thread stalls (starved, not waiting on the store) judges no one:
    its peers' counters are old only because it has not read them."""
    job.tick(3)
    job.alive = {1}
    job.tick(3 * LOST_S)
    assert job.ranks[0].lost(job.now) is None
    job.alive = {0, 1}
    job.tick(1)
    assert job.ranks[0].lost(job.now) is None


def test_a_store_that_stops_answering_loses_its_host(job):
    job.tick(3)
    job.store.up = False  # host 0's link is down, seen from host 1
    job.tick(1)  # the first call that gets no answer starts the count
    job.tick(LOST_S - 1)
    assert job.ranks[1].lost(job.now) is None
    job.tick(1)
    assert job.ranks[1].lost(job.now) == \
        f"lost host 10.77.0.1 (rank 0): the job's store there has not answered for {LOST_S:.0f} s"


def test_a_store_call_that_hangs_counts_from_its_start(job):
    job.tick(2)
    monitor = job.ranks[1]
    monitor.silent_since = job.now  # what beat() sets as it calls the store
    job.now += LOST_S
    assert monitor.lost(job.now).startswith("lost host 10.77.0.1 (rank 0)")


def test_a_rank_that_ends_normally_is_not_lost(job):
    job.tick(3)
    job.ranks[1].stop()
    job.alive = {0}
    job.tick(2 * LOST_S)
    assert job.store.data[job.ranks[1].key("beat", 1)] > GONE
    assert job.ranks[0].lost(job.now) is None
    job.store.up = False  # and then the store's host ends too
    job.tick(2 * LOST_S)
    assert job.ranks[0].lost(job.now) is None


def test_a_peer_on_another_machine_is_named_with_its_host_name(job):
    job.store.data[job.ranks[0].key("host", 1)] = b"node7 10.77.0.2"
    job.tick(2)
    job.alive = {0}
    job.tick(LOST_S)
    assert job.ranks[0].lost(job.now).startswith("lost rank 1 (host node7, 10.77.0.2): ")


def test_declare_prints_one_line_runs_the_callbacks_and_exits_1(job, monkeypatch):
    err, seen = io.StringIO(), []
    monkeypatch.setattr(sys, "__stderr__", err)
    monkeypatch.setattr(liveness, "LINGER_S", 0)
    monkeypatch.setattr(os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    job.ranks[0].callbacks += [seen.append, lambda why: 1 / 0]  # a failing callback stops nothing
    with pytest.raises(SystemExit) as e:
        job.ranks[0].declare("lost rank 1 (host 10.77.0.2): no heartbeat for 10 s")
    assert e.value.code == 1 and seen == ["lost rank 1 (host 10.77.0.2): no heartbeat for 10 s"]
    assert err.getvalue() == "error: lost rank 1 (host 10.77.0.2): no heartbeat for 10 s\n"
