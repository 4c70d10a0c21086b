r"""Benchmark our generate.py against its peers on the same weights, in one run.

Run from the repository root:

    python -m scripts.bench                      # SmolLM2-135M, float32 + bfloat16, 3 rounds
    python -m scripts.bench --quick              # smoke test: 1 round, 32 new tokens
    python -m scripts.bench --llama_quants Q8_0,ORIG --json bench-out/bench.json
    python -m scripts.bench --engines ours,llama --dtypes float32,bfloat16 \
        --quantized int8,int4-g32 --llama_quants Q8_0,Q4_1     # quantized weights
    git worktree add /tmp/before HEAD~1 && python -m scripts.bench --engines ours \
        --before /tmp/before --quantized int8,int4-g32          # a change, before and after
    python -m scripts.bench --shape llama-2-7b --device cuda --dtypes bfloat16 \
        --quantized int8,int4-g32,int4-g64 --batch_sizes 1,8,32,64   # 7B random weights, ours alone

--shape (a model shape with random weights, shapes.py: no peers, no checkpoint) is run by
scripts/bench_shapes.py; its docstring says how.

Current figures and the commands that made them: docs/benchmarks.md.

Engines (--engines), each started in its own subprocess, all fed the same prompt token ids:
  ours        generate.py --compile (torch.compile of the decode step)
  ours-max    generate.py --compile --compile_mode max (frozen weights, inductor GEMM kernels)
  ours-prefill generate.py --compile --compile_prefill (the prefill compiled too, dynamic shapes)
  ours-eager  generate.py --no-compile
  ours-before generate.py --compile of another checkout (--before DIR, e.g. a git worktree of an
              earlier commit): a change's before and after in the same interleaved rounds
  hf          Hugging Face transformers' best configuration: static cache +
              torch.compile(model.forward, mode="reduce-overhead", fullgraph=True) on CPU;
              on a GPU generate() compiles the forward itself (CUDA graphs)
  hf-eager    transformers with its default dynamic cache, no compile
  llama       llama.cpp through llama-cpp-python, on F32/BF16 GGUFs of the same weights

Weights: ours read checkpoints/NAME (made by `python download.py NAME` from a GGUF);
transformers loads that GGUF and dequantizes it the way our converter does; llama.cpp runs an
F32 GGUF written from the dequantized tensors (same metadata) and a BF16 one made from it by
llama_model_quantize. Those files are cached in $MINILLM_CACHE/bench (default
~/.cache/minillm/bench). --llama_quants adds llama.cpp rows at Q8_0 (quantized from the F32 file)
and ORIG (the GGUF as shipped, for SmolLM2 Q4_1 with a Q8_0 embedding).

Protocol: batch 1, 2 threads everywhere (OMP_NUM_THREADS=2, torch.set_num_threads(2),
n_threads=2), greedy, exactly --max_new_tokens new tokens (EOS ignored). Every engine runs each
prompt in a process of its own, --num_samples times, and drops the first run (compilation and
warm-up); the median of the rest is that round's figure. In a round the runs that are compared
(ours float32 and llama.cpp F32, ours int8 and Q8_0, ...) run back to back, their order reversed
every round, so that a machine whose bandwidth drifts over minutes favours no engine; the table
shows the median over rounds, and a ratio column the median of each round's ratio.
Decode tokens/s is measured after the short prompt; time to first token (TTFT: prefill plus the
first token) for the short prompt and for a long one (the opening of Moby-Dick).
Memory bandwidth is measured in every round over 1 GiB of float32, 2 threads, best of 5, as the
faster of torch's sum and kernels.stream_sum (plain reads in 1-8 streams per thread); "% bw" is an
engine's achieved bandwidth (weight bytes x decode steps/s; ours as generate.py reports it) over
the median measured bandwidth.

llama.cpp is optional: without llama-cpp-python its rows are skipped with a message. It builds
from source (several minutes) and the CPU flags must match the machine
(`grep -o 'avx512[a-z_]*\|amx[a-z_]*' /proc/cpuinfo | sort -u`): a flag the CPU lacks gives
"Illegal instruction" on the first model load. Keep AMX off: ggml's AMX code has crashed on
Q4_1/Q8_0 decoding. On an AVX2-only CPU:

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" CMAKE_BUILD_PARALLEL_LEVEL=2 pip install --no-cache-dir --force-reinstall --no-deps llama-cpp-python==0.3.36

On an AVX-512 CPU:

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" CMAKE_BUILD_PARALLEL_LEVEL=2 pip install --no-cache-dir llama-cpp-python==0.3.36

Where a llama.cpp of that version is already built (its build/bin holds libllama.so and
libggml*.so), the bindings can skip the build and load it:

    CMAKE_ARGS="-DLLAMA_BUILD=OFF" pip install --no-cache-dir llama-cpp-python==0.3.36
    export LLAMA_CPP_LIB_PATH=/path/to/llama.cpp/build/bin

The table goes to stdout, progress to stderr, every raw number to --json.
"""
import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import download
from scripts.bench_peers import THREADS, gguf_variant, quantized_activations

REPO_ROOT = Path(__file__).resolve().parent.parent

SHORT_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."

# Herman Melville, Moby-Dick (1851), chapter 1; public domain. About 500 tokens.
LONG_PROMPT = """\
Call me Ishmael. Some years ago--never mind how long precisely--having little or no money in my \
purse, and nothing particular to interest me on shore, I thought I would sail about a little and see \
the watery part of the world. It is a way I have of driving off the spleen and regulating the \
circulation. Whenever I find myself growing grim about the mouth; whenever it is a damp, drizzly \
November in my soul; whenever I find myself involuntarily pausing before coffin warehouses, and \
bringing up the rear of every funeral I meet; and especially whenever my hypos get such an upper hand \
of me, that it requires a strong moral principle to prevent me from deliberately stepping into the \
street, and methodically knocking people's hats off--then, I account it high time to get to sea as \
soon as I can. This is my substitute for pistol and ball. With a philosophical flourish Cato throws \
himself upon his sword; I quietly take to the ship. There is nothing surprising in this. If they but \
knew it, almost all men in their degree, some time or other, cherish very nearly the same feelings \
towards the ocean with me.

There now is your insular city of the Manhattoes, belted round by wharves as Indian isles by coral \
reefs--commerce surrounds it with her surf. Right and left, the streets take you waterward. Its \
extreme downtown is the battery, where that noble mole is washed by waves, and cooled by breezes, \
which a few hours previous were out of sight of land. Look at the crowds of water-gazers there.

Circumambulate the city of a dreamy Sabbath afternoon. Go from Corlears Hook to Coenties Slip, and \
from thence, by Whitehall, northward. What do you see?--Posted like silent sentinels all around the \
town, stand thousands upon thousands of mortal men fixed in ocean reveries. Some leaning against the \
spiles; some seated upon the pier-heads; some looking over the bulwarks of ships from China; some \
high aloft in the rigging, as if striving to get a still better seaward peep. But these are all \
landsmen; of week days pent up in lath and plaster--tied to counters, nailed to benches, clinched to \
desks. How then is this? Are the green fields gone? What do they here?"""

PROMPTS = {"short": SHORT_PROMPT, "long": LONG_PROMPT}

ENGINES = {  # name -> label in the table
    "ours": "ours (compiled decode)",
    "ours-max": "ours (--compile_mode max)",
    "ours-prefill": "ours (--compile_prefill)",
    "ours-eager": "ours (eager)",
    "ours-before": "ours, --before tree",
    "hf": "transformers static+compile",
    "hf-eager": "transformers eager",
    "llama": "llama.cpp",
}
LLAMA_KIND = {"float32": "F32", "bfloat16": "BF16"}  # our dtype -> llama.cpp file type
# our quantized checkpoints (--quantized) -> quantize.py arguments, and the llama.cpp type they face
QUANTIZED = {"int8": (["--mode", "int8"], "Q8_0"), "int4-g32": (["--mode", "int4", "--groupsize", "32"], "Q4_1"),
             "int4-gptq-g32": (["--mode", "int4-gptq", "--groupsize", "32"], "Q4_1")}


def log(*args):
    print("[bench]", *args, file=sys.stderr, flush=True)


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


# ---------------------------------------------------------------- setup

def resolve_weights(args):
    """(checkpoint dir, source GGUF path) for --model unless --checkpoint/--gguf say otherwise."""
    checkpoint = args.checkpoint or REPO_ROOT / "checkpoints" / args.model
    gguf = args.gguf
    if gguf is None:
        if args.model not in download.MODELS:
            sys.exit(f"error: unknown --model {args.model!r}; pass --gguf for other weights")
        gguf = download.fetch_gguf(args.model)  # downloaded (once) and verified
    return Path(checkpoint), Path(gguf)


def bench_cache_dir() -> Path:
    return Path(os.environ.get("MINILLM_CACHE") or Path.home() / ".cache" / "minillm") / "bench"


def tokenize_prompts(gguf: Path, checkpoint: Path) -> dict:
    """Prompt token ids from the transformers GGUF tokenizer: what hf and llama.cpp are fed.
    Ours tokenizes the same text itself; check here that it gets the same ids."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    ids = {name: tok(text).input_ids for name, text in PROMPTS.items()}
    try:
        from tokenizer import Tokenizer
        ours = Tokenizer(checkpoint)
        for name, text in PROMPTS.items():
            if ours.encode(text) != ids[name]:
                log(f"WARNING: our tokenizer and transformers' disagree on the {name} prompt "
                    f"({len(ours.encode(text))} vs {len(ids[name])} tokens): engines see different ids")
    except Exception as e:  # no checkpoint or tokenizer.py yet: the prompt_tokens check still runs
        log(f"(could not compare with our tokenizer: {e})")
    return ids


SAME = {"F32": "float32", "BF16": "bfloat16", "Q8_0": "int8", "Q4_1": "int4-g32"}  # a peer's file type -> our dtype


def engine_jobs(args, llama_ok: bool) -> list:
    """(engine, dtype) pairs of one round; llama.cpp rows use its file types as dtype."""
    jobs = []
    for engine in args.engines:
        if engine == "llama":
            if not llama_ok:
                continue
            kinds = [LLAMA_KIND[d] for d in args.dtypes] + args.llama_quants
            jobs += [(engine, k) for k in dict.fromkeys(kinds)]
        else:
            jobs += [(engine, d) for d in args.dtypes]
            if engine in ("ours", "ours-max", "ours-before"):
                jobs += [(engine, q) for q in args.quantized]  # weights quantized, activations float32
    return jobs


def round_order(jobs: list, rnd: int) -> list:
    """The jobs of round rnd: those compared with each other (ours float32 and llama.cpp F32) run
    back to back, so that their ratio is taken minutes apart at most on a machine whose
    bandwidth drifts; the groups rotate and the order within each group reverses every round,
    so no engine always runs first."""
    groups = {}
    for engine, dtype in jobs:
        groups.setdefault(SAME.get(dtype, dtype), []).append((engine, dtype))
    groups = list(groups.values())
    shift = rnd % len(groups) if groups else 0
    return [job for group in groups[shift:] + groups[:shift] for job in (group[::-1] if rnd % 2 else group)]


def quantized_checkpoint(args, label: str) -> Path:
    """checkpoints/NAME-<label>, made by quantize.py if it is not there yet."""
    path = args.checkpoint.parent / f"{args.checkpoint.name}-{label}"
    if not (path / "config.json").exists():
        log(f"making {path} with quantize.py")
        result = subprocess.run([sys.executable, "quantize.py", "--checkpoint", str(args.checkpoint),
                                 *QUANTIZED[label][0], "--out", str(path)], cwd=REPO_ROOT)
        if result.returncode != 0:
            sys.exit(f"error: quantize.py failed for {label}")
    return path


# ---------------------------------------------------------------- subprocesses

def subprocess_env(**extra) -> dict:
    return dict(os.environ, OMP_NUM_THREADS=str(THREADS), MKL_NUM_THREADS=str(THREADS),
                TOKENIZERS_PARALLELISM="false", **extra)


def run_process(cmd: list, out: Path, logfile: Path, timeout: float):
    """Run cmd, output to logfile; return (JSON it wrote to out or None, error text or None, wall s)."""
    start = time.perf_counter()
    try:
        with open(logfile, "w") as f:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=subprocess_env(),
                                timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    wall = time.perf_counter() - start
    if rc == 0 and out.exists():
        return json.loads(out.read_text()), None, wall
    tail = "\n".join(logfile.read_text(errors="replace").splitlines()[-15:])
    hint = " (illegal instruction: llama-cpp-python was built for another CPU, see --help)" if rc == -4 else ""
    return None, f"exit {rc}{hint}; log {logfile}:\n{tail}", wall


def peers_cmd(worker: str, out: Path, *flags) -> list:
    return [sys.executable, "-m", "scripts.bench_peers", worker, "--out", str(out), *map(str, flags)]


def run_ours(args, engine, dtype, ids, workdir: Path, tag: str) -> dict:
    """generate.py once per prompt; drop sample 0 (compilation), keep the rest."""
    runs, warmup, errors, wall = {}, {}, [], 0.0
    for name, text in PROMPTS.items():
        out = workdir / f"{tag}-{name}.json"
        checkpoint = args.checkpoint if dtype not in QUANTIZED else quantized_checkpoint(args, dtype)
        tree = args.before if engine == "ours-before" else REPO_ROOT
        cmd = [sys.executable, str(tree / "generate.py"), "--checkpoint", str(checkpoint),
               "--prompt", text, "--max_new_tokens", str(args.max_new_tokens), "--temperature", "0",
               "--device", args.device, "--dtype", quantized_activations(args.device) if dtype in QUANTIZED else dtype,
               *(["--no-compile"] if engine == "ours-eager" else ["--compile", "--wait_for_compile"]),
               *(["--compile_mode", "max"] if engine == "ours-max" else []),
               *(["--compile_prefill"] if engine == "ours-prefill" else []),
               "--ignore_eos", "--num_samples", str(args.num_samples), "--metrics_json", str(out)]
        # the other tree builds its own CPU kernels (kernels.build_name keys the build by checkout)
        metrics, err, seconds = run_process(cmd, out, workdir / f"{tag}-{name}.log", args.timeout)
        wall += seconds
        if err:
            errors.append(f"{name}: {err}")
            continue
        if metrics[0]["prompt_tokens"] != len(ids[name]):
            log(f"WARNING: ours saw {metrics[0]['prompt_tokens']} prompt tokens for the {name} prompt, "
                f"the peers {len(ids[name])}")
        warmup[name] = metrics[0]["ttft_s"] + (metrics[0]["new_tokens"] - 1) / max(metrics[0]["decode_tokens_per_s"], 1e-9)
        runs[name] = metrics[1:] or metrics
    result = {"runs": runs, "warmup_s": warmup, "wall_s": wall}
    if errors:
        result["error"] = "\n".join(errors)
    return result


def run_peer(args, engine, dtype, ids, workdir: Path, tag: str) -> dict:
    """One worker process per prompt, like ours: a process that saw two prompt lengths would
    run torch.compile's second graph with dynamic shapes, which is not transformers' best case."""
    runs, warmup, load, errors, wall, weight_bytes = {}, {}, {}, [], 0.0, None
    for name in PROMPTS:
        out, ids_file = workdir / f"{tag}-{name}.json", workdir / f"ids-{name}.json"
        ids_file.write_text(json.dumps({name: ids[name]}))
        common = ["--prompts", ids_file, "--max_new_tokens", args.max_new_tokens, "--num_samples", args.num_samples]
        if engine == "llama":
            cmd = peers_cmd("llama", out, "--gguf", args.llama_files[dtype], *common)
        else:
            cmd = peers_cmd("hf", out, "--gguf", args.gguf, "--dtype", dtype, "--device", args.device,
                            "--compile" if engine == "hf" else "--no-compile", *common)
        result, err, seconds = run_process(cmd, out, workdir / f"{tag}-{name}.log", args.timeout)
        wall += seconds
        if err:
            errors.append(f"{name}: {err}")
            continue
        runs[name], warmup[name], load[name] = result["runs"][name], result["warmup_s"][name], result["load_s"]
        weight_bytes = result["weight_bytes"]
    result = {"runs": runs, "warmup_s": warmup, "load_s": load, "weight_bytes": weight_bytes, "wall_s": wall}
    if errors:
        result["error"] = "\n".join(errors)
    return result


def run_membw(args, workdir: Path, tag: str) -> dict:
    out = workdir / f"{tag}.json"
    result, err, _ = run_process(peers_cmd("membw", out, "--device", args.device), out, workdir / f"{tag}.log",
                                 args.timeout)
    if err:
        log(f"memory bandwidth measurement failed: {err}")
    return result or {}


# ---------------------------------------------------------------- summary

def summarize(raw: list, membw: list, n_new: int, reference: str = "ours") -> list:
    """One row per (engine, dtype): medians over rounds of each round's median over samples."""
    bw_machine = median([m.get("gb_s") for m in membw])
    groups = {}
    for result in raw:
        groups.setdefault((result["engine"], result["dtype"]), []).append(result)
    summary = []
    for (engine, dtype), rounds in groups.items():
        def per_round(prompt, key):
            return median([median([s.get(key) for s in rr["runs"].get(prompt, [])]) for rr in rounds])
        tps = per_round("short", "decode_tokens_per_s")
        if engine.startswith("ours"):
            bw = per_round("short", "bandwidth_gb_s")
        else:
            wb = median([rr.get("weight_bytes") for rr in rounds])
            bw = wb * tps / 1e9 if wb and tps else None
        new_tokens = {s["new_tokens"] for rr in rounds for runs in rr["runs"].values() for s in runs}
        summary.append({
            "engine": engine, "dtype": dtype, "rounds_ok": sum(1 for rr in rounds if rr["runs"].get("short")),
            "decode_tokens_per_s": tps,
            "decode_tokens_per_s_after_long": per_round("long", "decode_tokens_per_s"),
            "ttft_short_s": per_round("short", "ttft_s"), "ttft_long_s": per_round("long", "ttft_s"),
            "bandwidth_gb_s": bw, "bandwidth_fraction": bw / bw_machine if bw and bw_machine else None,
            "warmup_s": {p: median([rr.get("warmup_s", {}).get(p) for rr in rounds]) for p in PROMPTS},
            "new_tokens_seen": sorted(new_tokens), "exact_new_tokens": new_tokens == {n_new},
            "errors": [rr["error"] for rr in rounds if rr.get("error")],
            "output_ids_short": next((runs[0].get("output_ids") for rr in rounds
                                      for runs in [rr["runs"].get("short")] if runs), None),
        })
    # ours/peer: decode speed ratio and TTFT speedup (peer TTFT / our TTFT), same dtype: the median
    # over rounds of each round's ratio (the two ran back to back), not the ratio of the medians
    ours = reference if any(s["engine"] == reference for s in summary) else \
        next((s["engine"] for s in summary if s["engine"].startswith("ours")), None)
    for row in summary:
        mine = groups.get((ours, SAME.get(row["dtype"], row["dtype"])))
        ok = mine is not None and row["engine"] != ours and \
            (row["engine"] == "ours-before" or not row["engine"].startswith("ours"))
        theirs = groups[(row["engine"], row["dtype"])]

        def paired(prompt, key, ours_over_peer):
            if not ok:
                return None
            ratios = []
            for rnd in {rr["round"] for rr in theirs}:
                a = [median([s.get(key) for s in rr["runs"].get(prompt, [])]) for rr in mine if rr["round"] == rnd]
                b = [median([s.get(key) for s in rr["runs"].get(prompt, [])]) for rr in theirs if rr["round"] == rnd]
                if a and b and a[0] and b[0]:
                    ratios.append(a[0] / b[0] if ours_over_peer else b[0] / a[0])
            return median(ratios)
        row["ours_decode_ratio"] = paired("short", "decode_tokens_per_s", True)
        row["ours_ttft_short_speedup"] = paired("short", "ttft_s", False)
        row["ours_ttft_long_speedup"] = paired("long", "ttft_s", False)
    return summary


def fmt(x, spec, scale=1.0):
    return "-" if x is None else format(x * scale, spec)


def print_table(summary: list, membw: list, ids: dict, args):
    n_long = len(ids["long"])
    head = ["engine", "dtype", "decode tok/s", "TTFT short ms", f"TTFT {n_long} ms", "GB/s", "% bw",
            "ours/peer decode", "ours TTFT short x", f"ours TTFT {n_long} x"]
    cells = [[ENGINES[row["engine"]], row["dtype"], fmt(row["decode_tokens_per_s"], ".1f"),
             fmt(row["ttft_short_s"], ".0f", 1000), fmt(row["ttft_long_s"], ".0f", 1000),
             fmt(row["bandwidth_gb_s"], ".1f"), fmt(row["bandwidth_fraction"], ".0f", 100),
             fmt(row["ours_decode_ratio"], ".2f"), fmt(row["ours_ttft_short_speedup"], ".2f"),
             fmt(row["ours_ttft_long_speedup"], ".2f")] for row in summary]
    widths = [max(len(str(r[i])) for r in [head] + cells) for i in range(len(head))]
    line = lambda r: "  ".join(str(c).ljust(w) if i < 2 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    bws = [m["gb_s"] for m in membw if m.get("gb_s")]
    sums = [m["gb_s_torch_sum"] for m in membw if m.get("gb_s_torch_sum")]
    print(f"\nmodel {args.checkpoint} / {args.gguf.name}; batch 1, {THREADS} threads, greedy, {args.max_new_tokens} new "
          f"tokens; prompts {len(ids['short'])} and {n_long} tokens; median of {args.rounds} round(s)")
    if bws:
        alone = f"; torch sum alone {statistics.median(sums):.1f}" if sums else ""
        print(f"memory bandwidth (1 GiB fp32, {THREADS} threads, the faster of torch sum and kernels.stream_sum): "
              f"median {statistics.median(bws):.1f} GB/s (rounds: {', '.join(f'{b:.1f}' for b in bws)}){alone}")
    print(line(head))
    print(line(["-" * w for w in widths]))
    for r in cells:
        print(line(r))
    f32 = next((row for row in summary if row["engine"] == args.reference and row["dtype"] == "float32"), None)
    for row in summary:
        if row["engine"] == args.reference and row["dtype"] in QUANTIZED and f32 and row["decode_tokens_per_s"]:
            print(f"ours {row['dtype']} decodes {row['decode_tokens_per_s'] / f32['decode_tokens_per_s']:.2f}x ours float32")
    print("ours/peer decode: our decode tok/s over the peer's (same dtype; int8 faces Q8_0, int4-g32 Q4_1); "
          "ours TTFT x: the peer's time to "
          "first token over ours (>1: ours is faster); each the median of the rounds' ratios of back-to-back runs. "
          "% bw: achieved bandwidth over the measured one.")
    ref = next((row for row in summary if row["engine"].startswith("hf") and row["output_ids_short"]), None)
    if ref:  # greedy outputs of the same weights should agree for a while, then drift with rounding
        agree = []
        for row in summary:
            out, ref_out = row["output_ids_short"], ref["output_ids_short"]
            if out and row is not ref:
                same = next((i for i, (x, y) in enumerate(zip(out, ref_out)) if x != y), min(len(out), len(ref_out)))
                agree.append(f"{ENGINES[row['engine']]} {row['dtype']} {same}/{len(out)}")
        if agree:
            print(f"greedy tokens agreeing with {ENGINES[ref['engine']]} {ref['dtype']} (short prompt): {', '.join(agree)}")
    for row in summary:
        if row["warmup_s"].get("short") and row["engine"] in ("hf", "ours", "ours-max", "ours-prefill"):
            print(f"{ENGINES[row['engine']]} {row['dtype']}: first (compiling) generation took "
                  f"{row['warmup_s']['short']:.1f} s short / {row['warmup_s'].get('long') or 0:.1f} s long")
        if not row["exact_new_tokens"] and row["new_tokens_seen"]:
            print(f"WARNING {ENGINES[row['engine']]} {row['dtype']}: generated {row['new_tokens_seen']} tokens, "
                  f"not exactly {args.max_new_tokens}")
        for e in row["errors"]:
            print(f"ERROR {ENGINES[row['engine']]} {row['dtype']}: {e.splitlines()[0]} (see --json / the log)")


# ---------------------------------------------------------------- main

def build_parser(prog: str = "python -m scripts.bench") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                     epilog=__doc__[__doc__.index("Engines"):],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m",
                        help="a model name known to download.py (default: smollm2-135m)")
    parser.add_argument("--checkpoint", type=Path, default=None, help="our checkpoint dir (default: checkpoints/MODEL)")
    parser.add_argument("--gguf", type=Path, default=None,
                        help="the GGUF the checkpoint was converted from (default: download.py's cached copy)")
    parser.add_argument("--engines", default="ours,hf,llama",
                        help=f"comma-separated, from: {', '.join(ENGINES)} (default: ours,hf,llama)")
    parser.add_argument("--reference", default="ours",
                        help="which of our engines the ratio columns compare with the peers (default: ours)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated torch dtypes (default: both)")
    parser.add_argument("--quantized", default="",
                        help="extra rows of ours on quantized checkpoints, comma-separated from "
                             f"{', '.join(QUANTIZED)} (made with quantize.py when missing)")
    parser.add_argument("--llama_quants", default="",
                        help="extra llama.cpp rows, comma-separated from Q8_0, Q4_1, ORIG (the GGUF as shipped)")
    parser.add_argument("--device", default="cpu",
                        help="cpu, or cuda: ours and transformers on the GPU (llama.cpp here is a CPU build)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the table shows the median")
    parser.add_argument("--max_new_tokens", type=int, default=128, help="tokens generated per run, EOS ignored")
    parser.add_argument("--num_samples", type=int, default=2,
                        help="runs per prompt per process; the first is warm-up and is dropped (>= 2)")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds one subprocess may take")
    parser.add_argument("--quick", action="store_true", help="smoke test: 1 round, 32 new tokens")
    parser.add_argument("--json", type=Path, default=None, help="write every raw number here")
    parser.add_argument("--shape", default=None,
                        help="comma-separated shapes.py shapes (llama-2-7b, llama-3.1-8b, tiny): ours alone on "
                             "random weights, --quantized quantized in memory (scripts/bench_shapes.py)")
    parser.add_argument("--batch_sizes", default="1",
                        help="with --shape: batch sizes of the first --dtypes (default: 1)")
    parser.add_argument("--profile_dir", type=Path, default=None,
                        help="with --shape: profile each process's last sample, its table written here")
    parser.add_argument("--before", type=Path, default=None,
                        help="another checkout of this project (e.g. a git worktree of an earlier commit): "
                             "adds the engine ours-before, its generate.py, to the same interleaved rounds")
    return parser


def shape_main(args) -> int:
    """--shape: scripts/bench_shapes.py over these arguments."""
    import shapes
    from errors import UserError
    from scripts import bench_shapes
    args.shape = [s for s in args.shape.split(",") if s]
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    try:
        for label in args.quantized:
            shapes.parse_quantization(label)
    except UserError as e:
        sys.exit(f"error: {e}")
    bad = [s for s in args.shape if s not in shapes.SHAPES] + [d for d in args.dtypes if d not in LLAMA_KIND]
    if bad or not args.dtypes or args.num_samples < 2 or any(b < 1 for b in args.batch_sizes):
        sys.exit(f"error: bad arguments {bad or ''} (--dtypes needs one, --num_samples >= 2, batch sizes >= 1)")
    return bench_shapes.run(args)


def main(argv=None, prog: str = "python -m scripts.bench"):
    args = build_parser(prog).parse_args(argv)
    if args.quick:
        args.rounds, args.max_new_tokens = 1, min(args.max_new_tokens, 32)
    args.engines = [e for e in args.engines.split(",") if e]
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    args.llama_quants = [q.upper() for q in args.llama_quants.split(",") if q]
    args.quantized = [q for q in args.quantized.split(",") if q]
    if args.shape:
        return shape_main(args)
    bad = [e for e in args.engines if e not in ENGINES] + [d for d in args.dtypes if d not in LLAMA_KIND] + \
        [q for q in args.llama_quants if q not in ("Q8_0", "Q4_1", "ORIG")] + [q for q in args.quantized if q not in QUANTIZED]
    if bad or args.num_samples < 2 or args.rounds < 1:
        sys.exit(f"error: bad arguments {bad or ''} (--num_samples must be >= 2, --rounds >= 1)")
    if args.device != "cpu" and "llama" in args.engines:
        sys.exit(f"error: --device {args.device}: the llama engine (llama-cpp-python) runs on the CPU only")
    args.checkpoint, args.gguf = resolve_weights(args)
    if args.before is not None:
        if not (args.before / "generate.py").is_file():
            sys.exit(f"error: --before {args.before} holds no generate.py")
        args.before = args.before.resolve()
        args.engines += [] if "ours-before" in args.engines else ["ours-before"]

    if any(e.startswith("ours") for e in args.engines):
        why = None if (REPO_ROOT / "generate.py").exists() else "generate.py is missing"
        if not (args.checkpoint / "config.json").exists():
            why = f"no checkpoint at {args.checkpoint} (make it with: python download.py {args.model})"
        if why:
            log(f"skipping ours: {why}")
            args.engines = [e for e in args.engines if not e.startswith("ours")]
    llama_ok = importlib.util.find_spec("llama_cpp") is not None
    if "llama" in args.engines and not llama_ok:
        log("skipping llama.cpp: llama-cpp-python is not installed (see `python -m scripts.bench --help` for how to build it)")
    args.llama_files = {}
    if "llama" in args.engines and llama_ok:
        for kind in [LLAMA_KIND[d] for d in args.dtypes] + args.llama_quants:
            args.llama_files[kind] = gguf_variant(args.gguf, kind, bench_cache_dir())

    ids = tokenize_prompts(args.gguf, args.checkpoint)
    log(f"prompts: short {len(ids['short'])} tokens, long {len(ids['long'])} tokens")
    workdir = Path(tempfile.mkdtemp(prefix="minillm-bench-"))
    jobs = engine_jobs(args, llama_ok)
    log(f"{args.rounds} round(s) of {len(jobs)} runs: {', '.join(f'{e}/{d}' for e, d in jobs)}; logs in {workdir}")

    raw, membw, t_start = [], [], time.perf_counter()
    for rnd in range(args.rounds):
        bandwidth = run_membw(args, workdir, f"r{rnd}-membw")
        bandwidth["round"] = rnd
        membw.append(bandwidth)
        log(f"round {rnd + 1}/{args.rounds}: memory bandwidth {bandwidth.get('gb_s', 0):.1f} GB/s")
        for engine, dtype in round_order(jobs, rnd):
            tag = f"r{rnd}-{engine}-{dtype}"
            if engine.startswith("ours"):
                result = run_ours(args, engine, dtype, ids, workdir, tag)
            else:
                result = run_peer(args, engine, dtype, ids, workdir, tag)
            result.update(round=rnd, engine=engine, dtype=dtype)
            raw.append(result)
            short = result["runs"].get("short") or [{}]
            long = result["runs"].get("long") or [{}]
            if result.get("error"):
                log(f"  {engine}/{dtype}: FAILED {result['error']}")
            log(f"  {engine}/{dtype}: decode {median([s.get('decode_tokens_per_s') for s in short]) or 0:.1f} tok/s, "
                f"TTFT {1000 * (median([s.get('ttft_s') for s in short]) or 0):.0f} / "
                f"{1000 * (median([s.get('ttft_s') for s in long]) or 0):.0f} ms ({result['wall_s']:.0f} s)")

    summary = summarize(raw, membw, args.max_new_tokens, args.reference)
    print_table(summary, membw, ids, args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "llama_files"}
        config["llama_files"] = {k: str(v) for k, v in args.llama_files.items()}
        args.json.write_text(json.dumps({
            "config": config, "threads": THREADS, "prompt_ids": ids, "prompts": PROMPTS,
            "wall_s": time.perf_counter() - t_start, "memory_bandwidth": membw,
            "summary": summary, "raw": raw}, indent=1))
        log(f"wrote {args.json}")


if __name__ == "__main__":
    sys.exit(main())
