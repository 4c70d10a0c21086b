"""What speculative decoding (speculative.py) verifies: a proposer's guess of the next k tokens.

Proposers:
- `DraftProposer`: a smaller (or quantized) model with the same tokenizer, its own KV cache and
  its own compiled one-token step; it drafts k tokens one at a time.
- `NgramProposer` (prompt lookup): the last N tokens of prompt + output are looked up in
  everything before them; the k tokens that followed their most recent earlier occurrence are the
  proposal. With no match of N tokens, N - 1, ..., down to `min_n` are tried; with no match at
  all, the round is a plain one-token decoding step of the target (no proposal, no verify).
  A match near the end is continued by copying what it proposes itself (as LZ77 does), so
  a repeating pattern still yields k tokens.
- `SuffixProposer` (SuffixDecoding, Oliaro et al. 2024): the most frequent continuation of the
  longest suffix seen earlier in the prompt, the output, or earlier calls' prompts and outputs,
  counted in a trie (suffix.py); it proposes nothing where no continuation is likely enough.
"""
import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import Tensor

from compile import compile_step
from errors import UserError
from grammar import allow_tokens
from kvcache import ForwardBatch
from model import Transformer
from sampling import Sampling, logits_to_probs, sample_probs
from spec_cost import ChainThreshold
from suffix import SuffixIndex
from tree import Tree


def draft_chunk(model: Transformer, tokens: list, start: int):
    """A draft's chunk (a prompt, the target's forced tokens) through its cache at start: its keys only."""
    device = model.norm.weight.device
    positions = torch.arange(start, start + len(tokens), device=device).view(1, -1)
    batch = ForwardBatch.rows(positions, 1, model.max_seq_length, kv_len=start + len(tokens),
                              last=torch.full((1, 1), len(tokens) - 1, device=device))
    model(torch.tensor([tokens], device=device), batch)


def draft_one_token(model: Transformer, cur: Tensor, input_pos: Tensor, sampling: Optional[Sampling]):
    """One draft decode step: (next id (1, 1), its distribution q (1, V) or None when greedy, the
    draft's probability of that id (1, 1)); with sampling None its logits (1, V), which a grammar
    masks on the host."""
    logits = model(cur, input_pos)[:, -1]  # (1, V)
    if sampling is None:
        return logits
    if sampling.temperature == 0:
        token = logits.argmax(-1, keepdim=True)
        return token, None, logits.float().softmax(-1).gather(-1, token)
    q = logits_to_probs(logits, sampling)
    token = sample_probs(q)
    return token, q, q.gather(-1, token)


def common_prefix(a: list, b: list) -> int:
    lo, hi = 0, min(len(a), len(b))  # slices compare in C: a binary search over their length
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


# ---------------------------------------------------------------- proposers

class Proposer(ABC):
    """What SpeculativeEngine asks of a proposer. Each generate call: start(context) once, then
    per round propose(context, k) (propose_on_host(context, k, sampling, constraint) when the
    engine picks on the host) and accepted(n). context is every token so far, by position; its
    last token (after a grammar's forced tokens, its last few) has not been through the target yet."""

    name: str = "proposer"
    model: Optional[Transformer] = None  # a proposer that runs a model names it (its bytes count as read)
    forwards: int = 0  # model forwards so far
    cheap: bool = True  # a proposal costs nothing next to a target step (a lookup, not a model)

    def adapt(self, on: bool):
        """Whether the proposer may propose fewer than asked where it is unsure (--adaptive_k)."""

    def setup(self, max_seq_length: int):
        """Allocate what the proposer keeps per position (a draft's KV cache)."""

    def warm_up(self, sampling: Sampling, host: bool = False) -> Optional[Callable]:
        """Propose eagerly until the work returned (run at once, or on a compile thread) has
        compiled any graph of the proposer's (host: the one that returns logits); the next proposal
        takes it up. None: nothing to compile."""
        return None

    @abstractmethod
    def start(self, context: list, sampling: Sampling):
        """A new generate call over `context`."""

    @abstractmethod
    def propose(self, context: list, k: int, sampling: Sampling) -> tuple:
        """Up to k proposed ids, and their distributions q (m, V), or None for point masses or greedy."""

    def propose_on_host(self, context: list, k: int, sampling: Sampling, constraint) -> tuple:
        """As propose, for a round the engine picks on the host, under a grammar (`constraint`, a
        grammar.Constraint left as it was, or None). Proposals drawn from distributions must be
        drawn from them masked by the grammar, so that q is what they really came from; point masses
        (this default) are proposed as usual, and the engine cuts them where the grammar objects."""
        drafts, q = self.propose(context, k, sampling)
        if q is not None and constraint is not None:
            # a proposal drawn from q unmasked would make verification accept from the wrong distribution
            raise TypeError(f"the {self.name} proposer draws from distributions: it must override "
                            "propose_on_host to propose under a grammar")
        return drafts, q

    def propose_tree(self, context: list, nodes: int, depth: int) -> Optional[Tree]:
        """Candidates for tree verification: up to `nodes` tokens at most `depth` deep after the
        context's last token (the root), checked as point masses; this default: propose's chain."""
        drafts, _ = self.propose(context, min(nodes, depth), Sampling(temperature=0))
        return Tree.from_paths(context[-1], [drafts])

    def accepted(self, n: int):
        """The target kept the first n proposals of the last round."""


class NgramProposer(Proposer):
    """Prompt lookup: propose what followed the most recent earlier occurrence of the last n tokens
    (n = max_n, then shorter, down to min_n). An index from each n-gram to where its most recent
    occurrence's continuation starts is kept up to date as the context grows."""

    name = "ngram"

    def __init__(self, max_n: int, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise UserError(f"n-gram sizes must satisfy 1 <= min_n <= max_n (got {min_n}, {max_n})")
        self.max_n, self.min_n = max_n, min_n
        self.start([])

    def start(self, context: list, sampling: Optional[Sampling] = None):
        self.index = {n: {} for n in range(self.min_n, self.max_n + 1)}  # n-gram -> continuation start
        self.indexed = 0

    def _extend_index(self, context: list):
        for j in range(self.indexed, len(context)):  # j: a continuation start, so j <= len - 1
            for n in self.index:
                if j >= n:
                    self.index[n][tuple(context[j - n:j])] = j
        self.indexed = len(context)

    def propose(self, context: list, k: int, sampling: Sampling) -> tuple:
        """Up to k proposed ids (none when nothing matches) and q = None (a point mass)."""
        matches = self.matches(context)
        return (self.continuation(context, matches[0], k) if matches else []), None

    def matches(self, context: list) -> list:
        """Where the continuation of the last n tokens' most recent earlier occurrence starts, for
        every n that matches, longest first."""
        self._extend_index(context)
        length = len(context)
        found = (self.index[n].get(tuple(context[length - n:])) for n in range(min(self.max_n, length - 1),
                                                                               self.min_n - 1, -1))
        return [start for start in found if start is not None]

    @staticmethod
    def continuation(context: list, start: int, k: int) -> list:
        out, length = [], len(context)
        for i in range(k):  # past the end of the context, copy what we proposed (LZ77-style)
            out.append(context[start + i] if start + i < length else out[start + i - length])
        return out

    def propose_tree(self, context: list, nodes: int, depth: int) -> Optional[Tree]:
        """The continuations of every matching n-gram (longest first), merged into one tree, cut
        to its first `nodes` candidates."""
        tree = Tree.from_paths(context[-1], [self.continuation(context, start, depth)
                                             for start in dict.fromkeys(self.matches(context))])
        return Tree(tree.tokens[:nodes + 1], tree.parents[:nodes + 1])


class SuffixProposer(Proposer):
    """Follow the most frequent continuation of the context's longest suffix seen before, in this
    call's prompt and output and in earlier calls' (kept up to a cap of tokens: `SuffixIndex`)."""

    name = "suffix"

    def __init__(self, **options):
        try:
            self.index = SuffixIndex(**options)
        except ValueError as e:
            raise UserError(str(e)) from None

    def start(self, context: list, sampling: Optional[Sampling] = None):
        self.index.start(context)

    def propose(self, context: list, k: int, sampling: Sampling) -> tuple:
        """Up to k proposed ids (none when no continuation is likely enough) and q = None (a point mass)."""
        return self.index.continuation(context, k), None

    def propose_tree(self, context: list, nodes: int, depth: int) -> Optional[Tree]:
        tokens, parents = self.index.continuations(context, nodes, depth)
        return Tree([context[-1]] + tokens, [-1] + [p + 1 for p in parents])


class DraftProposer(Proposer):
    """A draft model with its own KV cache and compiled one-token step. `fed` lists the tokens
    whose keys and values are in its cache, by position."""

    name = "draft"
    cheap = False

    def __init__(self, model: Transformer, compile: bool = False, compile_mode: str = "default"):
        self.model = model
        self.threshold: Optional[ChainThreshold] = None  # threshold drafting, when adapting
        self.device = model.norm.weight.device  # (a quantized embedding has no .weight)
        self.step = draft_one_token
        if compile:
            self.step = compile_step(draft_one_token, model, compile_mode)
        self.fed: list = []
        self.ready: Optional[Callable] = None  # the step compiled aside, until a proposal takes it up

    def setup(self, max_seq_length: int):
        if self.model.max_batch_size != 1 or self.model.max_seq_length != max_seq_length:
            self.model.setup_caches(1, max_seq_length)
            self.fed = []

    def _one(self, token, pos: int, sampling: Sampling):
        cur = token if isinstance(token, Tensor) else torch.tensor([[token]], device=self.device)
        self.forwards += 1
        # clone: under CUDA graphs the next replay overwrites the previous step's outputs
        tok, q, prob = self.step(self.model, cur, torch.tensor([pos], device=self.device), sampling)
        return tok.clone(), (None if q is None else q.clone()), prob.clone()

    def _logits(self, token: int, pos: int) -> Tensor:
        """The draft's logits (1, V) after `token` at cache slot pos."""
        self.forwards += 1
        return self.step(self.model, torch.tensor([[token]], device=self.device),
                         torch.tensor([pos], device=self.device), None).clone()

    def warm_up(self, sampling: Sampling, host: bool = False) -> Callable:
        compiled, self.step = self.step, draft_one_token

        def work():  # (under inference mode: inference tensors, as a step's inputs are)
            token = torch.zeros((1, 1), dtype=torch.long, device=self.device)
            pos = torch.zeros(1, dtype=torch.long, device=self.device)
            for _ in range(2):  # the compiled graph runs from the second call on; slot 0 then holds garbage
                compiled(self.model, token, pos, None if host else sampling)
            self.ready = compiled
        return work

    def take_up(self, context: list):
        """The step warm_up compiled, once ready; its work wrote slot 0, so the draft starts over."""
        if self.ready is not None:
            self.step, self.ready, self.fed = self.ready, None, []
            self.start(context, None)

    def start(self, context: list, sampling: Sampling):
        """Prefill the draft with context[:-1], reusing what its cache already holds (chat turns)."""
        keep = min(common_prefix(self.fed, context), len(context) - 1)
        del self.fed[keep:]
        chunk = context[keep:-1]
        if chunk:
            draft_chunk(self.model, chunk, keep)
            self.fed.extend(chunk)

    def adapt(self, on: bool):
        self.threshold = ChainThreshold() if on else None

    def catch_up(self, context: list):
        """Feed what the draft has not seen but the last token (the target's tokens: after a fully
        accepted block also the last proposal, after plain steps each of theirs) as one chunk."""
        missing = context[len(self.fed):-1]
        if missing:
            self.forwards += 1
            draft_chunk(self.model, missing, len(self.fed))
            self.fed.extend(missing)

    def unsure(self, chain: float) -> bool:
        """Threshold drafting: whether the chain drafted so far, of this probability, ends here."""
        return self.threshold is not None and float(chain) < self.threshold.value  # (a sync only when drafting so)

    def propose(self, context: list, k: int, sampling: Sampling) -> tuple:
        """Up to k drafted ids (k unless threshold drafting stops sooner) and their distributions
        q (m, V) (None when greedy)."""
        self.take_up(context)
        self.catch_up(context)
        tok, q, chain = self._one(context[-1], len(self.fed), sampling)
        self.fed.append(context[-1])
        self.first_draft_slot = len(self.fed)
        toks, qs = [tok], [q]
        for i in range(k - 1):
            if self.unsure(chain):
                break
            tok, q, prob = self._one(tok, self.first_draft_slot + i, sampling)
            toks.append(tok)
            qs.append(q)
            chain *= prob
        drafts = torch.cat(toks).view(-1).tolist()
        self.fed.extend(drafts[:-1])  # the last proposal was not fed
        return drafts, (None if sampling.temperature == 0 else torch.cat(qs))

    def propose_on_host(self, context: list, k: int, sampling: Sampling, constraint) -> tuple:
        """Up to k ids drafted from the draft's logits masked by the grammar, and the distributions
        they were drawn from (k, V) (None when greedy: masked argmax); up to where the grammar
        completes. (Where it forces tokens the engine inserts its own, and skips these proposals.)"""
        self.take_up(context)
        self.catch_up(context)  # the target's new tokens: a sampled one and any a grammar forced
        logits = self._logits(context[-1], len(self.fed))
        self.fed.append(context[-1])
        self.first_draft_slot = len(self.fed)
        drafts, qs, chain = [], [], 1.0
        for i in range(k):
            if i:
                if self.unsure(chain):
                    break
                logits = self._logits(drafts[-1], self.first_draft_slot + i - 1)
            x = logits.float()
            if constraint is not None:
                x = allow_tokens(x, [constraint])
            if sampling.temperature == 0:
                drafts.append(x.argmax(-1).item())
                chain *= x.softmax(-1)[0, drafts[-1]].item()
            else:
                qs.append(logits_to_probs(x, sampling))
                drafts.append(sample_probs(qs[-1]).item())
                chain *= qs[-1][0, drafts[-1]].item()
            if constraint is not None:
                constraint.accept(drafts[-1])
                if constraint.done():
                    break
        if constraint is not None:
            constraint.rollback(len(drafts))
        self.fed.extend(drafts[:-1])  # the last proposal was not fed
        return drafts, (torch.cat(qs) if qs else None)

    def accepted(self, n: int):
        """n of the last proposals were kept: forget the rest."""
        if self.threshold is not None:
            self.threshold.update(len(self.fed) + 1 - self.first_draft_slot, n)  # the last one was not fed
        del self.fed[self.first_draft_slot + n:]


# ---------------------------------------------------------------- a draft's tokenizer

def tokenizer_fingerprint(checkpoint_dir) -> tuple:
    """What decides token ids: tokenizer.json's model (vocab, merges) and added tokens, or the
    bytes of tokenizer.model. Two checkpoints can share a draft only when these are equal."""
    directory = Path(checkpoint_dir)
    if (directory / "tokenizer.json").is_file():
        spec = json.loads((directory / "tokenizer.json").read_text())
        added = sorted((t.get("id"), t.get("content")) for t in spec.get("added_tokens") or [])
        return "tokenizer.json", json.dumps(spec.get("model"), sort_keys=True), added
    if (directory / "tokenizer.model").is_file():
        return "tokenizer.model", (directory / "tokenizer.model").read_bytes()
    return None, None


def check_same_tokenizer(target_dir, draft_dir):
    if not Path(draft_dir).is_dir():
        raise UserError(f"draft checkpoint directory {draft_dir} does not exist")
    target, draft = tokenizer_fingerprint(target_dir), tokenizer_fingerprint(draft_dir)
    if draft[0] is None:
        raise UserError(f"draft checkpoint {draft_dir} has no tokenizer.json or tokenizer.model")
    if target != draft:
        raise UserError(f"the draft {draft_dir} and the target {target_dir} have different tokenizers; "
                        "a draft must share the target's vocabulary")
