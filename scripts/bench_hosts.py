"""What a link costs: decode tokens/s and the median inter-token latency of SmolLM2-135M (float32,
greedy, batch 1, 64 new tokens, EOS ignored, eager: --no-compile, prompt "Once upon a time") in
one process, in two tensor-parallel ranks on this machine, and in two ranks on two hosts made by
scripts/multihost.sh, whose link each host delays by 0, 0.5 and 2 ms one way (tc netem).

Run from the repository root (the hosts need root):

    python -m scripts.bench_hosts --json benchmarks/hosts.json

Configurations (each generate.py run with --num_samples 2, the first sample dropped):
  single, 1 thread / 2 threads   python generate.py, OMP_NUM_THREADS=1 / 2
  torchrun N=2                   torchrun --standalone --nproc_per_node 2, OMP_NUM_THREADS=1
  2 hosts, delay D               multihost.sh -n 2 -d D, torchrun as in its header, OMP_NUM_THREADS=1
Every configuration runs --rounds times, the rounds interleaved; the medians are reported. A delay
that netem cannot apply here is recorded as unavailable. What a rank sends per token is computed
from the model's config (tp.py's collectives), not measured.
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from tp import head_split

ROOT = Path(__file__).resolve().parents[1]
GEN = ["generate.py", "--checkpoint", "checkpoints/smollm2-135m", "--prompt", "Once upon a time",
       "--dtype", "float32", "--max_new_tokens", "64", "--ignore_eos", "--no-compile", "--num_samples", "2"]
TORCHRUN = [".venv/bin/torchrun"]
HOSTS_RUN = (".venv/bin/torchrun --nnodes $NUM_HOSTS --nproc_per_node 1 --rdzv_backend c10d "
             "--rdzv_endpoint $MASTER_ADDR:$MASTER_PORT --local_addr $HOST_ADDR "
             "--rdzv_conf is_host=$((HOST_RANK == 0))")
CANNOT = 77  # multihost.sh: namespaces or the delay cannot be made here


def command(config: dict, out: Path) -> list:
    gen = [*GEN, "--metrics_json", str(out)]
    if config["kind"] == "single":
        return [sys.executable, *gen]
    if config["kind"] == "torchrun":
        return [*TORCHRUN, "--standalone", "--nproc_per_node", "2", *gen]
    line = f"OMP_NUM_THREADS=1 {HOSTS_RUN} {shlex.join(gen)}"
    return ["bash", "scripts/multihost.sh", "-n", "2", "-p", "benchhosts", "-t", "600",
            *(["-d", config["delay"]] if config["delay"] != "0ms" else []), "--", line]


def run_once(config: dict):
    """generate.py's metrics of the last sample (rank 0's), or the reason it could not run."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "metrics.json"
        env = dict(os.environ, OMP_NUM_THREADS=str(config.get("threads", 1)))
        r = subprocess.run(command(config, out), cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        if r.returncode == CANNOT:
            return r.stderr.strip().splitlines()[-1]
        if r.returncode != 0:
            sys.exit(f"error: {config['name']} failed:\n{r.stderr[-2000:]}")
        return json.loads(out.read_text())[-1]


def per_token_traffic(ranks: int = 2) -> dict:
    """What one rank's collectives carry per decoded token, from config.json and tp.py's plan."""
    cfg = json.loads((ROOT / "checkpoints/smollm2-135m/config.json").read_text())
    dim, layers, vocab, f32 = cfg["dim"], cfg["n_layers"], cfg["vocab_size"], 4
    hidden = cfg["intermediate_size"]
    # the heads' outputs split as tp.py splits the heads (by key-value groups), padded to the widest part
    widest_q = max(head_split(cfg["n_heads"], cfg["n_kv_heads"], ranks, r)[1] for r in range(ranks)) * cfg["head_dim"]
    # allreduce: after wo and w2 in each layer, and the vocab-split embedding; the logits all-gathered
    allreduce = {"all_reduces": 2 * layers + 1, "all_reduce_bytes": (2 * layers + 1) * dim * f32,
                 "all_gathers": 1, "all_gather_bytes": vocab * f32}
    # exact: around wo and w2 of each layer, their inputs and their outputs are all-gathered
    per_layer = ranks * widest_q + dim + hidden + dim
    exact = {"all_reduces": 1, "all_reduce_bytes": dim * f32, "all_gathers": 4 * layers + 1,
             "all_gather_bytes": (layers * per_layer + vocab) * f32}
    return {"note": f"computed from the config for {ranks} ranks, not measured; bytes: each collective's "
                    "full float32 result (tp.py's rank_metrics convention, padding included)",
            "allreduce": allreduce, "exact": exact}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m scripts.bench_hosts", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every configuration, interleaved")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    configs = [{"name": "single, 1 thread", "kind": "single", "threads": 1},
               {"name": "single, 2 threads", "kind": "single", "threads": 2},
               {"name": "torchrun N=2", "kind": "torchrun"},
               *({"name": f"2 hosts, delay {d}", "kind": "hosts", "delay": d} for d in ("0ms", "0.5ms", "2ms"))]
    results = {c["name"]: [] for c in configs}
    for rnd in range(args.rounds):
        for c in configs:
            if results[c["name"]] and isinstance(results[c["name"]][0], str):
                continue  # could not run here: no use trying again
            print(f"round {rnd + 1}: {c['name']}", file=sys.stderr, flush=True)
            results[c["name"]].append(run_once(c))
    rows = []
    for c in configs:
        got = results[c["name"]]
        if isinstance(got[0], str):
            rows.append({"config": c["name"], "unavailable": got[0]})
            continue
        tokens_per_s = [m["decode_tokens_per_s"] for m in got]
        rows.append({"config": c["name"], "decode_tokens_per_s_rounds": tokens_per_s,
                     "decode_tokens_per_s": statistics.median(tokens_per_s),
                     "inter_token_latency_median_ms":
                         1000 * statistics.median(m["inter_token_latency_median_s"] for m in got),
                     # tp.py's count of the collectives it hooked in, to check per_token_traffic against
                     **{k: got[-1][k] for k in ("all_reduces_per_step", "all_reduce_bytes_per_step",
                                                "all_gathers_per_step", "all_gather_bytes_per_step") if k in got[-1]}})
    print("| config | decode tok/s | inter-token ms |\n|---|---|---|")
    for row in rows:
        print(f"| {row['config']} | " + (f"{row['decode_tokens_per_s']:.1f} | {row['inter_token_latency_median_ms']:.1f} |"
                                          if "unavailable" not in row else f"unavailable: {row['unavailable']} | |"))
    if args.json:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "")
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "commit": git.stdout.strip(), "machine": model,
            "command": "python -m scripts.bench_hosts " + shlex.join(argv if argv is not None else sys.argv[1:]),
            "per_token_traffic_per_rank": per_token_traffic(), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
