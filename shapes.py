"""Models of a published shape with random weights, made on the device in seconds.

Decode speed depends on the shapes and on the bytes a step reads, not on the values of the
weights, so a 7B model's speed on a GPU can be measured without carrying 13 GB of weights there:

    python generate.py --shape llama-2-7b --device cuda --dtype bfloat16 --max_new_tokens 256 --ignore_eos
    python generate.py --shape llama-3.1-8b --quantize int4-g32 --device cuda --dtype bfloat16
    python -m scripts.bench --shape llama-2-7b --device cuda --quantized int8,int4-g32,int4-g64

The weights are drawn from N(0, 0.02) on the device (norms 1). --quantize rounds them with
quantize.py's own quantizers, a layer at a time as they are drawn, so no float copy of the whole
model is ever held, and the layers are packed for the device as a quantized checkpoint's are at
load. What such a model writes means nothing: generate.py prints its token ids.
"""
from dataclasses import replace
from typing import Callable, Optional

import torch

import kernels
import qlayers
import quantize
from choices import SHAPES  # (there without torch: generate.py's --shape offers them)
from errors import QuantizeError
from memory import Need, check_memory, dtype_name, weight_bytes
from model import ModelArgs, Transformer


def parse_quantization(label: str) -> tuple[str, int]:
    """"int8", "int4-g32", "int4-g64", ... -> (quantize.py's mode, group size)."""
    mode, _, group = label.partition("-g")
    if mode not in qlayers.SCHEMES or (qlayers.SCHEMES[mode].grouped != bool(group)) \
            or (group and (not group.isdigit() or int(group) not in qlayers.GROUPSIZES)):
        groups = ", ".join(f"int4-g{g}" for g in qlayers.GROUPSIZES)
        raise QuantizeError(f"unknown quantization {label!r} (choose int8, {groups})")
    return mode, int(group) if group else 32


def shape_args(name: str) -> ModelArgs:
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r} (choose {', '.join(SHAPES)})")
    return ModelArgs(**SHAPES[name])


def random_model(name: str, device="cpu", dtype=torch.float32, quantization: Optional[str] = None,
                 seed: int = 0, needs: Optional[Callable[[Transformer], list]] = None) -> Transformer:
    """The model of shape `name` with random weights, built on `device` in `dtype` (the norms and
    activations), its linear layers and embedding quantized in memory as quantization says
    (a parse_quantization label), ready to run as load_model leaves a checkpoint's model. Its
    weights and what needs(meta model) lists are checked against the free memory first."""
    device = torch.device(device)
    args = shape_args(name)
    float_model = qlayers.meta_model(args)  # the float shape of every tensor
    record, scheme, groupsize = None, None, None
    if quantization:
        mode, groupsize = parse_quantization(quantization)
        record, scheme = quantize.scheme_record(mode, groupsize, float_model), qlayers.SCHEMES[mode]
    model = qlayers.meta_model(replace(args, quantization=record))
    check_memory([Need("the weights", weight_bytes(model, dtype), "pass a smaller --dtype or --quantize",
                       f" of shape {name} in {dtype_name(dtype)}"), *(needs(model) if needs else [])], device)
    layers = set(qlayers.linear_names(float_model) + ["tok_embeddings"]) if record else set()
    generator = torch.Generator(device).manual_seed(seed)
    state = {}
    for key, t in float_model.state_dict().items():
        if args.tie_word_embeddings and key == "output.weight":
            continue  # the embedding's
        layer = key.rpartition(".")[0]
        if "norm" in layer:
            state[key] = torch.ones(t.shape, dtype=dtype, device=device)
            continue
        # drawn in float32 a few thousand rows at a time (quantizing a 128256-row head whole takes
        # gigabytes of temporaries), each part written into the tensors it ends up in
        for rows in range(0, t.shape[0], ROWS_AT_ONCE):
            w = torch.randn((min(ROWS_AT_ONCE, t.shape[0] - rows), *t.shape[1:]), generator=generator, device=device) * 0.02
            part = quantize.quantize_weight(scheme, args, layer, w, groupsize) \
                if layer in layers and key.endswith(".weight") else {key: w.to(dtype)}
            for name, value in part.items():
                if name not in state:
                    state[name] = torch.empty((t.shape[0], *value.shape[1:]), dtype=value.dtype, device=device)
                state[name][rows:rows + len(value)] = value
    model.load_state_dict(state, strict=False, assign=True)
    if args.tie_word_embeddings:
        model.output.weight = model.tok_embeddings.weight
    if record:
        qlayers.prepare_for_device(model)
    if device.type == "cuda":  # the quantizers' temporaries go back to the device
        torch.cuda.empty_cache()
    return kernels.install(model).eval()


ROWS_AT_ONCE = 4096


def random_prompt(name: str, length: int, seed: int = 0) -> list:
    """length token ids, drawn the same way every time."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, shape_args(name).vocab_size, (length,), generator=generator).tolist()


class TokenIds:
    """Stands in for a tokenizer where a model has none: a token's text is its id (decode of a
    sequence is the decodes of its parts joined, as StreamDecoder needs)."""
    eos_ids: list = []

    def decode(self, ids) -> str:
        return "".join(f" {int(i)}" for i in ids)
