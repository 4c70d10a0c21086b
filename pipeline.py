"""Pipeline parallelism: `--pp N` under torchrun splits the layers into N stages, each rank holding
one stage's layers (the embedding on the first, the final norm and the head on the last), reading
only their weights from the checkpoint and keeping a KV cache for them alone.

    torchrun --standalone --nproc_per_node=2 generate.py --checkpoint checkpoints/smollm2-135m --pp 2 --prompt "Hi"

It combines with tensor parallelism: world = tp x pp, and rank = stage * tp + tp_rank, so each
stage's tp ranks are consecutive and form that stage's own tensor-parallel group (tp.py shards the
stage's layers over it). Rank r of one stage hands its hidden states to rank r of the next.

Every rank runs every step, as under tensor parallelism (the same plans, in the same order): the
first stage embeds the tokens and runs its layers, each stage sends its output (B, T, dim) to the
next, and the last stage computes the logits and broadcasts what the step returns to its rank of
every stage (forwards.shared): the tokens it sampled where the step samples (8 bytes a row), else
the logits (a row's vocabulary in float32), so that every engine's scheduler stays in lockstep. One
step runs the stages in turn: a stage waits while the others compute.

Decoding groups (--pp_groups G, default N) keep every stage busy while decoding. The engine splits
the decoding requests into up to G groups (Stage.group_rows) and leaves each group's step in flight
(Engine.step): while the last stage runs group A's step t, the first stage runs group B's step t,
and it collects A's tokens (the last stage's broadcast) just before A's step t + 1 needs them.
Every rank still runs the same plans in the same order; it only waits later for a step's tokens.
A step is not split: the gain comes from more requests in flight, not from smaller steps. A decode
step is bound by its weight reads, so a group's step costs about what a step of every request
costs; with G groups, each as large as one lockstep step's rows, G times the requests decode in
about the time one lockstep step took. A group has two rows or more, and no product of its step
takes another kernel path than in a step of every decoding request, so the text stays one
process's.

With --microbatches M, a step of many tokens (a batch of prompts) goes through the stages in up to
M parts of its rows: each stage sends a part on and starts the next while the next stage runs it.
A decode step is not split: bound by its weight reads, in parts it would read every weight once a
part. A part keeps every product on the whole step's kernel path, so the text stays one process's.

The exchanges are broadcasts in groups of two ranks (one stage's rank and the next's) and in each
pipe (a tp_rank's rank of every stage), through functional collectives that torch.compile traces
into the compiled step as it does tp.py's, so the compiled step needs no graph break. A decode
step's result is shared after its compiled graph (the engine calls forwards.shared), where the
exchange can stay in flight: a traced collective is waited for inside the graph.
"""
import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn

import kernels
import tp as tensor_parallel
from errors import TPError, UserError
from kvcache import ForwardBatch
from model import Transformer
from thresholds import THRESHOLDS
from tp import TensorParallel, split_evenly


# a decode step is bound by its weight reads, and in parts each stage reads its weights once a part;
# a part of this many tokens is bound by its arithmetic instead (an estimate: no machine here gives
# each rank a core of its own to measure the overlap on)
MICROBATCH_MIN_TOKENS = 256
# token counts at which a product changes path (kernels.py, qlayers.py): a part must not cross one
TOKEN_LIMITS = (THRESHOLDS.onednn_min_tokens, THRESHOLDS.onednn_min_tokens_bf16, THRESHOLDS.tile_max_tokens,
                THRESHOLDS.linear_max_tokens, THRESHOLDS.loop_max_tokens, THRESHOLDS.expert_loop_max_slots)


@dataclass
class Stage:
    """This rank's place in the pipeline, and the groups (by name) it exchanges activations in."""
    index: int  # 0 .. stages - 1
    stages: int
    tp_rank: int  # within the stage's tensor-parallel group
    tp_size: int
    tp_group: str  # the stage's ranks
    prev: Optional[str]  # this rank and the previous stage's rank of the same tp_rank (it sends)
    next: Optional[str]  # this rank and the next stage's (this rank sends)
    pipe: str  # this tp_rank's rank of every stage, in stage order: the last one sends the logits
    first_layer: int = 0  # set by shard_modules from the model's layer count
    n_layers: int = 0
    microbatches: int = 1  # a step's rows go through the stages in up to this many parts
    groups: int = 1  # decoding requests in up to this many groups, whose steps are in flight at once

    def parts(self, rows: int, tokens: int, last: bool) -> list:
        """(first row, rows) of each micro-batch of a step of `rows` rows of `tokens` tokens (last:
        the last layer takes one token a row): the most that microbatches allows with at least two
        rows and MICROBATCH_MIN_TOKENS tokens each, where no product takes another path than the
        whole step's (kernels.py gives a row the same bits beside any rows on one path, not across
        paths, nor alone); else one part."""
        for n in range(min(self.microbatches, rows // 2), 1, -1):
            least = rows // n
            if least * tokens >= MICROBATCH_MIN_TOKENS and not any(
                    least * t <= v <= rows * t for v in TOKEN_LIMITS for t in {tokens, 1 if last else tokens}):
                return [split_evenly(rows, n, i) for i in range(n)]
        return [(0, rows)]

    def group_rows(self, running: int, limits: tuple = TOKEN_LIMITS) -> int:
        """The decoding rows a step takes of `running` requests: a group's share, in the most groups
        (up to `groups`) of two rows or more each where no product takes another path than in a step
        of them all (limits: token counts at which one changes path); else all of them."""
        for n in range(min(self.groups, running // 2), 1, -1):
            rows = -(-running // n)
            least = running - (n - 1) * rows
            if least >= 2 and not any(least <= v <= running for v in limits):
                return rows
        return running

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.stages - 1

    # ---------------------------------------------------------------- the stage's part of the model

    def shard_modules(self, model: Transformer):
        """On the meta-device model: keep this stage's layers (and the embedding on the first, the
        head on the last), and make its forward the stage's (StageTransformer)."""
        args = model.args
        if args.n_layers < self.stages:
            raise UserError(f"--pp {self.stages}: the model has only {args.n_layers} layers, fewer than the stages")
        if len({layer.attention.sliding for layer in model.layers}) > 1:
            # each engine sizes its sliding-window pools by the kinds of layers it holds: the stages' would differ
            raise UserError("--pp does not split a model that mixes sliding-window and full-attention layers")
        self.first_layer, self.n_layers = split_evenly(args.n_layers, self.stages, self.index)
        model.layers = nn.ModuleList(list(model.layers)[self.first_layer:self.first_layer + self.n_layers])
        tied = args.tie_word_embeddings
        if not self.first and not (self.last and tied):  # a tied head's weight is the embedding's
            model.tok_embeddings = None
        if not self.last:
            model.output = None
        model.args = dataclasses.replace(args, tie_word_embeddings=tied and self.last)
        model.__class__ = StageTransformer
        model.stage = self

    def local_name(self, name: str, held: set) -> Optional[str]:
        """A checkpoint tensor's name in this stage's model (its layers numbered from 0), or None
        when the stage does not hold it; held: the stage's top-level modules."""
        part, _, rest = name.partition(".")
        if part == "layers":
            index, _, tail = rest.partition(".")
            if not index.isdigit():
                return name  # not a layer's: the checkpoint's names are checked as usual
            local = int(index) - self.first_layer
            return f"layers.{local}.{tail}" if 0 <= local < self.n_layers else None
        return name if part in held or part not in ("tok_embeddings", "output") else None

    # ---------------------------------------------------------------- the exchanges

    def receive(self, shape: tuple, dtype: torch.dtype, device) -> Tensor:
        """The previous stage's output."""
        return funcol.wait_tensor(funcol.broadcast(torch.empty(shape, dtype=dtype, device=device), 0, self.prev))

    def send(self, x: Tensor) -> Tensor:
        """Start sending x to the next stage; wait_tensor on the result waits until it is sent (a
        compiled graph could drop a collective whose result nothing waits on)."""
        return funcol.broadcast(x.contiguous(), 0, self.next)

    def share(self, out: Tensor, wait: bool = True) -> Tensor:
        """The last stage's out (logits or tokens), on every stage; wait=False: in flight, an
        AsyncCollectiveTensor that its first use waits for (eager only: a traced one is waited)."""
        out = funcol.broadcast(out.contiguous(), self.stages - 1, self.pipe)
        return funcol.wait_tensor(out) if wait else out


class StageTransformer(Transformer):
    """A Transformer that holds one stage's layers (Stage.shard_modules makes it): its forward takes
    the previous stage's hidden states in place of the embedding, hands its own to the next, and
    returns the last stage's logits, which every stage receives."""
    stage: Stage

    def forward(self, tokens: Tensor, batch) -> Tensor:
        batch = self.forward_batch(tokens, batch)
        stage, (B, T) = self.stage, tokens.shape
        outputs, sent = [], []
        # micro-batches: while the next stage runs one part, this one runs the next part
        for first, rows in stage.parts(B, T, batch.last is not None):
            part = rows_of(batch, first, rows)
            if stage.first:
                x = self.embed(tokens[first:first + rows])
            else:
                x = stage.receive((rows, T, self.args.dim), self.norm.weight.dtype, tokens.device)  # (rows, T, dim)
            x = self.blocks(x, part, part.last if stage.last else None)  # the next stage needs every token
            if stage.last:
                outputs.append(x)
            else:
                sent.append(stage.send(x))
        if stage.last:
            return self.head(torch.cat(outputs) if len(outputs) > 1 else outputs[0], batch)
        for x in sent:
            funcol.wait_tensor(x)
        rows = B if batch.logit_rows is None else batch.logit_rows.shape[0]
        # a stand-in for the logits, which the last stage alone computes: what follows (sampling)
        # runs on it, and share() replaces the result by the last stage's
        return tokens.new_zeros(rows, T if batch.last is None else 1, self.args.vocab_size, dtype=torch.float32)

    def share(self, out: Tensor, wait: bool = True) -> Tensor:
        """The last stage's result of a forward (its logits, or the tokens sampled from them), on every stage."""
        return self.stage.share(out, wait)

    @property
    def groups(self) -> int:
        return self.stage.groups

    def group_rows(self, running: int) -> int:
        """Stage.group_rows at the token counts where the products of one-token rows change path in
        this model's dtype (not at the other dtype's oneDNN threshold)."""
        dtype = self.norm.weight.dtype
        limits = (kernels.onednn_min_tokens(dtype), kernels.compiled_onednn_min_tokens(dtype),
                  THRESHOLDS.linear_max_tokens, THRESHOLDS.loop_max_tokens, THRESHOLDS.expert_loop_max_slots)
        return self.stage.group_rows(running, limits)


def rows_of(batch: ForwardBatch, first: int, rows: int) -> ForwardBatch:
    """The ForwardBatch of rows first .. first + rows - 1 of batch, every logit row's (the head runs
    on the parts' outputs together)."""
    if rows == batch.positions.shape[0]:
        return dataclasses.replace(batch, logit_rows=None)
    cut = lambda t: None if t is None else t[first:first + rows]  # noqa: E731
    return dataclasses.replace(batch, positions=cut(batch.positions), slots=cut(batch.slots),
                               block_table=cut(batch.block_table), last=cut(batch.last), logit_rows=None,
                               window_slots=cut(batch.window_slots), window_table=cut(batch.window_table))


class StageFile:
    """A checkpoint file (safetensors' safe_open) as one stage reads it: its layers' tensors under
    the stage's layer numbers, the embedding and head where it holds them, and no other tensor."""

    def __init__(self, f, stage: Stage, held: set):
        self.f = f
        self.names = {}  # the stage's name -> the file's
        for name in f.keys():
            local = stage.local_name(name, held)
            if local is not None:
                self.names[local] = name

    def keys(self):
        return list(self.names)

    def get_slice(self, name: str):
        return self.f.get_slice(self.names[name])

    def get_tensor(self, name: str) -> Tensor:
        return self.f.get_tensor(self.names[name])


class StageParallel(TensorParallel):
    """A rank of a pipeline stage: tp.py's tensor parallelism over the stage's own group (its shard of
    the stage's layers), and agreement (a failed load, the seed, the metrics) over every rank."""

    def __init__(self, stage: Stage, device="cpu", mode: str = "auto"):
        super().__init__(stage.tp_rank, stage.tp_size, stage.tp_group, device=device, mode=mode)
        self.stage = stage
        self.held: set = set()  # the stage model's top-level modules, set by shard_modules

    @property
    def group(self) -> dist.ProcessGroup:
        return dist.group.WORLD

    def shard_modules(self, model: nn.Module):
        self.stage.shard_modules(model)
        self.held = {name for name, module in model.named_children() if module is not None}
        super().shard_modules(model)

    def view(self, f) -> StageFile:
        return StageFile(f, self.stage, self.held)

    def read(self, f: StageFile, name: str) -> Tensor:
        try:
            return super().read(f, name)
        except TPError as e:  # named as the checkpoint names it, not by the stage's layer numbers
            raise TPError(str(e).replace(name, f.names[name], 1)) from None

    def rank_metrics(self, metrics: dict, model: nn.Module) -> dict:
        out = super().rank_metrics(metrics, model)
        out.update(pp_stages=self.stage.stages, pp_groups=self.stage.groups,
                   layers_per_rank=self.gather(len(model.layers)))
        return out


def init_from_env(device: str = "cpu", mode: str = "auto", stages: int = 1, microbatches: int = 1,
                  groups: Optional[int] = None) -> tuple[Optional[TensorParallel], str]:
    """tp.init_from_env, and with stages > 1 this rank's StageParallel in place of its TensorParallel,
    its steps in up to `microbatches` parts, its decoding requests in up to `groups` (default stages)."""
    tp, device = tensor_parallel.init_from_env(device, mode)
    if stages == 1:
        return tp, device
    if tp is None:
        raise UserError(f"--pp {stages} runs under torchrun, with a multiple of {stages} ranks (world = tp x pp)")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % stages:
        raise UserError(f"--pp {stages} does not divide the {world} ranks torchrun started (world = tp x pp)")
    stage = make_stage(rank, world, stages)
    stage.microbatches, stage.groups = microbatches, groups or stages
    return StageParallel(stage, device, mode), device


def make_stage(rank: int, world: int, stages: int) -> Stage:
    """This rank's Stage; every rank creates every group, in the same order (dist.new_group's rule)."""
    width = world // stages  # tp: ranks per stage
    index, tp_rank = divmod(rank, width)
    names = {}

    def group(key, ranks: list):
        g = dist.new_group(ranks)
        if rank in ranks:
            names[key] = g.group_name

    for s in range(stages):
        group(("tp", s), [s * width + r for r in range(width)])
    for s in range(stages - 1):
        for r in range(width):
            group(("pair", s), [s * width + r, (s + 1) * width + r])
    for r in range(width):
        group("pipe", [s * width + r for s in range(stages)])
    return Stage(index, stages, tp_rank, width, names[("tp", index)], names.get(("pair", index - 1)),
                 names.get(("pair", index)), names["pipe"])


def leads() -> bool:
    """Whether this process writes the run's files: a lone process, or torchrun's rank 0."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
