"""Tensor parallelism: every rank holds 1/N of each large weight. In "allreduce" mode the ranks
all-reduce twice per layer (Megatron-LM, Shoeybi et al. 2019, section 3), plus once for a
vocabulary-split embedding; in "exact" mode (the default for quantized checkpoints) they
all-gather instead, four times per layer, so that every sum is added in one process's order
(TensorParallel says why).

    torchrun --standalone --nproc_per_node=2 generate.py --checkpoint checkpoints/smollm2-135m --prompt "Hi"

The split is a per-module plan (as torchtitan writes it): `PLAN` names, for each linear layer of a
`TransformerBlock`, whether its output features (column-wise) or its input features (row-wise) are
split. Attention is split by heads, the feed-forward by its hidden dimension; a column-wise layer
feeds the row-wise one after it, so the activations between them stay local, and only the row-wise
layer's partial sums need an all-reduce. The embedding and output head are split by vocabulary
when N divides it (Megatron's vocabulary-parallel embedding; the logits are all-gathered). Norms
are replicated.

Quantized checkpoints (quantize.py) are split in their on-disk layout, generically: a column-wise
layer splits every tensor along dim 0; a row-wise layer splits its 2-D tensors along dim 1 (packed
int4 weights and group-wise scales included, at the group boundaries that the layer's
`split_unit` gives) and replicates 1-D per-channel scales; a row-wise bias is kept by rank 0
only, so the all-reduce adds it once. tp.py knows no quantization mode.

model.py knows nothing of this: `shard_modules` shrinks the meta-device model's sharded tensors
and attention head counts before loading, `read` slices each tensor from the memory-mapped
safetensors file, so a rank materializes only its own shard, and forward hooks all-reduce the
output of each row-wise layer (and all-gather the logits) through functional collectives, which
torch.compile traces into the compiled decode step.
"""
import atexit
import faulthandler
import math
import os
import signal
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.distributed_c10d import _resolve_process_group

import liveness
from choices import TP_MODES as MODES
from errors import TPError, UserError


def all_gather_single(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    """Every rank's x concatenated along dim, in rank order. The collective gathers along dim 0 and
    the parts are laid side by side here: torch 2.11's all_gather_tensor fails under torch.compile
    when it does that itself. funcol.all_gather_single is torch 2.13's name for all_gather_tensor,
    which older releases (requirements.txt's floor) have under the old name only."""
    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    y = gather(x.contiguous(), 0, group_name)  # (ranks * x.shape[0], *x.shape[1:])
    if dim == 0:
        return y
    parts = y.view(-1, *x.shape).movedim(0, dim)  # (..., ranks, x.shape[dim], ...)
    return parts.reshape(*x.shape[:dim], -1, *x.shape[dim + 1:])

# module name (or its last dotted parts) -> how its weight is split; every other tensor is replicated.
# Every linear layer of a Transformer is here: quantize.py quantizes these (all but the embedding).
PLAN = {
    "attention.wqkv": "colwise_heads",  # q, k and v row blocks, each split by heads
    "attention.wo": "rowwise_heads",  # input features are the heads' outputs
    "feed_forward.w1": "colwise",  # gate
    "feed_forward.w3": "colwise",  # up
    "feed_forward.w2": "rowwise",  # down: partial sums over the hidden dimension, all-reduced
    # by vocabulary, when N divides it (else replicated): each rank embeds the tokens it holds
    # (zeros for the rest) and the embeddings are all-reduced; the head's logits are all-gathered
    "tok_embeddings": "vocab_embedding",
    "output": "vocab_head",
}


# Modules that only some architectures have, split the same way (PLAN lists every model's linear layers)
VARIANT_PLAN = {
    # a mixture's experts (model.Experts, every expert's rows in one matrix): each expert's hidden
    # dimension split as a dense feed-forward's, so every rank runs every expert on its part
    "experts.w1": "colwise_experts",  # gate: the rank's rows of each expert
    "experts.w3": "colwise_experts",  # up
    "experts.w2": "rowwise_experts",  # down: partial sums over each expert's hidden part, all-reduced
    "attention": "heads",  # per-head tensors of attention itself (gpt-oss's sinks): the rank's query heads
}


def plan_kind(name: str) -> Optional[str]:
    """How the module `name` is split (PLAN, VARIANT_PLAN), or None: replicated."""
    return next((k for suffix, k in {**PLAN, **VARIANT_PLAN}.items()
                 if name == suffix or name.endswith("." + suffix)), None)


def split_units(model: nn.Module) -> dict:
    """plan kind -> how many input features a row-wise split must keep together: the lcm of its
    layers' `split_unit` (qlayers.py's int4 layers: their group size), 1 for plain layers."""
    units = dict.fromkeys([*PLAN.values(), *VARIANT_PLAN.values()], 1)
    for name, module in model.named_modules():
        kind = plan_kind(name)
        if kind is not None:
            units[kind] = math.lcm(units[kind], getattr(module, "split_unit", 1))
    return units


# a collective waits this long for a late rank (one that is lost ends the wait sooner: liveness.py)
TIMEOUT_S = int(os.environ.get("MINILLM_TP_TIMEOUT_S", "600"))


def split_evenly(n: int, parts: int, i: int) -> tuple[int, int]:
    """(start, count) of part i when n items go to `parts` parts; the first n % parts get one more."""
    base, extra = divmod(n, parts)
    return i * base + min(i, extra), base + (i < extra)


def head_split(n_heads: int, n_kv_heads: int, world: int, rank: int) -> tuple[int, int, int, int]:
    """(first query head, query heads, first KV head, KV heads) of this rank.

    With at least as many KV heads as ranks, each rank takes whole query groups (a KV head and the
    query heads that read it), as evenly as possible: SmolLM2's 3 KV heads on 2 ranks split 2 + 1
    (6 + 3 query heads). Splitting 5 + 4 would leave a rank with groups of unequal size, which the
    model's grouped-query attention (one SDPA call over equal groups) cannot run. With fewer KV
    heads than ranks (multi-query), each KV head is replicated on world / n_kv_heads ranks, which
    split its query group."""
    group = n_heads // n_kv_heads
    if n_kv_heads >= world:
        kv0, n_kv = split_evenly(n_kv_heads, world, rank)
        return kv0 * group, n_kv * group, kv0, n_kv
    sharing = world // n_kv_heads  # ranks that replicate one KV head
    if world % n_kv_heads or group % sharing:
        raise TPError(f"cannot split {n_heads} query heads and {n_kv_heads} KV heads over {world} ranks: "
                      f"with fewer KV heads than ranks, the ranks must be a multiple of the KV heads "
                      f"({n_kv_heads}) that divides the query heads per KV head ({group})")
    q_per_rank = group // sharing
    kv = rank // sharing
    return kv * group + (rank % sharing) * q_per_rank, q_per_rank, kv, 1


@dataclass
class Shard:
    """The part of one linear layer that this rank holds, in the layer's logical features."""
    rowwise: bool  # False: output features split (dim 0); True: input features split (dim 1)
    ranges: list  # [(start, stop), ...] of the split features, concatenated in this order
    features: int  # the layer's full number of output (column-wise) or input (row-wise) features


class TensorParallel:
    """This rank's place in the group and its shard of each layer named in PLAN.

    mode "allreduce" is Megatron's: attention.wo and feed_forward.w2 split by input features,
    their partial sums all-reduced (two collectives per layer). The ranks then add in another
    order than one process does, and where activations are rounded to int8 (kernels.py's
    quantized loops) a last-bit difference can move a value across a rounding step, so an int8
    or int4 model's greedy text drifts from one process's after some tokens.
    mode "exact" keeps every sum whole: wo and w2 are split by output features, after an
    all-gather of their inputs (the heads' outputs, the hidden activations), and their outputs
    are all-gathered; each output element is then computed by one rank as one process computes
    it, so with kernels.py's loops (which give a row the same bits whatever the other rows) the
    ranks produce one process's bits, at the cost of four all-gathers per layer instead of two
    all-reduces. A float layer's BLAS may add in an order that depends on the matrix's shape,
    so there exact mode buys no more than allreduce's last-bit agreement.
    mode "auto" (the default): exact for a quantized checkpoint, allreduce otherwise.
    A mixture's experts stay all-reduced in every mode."""

    def __init__(self, rank: int, world_size: int, group_name: Optional[str] = None, device="cpu",
                 mode: str = "auto"):
        if mode not in MODES:
            raise UserError(f"tensor-parallel mode {mode!r} is not one of {', '.join(MODES)}")
        self.rank, self.world_size, self.device, self.mode = rank, world_size, device, mode
        # the group's name, not the group: nothing of ours may keep it (and its threads) alive past close()
        self.group_name = group_name if group_name is not None else dist.group.WORLD.group_name
        self.shards: dict[str, Shard] = {}  # module name -> Shard, filled by shard_modules
        self.full_shapes: dict[str, tuple] = {}  # tensor name -> shape in the checkpoint

    @property
    def group(self) -> dist.ProcessGroup:
        return _resolve_process_group(self.group_name)

    # ---------------------------------------------------------------- the plan, before loading

    def shard_modules(self, model: nn.Module):
        """On the meta-device model: shrink each sharded layer's tensors to this rank's part, set
        each attention's local head counts, and hook in the collectives: an all-reduce after every
        row-wise layer, or in exact mode all-gathers around wo and w2."""
        args = model.args
        head_part = head_split(args.n_heads, args.n_kv_heads, self.world_size, self.rank)
        collectives = model.tp_collectives = []  # (kind, elements per batch row) of each one a step runs
        mode = model.tp_mode = self.mode if self.mode != "auto" else "exact" if args.quantization else "allreduce"
        units = self._row_units(model, mode)
        layer_shards = self._layer_shards(args, units, head_part)
        gathered, out_sizes = {}, None  # the all-gathers' sizes, in exact mode only
        if mode == "exact":
            gathered, out_sizes = self._exact_shards(args, units["rowwise"], layer_shards)
        for name, module in model.named_modules():
            kind = plan_kind(name)
            if kind not in layer_shards:
                continue
            shard = self.shards[name] = layer_shards[kind]
            self._shrink(name, module, shard)
            if self.world_size > 1:  # one rank holds the whole sum already
                collectives += self._hook_collectives(module, kind, shard, gathered.get(kind), out_sizes, args)
            # sizes that layers keep (nn.Linear, qlayers.py's layers slice by in_features)
            for attr in ("out_features", "in_features", "num_embeddings"):
                if hasattr(module, attr) and (attr == "in_features") == shard.rowwise:
                    setattr(module, attr, sum(b - a for a, b in shard.ranges))
        _, nq, _, nkv = head_part
        for layer in model.layers:
            layer.attention.n_heads, layer.attention.n_kv_heads = nq, nkv

    def _row_units(self, model: nn.Module, mode: str) -> dict:
        """Input features per group of each row-wise kind: a row-wise split must fall on the
        boundaries of the input-feature groups its layer stores together (quantize.py's int4 groups)."""
        args = model.args
        units = split_units(model)
        if mode == "exact":  # wo and w2 keep their input features whole
            units["rowwise"] = units["rowwise_heads"] = 1
        expert_hidden = args.moe_intermediate_size or args.intermediate_size
        q_rows = args.n_heads * args.head_dim
        for kind, features in (("rowwise", args.intermediate_size), ("rowwise_heads", q_rows),
                               ("rowwise_experts", expert_hidden)):
            if features % units[kind]:
                name = next(suffix for suffix, k in {**PLAN, **VARIANT_PLAN}.items() if k == kind)
                raise TPError(f"cannot split {name}: its {features} input features are padded to groups of "
                              f"{units[kind]}; quantize with a group size that divides {features}")
        return units

    def _layer_shards(self, args, units: dict, head_part: tuple) -> dict:
        """This rank's Shard of each plan kind: attention by heads, the feed-forward by its hidden
        dimension (w1 and w3 follow w2's split), experts by their hidden dimension, and the
        embedding and output head by vocabulary when the ranks divide it. head_part: head_split's."""
        head_dim, intermediate = args.head_dim, args.intermediate_size
        q0, nq, kv0, nkv = head_part
        q_rows, kv_rows = args.n_heads * head_dim, args.n_kv_heads * head_dim
        heads = Shard(False, [(q0 * head_dim, (q0 + nq) * head_dim),
                              (q_rows + kv0 * head_dim, q_rows + (kv0 + nkv) * head_dim),
                              (q_rows + kv_rows + kv0 * head_dim, q_rows + kv_rows + (kv0 + nkv) * head_dim)],
                      q_rows + 2 * kv_rows)
        unit = units["rowwise"]
        f0, nf = split_evenly(intermediate // unit, self.world_size, self.rank)
        hidden_part = [(f0 * unit, (f0 + nf) * unit)]
        if (q0 * head_dim) % units["rowwise_heads"] or ((q0 + nq) * head_dim) % units["rowwise_heads"]:
            raise TPError(f"cannot split attention.wo at query head {q0} over {self.world_size} ranks: "
                          f"its groups of {units['rowwise_heads']} input features straddle the heads")
        n_experts, expert_hidden = args.n_experts, args.moe_intermediate_size or intermediate
        e0, ne = split_evenly(expert_hidden // units["rowwise_experts"], self.world_size, self.rank)
        expert_part = (e0 * units["rowwise_experts"], (e0 + ne) * units["rowwise_experts"])
        layer_shards = {
            "colwise_heads": heads,
            "rowwise_heads": Shard(True, [(q0 * head_dim, (q0 + nq) * head_dim)], q_rows),
            "colwise": Shard(False, hidden_part, intermediate),
            "rowwise": Shard(True, hidden_part, intermediate),
            # the same part of every expert: expert e's hidden feature f is row e * expert_hidden + f
            "colwise_experts": Shard(False, [(e * expert_hidden + expert_part[0], e * expert_hidden + expert_part[1])
                                             for e in range(n_experts)], n_experts * expert_hidden),
            "rowwise_experts": Shard(True, [expert_part], expert_hidden),
            "heads": Shard(False, [(q0, q0 + nq)], args.n_heads),
        }
        vocab = args.vocab_size
        if vocab % self.world_size == 0:  # all-gather needs equal parts
            v0, nv = split_evenly(vocab, self.world_size, self.rank)
            layer_shards["vocab_embedding"] = layer_shards["vocab_head"] = Shard(False, [(v0, v0 + nv)], vocab)
        return layer_shards

    def _exact_shards(self, args, unit: int, layer_shards: dict) -> tuple[dict, list]:
        """Exact mode: wo and w2 take the whole input, gathered from every rank's part, and split
        their output features (layer_shards is updated). Returns (kind -> every rank's input
        features, every rank's output features) of the gathered tensors, for the padding."""
        out_part = [split_evenly(args.dim, self.world_size, r) for r in range(self.world_size)]
        layer_shards["rowwise_heads"] = layer_shards["rowwise"] = \
            Shard(False, [(out_part[self.rank][0], sum(out_part[self.rank]))], args.dim)
        heads_in = [head_split(args.n_heads, args.n_kv_heads, self.world_size, r)[1] * args.head_dim
                    for r in range(self.world_size)]
        hidden_in = [split_evenly(args.intermediate_size // unit, self.world_size, r)[1] * unit
                     for r in range(self.world_size)]
        return {"rowwise_heads": heads_in, "rowwise": hidden_in}, [n for _, n in out_part]

    def _shrink(self, name: str, module: nn.Module, shard: Shard):
        """Replace the module's meta tensors by meta tensors of this rank's shape."""
        for tensors in (module._parameters, module._buffers):
            for t_name, t in tensors.items():
                if t is not None:
                    self.full_shapes[f"{name}.{t_name}"] = tuple(t.shape)
                    local = torch.empty(self._local_shape(shard, t_name, t.shape), dtype=t.dtype, device="meta")
                    tensors[t_name] = nn.Parameter(local, requires_grad=False) if isinstance(t, nn.Parameter) else local

    def _hook_collectives(self, module: nn.Module, kind: str, shard: Shard, gathered_in: Optional[list],
                          out_sizes: Optional[list], args) -> list:
        """Hook the module's collectives in; returns them as (kind, elements per batch row)."""
        if gathered_in is not None:
            module.register_forward_pre_hook(self._gather_hook(gathered_in, inputs=True))
            module.register_forward_hook(self._gather_hook(out_sizes))
            return [("all_gather", self.world_size * max(gathered_in)),
                    ("all_gather", self.world_size * max(out_sizes))]
        if shard.rowwise:
            module.register_forward_hook(self._all_reduce_hook)
            return [("all_reduce", args.dim)]
        if kind == "vocab_head":
            module.register_forward_hook(self._all_gather_hook)
            return [("all_gather", args.vocab_size)]
        if kind == "vocab_embedding":
            self._embed_own_tokens(module, *shard.ranges[0])
            return [("all_reduce", args.dim)]
        return []

    def _all_reduce_hook(self, module, inputs, output):
        # the whole output, every batch row: each rank holds a partial sum over its input features
        return funcol.all_reduce(output, "sum", self.group_name)

    def _gather_hook(self, sizes: list, inputs: bool = False):
        """A hook that replaces a module's input (pre-hook) or output by the concatenation, in
        rank order, of every rank's part, whose last-dimension sizes are `sizes`: each part is
        padded to the largest, gathered, and the padding dropped."""
        group_name, widest = self.group_name, max(sizes)

        def gather(x):
            x = all_gather_single(F.pad(x, (0, widest - x.shape[-1])), x.dim() - 1, group_name)
            if min(sizes) == widest:
                return x
            return torch.cat([x[..., r * widest:r * widest + n] for r, n in enumerate(sizes)], dim=-1)

        if inputs:
            return lambda module, args: (gather(args[0]), *args[1:])
        return lambda module, args, output: gather(output)

    def _all_gather_hook(self, module, inputs, output):
        # (..., vocab / N) logits of this rank's tokens -> (..., vocab), in rank order
        return all_gather_single(output, output.dim() - 1, self.group_name)

    def _embed_own_tokens(self, module: nn.Module, v0: int, v1: int):
        """Make an embedding (nn.Embedding or qlayers.py's) holding rows v0..v1 look up only
        its own tokens, give zeros for the others, and all-reduce: the sum is the full lookup."""
        base, group_name = type(module), self.group_name

        def forward(self, tokens):
            local = tokens - v0
            mine = (local >= 0) & (local < v1 - v0)
            x = base.forward(self, local.clamp(0, v1 - v0 - 1))  # (..., dim)
            return funcol.all_reduce(x.masked_fill(~mine.unsqueeze(-1), 0), "sum", group_name)

        module.__class__ = type(f"VocabParallel{base.__name__}", (base,), {"forward": forward})

    def _slices(self, shard: Shard, t_name: str, shape) -> tuple[Optional[int], list]:
        """(dim, [(start, stop), ...]) of this rank's part of a tensor of the layer, in the
        tensor's own coordinates; dim None: the whole tensor (replicated)."""
        dim = 1 if shard.rowwise else 0
        if len(shape) <= dim:  # a row-wise layer's 1-D tensors: per-output-channel scales, or a bias
            return None, []
        size = shape[dim]
        unit = shard.features // size  # features per element: 1, 2 for packed int4, the group size for scales
        if unit * size != shard.features:
            raise TPError(f"{t_name} of shape {tuple(shape)} does not cover the layer's {shard.features} "
                          f"{'input' if shard.rowwise else 'output'} features evenly (padded?); cannot split it")
        for a, b in shard.ranges:
            if a % unit or b % unit:
                raise TPError(f"{t_name}: the split at feature {a if a % unit else b} is not on a boundary of "
                              f"its {unit}-feature groups")
        return dim, [(a // unit, b // unit) for a, b in shard.ranges]

    def _local_shape(self, shard: Shard, t_name: str, shape) -> tuple:
        dim, ranges = self._slices(shard, t_name, shape)
        if dim is None:
            return tuple(shape)
        out = list(shape)
        out[dim] = sum(b - a for a, b in ranges)
        return tuple(out)

    # ---------------------------------------------------------------- loading

    def view(self, f):
        """The checkpoint file (safe_open) as this rank reads it: whole here, a stage's part in pipeline.py."""
        return f

    def read(self, f, name: str) -> torch.Tensor:
        """This rank's part of tensor `name` from an open safetensors file (safe_open): only
        the slice is read from disk."""
        module, _, t_name = name.rpartition(".")
        shard = self.shards.get(module)
        if shard is None:
            return f.get_tensor(name)
        sl = f.get_slice(name)
        full = self.full_shapes.get(name)
        if full is not None and tuple(sl.get_shape()) != full:
            raise TPError(f"{name} has shape {tuple(sl.get_shape())} in the checkpoint, config.json implies {full}")
        dim, ranges = self._slices(shard, name, sl.get_shape())
        if dim is None:
            t = sl[:]
            if shard.rowwise and t_name == "bias" and self.rank != 0:
                t = torch.zeros_like(t)  # rank 0 adds the bias; the all-reduce sums it once
            return t
        # safetensors slices are views into the memory map: rows (dim 0) stay views, touching only
        # their own pages; columns become dense copies, so as not to keep the whole matrix's pages
        parts = [sl[a:b] if dim == 0 else sl[:, a:b].contiguous() for a, b in ranges]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)

    # ---------------------------------------------------------------- running as a group

    def all_ranks_ok(self, fn: Callable, *args, **kwargs):
        """Run fn on every rank and agree on the outcome before anyone goes on: if a rank fails
        (a bad shard, out of memory), every rank raises TPError naming it, instead of the others
        waiting forever in their next collective."""
        try:
            result, error = fn(*args, **kwargs), None
        except Exception as e:  # noqa: BLE001: reported by every rank, then raised there
            # a UserError says what is wrong; name the others' type (MemoryError)
            plain = str(e) and isinstance(e, (UserError, ValueError, RuntimeError, OSError))
            result, error = None, str(e) if plain else f"{type(e).__name__}: {e}"
        errors = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(errors, error, group=self.group)
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if failed:
            r, e = failed[0]
            if dist.get_rank(self.group) != 0:
                # wait here until rank 0 has printed the message and exited (the barrier then
                # fails), so that torchrun does not tear rank 0 down before it says why
                try:
                    dist.barrier(group=self.group)
                except Exception:  # noqa: BLE001: rank 0 is gone, as expected
                    pass
            more = f" (and {len(failed) - 1} more rank{'s' * (len(failed) > 2)})" if len(failed) > 1 else ""
            raise TPError(f"rank {r}{more}: {e}")
        return result

    def same_seed(self, seed: Optional[int]) -> int:
        """One sampling seed for every rank (rank 0's), so that every rank samples the same tokens."""
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()).item())
        t = torch.tensor([seed], dtype=torch.int64, device=self.device)  # nccl sends only CUDA tensors
        dist.broadcast(t, 0, group=self.group)
        return int(t.item())

    def gather(self, value) -> list:
        """value from every rank, in rank order (e.g. per-rank memory for the metrics)."""
        out = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, value, group=self.group)
        return out

    def rank_metrics(self, metrics: dict, model: nn.Module) -> dict:
        """Per-rank memory and weights, and what a decode step sends: the collectives that
        shard_modules hooked in, each of (batch, 1, width) activations (a collective on every
        rank: call it on all of them)."""
        elem = model.norm.weight.element_size()  # activations are in the model dtype
        batch = model.max_batch_size

        def count(kind):
            widths = [w for k, w in model.tp_collectives if k == kind]
            return len(widths), batch * sum(widths) * elem

        (n_reduce, reduce_bytes), (n_gather, gather_bytes) = count("all_reduce"), count("all_gather")
        return {
            "tp_world_size": self.world_size,
            "tp_mode": model.tp_mode,
            "peak_memory_bytes_per_rank": self.gather(metrics["peak_memory_bytes"]),
            "weight_bytes_per_rank": self.gather(sum(sharded_bytes(model))),
            # peak RSS also counts the checkpoint's memory-mapped pages that a rank touched
            # (reclaimable page cache); anonymous memory is what the rank itself holds
            "rss_anon_bytes_per_rank": self.gather(rss_anon_bytes()),
            "all_reduces_per_step": n_reduce,
            "all_reduce_bytes_per_step": reduce_bytes,
            "all_gathers_per_step": n_gather,
            "all_gather_bytes_per_step": gather_bytes,  # what each rank receives, padding included
        }


def init_from_env(device: str = "cpu", mode: str = "auto") -> tuple[Optional[TensorParallel], str]:
    """(TensorParallel, device) when launched by torchrun, else (None, device).

    Reads torchrun's standard environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
    MASTER_PORT), so it runs across nodes as well: gloo on CPU, nccl on CUDA with one device per
    local rank. Ranks other than 0 print nothing but their own crash. A lost rank or host ends the
    others within seconds, with one line naming it (watch_peers). One rank (torchrun
    --nproc_per_node=1) runs the same path with whole shards: a baseline for N > 1."""
    if "WORLD_SIZE" not in os.environ:
        return None, device
    # a rank that crashes below Python (SIGABRT, SIGSEGV), joining the group included, names its Python line
    faulthandler.enable(sys.__stderr__)
    if os.environ.get("MINILLM_TP_STACKS") == "1":  # where a rank was when torchrun ended the job (tests)
        faulthandler.register(signal.SIGTERM, file=sys.__stderr__, all_threads=True, chain=True)
    world = int(os.environ["WORLD_SIZE"])
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    cuda = device.startswith("cuda")
    if cuda:
        if local_rank >= torch.cuda.device_count():
            raise UserError(f"rank {rank} needs cuda:{local_rank}, but this machine has "
                            f"{torch.cuda.device_count()} CUDA device(s): lower --nproc_per_node")
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        # the timeout bounds how long a rank waits in a collective for one that died
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=TIMEOUT_S),
                                device_id=torch.device(device) if cuda else None)
    atexit.register(close)
    if rank != 0:
        quiet()
    if world > 1:
        watch_peers(rank, world)
    return TensorParallel(rank, world, device=device, mode=mode), device


def watch_peers(rank: int, world: int):
    """Heartbeats through a client of this rank's own to the job's store (liveness.py): a lost rank
    or host ends every other rank in seconds with one line, not the collectives' TIMEOUT_S."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=liveness.LOST_S),
                          wait_for_workers=False)
    # torchrun's store outlives a restart of the workers: each attempt counts afresh
    attempt = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'job')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    liveness.start(store, rank, world, host, port, prefix=f"minillm/liveness/{attempt}")


def all_ranks(flag: bool) -> bool:
    """Whether flag holds on every rank: every rank calls it at the same point of its steps."""
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def close():
    """Destroy the process group, before the interpreter finalizes (init_from_env registers this
    at exit). The group's worker threads stop when its last reference goes, so TensorParallel
    keeps only its name: a gloo worker still alive at finalization, freeing a finished collective's
    tensors, asks the finalizing interpreter for the GIL, is ended by pthread_exit, and that
    unwinding through the tensors' noexcept destructor aborts the process ("terminate called
    without an active exception")."""
    liveness.stop()  # first: a rank that ends on purpose is no lost rank
    if dist.is_initialized():
        dist.destroy_process_group()


def quiet():
    """Only rank 0 prints: silence this rank's stdout and stderr, but still show its crash."""
    rank = dist.get_rank() if dist.is_initialized() else os.environ.get("RANK", "?")
    err = sys.__stderr__

    def excepthook(kind, value, tb):
        if not issubclass(kind, (TPError, KeyboardInterrupt)):  # TPError: rank 0 already says which rank
            import traceback
            err.write(f"[rank {rank}] " + "".join(traceback.format_exception(kind, value, tb)))
            err.flush()

    sys.excepthook = excepthook
    sys.stdout = sys.stderr = open(os.devnull, "w")


def rss_anon_bytes() -> Optional[int]:
    """This process's anonymous resident memory now (Linux), without file-backed pages."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def sharded_bytes(model: nn.Module, tp: Optional[TensorParallel] = None) -> tuple[int, int]:
    """(bytes in the tensors that the plan shards, bytes in the replicated ones) of a model: with
    tp, of this rank's loaded shard; the sharded part is 1/N of the single-process one when the
    heads and the hidden dimension divide evenly."""
    sharded = set()
    for name, module in model.named_modules():
        if plan_kind(name) is not None and (tp is None or name in tp.shards):
            sharded.update(id(t) for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)))
    buffers = [b for n, b in model.named_buffers() if "cache" not in n and "inv_freq" not in n]  # weights only
    tensors = {id(t): t for t in list(model.parameters()) + buffers}
    nbytes = lambda ids: sum(t.numel() * t.element_size() for i, t in tensors.items() if i in ids)  # noqa: E731
    return nbytes(sharded), nbytes(set(tensors) - sharded)


def ranks_on_this_machine() -> int:
    """Ranks that torchrun started on this machine (LOCAL_WORLD_SIZE): on CPU they share its memory."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
