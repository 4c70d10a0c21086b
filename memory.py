"""Memory preflight: the bytes a run will allocate (weights, KV caches, logits, activations),
estimated from a model built on the meta device, checked against the memory there is before any
of it is allocated, so that too much is a one-line error instead of the kernel's OOM killer."""
import math
import os
import resource
from dataclasses import dataclass
from typing import Optional

import torch

import checkpoint
from errors import UserError
from model import Transformer

# a run plans at most this share of the free memory: activations, compiled code and the
# allocator's slack take the rest
MEMORY_MARGIN = 0.9
MEMINFO = "/proc/meminfo"


class OutOfMemory(UserError):
    """Buffers that would not fit in the memory there is, refused before any is allocated."""


@dataclass(frozen=True)
class Need:
    """A buffer a run will allocate, its bytes, and how to shrink it (for the message)."""
    name: str  # "the KV cache"
    nbytes: int
    fix: str  # "lower --batch_size or --max_new_tokens"
    detail: str = ""  # " for 4 sequences of 512 tokens"


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB", "PB"):
        if n < 999.5 or unit == "PB":
            return f"{n:.3g} {unit}"
        n /= 1000


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def meminfo_available() -> Optional[int]:
    """The kernel's estimate of the memory that can be allocated without swapping (MemAvailable,
    Linux); None where there is no such file."""
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def available_memory(device) -> Optional[int]:
    """Bytes that can still be allocated on `device`: on CPU the kernel's MemAvailable, on CUDA
    the device's free memory; None where unknown (then nothing is refused). MINILLM_AVAILABLE_MEMORY
    (bytes) caps it: room kept for other work, and the tests' small machine."""
    device = torch.device(device)
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    elif device.type == "cpu":
        free = meminfo_available()
    else:
        free = None
    cap = os.environ.get("MINILLM_AVAILABLE_MEMORY")
    if cap:
        try:
            cap = int(float(cap))
        except ValueError:
            raise UserError(f"MINILLM_AVAILABLE_MEMORY={cap!r} is not a number of bytes") from None
        free = cap if free is None else min(free, cap)
    return free


def tokens_that_fit(model: Transformer, dtype: torch.dtype, want: int, floor: int, device, reserve: int = 0,
                    ranks: int = 1) -> int:
    """KV cache tokens to allocate: want, or as many as the memory available on device (a 1/ranks
    part of it) holds beside reserve bytes (within MEMORY_MARGIN), but not fewer than floor
    (check_memory then says whether floor fits)."""
    have = available_memory(device)
    if have is None:
        return want
    have //= ranks
    per_token = max(1, kv_cache_bytes(model, 1, 1, dtype))
    return max(floor, min(want, int((have * MEMORY_MARGIN - reserve) // per_token)))


def check_memory(needs: list, device, ranks: int = 1) -> None:
    """OutOfMemory, naming the largest need, both figures and its fix, unless all of `needs` fit in
    MEMORY_MARGIN of the memory available on `device` (a 1/ranks part of it: processes that
    allocate from it at once)."""
    device = torch.device(device)
    have = available_memory(device)
    if have is None:
        return
    have //= ranks
    total = sum(n.nbytes for n in needs)
    if total <= have * MEMORY_MARGIN:
        return
    largest, *rest = sorted((n for n in needs if n.nbytes), key=lambda n: -n.nbytes)
    names = [n.name for n in rest]
    others = f" ({human_bytes(total)} with {', '.join(names[:-1])}{' and ' * (len(names) > 1)}{names[-1]})" \
        if names else ""
    where = device.type + (f" for each of the {ranks} ranks on this machine" if ranks > 1 else "")
    raise OutOfMemory(f"{largest.name}{largest.detail} would need {human_bytes(largest.nbytes)}{others}, but "
                      f"{human_bytes(have)} is available on {where} (a run plans {MEMORY_MARGIN:.0%} of it): "
                      f"{largest.fix}")


def weight_bytes(model: Transformer, dtype: torch.dtype) -> int:
    """Bytes of the weights load_model reads into `model` (as meta_model builds it): float tensors
    in `dtype`, except quantized layers' scales and zeros, which keep theirs, as do integers."""
    expected = checkpoint.expected_shapes(model)
    # quantized layers (qlayers.QuantizedLayer) declare the float tensors that keep their dtype
    keep = {f"{name}.{tensor}" for name, module in model.named_modules()
            for tensor in getattr(module, "float_tensors", ())}
    return sum(math.prod(shape) * (dtype.itemsize if expected.dtypes[name].is_floating_point and name not in keep
                                   else expected.dtypes[name].itemsize)
               for name, shape in expected.items())


def kv_cache_bytes(model: Transformer, batch_size: int, max_seq_length: int, dtype: torch.dtype) -> int:
    """Bytes of the slot pools model.setup_caches(batch_size, max_seq_length) allocates in `dtype`:
    keys and values of every layer (this rank's KV heads) for batch_size x max_seq_length slots."""
    per_slot = sum(2 * a.n_kv_heads * a.head_dim for a in (layer.attention for layer in model.layers))
    return batch_size * max_seq_length * per_slot * dtype.itemsize


def logits_bytes(vocab_size: int, rows: int) -> int:
    """Float32 logits of `rows` positions, twice: the model's output and the sampler's (or the
    loss's) working copy."""
    return 2 * rows * vocab_size * 4


def activation_bytes(args, tokens: int, kv_len: int, dtype: torch.dtype) -> int:
    """The largest activations of one forward over `tokens` positions (all rows) whose queries see
    kv_len keys, roughly: a few residual-stream tensors and a feed-forward's hidden states at once,
    and the additive attention mask."""
    hidden = max(args.intermediate_size, (args.moe_intermediate_size or 0) * args.n_experts_per_token)
    return tokens * (4 * args.dim + 3 * hidden + kv_len) * dtype.itemsize


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
