"""Draw the figures of docs/ from the measured results in benchmarks/*.json.

    python -m scripts.plot_bench                 # every figure into docs/
    python -m scripts.plot_bench --only decode   # one of: decode, models, speculative, quantization

Figures (each file's machine, date and commit go into the figure's caption):
  docs/decode.png        decode tokens/s per precision, ours against llama.cpp and transformers, with
                         the memory-bandwidth ceiling (weight bytes / measured bandwidth)
                         (benchmarks/decode-smollm2.json)
  docs/models.png        decode tokens/s per offline model and precision, ours against llama.cpp
                         (int8 against Q8_0, int4 against Q4_1), with the bandwidth ceiling
                         (benchmarks/decode-models.json)
  docs/speculative.png   speed-up over plain decoding per case, fixed k against adaptive k
                         (benchmarks/speculative.json)
  docs/quantization.png  perplexity against file size per quantization scheme
                         (benchmarks/quantization.json)

To add a measured run, edit the JSON (or replace it with a new run's figures) and run this again.
"""
import argparse
import json
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ENGINES = {"ours": "#1f77b4", "llama.cpp": "#ff7f0e", "transformers": "#2ca02c"}


def load(name: str) -> dict:
    return json.loads((ROOT / "benchmarks" / name).read_text())


def caption(fig, d: dict, text: str = ""):
    fig.text(0.01, 0.01, f"{text}{d['date']}, commit {d['commit']}; {d['machine'].split(' (')[0]}",
             fontsize=7, color="0.35", wrap=True)


def plot_decode(out: Path):
    d = load("decode-smollm2.json")
    precisions = list(d["weight_bytes"])
    fig, ax = plt.subplots(figsize=(8, 4.8))
    width = 0.26
    for i, (engine, color) in enumerate(ENGINES.items()):
        for j, precision in enumerate(precisions):
            row = next((r for r in d["rows"] if r["engine"] == engine and r["precision"] == precision), None)
            if row is None:
                continue
            tok_s = row["decode_tok_s"]
            lo, hi = (min(tok_s), max(tok_s)) if isinstance(tok_s, list) else (tok_s, tok_s)
            x = j + (i - 1) * width
            ax.bar(x, (lo + hi) / 2, width, color=color, label=engine, zorder=2,
                   yerr=[[(hi - lo) / 2], [(hi - lo) / 2]] if hi > lo else None, capsize=3)
            ax.annotate(f"{lo:g}-{hi:g}" if hi > lo else f"{hi:g}", (x, hi), ha="center", va="bottom",
                        fontsize=8, xytext=(0, 2), textcoords="offset points")
    # what reading every weight once per token allows, at the machine's measured bandwidth range
    bw_lo, bw_hi = d["memory_bandwidth_GBps"]
    for j, precision in enumerate(precisions):
        nbytes = d["weight_bytes"][precision]
        ax.fill_between([j - 0.45, j + 0.45], bw_lo * 1e9 / nbytes, bw_hi * 1e9 / nbytes,
                        color="0.6", alpha=0.35, zorder=1,
                        label=f"bandwidth ceiling ({bw_lo}-{bw_hi} GB/s / weight bytes)" if j == 0 else None)
    handles, labels = ax.get_legend_handles_labels()
    seen = dict(zip(labels, handles))
    ax.legend(seen.values(), seen.keys(), fontsize=8, loc="upper left")
    ax.set_xticks(range(len(precisions)), [f"{p}\n{d['weight_bytes'][p] / 1e6:.0f} MB" for p in precisions])
    ax.set_ylabel("decode tokens/s (batch 1, 2 threads)")
    ax.set_title("SmolLM2-135M decode speed per precision")
    ax.set_ylim(0, max(bw_hi * 1e9 / b for b in d["weight_bytes"].values()) * 1.08)
    caption(fig, d, "A missing bar: not measured in this run. ")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(out, dpi=120)


def plot_models(out: Path):
    """Each bar is decode tokens/s over the bandwidth ceiling (the run's median measured GB/s over
    the weight bytes a token reads), so that models of every size share one linear axis; the
    labels give the tokens/s."""
    d = load("decode-models.json")
    groups = [(m, p) for m in d["models"] for p in ("float32", "bfloat16", "int8", "int4-g32") if p in m["weight_bytes"]]
    fig, ax = plt.subplots(figsize=(max(10, 1.0 * len(groups)), 4.6))
    width = 0.38
    for j, (m, precision) in enumerate(groups):
        bws = sorted(m["memory_bandwidth_GBps_rounds"])
        ceiling = bws[len(bws) // 2] * 1e9 / m["weight_bytes"][precision]
        for i, engine in enumerate(["ours", "llama.cpp"]):
            row = next((r for r in m["rows"] if r["engine"] == engine and r["precision"] == precision), None)
            if row is None:
                continue
            x, y = j + (i - 0.5) * width, row["decode_tok_s"] / ceiling
            ax.bar(x, y, width, color=ENGINES[engine], label=engine, zorder=2)
            ax.annotate(f"{row['decode_tok_s']:g}", (x, y), ha="center", va="bottom", fontsize=7,
                        xytext=(0, 2), textcoords="offset points")
    ax.axhline(1.0, color="0.3", linestyle="dashed", zorder=3, label="bandwidth ceiling")
    handles, labels = ax.get_legend_handles_labels()
    seen = dict(zip(labels, handles))
    ax.legend(seen.values(), seen.keys(), fontsize=8, loc="upper left")
    ax.set_xticks(range(len(groups)), [f"{m['model'].replace('-coder', '')}\n{p}" for m, p in groups], fontsize=7)
    ax.set_ylabel("decode speed / bandwidth ceiling")
    ax.set_title("Decode tokens/s per model and precision (labels), batch 1, 2 threads")
    caption(fig, d, "Ceiling: the run's median measured bandwidth over the weight bytes a token of ours reads. ")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(out, dpi=120)


def plot_speculative(out: Path):
    d = load("speculative.json")
    cases = d["cases"]
    fig, ax = plt.subplots(figsize=(8, 4.4))
    width = 0.38
    kinds = [("fixed_k", "fixed k", "#9ecae1"), ("adaptive_k", "adaptive k", "#1f77b4")]
    for i, (key, label, color) in enumerate(kinds):
        xs = [j + (i - 0.5) * width for j in range(len(cases))]
        speedups = [c[key]["speedup"] for c in cases]
        ax.bar(xs, speedups, width, label=label, color=color)
        for x, s in zip(xs, speedups):
            ax.annotate(f"{s:.2f}x", (x, s), ha="center", va="bottom", fontsize=8, xytext=(0, 2),
                        textcoords="offset points")
    ax.axhline(1.0, color="0.3", lw=1, ls="--")
    ax.set_xticks(range(len(cases)), [f"{c['case']}\n({c['plain_tok_s']:g} tok/s plain)" for c in cases])
    ax.set_ylabel("speed-up over plain decoding")
    ax.set_title("Speculative decoding, greedy (output identical to plain decoding)")
    ax.legend(fontsize=8)
    caption(fig, d)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(out, dpi=120)


def plot_quantization(out: Path):
    d = load("quantization.json")
    fig, axes = plt.subplots(1, len(d["models"]), figsize=(9, 4.2))
    for ax, (model, m) in zip(axes, d["models"].items()):
        sizes = [r["bytes"] / 1e6 for r in m["rows"]]
        base = next(r["perplexity"] for r in m["rows"] if r["scheme"] == "float32")
        ax.axhline(base, color="0.6", lw=1, ls="--", zorder=1)
        for row in m["rows"]:
            marker = "s" if row["scheme"] == "float32" else "^" if row.get("gptq") else "o"
            ax.scatter(row["bytes"] / 1e6, row["perplexity"], marker=marker, s=40, zorder=3,
                       color="0.2" if row["scheme"] == "float32" else "#d62728" if row.get("gptq") else "#1f77b4")
            ax.annotate(row["scheme"], (row["bytes"] / 1e6, row["perplexity"]), fontsize=7,
                        xytext=(5, -10 if row.get("gptq") else 4), textcoords="offset points")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xticks([t for t in (50, 100, 200, 500, 1000, 2000, 5000) if 0.7 * min(sizes) < t < 1.5 * max(sizes)])
        ax.margins(x=0.2, y=0.1)
        ax.set_xlabel("file size (MB, log scale)")
        ax.set_ylabel("perplexity (lower is better; dashed: float32)")
        ax.set_title(f"{model}, first {m['eval_tokens']:,} tokens of Hamlet", fontsize=9)
        ax.grid(alpha=0.3)
    fig.suptitle("Quantization: size against perplexity (circles round to nearest, triangles GPTQ)", fontsize=10)
    caption(fig, d)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(out, dpi=120)


FIGURES = {"decode": plot_decode, "models": plot_models, "speculative": plot_speculative, "quantization": plot_quantization}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=list(FIGURES), help="draw one figure instead of all")
    p.add_argument("--out_dir", type=Path, default=ROOT / "docs", help="where the PNGs go (default: docs/)")
    a = p.parse_args(argv)
    a.out_dir.mkdir(parents=True, exist_ok=True)
    for name in [a.only] if a.only else FIGURES:
        path = a.out_dir / f"{name}.png"
        FIGURES[name](path)
        print(path)


if __name__ == "__main__":
    main()
