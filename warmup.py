"""Warm-up: the steps a run will take, run on the scratch block before (or while) the run needs
them, so that torch.compile compiles their graphs there and not in the middle of the run.

A plan here is a scheduler.StepPlan whose rows hold no blocks: every row reads and writes the
scratch block, so nothing a request holds is touched. compile_now runs the plans first (timed
runs, CUDA graphs, tensor parallelism); compile_aside runs them on a thread through a copy of the
engine that holds the compiled graphs while the engine itself steps eagerly, and the engine takes
the graphs up at its first step after the last plan: a first token in seconds, not minutes.
"""
import contextlib
import copy
import sys
import threading
from typing import Callable, Optional

import torch

import kernels
import tp
from compile import DryRun, compiling, dry_run, tensor_parallel
from errors import log
from forwards import buckets, forward_chunk, forward_rides
from grammar import token_masks
from sampling import Sampling
from scheduler import StepPlan
from thresholds import THRESHOLDS


def rides(rows: int, pos: int, wants: Optional[int] = None, **options) -> StepPlan:
    """rows one-token rows at pos on the scratch block, the first `wants` of them (all) wanting logits."""
    wants = rows if wants is None else wants
    return StepPlan(rides=[(0, pos, ([], []))] * rows, wants=list(range(wants)), **options)


def chunk_plans(engine, longest: int) -> list:
    """Steps that run the graph of a few tokens after cached ones (a verify, a grammar's forced
    tokens, a prompt's tail after a prefix hit): one graph for them all (run_chunk pads the sizes
    of 1 a dynamic graph would specialize), met in the shapes that compiled apart before, up to
    longest tokens."""
    plans = []
    for T, pos in ((longest, 3), (2, 20), (3, 5), (1, 9), (1, 40)):
        pos = max(1, min(pos, engine.max_seq_length - T))
        plans.append(StepPlan(chunks=[([0] * T, pos, ([], []), True)]))
    return plans


def generate_plans(engine, prompts: Optional[list], sampling: Sampling, host: bool = False,
                   constrained: bool = False) -> list:
    """The steps Engine.generate takes for these prompts (None: the turns of a chat, whose tails
    after the cached turns go through the short-chunk graph): the prompts' chunk where prefill is
    compiled, two decode steps of every row (a group's rows, with decoding groups; sampling inside
    the step unless host, with a grammar's mask when constrained), and for one row the chunks of
    forced tokens a grammar or logprobs meet."""
    rows = len(prompts) if prompts else 1
    longest = max(len(p) for p in prompts) if prompts else 1
    group_rows = engine.scheduler.group_rows  # a decode step's rows, with decoding groups (pipeline.py)
    decoding = group_rows(rows) if group_rows is not None else rows
    in_step = engine.sample_in_step and not host and not sampling.adjusts
    plans = []
    if prompts and engine.long_chunk is not forward_chunk:
        plans.append(StepPlan(chunks=[(list(p), 0, ([], [])) for p in prompts]))
    pos = max(0, min(longest, engine.max_seq_length - 2))
    if constrained and in_step:  # every decode step carries the mask, at cache lengths past one block
        with torch.inference_mode():  # an inference tensor, as a step's mask is: the graph guards on it
            mask = token_masks([None] * decoding, engine.model.args.vocab_size).to(engine.device)
        for pos in (2 * engine.block_size, 3 * engine.block_size):
            plans.append(rides(decoding, min(pos, engine.max_seq_length - 1), sampling=sampling, mask=mask))
    else:
        plans += [rides(decoding, pos + i, sampling=sampling if in_step else None) for i in range(2)]
    if not prompts:
        plans += chunk_plans(engine, THRESHOLDS.attend_max_queries)
    elif (host or constrained) and rows == 1:
        plans += chunk_plans(engine, 3)
    return plans


def serve_plans(engine) -> list:
    """The steps that compile every shape serving meets (a request would otherwise wait for the
    compiler in the middle of serving). On CPU: two batch sizes (one with prompt rows, which need
    no logits) and two cache lengths, the second step changing all three at once so that one
    recompile makes the graph general in them; then steps of as many rows, and as many logits, as
    make the float products change kernels (kernels.compiled_onednn_min_tokens), which compile
    apart. On CUDA the step is general from the first compile: every shape a step takes
    (power-of-two rows, each cache bucket), twice, so that each is recorded as a CUDA graph."""
    B, fused = engine.max_batch_size, engine.scheduler.fused_rows

    def step(decoding: int, prompt: int, pos: int) -> StepPlan:
        """decoding rows that want logits, and a prompt's rows beside them (its last one wants its logits)."""
        plan = rides(decoding + prompt, pos, decoding)
        plan.wants += [decoding + prompt - 1] if prompt else []
        return plan

    if engine.pad_rows:
        widths = sorted({engine.step_width(n) for n in range(1, B + 1)})
        plans = [step(w, 0, kv - 1) for w in widths for kv in buckets(engine.kv_limit) for _ in range(2)]
    else:
        # a prompt chunk of two tokens: one more logit-less row
        grow = (engine.min_rows, 2) if fused else (min(engine.min_rows + 1, B + 1), 0)
        plans = [step(engine.min_rows, 0, 0), step(*grow, min(200, engine.max_seq_length - 3)), step(*grow, 0)]
        wide = kernels.compiled_onednn_min_tokens(engine.model.norm.weight.dtype)
        pos = max(0, engine.max_seq_length - wide - 1)
        if fused >= wide:  # many rows, few logits: prompt tokens beside a few streams
            plans.append(step(1, wide - 1, pos))
        elif B + 1 >= wide:
            plans.append(step(wide, 0, pos))
        if B >= wide:  # many rows and many logits: as many streams
            plans.append(step(wide, 2 if fused >= wide + 2 else 0, pos))
    return plans + chunk_plans(engine, THRESHOLDS.attend_max_queries)  # a prompt's few tokens after cached blocks


def widest_rows(engine) -> Optional[int]:
    """The most rows a step may take (verify rows beside decoding ones) without a shape that
    serve_plans did not compile: on CUDA its widest power of two; on CPU, fewer than make the float
    products change kernels, unless as many streams compiled those; None when eager (any will do)."""
    if engine.pad_rows:
        return engine.step_width(engine.max_batch_size)
    wide = kernels.compiled_onednn_min_tokens(engine.model.norm.weight.dtype)
    if engine.rides is forward_rides or engine.max_batch_size >= wide:
        return None
    return max(engine.max_batch_size, wide - 1)


def compile_now(engine, plans: list, then: Optional[Callable] = None):
    """Run the plans (and then(): a draft's step) before anything else, under tensor parallelism
    sending each to the ranks that follow."""
    log("compiling (about a minute the first time, cached on disk afterwards; every run with --compile_mode max)...")
    with torch.inference_mode(), compiling():
        for plan in plans:
            if engine.broadcast is not None:
                engine.broadcast(plan)
            engine.run(plan)
        if then is not None:
            then()


def compile_aside(engine, plans: list, then: Optional[Callable] = None) -> threading.Thread:
    """Step eagerly while a thread runs the plans (and then()) through a copy of the engine that
    holds the compiled graphs; the engine's first step after them takes the graphs up."""
    compiled = engine.rides, engine.short_chunk, engine.long_chunk
    aside = copy.copy(engine)  # its own last step and shapes; the same model, pools and feeder
    engine.rides, engine.short_chunk, engine.long_chunk = forward_rides, forward_chunk, forward_chunk
    engine.compiling_aside = True
    log("running the eager step while the compiled one compiles (cached on disk afterwards)")
    # an eager step gives up the GIL in each of its hundreds of operators and waits to get it back
    # from the compiling thread: at Python's 5 ms switch interval a step took 200 ms, at 0.1 ms 40
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)

    dry = engine.device.type == "cpu" and tensor_parallel()  # compile without running the collectives
    engine.agree = tp.all_ranks if dry else None

    @torch.inference_mode()
    def work():
        try:
            with compiling(": the next step runs the compiled graphs"), dry_run() if dry else contextlib.nullcontext():
                for plan in plans:
                    try:
                        aside.run(plan)
                    except DryRun:
                        pass
                if then is not None:
                    then()
        except Exception as e:  # the eager step runs on
            log(f"compiling failed, the step stays eager ({type(e).__name__}: {e})")
            return
        finally:
            sys.setswitchinterval(switch)
        engine.compiled_ready = compiled
        engine.wakeup.set()

    (thread := threading.Thread(target=work, name="compile", daemon=True)).start()
    return thread
