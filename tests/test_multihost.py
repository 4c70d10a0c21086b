"""scripts/multihost.sh: hosts as network namespaces on this machine, each with its own address, all
removed afterwards; and generate.py's tensor parallelism across two of them (torchrun's c10d
rendezvous and gloo over the veth links) printing one process's greedy text.

Needs root (ip netns); skipped, with the script's reason, where namespaces cannot be made.
Run: python -m pytest -q tests/test_multihost.py
"""
import os
import shlex
import shutil
import subprocess
import sys
import time

import pytest

from conftest import ROOT, TEST_DEVICE, run_script

SCRIPT = ROOT / "scripts" / "multihost.sh"
PREFIX = f"mlt{os.getpid()}"  # not the script's default, nor another test run's: their namespaces are left alone
CANNOT = 77  # the script's status where namespaces cannot be made


def multihost(command: str, prefix: str, *flags, hosts: int = 2, timeout: int = 120) -> subprocess.CompletedProcess:
    """The script on `hosts` hosts named prefix-h0, ..., skipping the test where it cannot make namespaces."""
    args = ["-n", str(hosts), "-p", prefix, "-t", str(timeout), *map(str, flags)]
    r = subprocess.run(["bash", SCRIPT, *args, "--", command], cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout + 60)
    if r.returncode == CANNOT:
        pytest.skip(r.stderr.strip().splitlines()[-1])
    return r


def namespaces(prefix: str) -> list:
    """The namespaces named prefix-... that exist now."""
    if not shutil.which("ip"):
        return []
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith(prefix + "-")]


def test_each_host_has_its_own_address_and_all_are_removed():
    """Each host sees its own veth address and an up loopback, the others' addresses nowhere;
    the environment names its rank and host 0; no namespace is left."""
    r = multihost('echo "rank $HOST_RANK of $NUM_HOSTS at $HOST_ADDR, master $MASTER_ADDR:$MASTER_PORT"; '
                  'ip -4 -o addr show', f"{PREFIX}a", hosts=3)
    assert r.returncode == 0, r.stderr
    for i in range(3):
        lines = [line for line in r.stdout.splitlines() if line.startswith(f"[h{i}] ")]
        assert f"[h{i}] rank {i} of 3 at 10.77.0.{i + 1}, master 10.77.0.1:29400" in lines
        addrs = {line.split()[4] for line in lines[1:]}  # "[hI] 2: veth0    inet 10.77.0.1/24 ..."
        assert addrs == {"127.0.0.1/8", f"10.77.0.{i + 1}/24"}, r.stdout
        assert f"host {i} (10.77.0.{i + 1}): exit 0" in r.stderr
    assert namespaces(f"{PREFIX}a") == []


def test_a_failing_host_ends_the_others_and_leftovers_are_removed():
    """The failing host's status is the script's, and the host still running is ended after the
    grace (-g); namespaces left by an aborted run with the same prefix are removed before it
    starts, and its own after it ends."""
    if not shutil.which("ip") or subprocess.run(["ip", "netns", "add", f"{PREFIX}b-h7"]).returncode != 0:
        pytest.skip("cannot make a network namespace here (ip netns add)")
    start = time.monotonic()
    r = multihost("if [ $HOST_RANK = 1 ]; then exit 3; fi; sleep 100", f"{PREFIX}b", "-g", 1)
    assert r.returncode == 3, r.stderr
    assert "host 0 (10.77.0.1): exit 143" in r.stderr and "host 1 (10.77.0.2): exit 3" in r.stderr
    assert time.monotonic() - start < 30
    assert namespaces(f"{PREFIX}b") == []


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="gloo across namespaces: CPU ranks")
@pytest.mark.parametrize("split", [[], ["--pp", "2"]], ids=["tp2", "pp2"])
def test_two_hosts_match_single_process(smollm2_dir, tmp_path, split):
    """torchrun on each of 2 hosts (1 rank each, c10d rendezvous at host 0, gloo over the veths):
    SmolLM2 split 6 + 3 heads, or into two stages of 15 layers, prints one process's greedy text,
    from host 0 (rank 0) only."""
    flags = ["--checkpoint", smollm2_dir, "--prompt", "Once upon a time", "--max_new_tokens", "16", "--no-compile",
             "--device", "cpu", "--dtype", "float32"]
    single = run_script("generate.py", *flags)
    assert single.returncode == 0, single.stderr[-3000:]
    # one thread a rank: two ranks share this machine's cores
    torchrun = (f"OMP_NUM_THREADS=1 MINILLM_TP_TIMEOUT_S=120 {shlex.quote(sys.executable)} -m torch.distributed.run "
                "--nnodes $NUM_HOSTS --nproc_per_node 1 --rdzv_backend c10d "
                "--rdzv_endpoint $MASTER_ADDR:$MASTER_PORT --local_addr $HOST_ADDR "
                "--rdzv_conf is_host=$((HOST_RANK == 0)),join_timeout=120")
    r = multihost(f"{torchrun} generate.py {shlex.join(map(str, flags + split))}", f"{PREFIX}c", "-o", tmp_path,
                  timeout=300)
    assert r.returncode == 0, r.stderr[-5000:]
    assert (tmp_path / "h0.out").read_text() == single.stdout and len(single.stdout) > 40
    assert (tmp_path / "h1.out").read_text() == ""
    assert namespaces(f"{PREFIX}c") == []
