"""Tensor parallelism: decode tokens/s, per-rank memory and the communication per decode step,
for one process and for torchrun with N = 1, 2, ... ranks.

Run from the repository root:

    python -m scripts.bench_tp                                  # SmolLM2-135M, N = 1, 2, float32
    python -m scripts.bench_tp --ranks 1,2,3 --threads 1 --json bench-out/tp.json

Current figures and the commands that made them: docs/benchmarks.md.

Each configuration is generate.py in its own job, greedy, batch 1, exactly --max_new_tokens new
tokens (EOS ignored), compiled decode step (--no-compile for eager), --num_samples samples of which
the first is dropped; the median of the rest is reported. Rows:
  single      python generate.py, --threads threads per process
  tp N MODE   torchrun --standalone --nproc_per_node=N generate.py --tp_mode MODE, OMP_NUM_THREADS=--threads
              per rank (ranks * threads should not exceed the cores: ranks that compete for
              the same cores cannot speed up; N = 1 is the same code path with whole shards and
              one-rank collectives)
Memory per rank: the bytes of weights the rank holds, its anonymous resident memory after
generation, and its peak resident memory (which also counts the pages of the memory-mapped
checkpoint it touched while loading: page cache, reclaimable).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Once upon a time, there was a little"


def run(cmd: list, threads: int, timeout: float) -> None:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        sys.exit(f"error: {' '.join(map(str, cmd))} failed:\n{result.stderr[-2000:]}")


def measure(args, ranks: int, mode: str = "auto") -> dict:
    """ranks 0: one plain process; else torchrun with that many ranks, in tp.py's `mode`."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "metrics.json"
        gen = ["generate.py", "--checkpoint", args.checkpoint, "--prompt", PROMPT, "--max_new_tokens",
               args.max_new_tokens, "--ignore_eos", "--num_samples", args.num_samples, "--dtype", args.dtype,
               "--metrics_json", out, *(["--compile", "--wait_for_compile"] if args.compile else ["--no-compile"])]
        if ranks:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", *gen,
                   "--tp_mode", mode]
        else:
            cmd = [sys.executable, *gen]
        run([str(c) for c in cmd], args.threads, args.timeout)
        samples = json.loads(out.read_text())[1:] or json.loads(out.read_text())
    last = samples[-1]
    row = {
        "config": f"tp {ranks} {mode}" if ranks else "single",
        "decode_tokens_per_s": statistics.median(s["decode_tokens_per_s"] for s in samples),
        "inter_token_latency_median_ms": 1000 * statistics.median(s["inter_token_latency_median_s"] for s in samples),
        "peak_memory_bytes_per_rank": last.get("peak_memory_bytes_per_rank", [last["peak_memory_bytes"]]),
    }
    for key in ("weight_bytes_per_rank", "rss_anon_bytes_per_rank", "all_reduces_per_step",
                "all_reduce_bytes_per_step", "all_gathers_per_step", "all_gather_bytes_per_step"):
        row[key] = last.get(key)
    return row


def mb(xs) -> str:
    return " / ".join(f"{x / 1e6:.0f}" for x in xs) if xs else "-"


def run_options(parser: argparse.ArgumentParser, max_new_tokens: int, compile: bool):
    """The options of each generate.py process a multi-rank benchmark runs (bench_tp, bench_pp_groups)."""
    parser.add_argument("--threads", type=int, default=1, help="threads per process (per rank)")
    parser.add_argument("--dtype", default="float32", help="generate.py --dtype (default: float32)")
    parser.add_argument("--max_new_tokens", type=int, default=max_new_tokens)
    parser.add_argument("--num_samples", type=int, default=3, help="samples per configuration; the first is dropped")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=compile)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one configuration may take")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m scripts.bench_tp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=ROOT / "checkpoints" / "smollm2-135m",
                        help="our checkpoint directory (default: checkpoints/smollm2-135m)")
    parser.add_argument("--ranks", default="1,2", help="torchrun world sizes to measure, comma-separated")
    parser.add_argument("--tp_modes", default="exact,allreduce", help="tp.py modes to measure, comma-separated")
    parser.add_argument("--no-single", dest="single", action="store_false", help="skip the plain single-process row")
    run_options(parser, max_new_tokens=128, compile=True)
    args = parser.parse_args(argv)
    configs = ([(0, "")] if args.single else []) + [(int(n), mode) for n in args.ranks.split(",")
                                                   for mode in args.tp_modes.split(",")]
    rows = []
    for ranks, mode in configs:
        print(f"measuring {'single process' if ranks == 0 else f'{ranks} ranks, {mode}'}...", file=sys.stderr, flush=True)
        rows.append(measure(args, ranks, mode))
    print("| config | decode tok/s | weights per rank (MB) | anon RSS per rank (MB) | peak RSS per rank (MB) "
          "| all-reduces / step (bytes) | all-gathers / step (bytes) |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['config']} | {row['decode_tokens_per_s']:.1f} | {mb(row['weight_bytes_per_rank'])} "
              f"| {mb(row['rss_anon_bytes_per_rank'])} | {mb(row['peak_memory_bytes_per_rank'])} "
              f"| {row['all_reduces_per_step'] or '-'} ({row['all_reduce_bytes_per_step'] or '-'}) "
              f"| {row['all_gathers_per_step'] or '-'} ({row['all_gather_bytes_per_step'] or '-'}) |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
