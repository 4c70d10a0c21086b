"""Rotary position embeddings (RoPE, Su et al. 2021) and their scalings: linear, dynamic NTK,
Llama 3.1's, YaRN and LongRoPE, with each variant's parameters read from config.json's
rope_scaling as Hugging Face writes them. Imports nothing of the project (model.py builds on it).
"""
import math
from dataclasses import replace
from typing import Optional

import torch
from torch import Tensor, nn

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def rope_inv_freq(args, long: bool = False) -> tuple[Tensor, float]:
    """Inverse frequencies (rope_dim/2,) and the cos/sin scale, for every static RoPE variant.
    Dynamic NTK and LongRoPE depend on the sequence length and are finished in `Rotary`
    (long: LongRoPE's frequencies for sequences past original_max_position_embeddings)."""
    head_dim, base = args.rope_dim or args.head_dim, args.rope_theta  # the rotated dims only
    wavelengths = base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    inv_freq = 1.0 / wavelengths
    scaling = args.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":  # position interpolation (Chen et al. 2023): positions / factor
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":  # Llama 3.1: scale long wavelengths, keep short ones, blend between
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        out = torch.where(wavelen > old_ctx / lo, inv_freq / factor, blended)
        return torch.where(wavelen < old_ctx / hi, inv_freq, out), 1.0
    if kind == "yarn":
        return yarn_inv_freq(args, inv_freq, head_dim, base, scaling)
    if kind == "longrope":  # LongRoPE (Ding et al. 2024): searched per-dimension factors, short or long
        orig = scaling["original_max_position_embeddings"]
        factor = scaling.get("factor") or args.max_position_embeddings / orig
        attn_factor = scaling.get("attention_factor")
        if attn_factor is None:
            attn_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig))
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (factors * wavelengths), float(attn_factor)
    return inv_freq, 1.0  # default and dynamic


def yarn_inv_freq(args, inv_freq: Tensor, head_dim: int, base: float, scaling: dict) -> tuple[Tensor, float]:
    """YaRN (Peng et al. 2023), eq. 15-20: a ramp between interpolation and extrapolation."""
    factor = scaling["factor"]
    orig = scaling.get("original_max_position_embeddings") or args.max_position_embeddings

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn_factor = scaling.get("attention_factor")
    if attn_factor is None:
        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            attn_factor = mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
        else:
            attn_factor = mscale(factor)

    def correction_dim(rotations):  # the dimension whose wavelength fits `rotations` times in orig
        return head_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1 for high-frequency dims, which keep their original frequency
    return inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate, float(attn_factor)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: (B, n_heads, T, head_dim), cos/sin: (B, 1, T, rope_dim/2); HF "rotate_half" layout
    rope_dim = 2 * cos.shape[-1]
    if rope_dim < x.shape[-1]:  # partial rotary: the trailing dims pass through unrotated
        return torch.cat([apply_rope(x[..., :rope_dim], cos, sin), x[..., rope_dim:]], dim=-1)
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.type_as(x)


def recompute_position(args) -> Optional[int]:
    """The sequence length past which every cached key must be rotated again: LongRoPE (Phi-3)
    switches to its long factors there, for the whole sequence, as transformers' generate() does.
    None for every other variant."""
    scaling = args.rope_scaling or {}
    return scaling["original_max_position_embeddings"] if scaling.get("rope_type") == "longrope" else None


def trained_context(args) -> int:
    """Positions the model was trained for: max_position_embeddings, times the factor of the RoPE
    scalings whose configs keep the original length there (linear, dynamic, YaRN), as vLLM reads them."""
    scaling = args.rope_scaling or {}
    factor = scaling.get("factor")
    if scaling.get("rope_type") not in ("linear", "dynamic", "yarn") or not isinstance(factor, (int, float)) \
            or not 1 < factor < 2 ** 31:
        return args.max_position_embeddings
    original = scaling.get("original_max_position_embeddings") if scaling["rope_type"] == "yarn" else None
    original = original if isinstance(original, int) and original > 0 else args.max_position_embeddings
    return max(args.max_position_embeddings, int(original * factor))


class Rotary(nn.Module):
    """cos and sin for positions (B, T): (B, 1, T, rope_dim/2). The variants that depend on the
    sequence's length (dynamic NTK, LongRoPE) read it per row, from the row's largest position in
    this forward, so that a row rotates as it would alone."""

    def __init__(self, args, local: bool = False, device=None):
        super().__init__()
        if local:  # Gemma 3's sliding layers: their own base, unscaled
            args = replace(args, rope_theta=args.rope_local_theta, rope_scaling=None)
        self.args = args
        inv_freq, self.scale = rope_inv_freq(args)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self.kind = (args.rope_scaling or {}).get("rope_type", "default")
        if self.kind == "longrope":
            self.register_buffer("long_inv_freq", rope_inv_freq(args, long=True)[0].to(device), persistent=False)

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        inv_freq = self.inv_freq.expand(positions.shape[0], -1)  # (B, rope_dim/2)
        scaling, longest = self.args.rope_scaling or {}, positions.amax(-1, keepdim=True) + 1  # (B, 1)
        if self.kind == "dynamic":  # Dynamic NTK: stretch the base once the sequence outgrows the trained context
            head_dim, orig = self.args.rope_dim or self.args.head_dim, self.args.max_position_embeddings
            factor = scaling["factor"]
            base = self.args.rope_theta * ((factor * longest.float().clamp(min=orig) / orig) - (factor - 1)) \
                ** (head_dim / (head_dim - 2))  # (B, 1)
            exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
            inv_freq = 1.0 / base ** exponent
        if self.kind == "longrope":  # the long factors once the sequence outgrows the original context
            inv_freq = torch.where(longest > scaling["original_max_position_embeddings"], self.long_inv_freq, inv_freq)
        angles = positions.unsqueeze(-1).float() * inv_freq.unsqueeze(1)  # (B, T, rope_dim/2)
        return (angles.cos() * self.scale).unsqueeze(1), (angles.sin() * self.scale).unsqueeze(1)
