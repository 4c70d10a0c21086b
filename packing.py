"""How quantized integers are laid out: on disk (int4 as two nibbles a byte, rows padded to whole
groups), and for each kernel that reads them at run time (inductor's 32-bit lanes, kernels.py's
rows, tinygemm's tiles). Pure tensor functions: qlayers.py's layers call them when they pack,
quantize.py when it writes a checkpoint."""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

import kernels


# ---------------------------------------------------------------- on disk

def padded_width(in_features: int, groupsize: int) -> int:
    return -(-in_features // groupsize) * groupsize


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
