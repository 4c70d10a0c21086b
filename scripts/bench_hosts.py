"""What a link costs: decode tokens/s, the median inter-token latency, and the bytes and packets a
host sends per token, of a model (greedy, batch 1, EOS ignored, eager: --no-compile, prompt "Once
upon a time") in one process, in two tensor-parallel ranks on this machine, and split over two
hosts made by scripts/multihost.sh: tensor parallel (both of tp.py's modes) and pipeline parallel
(--pp 2, where generate.py has it), on links of full speed and limited to 1 Gbit/s and 100 Mbit/s
(tc tbf; delays need netem, which some kernels lack: they are left out).

Run from the repository root (the hosts need root):

    python -m scripts.bench_hosts --json benchmarks/hosts.json
    python -m scripts.bench_hosts --checkpoint checkpoints/qwen2.5-coder-1.5b --dtype bfloat16 \\
        --tokens 16 --json benchmarks/hosts-qwen-1.5b.json

Every configuration runs generate.py with --num_samples 2 (the first sample dropped) --rounds
times, the rounds interleaved; the medians are reported. Traffic per token is measured on the
wire: veth counters (what both hosts sent, TCP/IP headers and acknowledgements included) of a run
of --tokens new tokens less those of a run of a quarter as many, over the tokens between them.
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

ROOT = Path(__file__).resolve().parents[1]
HOSTS_RUN = (".venv/bin/torchrun --nnodes $NUM_HOSTS --nproc_per_node 1 --rdzv_backend c10d "
             "--rdzv_endpoint $MASTER_ADDR:$MASTER_PORT --local_addr $HOST_ADDR "
             "--rdzv_conf is_host=$((HOST_RANK == 0))")
CANNOT = 77  # multihost.sh: namespaces or the link's shaping cannot be made here
SAMPLES = 2


def generate_args(args, tokens: int, out: Path, extra=()) -> list:
    return ["generate.py", "--checkpoint", args.checkpoint, "--prompt", "Once upon a time", "--dtype", args.dtype,
            "--max_new_tokens", str(tokens), "--ignore_eos", "--no-compile", "--num_samples", str(SAMPLES),
            "--metrics_json", str(out), *extra]


def command(config: dict, gen: list) -> list:
    if config["kind"] == "single":
        return [sys.executable, *gen]
    if config["kind"] == "torchrun":
        return [".venv/bin/torchrun", "--standalone", "--nproc_per_node", "2", *gen]
    line = f"OMP_NUM_THREADS=1 {HOSTS_RUN} {shlex.join(gen)}"
    return ["bash", "scripts/multihost.sh", "-n", "2", "-p", "benchhosts", "-t", "1200",
            *(["-b", config["rate"]] if config.get("rate") else []), "-o", "{dir}", "--", line]


def run_once(config: dict, args, tokens: int):
    """(generate.py's metrics of the last sample, rank 0's; what both hosts sent: bytes, packets),
    or the reason it could not run here."""
    with tempfile.TemporaryDirectory() as tmp:
        out, links = Path(tmp) / "metrics.json", Path(tmp) / "hosts"
        cmd = [part.replace("{dir}", str(links)) for part in command(config, generate_args(args, tokens, out,
                                                                                          config.get("args", ())))]
        env = dict(os.environ, OMP_NUM_THREADS=str(config.get("threads", 1)))
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        if r.returncode == CANNOT:
            return r.stderr.strip().splitlines()[-1]
        if r.returncode != 0:
            sys.exit(f"error: {config['name']} failed:\n{r.stderr[-2000:]}")
        sent = [0, 0]
        for f in links.glob("h*.link"):
            tx = json.loads(f.read_text())[0]["stats64"]["tx"]
            sent = [sent[0] + tx["bytes"], sent[1] + tx["packets"]]
        return json.loads(out.read_text())[-1], sent


def configs(args) -> list:
    """Each configuration: a name, how it runs, and generate.py's extra flags."""
    help_text = subprocess.run([sys.executable, "generate.py", "--help"], cwd=ROOT, capture_output=True, text=True).stdout
    modes = [("TP 2", ["--tp_mode", "allreduce"]), ("TP 2 exact", ["--tp_mode", "exact"])]
    if "--pp" in help_text:
        modes.append(("PP 2", ["--pp", "2"]))
    out = [{"name": "one process, 1 thread", "kind": "single", "threads": 1},
           {"name": "one process, 2 threads", "kind": "single", "threads": 2},
           {"name": "torchrun TP 2, one machine", "kind": "torchrun", "args": ["--tp_mode", "allreduce"]}]
    for name, flags in modes:
        for rate in ("", *args.rates.split(",")) if args.rates else ("",):
            out.append({"name": f"2 hosts, {name}" + (f", {rate}" if rate else ""), "kind": "hosts", "rate": rate,
                        "args": flags, "traffic": not rate})
    return out


def summarize(config: dict, got: list, traffic) -> dict:
    if isinstance(got[0], str):
        return {"config": config["name"], "unavailable": got[0]}
    metrics = [m for m, _ in got]
    rates = [m["decode_tokens_per_s"] for m in metrics]
    row = {"config": config["name"], "decode_tokens_per_s_rounds": rates, "decode_tokens_per_s": statistics.median(rates),
           "inter_token_latency_median_ms": 1000 * statistics.median(m["inter_token_latency_median_s"] for m in metrics)}
    if traffic is not None:
        row.update(traffic)
    return row


def per_token(long_runs: list, short_runs: list, tokens: int, short: int) -> dict:
    """Bytes and packets both hosts sent per token: the long runs' less the short runs', per token between."""
    between = SAMPLES * (tokens - short)
    sent = [statistics.median(s[i] for _, s in long_runs) - statistics.median(s[i] for _, s in short_runs)
            for i in (0, 1)]
    return {"bytes_sent_per_token": sent[0] / between, "packets_sent_per_token": sent[1] / between}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m scripts.bench_hosts", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="checkpoints/smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens a sample")
    parser.add_argument("--rates", default="1gbit,100mbit", help="link rates to try besides full speed (tc's syntax)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every configuration, interleaved")
    parser.add_argument("--only", default=None, metavar="TEXT",
                        help="run only the configurations whose name contains TEXT (e.g. 'PP 2')")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    todo = [c for c in configs(args) if args.only is None or args.only in c["name"]]
    short = max(1, args.tokens // 4)
    results = {c["name"]: [] for c in todo}
    shorts = {c["name"]: [] for c in todo if c.get("traffic")}
    for rnd in range(args.rounds):
        for c in todo:
            if results[c["name"]] and isinstance(results[c["name"]][0], str):
                continue  # could not run here: no use trying again
            print(f"round {rnd + 1}: {c['name']}", file=sys.stderr, flush=True)
            results[c["name"]].append(run_once(c, args, args.tokens))
            if c["name"] in shorts and not isinstance(results[c["name"]][0], str):
                shorts[c["name"]].append(run_once(c, args, short))
    rows = [summarize(c, results[c["name"]], per_token(results[c["name"]], shorts[c["name"]], args.tokens, short)
                      if shorts.get(c["name"]) else None) for c in todo]
    print("| config | decode tok/s | inter-token ms | sent per token |\n|---|---|---|---|")
    for row in rows:
        if "unavailable" in row:
            print(f"| {row['config']} | unavailable: {row['unavailable']} | | |")
            continue
        sent = (f"{row['bytes_sent_per_token'] / 1000:.1f} kB, {row['packets_sent_per_token']:.0f} packets"
                if "bytes_sent_per_token" in row else "")
        print(f"| {row['config']} | {row['decode_tokens_per_s']:.1f} | {row['inter_token_latency_median_ms']:.1f} | {sent} |")
    if args.json:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "")
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "commit": git.stdout.strip(), "machine": model,
            "command": "python -m scripts.bench_hosts " + shlex.join(argv if argv is not None else sys.argv[1:]),
            "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
