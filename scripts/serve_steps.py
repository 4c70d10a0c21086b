"""The server's engine of each checkout named, in one process each, driven through bench_serve's
default workload at concurrency 16 (32 requests of 256 random token ids, 128 tokens out, a new
request as one finishes) without HTTP: how many steps, how long each takes, tokens/s. What a
serving A/B looks like with the client and the sockets out of it.

    git worktree add /tmp/before 7cefa95
    python -m scripts.serve_steps . /tmp/before . /tmp/before --json benchmarks/serve-steps.json

A checkout at or after the one engine runs `Engine.for_serving`; one before it, `BatchEngine`."""
import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

WORKER = r'''
import json, random, statistics, sys, time
import torch
import engine as E
import serve
from sampling import Sampling
try:
    from loading import load_model
except ImportError:  # a checkout before loading.py
    load_model = E.load_model
model = load_model("checkpoints/smollm2-135m", torch.device("cpu"), torch.float32)
if hasattr(E, "BatchEngine"):
    eng, Req = E.BatchEngine(model, 16, 392, compile=True, prefill_chunk=256), E.Request
else:
    from scheduler import Request as Req
    eng = E.Engine.for_serving(model, 16, 392, compile=True, kv_tokens=16 * 392)
serve.warm_up(eng)
rng = random.Random(0)
queue = [[rng.randrange(49000) for _ in range(256)] for _ in range(32)]
reqs = []
def submit():
    if queue:
        r = Req(queue.pop(0), 128, Sampling(), on_finish=lambda r: submit())
        reqs.append(r)
        eng.submit(r)
for _ in range(16):
    submit()
times, t0 = [], time.perf_counter()
while queue or any(r.finish_reason is None for r in reqs):
    t = time.perf_counter()
    if eng.step():
        times.append(time.perf_counter() - t)
total = time.perf_counter() - t0
print(json.dumps({"total_s": total, "steps": len(times), "out_tok_s": sum(len(r.out) for r in reqs) / total,
                  "median_ms": 1000 * statistics.median(times), "p90_ms": 1000 * sorted(times)[int(0.9 * len(times))]}))
'''


def tree_arguments(prog: str, doc: str, argv=None) -> argparse.Namespace:
    """The command line of a script that runs a worker in each checkout named: trees, --json."""
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    p.add_argument("trees", nargs="+", type=Path, help="checkouts, run in this order (name one twice to alternate)")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def run_in_trees(worker: str, trees: list, json_path=None) -> list:
    """worker (Python source printing a JSON line last) run in each checkout in turn, one process
    each: a dict per run, with its tree; written to json_path with the date and command line."""
    runs = []
    for tree in trees:
        r = subprocess.run([sys.executable, "-c", worker], cwd=tree, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"error: {tree}: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")
        runs.append({"tree": str(tree), **json.loads(r.stdout.strip().splitlines()[-1])})
        print(json.dumps(runs[-1]), flush=True)
    if json_path:
        json_path.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "argv": sys.argv[1:], "runs": runs}, indent=1))
    return runs


def main(argv=None):
    args = tree_arguments("python -m scripts.serve_steps", __doc__, argv)
    runs = run_in_trees(WORKER, args.trees, args.json)
    by_tree = {}
    for run in runs:
        by_tree.setdefault(run["tree"], []).append(run["out_tok_s"])
    for tree, rates in by_tree.items():
        print(f"{tree}: {statistics.median(rates):.1f} tok/s (median of {len(rates)})")


if __name__ == "__main__":
    main()
