"""liveness.py: a lost rank or host ends the job within seconds, with one line naming it.

The watcher's logic on a fake store and clock (no processes); a rank busy for longer than LOST_S
that is not declared lost (torchrun on this machine); then the real thing across two hosts
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
import threading
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


def test_a_process_that_could_not_run_its_threads_does_not_count_that_time(job):
    """Another thread held the interpreter for longer than LOST_S: the store's answer may be waiting
    unread, so its silence counts from when the watcher runs again."""
    job.tick(2)
    monitor = job.ranks[1]
    monitor.silent_since = job.now
    job.now += 2 * LOST_S
    monitor.forgive(job.now)
    assert monitor.lost(job.now) is None
    job.now += LOST_S
    assert monitor.lost(job.now) is not None


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


def test_a_sigterm_during_confirm_waits_for_the_verdict(job, monkeypatch):
    """torchrun ends a rank with SIGTERM when its store connection fails: while confirm() waits for
    the watcher, a SIGTERM is held, then delivered as before when no loss was named; outside
    confirm() the handler is the one it was."""
    real_kill, kills = os.kill, []
    monkeypatch.setattr(os, "kill", lambda pid, sig: kills.append(sig))
    monkeypatch.setattr(liveness, "CONFIRM_S", 0.5)
    monkeypatch.setattr(liveness, "_monitor", job.ranks[0])
    before = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        threading.Timer(0.1, real_kill, (os.getpid(), signal.SIGTERM)).start()
        liveness.confirm()
        assert kills == [signal.SIGTERM] and signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        assert not job.ranks[0].suspect
    finally:
        signal.signal(signal.SIGTERM, before)


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


SLOW_RANK = """
import time, torch, torch.distributed as dist, tp
t, _ = tp.init_from_env("cpu")
if t.rank == 1:
    time.sleep(3 * float(__import__("os").environ["MINILLM_TP_LOST_S"]))  # busy, as while compiling
x = torch.ones(1)
dist.all_reduce(x)  # rank 0 waits here all along
print(f"rank {t.rank}: {int(x.item())}", flush=True)
"""


def test_a_slow_rank_is_not_lost(tmp_path):
    """A rank busy for three times LOST_S (its main thread asleep, as in a long compile) while the
    other waits in a collective: its thread beats on, nobody is declared lost, the job ends 0."""
    (tmp_path / "slow.py").write_text(SLOW_RANK)
    env = dict(os.environ, OMP_NUM_THREADS="1", MINILLM_TP_LOST_S="2", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        tmp_path / "slow.py"], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and "error: lost" not in r.stderr, r.stderr[-3000:]
    assert r.stdout == "rank 0: 2\n"  # rank 1 is quiet (tp.quiet)


# ---------------------------------------------------------------- across two hosts (network namespaces)

SCRIPT = ROOT / "scripts" / "multihost.sh"
CANNOT = 77  # the script's status where namespaces cannot be made
DEADLINE_S = 30  # a rank that lost a peer has said so and exited within this
# one thread a rank: two ranks share this machine's cores
TORCHRUN = (f"OMP_NUM_THREADS=1 {shlex.quote(sys.executable)} -m torch.distributed.run --nnodes $NUM_HOSTS "
            "--nproc_per_node 1 --rdzv_backend c10d --rdzv_endpoint $MASTER_ADDR:$MASTER_PORT "
            "--local_addr $HOST_ADDR --rdzv_conf is_host=$((HOST_RANK == 0)),join_timeout=120")
needs_cpu = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="gloo across namespaces: CPU ranks")


class Hosts:
    """scripts/multihost.sh running `command` on 2 hosts named prefix-h0, prefix-h1, in the background;
    each host's output in tmp_path/h<i>.out, .err as it comes. grace: the script's -g, how long a host
    may go on after another failed (torchrun on a host that lost host 0 waits out its own rendezvous)."""

    def __init__(self, command: str, prefix: str, tmp_path, grace: int = 5):
        self.prefix, self.dir = prefix, tmp_path
        self.proc = subprocess.Popen(["bash", SCRIPT, "-n", "2", "-p", prefix, "-t", "300", "-g", str(grace),
                                      "-o", tmp_path, "--", command], cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)

    def text(self, name: str) -> str:
        path = self.dir / name
        return path.read_text() if path.exists() else ""

    def wait_for(self, what, timeout: float = 180):
        """Poll until what() is true; skip where the script could not make the namespaces."""
        deadline = time.monotonic() + timeout
        while not what():
            if self.proc.poll() is not None:
                out, err = self.proc.communicate()
                if self.proc.returncode == CANNOT:
                    pytest.skip(err.strip().splitlines()[-1])
                raise AssertionError(f"the hosts ended first ({self.proc.returncode}): {err[-3000:]}")
            assert time.monotonic() < deadline, f"timed out: {self.text('h0.err')[-2000:]}"
            time.sleep(0.2)

    def rank_pid(self, host: int, script: str) -> int:
        """The process of the rank that torchrun started on `host` (python -u script ...)."""
        listed = subprocess.run(["ip", "netns", "pids", f"{self.prefix}-h{host}"], capture_output=True, text=True)
        for pid in listed.stdout.split():
            try:
                cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            if b"-u" in cmdline and script.encode() in cmdline:
                return int(pid)
        raise AssertionError(f"no rank running {script} on host {host}")

    def in_host(self, host: int, *command) -> list:
        return ["ip", "netns", "exec", f"{self.prefix}-h{host}", *map(str, command)]

    def finish(self) -> subprocess.CompletedProcess:
        out, err = self.proc.communicate(timeout=120)
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, out, err)

    def stop(self):
        """End the script (its trap ends the hosts' processes and removes the namespaces)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.communicate(timeout=60)


@pytest.fixture
def start_hosts(tmp_path):
    """Hosts(command, prefix, tmp_path), stopped after the test, passed or failed."""
    started = []

    def start(command: str, prefix: str) -> Hosts:
        started.append(Hosts(command, prefix, tmp_path))
        return started[-1]

    yield start
    for hosts in started:
        hosts.stop()


def gone_within(pids: list, seconds: float) -> float:
    """Seconds until every process in pids has exited (fails past `seconds`)."""
    start = time.monotonic()
    while any(os.path.exists(f"/proc/{pid}") and b"zombie" not in status(pid) for pid in pids):
        assert time.monotonic() - start < seconds, f"still running after {seconds} s"
        time.sleep(0.1)
    return time.monotonic() - start


def status(pid: int) -> bytes:
    try:
        return open(f"/proc/{pid}/status", "rb").read().lower()
    except OSError:
        return b"zombie"


def lost_lines(text: str) -> list:
    return [line for line in text.splitlines() if line.startswith("error: lost")]


def generate_on_two_hosts(smollm2_dir, prefix: str, start_hosts) -> Hosts:
    """generate.py over 2 hosts, a long greedy run, once its first tokens are out."""
    flags = ["--checkpoint", smollm2_dir, "--prompt", "Once upon a time", "--max_new_tokens", 2000,
             "--max_seq_length", 2048, "--no-compile", "--device", "cpu", "--dtype", "float32"]
    hosts = start_hosts(f"{TORCHRUN} generate.py {shlex.join(map(str, flags))}", prefix)
    hosts.wait_for(lambda: len(hosts.text("h0.out")) > 20)
    return hosts


@needs_cpu
@pytest.mark.parametrize("killed", [1, 0])
def test_a_killed_rank_ends_its_peer_with_one_line(smollm2_dir, start_hosts, killed):
    """SIGKILL of one host's rank mid-generation: the other host's rank names it (or, for host 0,
    its host, whose torchrun and store end with it) and exits 1 within seconds."""
    hosts = generate_on_two_hosts(smollm2_dir, f"flt{os.getpid()}a{killed}", start_hosts)
    other = 1 - killed
    peer = hosts.rank_pid(other, "generate.py")
    os.kill(hosts.rank_pid(killed, "generate.py"), signal.SIGKILL)
    seconds = gone_within([peer], DEADLINE_S)
    r = hosts.finish()
    assert r.returncode != 0
    err = hosts.text(f"h{other}.err")
    address = f"10.77.0.{killed + 1}"
    named = (f"error: lost rank {killed} (host {address}): no heartbeat for {SUSPECT_S:.0f} s",
             f"error: lost host {address} (rank 0): the job's store there has not answered for {SUSPECT_S:.0f} s")
    assert len(lost_lines(err)) == 1 and lost_lines(err)[0] in named, err[-3000:]
    assert "Traceback" not in err.split("error: lost")[0]
    if other == 0:
        assert "exitcode  : 1" in err  # torchrun's report of its rank
    print(f"host {other}'s rank exited {seconds:.1f} s after the kill")


@needs_cpu
def test_a_host_whose_link_goes_down_is_named_on_both_sides(smollm2_dir, start_hosts):
    """`ip link set veth1 down` on host 1 mid-generation: host 0's rank names rank 1, host 1's names
    host 0 (whose store it cannot reach), both exit 1 within DEADLINE_S instead of gloo's timeout."""
    hosts = generate_on_two_hosts(smollm2_dir, f"flt{os.getpid()}b", start_hosts)
    ranks = [hosts.rank_pid(0, "generate.py"), hosts.rank_pid(1, "generate.py")]
    subprocess.run(hosts.in_host(1, "ip", "link", "set", "veth1", "down"), check=True)
    seconds = gone_within(ranks, DEADLINE_S)
    hosts.finish()
    assert lost_lines(hosts.text("h0.err")) == [f"error: lost rank 1 (host 10.77.0.2): no heartbeat for {LOST_S:.0f} s"]
    assert lost_lines(hosts.text("h1.err")) == [
        f"error: lost host 10.77.0.1 (rank 0): the job's store there has not answered for {LOST_S:.0f} s"]
    assert "exitcode  : 1" in hosts.text("h0.err")
    print(f"both ranks exited {seconds:.1f} s after the link went down")


# a client inside host 0 (its loopback is its own): POST argv[2] to argv[1], print each line as it comes
CLIENT = """
import sys, urllib.error, urllib.request
req = urllib.request.Request(sys.argv[1], sys.argv[2].encode(), {"Content-Type": "application/json"})
try:
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            print(line.decode().rstrip(), flush=True)
except urllib.error.HTTPError as e:
    print(e.code, e.read().decode(), flush=True)
"""
URL = "http://127.0.0.1:8000"


@needs_cpu
def test_serve_across_hosts_answers_then_errors_its_stream_when_the_follower_dies(smollm2_dir, start_hosts):
    """serve.py over 2 hosts (rank 0 serves HTTP, rank 1 follows its plan): generate.py's greedy text;
    then, with a streamed request open, the follower is killed: the stream ends with an error event
    naming it and the server exits 1 within DEADLINE_S."""
    single = run_script("generate.py", "--checkpoint", smollm2_dir, "--prompt", "Once upon a time",
                        "--max_new_tokens", 16, "--no-compile", "--device", "cpu", "--dtype", "float32")
    assert single.returncode == 0, single.stderr[-3000:]
    flags = ["--checkpoint", smollm2_dir, "--no-compile", "--max_seq_length", 1024, "--port", 8000,
             "--device", "cpu", "--dtype", "float32"]
    hosts = start_hosts(f"{TORCHRUN} serve.py {shlex.join(map(str, flags))}", f"flt{os.getpid()}c")
    health = hosts.in_host(0, sys.executable, "-c", f"import urllib.request; urllib.request.urlopen('{URL}/health')")
    hosts.wait_for(lambda: subprocess.run(health, capture_output=True).returncode == 0)

    def post(body: dict, **popen):
        return subprocess.Popen(hosts.in_host(0, sys.executable, "-c", CLIENT, f"{URL}/v1/completions",
                                              json.dumps(body)), stdout=subprocess.PIPE, text=True, **popen)

    reply = post({"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}).communicate(timeout=120)[0]
    assert json.loads(reply)["choices"][0]["text"] == single.stdout[:-1]
    stream = post({"prompt": "Once upon a time", "max_tokens": 1000, "temperature": 0, "stream": True})
    assert stream.stdout.readline().startswith("data: {")  # the first token is out
    server, start = hosts.rank_pid(0, "serve.py"), time.monotonic()
    os.kill(hosts.rank_pid(1, "serve.py"), signal.SIGKILL)
    rest = stream.communicate(timeout=DEADLINE_S)[0]
    gone_within([server], DEADLINE_S)
    seconds = time.monotonic() - start
    assert seconds < DEADLINE_S
    hosts.finish()
    events = [json.loads(line[6:]) for line in rest.splitlines() if line.startswith("data: {")]
    assert events[-1] == {"error": {"message": "generation failed: lost rank 1 (host 10.77.0.2): no heartbeat for 3 s",
                                    "type": "server_error", "param": None, "code": None}}, rest[-2000:]
    assert rest.rstrip().endswith("data: [DONE]")
    assert lost_lines(hosts.text("h0.err")) == ["error: lost rank 1 (host 10.77.0.2): no heartbeat for 3 s"]
    assert "exitcode  : 1" in hosts.text("h0.err")
    print(f"the server exited {seconds:.1f} s after the kill")
