"""What a step feeds the model: the two forwards it compiles (one-token rows; chunks of a
sequence), and the tensors a plan becomes (tokens, positions, block tables, slots).

A step of the same requests as the last one, each one position further, continues on the device:
its tokens are the last step's sampled ones, its positions the last ones plus one, its block
tables the last ones with what changed written in place. The host sends nothing, so that on CUDA
the next step can be launched before the last one's tokens are read back (Engine.run_ahead).
"""
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from grammar import unpack_mask
from kvcache import ForwardBatch
from model import Transformer
from sampling import StepSampling, sample_in_step


def forward_rides(model: Transformer, tokens: Tensor, positions: Tensor, block_size: int, kv_len: int,
                  logit_rows: Tensor, sampling: Optional[StepSampling] = None, mask: Optional[Tensor] = None,
                  **views) -> tuple[Tensor, Tensor]:
    """One token a row (W, 1) at its position (W, 1), reading its keys up to kv_len through its block
    table (views: block_table, and a mixed model's window_table): the logits (L, V) of rows
    logit_rows (L,), or with sampling their next tokens (L, 1); mask (L, ceil(V / 32)): the tokens a
    grammar allows. Under pipeline parallelism, this stage's result: the engine shares the last
    stage's after the step (shared), where it can leave the exchange in flight. Also the positions
    of the step after it (W, 1): in the graph, where between steps an eager add costs ~25 us."""
    # each token's slot from its table, in the graph: eager ops between steps cost ~40 us each here,
    # the caches cold after the weights streamed through them
    for table, slots in (("block_table", "slots"), ("window_table", "window_slots")):
        if table in views:
            views[slots] = views[table].gather(1, positions // block_size) * block_size + positions % block_size
    batch = ForwardBatch(positions, block_size=block_size, kv_len=kv_len, logit_rows=logit_rows, **views)
    logits = model(tokens, batch)[:, -1]  # (L, V)
    if mask is not None:
        logits = logits.masked_fill(~unpack_mask(mask, logits.shape[-1]), float("-inf"))
    return (logits if sampling is None else sample_in_step(logits, sampling)), positions + 1


def forward_chunk(model: Transformer, tokens: Tensor, positions: Tensor, block_size: int, kv_len: int,
                  fresh: bool, last: Optional[Tensor], **views) -> Tensor:
    """Chunks of B sequences (B, T), a shorter one padded at its end: the logits of each one's last
    token (B, 1, V) (last (B, 1): where that is), or of every token (B, T, V). fresh: nothing is
    cached before them; views as forward_rides'."""
    batch = ForwardBatch(positions, block_size=block_size, kv_len=kv_len, last=last, fresh=fresh, **views)
    return shared(model, model(tokens, batch))


def shared(model: Transformer, out: Tensor, wait: bool = True) -> Tensor:
    """A forward's result as every rank must see it: under pipeline parallelism the last stage's,
    sent after sampling, so that a decode step sends its rows' tokens rather than their logits.
    wait=False: it arrives meanwhile, and its first use waits for it (landed)."""
    share = getattr(model, "share", None)  # pipeline.StageTransformer's
    return out if share is None else share(out, wait)


def landed(out: Optional[Tensor]) -> Optional[Tensor]:
    """A result shared() left in flight, once it has arrived; anything else as it is."""
    return out.wait() if isinstance(out, AsyncCollectiveTensor) else out


def bucket(n: int, limit: int, smallest: int = 128) -> int:
    """n rounded up to a power of two (at least `smallest`, at most `limit`): the cache length a
    step attends over, so that a few compiled graphs serve every length."""
    b = smallest
    while b < n:
        b *= 2
    return min(b, limit)


def buckets(limit: int, smallest: int = 128) -> list:
    """Every cache length bucket() gives for lengths up to limit."""
    out = [min(smallest, limit)]
    while out[-1] < limit:
        out.append(min(2 * out[-1], limit))
    return out


@dataclass
class Rides:
    """A step's one-token rows as the forward takes them, and what the host knew of them."""
    requests: list  # the plan's requests, a row each
    positions: list  # their positions (host)
    tables: list  # their block tables (host), each (blocks, window blocks)
    kv_len: int
    inputs: dict  # tokens (W, 1), positions (W, 1), logit_rows (L,), block_table[, window_table] (device)
    following: Optional[Tensor] = None  # the next step's positions (W, 1), once this one ran (device)


class Feeder:
    """Turns plans into the forwards' tensors on one device, over the paged cache's block tables;
    released or missing blocks and padding rows read and write a scratch block (one per pool)."""

    def __init__(self, block_size: int, device: torch.device, scratch: int, window_scratch: Optional[int]):
        self.block_size, self.device = block_size, device
        self.scratch = (scratch, window_scratch)

    def table_row(self, blocks: list, n: int, group: int) -> list:
        scratch = self.scratch[group]
        return [b if b >= 0 else scratch for b in blocks[:n]] + [scratch] * (n - len(blocks[:n]))

    def views(self, rows: list, n: int, real: Optional[int] = None, slots: bool = True) -> dict:
        """rows (tokens, start, tables): ForwardBatch's block_table (R, n) and slots (R, T), and a
        mixed model's window_table and window_slots; tokens past the first `real` are padding,
        written to the scratch block. slots=False: the tables alone (forward_rides derives them)."""
        bs, out = self.block_size, {}
        for group, (table_key, slots_key) in enumerate((("block_table", "slots"), ("window_table", "window_slots"))):
            if self.scratch[group] is None:
                continue
            tables = [self.table_row(t[group], n, group) for _, _, t in rows]
            out[table_key] = torch.tensor(tables, device=self.device)
            if slots:
                scratch = self.scratch[group] * bs
                out[slots_key] = torch.tensor([[table[p // bs] * bs + p % bs if real is None or p < start + real
                                                else scratch for p in range(start, start + len(tokens))]
                                               for (tokens, start, _), table in zip(rows, tables)], device=self.device)
        return out

    def rides(self, rows: list, requests: list, wants: list, kv_len: int) -> Rides:
        """rows (token, position, tables), padding rows included; wants: the rows whose output is wanted."""
        device, n = self.device, -(-kv_len // self.block_size)
        inputs = dict(tokens=torch.tensor([[t] for t, _, _ in rows], device=device),
                      positions=torch.tensor([[p] for _, p, _ in rows], device=device),
                      logit_rows=torch.tensor(wants, device=device),
                      **self.views([([t], p, tables) for t, p, tables in rows], n, slots=False))
        return Rides(requests, [p for _, p, _ in rows], [tables for _, _, tables in rows], kv_len, inputs)

    def continues(self, last: Optional[Rides], requests: list, positions: list, kv_len: int) -> bool:
        """Whether a step of these requests at these positions can continue on the device from last."""
        return (last is not None and requests and last.kv_len == kv_len and last.requests == requests
                and all(p == q + 1 for p, q in zip(positions, last.positions[:len(requests)])))

    def next_rides(self, last: Rides, tokens: Tensor, tables: list) -> Rides:
        """The step after last (which ran), of the same rows one position further: tokens (W, 1) on
        the device (last step's sampled ones), tables (host) as they are now, written in place where they changed."""
        inputs = dict(last.inputs)
        inputs["tokens"], inputs["positions"] = tokens, last.following
        for group, table_key in enumerate(("block_table", "window_table")):
            if self.scratch[group] is None:
                continue
            table = inputs[table_key]
            for r, (old, new) in enumerate(zip(last.tables, tables)):
                if old[group] != new[group]:
                    row = self.table_row(new[group], table.shape[1], group)
                    for j, (a, b) in enumerate(zip(self.table_row(old[group], table.shape[1], group), row)):
                        if a != b:
                            table[r, j] = b
        tables = tables + last.tables[len(tables):]  # padding rows keep theirs
        return Rides(last.requests, [p + 1 for p in last.positions], tables, last.kv_len, inputs)
