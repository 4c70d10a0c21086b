"""A draft model's proposals for the server's batched step (serve.py --speculative draft,
speculation.py). The draft keeps a KV cache of its own: R rows of max_seq_length slots, laid out
as model.setup_caches(R, L) lays them out (row b in slots b * L .., one block a row, as
ForwardBatch.rows addresses them), R the server's --max_batch_size. A speculating request holds a
row while it runs (none free: it is not asked that step) and the list of tokens fed into it.

Each step, for the requests asked: a row first catches up on the tokens it has not seen (one
chunk forward per request: a prompt, or the target's tokens since its last proposals), then the
draft drafts for all of them together, one batched one-token forward per proposal depth, each
row at its own position. Greedy: the draft's argmax; sampling: a draw from q, the draft's
distribution under the request's own Sampling (sampling.logits_to_probs), which the verify needs
for exact rejection sampling (Leviathan et al. 2023). A rejected proposal's key stays in the row
past what the target accepted; `fed` says so, and the next catch-up writes over it.

The forwards run eagerly: a draft is small, and a compiled graph per row count would compile
while serving.
"""
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from kvcache import ForwardBatch
from model import Transformer
from proposers import common_prefix
from sampling import logits_to_probs, sample_probs
from spec_cost import running_mean


@dataclass(eq=False)
class DraftRow:
    index: int  # its slots: index * max_seq_length onwards
    fed: list = field(default_factory=list)  # the tokens whose keys and values are in it, by position


class DraftRows:
    """A draft model, its cache of `rows` rows, and which request holds which row."""

    def __init__(self, model: Transformer, rows: int, max_seq_length: int):
        model.setup_caches(rows, max_seq_length)
        self.model, self.length = model, max_seq_length
        self.device = model.norm.weight.device  # (a quantized embedding has no .weight)
        self.free = list(range(rows))  # rows no request holds
        self.held: dict = {}  # request -> DraftRow
        self.seconds: Optional[float] = None  # one batched drafting forward, a running mean
        self.forwards = 0

    def release(self, req):
        """req ended: its row goes back."""
        row = self.held.pop(req, None)
        if row is not None:
            self.free.append(row.index)

    def row(self, req) -> Optional[DraftRow]:
        if req not in self.held and self.free:
            self.held[req] = DraftRow(self.free.pop(0))
        return self.held.get(req)

    def forward(self, tokens: list, positions: list, rows: list, last: Optional[Tensor] = None) -> Tensor:
        """tokens (B, T) at positions (B, T), row b of the batch in draft row rows[b]: float logits
        (B, T, V), or (B, 1, V) of `last`'s token."""
        self.forwards += 1
        pos = torch.tensor(positions, device=self.device)
        table = torch.tensor(rows, device=self.device).view(-1, 1)  # (B, 1): one block a row
        kv_len = max(p[-1] for p in positions) + 1
        batch = ForwardBatch(pos, table * self.length + pos, table, self.length, kv_len, last=last)
        return self.model(torch.tensor(tokens, device=self.device), batch)

    def catch_up(self, row: DraftRow, context: list):
        """Feed the context but its last token, after what the row holds of it, as one chunk."""
        keep = min(common_prefix(row.fed, context), len(context) - 1)
        del row.fed[keep:]  # rejected proposals (their keys are written over)
        chunk = context[keep:-1]
        if chunk:
            last = torch.full((1, 1), len(chunk) - 1, device=self.device)  # (its logits are not needed)
            self.forward([chunk], [list(range(keep, keep + len(chunk)))], [row.index], last)
            row.fed.extend(chunk)

    @torch.inference_mode()
    def propose(self, asked: list) -> dict:
        """asked: (request, k) pairs. Each request that holds or gets a row: (up to k drafted ids,
        the distributions q (k, V) they were drawn from, or None when greedy)."""
        rows = [(req, row, k) for req, k in asked if k > 0 and (row := self.row(req)) is not None]
        if not rows:
            return {}
        for req, row, _ in rows:
            self.catch_up(row, req.known())
        start, forwards = time.perf_counter(), self.forwards
        drafts = {req: [] for req, _, _ in rows}
        qs = {req: [] for req, _, _ in rows}
        tokens = [req.last() for req, _, _ in rows]
        while rows:
            logits = self.forward([[t] for t in tokens], [[len(row.fed)] for _, row, _ in rows],
                                  [row.index for _, row, _ in rows])[:, -1]  # (B', V)
            picks = self.pick(logits, [req.sampling for req, _, _ in rows], [qs[req] for req, _, _ in rows])
            going, fed, tokens = [], tokens, []
            for (req, row, k), token_fed, token in zip(rows, fed, picks):
                row.fed.append(token_fed)
                drafts[req].append(token)
                if len(drafts[req]) < k:
                    going.append((req, row, k))
                    tokens.append(token)
            rows = going
        self.seconds = running_mean(self.seconds, (time.perf_counter() - start) / (self.forwards - forwards))
        return {req: (d, torch.cat(qs[req]) if qs[req] else None) for req, d in drafts.items()}

    @staticmethod
    def pick(logits: Tensor, samplings: list, qs: list) -> list:
        """Each row's next draft: greedy rows the argmax; sampling rows a draw from q, appended to qs[b]."""
        picks = logits.argmax(-1)
        for b, sampling in enumerate(samplings):
            if sampling is not None and sampling.temperature > 0:
                qs[b].append(logits_to_probs(logits[b:b + 1], sampling))  # (1, V)
                picks[b] = sample_probs(qs[b][-1])[0, 0]
        return picks.tolist()  # one copy to the host a depth

