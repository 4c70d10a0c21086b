"""Speculative decoding: a cheap proposer guesses up to k tokens, the target model checks them all
in one forward pass over k + 1 positions, and the output is exactly what the target alone gives.

    python generate.py --checkpoint checkpoints/qwen2.5-coder-1.5b \\
        --draft_checkpoint checkpoints/qwen2.5-coder-0.5b --speculate_k 5 --prompt "def quicksort(xs):"
    python generate.py --checkpoint checkpoints/smollm2-135m --ngram 3 --speculate_k 8 --chat \\
        --prompt "Fix the typo in this sentence: ..."

Proposers:
- `DraftProposer`: a smaller (or quantized) model with the same tokenizer, its own KV cache and
  its own compiled one-token step; it drafts k tokens one at a time.
- `NgramProposer` (prompt lookup): the last N tokens of prompt + output are looked up in
  everything before them; the k tokens that followed their most recent earlier occurrence are the
  proposal. With no match of N tokens, N - 1, ..., down to `min_n` are tried; with no match at
  all, the round is a plain one-token decoding step of the target (no proposal, no verify).
  A match near the end is continued by copying what it proposes itself (as LZ77 does), so
  a repeating pattern still yields k tokens.

Verification (`SpeculativeEngine.speculative_decode`), over [last token, d_1 .. d_k]:
- greedy: accept the longest prefix of proposals equal to the target's argmax, then the
  target's own token at the first mismatch (or after d_k): token-identical to greedy decoding.
- sampling: Leviathan et al. 2023 (Algorithm 1) / Chen et al. 2023: accept d_i with probability
  min(1, p(d_i) / q(d_i)); on rejection sample from norm(max(p - q, 0)); when all are accepted,
  sample a bonus token from p. p and q are the processed distributions (temperature, top-k,
  top-p: `generate.logits_to_probs`) of target and draft. An n-gram proposal is a point mass
  (q = one-hot): accept with probability p(d), on rejection sample from p with d removed.

How many to propose (`--adaptive_k`, on by default; `next_k`): start at 2, double after a block
accepted whole (up to --speculate_k), drop to one more than were accepted after a rejection. The
compiled verify is one dynamic graph for every block length and context length, so a short
block costs a short verify: the weights are read once either way, the arithmetic and attention
grow with the block.

KV caches: both caches are indexed by absolute position, so undoing rejected positions means not
advancing: their slots are masked causally and overwritten later. A sliding-window ring cache
(`model.RingKVCache`) cannot be rewound that way (a rejected position overwrote the slot of one
`window` positions earlier that is still needed), so the slots that speculative positions will
overwrite are saved before and put back after (`RingSnapshot`); this needs k < window.

Batch size 1 only: rows of a batch accept different numbers of tokens; larger batches are refused.
"""
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import Tensor

from generate import (Engine, Sampling, Stats, UserError, common_prefix, compile_options, log,
                      logits_to_probs)
from model import RingKVCache, Transformer, param_bytes


# ---------------------------------------------------------------- the compiled pieces

def sample_probs(probs: Tensor) -> Tensor:
    """(B, V) probabilities -> (B, 1) ids; argmax(p / Exp(1)) draws from p without a host sync."""
    return (probs / torch.empty_like(probs).exponential_(1)).argmax(-1, keepdim=True)


def verify(model: Transformer, tokens: Tensor, input_pos: Tensor, s: Sampling, kv_len: int) -> Tensor:
    """The target over [last token, d_1 .. d_m] (1, m + 1): its greedy ids (m + 1,), or its
    processed distributions (m + 1, V) when sampling. Row i predicts the token after d_i.
    kv_len: the cache slots in use, so attention skips the empty rest of the cache."""
    logits = model(tokens, input_pos, kv_len=kv_len)[0]  # (m + 1, V)
    if s.temperature == 0:
        return logits.argmax(-1)
    return logits_to_probs(logits, s)


def draft_one_token(model: Transformer, cur: Tensor, input_pos: Tensor, s: Sampling):
    """One draft decode step: (next id (1, 1), its distribution q (1, V), or None when greedy)."""
    logits = model(cur, input_pos)[:, -1]  # (1, V)
    if s.temperature == 0:
        return logits.argmax(-1, keepdim=True), None
    q = logits_to_probs(logits, s)
    return sample_probs(q), q


def residual_distribution(p: Tensor, q: Tensor) -> Tensor:
    """What to sample from after rejecting a proposal (Leviathan et al. 2023, Algorithm 1;
    Chen et al. 2023, eq. 1): norm(max(p - q, 0)), which makes the output distribution exactly p.
    Where nothing is left (p <= q everywhere, so the proposal was accepted with probability 1
    up to rounding) it is p. A q row of zeros (no proposal there) leaves p itself."""
    r = (p - q).clamp(min=0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp(min=1e-30), p)


def accept_sampled(p: Tensor, q: Tensor, drafts: list) -> tuple:
    """Rejection sampling over m = len(drafts) proposals. p: (k + 1, V) target distributions,
    q: (m, V) proposal distributions. Returns (n accepted, the token after them)."""
    m = len(drafts)
    d = torch.tensor(drafts, device=p.device)
    rows = torch.arange(m, device=p.device)
    px, qx = p[rows, d], q[rows, d]
    accept = (torch.rand(m, device=p.device) * qx < px).tolist()  # u < p/q: with probability min(1, p/q)
    n = 0
    while n < m and accept[n]:
        n += 1
    dist = residual_distribution(p[n], q[n]) if n < m else p[n]  # all accepted: a bonus token from p
    return n, sample_probs(dist.unsqueeze(0)).item()


class RingSnapshot:
    """The ring-cache slots that speculative positions overwrite, saved so rejected positions can
    be undone. A no-op for models without ring caches."""

    def __init__(self, model: Transformer):
        self.window = model.ring_window
        self.caches = [m for m in model.modules() if isinstance(m, RingKVCache)]
        self.saved = None

    def save(self, start: int, end: int):
        """Positions [start, end) are about to be written, and may be rejected."""
        if not self.caches or end <= start:
            self.saved = None
            return
        assert end - start <= self.window, "more speculative positions than the ring holds"
        slots = torch.arange(start, end, device=self.caches[0].k_cache.device) % self.window
        self.saved = (start, slots, [(c.k_cache.index_select(2, slots), c.v_cache.index_select(2, slots))
                                     for c in self.caches])

    def restore(self, valid_end: int):
        """Positions from valid_end on were rejected: give their slots back what they held."""
        if self.saved is None:
            return
        start, slots, saved = self.saved
        first = max(valid_end - start, 0)
        if first < len(slots):
            for c, (k, v) in zip(self.caches, saved):
                c.k_cache.index_copy_(2, slots[first:], k[:, :, first:])
                c.v_cache.index_copy_(2, slots[first:], v[:, :, first:])
        self.saved = None


# ---------------------------------------------------------------- proposers

class NgramProposer:
    """Prompt lookup: propose what followed the most recent earlier occurrence of the last n tokens
    (n = max_n, then shorter, down to min_n). An index from each n-gram to where its most recent
    occurrence's continuation starts is kept up to date as the context grows."""

    name = "ngram"

    def __init__(self, max_n: int, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise UserError(f"n-gram sizes must satisfy 1 <= min_n <= max_n (got {min_n}, {max_n})")
        self.max_n, self.min_n = max_n, min_n
        self.forwards = 0  # no model
        self.start([])

    def setup(self, max_seq_length: int):
        pass

    def warm_up(self, s: Sampling):
        pass

    def start(self, context: list, s: Optional[Sampling] = None):
        self.index = {n: {} for n in range(self.min_n, self.max_n + 1)}  # n-gram -> continuation start
        self.indexed = 0

    def _extend_index(self, context: list):
        for j in range(self.indexed, len(context)):  # j: a continuation start, so j <= len - 1
            for n in self.index:
                if j >= n:
                    self.index[n][tuple(context[j - n:j])] = j
        self.indexed = len(context)

    def propose(self, context: list, k: int, s: Sampling) -> tuple:
        """Up to k proposed ids (none when nothing matches) and q = None (a point mass)."""
        self._extend_index(context)
        L = len(context)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            j = self.index[n].get(tuple(context[L - n:]))
            if j is not None:
                out = []
                for i in range(k):  # past the end of the context, copy what we proposed (LZ77-style)
                    out.append(context[j + i] if j + i < L else out[j + i - L])
                return out, None
        return [], None

    def accepted(self, n: int):
        pass


class DraftProposer:
    """A draft model with its own KV cache and compiled one-token step. `fed` lists the tokens
    whose keys and values are in its cache, by position."""

    name = "draft"

    def __init__(self, model: Transformer, compile: bool = False, compile_mode: str = "default"):
        self.model = model
        self.device = model.norm.weight.device  # (a quantized embedding has no .weight)
        self.step = draft_one_token
        if compile:
            self.step = torch.compile(draft_one_token, fullgraph=True,
                                      **compile_options(self.device, compile_mode))
        self.fed: list = []
        self.forwards = 0
        self.ring = None

    def setup(self, max_seq_length: int):
        m = self.model
        if m.max_batch_size != 1 or m.max_seq_length != max_seq_length:
            m.setup_caches(1, max_seq_length)
            self.fed = []
        self.ring = RingSnapshot(m)

    def _one(self, token, pos: int, s: Sampling):
        cur = token if isinstance(token, Tensor) else torch.tensor([[token]], device=self.device)
        self.forwards += 1
        # clone: under CUDA graphs the next replay overwrites the previous step's outputs
        tok, q = self.step(self.model, cur, torch.tensor([pos], device=self.device), s)
        return tok.clone(), (None if q is None else q.clone())

    def warm_up(self, s: Sampling):
        for _ in range(2):  # the compiled graph runs from the second call on
            self._one(0, 0, s)
        self.fed = []  # slot 0 now holds garbage

    def start(self, context: list, s: Sampling):
        """Prefill the draft with context[:-1], reusing what its cache already holds (chat turns)."""
        keep = min(common_prefix(self.fed, context), len(context) - 1)
        window = self.model.ring_window
        if window and keep < len(self.fed) and len(self.fed) > window:
            keep = 0  # a ring cache cannot rewind past its window: prefill again
        del self.fed[keep:]
        self.ring = RingSnapshot(self.model)  # the caches may have been reallocated since the last call
        chunk = context[keep:-1]
        if chunk:
            self.model(torch.tensor([chunk], device=self.device),
                       torch.arange(keep, len(context) - 1, device=self.device),
                       last_logits_only=True, kv_len=len(context) - 1)
            self.fed.extend(chunk)

    def propose(self, context: list, k: int, s: Sampling) -> tuple:
        """k drafted ids and their distributions q (k, V) (None when greedy)."""
        # catch up on what the draft has not seen: the target's last token, and after a fully
        # accepted block also the last proposal, which the draft produced but never fed back
        for t in context[len(self.fed):]:
            tok, q = self._one(t, len(self.fed), s)
            self.fed.append(t)
        self.base = len(self.fed)
        self.ring.save(self.base, self.base + k - 1)
        toks, qs = [tok], [q]
        for i in range(k - 1):
            tok, q = self._one(tok, self.base + i, s)
            toks.append(tok)
            qs.append(q)
        drafts = torch.cat(toks).view(-1).tolist()
        self.fed.extend(drafts[:-1])  # the last proposal was not fed
        return drafts, (None if s.temperature == 0 else torch.cat(qs))

    def accepted(self, n: int):
        """n of the last proposals were kept: forget the rest (and undo them in a ring cache)."""
        del self.fed[self.base + n:]
        self.ring.restore(len(self.fed))


# ---------------------------------------------------------------- adaptive k

ADAPTIVE_MIN_K = 2


def next_k(k: int, accepted: int, proposed: int, k_max: int) -> int:
    """How many tokens to propose next round, from this round's outcome (--adaptive_k): after a
    block accepted whole, twice as many (up to k_max); after a rejection, one more than were
    accepted, at least ADAPTIVE_MIN_K. Proposals tend to come in runs: a proposer that is
    copying a passage keeps being right, one that guesses keeps being wrong, and a wrong guess
    is cheaper to check when it is short. On scripts/bench_speculative.py's n-gram prompts,
    replaying the recorded greedy outputs with verify costs measured per length, this beat
    every fixed k and the simpler "k_max after a full block, else 3"."""
    if accepted == proposed:
        return min(k_max, 2 * k)
    return min(k_max, max(ADAPTIVE_MIN_K, accepted + 1))


# ---------------------------------------------------------------- the engine

@dataclass
class SpecStats(Stats):
    k: int = 0
    target_forwards: int = 0  # after prefill: verify forwards + plain one-token steps
    plain_steps: int = 0  # rounds without a proposal (n-gram miss, last token, end of the cache)
    draft_forwards: int = 0
    histogram: list = field(default_factory=list)  # histogram[i]: verify forwards that accepted i proposals
    proposed: int = 0  # proposals checked, over all verify forwards


class SpeculativeEngine:
    """An `Engine` (the target, its prefill and compiled one-token step) plus a proposer and a
    compiled (k + 1)-token verify forward. Same `generate` and `setup` as `Engine`, so `Chat`
    works with it unchanged."""

    def __init__(self, engine: Engine, proposer, k: int, compile: bool = False, compile_mode: str = "default",
                 adaptive: bool = True):
        if k < 1:
            raise UserError("--speculate_k must be at least 1")
        self.engine, self.proposer, self.k = engine, proposer, k
        self.adaptive = adaptive
        self.model, self.device = engine.model, engine.device
        self.verify, self.compiled = verify, compile
        if compile:  # dynamic: one graph for every number of proposals and every context length
            # on CPU with a C++ wrapper around the graph's ~300 kernel calls (half of them
            # kernels.py's, outside inductor's code): a 4-token SmolLM2 verify took 32 ms
            # instead of 40 (one-off profile)
            options = compile_options(self.device, compile_mode)
            self.verify = torch.compile(verify, fullgraph=True, dynamic=True, **options)
        self.guards_checked, self.step_guards_checked, self.skip_guards = False, False, True
        self.k_now = k  # this round's proposals at most: k, or next_k's choice when adaptive
        self.tokens: list = []  # the target's context: tokens by cache position (the last one not fed yet)
        self.ring = None

    def setup(self, batch_size: int, max_seq_length: int):
        if batch_size != 1:
            raise UserError("speculative decoding runs one sequence at a time: use a single prompt "
                            "and --batch_size 1")
        self.engine.setup(1, max_seq_length)
        self.proposer.setup(max_seq_length)
        self.tokens = []

    def warm_up(self, prompts: list, s: Sampling):
        """Run every compiled graph (verify, the one-token step, the draft's step) before timing."""
        if not self.compiled:
            return
        log("compiling (about a minute the first time, cached on disk afterwards)...")
        t0 = time.perf_counter()
        dev, k = self.device, self.k
        with torch.inference_mode():
            for T, pos in ((k + 1, 3), (2, 7)):  # two lengths: the second call runs the dynamic graph
                self.run_verify(torch.zeros(1, T, dtype=torch.long, device=dev), pos, s)
                self.engine.decode_one_token(self.model, torch.zeros(1, 1, dtype=torch.long, device=dev),
                                             torch.tensor([0], device=dev), torch.zeros(1, dtype=torch.long, device=dev), s)
            self.proposer.warm_up(s)
        self.tokens = []  # the caches now hold garbage at the first positions
        log(f"compiled in {time.perf_counter() - t0:.1f} s")

    def speculation_metrics(self, stats: "SpecStats") -> dict:
        return speculation_metrics(stats, self)

    @torch.inference_mode()
    def generate(self, prompts: list, max_new_tokens: int, s: Sampling, stop_ids=(), start_pos: int = 0,
                 on_tokens: Optional[Callable] = None) -> tuple:
        """As `Engine.generate`, for one prompt; returns ([new ids], SpecStats)."""
        if len(prompts) != 1:
            raise UserError("speculative decoding runs one sequence at a time: use a single prompt "
                            "and --batch_size 1")
        prompt, dev = list(prompts[0]), self.device
        T, S = len(prompt), self.model.max_seq_length
        if start_pos + T + max_new_tokens > S:
            raise UserError(f"prompt ({start_pos + T} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                            f"the KV cache (max_seq_length {S})")
        if start_pos > len(self.tokens):
            raise ValueError(f"start_pos {start_pos} is past the {len(self.tokens)} cached tokens")
        for m in (self.model, getattr(self.proposer, "model", None)):
            if m is not None and m.ring_window is not None and self.k >= m.ring_window:
                raise UserError(f"--speculate_k {self.k} must be smaller than the sliding window "
                                f"({m.ring_window}): a ring KV cache cannot undo more positions")
        self.ring = RingSnapshot(self.model)  # the caches may have been reallocated since the last call
        context = self.tokens = self.tokens[:start_pos] + prompt
        stats = SpecStats(prompt_tokens=T, new_tokens=0, ttft_s=0.0, decode_s=0.0, token_times=[],
                          k=self.k, histogram=[0] * (self.k + 1))
        draft_forwards0 = self.proposer.forwards
        self.k_now = min(ADAPTIVE_MIN_K, self.k) if self.adaptive else self.k
        self.guards_checked = self.step_guards_checked = False
        stop, out = set(stop_ids), []

        def emit(new: list):
            now = time.perf_counter()
            out.extend(new)
            context.extend(new)
            stats.token_times.extend([now] * len(new))  # a block of tokens arrives at once
            if on_tokens:
                for t in new:
                    on_tokens([t])

        t0 = time.perf_counter()
        cur = self.engine.prefill(self.model, torch.tensor([prompt], device=dev),
                                  torch.arange(start_pos, start_pos + T, device=dev),
                                  torch.zeros(1, dtype=torch.long, device=dev), s, start_pos + T)
        emit([cur.item()])
        stats.ttft_s = stats.token_times[0] - t0
        if out[-1] not in stop and max_new_tokens > 1:
            self.proposer.start(context, s)
        pos = start_pos + T  # the cache slot of context[-1], which the target has not seen yet
        while out[-1] not in stop and len(out) < max_new_tokens:
            new = self.speculative_decode(context, pos, s, max_new_tokens - len(out), stop, stats)
            pos += len(new)
            emit(new)
        stats.new_tokens = len(out)
        stats.decode_s = stats.token_times[-1] - stats.token_times[0]
        stats.draft_forwards = self.proposer.forwards - draft_forwards0
        return [out], stats

    def run_verify(self, ids: Tensor, pos: int, s: Sampling) -> Tensor:
        """The target over ids (1, m + 1), from cache slot pos. Compiled, one graph serves every
        m and every context length: a verify of fewer tokens costs less (each weight is read
        once either way, but the arithmetic grows with m), which is what lets `next_k` try short
        proposals cheaply; and attention covers the slots in use, not the whole cache (for 9
        tokens it is as much arithmetic per cached position as 27 decode steps: SmolLM2 has 3
        query heads per key head)."""
        T = ids.shape[1]
        # under CUDA graphs every new shape is recorded anew: there attention keeps covering the
        # whole cache, so that only the block length varies (at most k graphs)
        kv_len = pos + T if ids.device.type == "cpu" else self.model.max_seq_length
        # guards are checked on a generate call's first verify only (as generate.py does for
        # the one-token step): ~1.3 ms a call, and nothing they check changes within a call
        with torch.compiler.set_stance(skip_guard_eval_unsafe=self.guards_checked):
            out = self.verify(self.model, ids, torch.arange(pos, pos + T, device=ids.device), s, kv_len)
        self.guards_checked = self.compiled and self.skip_guards
        return out

    def speculative_decode(self, context: list, pos: int, s: Sampling, budget: int, stop: set,
                           stats: SpecStats) -> list:
        """One round: propose, verify in one target forward, accept. Returns the new tokens
        (accepted proposals + the target's own token), cut after a stop token and to `budget`."""
        dev, k = self.device, self.k_now
        room = self.model.max_seq_length - pos - 1  # slots after the last token
        drafts, q = self.proposer.propose(context, min(k, budget - 1), s) if budget > 1 and room >= k else ([], None)
        stats.target_forwards += 1
        if not drafts:  # nothing to check: a plain decoding step
            stats.plain_steps += 1
            # guards checked on the call's first plain step only, as for the verify (~1 ms a step)
            with torch.compiler.set_stance(skip_guard_eval_unsafe=self.step_guards_checked):
                cur = self.engine.decode_one_token(self.model, torch.tensor([[context[-1]]], device=dev),
                                                   torch.tensor([pos], device=dev),
                                                   torch.zeros(1, dtype=torch.long, device=dev), s)
            self.step_guards_checked = self.compiled and self.skip_guards
            return [cur.item()]
        m = len(drafts)
        self.ring.save(pos + 1, pos + m + 1)
        target = self.run_verify(torch.tensor([[context[-1]] + drafts], device=dev), pos, s)
        if s.temperature == 0:
            target = target.tolist()
            n = 0
            while n < m and drafts[n] == target[n]:
                n += 1
            nxt = target[n]
        else:
            if q is None:  # an n-gram proposal is a point mass
                q = torch.zeros(m, target.shape[-1], device=dev).scatter_(
                    1, torch.tensor(drafts, device=dev).view(-1, 1), 1.0)
            n, nxt = accept_sampled(target, q, drafts)
        stats.histogram[n] += 1
        stats.proposed += m
        if self.adaptive:
            self.k_now = next_k(k, n, m, self.k)
        new = drafts[:n] + [nxt]
        for i, t in enumerate(new):  # stop inside an accepted block: what follows was never generated
            if t in stop:
                new = new[:i + 1]
                break
        new = new[:budget]
        # slots pos .. pos + len(new) - 1 now hold the last token and the kept proposals
        self.ring.restore(pos + len(new))
        self.proposer.accepted(len(new) - 1)
        return new


# ---------------------------------------------------------------- setup and reporting

def tokenizer_fingerprint(checkpoint_dir) -> tuple:
    """What decides token ids: tokenizer.json's model (vocab, merges) and added tokens, or the
    bytes of tokenizer.model. Two checkpoints can share a draft only when these are equal."""
    d = Path(checkpoint_dir)
    if (d / "tokenizer.json").is_file():
        j = json.loads((d / "tokenizer.json").read_text())
        added = sorted((t.get("id"), t.get("content")) for t in j.get("added_tokens") or [])
        return "tokenizer.json", json.dumps(j.get("model"), sort_keys=True), added
    if (d / "tokenizer.model").is_file():
        return "tokenizer.model", (d / "tokenizer.model").read_bytes()
    return None, None


def check_same_tokenizer(target_dir, draft_dir):
    if not Path(draft_dir).is_dir():
        raise UserError(f"draft checkpoint directory {draft_dir} does not exist")
    a, b = tokenizer_fingerprint(target_dir), tokenizer_fingerprint(draft_dir)
    if b[0] is None:
        raise UserError(f"draft checkpoint {draft_dir} has no tokenizer.json or tokenizer.model")
    if a != b:
        raise UserError(f"the draft {draft_dir} and the target {target_dir} have different tokenizers; "
                        "a draft must share the target's vocabulary")


def build(engine: Engine, k: int, draft: Optional[Transformer] = None, ngram: Optional[int] = None,
          compile: bool = False, compile_mode: str = "default", ngram_min: int = 1,
          adaptive: bool = True) -> SpeculativeEngine:
    """A SpeculativeEngine around `engine` with a draft model or an n-gram proposer (n-grams of
    `ngram` tokens down to `ngram_min`)."""
    if (draft is None) == (ngram is None):
        raise UserError("give exactly one of --draft_checkpoint and --ngram")
    if draft is not None:
        if draft.args.vocab_size != engine.model.args.vocab_size:
            raise UserError(f"the draft's vocabulary ({draft.args.vocab_size}) differs from the target's "
                            f"({engine.model.args.vocab_size})")
        proposer = DraftProposer(draft, compile=compile, compile_mode=compile_mode)
    else:
        proposer = NgramProposer(ngram, ngram_min)
    return SpeculativeEngine(engine, proposer, k, compile=compile, compile_mode=compile_mode, adaptive=adaptive)


def speculation_metrics(stats: SpecStats, spec: SpeculativeEngine) -> dict:
    """Acceptance figures of one generate() call, to merge into generate.metrics()."""
    verifies = sum(stats.histogram)
    forwards, decoded = stats.target_forwards, stats.new_tokens - 1  # the first token comes from prefill
    m = {
        "proposer": spec.proposer.name,
        "speculate_k": stats.k,
        "target_forwards": forwards,
        "tokens_per_target_forward": decoded / forwards if forwards else 0.0,
        "mean_accepted_proposals": sum(i * h for i, h in enumerate(stats.histogram)) / verifies if verifies else 0.0,
        "acceptance_histogram": stats.histogram,
        "plain_steps": stats.plain_steps,
        "draft_forwards": stats.draft_forwards,
    }
    if stats.decode_s > 0:  # weights read: the target's once per forward, the draft's once per step
        read = param_bytes(spec.model) * forwards
        if isinstance(spec.proposer, DraftProposer):
            read += param_bytes(spec.proposer.model) * stats.draft_forwards
        m["bandwidth_gb_s"] = read / stats.decode_s / 1e9
    return m


def compare_with_plain(spec: SpeculativeEngine, prompts: list, max_new_tokens: int, s: Sampling, stop_ids,
                       m: dict, spec_outputs: list) -> dict:
    """Decode the same prompt without speculation (the target's own Engine) and compare speeds
    and, greedy, the outputs. m: the speculative run's metrics."""
    from generate import metrics, warm_up
    warm_up(spec.engine, prompts, s, min(3, max_new_tokens))
    outs, stats = spec.engine.generate(prompts, max_new_tokens, s, stop_ids)
    spec.tokens = []  # the target's cache now holds the plain run
    tps = metrics(stats, spec.model, spec.device, 1)["decode_tokens_per_s"]
    r = {"plain_decode_tokens_per_s": tps, "speedup": m["decode_tokens_per_s"] / tps if tps else 0.0}
    if s.temperature == 0:
        r["identical_to_plain"] = outs == spec_outputs
    log(f"plain decoding {tps:.2f} tokens/s: speculation is {r['speedup']:.2f}x"
        + ({True: ", output identical", False: ", OUTPUT DIFFERS"}[r["identical_to_plain"]]
           if "identical_to_plain" in r else ""))
    return r


def print_speculation(m: dict):
    log(f"speculation ({m['proposer']}, k={m['speculate_k']}): {m['tokens_per_target_forward']:.2f} tokens "
        f"per target forward ({m['target_forwards']} forwards, {m['plain_steps']} without a proposal), "
        f"{m['mean_accepted_proposals']:.2f} proposals accepted per verify")
    log("acceptance histogram (accepted proposals: verify forwards): "
        + ", ".join(f"{i}: {h}" for i, h in enumerate(m["acceptance_histogram"])))
