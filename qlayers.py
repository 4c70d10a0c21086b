"""The quantized layers as a loaded model runs them, and which layer reads which format.

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
layers, subclasses of `QuantizedLayer`, and its quantizer in quantize.QUANTIZERS) and a row of
SCHEMES; load_model and tp.py ask the layers what they need. At load time prepare_for_device()
repacks the integers for the kernel (packing.py).
"""
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import checkpoint
import kernels
import tp
from choices import GROUPSIZES
from errors import QuantizeError
from model import Experts, Transformer, through_experts
from packing import (bytes_to_nibbles, dequantize_int4, for_cpu_kernel, int8_byte, int8_layout, pack_int4,
                     pack_int4_rows, pack_int8_for_device, pad_columns, padded_width, tinygemm_mm, tinygemm_pack,
                     unpack_int4, unpack_int4_rows, unpack_int8, uses_tinygemm)
from thresholds import THRESHOLDS


# ---------------------------------------------------------------- the layers

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
    """What the int8 and int4 linears share: the choice of path, by layout and token count
    (`linear_path`). A subclass's pack() sets `cpu_kernel_layout`, `tinygemm` and `width` (the
    padded input width), and it gives `cpu_kernel` (kernels.py, CPU), `matvec` (the unpacking
    expression for one compiled token) and `dequantized` (everything else)."""
    tinygemm = False

    def one_pass(self, dtype) -> bool:
        """Whether `dequantized` takes kernels.py's one-pass loop (the expression's bits, no float32
        temporaries) rather than the torch expression."""
        return self.cpu_kernel_layout and kernels.available() and dtype in (torch.float32, torch.bfloat16)

    def linear_path(self, tokens: int, compiled: bool) -> str:
        """The path of `tokens` tokens of x (compiled: being traced by torch.compile), first rule first."""
        if self.tinygemm:  # int4 on CUDA in bfloat16, every token count: tinygemm_mm
            return "tinygemm"
        # CPU with kernels.py, compiled or not: its int8-activation loop reads the weights faster than inductor
        if self.cpu_kernel_layout and tokens <= THRESHOLDS.loop_max_tokens:
            return "loop"
        # CUDA, or a CPU without kernels.py: one compiled token through the unpacking expression, which inductor fuses
        if not self.cpu_kernel_layout and compiled and tokens == 1:
            return "matvec"
        if not self.cpu_kernel_layout and getattr(self, "layout", None) == "rows":  # CUDA's int8 rows
            return "rows"
        return "dequantized"  # a longer prompt, eager CUDA: one dequantized weight for the float product

    def forward(self, x: Tensor) -> Tensor:
        path = self.linear_path(x.shape[:-1].numel(), torch.compiler.is_compiling())
        if path == "tinygemm":
            xt = x.reshape(-1, x.shape[-1]).to(self.scales_and_zeros.dtype)
            y = tinygemm_mm(F.pad(xt, (0, self.width - x.shape[-1])), self.packed, self.groupsize, self.scales_and_zeros)
        elif path == "loop":
            y = self.cpu_kernel(padded_tokens(x, self.width))  # (tokens, out) float32
        elif path == "matvec":
            y = self.matvec(kernels.materialize(padded_tokens(x, self.width)))
        elif path == "rows":  # integers are exact in any float dtype: the scales wait until after the product
            y = F.linear(x.reshape(-1, x.shape[-1]), self.packed.to(x.dtype)) * self.scales
        else:
            y = self.through_dequantized(x)
        y = y.to(x.dtype).view(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias

    def through_dequantized(self, x: Tensor) -> Tensor:
        """x times the dequantized weight; on a CPU with bf16 instructions in bfloat16 through oneDNN,
        at twice float32's rate: x and the product rounded to 8 bits of mantissa (the loops round x
        coarser, to int8 blocks), the weight by at most a quarter of an int8 step."""
        bf16 = self.cpu_kernel_layout and kernels.ONEDNN and kernels.CPU_HAS_BF16
        x_in = x.to(torch.bfloat16) if bf16 else x
        weight = self.dequantized(x_in.dtype)
        if kernels.uses_onednn(x_in.shape[:-1].numel(), x_in.dtype, weight):
            return kernels.dense_linear(x_in, weight)
        return F.linear(x_in, weight)


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
        if torch.compiler.is_compiling() and N * k <= min(self.n_experts, THRESHOLDS.expert_loop_max_slots):
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
    float32. Up to expert_loop_max_slots slots of a chosen expert go through kernels.q8_linear on a view of its rows
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
        elif len(chosen) <= THRESHOLDS.expert_loop_max_slots:
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

@dataclass(frozen=True)
class Format:
    """How one weight matrix is stored, and the layers that read it (its quantizer, which loading
    never needs, is quantize.QUANTIZERS[format])."""
    name: str  # what config.json records for the head and the embedding
    linear: type  # the QuantizedLayer replacing an nn.Linear
    embedding: type  # the QuantizedLayer replacing the nn.Embedding (same tensors: a tied head shares them)
    experts: type  # the QuantizedLayer replacing a mixture's model.Experts (every expert's matrix in this format)
    grouped: bool = False  # takes --groupsize


INT8 = Format("int8", Int8Linear, Int8Embedding, Int8Experts)
INT4 = Format("int4", Int4Linear, Int4Embedding, Int4Experts, grouped=True)


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


# ---------------------------------------------------------------- loading a quantized checkpoint

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


def int4_rows_block(layers: list) -> dict:
    """id(weight) -> an empty tensor for pack_int4_rows to fill, for the int4 weight of each layer
    that packs for the CPU loops, all views of one block on 2 MB pages (the int8 rows' reason,
    checkpoint.streamed_block: Qwen 0.5B int4 decodes 1.10x faster, docs/design.md).
    Packed into it directly, so that no packed copy is freed to the heap, which would keep it."""
    weights = {id(m.weight): m.weight for m in layers
               if isinstance(m, Int4Linear) and m.weight is not None and for_cpu_kernel(m.weight)}
    shapes = {key: (w.shape[0], -(-w.shape[1] * 2 // 64) * 32) for key, w in weights.items()}  # pack_int4_rows'
    views = checkpoint.block_views({key: rows * cols for key, (rows, cols) in shapes.items()})
    return {key: view.view(shapes[key]) for key, view in views.items()}


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


def meta_model(args) -> Transformer:
    """The model of `args` on the meta device (no memory, no random init: every weight comes from a
    file), with a quantized checkpoint's layers."""
    with torch.device("meta"):
        model = Transformer(args)
    if args.quantization:
        use_quantized_layers(model, args.quantization)
    return model
