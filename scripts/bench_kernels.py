"""The measurements behind the kernel choices in the README, on one model's layer shapes.

    python -m scripts.bench_kernels --what layers    # one decode token's products, per kernel
    python -m scripts.bench_kernels --what kinds --checkpoint checkpoints/qwen2.5-coder-0.5b
                                                     # a decode token's time per layer kind
    python -m scripts.bench_kernels --what verify    # a compiled (k+1)-token verify vs a decode step
    python -m scripts.bench_kernels --what prefill   # where a 494-token prefill spends its time
    python -m scripts.bench_kernels --what prefill --dtype bfloat16   # the same in bfloat16
    python -m scripts.bench_kernels --what gemm      # BLAS, oneDNN and small_linear by token count
    python -m scripts.bench_kernels --what attend    # a batch step's attention and its read rate
    python -m scripts.bench_kernels --what blocks    # that attention over blocks of 16 to 256 tokens

Run from the repository root. The model runs with kernels.py's CPU paths installed, as
loading.load_model does, through the engine's forwards (forwards.forward_chunk for a prompt,
forwards.forward_rides for a decode step) over a paged cache of BLOCK_SIZE-token blocks.

Every row of a table is timed in the same process, in interleaved rounds (median shown), so
the ratios hold even when the machine drifts. Speeds of whole runs are scripts/bench.py's job.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import kernels
import packing
import qlayers
import quantize as Q
from checkpoint import huge_page_zeros, write_json
from engine import BLOCK_SIZE
from forwards import bucket, forward_chunk, forward_rides
from loading import load_model
from model import ModelArgs
from sampling import Sampling
from thresholds import THRESHOLDS

ROOT = Path(__file__).resolve().parent.parent


def prefill(model, tokens: torch.Tensor, forward=forward_chunk) -> torch.Tensor:
    """A prompt's first chunk as the engine runs it (engine.forward_chunk, or its compiled `forward`):
    tokens (1, T) from position 0 in the cache's first blocks, nothing cached before them; the
    last position's logits (1, V)."""
    T, device = tokens.shape[1], tokens.device
    positions = torch.arange(T, device=device).view(1, -1)  # (1, T); in blocks 0, 1, ...: slot = position
    table = torch.arange(-(-T // BLOCK_SIZE), device=device).view(1, -1)
    last = torch.tensor([[T - 1]], device=device)
    return forward(model, tokens, positions, BLOCK_SIZE, T, True, last, slots=positions, block_table=table)[:, -1]


def decode_inputs(model, token: int, position: int) -> tuple:
    """forward_rides' inputs after the model, and its views: one row at `position` of a sequence in
    the cache's first blocks, reading the whole cache (model.setup_caches(1, max_seq_length)), its
    logits wanted."""
    tokens, positions = torch.tensor([[token]]), torch.tensor([[position]])  # (1, 1)
    table = torch.arange(model.max_seq_length // BLOCK_SIZE).view(1, -1)
    return (tokens, positions, BLOCK_SIZE, model.max_seq_length, torch.tensor([0])), dict(slots=positions,
                                                                                          block_table=table)


def timed(fns: dict, rounds: int, calls: int) -> dict:
    """name -> median milliseconds per call, over interleaved rounds after a warm-up."""
    times = {name: [] for name in fns}
    for f in fns.values():
        for _ in range(3):
            f()
    for _ in range(rounds):
        for name, f in fns.items():
            t = time.perf_counter()
            for _ in range(calls):
                f()
            times[name].append((time.perf_counter() - t) / calls * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def layer_shapes(args: ModelArgs) -> list:
    """(out, in) of one block's products: wqkv, wo, w1, w3, w2."""
    qkv = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
    return [(qkv, args.dim), (args.dim, args.n_heads * args.head_dim), (args.intermediate_size, args.dim),
            (args.intermediate_size, args.dim), (args.dim, args.intermediate_size)]


def int8_unpack_then_reduce(layer: qlayers.Int8Linear, x):
    """Another int8 expression for inductor: unpack to (out, blocks, 4, 8), then one reduction."""
    blocks = layer.packed.shape[1]
    xb = kernels.materialize(qlayers.padded_tokens(x, blocks * 32)).view(blocks, 4, 8)  # (blocks, 4, 8)
    return (packing.unpack_int8(layer.packed).float() * xb).sum((-3, -2, -1)) * layer.scales


def bench_layers(model_args: ModelArgs, options):
    """One decode token's products over all blocks (milliseconds per token), by kernel."""
    torch.manual_seed(0)
    shapes = layer_shapes(model_args)
    weights = [torch.randn(o, i) * 0.02 for o, i in shapes]
    xs = [torch.randn(1, 1, i) for _, i in shapes]

    def linears(dtype):
        mods = []
        for w in weights:
            lin = kernels.CpuLinear(w.shape[1], w.shape[0], bias=False)
            lin.weight.data = w.to(dtype)
            mods.append(lin)
        return mods

    def int8_layers():
        mods = []
        for w in weights:
            q, s = Q.quantize_int8(w)
            m = qlayers.Int8Linear(w.shape[1], w.shape[0])
            m.weight, m.scales = q, s
            m.pack({})
            mods.append(m)
        return mods

    def int4_layers():
        mods = []
        for w in weights:
            q, s, z = Q.quantize_int4(w, 32)
            m = qlayers.Int4Linear(w.shape[1], w.shape[0], 32)
            m.weight, m.scales, m.zeros = packing.nibbles_to_bytes(q), s.half(), z.half()
            m.pack({})
            mods.append(m)
        return mods

    def lanes(make):  # packed in lanes for inductor's unpacking expression, as without kernels.py
        with kernels.switched_off():
            return make()

    def compiled(mods, call=lambda m, x: m(x)):
        f = torch.compile(lambda ms, xs: [call(m, x) for m, x in zip(ms, xs)], fullgraph=True)
        return lambda: f(mods, xs)

    f32, b16, i8, i4 = linears(torch.float32), linears(torch.bfloat16), int8_layers(), int4_layers()
    i8_lanes, i4_lanes = lanes(int8_layers), lanes(int4_layers)
    int8_rows = [Q.quantize_int8(w) for w in weights]
    xs16 = [x.reshape(1, -1).bfloat16() for x in xs]
    packed_fbgemm = []
    for w in weights:  # fbgemm's dynamic int8 linear: int8 weights, activations quantized per call
        s = w.abs().amax(1) / 127
        qw = torch.quantize_per_channel(w, s.double(), torch.zeros(len(s), dtype=torch.long), 0, torch.qint8)
        packed_fbgemm.append(torch.ops.quantized.linear_prepack(qw, None))
    int8_t = [q.t().contiguous() for q, _ in int8_rows]  # (in, out) for torch._int_mm

    def int_mm(x, qt, scales):  # activations quantized per call (symmetric, one scale), int32 product
        xs = x.reshape(1, -1).abs().amax() / 127
        xq = (x.reshape(1, -1) / xs).round().to(torch.int8)
        return torch._int_mm(xq, qt).float() * xs * scales

    fns = {
        "float32 F.linear (BLAS gemv), eager": lambda: [F.linear(x, m.weight) for m, x in zip(f32, xs)],
        "float32 multiply-and-sum, compiled (ours)": compiled(f32),
        "bfloat16 F.linear (oneDNN), eager": lambda: [F.linear(x.bfloat16(), m.weight) for m, x in zip(b16, xs)],
        "bfloat16 multiply-and-sum, compiled (ours)": compiled(b16),
        "int8 kernels.q8_linear, int8 activations, compiled (ours)": compiled(i8),
        "int8 four shifted terms, compiled (inductor; without kernels.py)": compiled(i8_lanes),
        "int8 unpack then reduce, compiled (inductor; alternative expression)":
            compiled(i8_lanes, int8_unpack_then_reduce),
        "int8 _weight_int8pack_mm, bf16 activations": lambda: [
            torch.ops.aten._weight_int8pack_mm(x, q, s.bfloat16()) for x, (q, s) in zip(xs16, int8_rows)],
        "int8 fbgemm quantized::linear_dynamic": lambda: [
            torch.ops.quantized.linear_dynamic(x.reshape(1, -1), p, True) for x, p in zip(xs, packed_fbgemm)],
        "int8 torch._int_mm, int8 activations": lambda: [
            int_mm(x, qt, sc) for x, qt, (_, sc) in zip(xs, int8_t, int8_rows)],
        "int4 g32 kernels.q4_linear, int8 activations, compiled (ours)": compiled(i4),
        "int4 g32 unpacking expression, compiled (inductor; without kernels.py)": compiled(i4_lanes),
    }
    weights_mb = sum(w.numel() for w in weights) * model_args.n_layers / 1e6
    print(f"one decode token's products over {model_args.n_layers} blocks ({weights_mb:.0f}M weights), "
          f"median of {options.rounds} interleaved rounds; per-call overhead included")
    print("| kernel | ms per token |\n|---|---|")
    with torch.inference_mode():
        for name, ms in timed(fns, options.rounds, options.calls).items():
            print(f"| {name} | {ms * model_args.n_layers:.2f} |")


def bench_kinds(model_args: ModelArgs, options):
    """Where a float decode token's time goes, per layer kind, over all blocks (each block's
    weights its own tensor, so they stream from memory as in the model): the one-token product
    as inductor's multiply-and-sum and as kernels.small_linear, and attention over a 145-token
    context with kernels.attend."""
    if not kernels.available():
        raise SystemExit("error: the kernels could not be built here")
    torch.manual_seed(0)
    # dynamo caches by code object, so the multiply-and-sum lambdas below, one torch.compile per
    # shape, share one cache: it needs an entry per layer kind and dtype
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
    a, L = model_args, model_args.n_layers
    kinds = dict(zip(["wqkv", "wo", "w1 (and w3)", "w2"], layer_shapes(a)))
    kinds["w1 (and w3)"] = (2 * a.intermediate_size, a.dim)
    kinds["output head"] = (a.vocab_size, a.dim)
    S, ctx = 512, 145  # cache slots, tokens in the context
    group = a.n_heads // a.n_kv_heads
    mask = torch.full((1, 1, 1, S), float("-inf"))
    mask[..., :ctx] = 0
    for dtype in (torch.float32, torch.bfloat16):
        rows, fns = {}, {}
        for kind, (out, inp) in kinds.items():
            ws = [(torch.randn(out, inp) * 0.02).to(dtype) for _ in range(1 if kind == "output head" else L)]
            x = torch.randn(1, inp)
            rows[kind] = sum(w.numel() * w.element_size() for w in ws)
            mulsum = torch.compile(lambda w, x: (w.float() * kernels.materialize(x)).sum(-1), fullgraph=True,
                                   dynamic=False)
            fns[(kind, "multiply-and-sum")] = lambda ws=ws, x=x, f=mulsum: [f(w, x) for w in ws]
            fns[(kind, "small_linear")] = lambda ws=ws, x=x: [kernels.small_linear(x, w) for w in ws]
        caches = [(torch.randn(1, a.n_kv_heads, S, a.head_dim).to(dtype), torch.randn(1, a.n_kv_heads, S, a.head_dim).to(dtype))
                  for _ in range(L)]
        q = torch.randn(1, a.n_kv_heads, group, a.head_dim)
        fns[("attention", "kernels.attend")] = lambda: [kernels.attend(q, k, v, mask, a.head_dim ** -0.5) for k, v in caches]
        with torch.inference_mode():
            ms = timed(fns, options.rounds, 3)
        print(f"\n{dtype} one-token decode, {L} blocks, median of {options.rounds} interleaved rounds")
        print("| layer kind | bytes a token | multiply-and-sum, compiled: ms (GB/s) | kernels.small_linear: ms (GB/s) |\n|---|---|---|---|")
        for kind, nbytes in rows.items():
            cells = [f"{ms[(kind, k)]:.2f} ({nbytes / ms[(kind, k)] / 1e6:.0f})" for k in ("multiply-and-sum", "small_linear")]
            print(f"| {kind} | {nbytes / 1e6:.0f} MB | {cells[0]} | {cells[1]} |")
        print(f"| attention, {ctx} tokens (kernels.attend) | | | {ms[('attention', 'kernels.attend')]:.2f} |")


def bench_verify(model, options):
    """A decode step against a (k+1)-token forward (compiled with kernels.small_linear, compiled
    with BLAS, eager); and one layer's product at several token counts: compiled
    multiply-and-sum, BLAS and kernels.small_linear."""
    s = Sampling()
    model.setup_caches(1, 512)
    step = torch.compile(forward_rides, fullgraph=True)  # the engine's decode step, sampling included
    verify = torch.compile(lambda m, t, p: m(t, p)[0].argmax(-1), fullgraph=True, dynamic=False)
    k = options.speculate_k
    tokens, positions = torch.arange(5, 6 + k).view(1, -1), torch.arange(100, 101 + k)
    one, views = decode_inputs(model, 5, 100)
    # the same verify traced with kernels.small_linear switched off: a compiled graph reads the
    # switch once, when it is traced (a separate lambda is a separate graph)
    verify_blas = torch.compile(lambda m, t, p: m(t, p)[0].argmax(-1), fullgraph=True, dynamic=False)
    with kernels.switched_off(), torch.inference_mode():
        verify_blas(model, tokens, positions)

    with torch.inference_mode():
        ms = timed({"decode step, compiled": lambda: step(model, *one, s, **views),
                    f"{k + 1}-token verify, compiled": lambda: verify(model, tokens, positions),
                    f"{k + 1}-token verify, compiled, BLAS instead of kernels.small_linear":
                        lambda: verify_blas(model, tokens, positions),
                    f"{k + 1}-token forward, eager (BLAS)": lambda: model(tokens, positions)}, options.rounds, 5)
    print(f"| forward ({model.args.dim}-dim model, 512-slot cache) | ms | decode steps |\n|---|---|---|")
    for name, t in ms.items():
        print(f"| {name} | {t:.1f} | {t / ms['decode step, compiled']:.2f} |")

    out, inp = model.args.intermediate_size, model.args.dim
    w = torch.randn(out, inp)
    # (out, T): each weight row read once and reused for every token; inductor keeps one accumulator
    mulsum = torch.compile(lambda w, x: (w[:, None, :] * kernels.materialize(x)).sum(-1).t(), fullgraph=True,
                           dynamic=False)
    print(f"\n| tokens | {out}x{inp} multiply-and-sum, compiled, us | F.linear (BLAS), us | kernels.small_linear, us |"
          "\n|---|---|---|---|")
    with torch.inference_mode():
        for T in (1, 2, 4, 9, 16):
            x = torch.randn(T, inp)
            r = timed({"mulsum": lambda: mulsum(w, x), "blas": lambda: F.linear(x, w),
                       "small": lambda: kernels.small_linear(x, w)}, options.rounds, 50)
            print(f"| {T} | {r['mulsum'] * 1e3:.0f} | {r['blas'] * 1e3:.0f} | {r['small'] * 1e3:.0f} |")


def prefill_parts(model, run, rounds: int) -> dict:
    """Wall-clock milliseconds of an eager prefill's parts, medians over rounds: the weights'
    oneDNN GEMMs (kernels.dense_linear), attention (CpuAttention.attend) and the rest; then the
    same GEMM calls repeated one by one, hot, where oneDNN reaches its best rate. (A profiler's
    attribution inflates the GEMMs; plain timers do not.)"""
    parts, calls = {"gemm": 0.0, "attention": 0.0}, []
    dense, attend = kernels.dense_linear, kernels.CpuAttention.attend

    def timed_dense(x, w, bias=None):
        start = time.perf_counter()
        y = dense(x, w, bias)
        parts["gemm"] += time.perf_counter() - start
        calls.append((x, w, bias))
        return y

    def timed_attend(self, *args, **kwargs):
        start = time.perf_counter()
        y = attend(self, *args, **kwargs)
        parts["attention"] += time.perf_counter() - start
        return y

    rows = {"whole": [], "gemm": [], "attention": []}
    kernels.dense_linear, kernels.CpuAttention.attend = timed_dense, timed_attend
    try:
        for _ in range(rounds):
            parts.update(gemm=0.0, attention=0.0)
            calls.clear()
            start = time.perf_counter()
            run()
            rows["whole"].append(time.perf_counter() - start)
            rows["gemm"].append(parts["gemm"])
            rows["attention"].append(parts["attention"])
    finally:
        kernels.dense_linear, kernels.CpuAttention.attend = dense, attend
    out = {k: statistics.median(v) * 1e3 for k, v in rows.items()}
    out["rest"] = out["whole"] - out["gemm"] - out["attention"]
    out["gflop"] = sum(2 * x.shape[:-1].numel() * w.shape[0] * w.shape[1] for x, w, _ in calls) / 1e9
    hot = 0.0
    for x, w, bias in calls:
        hot += timed({"hot": lambda: dense(x, w, bias)}, 3, 3)["hot"]
    out["gemm_hot"] = hot
    return out


def bench_prefill(model, options):
    """Operator shares of an eager 494-token prefill, its parts by wall clock against its GEMMs
    repeated hot, then eager against compiled prefill."""
    T = 494
    model.setup_caches(1, 640)
    tokens = torch.randint(0, model.args.vocab_size, (1, T))
    compiled = torch.compile(forward_chunk, dynamic=True, fullgraph=True)  # the engine's --compile_prefill
    with torch.inference_mode():
        prefill(model, tokens)
        with torch.profiler.profile() as prof:
            prefill(model, tokens)
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events)
        print(f"| operator (eager {T}-token prefill) | share of self CPU time |\n|---|---|")
        for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:6]:
            print(f"| {e.key} | {100 * e.self_cpu_time_total / total:.0f}% |")
        ms = timed({"eager": lambda: prefill(model, tokens),
                    "compiled (--compile_prefill)": lambda: prefill(model, tokens, compiled)}, options.rounds, 1)
        parts = prefill_parts(model, lambda: prefill(model, tokens), options.rounds)
    print(f"\n| eager {T}-token prefill, by wall clock | ms | share | GFLOP/s |\n|---|---|---|---|")
    print(f"| whole | {parts['whole']:.0f} | | {parts['gflop'] / parts['whole'] * 1e3:.0f} |")
    for name, key in (("weights' GEMMs (oneDNN), %.0f GFLOP" % parts["gflop"], "gemm"),
                      ("attention", "attention"), ("everything else", "rest")):
        rate = f"{parts['gflop'] / parts[key] * 1e3:.0f}" if key == "gemm" else ""
        print(f"| {name} | {parts[key]:.0f} | {100 * parts[key] / parts['whole']:.0f}% | {rate} |")
    print(f"| the same GEMMs, each repeated hot | {parts['gemm_hot']:.0f} | | "
          f"{parts['gflop'] / parts['gemm_hot'] * 1e3:.0f} |")
    print(f"\n| {T}-token prefill | ms |\n|---|---|")
    for name, t in ms.items():
        print(f"| {name} | {t:.0f} |")
    return {"tokens": T, "dtype": str(model.norm.weight.dtype).removeprefix("torch."), "eager_ms": ms["eager"],
            "compiled_ms": ms["compiled (--compile_prefill)"], "parts_ms": parts}


def bench_gemm(args: ModelArgs, options):
    """GFLOP/s of one product of T tokens by a layer's weight: BLAS (F.linear), oneDNN
    (kernels.dense_linear, what prompts and batches take) and kernels.small_linear."""
    dtype = getattr(torch, options.dtype)
    shapes = {"w1": (args.intermediate_size, args.dim), "w2": (args.dim, args.intermediate_size)}
    print(f"| {options.dtype} product | tokens | F.linear (BLAS) | oneDNN (dense_linear) | small_linear |\n|---|---|---|---|---|")
    with torch.inference_mode():
        for kind, (out, inp) in shapes.items():
            w = torch.randn(out, inp).to(dtype)
            for T in (8, 16, 32, 64, 128, 494):
                x = torch.randn(T, inp).to(dtype)
                fns = {"blas": lambda: F.linear(x, w), "onednn": lambda: kernels.dense_linear(x, w)}
                if T <= THRESHOLDS.linear_max_tokens:
                    fns["small"] = lambda: kernels.small_linear(x.float(), w)
                ms = timed(fns, options.rounds, 10)
                gflops = {k: 2 * T * out * inp / (t * 1e6) for k, t in ms.items()}
                cells = [f"{gflops[k]:.0f}" if k in gflops else "" for k in ("blas", "onednn", "small")]
                print(f"| {kind} {out}x{inp} | {T} | " + " | ".join(cells) + " |")


def paged_pools(args: ModelArgs, dtype: str) -> tuple:
    """Every layer's key and value pools of 17 x 4,096 slots (so that a step reads them from memory),
    on 2 MB pages as the engine's are: (kv heads, query group, layers, 4096, head_dim, [(k, v)])."""
    H, G, L, S = args.n_kv_heads, args.n_heads // args.n_kv_heads, args.n_layers, 4096
    D = args.head_dim or args.dim // args.n_heads
    caches = [tuple(huge_page_zeros((17 * S, H, D), getattr(torch, dtype), "cpu").copy_(torch.randn(17 * S, H, D))
                    for _ in "kv") for _ in range(L)]
    return H, G, L, S, D, caches


def scattered_slots(block_size: int, S: int, seed: int) -> torch.Tensor:
    """The slots (16, S) of 16 sequences of S positions whose blocks are scattered over the pool."""
    per_row = S // block_size
    tables = torch.randperm(17 * per_row, generator=torch.Generator().manual_seed(seed))[:16 * per_row].view(16, -1)
    positions = torch.arange(S)
    return tables[:, positions // block_size] * block_size + positions % block_size


def bench_attend(args: ModelArgs, options) -> dict:
    """A batch step's attention over every layer (kernels.attend, milliseconds a step) and the
    rate it reads keys and values at, over a server's paged cache (a pool of 17 x 4,096 slots a
    layer, so that they come from memory, as in a step, where the weights pass through the caches;
    each of 16 sequences in BLOCK_SIZE-token blocks scattered over it, read in place through their
    slots), under a step's mask: as wide as the engine's bucket of the position."""
    if not kernels.available():
        print("attend: the kernels could not be built here", file=sys.stderr)
        return {}
    H, G, L, S, D, caches = paged_pools(args, options.dtype)
    row_slots = scattered_slots(BLOCK_SIZE, S, seed=0)
    print(f"| {options.dtype} cache: rows | position | ms a step | keys and values read (GB/s) |\n|---|---|---|---|")
    result = {}
    with torch.inference_mode():
        for B in (2, 16, 64):
            rows = torch.arange(B) % 16  # 16 sequences (a prompt chunk's rows share one)
            for pos in (300, 1000, 3000):
                q = torch.randn(B, H, G, D)
                width = bucket(pos + 1, S)
                mask = torch.zeros(B, 1, 1, width)
                mask[..., pos:] = float("-inf")
                slots = row_slots[rows, :width]  # (B, width)
                step = lambda: [kernels.attend(q, k, v, mask, D ** -0.5, 0.0, slots) for k, v in caches]  # noqa: E731
                ms = timed({"attend": step}, options.rounds, 2)["attend"]
                gbs = 2 * L * B * H * pos * D * caches[0][0].element_size() / (ms * 1e6)
                print(f"| {B} | {pos} | {ms:.2f} | {gbs:.1f} |")
                result[f"{B} rows at {pos}"] = {"ms": ms, "GB/s": gbs}
    return result


def bench_blocks(args: ModelArgs, options) -> dict:
    """A batch step's attention (every layer, kernels.attend) over a paged cache of blocks of 16 to
    256 tokens, each sequence's blocks scattered over the pool: what the block size costs the read.
    The block sizes are timed in interleaved rounds."""
    if not kernels.available():
        print("blocks: the kernels could not be built here", file=sys.stderr)
        return {}
    H, G, L, S, D, caches = paged_pools(args, options.dtype)
    sizes, result = (16, 32, 64, 128, 256), {}
    print(f"| {options.dtype} cache: rows | position | " + " | ".join(f"{b}-token blocks (ms)" for b in sizes)
          + " |\n|---|---|" + "---|" * len(sizes))
    with torch.inference_mode():
        for B, pos in ((1, 1000), (16, 1000), (16, 3000)):
            q = torch.randn(B, H, G, D)
            width = bucket(pos + 1, S)
            mask = torch.zeros(B, 1, 1, width)
            mask[..., pos:] = float("-inf")
            steps = {}
            for bs in sizes:
                slots = scattered_slots(bs, S, seed=bs)[:B, :width]  # (B, width)
                steps[bs] = lambda slots=slots: [kernels.attend(q, k, v, mask, D ** -0.5, 0.0, slots)
                                                 for k, v in caches]
            ms = timed(steps, options.rounds, 2)
            print(f"| {B} | {pos} | " + " | ".join(f"{ms[b]:.2f}" for b in sizes) + " |")
            result[f"{B} rows at {pos}"] = {str(b): ms[b] for b in sizes}
    return result


def add_to_json(path: Path, key: str, result: dict):
    """One entry per measurement, checkpoint and dtype, kept beside the file's others."""
    old = json.loads(path.read_text()) if path.is_file() else {}
    write_json(path, old | {key: result})


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--checkpoint", type=Path, default=ROOT / "checkpoints" / "smollm2-135m",
                   help="model whose shapes (layers) or weights (verify, prefill) are used")
    p.add_argument("--what", choices=["layers", "kinds", "verify", "prefill", "gemm", "attend", "blocks", "all"], default="all")
    p.add_argument("--speculate_k", type=int, default=8, help="verify: proposals per verify forward")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the median is shown")
    p.add_argument("--calls", type=int, default=20, help="layers: calls per round")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, help="prefill, attend, blocks: add its figures to this JSON file")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="verify, prefill, gemm: the model's dtype; attend: the cache's")
    options = p.parse_args(argv)
    if not (options.checkpoint / "config.json").is_file():
        print(f"error: no checkpoint at {options.checkpoint} (python download.py smollm2-135m)", file=sys.stderr)
        return 1
    torch.set_num_threads(options.threads)
    if options.what in ("layers", "all"):
        bench_layers(ModelArgs.from_json(options.checkpoint / "config.json"), options)
    if options.what in ("kinds", "all"):
        bench_kinds(ModelArgs.from_json(options.checkpoint / "config.json"), options)
    if options.what in ("gemm", "all"):
        bench_gemm(ModelArgs.from_json(options.checkpoint / "config.json"), options)
    if options.what in ("attend", "all"):
        result = bench_attend(ModelArgs.from_json(options.checkpoint / "config.json"), options)
        if options.json:
            add_to_json(options.json, f"attend {options.checkpoint.name} {options.dtype}", result)
    if options.what in ("blocks", "all"):
        result = bench_blocks(ModelArgs.from_json(options.checkpoint / "config.json"), options)
        if options.json:
            add_to_json(options.json, f"blocks {options.checkpoint.name} {options.dtype}", result)
    if options.what in ("verify", "prefill", "all"):
        model = kernels.install(load_model(options.checkpoint, torch.device("cpu"), getattr(torch, options.dtype)))
        if options.what in ("verify", "all"):
            print()
            bench_verify(model, options)
        if options.what in ("prefill", "all"):
            print()
            result = bench_prefill(model, options)
            if options.json:
                add_to_json(options.json, f"{options.checkpoint.name} {options.dtype}", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
