"""An alternating A/B of two checkouts' generate.py: many short rounds, each weight setting run
after and before back to back (the order flips every round), so that a few percent can be told
apart on a machine whose bandwidth drifts by more than that from minute to minute.

    git worktree add /tmp/before HEAD~1
    python -m scripts.ab_decode --before /tmp/before --weights float32,bfloat16,int8,int4-g32 --rounds 12

Each run is one generate.py process: the short prompt, --max_new_tokens tokens with EOS ignored,
--samples samples of which the first (compilation) is dropped; its figure is the median of the
rest. Reported per weight setting: the median of the rounds' after/before ratios, how many rounds
after was ahead, and a 95% interval of that median from resampling the rounds (bootstrap), for
decode tok/s and the TTFT of the prompt given (--long for the 494-token one)."""
import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from scripts.bench import LONG_PROMPT, QUANTIZED, REPO_ROOT, SHORT_PROMPT, quantized_checkpoint, run_process


def knows(tree: Path, flag: str) -> bool:
    """Whether the checkout's generate.py takes flag."""
    return any(flag in f.read_text() for f in (tree / "generate.py", tree / "generate_args.py") if f.exists())


def generate_command(tree: Path, checkpoint: Path, weights: str, prompt: str, args, out: Path) -> list:
    """`tree`'s generate.py, greedy and compiled, args.samples samples of args.max_new_tokens tokens
    (EOS ignored), their metrics to out."""
    dtype = "float32" if weights in QUANTIZED else weights
    cmd = [sys.executable, str(tree / "generate.py"), "--checkpoint", str(checkpoint), "--prompt", prompt,
           "--max_new_tokens", str(args.max_new_tokens), "--temperature", "0", "--dtype", dtype, "--compile",
           "--ignore_eos", "--num_samples", str(args.samples), "--metrics_json", str(out)]
    if knows(tree, "--wait_for_compile"):  # an older checkout has no aside compile: it compiles first anyway
        cmd.append("--wait_for_compile")
    return cmd


def add_checkout_options(p: argparse.ArgumentParser):
    """The options an A/B of two checkouts' generate.py shares."""
    p.add_argument("--before", type=Path, required=True, help="the other checkout (a git worktree)")
    p.add_argument("--checkpoint", type=Path, default=REPO_ROOT / "checkpoints" / "smollm2-135m")
    p.add_argument("--weights", default="float32,bfloat16,int8,int4-g32",
                   help=f"comma-separated: float32, bfloat16, {', '.join(QUANTIZED)}")
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--long", action="store_true", help="the 494-token prompt, not the short one")
    p.add_argument("--json", type=Path, default=None)


def weight_settings(args) -> dict:
    """--weights: each setting's checkpoint (a quantized copy made where missing)."""
    weights = args.weights.split(",")
    if unknown := [w for w in weights if w not in ("float32", "bfloat16", *QUANTIZED)]:
        sys.exit(f"error: unknown weights {', '.join(unknown)}")
    return {w: quantized_checkpoint(args, w) if w in QUANTIZED else args.checkpoint for w in weights}


def one_run(tree: Path, checkpoint: Path, weights: str, prompt: str, args, out: Path) -> dict:
    """Median decode tok/s and TTFT (ms) of one generate.py process of `tree`."""
    cmd = generate_command(tree, checkpoint, weights, prompt, args, out)
    metrics, err, _ = run_process(cmd, out, out.with_suffix(".log"), 1200)
    if err:
        sys.exit(f"error: {tree}/generate.py failed on {weights}: {err}")
    kept = metrics[1:]
    return {"decode": statistics.median(m["decode_tokens_per_s"] for m in kept),
            "ttft_ms": 1000 * statistics.median(m["ttft_s"] for m in kept)}


def bootstrap(ratios: list, draws: int = 2000, seed: int = 0) -> tuple:
    """A 95% interval of the median of ratios, resampling them with replacement."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def summary(rounds: list, weights: str, figure: str, higher_better: bool) -> dict:
    ratios = [r["after"][figure] / r["before"][figure] for r in rounds if r["weights"] == weights]
    low, high = bootstrap(ratios)
    ahead = sum((x > 1) == higher_better for x in ratios)
    return {"weights": weights, "figure": figure, "median_ratio": statistics.median(ratios), "ci95": [low, high],
            "rounds": len(ratios), "rounds_after_ahead": ahead, "ratios": ratios}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m scripts.ab_decode", description=__doc__.split("\n\n")[0])
    add_checkout_options(p)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--samples", type=int, default=3, help="per process; the first is dropped")
    args = p.parse_args(argv)
    checkpoints = weight_settings(args)
    weights = list(checkpoints)
    prompt = LONG_PROMPT if args.long else SHORT_PROMPT
    rounds, work = [], Path(tempfile.mkdtemp(prefix="minillm-ab-"))
    for i in range(args.rounds):
        for w in weights:
            order = [("after", REPO_ROOT), ("before", args.before)][::(-1 if i % 2 else 1)]
            got = {name: one_run(tree, checkpoints[w], w, prompt, args, work / f"{i}-{w}-{name}.json")
                   for name, tree in order}
            rounds.append({"round": i, "weights": w, **got})
            print(f"round {i} {w:9s} decode after/before {got['after']['decode']:.1f}/{got['before']['decode']:.1f} "
                  f"TTFT {got['after']['ttft_ms']:.0f}/{got['before']['ttft_ms']:.0f} ms", flush=True)
    table = [summary(rounds, w, f, f == "decode") for w in weights for f in ("decode", "ttft_ms")]
    for s in table:
        print(f"{s['weights']:9s} {s['figure']:8s} after/before median {s['median_ratio']:.3f} "
              f"(95% {s['ci95'][0]:.3f}-{s['ci95'][1]:.3f}), after ahead in {s['rounds_after_ahead']} of {s['rounds']}")
    if args.json:
        commit = __import__("subprocess").run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                                              capture_output=True, text=True).stdout.strip()
        args.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "commit": commit, "argv": sys.argv[1:],
                                         "summary": table, "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
