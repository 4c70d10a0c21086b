"""Batch-1 decode of a mixture of experts against the dense model of its active size.

    python -m scripts.bench_moe                                # float32, bfloat16, int8; 3 rounds
    python -m scripts.bench_moe --dtypes float32 --rounds 1    # a quick look
    python -m scripts.bench_moe --json /tmp/moe.json           # the figures elsewhere than benchmarks/moe.json

Run from the repository root. Current figures and the command that made them: docs/benchmarks.md.

Two models with random, seeded weights, saved as checkpoints in a temporary directory and loaded
by loading.load_model (kernels.py's CPU paths installed), as generate.py does:
  moe    Mixtral-shaped: every layer's feed-forward is --experts SwiGLUs of hidden width
         --expert_hidden, of which the router picks --top_k per token
  dense  Llama-shaped, the same in every other way, one SwiGLU of hidden width
         top_k * expert_hidden: the weights a MoE decode step reads, minus the router's few
A decode step of the MoE should cost about what the dense one does: it reads top_k of the
experts (model.through_experts), so the bytes it reads are the dense step's plus the router.

Protocol: batch 1, greedy, compiled decode step (engine.Engine(compile=True), warmed up first, as
generate.py does), --threads threads, a --prompt_tokens-token prompt (random ids, the same for
both). Per precision both engines live in one process. A round decodes --max_new_tokens tokens
with each, in turns of --turn_tokens (a generate call each; its prefill is not timed) that
alternate between the engines, the first of each round rotating: a load that comes and goes on
a shared machine hits both alike. int8 is quantize.py --mode int8 of each float checkpoint, run
with float32 activations. Reported per precision: each engine's median decode tok/s over the
rounds, the median over the rounds of MoE step time / dense step time, and the same ratio of
the best rounds (noise on a shared machine only slows a run down).
"""
import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import quantize
from checkpoint import write_checkpoint
from engine import Engine
from loading import load_model
from model import ModelArgs, Transformer, param_bytes
from sampling import Sampling

ROOT = Path(__file__).resolve().parent.parent
DTYPES = ("float32", "bfloat16", "int8")


def log(*args):
    print(*args, file=sys.stderr, flush=True)


def model_args(args, moe: bool) -> ModelArgs:
    common = dict(vocab_size=args.vocab_size, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                  n_kv_heads=args.kv_heads, max_position_embeddings=4096)
    if moe:
        return ModelArgs(architecture="mixtral", intermediate_size=args.expert_hidden, n_experts=args.experts,
                         n_experts_per_token=args.top_k, **common)
    return ModelArgs(architecture="llama", intermediate_size=args.top_k * args.expert_hidden, **common)


def random_checkpoint(margs: ModelArgs, out: Path, seed: int) -> Path:
    """A checkpoint of random weights: N(0, 0.02) matrices, unit norms (drawn directly, no nn init)."""
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in Transformer(margs).state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    state = {name: torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=g) * 0.02
             for name, shape in shapes.items()}
    log(f"writing {out.name}: {sum(t.numel() for t in state.values()) / 1e6:.0f} M parameters")
    return write_checkpoint(out, margs, state)


def checkpoints(args, tmp: Path) -> dict:
    """kind ("moe" | "dense") -> {precision: checkpoint dir}."""
    out = {}
    for seed, kind in enumerate(("moe", "dense")):
        src = random_checkpoint(model_args(args, kind == "moe"), tmp / kind, seed)
        out[kind] = {"float32": src, "bfloat16": src}
        if "int8" in args.dtypes:
            quantize.main(["--checkpoint", str(src), "--mode", "int8", "--out", str(tmp / f"{kind}-int8")])
            out[kind]["int8"] = tmp / f"{kind}-int8"
    return out


def make_engine(path: Path, dtype: str, max_seq_length: int, prompt: list) -> Engine:
    model = load_model(path, dtype=torch.float32 if dtype == "int8" else getattr(torch, dtype))
    engine = Engine(model, 1, max_seq_length, compile=True)
    engine.warm_up([prompt], Sampling())
    return engine


def decode_turn(engine: Engine, prompt: list, n: int) -> tuple:
    """(decode steps, their seconds, the tokens) of one generate call of n new tokens."""
    (out,), stats = engine.generate([prompt], n, Sampling())
    assert len(out) == n, "a row stopped early: stop_ids are empty, so this is a bug"
    return len(stats.token_times) - 1, stats.decode_s, out


def bench_dtype(args, paths: dict, dtype: str, prompt: list) -> dict:
    torch._dynamo.reset()  # each precision's two graphs start from a clean recompile budget
    max_seq_length = len(prompt) + args.turn_tokens + 8
    engines = {}
    for kind in ("moe", "dense"):
        start = time.perf_counter()
        engines[kind] = make_engine(paths[kind][dtype], dtype, max_seq_length, prompt)
        log(f"  {dtype} {kind}: loaded and compiled in {time.perf_counter() - start:.0f} s")
    speeds = {kind: [] for kind in engines}
    outputs = {kind: None for kind in engines}
    order = list(engines)
    turns = -(-args.max_new_tokens // args.turn_tokens)
    for rnd in range(args.rounds):
        steps, seconds = {kind: 0 for kind in engines}, {kind: 0.0 for kind in engines}
        for _ in range(turns):  # short turns, so that a load that comes and goes hits both engines alike
            for kind in order[rnd % 2:] + order[:rnd % 2]:  # MoE first in even rounds, dense first in odd ones
                n, s, out = decode_turn(engines[kind], prompt, args.turn_tokens)
                steps[kind] += n
                seconds[kind] += s
                if outputs[kind] is not None and out != outputs[kind]:
                    log(f"  WARNING: {dtype} {kind} decoded other tokens than in its first turn")
                outputs[kind] = out
        for kind in engines:
            speeds[kind].append(steps[kind] / seconds[kind])
        log(f"  {dtype} round {rnd + 1}/{args.rounds}: moe {speeds['moe'][-1]:.1f} tok/s, "
            f"dense {speeds['dense'][-1]:.1f} tok/s, ratio {speeds['dense'][-1] / speeds['moe'][-1]:.2f}")
    step_bytes = {kind: param_bytes(e.model) for kind, e in engines.items()}
    held_bytes = {kind: param_bytes(e.model, tokens=args.experts) for kind, e in engines.items()}
    del engines
    return {
        "precision": dtype,
        "moe_tok_s": statistics.median(speeds["moe"]),
        "dense_tok_s": statistics.median(speeds["dense"]),
        "moe_time_over_dense": statistics.median(d / m for m, d in zip(speeds["moe"], speeds["dense"])),
        "best_moe_time_over_dense": max(speeds["dense"]) / max(speeds["moe"]),
        "moe_tok_s_rounds": speeds["moe"],
        "dense_tok_s_rounds": speeds["dense"],
        "moe_weight_bytes_per_step": step_bytes["moe"],
        "moe_weight_bytes_all_experts": held_bytes["moe"],
        "dense_weight_bytes_per_step": step_bytes["dense"],
    }


def machine() -> str:
    try:
        cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")), "")
    except OSError:
        name = platform.processor()
    return f"{torch.get_num_threads()} threads; {name or 'CPU'} ({torch.backends.cpu.get_cpu_capability()}), " \
           f"{platform.system()}, torch {torch.__version__}"


def commit() -> str:
    run = lambda *cmd: subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True).stdout.strip()  # noqa: E731
    return run("rev-parse", "--short", "HEAD") + (" (with uncommitted changes)" if run("status", "--porcelain", "-uno") else "")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m scripts.bench_moe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default=",".join(DTYPES), help=f"comma-separated, of {', '.join(DTYPES)} (default: all)")
    p.add_argument("--rounds", type=int, default=3, help="decode runs per engine and precision (default: 3)")
    p.add_argument("--max_new_tokens", type=int, default=128, help="decode tokens per engine and round (default: 128)")
    p.add_argument("--turn_tokens", type=int, default=16,
                   help="new tokens per generate call: a round alternates the engines in turns of this many (default: 16)")
    p.add_argument("--prompt_tokens", type=int, default=16, help="prompt length (default: 16)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    p.add_argument("--dim", type=int, default=1024, help="residual width (default: 1024)")
    p.add_argument("--layers", type=int, default=8, help="blocks (default: 8)")
    p.add_argument("--heads", type=int, default=16, help="query heads (default: 16)")
    p.add_argument("--kv_heads", type=int, default=4, help="key/value heads (default: 4)")
    p.add_argument("--vocab_size", type=int, default=32000, help="(default: 32000)")
    p.add_argument("--experts", type=int, default=8, help="experts per layer (default: 8)")
    p.add_argument("--top_k", type=int, default=2, help="experts per token (default: 2)")
    p.add_argument("--expert_hidden", type=int, default=1408,
                   help="each expert's hidden width; the dense model's is top_k times it (default: 1408)")
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "moe.json",
                   help="write the figures here (default: benchmarks/moe.json)")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    bad = [d for d in args.dtypes if d not in DTYPES]
    if bad or args.rounds < 1 or args.max_new_tokens < 2 or args.turn_tokens < 2 or args.prompt_tokens < 1:
        sys.exit(f"error: bad arguments {bad or ''} (--rounds >= 1, --max_new_tokens >= 2, --turn_tokens >= 2, "
                 "--prompt_tokens >= 1)")
    torch.set_num_threads(args.threads)
    prompt = torch.randint(0, args.vocab_size, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    rows = []
    with tempfile.TemporaryDirectory(prefix="minillm-bench-moe-") as tmp:
        paths = checkpoints(args, Path(tmp))
        for dtype in args.dtypes:
            log(f"{dtype}:")
            rows.append(bench_dtype(args, paths, dtype, prompt))
    print(f"MoE: {args.experts} experts of hidden {args.expert_hidden}, top-{args.top_k}; dense: hidden "
          f"{args.top_k * args.expert_hidden}; dim {args.dim}, {args.layers} layers, {args.heads}/{args.kv_heads} heads, "
          f"vocab {args.vocab_size}; batch 1, {args.max_new_tokens} new tokens, {args.rounds} round(s)")
    print("| weights | MoE tok/s | dense tok/s | MoE step time / dense | best round's, MoE / dense | MB read per step, MoE / dense |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['precision']} | {r['moe_tok_s']:.1f} | {r['dense_tok_s']:.1f} | {r['moe_time_over_dense']:.2f} "
              f"| {r['best_moe_time_over_dense']:.2f} "
              f"| {r['moe_weight_bytes_per_step'] / 1e6:.0f} / {r['dense_weight_bytes_per_step'] / 1e6:.0f} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "title": "Batch-1 decode: a random 8-expert top-2 MoE against the dense model of its active size",
            "machine": machine(),
            "date": datetime.date.today().isoformat(),
            "commit": commit(),
            "command": "python -m scripts.bench_moe " + " ".join(sys.argv[1:] if argv is None else argv),
            "config": {k: v for k, v in vars(args).items() if k != "json"},
            "rows": rows}, indent=1) + "\n")
        log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
