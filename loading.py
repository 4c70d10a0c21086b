"""From a checkpoint directory to a model on a device: the meta model (a quantized checkpoint's
layers, a tensor-parallel rank's shard), the memory preflight, the weights, the device's packing and
kernels; and the checks of the device, dtype and tokenizer that come before it."""
import functools
from typing import Callable, Optional

import torch

import checkpoint
import kernels
import qlayers
from errors import TokenizerError, UserError
from memory import Need, check_memory, dtype_name, weight_bytes
from model import Transformer
from tp import ranks_on_this_machine

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@functools.cache  # once per process: load_model calls it for the target and the draft
def keep_freed_memory() -> bool:
    """Let glibc keep freed memory for reuse instead of returning it to the kernel: otherwise every
    tensor above 128 KiB is a fresh mmap, and each prefill and verify pays page faults for new,
    zeroed pages. Returns whether the allocator took the settings (False off glibc)."""
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # malloc.h
    # mmap only above 32 MiB (glibc's largest dynamic threshold); keep up to 1 GiB free at the top
    return bool(libc.mallopt(M_MMAP_THRESHOLD, 32 << 20) and libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))


def meta_model(args, tp=None) -> Transformer:
    """The model load_model builds before reading any weight: on the meta device, with a quantized
    checkpoint's layers and, with `tp`, only this rank's shard of each weight."""
    model = qlayers.meta_model(args)
    if tp is not None:
        tp.shard_modules(model)  # shrink the sharded layers to this rank's part
    return model


def load_model(checkpoint_dir, device="cpu", dtype=torch.float32, tp=None, fast_kernels: bool = True,
               needs: Optional[Callable[[Transformer], list]] = None) -> Transformer:
    """checkpoint dir -> ModelArgs + weights -> Transformer on `device` in `dtype` (eval mode).
    A quantized checkpoint (config.json names its scheme) gets qlayers.py's layers; with `tp`
    (tp.py) this process builds and reads only its shard of each weight; on CPU, kernels.py's
    fast paths are installed unless fast_kernels is False (the reference model alone).
    Before any weight is read, the weights and what needs(meta model) lists (the run's other
    buffers, as `Need`s) are checked against the free memory (check_memory)."""
    keep_freed_memory()
    args = checkpoint.read_config(checkpoint_dir)
    model = meta_model(args, tp)
    device = torch.device(device)
    # CPU ranks on one machine load at once from the same free memory: each may plan its part only
    preflight(model, checkpoint_dir, device, dtype, needs,
              ranks=ranks_on_this_machine() if tp is not None and device.type == "cpu" else 1)
    keep_dtype = qlayers.float_tensor_names(model)  # a quantized layer's scales and zeros
    streamed = qlayers.streamed_int8_names(model)  # int8 rows read into one block on 2 MB pages (CPU)
    state = checkpoint.read_weights(checkpoint_dir, checkpoint.expected_shapes(model), device, dtype,
                                    keep_dtype=keep_dtype.__contains__, read=tp.read if tp is not None else None,
                                    streamed=streamed.__contains__, view=tp.view if tp is not None else lambda f: f)
    model.load_state_dict(state, strict=False, assign=True)
    if model.args.tie_word_embeddings:  # (a pipeline stage's args say whether it holds the head)
        model.output.weight = model.tok_embeddings.weight
    if args.quantization:
        qlayers.prepare_for_device(model)  # ties scales, packs the weights for this device's kernel
    if fast_kernels:
        kernels.install(model)
    return model.eval()


# ---------------------------------------------------------------- memory preflight (memory.py)

def preflight(model: Transformer, checkpoint_dir, device, dtype: torch.dtype,
              needs: Optional[Callable[[Transformer], list]] = None, ranks: int = 1) -> None:
    """check_memory for the weights of `model` (as meta_model builds it) in `dtype` and what
    needs(model) lists."""
    weights = Need("the weights", weight_bytes(model, dtype), "pass a smaller --dtype or a quantized checkpoint "
                   "(quantize.py)", f" of {checkpoint_dir} in {dtype_name(dtype)}")
    check_memory([weights, *(needs(model) if needs else [])], device, ranks)


def check_vocabulary(tok, args, where) -> None:
    """Every token id the tokenizer gives text, and its BOS and EOS, must index the model's
    embedding: tokenizer files of another model fail here, not as an index error mid-generation.
    Special tokens past the embedding are allowed (Gemma 3's image token); a prompt that holds one
    is refused where it is encoded."""
    past = sorted(i for i in tok.text_ids() if i >= args.vocab_size)
    if past:
        raise TokenizerError(f"{where}: the tokenizer has token ids up to {past[-1]} ({len(past)} of them past the "
                        f"model's vocabulary of {args.vocab_size}): tokenizer files of another model?")


def describe_weights(model: Transformer, dtype: str, device, checkpoint_dir=None) -> str:
    """What a status line says of a loaded model's weights: the bytes it holds (every expert, an
    untied embedding too: not param_bytes, what a step reads) in `dtype`; for a quantized model its
    scheme, and the size as the checkpoint stores it beside the size on the device (which the
    device's packing changes)."""
    tensors = dict(model.named_parameters())  # a tied head appears once
    tensors.update((n, b) for n, b in model.named_buffers() if "cache" not in n)
    size = sum(t.nbytes for n, t in tensors.items() if not n.startswith(("rotary.", "local_rotary.")))
    q = model.args.quantization
    if not q:
        return f"{size / 1e6:.0f} MB of weights in {dtype} on {device}"
    base = q["mode"].split("-")[0]  # int4-gptq: int4 weights calibrated with GPTQ
    label = base + (f"-g{q['groupsize']}" if "groupsize" in q else "") + (" (GPTQ)" if "gptq" in q["mode"] else "")
    others = {}  # format -> the parts stored in it, where not the blocks' format
    for part, key in (("embedding", "embedding"), ("head", "output")):
        if q.get(key, base) != base:
            others.setdefault(q[key], []).append(part)
    label += "".join(f" with the {' and '.join(parts)} {fmt}" for fmt, parts in others.items())
    if checkpoint_dir is None:
        return f"{size / 1e6:.0f} MB of weights: {label}, the rest in {dtype}, on {device}"
    stored = checkpoint.stored_bytes(checkpoint_dir)
    return f"{stored / 1e6:.0f} MB of weights as stored: {label}, the rest in {dtype}; {size / 1e6:.0f} MB on {device}"


def parse_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"unknown device {name!r} (try cpu or cuda)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError("device cuda is not available on this machine")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise UserError(f"device {name!r} does not exist: this machine has {torch.cuda.device_count()} "
                        f"CUDA device(s), cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError("device mps is not available on this machine")
    if device.type not in ("cpu", "cuda", "mps"):
        raise UserError(f"unsupported device {name!r} (try cpu or cuda)")
    return device


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise UserError(f"unknown dtype {name!r} (choose {', '.join(DTYPES)})")
    return DTYPES[name]


# ---------------------------------------------------------------- the two phases
