"""Quality and size of quantized checkpoints against their float original, in one run.

Run from the repository root:

    python -m scripts.quant_report --model smollm2-135m
    python -m scripts.quant_report --model qwen2.5-coder-0.5b --max_tokens 16384
    python -m scripts.quant_report --model smollm2-135m --groupsize 128 --variants int4,int4-gptq

For checkpoints/MODEL it makes (with quantize.py, when missing) the int8, int4 and GPTQ int4
checkpoints (int4 groups of --groupsize, default 32), runs eval.py on each and on the float one
over the same text, and prints a table:
checkpoint size (and % of float32), perplexity (and % above float), against the targets: int8
within 1% of float, int4 g32 within 5%, GPTQ below round-to-nearest; int8 <= 30% of the float
size, int4 <= 18%. Decode speed is scripts/bench.py's job (--quantized int8,int4-g32).
Current figures: docs/benchmarks.md.
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
MODES = ("int8", "int4", "int4-gptq")  # quantize.py --mode


def run(cmd: list) -> str:
    result = subprocess.run([sys.executable, *map(str, cmd)], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    if result.returncode != 0:
        sys.exit(f"error: {' '.join(map(str, cmd[:3]))} ... failed (exit {result.returncode})")
    return result.stdout


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m scripts.quant_report", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="checkpoints/MODEL is the float checkpoint")
    parser.add_argument("--variants", default=",".join(MODES), help=f"comma-separated from {', '.join(MODES)}")
    parser.add_argument("--groupsize", type=int, default=32, help="int4 group size")
    parser.add_argument("--max_tokens", type=int, default=None, help="eval.py: score only the first N tokens")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here too")
    args = parser.parse_args(argv)
    base = REPO_ROOT / "checkpoints" / args.model
    if not (base / "config.json").exists():
        sys.exit(f"error: {base} not found (python download.py {args.model})")
    rows = {"float32": base}
    for mode in args.variants.split(","):
        if mode not in MODES:
            sys.exit(f"error: unknown variant {mode!r} (choose from {', '.join(MODES)})")
        label = mode if mode == "int8" else f"{mode}-g{args.groupsize}"  # quantize.py's default names
        out = base.parent / f"{base.name}-{label}"
        if not (out / "config.json").exists():
            print(f"[report] making {out}", file=sys.stderr, flush=True)
            group = [] if mode == "int8" else ["--groupsize", args.groupsize]
            run(["quantize.py", "--checkpoint", base, "--mode", mode, *group, "--out", out])
        rows[label] = out
    figures = {}
    for label, ckpt in rows.items():
        print(f"[report] eval.py on {ckpt}", file=sys.stderr, flush=True)
        extra = ["--max_tokens", args.max_tokens] if args.max_tokens else []
        last = run(["eval.py", "--checkpoint", ckpt, *extra]).strip().splitlines()[-1]
        figures[label] = {"perplexity": float(last.split()[1]),
                          "bytes": (ckpt / "model.safetensors").stat().st_size}
    fp32 = figures["float32"]
    print(f"\n{args.model}: eval.py on data/hamlet.txt{f' (first {args.max_tokens} tokens)' if args.max_tokens else ''}")
    print(f"{'checkpoint':16s} {'size MB':>8s} {'% of fp32':>9s} {'perplexity':>10s} {'vs fp32':>8s}")
    for label, x in figures.items():
        print(f"{label:16s} {x['bytes'] / 1e6:8.1f} {100 * x['bytes'] / fp32['bytes']:8.1f}% {x['perplexity']:10.3f} "
              f"{100 * (x['perplexity'] / fp32['perplexity'] - 1):+7.2f}%")
    checks = []
    if "int8" in figures:
        checks += [("int8 perplexity within 1%", figures["int8"]["perplexity"] <= 1.01 * fp32["perplexity"]),
                   ("int8 size <= 30%", figures["int8"]["bytes"] <= 0.30 * fp32["bytes"])]
    rtn, gptq = f"int4-g{args.groupsize}", f"int4-gptq-g{args.groupsize}"
    if rtn in figures:
        checks += [(f"int4 g{args.groupsize} perplexity within 5%", figures[rtn]["perplexity"] <= 1.05 * fp32["perplexity"]),
                   ("int4 size <= 18%", figures[rtn]["bytes"] <= 0.18 * fp32["bytes"])]
    if rtn in figures and gptq in figures:
        checks.append(("GPTQ closer to float than round-to-nearest",
                       figures[gptq]["perplexity"] < figures[rtn]["perplexity"]))
    for name, ok in checks:
        print(f"{'met' if ok else 'NOT MET'}: {name}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"model": args.model, "max_tokens": args.max_tokens, "figures": figures,
                                         "checks": dict(checks)}, indent=1))


if __name__ == "__main__":
    main()
