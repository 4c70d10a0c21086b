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
tensor: 21% of SmolLM2) is int8 per row, except in int4 modes when the head is untied
(Qwen2.5): there the table goes int4 in groups, which pays for the int8 head (the file stays
under 18% of float32). A tied head shares the int8 table. Norms and biases stay in float.
config.json's "quantization" records each choice ("embedding", "output").

At load time prepare_for_device() repacks the integers for the kernel: see pack_int8/pack_int4.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import kernels
from model import ConfigError, ModelArgs, realized

MODES = ("int8", "int4", "int4-gptq")
GROUPSIZES = (32, 64, 128, 256)  # the int4 kernel handles 32 and multiples of 64
DEFAULT_CALIBRATION = Path(__file__).resolve().parent / "data" / "macbeth.txt"


class QuantizeError(Exception):
    """Bad input for quantization; the message is one line meant for the user."""


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
    a little buys a finer step for every other weight: 27% less squared error over
    Qwen2.5-Coder-0.5B's layers at g32 than min..max."""
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
    # a few hundred rows at a time: the search's temporaries stay in cache rather than in fresh
    # pages (a 4864x896 layer: 0.43 s against 1.48 s whole; one-off timing)
    params = [int4_group_params(rows) for rows in groups.split(256)]
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
# copy through a stack buffer and ran 4x slower. So each row is stored as blocks of 8 int32
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
    """Pack for kernels.py's q8/q4 loops (CPU), or in lanes for the compiled expression (CUDA,
    or a CPU without the kernels)."""
    return weight.device.type == "cpu" and kernels.available()


def pack_int4_rows(q: Tensor) -> Tensor:
    """values 0..15 (out, in) -> uint8 (out, ceil(in/64) * 32): per 64 columns, byte j holds
    column j in its low nibble and column 32 + j in its high nibble."""
    q = pad_columns(q.to(torch.uint8), 64)
    out, width = q.shape
    q = q.view(out, width // 64, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(out, width // 2).contiguous()


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


def use_kernel(x: Tensor) -> bool:
    # a compiled matrix-vector product (batch-1 decode) is the expression below, fused by inductor
    # with the rest of the layer
    return torch.compiler.is_compiling() and x.shape[:-1].numel() == 1


def padded_tokens(x: Tensor, width: int) -> Tensor:
    """x (..., in) -> float32 (tokens, width), zero columns appended to the packed width."""
    return F.pad(x.reshape(-1, x.shape[-1]).float(), (0, width - x.shape[-1]))


class PackedLinear(nn.Module):
    """What the int8 and int4 linears share: the choice of path, by layout and token count.
    A subclass's pack() sets `cpu_kernel_layout` and `width` (the padded input width), and it
    gives `cpu_kernel` (kernels.py, CPU), `matvec` (the unpacking expression for one compiled
    token, lanes layout) and `dequantized` (everything else).
    - CPU with kernels.py: up to 16 tokens (decode, a verify, a short prompt), compiled or not,
      go through kernels.py's int8-activation loop; inductor's fused expression was compute-bound
      at about 9 GB/s of int8 weights.
    - CUDA, or a CPU without the kernels: one compiled token is the unpacking expression.
    - Otherwise (longer prompts, eager CUDA) the layer dequantizes its weight for the float matmul."""

    def forward(self, x: Tensor) -> Tensor:
        if self.cpu_kernel_layout and x.shape[:-1].numel() <= kernels.MAX_TOKENS:
            y = self.cpu_kernel(padded_tokens(x, self.width))  # (tokens, out) float32
        elif not self.cpu_kernel_layout and use_kernel(x):
            y = self.matvec(realized(padded_tokens(x, self.width)))
        else:
            y = F.linear(x, self.dequantized(x.dtype))
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

    def pack(self, cache: dict):
        self.cpu_kernel_layout = for_cpu_kernel(self.weight)
        self.packed = cached_pack(cache, self.weight, pack_int8_for_device)
        self.scales = self.scales.float()
        self.weight = None  # the packed copy replaces it
        self.out_features = self.packed.shape[0]
        self.width = self.packed.shape[1] * (1 if self.cpu_kernel_layout else 32)

    def dequantized(self, dtype) -> Tensor:  # (out, in) in dtype
        q = self.packed if self.cpu_kernel_layout else unpack_int8(self.packed).reshape(self.out_features, -1)
        return (q[:, :self.in_features].float() * self.scales[:, None]).to(dtype)

    def matvec(self, xp: Tensor) -> Tensor:
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

    def __init__(self, in_features: int, out_features: int, groupsize: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.groupsize = in_features, out_features, groupsize
        width = padded_width(in_features, groupsize)
        self.register_buffer("weight", torch.empty(out_features, width // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.empty(out_features, width // groupsize, dtype=torch.float16))
        self.register_buffer("zeros", torch.empty(out_features, width // groupsize, dtype=torch.float16))
        self.register_buffer("bias", torch.empty(out_features) if bias else None)
        self.register_buffer("packed", None, persistent=False)  # made by pack() after loading

    def pack(self, cache: dict):
        self.out_features = self.weight.shape[0]
        self.cpu_kernel_layout = for_cpu_kernel(self.weight)
        if self.cpu_kernel_layout:
            self.packed = cached_pack(cache, self.weight, lambda w: pack_int4_rows(bytes_to_nibbles(w)))
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


class Int4Embedding(nn.Module):
    """Token embedding stored like Int4Linear's weight (int4 in groups along the row), for an
    untied model in int4 mode. A lookup unpacks the few rows it reads; no kernel layout."""

    def __init__(self, num_embeddings: int, embedding_dim: int, groupsize: int):
        super().__init__()
        self.embedding_dim, width = embedding_dim, padded_width(embedding_dim, groupsize)
        self.register_buffer("weight", torch.empty(num_embeddings, width // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.empty(num_embeddings, width // groupsize, dtype=torch.float16))
        self.register_buffer("zeros", torch.empty(num_embeddings, width // groupsize, dtype=torch.float16))
        self.dtype = torch.float32

    def pack(self, cache: dict, dtype: torch.dtype):
        self.dtype = dtype  # the model's activations

    def forward(self, tokens: Tensor) -> Tensor:
        flat = tokens.reshape(-1)
        rows = dequantize_int4(bytes_to_nibbles(self.weight[flat]), self.scales[flat], self.zeros[flat])
        return rows[:, :self.embedding_dim].reshape(*tokens.shape, -1).to(self.dtype)


class Int8Embedding(nn.Module):
    """Token embedding stored int8 per row (a row is one token's vector)."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.embedding_dim = embedding_dim
        self.register_buffer("weight", torch.empty(num_embeddings, embedding_dim, dtype=torch.int8))
        self.register_buffer("scales", torch.empty(num_embeddings, dtype=torch.float32))
        self.register_buffer("packed", None, persistent=False)  # made by pack() after loading
        self.dtype = torch.float32

    def pack(self, cache: dict, dtype: torch.dtype):
        # a tied head reads the same packed rows, so the embedding takes the head's layout
        self.dtype = dtype  # the model's activations
        self.cpu_kernel_layout = for_cpu_kernel(self.weight)
        self.packed = cached_pack(cache, self.weight, pack_int8_for_device)
        self.scales = self.scales.float()
        self.weight = None

    def forward(self, tokens: Tensor) -> Tensor:
        rows = self.packed[tokens]
        if not self.cpu_kernel_layout:
            rows = unpack_int8(rows).reshape(*tokens.shape, -1)  # (..., blocks, 4, 8) -> (..., width)
        return (rows[..., :self.embedding_dim].float() * self.scales[tokens][..., None]).to(self.dtype)


def pack_int8_for_device(q: Tensor) -> Tensor:
    return pad_columns(q, 32).contiguous() if for_cpu_kernel(q) else pack_int8(q)


def cached_pack(cache: dict, weight: Tensor, fn) -> Tensor:
    # a tied embedding and output head hold the same tensor: pack it once, share the result
    key = id(weight)
    if key not in cache:
        cache[key] = (weight, fn(weight))  # keep weight alive so its id is not reused
    return cache[key][1]


# ---------------------------------------------------------------- applying to a model

def linear_names(model) -> list:
    """Names of the linear layers quantize.py quantizes, block by block, then the head."""
    names = []
    for i in range(len(model.layers)):
        names += [f"layers.{i}.attention.wqkv", f"layers.{i}.attention.wo",
                  f"layers.{i}.feed_forward.w1", f"layers.{i}.feed_forward.w3", f"layers.{i}.feed_forward.w2"]
    return names + ["output"]


def check_scheme(q: dict):
    mode = q.get("mode")
    if mode not in MODES:
        raise QuantizeError(f"unknown quantization mode {mode!r} (this version knows {', '.join(MODES)})")
    for part in ("embedding", "output"):
        if q.get(part, "int8") not in ("int8", "int4") or (q.get(part) == "int4" and mode == "int8"):
            raise QuantizeError(f"unsupported quantization of the {part}: {q.get(part)!r}")
    if mode != "int8" and q.get("groupsize") not in GROUPSIZES:
        raise QuantizeError(f"unsupported int4 group size {q.get('groupsize')!r} "
                            f"(choose from {', '.join(map(str, GROUPSIZES))})")


def layer_kind(args, mode: str, name: str) -> str:
    """int8 or int4 for one linear layer, or for "tok_embeddings" (see the module docstring)."""
    if name == "output":
        return "int8"
    if name == "tok_embeddings":
        return "int4" if mode != "int8" and not args.tie_word_embeddings else "int8"
    return "int8" if mode == "int8" else "int4"


def use_quantized_layers(model, q: dict):
    """Swap the model's float layers for quantized ones of the same names (on the meta device,
    before the weights are read): what load_model does for a quantized checkpoint."""
    check_scheme(q)
    for name in linear_names(model):
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr)
        if scheme_kind(model.args, q, name) == "int8":
            new = Int8Linear(old.in_features, old.out_features, old.bias is not None)
        else:
            new = Int4Linear(old.in_features, old.out_features, q["groupsize"], old.bias is not None)
        setattr(parent, attr, new)
    if scheme_kind(model.args, q, "tok_embeddings") == "int8":
        model.tok_embeddings = Int8Embedding(model.args.vocab_size, model.args.dim)
    else:
        model.tok_embeddings = Int4Embedding(model.args.vocab_size, model.args.dim, q["groupsize"])


def scheme_kind(args, q: dict, name: str) -> str:
    """What a checkpoint's config.json recorded for the head and the embedding (files from before
    session 9 have an int4 head when untied), else what quantize.py makes."""
    recorded = {"output": q.get("output"), "tok_embeddings": q.get("embedding")}.get(name)
    return recorded or layer_kind(args, q["mode"], name)


def tie_scales(model):
    """A tied head reads the embedding's int8 rows: share its scales too (load_model ties weight)."""
    model.output.scales = model.tok_embeddings.scales


def prepare_for_device(model):
    """Repack every quantized layer's integers for the kernel, on the device they were loaded to,
    and make them Parameters (no gradient). Under skip_guard_eval_unsafe TorchDynamo still
    checks the shape, strides and dtype of every input tensor that is not a Parameter, on every
    call: for SmolLM2 int8 ~300 checks, about 1 ms of a 9 ms token."""
    cache = {}
    for m in model.modules():
        if isinstance(m, (Int8Linear, Int4Linear)):
            m.pack(cache)
    model.tok_embeddings.pack(cache, model.norm.weight.dtype)
    frozen = {}  # a tied head and embedding share tensors: one Parameter each, so they stay shared
    for m in model.modules():
        if isinstance(m, (Int8Linear, Int4Linear, Int8Embedding, Int4Embedding)):
            for name, t in list(m._buffers.items()):
                if t is not None:
                    if id(t) not in frozen:  # keep t too, so that its id is not reused
                        frozen[id(t)] = (t, nn.Parameter(t, requires_grad=False))
                    del m._buffers[name]
                    m.register_parameter(name, frozen[id(t)][1])


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
        for i, ids in enumerate(calibration):
            tokens = torch.tensor([ids])
            model(tokens, torch.arange(len(ids)))
            print(f"calibration {i + 1}/{len(calibration)}", file=sys.stderr, flush=True)
    finally:
        for h in hooks:
            h.remove()
    return hessians


def calibration_sequences(tokenizer, path: Path, n: int, length: int) -> list:
    ids = tokenizer.encode(path.read_text(encoding="utf-8"), add_bos=False)
    if len(ids) < length:
        raise QuantizeError(f"calibration text {path} has {len(ids)} tokens, fewer than one sequence ({length})")
    step = max((len(ids) - length) // max(n - 1, 1), 1)
    return [ids[i:i + length] for i in range(0, len(ids) - length + 1, step)][:n]


# ---------------------------------------------------------------- quantizing a checkpoint

def quantize_state(model, mode: str, groupsize: int, hessians: Optional[dict] = None, log=None) -> dict:
    """The quantized checkpoint's tensors from a float model's."""
    state = {k: v for k, v in model.state_dict().items()}
    args = model.args
    if args.tie_word_embeddings:
        state.pop("output.weight", None)
    out = {}
    names = linear_names(model)
    if args.tie_word_embeddings:
        names.remove("output")
    for i, name in enumerate(["tok_embeddings"] + names):
        w = state.pop(f"{name}.weight")
        kind = layer_kind(args, mode, name)
        if kind == "int8":
            out[f"{name}.weight"], out[f"{name}.scales"] = quantize_int8(w)
        else:
            if groupsize > w.shape[1]:
                raise QuantizeError(f"group size {groupsize} is larger than {name}'s {w.shape[1]} inputs")
            if hessians is not None and name in hessians:
                q, s, z = gptq_int4(w, hessians[name], groupsize)
            else:
                q, s, z = quantize_int4(w, groupsize)
            out[f"{name}.weight"] = nibbles_to_bytes(q)
            out[f"{name}.scales"], out[f"{name}.zeros"] = s.half(), z.half()
        if log:
            log(f"quantized {name} ({kind}) [{i + 1}/{len(names) + 1}]")
    out.update(state)  # norms and biases stay float
    return {k: v.contiguous() for k, v in out.items()}


def default_out(checkpoint: Path, mode: str, groupsize: int) -> Path:
    suffix = mode if mode == "int8" else f"{mode}-g{groupsize}"
    return checkpoint.parent / f"{checkpoint.name}-{suffix}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Quantize a float checkpoint's weights to int8 or int4; writes a new checkpoint directory.",
        epilog="int8: symmetric per output channel. int4: asymmetric per group of --groupsize inputs, "
               "round to nearest. int4-gptq: int4 with GPTQ error compensation, calibrated on "
               "--calibration (default: data/macbeth.txt, public domain). The token embedding is "
               "int8 in every mode. Run generate.py / eval.py on the output like on any checkpoint.")
    p.add_argument("--checkpoint", type=Path, required=True, help="float checkpoint directory")
    p.add_argument("--mode", required=True, help="int8, int4 or int4-gptq")
    p.add_argument("--groupsize", type=int, default=32, help="int4: inputs per scale/zero, 32, 64, 128 or 256")
    p.add_argument("--out", type=Path, default=None,
                   help="output directory (default: <checkpoint>-int8, -int4-g32, -int4-gptq-g32)")
    p.add_argument("--calibration", type=Path, default=DEFAULT_CALIBRATION, help="int4-gptq: calibration text file")
    p.add_argument("--calibration_samples", type=int, default=32, help="int4-gptq: sequences of calibration text")
    p.add_argument("--calibration_length", type=int, default=512, help="int4-gptq: tokens per sequence")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    return p


def main(argv=None):
    a = build_parser().parse_args(argv)
    log = lambda *m: print(*m, file=sys.stderr, flush=True)  # noqa: E731
    if a.mode not in MODES:
        raise QuantizeError(f"unknown --mode {a.mode!r} (choose {', '.join(MODES)})")
    if a.mode != "int8" and a.groupsize not in GROUPSIZES:
        raise QuantizeError(f"--groupsize {a.groupsize} is not supported (choose {', '.join(map(str, GROUPSIZES))})")
    if a.mode == "int4-gptq" and not a.calibration.is_file():
        raise QuantizeError(f"calibration file {a.calibration} not found")
    from generate import UserError, load_model
    try:
        args = ModelArgs.from_json(a.checkpoint / "config.json")
    except FileNotFoundError:
        raise QuantizeError(f"{a.checkpoint} is not a checkpoint directory (no config.json)") from None
    except (ConfigError, TypeError) as e:
        raise QuantizeError(f"{a.checkpoint}/config.json: {e}") from None
    if args.quantization:
        raise QuantizeError(f"{a.checkpoint} is already quantized ({args.quantization.get('mode')}); "
                            "quantize the float checkpoint it came from")
    out = a.out or default_out(a.checkpoint, a.mode, a.groupsize)
    if out.exists() and not a.force:
        raise QuantizeError(f"{out} exists (pass --force to replace it)")
    try:
        model = load_model(a.checkpoint, "cpu", torch.float32)
    except UserError as e:
        raise QuantizeError(str(e)) from None

    hessians = None
    if a.mode == "int4-gptq":
        from tokenizer import Tokenizer
        seqs = calibration_sequences(Tokenizer(a.checkpoint), a.calibration, a.calibration_samples,
                                     a.calibration_length)
        names = [n for n in linear_names(model) if layer_kind(args, a.mode, n) == "int4"]
        log(f"GPTQ: collecting layer inputs over {len(seqs)} x {a.calibration_length} tokens of {a.calibration}")
        hessians = collect_hessians(model, names, seqs)
    with torch.no_grad():
        state = quantize_state(model, a.mode, a.groupsize, hessians, log)
    scheme = {"mode": a.mode, "embedding": layer_kind(args, a.mode, "tok_embeddings"),
              "output": layer_kind(args, a.mode, "output")}
    if a.mode != "int8":
        scheme["groupsize"] = a.groupsize
        # layers whose input width the group size does not divide: zero columns pad the last group
        scheme["padded"] = [n for n in linear_names(model) if f"{n}.zeros" in state
                            and padded_width(model.get_submodule(n).in_features, a.groupsize)
                            != model.get_submodule(n).in_features]
    if a.mode == "int4-gptq":
        scheme["calibration"] = {"file": a.calibration.name, "sequences": a.calibration_samples,
                                 "tokens": a.calibration_length}
    write_checkpoint(a.checkpoint, out, args, scheme, state)
    float_bytes = (a.checkpoint / "model.safetensors").stat().st_size
    new_bytes = (out / "model.safetensors").stat().st_size
    log(f"wrote {out}: {new_bytes / 1e6:.1f} MB, {100 * new_bytes / float_bytes:.1f}% of the float checkpoint")


def write_checkpoint(src: Path, out: Path, args, scheme: dict, state: dict):
    """Write config + weights + tokenizer files into a temporary directory, then rename it to out."""
    from dataclasses import replace
    from safetensors.torch import save_file
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private
    try:
        cfg = replace(args, quantization=scheme)
        (tmp / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt", "quantization": json.dumps(scheme)})
        for f in src.iterdir():
            if f.is_file() and f.name not in ("config.json", "model.safetensors"):
                shutil.copy(f, tmp / f.name)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


if __name__ == "__main__":
    try:
        main()
    except QuantizeError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
