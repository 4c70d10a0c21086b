"""Pipeline parallelism's decoding groups: decode tokens/s of a batch of requests on --pp stages,
the stages in turn (--pp_groups 1, lockstep) against groups whose steps are in the stages at once
(--pp_groups G), beside one process.

Run from the repository root:

    python -m scripts.bench_pp_groups                               # SmolLM2-135M float32, 8 requests, pp 2
    python -m scripts.bench_pp_groups --requests 8 --groups 1,2 --json bench-out/pp-groups.json

Each configuration is generate.py in its own job: --requests prompts at once, greedy, exactly
--max_new_tokens new tokens each (EOS ignored), --threads threads a rank, --num_samples samples
of which the first is dropped; the median of the rest is reported. decode tok/s counts every
request's tokens after the first (a time a round: every request one token on), and each row
checks that its text is the single process's. The ranks need a core each (stages * threads
cores) for their steps to overlap; on fewer, groups cannot gain and the figure says so.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from scripts.bench_tp import run_options

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Once upon a time, there was a little", "The capital of France is", "def fibonacci(n):",
           "The best way to learn a language is", "In 1969, the first", "Water boils at", "My favourite food is",
           "The following is a list of"]


def measure(args, groups: int) -> dict:
    """groups 0: one plain process; else torchrun with --pp stages and --pp_groups groups."""
    prompts = [arg for i in range(args.requests) for arg in ("--prompt", PROMPTS[i % len(PROMPTS)])]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "metrics.json"
        gen = ["generate.py", "--checkpoint", args.checkpoint, *prompts, "--max_new_tokens", args.max_new_tokens,
               "--ignore_eos", "--num_samples", args.num_samples, "--dtype", args.dtype, "--metrics_json", out,
               *(["--compile", "--wait_for_compile"] if args.compile else ["--no-compile"])]
        cmd = [sys.executable, *gen]
        if groups:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.pp}", *gen,
                   "--pp", args.pp, "--pp_groups", groups]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        r = subprocess.run([str(c) for c in cmd], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=args.timeout)
        if r.returncode != 0:
            sys.exit(f"error: {' '.join(map(str, cmd))} failed:\n{r.stderr[-2000:]}")
        samples = json.loads(out.read_text())[1:] or json.loads(out.read_text())
    return {"config": f"pp {args.pp}, groups {groups}" if groups else "single",
            "decode_tokens_per_s": statistics.median(s["decode_tokens_per_s"] for s in samples),
            "inter_token_latency_median_ms": 1000 * statistics.median(s["inter_token_latency_median_s"] for s in samples),
            "text": r.stdout}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m scripts.bench_pp_groups", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=ROOT / "checkpoints" / "smollm2-135m",
                        help="our checkpoint directory (default: checkpoints/smollm2-135m)")
    parser.add_argument("--requests", type=int, default=8, help="prompts decoded at once")
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages (ranks)")
    parser.add_argument("--groups", default="1,2", help="--pp_groups values to measure, comma-separated")
    run_options(parser, max_new_tokens=64, compile=False)
    args = parser.parse_args(argv)
    rows = []
    for groups in [0] + [int(g) for g in args.groups.split(",")]:
        print(f"measuring {'one process' if not groups else f'pp {args.pp}, --pp_groups {groups}'}...",
              file=sys.stderr, flush=True)
        rows.append(measure(args, groups))
    print(f"cores: {os.cpu_count()}, load average: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print("| config | decode tok/s | inter-token ms | text as one process's |")
    print("|---|---|---|---|")
    reference = rows[0]["text"]
    for row in rows:
        row["same_text"] = row.pop("text") == reference
        print(f"| {row['config']} | {row['decode_tokens_per_s']:.1f} | {row['inter_token_latency_median_ms']:.1f} "
              f"| {row['same_text']} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        flags = {k: str(v) for k, v in vars(args).items() if k != "json"}
        args.json.write_text(json.dumps(dict(flags, cores=os.cpu_count(), load=os.getloadavg(), rows=rows), indent=2))


if __name__ == "__main__":
    main()
