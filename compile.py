"""torch.compile for the engines' steps: the compile modes and options per device, a tag that keys
the on-disk caches by the sources a step traces, and guard skipping within a run of steps."""
import contextlib
import functools
import hashlib
import inspect
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import torch

import kernels
from choices import COMPILE_MODES
from errors import UserError
from model import Transformer


def compile_options(device: torch.device, compile_mode: str) -> dict:
    """torch.compile arguments for the decode step."""
    if device.type == "cuda":  # CUDA graphs remove the per-kernel launch cost
        import torch._inductor.config as inductor_config
        inductor_config.triton.unique_kernel_names = True  # kernels named after what they compute: a profile reads
        if compile_mode == "max":  # as gpt-fast: also search each reduction's block sizes (minutes more compiling)
            inductor_config.coordinate_descent_tuning = True
        return {"mode": "max-autotune" if compile_mode == "max" else "reduce-overhead"}
    if compile_mode == "max":
        # Freeze the weights into the graph so inductor can pre-pack them for its own C++ GEMM
        # micro-kernels. Set globally: as per-call options freezing does not take effect.
        # Frozen graphs are not cached on disk, so every run compiles.
        import torch._inductor.config as inductor_config
        inductor_config.freezing = True
        inductor_config.max_autotune = True
        inductor_config.max_autotune_gemm_backends = "CPP,ATEN"
        return {}
    # inductor's graph called from C++ rather than Python: a quantized step calls many kernels.py
    # operators, and the Python wrapper's per-call overhead shows. Not under tensor parallelism:
    # the C++ wrapper cannot call the functional collectives, nor a compiled region (regional mode).
    if compile_mode == "regional" or tensor_parallel():
        return {}
    return {"options": {"cpp_wrapper": True}}


# the sources whose code a compiled step traces or calls
TRACED_SOURCES = ("model.py", "forwards.py", "engine.py", "sampling.py", "kernels.py", "kernels.cpp", "qlayers.py",
                  "packing.py", "thresholds.py", "tp.py", "pipeline.py", "grammar.py", "speculative.py", "proposers.py",
                  "staged.py")


@functools.cache
def compile_cache_tag(root: Path = Path(__file__).resolve().parent) -> str:
    """A tag for torch.compile's on-disk caches: a hash of TRACED_SOURCES and of the CPU features
    that pick kernels. A graph that other code cached carries that code's shape guards (a float32
    step split at 16 rows, say); a cache hit adds them to this code's graph, and a step that the
    warm-up compiled would then compile again in the middle of serving."""
    digest = hashlib.sha256(f"{kernels.AVX512} {kernels.CPU_HAS_BF16}".encode())
    for name in TRACED_SOURCES:
        digest.update((root / name).read_bytes())
    return "minillm-" + digest.hexdigest()[:16]


def tag_compile_cache():
    """Key torch.compile's caches by compile_cache_tag (beside any tag the user set)."""
    tag, current = compile_cache_tag(), torch.compiler.config.cache_key_tag
    if tag not in current:
        torch.compiler.config.cache_key_tag = f"{current}:{tag}" if current else tag


def tensor_parallel() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class DryRun(Exception):
    """What a graph compiled for tensor parallelism raises instead of running, inside dry_run()."""


DRY = threading.local()


@contextlib.contextmanager
def dry_run():
    """Within, on this thread, a tensor-parallel step compiles its graph and raises DryRun instead
    of running it: a thread compiles while only the stepping thread issues collectives, which every
    rank must issue in the same order (warmup.compile_aside)."""
    DRY.on = True
    try:
        yield
    finally:
        DRY.on = False


def dry_runnable(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    """The inductor backend, its graphs raising DryRun inside dry_run()."""
    from torch._inductor.compile_fx import compile_fx
    compiled = compile_fx(gm, example_inputs)

    def run(*args):
        if getattr(DRY, "on", False):
            raise DryRun
        return compiled(*args)
    run._boxed_call = getattr(compiled, "_boxed_call", False)  # called as inductor's graph is
    return run


def backend(device: torch.device):
    return dry_runnable if device.type == "cpu" and tensor_parallel() else "inductor"


def compile_chunk(fn: Callable, device: torch.device) -> Callable:
    """torch.compile for a chunk's forward: general in its length from the first call."""
    tag_compile_cache()
    return torch.compile(fn, dynamic=True, fullgraph=True, backend=backend(device))


def compile_step(fn: Callable, model: Transformer, compile_mode: str = "default", **options) -> Callable:
    """torch.compile(fn, fullgraph=True) for a step fn(model, ...). compile_mode: default, one graph
    of the whole step; regional, a step that calls one compiled layer for every layer alike (a
    fraction of the compile time; the calls are made from Python, a slower step for a small
    model, docs/benchmarks.md); max, see compile_options."""
    if compile_mode not in COMPILE_MODES:
        raise UserError(f"compile_mode must be one of {', '.join(COMPILE_MODES)}, not {compile_mode!r}")
    tag_compile_cache()
    # a model's float constants (a soft-cap, a scale) stay constants: one that differs between two
    # models of a process (a target and its draft) otherwise becomes a graph input after a
    # recompile, which a compiled region cannot take
    torch._dynamo.config.specialize_float = True
    if compile_mode == "regional":
        # static shapes unless the caller says otherwise: in torch 2.13 a region reused in a graph
        # made dynamic by a later recompile can fail to trace
        options.setdefault("dynamic", False)
    device = model.norm.weight.device
    options.update(compile_options(device, compile_mode))
    compiled = torch.compile(fn, fullgraph=True, backend=backend(device), **options)
    if compile_mode != "regional":
        return compiled

    @functools.wraps(fn)
    def regional(model: Transformer, *args, **kwargs):
        model.regional = True  # read when the step is traced (and guarded): this step's layers only
        try:
            return compiled(model, *args, **kwargs)
        finally:
            model.regional = False
    return regional


def stance_skips_guards() -> bool:
    """torch.compiler.set_stance(skip_guard_eval_unsafe=) exists from torch 2.7 on."""
    stance = getattr(torch.compiler, "set_stance", None)
    return stance is not None and "skip_guard_eval_unsafe" in inspect.signature(stance).parameters


SKIPS_GUARDS = stance_skips_guards()


def guards_skipped(skip: bool):
    """Within one generate call a compiled step is called again and again with inputs of the same
    shapes: once its guards have been checked, skipping them saves about a millisecond a call on CPU."""
    if not (SKIPS_GUARDS and skip):  # the stance is global: left alone unless skipping
        return contextlib.nullcontext()
    return torch.compiler.set_stance(skip_guard_eval_unsafe=skip)


@contextlib.contextmanager
def compiling(then: str = "", every: float = 30.0):
    """While the block compiles, "still compiling (N s)" on stderr every `every` seconds (a log
    would otherwise stay silent for minutes); "compiled in N s" and `then` when it is done."""
    done, start = threading.Event(), time.perf_counter()

    def say(text: str):
        print(text, file=sys.stderr, flush=True)

    def tick():
        while not done.wait(every):
            say(f"still compiling ({time.perf_counter() - start:.0f} s)")

    threading.Thread(target=tick, daemon=True).start()
    try:
        yield
    finally:
        done.set()
    say(f"compiled in {time.perf_counter() - start:.1f} s{then}")
