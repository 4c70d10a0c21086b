"""CPU fast paths, swapped into a built model by `install(model)`; model.py stays the reference
(nn.Linear and SDPA), as qlayers.py's layers are swapped in by `use_quantized_layers`.

- `CpuLinear` (for every nn.Linear): one token through `small_linear`'s AVX-512 loop, compiled
  products of a few tokens through `small_linear` (one token without AVX-512: a multiply-and-sum
  that inductor vectorizes), more tokens through oneDNN's GEMM rather than BLAS, and bfloat16
  prompts in float32 on a CPU without bf16 instructions.
- `CpuAttention` (for model.Attention): a few queries under a mask (decode, a speculative
  verify) through `attend`, or spelled out for inductor to fuse when the kernels are not built;
  a long prompt in chunks of queries, each through `prompt_attend` (bfloat16, AVX-512 BF16) or
  two oneDNN GEMMs (`chunk_attention`).

The hand-written kernels, in kernels.cpp:
- `small_linear`: float32 or bfloat16 weights times 2 to 128 tokens. BLAS's small-M GEMM is
  compute-bound far below the machine's peak for such shapes, and inductor's multiply-and-sum
  keeps one accumulator per output, a serial chain of multiply-adds. This is the textbook
  register-blocked micro-kernel: two weight rows times up to six tokens, twelve AVX2
  accumulators in registers, each weight read once per call for every token. One token with
  AVX-512 (the decode step): each thread streams its rows one at a time with four 16-lane
  accumulators, ~50 GB/s where inductor's multiply-and-sum reads a 4864-wide row at ~30; a
  bfloat16 model's token stays bfloat16 there with AVX-512 BF16 (`vdpbf16ps`, exact products).
- `q8_linear`, `q4_linear`: quantize.py's int8 and int4 weights times 1 to 16 tokens, decode
  included. As llama.cpp does, the activations are quantized to int8 per 32 columns on the way
  in, so 32 products are two integer instructions; the float unpack-and-multiply that inductor
  generates is compute-bound.
- `attend`: attention for a few query rows per KV head over the keys each row's mask allows,
  where inductor's code and CPU SDPA read the whole preallocated cache.
- `prompt_attend`: a bfloat16 prompt's attention, a chunk of queries at a time, with AVX-512
  BF16's bfloat16 dot products into float32 scores.
- `gated`: act(gate) * up for an eager prompt's feed-forward in one pass (`CpuFeedForward`).
- `rms_norm`: an eager prompt's RMS normalization in two passes a row (`CpuRMSNorm`).
- `stream_sum`: a tensor's sum as plain sequential reads, the bandwidth reference of
  scripts/bench.py.

kernels.cpp is compiled once per checkout with torch.utils.cpp_extension (g++ is needed anyway:
it is what inductor compiles to on CPU) and registers the operators `minillm::...`, which
compiled graphs call like aten ops. On a CPU with AVX-512 VNNI the integer dot products use its
vpdpbusd (one instruction for AVX2's two); MINILLM_KERNELS_VNNI=0 builds the AVX2 loops there
too. Where it cannot be built (no AVX2, no compiler) or when MINILLM_KERNELS=0, `available()`
is False and the layers use F.linear, SDPA and inductor.
"""
import functools
import hashlib
import os
import sys
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from model import ACTIVATIONS, Attention, FeedForward, RMSNorm
from thresholds import THRESHOLDS

KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # the float dtypes small_linear and attend take
SOURCE = Path(__file__).with_name("kernels.cpp")

_state = {"built": None}


@torch.compiler.assume_constant_result  # a compiled graph asks once, at trace time
def available() -> bool:
    """Build (once per machine; cached by torch under ~/.cache/torch_extensions) and load the
    kernels; False where they cannot run."""
    if _state["built"] is None:
        _state["built"] = _build()
    return _state["built"]


@functools.cache
def cpu_flags() -> Optional[frozenset]:
    """The x86 CPU's feature flags as Linux lists them (avx2, avx512_vnni, ...): empty on other
    CPUs, None where /proc/cpuinfo cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line for line in f if line.startswith("flags")), "").split()[2:])
    except OSError:
        return None


def has_vnni() -> bool:
    """Whether this CPU has AVX-512 VNNI (with the VL and BW parts the 256-bit form needs); the
    kernels are then built with it, unless MINILLM_KERNELS_VNNI=0."""
    if os.environ.get("MINILLM_KERNELS_VNNI", "1") == "0":
        return False
    return {"avx512_vnni", "avx512vl", "avx512bw", "avx512f"} <= (cpu_flags() or set())


def has_bf16_dot() -> bool:
    """Whether the AVX-512 build also gets AVX-512 BF16's vdpbf16ps (`prompt_attend`)."""
    return "avx512_bf16" in (cpu_flags() or set())


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX-512-BF16 or AMX); True when unknown."""
    flags = cpu_flags()
    return flags is None or "avx512_bf16" in flags or "amx_bf16" in flags


CPU_HAS_BF16 = cpu_has_bf16()  # read once: the compiled graph sees a constant
# oneDNN JIT-compiles its GEMM for the CPU's widest vectors whoever made the CPU; MKL, torch's
# float32 BLAS, runs at half of that on AMD's AVX-512 cores
ONEDNN = torch.backends.mkldnn.is_available() and "avx2" in (cpu_flags() or set())
AVX512 = has_vnni()  # the build with AVX-512, whose one-token float product beats inductor's
BF16_DOT = AVX512 and has_bf16_dot()  # the build with AVX-512 BF16: `prompt_attend`, the bf16 one-token loop
PROMPT_ATTEND = BF16_DOT  # whether a bf16 prompt's attention takes `prompt_attend` (tests switch it off)


def build_flags(vnni: bool) -> list:
    isa = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"] if vnni else []
    if vnni and has_bf16_dot():
        isa.append("-mavx512bf16")
    return ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", *isa]


def build_name(source: Path, cflags: list) -> str:
    """The extension's name, and so its build directory under ~/.cache/torch_extensions: one per
    checkout (the source's path), kernels.cpp text, compiler flags and torch version. torch rebuilds
    a name's library whenever the source path or flags change: under one name, two checkouts on a
    machine rebuilt it at every switch, and a process that waited on the other's build loaded the
    other's kernels."""
    key = hashlib.sha256(b"\0".join([str(source.resolve()).encode(), source.read_bytes(), " ".join(cflags).encode(),
                                      torch.__version__.encode()])).hexdigest()[:12]
    return f"minillm_kernels_{key}"


def build_directory(name: str) -> Path:
    """Where the extension `name` is built: torch's extensions root, one folder per Python version."""
    from torch.utils.cpp_extension import get_default_build_root
    return Path(get_default_build_root()) / f"py{sys.version_info.major}{sys.version_info.minor}_cpu" / name


def build_line(name: str, vnni: bool) -> Optional[str]:
    """What to say before loading the extension `name`: that it builds, or nothing when it is built."""
    if (build_directory(name) / f"{name}.so").exists():
        return None
    return f"kernels.py: building the CPU kernels ({'AVX-512 VNNI' if vnni else 'AVX2'}; once per checkout, ~1 min)"


def _build() -> bool:
    if os.environ.get("MINILLM_KERNELS", "1") == "0":
        return False
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return False
    # the ninja that requirements.txt installs sits next to this Python, maybe not on PATH
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    vnni = has_vnni()
    try:
        from torch.utils.cpp_extension import load
        cflags = build_flags(vnni)
        name = build_name(SOURCE, cflags)
        where = build_directory(name)
        where.mkdir(parents=True, exist_ok=True)
        if line := build_line(name, vnni):
            print(line, file=sys.stderr)
        # is_python_module=False: kernels.cpp registers its operators itself (TORCH_LIBRARY), and
        # the library is loaded into torch.ops.minillm
        load(name=name, sources=[str(SOURCE)], is_python_module=False, build_directory=str(where),
             extra_ldflags=["-fopenmp"], extra_cflags=cflags)
    except Exception as e:  # no compiler, no headers: fall back to BLAS, say why once
        print(f"kernels.py: CPU kernels not built ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
              "falling back to F.linear and inductor", file=sys.stderr)
        return False

    for op in ("small_linear", "q8_linear", "q4_linear"):  # the output shape, for tracing
        torch.library.register_fake(f"minillm::{op}")(
            lambda x, w, *scales: x.new_empty(x.shape[0], w.shape[0], dtype=torch.float32))
    torch.library.register_fake("minillm::q8_dequantize")(
        lambda w, scale, K, bf16: w.new_empty(w.shape[0], K, dtype=torch.bfloat16 if bf16 else torch.float32))
    torch.library.register_fake("minillm::q4_dequantize")(
        lambda w, s, z, g, K, bf16: w.new_empty(w.shape[0], K, dtype=torch.bfloat16 if bf16 else torch.float32))
    torch.library.register_fake("minillm::attend")(
        lambda q, *rest: torch.empty_like(q, memory_format=torch.contiguous_format))
    return True


@contextmanager
def switched_off():
    """Callers take their other paths inside (eager calls; a graph traced inside keeps them)."""
    built = available()
    _state["built"] = False
    try:
        yield
    finally:
        _state["built"] = built


def small_linear(x: Tensor, w: Tensor) -> Tensor:
    """x (..., K) float32 times w (N, K) float32 or bfloat16, transposed: (..., N) float32. Where
    BF16_DOT, x may also be one bfloat16 token times bfloat16 w (AVX-512 BF16's products)."""
    if x.dtype == torch.bfloat16 and (x.shape[:-1].numel() != 1 or w.dtype != torch.bfloat16):
        # checked here, not only by the operator: a C++ exception thrown from the extension killed the
        # process on a GPU machine's image (torch 2.11)
        raise RuntimeError(f"small_linear: a bfloat16 x must be one token (1, {w.shape[-1]}) times bfloat16 weights")
    y = torch.ops.minillm.small_linear(x.reshape(-1, x.shape[-1]), w)  # (tokens, N)
    return y.view(*x.shape[:-1], w.shape[0])


# prepack's copies of weights in oneDNN's blocked layout, found by the weight's address and shape
# when the product runs (a compiled graph cannot take an opaque oneDNN tensor as an input, and a
# per-layer constant would keep one compiled layer from serving every layer, compile_mode regional)
_PACKED: dict = {}


def packed_key(w: Tensor) -> tuple:
    return (w.data_ptr(), *w.shape)


@torch.library.custom_op("minillm_dnn::linear", mutates_args=())
def _onednn_linear(x: Tensor, w: Tensor, bias: Optional[Tensor]) -> Tensor:
    # opaque to inductor, which would otherwise lower the product to BLAS (or fail to lower the
    # oneDNN op with a weight that is not a frozen constant)
    return torch.ops.mkldnn._linear_pointwise(x, _PACKED.get(packed_key(w), w), bias, "none", [None], None)


@_onednn_linear.register_fake
def _(x: Tensor, w: Tensor, bias: Optional[Tensor]) -> Tensor:
    return x.new_empty(x.shape[0], w.shape[0])


def uses_onednn(tokens: int, dtype: torch.dtype, w: Tensor) -> bool:
    """Whether `dense_linear` takes `tokens` tokens in dtype times w: on CPU, float32 and bfloat16
    (on a CPU with bf16 instructions) from onednn_min_tokens, where oneDNN beats small_linear and BLAS."""
    return dtype == w.dtype and onednn_dtype(w.device, dtype) and tokens >= onednn_min_tokens(dtype)


def onednn_dtype(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN's GEMM takes products in dtype on device: float32 on CPU, and bfloat16 on a
    CPU with bf16 instructions."""
    return ONEDNN and device.type == "cpu" and (dtype == torch.float32 or (dtype == torch.bfloat16 and CPU_HAS_BF16))


def onednn_min_tokens(dtype: torch.dtype) -> int:
    """Tokens from which oneDNN's GEMM beats small_linear, from THRESHOLDS. (A comparison, not a
    dict keyed by dtype: a compiled region cannot rebuild a guard on such a lookup.)"""
    return THRESHOLDS.onednn_min_tokens_bf16 if dtype == torch.bfloat16 else THRESHOLDS.onednn_min_tokens


def compiled_onednn_min_tokens(dtype: torch.dtype) -> int:
    """Tokens from which a compiled product takes oneDNN's GEMM: float32 with AVX-512 past
    tile_max_tokens, where small_linear's 512-bit tiles stop beating it; else onednn_min_tokens."""
    return THRESHOLDS.tile_max_tokens + 1 if dtype == torch.float32 and AVX512 else onednn_min_tokens(dtype)


def dense_linear(x: Tensor, w: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """F.linear(x, w, bias) through oneDNN's GEMM: x (..., K), w (N, K), both float32 or both
    bfloat16 (see `uses_onednn`); (..., N) in x's dtype, accumulated in float32. w's copy from
    `prepack` is read instead of w while it is there."""
    y = _onednn_linear(x.reshape(-1, x.shape[-1]).contiguous(), w.contiguous(), bias)  # (tokens, N)
    return y.view(*x.shape[:-1], w.shape[0])


def prepack_bytes(model: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """The bytes `prepack` adds to a model that load_model builds on `device` in `dtype`, given
    the model as meta_model builds it: a copy of each float linear weight, a tied one once."""
    if not onednn_dtype(device, dtype):
        return 0
    weights = {id(m.weight): m.weight for m in model.modules() if isinstance(m, nn.Linear)}
    return sum(w.numel() for w in weights.values() if w.is_floating_point()) * dtype.itemsize


def prepack(model: nn.Module) -> int:
    """Give every CpuLinear whose products can take oneDNN's GEMM (`uses_onednn`) a copy of its
    weight in oneDNN's own blocked layout, which `dense_linear` then reads: the same products, bit
    for bit, without the reorder that oneDNN otherwise makes of a plain weight on every call, a
    fifth of a 16-row float32 step's products and a third in bfloat16 (docs/benchmarks.md). The
    plain weight stays, for the smaller products. Call it once the weights are final: the copy
    does not follow later changes to them. Costs `prepack_bytes`; returns how many it packed."""
    copies, count = {}, 0
    for module in model.modules():
        w = getattr(module, "weight", None)
        if not isinstance(module, CpuLinear) or not onednn_dtype(w.device, w.dtype) or module_packed(module):
            continue
        if id(w) not in copies:  # a tied weight is packed once
            key = packed_key(w)
            with torch.no_grad():
                _PACKED[key] = torch.ops.mkldnn._reorder_linear_weight(w.detach(), onednn_min_tokens(w.dtype))
            weakref.finalize(w, _PACKED.pop, key, None)  # goes with the weight
            copies[id(w)] = key
        module.packed = copies[id(w)]
        count += 1
    return count


def module_packed(module: nn.Module) -> bool:
    """Whether `prepack` gave this layer a copy that is still there."""
    return getattr(module, "packed", None) in _PACKED and module.packed == packed_key(module.weight)



def stream_sum(t: Tensor, streams: int = 1) -> float:
    """The sum of a contiguous float32 tensor (numel a multiple of 16), each thread reading its
    part as `streams` interleaved sequential streams: scripts/bench.py's read bandwidth."""
    if not (t.is_contiguous() and t.dtype == torch.float32 and t.numel() % 16 == 0 and 1 <= streams <= 8):
        raise RuntimeError("stream_sum: contiguous float32, a multiple of 16 elements, 1 to 8 streams")  # as small_linear
    return torch.ops.minillm.stream_sum(t, streams)


def q8_linear(x: Tensor, w: Tensor, scale: Tensor) -> Tensor:
    """x (T, K) float32 times an int8 weight w (N, K), K a multiple of 32, per-row scale (N,):
    activations quantized to int8 per 32 columns on the way in."""
    return torch.ops.minillm.q8_linear(x, w, scale)


def q4_linear(x: Tensor, w: Tensor, scales: Tensor, zeros: Tensor, groupsize: int) -> Tensor:
    """x (T, K) float32 times quantize.py's int4 weight packed by packing.pack_int4_rows: w uint8
    (N, K / 2), scales and zeros float16 (N, groups padded to a multiple of 8)."""
    return torch.ops.minillm.q4_linear(x, w, scales, zeros, groupsize)


def q8_dequantize(w: Tensor, scale: Tensor, in_features: int, dtype: torch.dtype) -> Tensor:
    """q8_linear's weight as (N, in_features) float32 or bfloat16: q * scale, rounded once."""
    return torch.ops.minillm.q8_dequantize(w, scale, in_features, dtype == torch.bfloat16)


def q4_dequantize(w: Tensor, scales: Tensor, zeros: Tensor, groupsize: int, in_features: int,
                  dtype: torch.dtype) -> Tensor:
    """q4_linear's weight as (N, in_features) float32 or bfloat16: q * scale + zero per group."""
    return torch.ops.minillm.q4_dequantize(w, scales, zeros, groupsize, in_features, dtype == torch.bfloat16)


def prompt_attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """softmax(scale * q k^T + mask) v for a chunk of a bfloat16 prompt's queries: q (B, n_heads,
    T, D), k and v (B, n_kv_heads, S, D) bfloat16 with D a multiple of 64, mask (B, 1, T, S).
    Scores and softmax in float32, the probabilities rounded to bfloat16 for their product with
    v (as SDPA does). Returns (B, n_heads, T, D) float32."""
    B, n_heads, T, D = q.shape
    q_groups = q.reshape(B, k.shape[1], -1, D)  # (B, n_kv_heads, group * T, D): row g * T + t is query t
    return torch.ops.minillm.prompt_attend(q_groups, k, v, mask.float(), scale).view(B, n_heads, T, D)


GATED_KINDS = {ACTIVATIONS["silu"]: 0, ACTIVATIONS["gelu_tanh"]: 1}  # kernels.cpp's `gated` kinds


def gated(gate: Tensor, up: Tensor, act) -> Tensor:
    """act(gate) * up in one pass, computed in float32 and rounded once (as the compiled step's
    fused code does): gate and up of one shape, float32 or bfloat16; act one of GATED_KINDS."""
    return torch.ops.minillm.gated(gate, up, GATED_KINDS[act])


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, softcap: float = 0.0,
           slots: Optional[Tensor] = None) -> Tensor:
    """Attention of a few query rows per KV head over the keys their additive mask allows:
    q (B, H, group * T, D) (row g * T + t is query t), k and v (B, H, S, D) float32 or bfloat16,
    or with slots (B, S) a cache's pools of blocks (N, H, block_size, D) of which row b's key s is in slot
    slots[b, s] (no copy); mask (B, 1, T, S). softmax(scale * q k^T, soft-capped when softcap > 0,
    + mask) v, float32."""
    if k.stride() != v.stride():  # the kernel reads key j and value j at one offset
        k, v = k.contiguous(), v.contiguous()  # (strides of size-1 dims may still differ: the kernel ignores those)
    return torch.ops.minillm.attend(q.float(), k, v, mask.float(), scale, softcap, slots)


# ---------------------------------------------------------------- the layers install() swaps in

def materialize(x: Tensor) -> Tensor:
    """x, stored to memory inside a compiled graph. Inductor otherwise inlines a cheap producer
    (RMSNorm, the residual add) into the matrix-vector reduction that reads x, and recomputes it
    for every output row."""
    if torch.compiler.is_compiling():
        return torch.ops.prims.inductor_force_stride_order(x, x.stride())
    return x


class CpuLinear(nn.Linear):
    """nn.Linear with four CPU paths, chosen by `linear_path` (thresholds from THRESHOLDS). Eager
    products of 2 tokens up to onednn_min_tokens keep BLAS: the reference that the compiled paths
    are tested against.
    - "small_linear" for one token (batch-1 decode, a prompt's last layer and output head) with
      AVX-512, compiled or not: its one-token loop (BLAS's gemv streams the 151936-row head at a
      third of the bandwidth).
    - "reduction" for one compiled token without AVX-512: multiply-and-sum in float32, which
      inductor turns into one vectorized, multi-threaded reduction that streams the weight
      (widening bfloat16 in registers) faster than BLAS and oneDNN gemv, though not at memory
      bandwidth on long rows.
    - "onednn" from onednn_min_tokens (a prompt, a batch of requests, a long verify): oneDNN's GEMM
      (`dense_linear`); compiled, in float32 with AVX-512, past tile_max_tokens.
    - "small_linear" for fewer tokens, compiled (a speculative verify, a batch step): it reads each
      weight once for all the tokens and gives a token the same bits whatever the others.
    - "float32" for more bfloat16 tokens (a prompt) on a CPU without bf16 instructions, where
      oneDNN's bf16 GEMM is much slower than widening the weight."""

    def linear_path(self, tokens: int, dtype: torch.dtype, compiled: bool) -> str:
        """The path of `tokens` tokens of x in dtype on the CPU (compiled: being traced by
        torch.compile): the first rule that holds."""
        kernel = self.weight.dtype in KERNEL_DTYPES and available()  # small_linear takes these weights
        if compiled and tokens == 1 and not (AVX512 and kernel):
            return "reduction"
        # compiled, the token count is tested once (each test is a guard on the graph's shapes)
        few = compiled and kernel and tokens < compiled_onednn_min_tokens(dtype)
        if not few and uses_onednn(tokens, dtype, self.weight):
            return "onednn"
        if kernel and ((tokens == 1 and AVX512) or (compiled and tokens <= THRESHOLDS.linear_max_tokens)):
            return "small_linear"
        if dtype == torch.bfloat16 and not CPU_HAS_BF16 and tokens > 1:
            return "float32"
        return "torch"

    def forward(self, x: Tensor) -> Tensor:
        if x.device.type != "cpu":  # a model moved off the CPU after install: the reference
            return super().forward(x)
        path = self.linear_path(x.shape[:-1].numel(), x.dtype, torch.compiler.is_compiling())
        if path == "reduction":
            return self.reduction(x)
        if path == "onednn":
            return dense_linear(x, self.weight, self.bias)
        if path == "small_linear":
            return self.through_small_linear(x)
        if path == "float32":
            return self.in_float32(x)
        return super().forward(x)

    def reduction(self, x: Tensor) -> Tensor:
        x_row = materialize(x.reshape(1, -1))  # (1, in_features)
        y = (self.weight.float() * x_row.float()).sum(-1).to(x.dtype)  # (out_features,)
        y = y.view(*x.shape[:-1], -1)  # (..., out_features)
        return y if self.bias is None else y + self.bias

    def through_small_linear(self, x: Tensor) -> Tensor:
        # one bfloat16 token times bfloat16 weights: x as it is, for the bf16 dot product loop
        bf16_row = x.shape[:-1].numel() == 1 and BF16_DOT and x.dtype == self.weight.dtype == torch.bfloat16
        y = small_linear(x if bf16_row else x.float(), self.weight).to(x.dtype)  # (..., out_features)
        return y if self.bias is None else y + self.bias

    def in_float32(self, x: Tensor) -> Tensor:
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)  # one rounding, at the end


class CpuAttention(Attention):
    """model.Attention with three CPU paths under a mask, chosen by `attention_path` (thresholds
    from THRESHOLDS); otherwise model.Attention's ("model").
    - "kernel" for up to attend_max_queries queries (decode, a verify): `attend`, which reads only
      the keys each query's mask allows.
    - "chunks" for an eager prompt of twice prompt_query_chunk queries or more: `attend_in_chunks`.
    - "spelled_out" for one compiled query without the kernels: inductor fuses it into the layer's
      kernel, where CPU SDPA would cost a mostly fixed overhead per call."""

    def attention_path(self, queries: int, dtype: torch.dtype, masked: bool, compiled: bool) -> str:
        """The path of `queries` queries per head over keys in dtype on the CPU (masked: under an
        additive mask, not SDPA's causal one; compiled: being traced by torch.compile)."""
        if not masked:
            return "model"
        if (queries <= THRESHOLDS.attend_max_queries and self.head_dim % 8 == 0 and dtype in KERNEL_DTYPES
                and available()):
            return "kernel"
        # the count before `compiled`: a compiled prompt's graph keeps this guard on its length
        if queries >= 2 * THRESHOLDS.prompt_query_chunk and not compiled and (ONEDNN or not self.softcap):
            return "chunks"
        if queries == 1 and compiled:
            return "spelled_out"
        return "model"

    def attend_cache(self, q: Tensor, mask: Tensor, context: Tensor) -> Tensor:
        cache, compiled = self.kv_cache, torch.compiler.is_compiling()
        if q.device.type != "cpu" or self.attention_path(q.shape[2], cache.k_cache.dtype, mask is not None,
                                                         compiled) != "kernel":
            return super().attend_cache(q, mask, context)  # the keys gathered, then `attend`
        return self.kernel_attend(q, cache.k_cache, cache.v_cache, mask, context)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> Tensor:
        if q.device.type != "cpu":  # a model moved off the CPU after install: the reference
            return super().attend(q, k, v, mask)
        path = self.attention_path(q.shape[2], k.dtype, mask is not None, torch.compiler.is_compiling())
        if path == "kernel":
            return self.kernel_attend(q, k, v, mask)
        if path == "chunks":
            return self.attend_in_chunks(q, k, v, mask)
        if path == "spelled_out":
            return self.spelled_out(q, k, v, mask)
        return super().attend(q, k, v, mask)

    def kernel_attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, slots: Optional[Tensor] = None) -> Tensor:
        """`attend` over k and v (B, n_kv_heads, S, head_dim), or with slots (B, S) over a cache's
        pools of blocks (N, n_kv_heads, block_size, head_dim)."""
        B, n_heads, T, head_dim = q.shape
        # each KV head's query group folded into the query length, as model.Attention does
        q_groups = q.reshape(B, k.shape[1], -1, head_dim)  # (B, n_kv_heads, group * T, head_dim)
        y = attend(q_groups, k, v, mask, self.scale or head_dim ** -0.5, self.softcap or 0.0, slots)
        return y.to(q.dtype).view(B, n_heads, T, head_dim)

    def spelled_out(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        """One query per head, for inductor to fuse."""
        B, n_heads, T, head_dim = q.shape
        q_groups = q.reshape(B, k.shape[1], -1, head_dim)  # (B, n_kv_heads, group, head_dim)
        # scores (B, n_kv_heads, group, S); the mask (B, 1, 1, S) broadcasts over heads and group
        scores = (q_groups.float().unsqueeze(-2) * k.float().unsqueeze(-3)).sum(-1) * (self.scale or head_dim ** -0.5)
        if self.softcap:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        probs = torch.softmax(scores + mask, dim=-1)
        y = (probs.unsqueeze(-1) * v.float().unsqueeze(-3)).sum(-2).to(q.dtype)  # (B, n_kv_heads, group, head_dim)
        return y.view(B, n_heads, T, head_dim)

    def attend_in_chunks(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        """A prompt's masked attention, prompt_query_chunk queries at a time over the keys from the
        first to the last one any of them may see: CPU SDPA works in blocks of 512 keys and would
        multiply every query by every key of a causal prompt shorter than that, half of them
        masked away (and, behind a ring cache, by its window of slots not yet written). A bfloat16
        chunk goes to `prompt_attend` where the CPU has AVX-512 BF16; otherwise, with oneDNN,
        each chunk is two of its float32 GEMMs (`chunk_attention`)."""
        visible = (mask > float("-inf")).any(0).any(0)  # (T, S) whether any row's query t sees key s
        scale = self.scale or q.shape[-1] ** -0.5
        bf16 = (PROMPT_ATTEND and q.dtype == k.dtype == v.dtype == torch.bfloat16 and not self.softcap
                and q.shape[-1] % 64 == 0 and available())
        out, chunk = [], THRESHOLDS.prompt_query_chunk
        for start in range(0, q.shape[2], chunk):
            stop = min(q.shape[2], start + chunk)
            seen = visible[start:stop].any(0).nonzero()  # not empty: a query always sees itself
            first, last = int(seen.min()), int(seen.max()) + 1  # a ring cache's empty slots lead
            args = (q[:, :, start:stop], k[:, :, first:last], v[:, :, first:last], mask[:, :, start:stop, first:last])
            if bf16:
                out.append(prompt_attend(*args, scale).to(q.dtype))
            elif ONEDNN:
                out.append(chunk_attention(*args, scale, self.softcap or 0.0).to(q.dtype))
            else:
                out.append(super().attend(*args))  # (B, n_heads, chunk, head_dim)
        return torch.cat(out, dim=2)


class CpuRMSNorm(RMSNorm):
    """model.RMSNorm whose eager bfloat16 forward takes two passes over each row (`rms_norm`) where
    eager torch makes one per operation; the same arithmetic, each rounding where the reference's is."""

    def forward(self, x: Tensor) -> Tensor:
        # bfloat16 only: float32 keeps the reference's own sums (tensor parallelism is checked
        # against one process to 1e-4 in float32, and a reordered sum moved that past it)
        if (torch.compiler.is_compiling() or x.device.type != "cpu" or x.dtype != self.weight.dtype
                or x.dtype != torch.bfloat16 or x.shape[-1] % 8 or not available()):
            return super().forward(x)
        return torch.ops.minillm.rms_norm(x, self.weight, self.eps, float(self.weight_offset))


class CpuFeedForward(FeedForward):
    """model.FeedForward whose eager bfloat16 forward (a prompt, a chunk) takes the gated activation
    in one pass (`gated`) where eager torch makes two, rounding after each; a compiled step's fused
    code already does so."""

    def forward(self, x: Tensor) -> Tensor:
        if torch.compiler.is_compiling() or self.act not in GATED_KINDS or x.device.type != "cpu" or not available():
            return super().forward(x)
        gate, up = self.w1(x), self.w3(x)
        if gate.dtype != up.dtype or gate.dtype != torch.bfloat16:  # float32: as CpuRMSNorm
            return self.w2(self.act(gate) * up)
        return self.w2(gated(gate, up, self.act))


def chunk_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, softcap: float = 0.0) -> Tensor:
    """softmax(scale * q k^T (soft-capped when softcap > 0) + mask) v in float32, each KV head's
    query group at once through oneDNN's GEMM: q (B, n_heads, T, D), k and v (B, n_kv_heads, S, D),
    mask (B, 1, T, S). CPU SDPA's own products run on BLAS, at half oneDNN's speed here, and in
    bfloat16 no faster. Returns (B, n_heads, T, D) float32."""
    B, nh, T, D = q.shape
    nkv, S = k.shape[1], k.shape[2]
    group = nh // nkv
    q = (q.float() * scale).reshape(B, nkv, group * T, D)
    k, v_t = k.float(), v.float().transpose(-2, -1)  # v_t (B, n_kv_heads, D, S): the GEMM's weight
    y = q.new_empty(B, nkv, group * T, D)
    for b in range(B):
        for h in range(nkv):
            scores = _onednn_linear(q[b, h], k[b, h].contiguous(), None).view(group, T, S)
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            probs = torch.softmax(scores + mask[b].float(), dim=-1)  # (group, T, S)
            y[b, h] = _onednn_linear(probs.view(group * T, S), v_t[b, h].contiguous(), None)
    return y.view(B, nh, T, D)


def install(model: nn.Module) -> nn.Module:
    """Swap the CPU fast paths into a built model, in place, after its weights are loaded: every
    exact nn.Linear becomes a CpuLinear, every model.Attention a CpuAttention, FeedForward a
    CpuFeedForward and RMSNorm a CpuRMSNorm, keeping their parameters, buffers and hooks (tied and
    tensor-parallel weights stay as they are).
    qlayers.py's packed layers are not nn.Linear and stay. A no-op for a model whose weights
    are not on the CPU, and when called again. Returns the model."""
    if any(p.device.type != "cpu" for p in model.parameters()):
        return model
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = CpuLinear
        elif type(module) is Attention:
            module.__class__ = CpuAttention
        elif type(module) is FeedForward:
            module.__class__ = CpuFeedForward
        elif type(module) is RMSNorm:
            module.__class__ = CpuRMSNorm
    return model
