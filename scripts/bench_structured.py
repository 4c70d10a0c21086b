"""What constrained decoding costs, and what jump-forward saves, on one model (compiled Engine).

    python -m scripts.bench_structured [--checkpoint checkpoints/smollm2-135m] [--out benchmarks/structured.json]

1. Decode tokens/s at batch 1 and 16 with a JSON-schema constraint (every row its own matcher,
   its mask computed on the host and applied inside the compiled step), against the same prompts
   unconstrained; jump-forward off, so both run one token per step.
2. Output tokens/s of a fixed-schema JSON answer (greedy, batch 1) with forced-token chunks
   against the same answer stepped one token at a time.
3. The per-token cost of computing the mask (llguidance), replaying the generated tokens.
Rounds alternate the configurations, and each figure is the median over rounds.
"""
import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch

from engine import Engine
from grammar import Grammars, token_masks
from loading import load_model
from sampling import Sampling
from tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
# a long answer: many steps per call, so the figure is decode, not prefill
LIST_SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "minItems": 40, "maxItems": 60, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                     "count": {"type": "integer", "minimum": 0, "maximum": 1000}},
    "required": ["name", "count"], "additionalProperties": False}}}, "required": ["items"], "additionalProperties": False}
# a fixed-schema answer: the keys are forced, the values chosen
RECORD_SCHEMA = {"type": "object", "properties": {
    "first_name": {"type": "string", "maxLength": 16}, "last_name": {"type": "string", "maxLength": 16},
    "date_of_birth": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
    "nationality": {"type": "string", "maxLength": 16},
    "occupation": {"type": "string", "maxLength": 24},
    "favourite_programming_language": {"enum": ["Python", "C", "Rust", "Go", "JavaScript"]},
    "is_currently_employed": {"type": "boolean"},
    "years_of_professional_experience": {"type": "integer", "minimum": 0, "maximum": 60}},
    "required": ["first_name", "last_name", "date_of_birth", "nationality", "occupation",
                 "favourite_programming_language", "is_currently_employed", "years_of_professional_experience"],
    "additionalProperties": False}


def log(*args):
    print("[bench_structured]", *args, flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m scripts.bench_structured", description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", type=Path, default=ROOT / "checkpoints" / "smollm2-135m")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=128, help="decode steps per call in part 1")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)

    model = load_model(args.checkpoint)
    tok = Tokenizer(args.checkpoint)
    grammars = Grammars(args.checkpoint, model.args.vocab_size, tok.eos_ids)
    engine = Engine(model, compile=True)
    chat = lambda text: tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_bos=False)  # noqa: E731
    list_grammar, record_grammar = grammars.compile("json_schema", LIST_SCHEMA), grammars.compile("json_schema", RECORD_SCHEMA)
    results = {"decode": [], "jump_forward": {}, "mask": {}}

    # 1. decode with and without a constraint
    prompt = chat("List 50 fruits with how many of each are in my basket, as JSON.")
    for batch in (1, 16):
        engine.setup(batch, 512)
        engine.jump_forward = False
        plain, constrained = [], []
        engine.warm_up([prompt] * batch, Sampling())
        engine.warm_up([prompt] * batch, Sampling(), constrained=True)
        for _ in range(args.rounds):
            for runs, constraints in ((plain, None), (constrained, True)):
                cs = [grammars.constraint(list_grammar) for _ in range(batch)] if constraints else None
                outs, stats = engine.generate([prompt] * batch, args.tokens, Sampling(), constraints=cs)
                steps = len(stats.token_times) - 1
                runs.append(steps * batch / stats.decode_s)
        row = {"batch_size": batch, "unconstrained_tokens_per_s": statistics.median(plain),
               "json_schema_tokens_per_s": statistics.median(constrained)}
        row["ratio"] = row["json_schema_tokens_per_s"] / row["unconstrained_tokens_per_s"]
        results["decode"].append(row)
        log(row)

    # 2. jump-forward: the same answer with forced-token chunks and stepped
    prompt = chat("Invent a software engineer and describe them as JSON.")
    engine.setup(1, 512)
    times, texts, counts = {True: [], False: []}, {}, {}
    for _ in range(args.rounds):
        for jump in (True, False):
            engine.jump_forward = jump
            start = time.perf_counter()
            (out,), stats = engine.generate([prompt], 200, Sampling(), tok.eos_ids,
                                            constraints=[grammars.constraint(record_grammar)])
            times[jump].append(time.perf_counter() - start)
            texts[jump], counts[jump] = tok.decode(out), len(out)
    assert texts[True] == texts[False], (texts[True], texts[False])
    jump_s, step_s = statistics.median(times[True]), statistics.median(times[False])
    results["jump_forward"] = {"output_tokens": counts[False], "output_tokens_with_chunks": counts[True],
                               "answer": texts[True],
                               "chunked_tokens_per_s": counts[True] / jump_s, "stepped_tokens_per_s": counts[False] / step_s,
                               "speedup": step_s / jump_s}
    log(results["jump_forward"])

    # 3. the mask's cost per token: replay the answer through a fresh matcher
    ids = tok.encode(texts[True], add_bos=False)
    costs = []
    for _ in range(args.rounds):
        c = grammars.constraint(record_grammar)
        for t in ids:
            start = time.perf_counter()
            token_masks([c], model.args.vocab_size)
            costs.append(time.perf_counter() - start)
            if not c.accept(t):
                break
    results["mask"] = {"median_us": statistics.median(costs) * 1e6, "p99_us": sorted(costs)[int(0.99 * len(costs))] * 1e6,
                       "tokens": len(costs)}
    log(results["mask"])

    if args.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        doc = {"title": "Constrained decoding (llguidance) and jump-forward, SmolLM2-135M float32, compiled Engine",
               "date": time.strftime("%Y-%m-%d"), "commit": commit,
               "command": "python -m scripts.bench_structured --out " + str(args.out),
               "threads": torch.get_num_threads(), **results}
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=2) + "\n")
        tmp.replace(args.out)


if __name__ == "__main__":
    main()
