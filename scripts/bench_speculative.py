"""Speculative decoding against plain decoding, side by side in one process, on the same prompts.

Cases (--case, default: all that can run):
  ngram  prompt lookup (generate.py --ngram 3 --speculate_k 8) with SmolLM2-135M-Instruct on
         input-grounded prompts: edit, fix or reformat a passage given in the prompt.
         Needs: python download.py smollm2-135m
  suffix the suffix proposer (generate.py --suffix --speculate_k 8) on the ngram case's prompts; each
         run starts with an empty store, so no run proposes from another's output.
         Needs: python download.py smollm2-135m
  qwen   Qwen2.5-Coder-0.5B-Instruct drafting for Qwen2.5-Coder-1.5B-Instruct on code prompts
         (generate.py --draft_checkpoint ... --speculate_k 5).
         Needs: python download.py qwen2.5-coder-0.5b && python download.py qwen2.5-coder-1.5b
  qwen-int8  the same with an int8 copy of the 0.5B as the draft (its decode step reads a quarter
         of the bytes).
         Needs: the qwen case's models and
         python quantize.py --checkpoint checkpoints/qwen2.5-coder-0.5b --mode int8
  int4   an int4 copy of SmolLM2-135M (group size 32) drafting for the float32 model, on the
         ngram case's prompts and a few open questions.
         Needs: python quantize.py --checkpoint checkpoints/smollm2-135m --mode int4 --groupsize 32
         (writes checkpoints/smollm2-135m-int4-g32)

Run from the repository root:

    python -m scripts.bench_speculative                     # every case, compiled, 2 rounds
    python -m scripts.bench_speculative --case ngram        # one case
    python -m scripts.bench_speculative --case qwen --draft_dtype bfloat16   # the draft in bfloat16
    python -m scripts.bench_speculative --quick             # smoke test: 2 prompts, 24 tokens, 1 round, eager
    python -m scripts.bench_speculative --json bench-out/speculative.json

Current figures and the commands that made them: docs/benchmarks.md.

Protocol: batch 1, greedy, float32 (the draft too, unless --draft_dtype), --threads threads
(default 2), chat template on, generation stops at EOS or --max_new_tokens. For each prompt,
plain decoding, speculative decoding with a fixed k and with the adaptive k (generate.py's
default, `speculative.next_k`) run one after the other on the same target model and engine
(plain decoding runs its compiled step, speculation verifies through its compiled chunk
forward); each starts with the prefix cache emptied, so each prefills its prompt in full. Rounds
repeat the whole set.
Each engine is warmed up (compiled) before timing. The figures: decode tokens/s of
each (tokens after the first / time after the first, as generate.py reports them), summed over
prompts (total tokens / total time), their ratio, the tokens produced per target forward, the
acceptance histogram, and whether every greedy output is identical to plain decoding (it must
be; the script exits 1 if not).

The table goes to stdout, progress to stderr, every number to --json.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

import proposers
import speculative
from engine import Engine
from loading import DTYPES, load_model
from sampling import Sampling
from tokenizer import Tokenizer

CHECKPOINTS = Path(__file__).resolve().parent.parent / "checkpoints"

GROUNDED = [
    "Fix the spelling mistakes in this paragraph and write it out again in full:\n\n"
    "The quick brown fox jumpd over the lazy dog. It then ran into the forrest, where it met an old "
    "owl who lived in a hollow tree. The owl asked the fox were it was going, and the fox said that "
    "it was looking for it's family, who had left early in the mornin.",

    "Add a docstring to this Python function and return the whole function:\n\n"
    "def moving_average(values, window):\n"
    "    if window <= 0:\n"
    "        raise ValueError('window must be positive')\n"
    "    out = []\n"
    "    total = 0.0\n"
    "    for i, v in enumerate(values):\n"
    "        total += v\n"
    "        if i >= window:\n"
    "            total -= values[i - window]\n"
    "        if i >= window - 1:\n"
    "            out.append(total / window)\n"
    "    return out\n",

    "Rewrite this list as a numbered list, keeping every item as it is:\n\n"
    "- buy milk and eggs at the market\n- call the plumber about the kitchen sink\n"
    "- send the quarterly report to Anna\n- book train tickets to Lyon for Friday\n"
    "- water the plants on the balcony\n- renew the library card before it expires\n",

    "Rename the variable `x` to `count` in this code and show the result:\n\n"
    "def tally(words):\n"
    "    x = {}\n"
    "    for w in words:\n"
    "        if w in x:\n"
    "            x[w] += 1\n"
    "        else:\n"
    "            x[w] = 1\n"
    "    return x\n",

    "Copy this email and change the date from Monday to Tuesday:\n\n"
    "Hi team,\n\nThe design review is moved to Monday at 10:00 in room 4B. Please bring your "
    "notes on the new onboarding flow and the list of open questions from last week. If you "
    "cannot attend on Monday, send your comments to Maria before the meeting.\n\nThanks,\nPaul",
]

CODE = [
    "Write a Python function `is_prime(n)` that returns True when n is a prime number.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a Python class `Stack` with push, pop, peek and is_empty methods.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python function `word_count(path)` that counts the words in a text file.",
]

OPEN = [
    "Explain in three sentences why the sky is blue.",
    "What are three good habits for writing clean code?",
]

CASES = {
    "ngram": dict(target="smollm2-135m", draft=None, ngram=3, k=8, prompts=GROUNDED),
    "suffix": dict(target="smollm2-135m", draft=None, ngram=None, k=8, prompts=GROUNDED),
    "qwen": dict(target="qwen2.5-coder-1.5b", draft="qwen2.5-coder-0.5b", ngram=None, k=5, prompts=CODE),
    "qwen-int8": dict(target="qwen2.5-coder-1.5b", draft="qwen2.5-coder-0.5b-int8", ngram=None, k=5, prompts=CODE),
    "int4": dict(target="smollm2-135m", draft="smollm2-135m-int4-g32", ngram=None, k=5, prompts=GROUNDED + OPEN),
}
NEEDS = {
    "smollm2-135m": "python download.py smollm2-135m",
    "qwen2.5-coder-0.5b": "python download.py qwen2.5-coder-0.5b",
    "qwen2.5-coder-1.5b": "python download.py qwen2.5-coder-1.5b",
    "qwen2.5-coder-0.5b-int8": "python quantize.py --checkpoint checkpoints/qwen2.5-coder-0.5b --mode int8",
    "smollm2-135m-int4-g32": "python quantize.py --checkpoint checkpoints/smollm2-135m --mode int4 --groupsize 32",
}


def log(*args):
    print(*args, file=sys.stderr, flush=True)


def decode_rate(stats) -> tuple:
    """(tokens after the first, seconds after the first)."""
    return stats.new_tokens - 1, stats.decode_s


def run_case(name: str, args) -> dict:
    case = CASES[name]
    k = args.speculate_k or case["k"]
    for checkpoint in filter(None, (case["target"], case["draft"])):
        if not (CHECKPOINTS / checkpoint / "config.json").exists():
            return {"case": name, "skipped": f"checkpoints/{checkpoint} is missing: {NEEDS[checkpoint]}"}
    if case["draft"]:
        speculative.check_same_tokenizer(CHECKPOINTS / case["target"], CHECKPOINTS / case["draft"])
    tokenizer = Tokenizer(CHECKPOINTS / case["target"])
    target = load_model(CHECKPOINTS / case["target"])
    stop = sorted(set(target.args.eos_token_ids) | set(tokenizer.eos_ids))
    prompts = case["prompts"][:2] if args.quick else case["prompts"]
    ids = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}]), add_bos=False)
           for p in prompts]
    max_seq_length = -(-(max(map(len, ids)) + args.max_new_tokens + k) // 256) * 256  # rounded up to 256
    engine = Engine(target, 1, max_seq_length, compile=args.compile)
    if case["draft"]:
        draft = load_model(CHECKPOINTS / case["draft"], dtype=DTYPES[args.draft_dtype])
        proposer = proposers.DraftProposer(draft, compile=args.compile)
    elif case["ngram"]:
        proposer = proposers.NgramProposer(case["ngram"], args.ngram_min)
    else:  # no store: a run finds only its own prompt and output
        proposer = proposers.SuffixProposer(store_tokens=0)
    spec = speculative.SpeculativeEngine(engine, proposer, k, compile=args.compile)
    sampling = Sampling()
    start = time.perf_counter()
    engine.warm_up(ids[:1], sampling)
    spec.warm_up(ids[:1], sampling)
    log(f"[{name}] warmed up in {time.perf_counter() - start:.1f} s")

    modes = {"fixed": False, "adaptive": True} if args.adaptive == "both" else {args.adaptive: args.adaptive == "adaptive"}
    runs = []
    for round_ in range(args.rounds):
        for i, prompt in enumerate(ids):
            engine.forget_prefixes()  # every run prefills its prompt: no run starts on another's blocks
            (plain_out,), plain_stats = engine.generate([prompt], args.max_new_tokens, sampling, stop)
            plain_tokens, plain_s = decode_rate(plain_stats)
            run = dict(round=round_, prompt=i, prompt_tokens=len(prompt), new_tokens=len(plain_out),
                       plain_tokens=plain_tokens, plain_s=plain_s)
            for mode, adaptive in modes.items():
                spec.adaptive = adaptive
                spec.forget_prefixes()
                (spec_out,), spec_stats = spec.generate([prompt], args.max_new_tokens, sampling, stop)
                metrics = spec.metrics(spec_stats)
                spec_tokens, spec_s = decode_rate(spec_stats)
                run[mode] = dict(identical=plain_out == spec_out, tokens=spec_tokens, s=spec_s,
                                 tokens_per_target_forward=metrics["tokens_per_target_forward"],
                                 histogram=spec_stats.histogram, plain_steps=spec_stats.plain_steps,
                                 proposed=spec_stats.proposed)
                if i == 0 and round_ == 0 and args.show and mode == list(modes)[0]:
                    log(tokenizer.decode([t for t in spec_out if t not in stop]))
            runs.append(run)
            log(f"[{name}] round {round_} prompt {i}: {len(plain_out)} tokens, "
                f"plain {plain_tokens / plain_s if plain_s else 0:.1f} tok/s, "
                + ", ".join(f"{mode} {x['tokens'] / x['s'] if x['s'] else 0:.1f} tok/s "
                            f"({x['tokens_per_target_forward']:.2f} tokens/forward)"
                            + ("" if x["identical"] else "  OUTPUT DIFFERS")
                            for mode, x in ((mode, run[mode]) for mode in modes)))
    plain_tps = sum(x["plain_tokens"] for x in runs) / sum(x["plain_s"] for x in runs)
    proposer_name = case["draft"] or (f"ngram {case['ngram']}" if case["ngram"] else "suffix")
    if case["draft"] and args.draft_dtype != "float32":
        proposer_name += f" ({args.draft_dtype})"
    result = dict(case=name, target=case["target"], draft=proposer_name, k=k, prompts=len(ids),
                  rounds=args.rounds, plain_tokens_per_s=plain_tps, runs=runs)
    for mode in modes:
        xs = [x[mode] for x in runs]
        tps = sum(x["tokens"] for x in xs) / sum(x["s"] for x in xs)
        forwards = sum(sum(x["histogram"]) + x["plain_steps"] for x in xs)
        verifies = sum(sum(x["histogram"]) for x in xs)
        result[mode] = dict(spec_tokens_per_s=tps, speedup=tps / plain_tps,
                            tokens_per_target_forward=sum(x["tokens"] for x in xs) / forwards if forwards else 0.0,
                            proposals_per_verify=sum(x["proposed"] for x in xs) / verifies if verifies else 0.0,
                            acceptance_histogram=[sum(x["histogram"][j] for x in xs) for j in range(k + 1)],
                            identical=all(x["identical"] for x in xs))
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench_speculative", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__[__doc__.index("Cases"):],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=["all", *CASES], default="all")
    parser.add_argument("--speculate_k", type=int, default=None, help="override the case's k")
    parser.add_argument("--ngram_min", type=int, default=1,
                        help="ngram case: shortest n-gram looked up (default 1; larger proposes less often, and "
                             "wastes fewer verify forwards when one costs much more than a one-token step)")
    parser.add_argument("--adaptive", choices=["both", "fixed", "adaptive"], default="both",
                        help="speculate with a fixed k, with the adaptive k (generate.py's default), or both, "
                             "each side by side with plain decoding (default: both)")
    parser.add_argument("--draft_dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the draft model's dtype (generate.py --draft_dtype); the target stays float32")
    parser.add_argument("--max_new_tokens", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=2, help="times the whole prompt set is run")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--quick", action="store_true", help="smoke test: 2 prompts, 24 new tokens, 1 round, no compile")
    parser.add_argument("--show", action="store_true", help="print the first prompt's output of each case (stderr)")
    parser.add_argument("--json", type=Path, default=None, help="write every number here")
    args = parser.parse_args(argv)
    if args.quick:
        args.max_new_tokens, args.rounds, args.compile = 24, 1, False
    torch.set_num_threads(args.threads)
    results = []
    for name in (CASES if args.case == "all" else [args.case]):
        result = run_case(name, args)
        if "skipped" in result:
            log(f"[{name}] skipped: {result['skipped']}")
            if args.case != "all":
                print(f"error: {result['skipped']}", file=sys.stderr)
                return 1
        results.append(result)

    print("| case | target | proposer | k | plain tok/s | speculative | tok/s | speedup "
          "| tokens/target forward | proposals/verify | acceptance histogram (0..k) | identical |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for result in results:
        if "skipped" in result:
            print(f"| {result['case']} | skipped: {result['skipped']} |||||||||||")
            continue
        for mode in ("fixed", "adaptive"):
            if mode in result:
                x = result[mode]
                print(f"| {result['case']} | {result['target']} | {result['draft']} | {result['k']} "
                      f"| {result['plain_tokens_per_s']:.1f} | {mode} k | {x['spec_tokens_per_s']:.1f} "
                      f"| **{x['speedup']:.2f}x** | {x['tokens_per_target_forward']:.2f} | {x['proposals_per_verify']:.2f} "
                      f"| {' '.join(map(str, x['acceptance_histogram']))} | {'yes' if x['identical'] else 'NO'} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return 0 if all(r[mode]["identical"] for r in results for mode in ("fixed", "adaptive") if mode in r) else 1


if __name__ == "__main__":
    sys.exit(main())
