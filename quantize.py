"""Weight-only quantization: int8 per channel, int4 per group (round-to-nearest or GPTQ).

    python quantize.py --checkpoint checkpoints/smollm2-135m --mode int8
    python quantize.py --checkpoint checkpoints/smollm2-135m --mode int4 --groupsize 32
    python quantize.py --checkpoint checkpoints/smollm2-135m --mode int4-gptq --groupsize 32

Each writes a checkpoint directory like any other (default checkpoints/<name>-int8,
-int4-g32, -int4-gptq-g32); generate.py, eval.py, speculative decoding and tensor parallelism
load it without further flags, because config.json records the scheme.

Decode reads every weight once per token, so fewer bytes per weight is more tokens per second.

This file makes a checkpoint: the quantizers, each tied to the format it writes (`QUANTIZERS`),
GPTQ's calibration, and the command line (its flags: script_args.py). The formats on disk, the
table of modes (`SCHEMES`) and the layers that read them at load time are qlayers.py's.
"""
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import errors
import script_args

if __name__ == "__main__":
    errors.run_cli(script_args.parse_quantize_args)  # a wrong flag fails now, not after torch's seconds of importing
    errors.quiet_ctrl_c()  # Ctrl-C while torch imports exits 130 as it does later

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

import checkpoint
from errors import QuantizeError
from memory import Need, activation_bytes, check_memory, kv_cache_bytes, logits_bytes, weight_bytes
from packing import nibbles_to_bytes, pad_columns
from progress import progress as progress_bar
from qlayers import INT4, INT8, SCHEMES, Format, Scheme, is_experts, layer_format, linear_names, meta_model


def log(message: str):
    tqdm.write(message, file=sys.stderr)


def progress(items, desc: str, unit: str):
    """A bar on a terminal, else a line every few seconds (progress.py)."""
    return progress_bar(items, desc, unit=unit)


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


# ---------------------------------------------------------------- each format's quantizer

def int8_tensors(w: Tensor, groupsize: Optional[int] = None) -> dict:
    q, scales = quantize_int8(w)
    return {"weight": q, "scales": scales}


def int4_tensors(q: Tensor, scales: Tensor, zeros: Tensor) -> dict:
    return {"weight": nibbles_to_bytes(q), "scales": scales.half(), "zeros": zeros.half()}


@dataclass(frozen=True)
class Quantizer:
    """How a float matrix becomes one Format's tensors."""
    quantize: Callable[[Tensor, Optional[int]], dict]  # (float weight (out, in), groupsize) -> tensors by name
    gptq: Optional[Callable[[Tensor, Tensor, int], dict]] = None  # (weight, Hessian, groupsize) -> the same


# every Format of qlayers.SCHEMES -> its quantizer (loading reads the formats, only quantizing needs these)
QUANTIZERS: dict[Format, Quantizer] = {
    INT8: Quantizer(int8_tensors),
    INT4: Quantizer(quantize=lambda w, groupsize: int4_tensors(*quantize_int4(w, groupsize)),
                    gptq=lambda w, hessian, groupsize: int4_tensors(*gptq_int4(w, hessian, groupsize))),
}


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
    quantizer = QUANTIZERS[fmt]
    tensors = quantizer.gptq(w, hessian, groupsize) if hessian is not None else quantizer.quantize(w, groupsize)
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
            if QUANTIZERS[layer_format(scheme, model.args, name)].gptq and not is_experts(model.get_submodule(name))]


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


def main(argv=None):
    args = script_args.parse_quantize_args(argv)
    scheme = SCHEMES[args.mode]
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
    errors.run_cli(main)
