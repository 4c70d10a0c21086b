"""Speculative decoding: a cheap proposer guesses up to k tokens, the target model checks them all
in one forward pass over k + 1 positions, and the output is exactly what the target alone gives.

    python generate.py --checkpoint checkpoints/qwen2.5-coder-1.5b \\
        --draft_checkpoint checkpoints/qwen2.5-coder-0.5b --speculate_k 5 --prompt "def quicksort(xs):"
    python generate.py --checkpoint checkpoints/smollm2-135m --ngram 3 --speculate_k 8 --chat \\
        --prompt "Fix the typo in this sentence: ..."

Proposers (proposers.py): a draft model, prompt lookup (n-grams), or suffix matching (suffix.py);
a draft that proposes trees, its chain sped up by prompt lookup (staged.py); lookahead decoding
(lookahead.py) proposes from a pool that its own rounds fill, in the verify's forward.

Verification (`SpeculativeEngine.speculative_decode`), over [last token, d_1 .. d_k]:
- greedy: accept the longest prefix of proposals equal to the target's argmax, then the
  target's own token at the first mismatch (or after d_k): token-identical to greedy decoding.
- sampling: Leviathan et al. 2023 (Algorithm 1) / Chen et al. 2023: accept d_i with probability
  min(1, p(d_i) / q(d_i)); on rejection sample from norm(max(p - q, 0)); when all are accepted,
  sample a bonus token from p. p and q are the processed distributions (temperature, top-k,
  top-p: `sampling.logits_to_probs`) of target and draft. An n-gram or suffix proposal is a point mass
  (q = one-hot): accept with probability p(d), on rejection sample from p with d removed.

Trees (--speculate_tree NODES, `speculative_tree_decode`, tree.py): the proposer's tree of up to
NODES candidates (several continuations, k deep) goes through the target in one forward, each
node attending to its ancestors only; the longest accepted path is kept (greedy: the argmax's
child at each node; sampling: recursive rejection sampling over a node's children, exact for
point masses and for a draft's draws, whose q the tree carries), and its keys and values are
moved to the positions it takes in the sequence. With --adaptive_k a round verifies the part of the
tree that gives the most expected tokens per unit of time, or none (a plain step):
spec_cost.TreePlanner, from the same StepCosts as chains and the acceptance per depth and sibling rank.

Structured output, penalties, logit_bias, logprobs (`speculative_decode_host`): the verify
returns logits and tokens are picked on the host, as `Engine.generate` picks them (penalties and
logit_bias counting the block's tokens before each position, the grammar's mask, then sampling).
Under a grammar (a `grammar.Constraint`):
- proposals are cut where the grammar stops allowing them (`Constraint.valid_prefix`); a draft
  model samples from its own distribution masked by the grammar, so q is what its proposals were
  really drawn from and rejection sampling stays exact (a cut point mass is still a point mass);
- after a proposal, the tokens the grammar then forces go into the block as `Engine` inserts them
  (jump-forward), unchecked; the target picks at each proposal and after the block, each masked
  by the grammar's state there (the block is consumed into the grammar, then rolled back);
- the accepted tokens and the target's own are consumed, then what the grammar forces next, which
  the next verify feeds before its proposals. Greedy output is token-identical to Engine's.

How many to propose (`--adaptive_k`, on by default; spec_cost.py): each round the count that
gives the most tokens per unit of time, from the measured cost of a verify of n proposals against
a plain step and the observed acceptance of each proposal position, or none: a round without
proposals is a plain step through the engine's compiled one-token graph, as Engine.generate
takes it, so speculation that does not pay costs what plain decoding costs. A draft model stops
drafting where it grows unsure (threshold drafting). --no-adaptive_k proposes --speculate_k
every round. The compiled verify is one dynamic graph for every block length and context length.

KV caches: the target's request holds blocks of the engine's paged cache, and every verify is a
step of the engine (Engine.feed: one chunk, every token's logits); the draft keeps a cache of its
own. Both are indexed by position, so undoing rejected positions means not advancing (Engine.keep
keeps the accepted ones): their slots are written again later. Nothing is rewound in place.

Batch size 1 only: rows of a batch accept different numbers of tokens; larger batches are refused.
"""
import functools
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import torch
from torch import Tensor

import warmup
from engine import ONE_SEQUENCE, Engine
from errors import UserError
from grammar import apply_mask, unpack_mask_on_host
from lookahead import LookaheadProposer, lookahead_decode
from model import param_bytes
from proposers import Proposer, common_prefix
from rope import recompute_position
from sampling import Sampling, adjust_logits, logits_to_probs, pick_tokens, sample, sample_probs, token_logprobs
from scheduler import Request, StepPlan
from spec_cost import LookaheadPlanner, RoundPlanner, StepCosts, TreePlanner
from stats import Stats, decode_metrics
from tree import Tree, compact, greedy_path, path_slots, sampled_path


# ---------------------------------------------------------------- the compiled pieces

def target_picks(logits: Tensor, sampling: Sampling) -> Tensor:
    """The target's logits over [last token, d_1 .. d_m] (m + 1, V): its greedy ids (m + 1,), or
    its processed distributions (m + 1, V) when sampling. Row i predicts the token after d_i."""
    if sampling.temperature == 0:
        return logits.argmax(-1)
    return logits_to_probs(logits, sampling)


def residual_distribution(p: Tensor, q: Tensor) -> Tensor:
    """What to sample from after rejecting a proposal (Leviathan et al. 2023, Algorithm 1;
    Chen et al. 2023, eq. 1): norm(max(p - q, 0)), which makes the output distribution exactly p.
    Where nothing is left (p <= q everywhere, so the proposal was accepted with probability 1
    up to rounding) it is p. A q row of zeros (no proposal there) leaves p itself."""
    r = (p - q).clamp(min=0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp(min=1e-30), p)


def accept_sampled(p: Tensor, q: Tensor, drafts: list) -> tuple:
    """Rejection sampling over m = len(drafts) proposals. p: (m + 1, V) target distributions (or
    (m, V) where nothing is picked after the proposals), q: (m, V) proposal distributions.
    Returns (n accepted, the token after them, or None when all were accepted and p has m rows)."""
    m = len(drafts)
    d = torch.tensor(drafts, device=p.device)
    rows = torch.arange(m, device=p.device)
    px, qx = p[rows, d], q[rows, d]
    accept = (torch.rand(m, device=p.device) * qx < px).tolist()  # u < p/q: with probability min(1, p/q)
    n = 0
    while n < m and accept[n]:
        n += 1
    if n == len(p):
        return n, None
    dist = residual_distribution(p[n], q[n]) if n < m else p[n]  # all accepted: a bonus token from p
    return n, sample_probs(dist.unsqueeze(0)).item()


def verify_on_host(x: Tensor, proposals: list, q: Optional[Tensor], sampling: Sampling) -> tuple:
    """The target's picks x (m + bonus, V), adjusted and masked, against m proposals drawn from q
    (m, V) (None: point masses): (proposals accepted, the target's own token after them or None)."""
    m = len(proposals)
    if sampling.temperature == 0:
        target = x.argmax(-1).tolist()
        n = 0
        while n < m and proposals[n] == target[n]:
            n += 1
        return n, (target[n] if n < len(target) else None)
    if not m:
        return 0, sample_probs(logits_to_probs(x, sampling)).item()
    if q is None:
        q = torch.zeros(m, x.shape[-1], device=x.device).scatter_(
            1, torch.tensor(proposals, device=x.device).view(-1, 1), 1.0)
    return accept_sampled(logits_to_probs(x, sampling), q, proposals)


def consume(row: Request, new: list, entries: list, jump: bool, budget: int) -> tuple:
    """As Request.take: the row's grammar consumes the new tokens, then (jump) what it forces next."""
    c = row.constraint
    if not c.accept_all(new):
        row.error = c.error() or "the grammar rejects the picked tokens"
    elif jump and not c.done():
        forced = c.forced()[:budget - len(new)]
        if forced and not c.accept_all(forced):
            row.error = c.error() or "the grammar rejects its own forced tokens"
        else:
            return new + forced, entries + [None] * len(forced)
    return new, entries


def build_block(drafts: list, constraint, masks: Optional[Tensor], stop: set, limit: int, jump: bool) -> tuple:
    """What a host round feeds the target after its unfed tokens, at most `limit` tokens: each
    proposal (the grammar allows them all), then the tokens the grammar forces after it (inserted
    whole, as Engine's jump-forward inserts them, never checked); the block ends where the proposals
    go another way than the forced tokens. masks[i] gets the grammar's mask before the i-th
    proposal, and masks[m] the one after the block when the target picks there: the block is
    consumed into the grammar and rolled back. Returns (block, the index of each proposal in it,
    which is its index in drafts too, whether the target picks after the block: not after a stop
    token, a completed grammar, or forced tokens that did not fit)."""
    c = constraint
    block, choices, consumed, i, bonus = [], [], 0, 0, True
    while i < len(drafts) and len(block) < limit:
        if c is not None:
            c.fill_mask(masks[len(choices)])
        choices.append(len(block))
        block.append(drafts[i])
        i += 1
        if c is not None:
            c.accept(block[-1])
            consumed += 1
        if block[-1] in stop or (c is not None and c.done()):
            bonus = False
            break
        forced = c.forced() if c is not None and jump else []
        if forced:
            if len(block) + len(forced) > limit:  # they come whole, after this round
                bonus = False
                break
            c.accept_all(forced)
            consumed += len(forced)
            block += forced
            if drafts[i:i + len(forced)] != forced:  # the proposal went another way (or ended)
                break
            i += len(forced)
    if c is not None:
        if bonus:
            c.fill_mask(masks[len(choices)])
        c.rollback(consumed)
    return block, choices, bonus


# ---------------------------------------------------------------- the tree verify

def tree_plans(engine: Engine, nodes: int) -> list:
    """Steps that compile the verify of a tree (warmup.chunk_plans' graph with a tree mask), in two
    shapes, so that the graph is general in its length from the first compile."""
    plans = []
    for T, pos in ((nodes + 1, 3), (3, 20)):
        pos = max(1, min(pos, engine.max_seq_length - T))
        plans.append(StepPlan(chunks=[([0] * T, pos, ([], []), True, Tree([0] * T, list(range(-1, T - 1))))]))
    return plans


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
    """An `Engine` (the target, its paged cache and its steps) plus a proposer: each round proposes,
    verifies in one step of the engine over up to k + 1 tokens, and keeps what the target accepts.
    The same interface as `Engine`, so the command line and `Chat` drive it unchanged."""

    def __init__(self, engine: Engine, proposer: Proposer, k: int, compile: bool = False,
                 compile_mode: str = "default", adaptive: bool = True, tree_nodes: int = 0):
        if k < 1:
            raise UserError("--speculate_k must be at least 1")
        if engine.max_batch_size != 1:
            raise UserError(ONE_SEQUENCE)
        draft = proposer.model
        if draft is not None and draft.args.vocab_size != engine.model.args.vocab_size:
            raise UserError(f"the draft's vocabulary ({draft.args.vocab_size}) differs from the target's "
                            f"({engine.model.args.vocab_size})")
        self.engine, self.proposer, self.k, self.adaptive = engine, proposer, k, adaptive
        self.model, self.device, self.compiled = engine.model, engine.device, compile
        self.max_seq_length = engine.max_seq_length
        self.lookahead_rounds = isinstance(proposer, LookaheadProposer)
        longest = max(k, tree_nodes, proposer.size - 1 if self.lookahead_rounds else 0)
        self.costs = StepCosts(longest)  # a verify's cost per proposal count, kept across calls
        self.fresh_planners()
        self.jump_forward = True  # feed the tokens a grammar forces with the next block (False: picked one by one)
        self.tree_nodes = tree_nodes  # > 0: each round verifies a tree of up to this many candidates, k deep
        # a round's kind, chosen once: lookahead's branches, a tree of candidates, or a chain
        self.round = (functools.partial(lookahead_decode, self) if self.lookahead_rounds
                      else self.speculative_tree_decode if tree_nodes else self.speculative_decode)
        proposer.setup(engine.max_seq_length)

    def fresh_planners(self):
        """Each generation learns its acceptance afresh; the step costs (self.costs) carry over."""
        self.planner = RoundPlanner(self.k, self.proposer.cheap, self.costs)
        self.tree_planner = TreePlanner(self.k, self.costs)
        if self.lookahead_rounds:
            self.lookahead_planner = LookaheadPlanner(self.proposer.size, self.proposer.N - 1, self.costs)

    def forget_prefixes(self):
        self.engine.forget_prefixes()

    def warm_up(self, prompts: list, sampling: Sampling, host: bool = False, constrained: bool = False,
                aside: bool = False) -> Optional[threading.Thread]:
        """Compile every graph (the verify's, the draft's step) first or (aside) on a thread while the
        eager ones run; host: the ones that return logits (penalties, logit_bias or logprobs; a
        grammar's mask, constrained)."""
        if not self.compiled:
            return None
        plans, host = warmup.chunk_plans(self.engine, self.k + 1), host or constrained  # the verify's shapes
        if self.tree_nodes:  # the verify with a tree's mask is a graph of its own
            plans += tree_plans(self.engine, self.tree_nodes)
        if self.lookahead_rounds:  # its rounds' forward: a mask too, one size
            plans += tree_plans(self.engine, self.proposer.size - 1)
        if not host:  # and the plain step's, which rounds without proposals take
            plans += warmup.generate_plans(self.engine, prompts, sampling)
        draft = self.proposer.warm_up(sampling, host)  # its step, taken up at the next proposal
        if aside:
            return warmup.compile_aside(self.engine, plans, then=draft)
        warmup.compile_now(self.engine, plans, then=draft)

    @torch.inference_mode()
    def generate(self, prompts: list, max_new_tokens: int, sampling: Sampling, stop_ids=(),
                 on_tokens: Optional[Callable] = None, constraints: Optional[list] = None,
                 logprobs: Optional[int] = None, host: bool = False) -> tuple:
        """As `Engine.generate`, for one prompt; returns ([new ids], SpecStats). A grammar,
        penalties, logit_bias or logprobs (or host=True) pick tokens on the host from the target's
        logits (`speculative_decode_host`, over chains even with tree_nodes); otherwise each round
        picks from the verify's."""
        if len(prompts) != 1:
            raise UserError(ONE_SEQUENCE)
        prompt = list(prompts[0])
        switch = recompute_position(self.model.args)
        if switch is not None and len(prompt) <= switch < len(prompt) + max_new_tokens - 1:
            raise UserError(f"speculative decoding cannot cross LongRoPE's original context ({switch} tokens), "
                            "where every cached key is computed again: lower --max_new_tokens, or decode without it")
        row = Request(prompt, max_new_tokens, sampling, stop_ids=frozenset(stop_ids),
                      constraint=constraints[0] if constraints else None, logprobs=logprobs)
        host = host or sampling.adjusts or logprobs is not None or row.constraint is not None
        stats = SpecStats(prompt_tokens=len(prompt), new_tokens=0, ttft_s=0.0, decode_s=0.0, token_times=[],
                          k=self.k, histogram=[0] * (self.k + 1))
        draft_forwards_before, eager = self.proposer.forwards, self.engine.eager_steps
        self.fresh_planners()
        self.proposer.adapt(self.adaptive)
        start = time.perf_counter()
        scheduler = self.engine.scheduler
        jump, scheduler.jump_forward = scheduler.jump_forward, False
        try:  # what a grammar forces before any choice is the rounds' to hand out
            self.engine.start(row)
        finally:
            scheduler.jump_forward = jump
        try:
            self.rounds(row, host, stats, on_tokens)
        finally:
            self.engine.scheduler.finish(row, row.finish_reason or "cancelled")
        stats.ttft_s = stats.token_times[0] - start
        stats.new_tokens = len(row.out)
        stats.decode_s = stats.token_times[-1] - stats.token_times[0]
        stats.draft_forwards = self.proposer.forwards - draft_forwards_before
        stats.finish_reasons = [row.finish_reason]
        stats.logprobs = [row.token_logprobs] if logprobs is not None else []
        stats.cached_tokens = row.cached_tokens
        stats.eager_steps = self.engine.eager_steps - eager
        return [row.out], stats

    def rounds(self, row: Request, host: bool, stats: "SpecStats", on_tokens: Optional[Callable]):
        """The prompt, then rounds until the row ends."""
        engine, sampling, stop = self.engine, row.sampling, set(row.stop_ids)
        emit = self.emitter(row, stats, on_tokens)
        if self.jump_forward and row.constraint is not None:
            lead = row.take(None)  # what the grammar forces before any choice is prefilled with the prompt
            if lead:
                emit(lead, timed=False)
        if row.finish_reason is None:
            logits = engine.feed(row, row.known()[row.fed:])
            engine.keep(row, len(row.known()) - row.fed)
            if host:
                token = pick_tokens(logits.unsqueeze(0), [row])[0]  # records its logprobs
                emit(row.take(token, jump=self.jump_forward and token not in stop))
            else:
                emit([int(sample(logits.unsqueeze(0), sampling))])
        if not stats.token_times:  # the grammar forced the whole output
            stats.token_times.append(time.perf_counter())
        if row.finish_reason is None:
            self.proposer.start(row.known(), sampling)
        while row.finish_reason is None:
            budget = row.max_new_tokens - len(row.out)
            if host:
                new, entries, fed = self.speculative_decode_host(row.known(), row.fed, row, budget, stop, stats)
            else:
                new = self.round(row, budget, stop, stats)
                entries, fed = (), len(new)  # the last token fed and the kept proposals
            emit(new, entries)
            engine.keep(row, fed)

    @staticmethod
    def emitter(row: Request, stats: "SpecStats", on_tokens: Optional[Callable]) -> Callable:
        """emit(new tokens, their logprob entries): as Engine's hand-out, the tokens go out and may
        end the output (a stop token, a stop string, a complete grammar, max_new_tokens)."""
        out = row.out

        def emit(new: list, entries=(), timed: bool = True):
            out.extend(new)
            row.token_logprobs.extend(lp for lp in entries if lp is not None)
            if timed:
                stamp(stats.token_times, len(new), time.perf_counter())
            row.finish_reason = row.end_reason()
            for i, token in enumerate(new if on_tokens else ()):
                if on_tokens([token]):  # a stop string: what followed was never said
                    del out[len(out) - len(new) + i + 1:]
                    if entries:
                        kept = sum(lp is not None for lp in entries[i + 1:])
                        del row.token_logprobs[len(row.token_logprobs) - kept:]
                    row.finish_reason = "stop"
                    break
        return emit

    def propose(self, context: list, limit: int, sampling: Sampling, constraint=None, host: bool = False) -> tuple:
        """This round's proposals, at most limit, and their q: as many as the planner asks for and,
        of those in hand, chooses to verify (--adaptive_k); else limit. ([], None): a plain step."""
        n = self.planner.ask(context, limit) if self.adaptive else limit
        if n <= 0:
            return [], None
        start = time.perf_counter()
        drafts, q = self.proposer.propose_on_host(context, n, sampling, constraint) if host \
            else self.proposer.propose(context, n, sampling)
        self.planner.proposed(len(drafts), time.perf_counter() - start)
        if self.adaptive and drafts:
            n = self.planner.choose(drafts, len(context))
            drafts, q = drafts[:n], (None if q is None else q[:n])  # (a draft's are all verified)
        return drafts, q

    def plain_step(self, row: Request) -> int:
        """A round without proposals: the engine's compiled one-token step (sampling in the step),
        the one Engine.generate takes, so that it costs what plain decoding costs."""
        engine = self.engine
        if not engine.scheduler.make_room(row, row.fed + 1, StepPlan()):
            raise UserError("the KV cache cannot hold this sequence")
        plan = StepPlan(rides=[(row.known()[-1], row.fed, row.tables())], wants=[0], requests=[row])
        engine.sampling_for(plan)
        start = time.perf_counter()
        out = engine.run(plan)[0]
        token = int(out.view(-1)[0]) if plan.sampling is not None else int(sample(out[:1], row.sampling))
        self.planner.plain(time.perf_counter() - start)
        return token

    def speculative_decode(self, row: Request, budget: int, stop: set, stats: "SpecStats") -> list:
        """One round of a chain: propose, verify in one target forward, accept. Returns the new tokens
        (accepted proposals + the target's own token), cut after a stop token and to `budget`."""
        device, sampling, context = self.device, row.sampling, row.known()
        room = self.max_seq_length - row.fed - 1  # slots after the last token
        drafts, q = self.propose(context, min(self.k, budget - 1), sampling) \
            if budget > 1 and room >= self.k else ([], None)
        stats.target_forwards += 1
        if not drafts:  # nothing to check: a plain decoding step
            stats.plain_steps += 1
            return [self.plain_step(row)]
        proposed = len(drafts)
        start = time.perf_counter()
        target = target_picks(self.engine.feed(row, [context[-1]] + drafts, every=True), sampling)
        if sampling.temperature == 0:
            target = target.tolist()
            n = 0
            while n < proposed and drafts[n] == target[n]:
                n += 1
            next_token = target[n]
        else:
            if q is None:  # an n-gram or suffix proposal is a point mass
                q = torch.zeros(proposed, target.shape[-1], device=device).scatter_(
                    1, torch.tensor(drafts, device=device).view(-1, 1), 1.0)
            n, next_token = accept_sampled(target, q, drafts)
        self.planner.verified(proposed, n, time.perf_counter() - start)
        stats.histogram[n] += 1
        stats.proposed += proposed
        return self.kept(drafts[:n] + [next_token], stop, budget)

    def speculative_tree_decode(self, row: Request, budget: int, stop: set, stats: "SpecStats") -> list:
        """One round over a tree of candidates (tree.py): the proposer's tree, at most tree_nodes
        candidates and k deep, in one target forward; the longest accepted path's keys and values
        move to the positions it takes (tree.compact); with --adaptive_k, of it the nodes the
        TreePlanner picks (none: a plain step). Returns as speculative_decode."""
        sampling, context, engine = row.sampling, row.known(), self.engine
        room = self.max_seq_length - row.fed - 1  # slots after the last token
        nodes = min(self.tree_nodes, room)
        candidates = self.proposer.propose_tree(context, nodes, min(self.k, budget - 1)) \
            if budget > 1 and nodes > 0 else None
        if self.adaptive and candidates is not None and len(candidates) > 1:
            candidates = candidates.subtree(self.tree_planner.choose(candidates.children(), candidates.tokens, context))
        stats.target_forwards += 1
        if candidates is None or len(candidates) < 2:  # nothing to check: a plain decoding step
            stats.plain_steps += 1
            return [self.plain_step(row)]
        began = time.perf_counter()
        target = target_picks(engine.feed(row, candidates.tokens, every=True, tree=candidates), sampling)
        if sampling.temperature == 0:
            path, next_token = greedy_path(candidates, target.tolist())
        else:
            path, next_token = sampled_path(candidates, target)
        if self.adaptive:
            self.tree_planner.verified(candidates.children(), path, time.perf_counter() - began)
        self.compact_path(row, path)
        stats.histogram[len(path)] += 1
        stats.proposed += len(candidates) - 1
        return self.kept([candidates.tokens[node] for node in path] + [next_token], stop, budget)

    def compact_path(self, row: Request, path: list):
        """The accepted nodes' keys and values to positions row.fed + 1.. (node i was fed at row.fed + i)."""
        start, moved = row.fed, [(i, node) for i, node in enumerate(path, 1) if node != i]
        if moved:
            bs, tables = self.engine.block_size, row.tables()
            sources = [start + node for _, node in moved]
            targets = [start + i for i, _ in moved]
            compact(self.model, {sliding: (path_slots(table, bs, sources), path_slots(table, bs, targets))
                                 for sliding, table in ((False, tables[0]), (True, tables[1] or tables[0]))})

    def kept(self, new: list, stop: set, budget: int) -> list:
        """A round's accepted tokens and the target's own, cut after a stop token (what follows was
        never generated) and to budget; the proposer learns how many of its own were kept."""
        for i, token in enumerate(new):
            if token in stop:
                new = new[:i + 1]
                break
        new = new[:budget]
        self.proposer.accepted(len(new) - 1)
        return new

    def speculative_decode_host(self, context: list, pos: int, row: Request, budget: int, stop: set,
                                stats: SpecStats) -> tuple:
        """One round picked on the host from the target's logits, as Engine.generate picks (penalties,
        logit_bias, the grammar's mask, then sampling; logprobs), under the row's grammar if it has
        one. context[pos:]: the tokens the target has not seen (a picked one, and any a grammar
        forced after it); after them the verify feeds `build_block`'s block, and the target picks at
        each proposal and after the block. Returns (new tokens, their logprob entries (None where
        none is recorded), how many tokens past pos the target's cache now holds)."""
        device, sampling, c = self.device, row.sampling, row.constraint
        # as Request.take: with logprobs asked for, forced tokens are picked one by one (each has its logprob)
        jump = self.jump_forward and row.logprobs is None
        unfed = context[pos:]
        u, V = len(unfed), self.model.args.vocab_size
        limit = min(budget - 1, self.max_seq_length - pos - u)  # block tokens: the target's own token takes the last one
        drafts, q = self.propose(context, min(self.k, limit), sampling, c, host=True) if limit > 0 else ([], None)
        allowed = drafts[:c.valid_prefix(drafts)] if c is not None and drafts else drafts
        masks = torch.empty(len(allowed) + 1, (V + 31) // 32, dtype=torch.int32) if c is not None else None
        block, choices, bonus = build_block(allowed, c, masks, stop, limit, jump)
        m, L = len(choices), len(block)
        stats.target_forwards += 1
        start = time.perf_counter()
        logits = self.engine.feed(row, unfed + block, every=True)  # (u + L, V)
        if not m:  # nothing checked: a plain step over the unfed tokens
            stats.plain_steps += 1
        picks = choices + ([L] if bonus else [])  # row u - 1 + j predicts block[j]
        x = logits[[u - 1 + j for j in picks]].float()  # (m + bonus, V)
        if sampling.adjusts:  # each pick's penalties count the block's tokens before it
            x = adjust_logits(x, [replace(row, out=row.out + block[:j]) for j in picks])
        if c is not None:
            x = apply_mask(x, unpack_mask_on_host(masks[:len(picks)], V).to(device))
        n, token = verify_on_host(x, [block[j] for j in choices], q if q is None else q[choices], sampling)
        kept = choices[n] if n < m else L  # block tokens before the first rejected proposal
        if m:
            stats.histogram[n] += 1
            stats.proposed += m
            if u == 1 and L == m:  # a verify alone (no forced tokens): its time is f(m)'s
                self.planner.verified(m, n, time.perf_counter() - start)
            else:
                self.planner.acceptance.record(m, n)
        new = block[:kept] + ([token] if token is not None else [])
        if drafts:  # (also when the grammar cut them all); the last new token is fed next round
            self.proposer.accepted(min(common_prefix(drafts, new), len(new) - 1))
        chosen = [choices[j] for j in range(n)] + ([kept] if token is not None else [])  # where the target picked
        entries = [None] * len(new)
        if row.logprobs is not None:
            for j, lp in zip(chosen, token_logprobs(logits[[u - 1 + j for j in chosen]], [new[j] for j in chosen],
                                                    [row.logprobs] * len(chosen))):
                entries[j] = lp
        if c is not None:
            new, entries = consume(row, new, entries, jump and new[-1] not in stop, budget)
        return new, entries, u + kept

    def metrics(self, stats: SpecStats) -> dict:
        """Engine's decode metrics plus the acceptance figures; bandwidth counts the target's
        weights once per forward and the draft's once per draft step."""
        metrics = decode_metrics(stats, self.model, self.device)
        verifies = sum(stats.histogram)
        forwards, decoded = stats.target_forwards, stats.new_tokens - 1  # the first token comes from prefill
        metrics.update({
            "proposer": self.proposer.name,
            "speculate_k": stats.k,
            "target_forwards": forwards,
            "tokens_per_target_forward": decoded / forwards if forwards else 0.0,
            "mean_accepted_proposals": sum(i * h for i, h in enumerate(stats.histogram)) / verifies if verifies else 0.0,
            "acceptance_histogram": stats.histogram,
            "plain_steps": stats.plain_steps,
            "draft_forwards": stats.draft_forwards,
        })
        if stats.decode_s > 0:
            read = param_bytes(self.model) * forwards
            if self.proposer.model is not None:
                read += param_bytes(self.proposer.model) * stats.draft_forwards
            metrics["bandwidth_gb_s"] = read / stats.decode_s / 1e9
        return metrics


def stamp(times: list, n: int, now: float):
    """The arrival times of n tokens that a round hands out together at `now`: spread evenly since
    the previous tokens, so that a gap is what a token cost (at one timestamp, the median gap was
    0 ms); the first round counts once, as in Engine."""
    if not times:
        times.append(now)
    else:
        last = times[-1]
        times.extend(last + (now - last) * (i + 1) / n for i in range(n))
