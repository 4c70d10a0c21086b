"""One torchrun job for tests/test_tp.py: every rank loads its shard of each case's checkpoint,
runs prefill and a few greedy decode steps (eager, or through engine.Engine with the compiled
step), and rank 0 writes the logits, tokens and per-rank bytes of every case to --out, and under
"gloo_threads" its gloo threads before and after tp.close().

    torchrun --standalone --nproc_per_node=2 -m tests.tp_worker --cases cases.json --out result.pt

cases.json: [{"name", "checkpoint", "prompts": [[ids], ...], "steps", "compile", "tp_mode",
               "float_activations", "speculate_k", "draft" (a checkpoint) or "ngram"}, ...]
"""
import argparse
import contextlib
import json
import os
from pathlib import Path

import torch

import kernels
import tp as tplib
from engine import Engine
from loading import load_model
from sampling import Sampling


@torch.inference_mode()
def run_case(model, prompts: list, steps: int, compile: bool = False) -> dict:
    """Greedy tokens (B, steps + 1) and the float logits of prefill (every position) and of each
    decode step, for prompts of different lengths in one batch, each row at its own positions (a
    shorter row's prompt padded at its end, past its own tokens); with compile, the tokens come
    from Engine.generate's compiled decode step and the logits from prefill only."""
    B, T = len(prompts), max(len(p) for p in prompts)
    if compile == "aside":  # eager while a thread compiles without running (compile.dry_run); then compiled
        engine = Engine(model, B, T + steps + 1, compile=True)
        thread = engine.warm_up(prompts, Sampling(), aside=True)
        eager, stats = engine.generate(prompts, steps + 1, Sampling())
        thread.join()
        with torch.compiler.set_stance("fail_on_recompile"):
            outs, again = engine.generate(prompts, steps + 1, Sampling())  # the ranks agree, and take the graphs up
        return {"tokens": torch.tensor(outs), "logits": [], "eager": torch.tensor(eager),
                "eager_steps": (stats.eager_steps, again.eager_steps)}
    if compile:
        engine = Engine(model, B, T + steps + 1, compile=True)
        engine.warm_up(prompts, Sampling())  # compile
        outs, _ = engine.generate(prompts, steps + 1, Sampling())
        return {"tokens": torch.tensor(outs), "logits": []}
    model.setup_caches(B, T + steps + 1)
    lengths = torch.tensor([len(p) for p in prompts])
    tokens = torch.tensor([list(p) + [0] * (T - len(p)) for p in prompts])
    logits = [model(tokens, torch.arange(T))]  # (B, T, vocab)
    cur = logits[-1][torch.arange(B), lengths - 1].argmax(-1, keepdim=True)  # (B, 1) each row after its last token
    out = [cur]
    for i in range(steps):
        logits.append(model(cur, (lengths + i).view(B, 1)))  # each row at its own position
        cur = logits[-1][:, -1].argmax(-1, keepdim=True)
        out.append(cur)
    return {"tokens": torch.cat(out, 1), "logits": logits}


def run_speculative(model, case: dict, draft=None) -> dict:
    import proposers
    import speculative
    (prompt,) = case["prompts"]
    proposer = proposers.DraftProposer(draft) if draft is not None else proposers.NgramProposer(case["ngram"])
    engine = Engine(model, 1, len(prompt) + case["steps"] + 1 + case["speculate_k"] + 1)
    spec = speculative.SpeculativeEngine(engine, proposer, case["speculate_k"])
    (out,), _ = spec.generate([prompt], case["steps"] + 1, Sampling())
    return {"tokens": torch.tensor([out]), "logits": []}


def gloo_threads() -> list:
    """Names of this process's threads that gloo started (Linux)."""
    names = [Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task")]
    return [name for name in names if "gloo" in name]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--fail_rank", type=int, default=None, help="this rank runs out of memory while loading")
    p.add_argument("--crash_rank", type=int, default=None, help="this rank dies after loading")
    p.add_argument("--abort_rank", type=int, default=None, help="this rank aborts (SIGABRT) after loading")
    args = p.parse_args()
    torch.set_num_threads(1)
    tp, _ = tplib.init_from_env("cpu")
    results = {}

    def load(checkpoint):
        if tp.rank == args.fail_rank:
            raise MemoryError("cannot allocate the shard (injected)")
        return load_model(checkpoint, "cpu", torch.float32, tp=tp)

    for case in json.loads(args.cases.read_text()):
        # float_activations: quantized layers packed and run without kernels.py, whose int8
        # rounding of the activations would turn the all-reduce's other summation order into
        # jumps of a rounding step, where the sharding is to be checked to 1e-4
        off = kernels.switched_off if case.get("float_activations") else contextlib.nullcontext
        tp.mode = case.get("tp_mode", "auto")
        with off():
            model = tp.all_ranks_ok(load, case["checkpoint"])
        if tp.rank == args.crash_rank:
            os._exit(3)  # no exception, no message: the others are left in their next all-reduce
        if tp.rank == args.abort_rank:
            os.abort()  # a crash below Python: faulthandler names this line
        with off():
            if case.get("speculate_k"):  # greedy speculative decoding, with a sharded draft or n-grams
                r = run_speculative(model, case, tp.all_ranks_ok(load, case["draft"]) if case.get("draft") else None)
            else:
                r = run_case(model, case["prompts"], case["steps"], case.get("compile", False))
        r["bytes"] = tp.gather(tplib.sharded_bytes(model, tp))  # [(sharded, replicated)] per rank
        r["n_heads"] = tp.gather([(layer.attention.n_heads, layer.attention.n_kv_heads) for layer in model.layers])
        results[case["name"]] = r
    running = gloo_threads()
    tplib.close()  # as at exit, with the models and compiled steps still alive
    if tp.rank == 0:
        results["gloo_threads"] = {"before_close": running, "after_close": gloo_threads()}
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
