"""Weight-only quantization: int8 per channel, int4 per group (round-to-nearest or GPTQ).

    python quantize.py --checkpoint checkpoints/smollm2-135m --mode int8
    python quantize.py --checkpoint checkpoints/smollm2-135m --mode int4 --groupsize 32
    python quantize.py --checkpoint checkpoints/smollm2-135m --mode int4-gptq --groupsize 32

Each writes a checkpoint directory like any other (default checkpoints/<name>-int8,
-int4-g32, -int4-gptq-g32); generate.py, eval.py, speculative decoding and tensor parallelism
load it without further flags, because config.json records the scheme.

Decode reads every weight once per token, so fewer bytes per weight is more tokens per second.

On disk (device-independent: made on CPU, runs on CUDA and the other way round):
  int8   X.weight int8 (out, in), X.scales float32 (out,): symmetric, w = q * scale.
  int4   X.weight uint8 (out, in_padded / 2), two 4-bit values per byte along the input (low
         nibble first), X.scales / X.zeros float16 (out, in_padded / groupsize): asymmetric,
         w = q * scale + zero with q in 0..15. An input width that the group size does not
         divide (SmolLM2's 576 with groupsize 128) is padded with zero columns up to a multiple
         of it; the padded width is the tensor's shape and config.json says "padded".
The linear layers of every block follow the mode. The output head is int8 in every mode: an
error there lands on the logits directly (llama.cpp likewise keeps the head at 6 bits or more
in its 4-bit files). The token embedding (a lookup reads one row, but it is the biggest single
tensor) is int8 per row, except in int4 modes when the head is untied (Qwen2.5): there the
table goes int4 in groups, which pays for the int8 head. A tied head shares the int8 table.
Norms and biases stay in float. config.json's "quantization" records each choice ("embedding",
"output"). A mixture's experts (model.Experts: every expert's rows in one matrix) take the blocks'
format, stored as a linear layer's; their router stays float, and int4-gptq rounds them to
nearest (no per-expert Hessians are collected).

`SCHEMES` is the table of modes: each names a `Format` (how one matrix is stored, and the layers
that read it) for the blocks, the head and the embedding. A new scheme is a new Format (its
layers, subclasses of `QuantizedLayer`, and its quantizer) and a row of SCHEMES; load_model and
tp.py ask the layers what they need. At load time prepare_for_device() repacks the integers for
the kernel: see pack_int8/pack_int4.
"""
import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

import checkpoint
import kernels
import tp
from errors import QuantizeError, run_cli
from memory import Need, activation_bytes, check_memory, kv_cache_bytes, logits_bytes, weight_bytes
from model import Experts, Transformer, through_experts

GROUPSIZES = (32, 64, 128, 256)  # the int4 kernel handles 32 and multiples of 64
DEFAULT_CALIBRATION = Path(__file__).resolve().parent / "data" / "macbeth.txt"


# ---------------------------------------------------------------- quantizing a matrix

def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """(out, in) float -> int8 q (out, in), float32 scales (out,): w ~ q * scale, q in -127..127.
    Each row's scale is the one, among its absmax / 127 shrunk by up to 30%, with the least
    squared error: clipping a rare outlier buys a finer step for all the other weights."""
    w = w.float()
    absmax = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-10)
    best_err = torch.full_like(absmax, float("inf"))
    scales = absmax / 127
    for shrink in torch.arange(1.0, 0.69, -0.02).tolist():
        s = absmax * shrink / 127
        err = ((torch.round(w / s).clamp(-127, 127) * s - w) ** 2).sum(dim=1, keepdim=True)
        better = err < best_err
        best_err, scales = torch.where(better, err, best_err), torch.where(better, s, scales)
    q = torch.round(w / scales).clamp(-127, 127).to(torch.int8)
    return q, scales.squeeze(1)


def padded_width(in_features: int, groupsize: int) -> int:
    return -(-in_features // groupsize) * groupsize


def int4_group_params(w: Tensor) -> tuple[Tensor, Tensor]:
    """Scale and zero of each group along the last dim (..., groupsize) with the least squared
    error we find, rounded to the float16 they are stored in (so that the integers are chosen
    against the values used to decode them). Still round to nearest, weight by weight: the
    search only picks the grid. Candidates: the group's min..max in 15 steps, and for steps
    of 14..16 across that range, the integers they round to with the scale and zero fitted to
    them by least squares (the idea of llama.cpp's k-quants). A grid that clips the extremes
    a little buys a finer step for every other weight."""
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    best_s, best_z = ((hi - lo) / 15).clamp(min=1e-6).half().float(), lo.half().float()
    best_err = int4_error(w, best_s, best_z)
    n, span = w.shape[-1], (hi - lo).clamp(min=1e-10)
    for steps in torch.arange(14.0, 16.01, 0.1).tolist():
        q = torch.round((w - lo[..., None]) * (steps / span)[..., None]).clamp(0, 15)
        sq, sqq, sw, sqw = q.sum(-1), (q * q).sum(-1), w.sum(-1), (q * w).sum(-1)
        det = n * sqq - sq * sq  # 0 when every q is equal: keep min..max there
        fit = det > 0
        det = torch.where(fit, det, torch.ones_like(det))
        s = torch.where(fit, (n * sqw - sq * sw) / det, best_s).clamp(min=1e-6).half().float()
        z = torch.where(fit, (sqq * sw - sq * sqw) / det, best_z).half().float()
        err = int4_error(w, s, z)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_s, best_z = torch.where(better, s, best_s), torch.where(better, z, best_z)
    return best_s, best_z


def int4_error(w: Tensor, scales: Tensor, zeros: Tensor) -> Tensor:
    """Squared error of each group (..., groupsize) rounded to nearest on its grid."""
    q = int4_round(w, scales[..., None], zeros[..., None])
    return ((q * scales[..., None] + zeros[..., None] - w) ** 2).sum(dim=-1)


def int4_round(w: Tensor, scales: Tensor, zeros: Tensor) -> Tensor:
    """Nearest q in 0..15 for w ~ q * scale + zero (scales/zeros broadcast against w)."""
    return torch.round((w - zeros) / scales).clamp(0, 15)


def quantize_int4(w: Tensor, groupsize: int) -> tuple[Tensor, Tensor, Tensor]:
    """(out, in) float -> q uint8 (out, in_padded) in 0..15, float32 scales and zeros
    (out, in_padded / groupsize), round to nearest."""
    w = pad_columns(w.float(), groupsize)
    out, width = w.shape
    groups = w.view(out, width // groupsize, groupsize)
    # a few hundred rows at a time on a CPU: the search's temporaries stay in cache rather than in
    # fresh pages; a GPU takes thousands, or the search is as many small kernels as it has rows
    params = [int4_group_params(rows) for rows in groups.split(256 if w.device.type == "cpu" else 8192)]
    scales, zeros = torch.cat([s for s, _ in params]), torch.cat([z for _, z in params])
    q = int4_round(groups, scales[..., None], zeros[..., None])
    return q.view(out, width).to(torch.uint8), scales, zeros


def pad_columns(w: Tensor, multiple: int) -> Tensor:
    width = padded_width(w.shape[1], multiple)
    return F.pad(w, (0, width - w.shape[1])) if width != w.shape[1] else w


def dequantize_int4(q: Tensor, scales: Tensor, zeros: Tensor) -> Tensor:
    out, width = q.shape
    g = width // scales.shape[1]
    return (q.float().view(out, -1, g) * scales.float()[..., None] + zeros.float()[..., None]).view(out, width)


def nibbles_to_bytes(q: Tensor) -> Tensor:
    """(out, width) values 0..15 -> uint8 (out, width / 2), low nibble = even column."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def bytes_to_nibbles(b: Tensor) -> Tensor:
    """Inverse of nibbles_to_bytes: uint8 (out, width / 2) -> uint8 (out, width)."""
    return torch.stack([b & 15, b >> 4], dim=-1).view(b.shape[0], -1)


def gptq_int4(w: Tensor, H: Tensor, groupsize: int, percdamp: float = 0.01,
              blocksize: int = 128) -> tuple[Tensor, Tensor, Tensor]:
    """GPTQ (Frantar et al. 2022, Algorithm 1 with lazy batch updates): quantize the columns one
    at a time, each time spreading the rounding error over the columns not yet quantized through
    the inverse Hessian of the layer's reconstruction error, H = 2 X^T X over calibration inputs.
    Group scales/zeros are chosen from the error-updated weights when a group starts.
    Returns what quantize_int4 returns."""
    W = pad_columns(w.float().clone(), groupsize)
    out, width = W.shape
    H = F.pad(H.float(), (0, width - H.shape[0], 0, width - H.shape[0]))  # padded columns: zeros
    dead = torch.diag(H) == 0  # inputs that were always zero: nothing to compensate
    H[dead, dead] = 1
    W[:, dead] = 0
    H += percdamp * torch.mean(torch.diag(H)) * torch.eye(width)  # dampening, section 4 "Step 3"
    # the upper Cholesky factor of H^-1 holds every row of the sequential updates (section 4)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    blocksize = max(blocksize // groupsize, 1) * groupsize  # a group never straddles two blocks
    Wt = W.T.contiguous()  # (width, out): a column of W is a contiguous row here
    Q = torch.zeros_like(Wt)
    scales = torch.zeros(width // groupsize, out)
    zeros = torch.zeros(width // groupsize, out)
    for i1 in range(0, width, blocksize):
        i2 = min(i1 + blocksize, width)
        W1, Hinv1 = Wt[i1:i2].clone(), Hinv[i1:i2, i1:i2]
        Err1 = torch.zeros_like(W1)
        for i in range(i2 - i1):
            col = i1 + i
            if col % groupsize == 0:
                g = col // groupsize
                scales[g], zeros[g] = int4_group_params(W1[i:i + groupsize].T)
                s, z = scales[g], zeros[g]
            q = int4_round(W1[i], s, z)
            Q[col] = q
            err = (W1[i] - (q * s + z)) / Hinv1[i, i]
            W1[i:].addr_(Hinv1[i, i:], err, alpha=-1)  # spread the error over the later columns
            Err1[i] = err
        Wt[i2:] -= Hinv[i1:i2, i2:].T @ Err1  # the lazy batch update of the columns after the block
    return Q.T.to(torch.uint8).contiguous(), scales.T.contiguous(), zeros.T.contiguous()


# ---------------------------------------------------------------- packing for the kernel

# The decode step is one matrix-vector product per layer. Inductor compiles our unpacking
# expression below into one vectorized C++ reduction per layer (a Triton kernel on CUDA), but
# only when the integers come in 32-bit lanes read as float32: its int8/int32 vector loads
# copy through a stack buffer. So each row is stored as blocks of 8 int32
# lanes; lane l of block b holds, in its k-th 8 (int8) or 4 (int4) bits, the column
# 8*k + l of the block (32 or 64 columns), and a left shift then an arithmetic right shift
# extract it. Eight consecutive lanes are eight consecutive columns, so the activations are
# read as plain vectors.

def pack_int8(q: Tensor) -> Tensor:
    """int8 (out, in) -> float32 bit patterns (out, ceil(in/32), 8)."""
    q = pad_columns(q, 32).to(torch.int32) & 0xFF
    out, width = q.shape
    q = q.view(out, width // 32, 4, 8)  # (out, block, k, lane)
    lanes = q[:, :, 0] | (q[:, :, 1] << 8) | (q[:, :, 2] << 16) | (q[:, :, 3] << 24)
    return lanes.contiguous().view(torch.float32)


def pack_int4(q: Tensor) -> Tensor:
    """values 0..15 (out, in) -> float32 bit patterns (out, ceil(in/64), 8) of q - 8 as signed
    4-bit numbers (so the arithmetic shift gives q - 8 directly)."""
    q = pad_columns((q.to(torch.int32) - 8) & 0xF, 64)
    out, width = q.shape
    q = q.view(out, width // 64, 8, 8)  # (out, block, k, lane)
    lanes = torch.zeros(out, width // 64, 8, dtype=torch.int32, device=q.device)
    for k in range(8):
        lanes |= q[:, :, k] << (4 * k)
    return lanes.contiguous().view(torch.float32)


# On CPU, when kernels.py is built, the layers are packed for its int8-activation loops instead:
# int8 rows as they are on disk (padded to 32 columns), int4 rows with 64 columns in 32 bytes
# (the low nibbles are columns 0-31, the high nibbles 32-63: a mask and a shift unpack them in
# order), scales and zeros in float16 (groups padded to a multiple of 8).

def for_cpu_kernel(weight: Tensor) -> bool:
    """Pack for kernels.py's q8/q4 loops (CPU), or for the compiled expression (CUDA, or a CPU
    without the kernels)."""
    return weight.device.type == "cpu" and kernels.available()


# On CUDA an int8 weight stays in its rows as stored: one compiled token's product is a single
# reduction kernel that converts each int8 as it multiplies (Int8Linear.matvec), reading one byte a
# weight. The lanes layout above is for a CPU's vector registers.

def int8_layout(q: Tensor) -> str:
    """"rows" (kernels.py's loops, padded to 32 columns; or CUDA's reduction, as stored) or "lanes"."""
    return "rows" if for_cpu_kernel(q) or q.device.type == "cuda" else "lanes"


def pack_int8_for_device(q: Tensor) -> Tensor:
    if int8_layout(q) == "lanes":
        return pack_int8(q)
    return pad_columns(q, 32).contiguous() if for_cpu_kernel(q) else q.contiguous()


# int4 on CUDA with bfloat16 activations: PyTorch's tinygemm kernel (_weight_int4pack_mm), any
# number of tokens, w = (q - 8) * scale + zero' per group with q in 0..15, so zero' = zero + 8 * scale;
# scales and zeros interleaved as (groups, out, 2). Its CPU twin (_for_cpu) runs the same repacking
# and call here, which is how they are tested without a GPU.

def uses_tinygemm(weight: Tensor, dtype: torch.dtype) -> bool:
    """tinygemm takes bfloat16 activations on CUDA, and output widths in multiples of 8 (its CPU twin: 16)."""
    return weight.device.type == "cuda" and dtype == torch.bfloat16 and weight.shape[0] % 16 == 0


def tinygemm_pack(q: Tensor) -> Tensor:
    """values 0..15 (out, in) -> the kernel's tiled layout, on q's device. The CUDA repacking takes
    two values a byte (the even column in the high nibble), the CPU one int32 values."""
    inner_k_tiles = next(t for t in (8, 4, 2) if q.shape[1] % (t * 16) == 0)  # the widest tile the width allows
    if q.device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), inner_k_tiles)
    q = q.to(torch.uint8)
    return torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).contiguous(), inner_k_tiles)


def tinygemm_mm(x: Tensor, packed: Tensor, groupsize: int, scales_and_zeros: Tensor) -> Tensor:
    """x (tokens, in_padded) in scales_and_zeros' dtype -> (tokens, out)."""
    if x.device.type == "cpu":
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, groupsize, scales_and_zeros)
    return torch.ops.aten._weight_int4pack_mm(x, packed, groupsize, scales_and_zeros)


def pack_int4_rows(q: Tensor, into: Optional[Tensor] = None) -> Tensor:
    """values 0..15 (out, in) -> uint8 (out, ceil(in/64) * 32): per 64 columns, byte j holds
    column j in its low nibble and column 32 + j in its high nibble. Written into `into` if given."""
    q = pad_columns(q.to(torch.uint8), 64)
    out, width = q.shape
    q = q.view(out, width // 64, 2, 32)
    if into is None:
        into = torch.empty(out, width // 2, dtype=torch.uint8, device=q.device)
    torch.bitwise_or(q[:, :, 0], q[:, :, 1] << 4, out=into.view(out, width // 64, 32))
    return into


def int4_rows_block(layers: list) -> dict:
    """id(weight) -> an empty tensor for pack_int4_rows to fill, for the int4 weight of each layer
    that packs for the CPU loops, all views of one block on 2 MB pages (the int8 rows' reason,
    checkpoint.streamed_block: Qwen 0.5B int4 decodes 1.10x faster, docs/benchmarks.md).
    Packed into it directly, so that no packed copy is freed to the heap, which would keep it."""
    weights = {id(m.weight): m.weight for m in layers
               if isinstance(m, Int4Linear) and m.weight is not None and for_cpu_kernel(m.weight)}
    shapes = {key: (w.shape[0], -(-w.shape[1] * 2 // 64) * 32) for key, w in weights.items()}  # pack_int4_rows'
    views = checkpoint.block_views({key: rows * cols for key, (rows, cols) in shapes.items()})
    return {key: view.view(shapes[key]) for key, view in views.items()}


def unpack_int4_rows(packed: Tensor) -> Tensor:
    """Inverse of pack_int4_rows: uint8 (out, width / 2) -> values 0..15 (out, width)."""
    b = packed.view(packed.shape[0], -1, 1, 32)
    return torch.cat([b & 15, b >> 4], dim=2).reshape(packed.shape[0], -1)


def int8_byte(lanes: Tensor, k) -> Tensor:
    """The k-th byte (an int, or a tensor of them that broadcasts) of int32 lanes, sign-extended:
    the int8 in column 8*k + lane of each block."""
    return (lanes << (24 - 8 * k)) >> 24


def unpack_int8(packed: Tensor) -> Tensor:
    """packed (..., blocks, 8) -> int32 values (..., blocks, 4, 8): column 32*b + 8*k + l."""
    k = torch.arange(4, dtype=torch.int32, device=packed.device).view(4, 1)
    return int8_byte(packed.view(torch.int32).unsqueeze(-2), k)


def unpack_int4(packed: Tensor, split: int = 1) -> Tensor:
    """packed (..., blocks, 8) -> int32 values q - 8 (..., blocks, split, 8 / split, 8):
    column 64*b + 8*k + l with k = split index * (8/split) + sub index."""
    shifts = torch.arange(28, -4, -4, dtype=torch.int32, device=packed.device).view(split, 8 // split, 1)
    return (packed.view(torch.int32)[..., None, None, :] << shifts) >> 28


def compiled_matvec(x: Tensor) -> bool:
    """Whether x (one token, being compiled) goes through the unpacking expression, which inductor
    fuses with the rest of the layer, rather than a dequantized weight."""
    return torch.compiler.is_compiling() and x.shape[:-1].numel() == 1


# Up to this many tokens (decode, a verify, a short prompt, a batch step) a quantized product goes
# through the integer loops: dequantizing every weight to bfloat16 costs more below it (docs/design.md)
LOOP_MAX_TOKENS = 64


def padded_tokens(x: Tensor, width: int) -> Tensor:
    """x (..., in) -> float32 (tokens, width), zero columns appended to the packed width."""
    return F.pad(x.reshape(-1, x.shape[-1]).float(), (0, width - x.shape[-1]))


class QuantizedLayer(nn.Module):
    """What load_model and tp.py ask of a quantized layer (a linear layer or an embedding)."""
    float_tensors: tuple = ("scales",)  # float tensors that keep their stored dtype whatever the model's
    split_unit: int = 1  # input features that a tensor-parallel row-wise split keeps together

    @classmethod
    def like(cls, module: nn.Module, groupsize: Optional[int]) -> "QuantizedLayer":
        """An empty layer (weights still to load) with the shape of a float nn.Linear or nn.Embedding."""
        raise NotImplementedError

    def pack(self, cache: dict, dtype: torch.dtype = torch.float32):
        """After loading: repack the integers for this device's kernel (a tensor in `cache`, keyed
        by id, is packed once for every layer holding it); dtype is the model's activations'."""
        raise NotImplementedError


class PackedLinear(QuantizedLayer):
    """What the int8 and int4 linears share: the choice of path, by layout and token count.
    A subclass's pack() sets `cpu_kernel_layout`, `tinygemm` and `width` (the padded input width),
    and it gives `cpu_kernel` (kernels.py, CPU), `matvec` (the unpacking expression for one compiled
    token) and `dequantized` (everything else).
    - int4 on CUDA in bfloat16: every token count through tinygemm (`tinygemm_mm`).
    - CPU with kernels.py: up to 64 tokens (decode, a verify, a short prompt), compiled or not,
      go through kernels.py's int8-activation loop, which reads the weights faster than
      inductor's fused expression.
    - CUDA, or a CPU without the kernels: one compiled token is the unpacking expression.
    - Otherwise (longer prompts, eager CUDA) the layer dequantizes its weight for the float matmul;
      on a CPU with bf16 instructions, in bfloat16 through oneDNN (kernels.dense_linear), twice
      the float32 GEMM's rate."""
    tinygemm = False

    def one_pass(self, dtype) -> bool:
        """Whether `dequantized` takes kernels.py's one-pass loop (the expression's bits, no float32
        temporaries) rather than the torch expression."""
        return self.cpu_kernel_layout and kernels.available() and dtype in (torch.float32, torch.bfloat16)

    def forward(self, x: Tensor) -> Tensor:
        if self.tinygemm:
            xt = x.reshape(-1, x.shape[-1]).to(self.scales_and_zeros.dtype)
            y = tinygemm_mm(F.pad(xt, (0, self.width - x.shape[-1])), self.packed, self.groupsize, self.scales_and_zeros)
        elif self.cpu_kernel_layout and x.shape[:-1].numel() <= LOOP_MAX_TOKENS:
            y = self.cpu_kernel(padded_tokens(x, self.width))  # (tokens, out) float32
        elif not self.cpu_kernel_layout and compiled_matvec(x):
            y = self.matvec(kernels.materialize(padded_tokens(x, self.width)))
        elif getattr(self, "layout", None) == "rows" and not self.cpu_kernel_layout:
            # CUDA's int8 rows: integers are exact in any float dtype, so the scales can wait until
            # after the product (one copy of the weight in x's dtype, no float32 one)
            y = F.linear(x.reshape(-1, x.shape[-1]), self.packed.to(x.dtype)) * self.scales
        else:
            # a CPU prompt in bfloat16 where oneDNN runs it at twice float32's rate: x and the
            # product rounded to 8 bits of mantissa (the kernel path rounds x coarser, to int8
            # blocks), the weight by at most a quarter of an int8 step
            bf16 = self.cpu_kernel_layout and kernels.ONEDNN and kernels.CPU_HAS_BF16
            x_in = x.to(torch.bfloat16) if bf16 else x
            weight = self.dequantized(x_in.dtype)
            y = kernels.dense_linear(x_in, weight) if kernels.uses_onednn(x_in, weight) else F.linear(x_in, weight)
        y = y.to(x.dtype).view(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias


class Int8Linear(PackedLinear):
    """y = x W^T * scale (+ bias), W int8 per output channel."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.empty(out_features, dtype=torch.float32))
        self.register_buffer("bias", torch.empty(out_features) if bias else None)
        self.register_buffer("packed", None, persistent=False)  # made by pack() after loading

    @classmethod
    def like(cls, linear: nn.Linear, groupsize: Optional[int] = None) -> "Int8Linear":
        return cls(linear.in_features, linear.out_features, linear.bias is not None)

    def pack(self, cache: dict, dtype: torch.dtype = torch.float32):
        self.cpu_kernel_layout, self.layout = for_cpu_kernel(self.weight), int8_layout(self.weight)
        self.packed = cached_pack(cache, self.weight, pack_int8_for_device)
        self.scales = self.scales.float()
        self.weight = None  # the packed copy replaces it
        self.out_features = self.packed.shape[0]
        self.width = self.packed.shape[1] * (32 if self.layout == "lanes" else 1)

    def dequantized(self, dtype) -> Tensor:  # (out, in) in dtype
        if self.one_pass(dtype):
            return kernels.q8_dequantize(self.packed, self.scales, self.in_features, dtype)
        q = unpack_int8(self.packed).reshape(self.out_features, -1) if self.layout == "lanes" else self.packed
        return (q[:, :self.in_features].float() * self.scales[:, None]).to(dtype)

    def matvec(self, xp: Tensor) -> Tensor:
        if self.layout == "rows":  # CUDA: one reduction kernel, each int8 converted as it is multiplied
            return ((self.packed.float() * xp).sum(-1) * self.scales).view(1, -1)
        xb = xp.view(-1, 4, 8)  # (blocks, k, lane)
        lanes = self.packed.view(torch.int32)  # (out, blocks, 8)
        # one load of 8 lanes, then each byte shifted out and multiplied: written as a sum of
        # four terms so that the generated loop has no index arithmetic to pick the shift
        acc = sum(int8_byte(lanes, k).float() * xb[:, k] for k in range(4))
        return (acc.sum((-2, -1)) * self.scales).view(1, -1)

    def cpu_kernel(self, xp: Tensor) -> Tensor:
        return kernels.q8_linear(xp, self.packed, self.scales)


class Int4Linear(PackedLinear):
    """y = x W^T (+ bias), W = q * scale + zero per group of `groupsize` inputs, q in 0..15."""
    float_tensors = ("scales", "zeros")

    def __init__(self, in_features: int, out_features: int, groupsize: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.groupsize = in_features, out_features, groupsize
        width = padded_width(in_features, groupsize)
        self.register_buffer("weight", torch.empty(out_features, width // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.empty(out_features, width // groupsize, dtype=torch.float16))
        self.register_buffer("zeros", torch.empty(out_features, width // groupsize, dtype=torch.float16))
        self.register_buffer("bias", torch.empty(out_features) if bias else None)
        self.register_buffer("packed", None, persistent=False)  # made by pack() after loading
        self.register_buffer("scales_and_zeros", None, persistent=False)  # tinygemm's, made by pack()

    @classmethod
    def like(cls, linear: nn.Linear, groupsize: Optional[int]) -> "Int4Linear":
        return cls(linear.in_features, linear.out_features, groupsize, linear.bias is not None)

    @property
    def split_unit(self) -> int:  # a group's scale and zero cover its inputs: a split keeps groups whole
        return self.groupsize

    def pack(self, cache: dict, dtype: torch.dtype = torch.float32, tinygemm: Optional[bool] = None):
        """tinygemm: None picks it where it runs (uses_tinygemm); True on CPU takes its CPU twin (tests)."""
        self.out_features = self.weight.shape[0]
        self.tinygemm = uses_tinygemm(self.weight, dtype) if tinygemm is None else tinygemm
        self.cpu_kernel_layout = for_cpu_kernel(self.weight) and not self.tinygemm
        if self.tinygemm:
            self.packed = cached_pack(cache, self.weight, lambda w: tinygemm_pack(bytes_to_nibbles(w)))
            self.width = self.weight.shape[1] * 2
            scales = self.scales.float()
            zeros = self.zeros.float() + 8 * scales  # tinygemm decodes q - 8
            self.scales_and_zeros = torch.stack([scales, zeros], -1).transpose(0, 1).contiguous().to(dtype)
            self.scales = self.zeros = None
        elif self.cpu_kernel_layout:
            into = cache.get(("int4 rows", id(self.weight)))  # where prepare_for_device wants it
            self.packed = cached_pack(cache, self.weight, lambda w: pack_int4_rows(bytes_to_nibbles(w), into))
            self.width = self.packed.shape[1] * 2
            n_groups = -(-self.width // self.groupsize)
            pad = -(-n_groups // 8) * 8 - self.scales.shape[1]  # kernels.py reads 8 groups at a time
            self.scales, self.zeros = F.pad(self.scales, (0, pad)), F.pad(self.zeros, (0, pad))
        else:
            self.packed = cached_pack(cache, self.weight, lambda w: pack_int4(bytes_to_nibbles(w)))
            self.width = self.packed.shape[1] * 64
            # the expression decodes q - 8: fold the 8 into the zero; pad the groups to whole blocks
            n_groups = self.width // self.groupsize
            scales = self.scales.float()
            zeros = self.zeros.float() + 8 * scales
            self.scales = F.pad(scales, (0, n_groups - scales.shape[1]))
            self.zeros = F.pad(zeros, (0, n_groups - zeros.shape[1]))
        self.weight = None

    def grouped(self, packed: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q - 8, scales and zeros as broadcastable 5-d tensors (out, groups, ., ., 8): inductor
        vectorizes the reduction when a group is whole dims of the unpacked tensor."""
        out, blocks, _ = packed.shape
        g = self.groupsize
        if g == 32:  # two groups per 64-column block
            q = unpack_int4(packed, split=2)  # (out, blocks, 2, 4, 8)
            s = self.scales.view(out, blocks, 2, 1, 1)
            z = self.zeros.view(out, blocks, 2, 1, 1)
        else:  # g / 64 blocks per group
            q = unpack_int4(packed.view(out, -1, g // 64, 8))  # (out, groups, g/64, 1, 8, 8)
            q = q.squeeze(-3)  # (out, groups, g/64, 8, 8)
            s = self.scales.view(out, -1, 1, 1, 1)
            z = self.zeros.view(out, -1, 1, 1, 1)
        return q, s, z

    def dequantized(self, dtype) -> Tensor:
        if self.tinygemm:  # the kernel's own product with the identity: W^T = I W^T
            eye = torch.eye(self.width, dtype=self.scales_and_zeros.dtype, device=self.packed.device)
            w_t = tinygemm_mm(eye, self.packed, self.groupsize, self.scales_and_zeros)  # (width, out)
            return w_t.t()[:, :self.in_features].to(dtype)
        if self.one_pass(dtype):
            return kernels.q4_dequantize(self.packed, self.scales, self.zeros, self.groupsize, self.in_features, dtype)
        if self.cpu_kernel_layout:
            q = unpack_int4_rows(self.packed).view(self.out_features, -1, self.groupsize)
            groups = q.shape[1]
            w = q.float() * self.scales[:, :groups, None].float() + self.zeros[:, :groups, None].float()
        else:
            q, s, z = self.grouped(self.packed)
            w = q.float() * s + z
        return w.reshape(self.out_features, -1)[:, :self.in_features].to(dtype)

    def matvec(self, xp: Tensor) -> Tensor:
        q, s, z = self.grouped(self.packed)
        return ((q.float() * s + z) * xp.view(q.shape[1:])).sum((-4, -3, -2, -1)).view(1, -1)

    def cpu_kernel(self, xp: Tensor) -> Tensor:
        return kernels.q4_linear(xp, self.packed, self.scales, self.zeros, self.groupsize)


class Int4Embedding(QuantizedLayer):
    """Token embedding stored like Int4Linear's weight (int4 in groups along the row), for an
    untied model in int4 mode. A lookup unpacks the few rows it reads; no kernel layout."""
    float_tensors = ("scales", "zeros")

    def __init__(self, num_embeddings: int, embedding_dim: int, groupsize: int):
        super().__init__()
        self.embedding_dim, width = embedding_dim, padded_width(embedding_dim, groupsize)
        self.register_buffer("weight", torch.empty(num_embeddings, width // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.empty(num_embeddings, width // groupsize, dtype=torch.float16))
        self.register_buffer("zeros", torch.empty(num_embeddings, width // groupsize, dtype=torch.float16))
        self.dtype = torch.float32

    @classmethod
    def like(cls, embedding: nn.Embedding, groupsize: Optional[int]) -> "Int4Embedding":
        return cls(embedding.num_embeddings, embedding.embedding_dim, groupsize)

    def pack(self, cache: dict, dtype: torch.dtype = torch.float32):
        self.dtype = dtype  # the model's activations

    def forward(self, tokens: Tensor) -> Tensor:
        flat = tokens.reshape(-1)
        rows = dequantize_int4(bytes_to_nibbles(self.weight[flat]), self.scales[flat], self.zeros[flat])
        return rows[:, :self.embedding_dim].reshape(*tokens.shape, -1).to(self.dtype)


class Int8Embedding(QuantizedLayer):
    """Token embedding stored int8 per row (a row is one token's vector)."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.embedding_dim = embedding_dim
        self.register_buffer("weight", torch.empty(num_embeddings, embedding_dim, dtype=torch.int8))
        self.register_buffer("scales", torch.empty(num_embeddings, dtype=torch.float32))
        self.register_buffer("packed", None, persistent=False)  # made by pack() after loading
        self.dtype = torch.float32

    @classmethod
    def like(cls, embedding: nn.Embedding, groupsize: Optional[int] = None) -> "Int8Embedding":
        return cls(embedding.num_embeddings, embedding.embedding_dim)

    def pack(self, cache: dict, dtype: torch.dtype = torch.float32):
        # a tied head reads the same packed rows, so the embedding takes the head's layout
        self.dtype = dtype  # the model's activations
        self.cpu_kernel_layout, self.layout = for_cpu_kernel(self.weight), int8_layout(self.weight)
        self.packed = cached_pack(cache, self.weight, pack_int8_for_device)
        self.scales = self.scales.float()
        self.weight = None

    def forward(self, tokens: Tensor) -> Tensor:
        rows = self.packed[tokens]
        if self.layout == "lanes":
            rows = unpack_int8(rows).reshape(*tokens.shape, -1)  # (..., blocks, 4, 8) -> (..., width)
        return (rows[..., :self.embedding_dim].float() * self.scales[tokens][..., None]).to(self.dtype)


class Int8Experts(QuantizedLayer):
    """model.Experts stored as Int8Linear's on-disk tensors: weight int8 (n_experts * out, in),
    scales float32 (n_experts * out,). On CPU with kernels.py, each chosen expert's rows go
    through its int8 loop, as Int8Linear's do (`int8_experts`). Elsewhere model.through_experts
    picks the path: the chosen experts' integers gathered and dequantized (fused into the product
    in a compiled step), or, for a prompt, one chosen expert dequantized at a time."""

    def __init__(self, n_experts: int, in_features: int, out_per_expert: int, bias: bool = False):
        super().__init__()
        self.n_experts, self.in_features, self.out_features = n_experts, in_features, n_experts * out_per_expert
        self.register_buffer("weight", torch.empty(self.out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.empty(self.out_features, dtype=torch.float32))
        self.register_buffer("bias", torch.empty(self.out_features) if bias else None)
        self.cpu_kernel_layout = False

    @classmethod
    def like(cls, experts: Experts, groupsize: Optional[int] = None) -> "Int8Experts":
        return cls(experts.n_experts, experts.in_features, experts.out_features // experts.n_experts,
                   experts.bias is not None)

    def pack(self, cache: dict, dtype: torch.dtype = torch.float32):
        self.scales = self.scales.float()
        self.cpu_kernel_layout = for_cpu_kernel(self.weight)
        if self.cpu_kernel_layout:  # the kernel reads rows of a multiple of 32 columns
            self.weight = pad_columns(self.weight, 32).contiguous()
            # a compiled step reads an expert id with Tensor.item() (decode_slots), which TorchDynamo
            # otherwise refuses to put in the graph
            torch._dynamo.config.capture_scalar_outputs = True

    def forward(self, x: Tensor, ids: Tensor) -> Tensor:
        if not self.cpu_kernel_layout:
            return through_experts(self, x, ids)
        N, k = ids.shape
        x = x.unsqueeze(1).expand(N, k, x.shape[-1]) if x.dim() == 2 else x  # (N, k, in)
        if torch.compiler.is_compiling() and N * k <= min(self.n_experts, kernels.MAX_TOKENS):
            y = self.decode_slots(padded_tokens(x, self.weight.shape[-1]).view(N, k, -1), ids)
        else:
            y = torch.ops.minillm_quantize.int8_experts(x.float(), ids, self.weight, self.scales, self.n_experts)
        y = y.to(x.dtype)  # (N, k, out)
        return y if self.bias is None else y + self.bias.view(self.n_experts, -1)[ids].to(y.dtype)

    def decode_slots(self, xp: Tensor, ids: Tensor) -> Tensor:
        """A compiled decode step's few slots, xp (N, k, width) float32: one kernels.q8_linear call
        per slot on a view of its expert's rows, at an offset read from ids inside the graph, so
        nothing is copied and no Python runs per call. (N, k, out) float32."""
        weight, scales = self.weight.view(self.n_experts, -1, self.weight.shape[-1]), self.scales.view(self.n_experts, -1)
        rows = []
        for n in range(ids.shape[0]):
            for j in range(ids.shape[1]):
                e = ids[n, j].item()
                torch._check(e >= 0)
                torch._check(e < self.n_experts)
                rows.append(kernels.q8_linear(xp[n, j:j + 1], weight[e], scales[e]))  # (1, out)
        return torch.cat(rows).view(*ids.shape, -1)

    def gathered(self, ids: Tensor, dtype: torch.dtype) -> Tensor:  # (N, k, out, in)
        q = self.weight.view(self.n_experts, -1, self.weight.shape[-1])[ids][..., :self.in_features]
        return (q.float() * self.scales.view(self.n_experts, -1)[ids][..., None]).to(dtype)

    def expert(self, e: int, dtype: torch.dtype) -> Tensor:  # (out, in)
        return self.gathered(torch.tensor(e), dtype)


@torch.library.custom_op("minillm_quantize::int8_experts", mutates_args=())
def int8_experts(x: Tensor, ids: Tensor, weight: Tensor, scales: Tensor, n_experts: int) -> Tensor:
    """x (N, k, in) float32 times the int8 expert ids[n, j] for each token slot: (N, k, out)
    float32. Up to 16 slots of a chosen expert go through kernels.q8_linear on a view of its rows
    (nothing gathered, nothing dequantized), more (a prompt) through its dequantized matrix. An
    opaque op in a compiled graph: which experts a step reads is data."""
    N, k, width = x.shape[0], x.shape[1], weight.shape[-1]
    w, s = weight.view(n_experts, -1, width), scales.view(n_experts, -1)  # (E, out, width), (E, out)
    flat = F.pad(x.reshape(N * k, -1), (0, width - x.shape[-1]))  # (N * k, width): zero columns to the padded width
    slots = {}  # expert -> the slots that chose it
    for slot, e in enumerate(ids.flatten().tolist()):
        slots.setdefault(e, []).append(slot)
    out = flat.new_empty(N * k, w.shape[1])
    for e, chosen in slots.items():
        if len(chosen) == 1:  # a decode step's slots: a view, no copy
            out[chosen[0]:chosen[0] + 1] = kernels.q8_linear(flat[chosen[0]:chosen[0] + 1], w[e], s[e])
        elif len(chosen) <= kernels.MAX_TOKENS:
            out[chosen] = kernels.q8_linear(flat[chosen], w[e], s[e])
        else:
            out[chosen] = F.linear(flat[chosen], w[e].float() * s[e][:, None])
    return out.view(N, k, -1)


@int8_experts.register_fake
def _(x, ids, weight, scales, n_experts):
    return x.new_empty(ids.shape[0], ids.shape[1], weight.shape[0] // n_experts)


class Int4Experts(QuantizedLayer):
    """model.Experts stored as Int4Linear's on-disk tensors: weight uint8 (n_experts * out,
    in_padded / 2), scales and zeros float16 (n_experts * out, groups); read as Int8Experts."""
    float_tensors = ("scales", "zeros")

    def __init__(self, n_experts: int, in_features: int, out_per_expert: int, groupsize: int, bias: bool = False):
        super().__init__()
        self.n_experts, self.in_features, self.out_features = n_experts, in_features, n_experts * out_per_expert
        self.groupsize, width = groupsize, padded_width(in_features, groupsize)
        self.register_buffer("weight", torch.empty(self.out_features, width // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.empty(self.out_features, width // groupsize, dtype=torch.float16))
        self.register_buffer("zeros", torch.empty(self.out_features, width // groupsize, dtype=torch.float16))
        self.register_buffer("bias", torch.empty(self.out_features) if bias else None)

    @classmethod
    def like(cls, experts: Experts, groupsize: Optional[int]) -> "Int4Experts":
        return cls(experts.n_experts, experts.in_features, experts.out_features // experts.n_experts, groupsize,
                   experts.bias is not None)

    @property
    def split_unit(self) -> int:  # as Int4Linear: a split keeps groups whole
        return self.groupsize

    def pack(self, cache: dict, dtype: torch.dtype = torch.float32):
        pass  # the gather unpacks the chosen experts' nibbles from the on-disk layout

    def forward(self, x: Tensor, ids: Tensor) -> Tensor:
        return through_experts(self, x, ids)

    def gathered(self, ids: Tensor, dtype: torch.dtype) -> Tensor:  # (N, k, out, in)
        def per_expert(t):  # (n_experts * out, ...) -> the chosen experts' (..., out, ...)
            return t.view(self.n_experts, -1, t.shape[-1])[ids]
        b, scales, zeros = per_expert(self.weight), per_expert(self.scales), per_expert(self.zeros)
        q = torch.stack([b & 15, b >> 4], dim=-1).flatten(-2)  # (..., out, width), low nibble first
        groups = q.view(*q.shape[:-1], scales.shape[-1], -1)  # (..., out, groups, groupsize)
        w = groups.float() * scales.float()[..., None] + zeros.float()[..., None]
        return w.flatten(-2)[..., :self.in_features].to(dtype)

    def expert(self, e: int, dtype: torch.dtype) -> Tensor:  # (out, in)
        return self.gathered(torch.tensor(e), dtype)


def cached_pack(cache: dict, weight: Tensor, fn) -> Tensor:
    # a tied embedding and output head hold the same tensor: pack it once, share the result
    key = id(weight)
    if key not in cache:
        cache[key] = (weight, fn(weight))  # keep weight alive so its id is not reused
    return cache[key][1]


# ---------------------------------------------------------------- the table of schemes

def int8_tensors(w: Tensor, groupsize: Optional[int] = None) -> dict:
    q, scales = quantize_int8(w)
    return {"weight": q, "scales": scales}


def int4_tensors(q: Tensor, scales: Tensor, zeros: Tensor) -> dict:
    return {"weight": nibbles_to_bytes(q), "scales": scales.half(), "zeros": zeros.half()}


@dataclass(frozen=True)
class Format:
    """How one weight matrix is stored, and the layers that read it."""
    name: str  # what config.json records for the head and the embedding
    linear: type  # the QuantizedLayer replacing an nn.Linear
    embedding: type  # the QuantizedLayer replacing the nn.Embedding (same tensors: a tied head shares them)
    experts: type  # the QuantizedLayer replacing a mixture's model.Experts (every expert's matrix in this format)
    quantize: Callable[[Tensor, Optional[int]], dict]  # (float weight (out, in), groupsize) -> tensors by name
    gptq: Optional[Callable[[Tensor, Tensor, int], dict]] = None  # (weight, Hessian, groupsize) -> the same
    grouped: bool = False  # takes --groupsize


INT8 = Format("int8", Int8Linear, Int8Embedding, Int8Experts, int8_tensors)
INT4 = Format("int4", Int4Linear, Int4Embedding, Int4Experts,
              quantize=lambda w, groupsize: int4_tensors(*quantize_int4(w, groupsize)),
              gptq=lambda w, hessian, groupsize: int4_tensors(*gptq_int4(w, hessian, groupsize)),
              grouped=True)


@dataclass(frozen=True)
class Scheme:
    """One --mode: the format of each kind of layer (see the module docstring for why)."""
    blocks: Format  # every linear layer of the blocks
    head: Format  # the output head
    embedding: Format  # the token embedding of an untied model; a tied one shares the head's tensors
    gptq: bool = False  # the blocks' layers calibrated with GPTQ, else rounded to nearest

    @property
    def grouped(self) -> bool:
        return any(f.grouped for f in (self.blocks, self.head, self.embedding))


SCHEMES = {
    "int8": Scheme(blocks=INT8, head=INT8, embedding=INT8),
    "int4": Scheme(blocks=INT4, head=INT8, embedding=INT4),
    "int4-gptq": Scheme(blocks=INT4, head=INT8, embedding=INT4, gptq=True),
}


def linear_names(model) -> list:
    """The linear layers, block by block, then the head: the modules tp splits, but the embedding
    and attention's own per-head tensors; a mixture's experts included."""
    return [name for name, module in model.named_modules()
            if tp.plan_kind(name) not in (None, "vocab_embedding", "heads") or is_experts(module)]


def is_experts(module: nn.Module) -> bool:
    """A mixture's stacked experts (model.Experts): weight (n_experts, out, in)."""
    return isinstance(module, Experts)


def layer_format(scheme: Scheme, args, name: str) -> Format:
    """The format of a linear layer (a name of linear_names) or of "tok_embeddings"."""
    if name == "output" or (name == "tok_embeddings" and args.tie_word_embeddings):
        return scheme.head
    return scheme.embedding if name == "tok_embeddings" else scheme.blocks


def check_scheme(recorded: dict, args) -> Scheme:
    """The Scheme of a checkpoint's config.json "quantization", which must be one quantize.py makes."""
    mode = recorded.get("mode")
    if not isinstance(mode, str) or mode not in SCHEMES:  # a list or a dict from a damaged file is no key
        raise QuantizeError(f"unknown quantization mode {mode!r} (this version knows {', '.join(SCHEMES)})")
    scheme = SCHEMES[mode]
    for part, name in (("embedding", "tok_embeddings"), ("output", "output")):
        made = layer_format(scheme, args, name).name
        if recorded.get(part, made) != made:
            raise QuantizeError(f"unsupported quantization of the {part}: {recorded[part]!r} "
                                f"(mode {mode} makes it {made})")
    groupsize = recorded.get("groupsize")
    if scheme.grouped and (type(groupsize) is not int or groupsize not in GROUPSIZES):  # 32.0 or true pass `in`
        raise QuantizeError(f"unsupported int4 group size {recorded.get('groupsize')!r} "
                            f"(choose from {', '.join(map(str, GROUPSIZES))})")
    return scheme


def use_quantized_layers(model, recorded: dict):
    """Swap the model's float layers for quantized ones of the same names (on the meta device,
    before the weights are read): what load_model does for a quantized checkpoint."""
    scheme = check_scheme(recorded, model.args)
    for name in linear_names(model) + ["tok_embeddings"]:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        fmt, module = layer_format(scheme, model.args, name), getattr(parent, attr)
        layer = fmt.embedding if name == "tok_embeddings" else fmt.experts if is_experts(module) else fmt.linear
        setattr(parent, attr, layer.like(module, recorded.get("groupsize")))


def float_tensor_names(model) -> set:
    """The float tensors of the quantized layers (scales, zeros), which keep their stored dtype."""
    return {f"{name}.{tensor}" for name, module in model.named_modules() if isinstance(module, QuantizedLayer)
            for tensor in module.float_tensors}


def streamed_int8_names(model) -> set:
    """The int8 weights whose rows the CPU loops read as stored in every decode step: the linear
    layers' and experts', and the embedding's where the head is tied to it (an untied embedding
    is read a row a token)."""
    names = {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, (Int8Linear, Int8Experts))}
    if model.args.tie_word_embeddings and isinstance(model.tok_embeddings, Int8Embedding):
        names.add("tok_embeddings.weight")
    return names


def prepare_for_device(model):
    """Tie a tied head's scales to the embedding's (load_model has tied the weight), repack every
    quantized layer's integers for the kernel, on the device they were loaded to, and make them
    Parameters (no gradient): under skip_guard_eval_unsafe TorchDynamo still checks the shape,
    strides and dtype of every input tensor that is not a Parameter, on every call."""
    if model.args.tie_word_embeddings:  # the head reads the embedding's int8 rows: their scales too
        model.output.scales = model.tok_embeddings.scales
    layers = [module for module in model.modules() if isinstance(module, QuantizedLayer)]
    cache = {("int4 rows", key): view for key, view in int4_rows_block(layers).items()}
    for layer in layers:
        layer.pack(cache, model.norm.weight.dtype)
    frozen = {}  # a tied head and embedding share tensors: one Parameter each, so they stay shared
    for layer in layers:
        for name, t in list(layer._buffers.items()):
            if t is not None:
                if id(t) not in frozen:  # keep t too, so that its id is not reused
                    frozen[id(t)] = (t, nn.Parameter(t, requires_grad=False))
                del layer._buffers[name]
                layer.register_parameter(name, frozen[id(t)][1])


def log(message: str):
    tqdm.write(message, file=sys.stderr)


def progress(items, desc: str, unit: str):
    """A progress bar on stderr, shown only when stderr is a terminal."""
    return tqdm(items, desc=desc, unit=unit, file=sys.stderr, disable=not sys.stderr.isatty())


# ---------------------------------------------------------------- calibration for GPTQ

@torch.no_grad()
def collect_hessians(model, names: list, calibration: list) -> dict:
    """H = 2/n sum x x^T of each named linear layer's inputs over the calibration sequences,
    through the float model (the inputs to later layers are not re-quantized)."""
    hessians, counts, hooks = {}, {}, []
    for name in names:
        layer = model.get_submodule(name)
        hessians[name] = torch.zeros(layer.in_features, layer.in_features)
        counts[name] = 0

        def hook(module, inputs, output, name=name):
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).float()
            n = counts[name] + x.shape[0]
            hessians[name] *= counts[name] / n
            hessians[name] += (2 / n) * x.T @ x
            counts[name] = n
        hooks.append(layer.register_forward_hook(hook))
    try:
        longest = max(len(ids) for ids in calibration)
        model.setup_caches(1, longest)
        for ids in progress(calibration, "calibration", "seq"):
            model(torch.tensor([ids]), torch.arange(len(ids)))
    finally:
        for handle in hooks:
            handle.remove()
    return hessians


def calibration_sequences(tokenizer, path: Path, n: int, length: int) -> list:
    ids = tokenizer.encode(path.read_text(encoding="utf-8"), add_bos=False)
    if len(ids) < length:
        raise QuantizeError(f"calibration text {path} has {len(ids)} tokens, fewer than one sequence ({length})")
    step = max((len(ids) - length) // max(n - 1, 1), 1)
    return [ids[i:i + length] for i in range(0, len(ids) - length + 1, step)][:n]


# ---------------------------------------------------------------- quantizing a checkpoint

def quantize_state(model, mode: str, groupsize: int, hessians: Optional[dict] = None) -> dict:
    """The quantized checkpoint's tensors from a float model's; GPTQ for the layers in `hessians`."""
    scheme, args = SCHEMES[mode], model.args
    state = dict(model.state_dict())
    names = ["tok_embeddings"] + linear_names(model)
    if args.tie_word_embeddings:  # the head is the embedding
        state.pop("output.weight", None)
        names.remove("output")
    out = {}
    for name in progress(names, "GPTQ" if hessians else "quantizing", "layer"):
        hessian = hessians.get(name) if hessians is not None else None
        out.update(quantize_weight(scheme, args, name, state.pop(f"{name}.weight"), groupsize, hessian))
    out.update(state)  # norms and biases stay float
    return {k: v.contiguous() for k, v in out.items()}


def quantize_weight(scheme: Scheme, args, name: str, w: Tensor, groupsize: int,
                    hessian: Optional[Tensor] = None) -> dict:
    """The checkpoint's tensors ("NAME.weight", "NAME.scales", ...) of layer `name`'s float weight w
    (out, in) in its format under scheme; GPTQ given the layer's Hessian."""
    fmt = layer_format(scheme, args, name)
    if fmt.grouped and groupsize > w.shape[1]:
        raise QuantizeError(f"group size {groupsize} is larger than {name}'s {w.shape[1]} inputs")
    tensors = fmt.gptq(w, hessian, groupsize) if hessian is not None else fmt.quantize(w, groupsize)
    return {f"{name}.{tensor}": t for tensor, t in tensors.items()}


def scheme_record(mode: str, groupsize: int, model) -> dict:
    """config.json's "quantization" for `model` (float, on any device) quantized in mode."""
    scheme, config = SCHEMES[mode], model.args
    record = {"mode": mode, "embedding": layer_format(scheme, config, "tok_embeddings").name,
              "output": layer_format(scheme, config, "output").name}
    if scheme.grouped:
        record["groupsize"] = groupsize
        # layers whose input width the group size does not divide: zero columns pad the last group
        record["padded"] = [name for name in linear_names(model) if layer_format(scheme, config, name).grouped
                            and model.get_submodule(name).in_features % groupsize]
    return record


def gptq_layers(model, scheme: Scheme) -> list:
    """The layers GPTQ calibrates. Experts are rounded to nearest: one Hessian per expert from the
    tokens routed to it is not collected."""
    return [name for name in linear_names(model)
            if layer_format(scheme, model.args, name).gptq and not is_experts(model.get_submodule(name))]


def meta_model(args) -> Transformer:
    """The model of `args` on the meta device (no memory, no random init: every weight comes from a
    file), with a quantized checkpoint's layers."""
    with torch.device("meta"):
        model = Transformer(args)
    if args.quantization:
        use_quantized_layers(model, args.quantization)
    return model


def memory_needs(model, args, scheme: Scheme, sequences: Optional[list]) -> list:
    """What quantizing allocates, from the float model built on the meta device: its weights (read in
    float32), the quantized copy, and for GPTQ a Hessian per layer (and one layer's working copies)
    and a calibration forward."""
    f32, machine = torch.float32, "quantize on a machine with more free memory"
    quantized = meta_model(replace(model.args, quantization={"mode": args.mode, "groupsize": args.groupsize}))
    needs = [Need("the float weights", weight_bytes(model, f32), machine, f" of {args.checkpoint} in float32"),
             Need("the quantized copy", weight_bytes(quantized, f32), machine, f" ({args.mode})")]
    if sequences:
        width = [model.get_submodule(name).in_features for name in gptq_layers(model, scheme)]
        length = max(map(len, sequences))
        needs += [Need("the GPTQ Hessians", sum(w * w * 4 for w in width) + 3 * max(width, default=0) ** 2 * 4,
                       f"use --mode int4 (round to nearest, no Hessians) or {machine}", f" of {len(width)} layers"),
                  Need("the calibration forward", kv_cache_bytes(model, 1, length, f32)
                       + logits_bytes(model.args.vocab_size, length) + activation_bytes(model.args, length, length, f32),
                       "lower --calibration_length", f" of {length} tokens")]
    return needs


def default_out(checkpoint_dir: Path, mode: str, groupsize: int) -> Path:
    suffix = f"{mode}-g{groupsize}" if SCHEMES[mode].grouped else mode
    return checkpoint_dir.parent / f"{checkpoint_dir.name}-{suffix}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Quantize a float checkpoint's weights to int8 or int4; writes a new checkpoint directory.",
        epilog="int8: symmetric per output channel. int4: asymmetric per group of --groupsize inputs, "
               "round to nearest. int4-gptq: int4 with GPTQ error compensation, calibrated on "
               "--calibration (default: data/macbeth.txt, public domain). The output head is int8 in "
               "every mode. Run generate.py / eval.py on the output like on any checkpoint.")
    p.add_argument("--checkpoint", type=Path, required=True, help="float checkpoint directory")
    p.add_argument("--mode", required=True, help=", ".join(SCHEMES))
    p.add_argument("--groupsize", type=int, default=32,
                   help=f"int4: inputs per scale/zero, one of {', '.join(map(str, GROUPSIZES))}")
    p.add_argument("--out", type=Path, default=None,
                   help="output directory (default: <checkpoint>-int8, -int4-g32, -int4-gptq-g32)")
    p.add_argument("--calibration", type=Path, default=DEFAULT_CALIBRATION, help="int4-gptq: calibration text file")
    p.add_argument("--calibration_samples", type=int, default=32, help="int4-gptq: sequences of calibration text")
    p.add_argument("--calibration_length", type=int, default=512, help="int4-gptq: tokens per sequence")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    scheme = SCHEMES.get(args.mode)
    if scheme is None:
        raise QuantizeError(f"unknown --mode {args.mode!r} (choose {', '.join(SCHEMES)})")
    if scheme.grouped and args.groupsize not in GROUPSIZES:
        raise QuantizeError(f"--groupsize {args.groupsize} is not supported "
                            f"(choose {', '.join(map(str, GROUPSIZES))})")
    if scheme.gptq and not args.calibration.is_file():
        raise QuantizeError(f"calibration file {args.calibration} not found")
    config = checkpoint.read_config(args.checkpoint)
    if config.quantization:
        raise QuantizeError(f"{args.checkpoint} is already quantized ({config.quantization.get('mode')}); "
                            "quantize the float checkpoint it came from")
    out = args.out or default_out(args.checkpoint, args.mode, args.groupsize)
    if out.exists() and not args.force:
        raise QuantizeError(f"{out} exists (pass --force to replace it)")
    sequences = None
    if scheme.gptq:  # a calibration text too short fails before the weights load
        from tokenizer import Tokenizer
        sequences = calibration_sequences(Tokenizer(args.checkpoint), args.calibration, args.calibration_samples,
                                          args.calibration_length)
    check_memory(memory_needs(meta_model(config), args, scheme, sequences), "cpu")
    model = checkpoint.read_model(args.checkpoint)

    hessians = None
    if scheme.gptq:
        log(f"GPTQ: collecting layer inputs over {len(sequences)} x {args.calibration_length} tokens "
            f"of {args.calibration}")
        hessians = collect_hessians(model, gptq_layers(model, scheme), sequences)
    with torch.no_grad():
        state = quantize_state(model, args.mode, args.groupsize, hessians)
    record = scheme_record(args.mode, args.groupsize, model)
    if scheme.gptq:
        record["calibration"] = {"file": args.calibration.name, "sequences": args.calibration_samples,
                                 "tokens": args.calibration_length}
    others = [f.name for f in args.checkpoint.iterdir()
              if f.is_file() and f.name not in (checkpoint.CONFIG, checkpoint.WEIGHTS)]
    checkpoint.write_checkpoint(out, replace(config, quantization=record), state,
                                add_files=checkpoint.copy_files(args.checkpoint, others),
                                metadata={"quantization": json.dumps(record)})
    float_bytes = (args.checkpoint / checkpoint.WEIGHTS).stat().st_size
    new_bytes = (out / checkpoint.WEIGHTS).stat().st_size
    log(f"wrote {out}: {new_bytes / 1e6:.1f} MB, {100 * new_bytes / float_bytes:.1f}% of the float checkpoint")


if __name__ == "__main__":
    run_cli(main)
