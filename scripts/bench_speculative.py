"""Speculative decoding against plain decoding, side by side in one process, on the same prompts.

Cases (--case, default: all that can run):
  ngram  prompt lookup (generate.py --ngram 3 --speculate_k 8) with SmolLM2-135M-Instruct on
         input-grounded prompts: edit, fix or reformat a passage given in the prompt.
         Needs: python download.py smollm2-135m
  suffix the suffix proposer (generate.py --suffix --speculate_k 8) on the ngram case's prompts; each
         run starts with an empty store, so no run proposes from another's output.
         Needs: python download.py smollm2-135m
  suffix-tree, ngram-tree  the suffix and n-gram cases verifying a tree of up to 15 candidates a
         forward (generate.py --speculate_tree 15): several continuations, 8 deep.
  lookahead, qwen-lookahead  lookahead decoding (generate.py --lookahead 4,3,3: a Jacobi window of 4
         over 2 levels, 3 pool n-grams verified) with SmolLM2-135M on the ngram case's prompts and open
         questions, and with Qwen2.5-Coder-1.5B on code prompts and open questions.
  qwen-suffix  the suffix proposer with Qwen2.5-Coder-1.5B-Instruct on the ngram case's prompts.
         Needs: python download.py qwen2.5-coder-1.5b
  qwen   Qwen2.5-Coder-0.5B-Instruct drafting for Qwen2.5-Coder-1.5B-Instruct on code prompts
         (generate.py --draft_checkpoint ... --speculate_k 5).
         Needs: python download.py qwen2.5-coder-0.5b && python download.py qwen2.5-coder-1.5b
  qwen-int8  the same with an int8 copy of the 0.5B as the draft (its decode step reads a quarter
         of the bytes).
         Needs: the qwen case's models and
         python quantize.py --checkpoint checkpoints/qwen2.5-coder-0.5b --mode int8
  qwen-staged, int4-staged  staged speculative decoding (generate.py --staged --speculate_tree 10) with
         the qwen case's pair and with the int4 case's draft: the draft proposes a tree, its own chain
         sped up by prompt lookup.
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
    python -m scripts.bench_speculative --set data/speculative_prompts.json --techniques ngram,qwen \
        --json bench-out/speculative-set.json   # the prompt set, per category
    python -m scripts.bench_speculative --set data/speculative_prompts.json --quick   # its smoke test

Current figures and the commands that made them: docs/benchmarks.md.

Protocol: batch 1, greedy, float32 (the draft too, unless --draft_dtype), --threads threads
(default 2), chat template on, generation stops at EOS or --max_new_tokens. For each prompt,
plain decoding, speculative decoding with a fixed k and with the adaptive k (generate.py's
default: each round's count from spec_cost.py's cost model, none where a plain step is faster)
run one after the other on the same target model and engine (plain decoding and speculation's
rounds without proposals run the compiled one-token step, verifies the compiled chunk
forward); each starts with the prefix cache emptied, so each prefills its prompt in full. Rounds
repeat the whole set.
Each engine is warmed up (compiled) before timing. The figures: decode tokens/s of
each (tokens after the first / time after the first, as generate.py reports them), summed over
prompts (total tokens / total time), their ratio, the tokens produced per target forward, the
acceptance histogram, and whether every greedy output is identical to plain decoding (it must
be; the script exits 1 if not).

With --set, each technique named by --techniques (a case: its target, proposer and k) runs over
a prompt set instead of the case's own prompts, with the same protocol; a technique whose
checkpoints are missing is recorded as unavailable. data/speculative_prompts.json holds six
categories (data/README.md). Reported per category and technique: plain and speculative decode
tokens/s, their ratio, the lowest ratio of any one prompt (rounds summed) with its name, tokens
per target forward, and greedy identity.

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
from lookahead import LookaheadProposer
from loading import DTYPES, load_model
from sampling import Sampling
from staged import StagedProposer
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
    # 15 candidates and the root: 16 queries, the most the attention kernel takes (THRESHOLDS.attend_max_queries)
    "suffix-tree": dict(target="smollm2-135m", draft=None, ngram=None, k=8, prompts=GROUNDED, tree=15),
    "ngram-tree": dict(target="smollm2-135m", draft=None, ngram=3, k=8, prompts=GROUNDED, tree=15),
    # lookahead decoding (generate.py --lookahead 4,3,3): k is its longest path, N - 1
    "lookahead": dict(target="smollm2-135m", draft=None, ngram=None, k=2, prompts=GROUNDED + OPEN, lookahead=(4, 3, 3)),
    "qwen-lookahead": dict(target="qwen2.5-coder-1.5b", draft=None, ngram=None, k=2, prompts=CODE + OPEN,
                           lookahead=(4, 3, 3)),
    "qwen-suffix": dict(target="qwen2.5-coder-1.5b", draft=None, ngram=None, k=8, prompts=GROUNDED),
    "qwen": dict(target="qwen2.5-coder-1.5b", draft="qwen2.5-coder-0.5b", ngram=None, k=5, prompts=CODE),
    "qwen-int8": dict(target="qwen2.5-coder-1.5b", draft="qwen2.5-coder-0.5b-int8", ngram=None, k=5, prompts=CODE),
    # staged (generate.py --staged --speculate_tree 10): the draft's tree, its chain sped up by prompt lookup
    "qwen-staged": dict(target="qwen2.5-coder-1.5b", draft="qwen2.5-coder-0.5b", ngram=None, k=5, prompts=CODE,
                        tree=10, staged=True),
    "int4-staged": dict(target="smollm2-135m", draft="smollm2-135m-int4-g32", ngram=None, k=5,
                        prompts=GROUNDED + OPEN, tree=10, staged=True),
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


def missing_checkpoint(case: dict):
    """Why the case cannot run here (the command that prepares what it lacks), or None."""
    for checkpoint in filter(None, (case["target"], case["draft"])):
        if not (CHECKPOINTS / checkpoint / "config.json").exists():
            return f"checkpoints/{checkpoint} is missing: {NEEDS.get(checkpoint, 'see --help')}"
    return None


def make_proposer(case: dict, args) -> proposers.Proposer:
    if case["draft"]:
        draft = load_model(CHECKPOINTS / case["draft"], dtype=DTYPES[args.draft_dtype])
        drafting = StagedProposer if case.get("staged") else proposers.DraftProposer
        return drafting(draft, compile=args.compile)
    if case["ngram"]:
        return proposers.NgramProposer(case["ngram"], args.ngram_min)
    if case.get("lookahead"):
        return LookaheadProposer(*case["lookahead"])
    return proposers.SuffixProposer(store_tokens=0)  # no store: a run finds only its own prompt and output


def proposer_name(case: dict, args) -> str:
    if case.get("lookahead"):
        return "lookahead " + ",".join(map(str, case["lookahead"]))
    if not case["draft"]:
        tree = f" tree {case['tree']}" if case.get("tree") else ""
        return (f"ngram {case['ngram']}" if case["ngram"] else "suffix") + tree
    return ("staged " if case.get("staged") else "") + case["draft"] + (f" ({args.draft_dtype})" if args.draft_dtype != "float32" else "")


def load_target(case: dict) -> tuple:
    """(tokenizer, target model, stop ids)."""
    if case["draft"]:
        proposers.check_same_tokenizer(CHECKPOINTS / case["target"], CHECKPOINTS / case["draft"])
    tokenizer = Tokenizer(CHECKPOINTS / case["target"])
    target = load_model(CHECKPOINTS / case["target"])
    return tokenizer, target, sorted(set(target.args.eos_token_ids) | set(tokenizer.eos_ids))


def encode_chats(tokenizer: Tokenizer, chats: list) -> list:
    """Each prompt (a string: one user message; or a list of messages) through the chat template."""
    return [tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": chat}] if isinstance(chat, str) else chat), add_bos=False) for chat in chats]


def build_engines(name: str, case: dict, target, ids: list, k: int, args) -> tuple:
    """(engine, speculative engine) on one target, both warmed up (compiled) on the first prompt."""
    W, N, G = case.get("lookahead", (0, 1, 0))
    spare = k + (N - 1) * (W + G)  # slots a verify writes past the last token
    max_seq_length = -(-(max(map(len, ids)) + args.max_new_tokens + spare) // 256) * 256  # rounded up to 256
    engine = Engine(target, 1, max_seq_length, compile=args.compile)
    spec = speculative.SpeculativeEngine(engine, make_proposer(case, args), k, compile=args.compile,
                                         tree_nodes=case.get("tree", 0))
    start = time.perf_counter()
    engine.warm_up(ids[:1], Sampling())
    spec.warm_up(ids[:1], Sampling())
    log(f"[{name}] warmed up in {time.perf_counter() - start:.1f} s")
    return engine, spec


def speculation_modes(args) -> dict:
    """mode name -> whether k adapts (spec_cost.RoundPlanner)."""
    if args.adaptive == "both":
        return {"fixed": False, "adaptive": True}
    return {args.adaptive: args.adaptive == "adaptive"}


def time_prompt(engine, spec, prompt: list, modes: dict, args, stop: list) -> tuple:
    """Plain decoding, then each speculation mode, one after the other on one prompt: (run, outputs)."""
    sampling = Sampling()
    engine.forget_prefixes()  # every run prefills its prompt: no run starts on another's blocks
    (plain_out,), plain_stats = engine.generate([prompt], args.max_new_tokens, sampling, stop)
    plain_tokens, plain_s = decode_rate(plain_stats)
    run = dict(prompt_tokens=len(prompt), new_tokens=len(plain_out), plain_tokens=plain_tokens, plain_s=plain_s)
    outputs = {}
    for mode, adaptive in modes.items():
        spec.adaptive = adaptive
        spec.forget_prefixes()
        (outputs[mode],), spec_stats = spec.generate([prompt], args.max_new_tokens, sampling, stop)
        spec_tokens, spec_s = decode_rate(spec_stats)
        run[mode] = dict(identical=plain_out == outputs[mode], tokens=spec_tokens, s=spec_s,
                         tokens_per_target_forward=spec.metrics(spec_stats)["tokens_per_target_forward"],
                         histogram=spec_stats.histogram, plain_steps=spec_stats.plain_steps,
                         proposed=spec_stats.proposed)
    return run, outputs


def rate(tokens: float, seconds: float) -> float:
    return tokens / seconds if seconds else 0.0


def describe_run(run: dict, modes: dict) -> str:
    return (f"{run['new_tokens']} tokens, plain {rate(run['plain_tokens'], run['plain_s']):.1f} tok/s, "
            + ", ".join(f"{mode} {rate(x['tokens'], x['s']):.1f} tok/s "
                        f"({x['tokens_per_target_forward']:.2f} tokens/forward)"
                        + ("" if x["identical"] else "  OUTPUT DIFFERS")
                        for mode, x in ((mode, run[mode]) for mode in modes)))


def summarise_runs(runs: list, modes: dict, k: int) -> dict:
    """Totals over runs (total tokens / total time): plain tokens/s, and per mode its figures, with the
    lowest ratio of any one prompt (its rounds summed) to plain decoding."""
    plain_tps = rate(sum(x["plain_tokens"] for x in runs), sum(x["plain_s"] for x in runs))
    out = dict(plain_tokens_per_s=plain_tps)
    for mode in modes:
        xs = [x[mode] for x in runs]
        tps = rate(sum(x["tokens"] for x in xs), sum(x["s"] for x in xs))
        forwards = sum(sum(x["histogram"]) + x["plain_steps"] for x in xs)
        verifies = sum(sum(x["histogram"]) for x in xs)
        out[mode] = dict(spec_tokens_per_s=tps, speedup=tps / plain_tps if plain_tps else 0.0,
                         tokens_per_target_forward=sum(x["tokens"] for x in xs) / forwards if forwards else 0.0,
                         proposals_per_verify=sum(x["proposed"] for x in xs) / verifies if verifies else 0.0,
                         acceptance_histogram=[sum(x["histogram"][j] for x in xs) for j in range(k + 1)],
                         identical=all(x["identical"] for x in xs), **lowest_prompt_ratio(runs, mode))
    return out


def lowest_prompt_ratio(runs: list, mode: str) -> dict:
    """The prompt whose speculation is slowest relative to plain decoding (prompts that decode at most one
    token have no rate and are left out)."""
    ratios = {}
    for key in {x["prompt"] for x in runs}:
        xs = [x for x in runs if x["prompt"] == key]
        plain = rate(sum(x["plain_tokens"] for x in xs), sum(x["plain_s"] for x in xs))
        if plain:
            ratios[key] = rate(sum(x[mode]["tokens"] for x in xs), sum(x[mode]["s"] for x in xs)) / plain
    if not ratios:
        return dict(min_prompt_ratio=None, min_prompt=None)
    worst = min(ratios, key=ratios.get)
    return dict(min_prompt_ratio=ratios[worst], min_prompt=worst)


def run_case(name: str, args) -> dict:
    case = CASES[name]
    k = args.speculate_k or case["k"]
    missing = missing_checkpoint(case)
    if missing:
        return {"case": name, "skipped": missing}
    tokenizer, target, stop = load_target(case)
    ids = encode_chats(tokenizer, case["prompts"][:2] if args.quick else case["prompts"])
    engine, spec = build_engines(name, case, target, ids, k, args)
    modes = speculation_modes(args)
    runs = []
    for round_ in range(args.rounds):
        for i, prompt in enumerate(ids):
            run, outputs = time_prompt(engine, spec, prompt, modes, args, stop)
            if i == 0 and round_ == 0 and args.show:
                log(tokenizer.decode([t for t in outputs[list(modes)[0]] if t not in stop]))
            runs.append(dict(round=round_, prompt=i, **run))
            log(f"[{name}] round {round_} prompt {i}: {describe_run(run, modes)}")
    return dict(case=name, target=case["target"], draft=proposer_name(case, args), k=k, prompts=len(ids),
                rounds=args.rounds, runs=runs, **summarise_runs(runs, modes, k))


def load_prompt_set(path: Path, per_category) -> list:
    """[{category, index, chat}] in file order; per_category: the first so many of each category."""
    categories = json.loads(path.read_text())["categories"]
    return [dict(category=category, index=i, chat=chat) for category, entry in categories.items()
            for i, chat in enumerate(entry["prompts"][:per_category])]


def run_technique(name: str, prompt_set: list, args) -> dict:
    """One case's target and proposer over the prompt set, each prompt's plain and speculative runs
    side by side; figures over the whole set and per category."""
    case = CASES[name]
    k = args.speculate_k or case["k"]
    missing = missing_checkpoint(case)
    if missing:
        return {"case": name, "unavailable": missing}
    tokenizer, target, stop = load_target(case)
    ids = encode_chats(tokenizer, [p["chat"] for p in prompt_set])
    engine, spec = build_engines(name, case, target, ids, k, args)
    modes = speculation_modes(args)
    runs = []
    for round_ in range(args.rounds):
        for p, prompt in zip(prompt_set, ids):
            label = f"{p['category']}/{p['index']}"
            run, _ = time_prompt(engine, spec, prompt, modes, args, stop)
            runs.append(dict(round=round_, prompt=label, category=p["category"], **run))
            log(f"[{name}] round {round_} {label}: {describe_run(run, modes)}")
    categories = {c: summarise_runs([x for x in runs if x["category"] == c], modes, k)
                  for c in dict.fromkeys(p["category"] for p in prompt_set)}
    return dict(case=name, target=case["target"], draft=proposer_name(case, args), k=k, prompts=len(ids),
                rounds=args.rounds, max_new_tokens=args.max_new_tokens, categories=categories, runs=runs,
                **summarise_runs(runs, modes, k))


def print_set_table(results: list):
    print("| category | technique | proposer | k | plain tok/s | speculative tok/s | ratio "
          "| lowest prompt ratio | tokens/target forward | identical |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for result in results:
        if "unavailable" in result:
            print(f"| all | {result['case']} | unavailable: {result['unavailable']} ||||||||")
            continue
        for category, figures in [*result["categories"].items(), ("all", result)]:
            for mode in ("fixed", "adaptive"):
                if mode not in figures:
                    continue
                x = figures[mode]
                lowest = "-" if x["min_prompt_ratio"] is None else f"{x['min_prompt_ratio']:.2f}x ({x['min_prompt']})"
                print(f"| {category} | {result['case']} ({mode} k) | {result['draft']} | {result['k']} "
                      f"| {figures['plain_tokens_per_s']:.1f} | {x['spec_tokens_per_s']:.1f} | **{x['speedup']:.2f}x** "
                      f"| {lowest} | {x['tokens_per_target_forward']:.2f} | {'yes' if x['identical'] else 'NO'} |")


def print_case_table(results: list):
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


def run_cases(args) -> list:
    """--case: each case on its own prompts; None where a named case cannot run."""
    results = []
    for name in (CASES if args.case == "all" else [args.case]):
        result = run_case(name, args)
        if "skipped" in result:
            log(f"[{name}] skipped: {result['skipped']}")
            if args.case != "all":
                print(f"error: {result['skipped']}", file=sys.stderr)
                return None
        results.append(result)
    print_case_table(results)
    return results


def run_set(args) -> list:
    """--set: every technique over the prompt set (a technique whose checkpoints are missing is recorded)."""
    per_category = 1 if args.quick else args.per_category
    prompt_set = load_prompt_set(args.set, per_category)
    results = []
    for name in args.techniques.split(","):
        if name not in CASES:
            raise SystemExit(f"error: unknown technique {name!r}; one of {', '.join(CASES)}")
        result = run_technique(name, prompt_set, args)
        if "unavailable" in result:
            log(f"[{name}] unavailable: {result['unavailable']}")
        results.append(result)
    print_set_table(results)
    return results


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m scripts.bench_speculative", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__[__doc__.index("Cases"):],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=["all", *CASES], default="all")
    parser.add_argument("--set", type=Path, default=None, metavar="FILE",
                        help="run the techniques over this prompt set instead of the cases' own prompts "
                             "(data/speculative_prompts.json), reporting per category")
    parser.add_argument("--techniques", default=",".join(CASES),
                        help=f"with --set: the cases whose target and proposer run, comma-separated (default: {','.join(CASES)})")
    parser.add_argument("--per_category", type=int, default=None, metavar="N",
                        help="with --set: the first N prompts of each category (default: all)")
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
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: 2 prompts (with --set: 1 per category), 24 new tokens, 1 round, no compile")
    parser.add_argument("--show", action="store_true", help="print the first prompt's output of each case (stderr)")
    parser.add_argument("--json", type=Path, default=None, help="write every number here")
    args = parser.parse_args(argv)
    if args.quick:
        args.max_new_tokens, args.rounds, args.compile = 24, 1, False
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    results = run_set(args) if args.set else run_cases(args)
    if results is None:
        return 1
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        settings = dict(set=str(args.set), max_new_tokens=args.max_new_tokens, rounds=args.rounds, threads=args.threads)
        args.json.write_text(json.dumps(dict(settings, techniques=results) if args.set else results, indent=2))
    return 0 if all(r[mode]["identical"] for r in results for mode in ("fixed", "adaptive") if mode in r) else 1


if __name__ == "__main__":
    sys.exit(main())
