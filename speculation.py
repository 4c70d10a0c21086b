"""Speculation in the server's batched step (serve.py --speculative): a request's proposals ride in
the step beside the other rows. Its last token and up to k proposals are one-token rows at their
positions, each wanting its logits (a *verify*); each verify accepts its own count with
speculative.py's rule (greedy: the longest prefix of proposals equal to the target's argmax, then
the target's own token; sampling: Leviathan et al.'s rejection sampling, a model-free proposal a
point mass, a draft's drawn from its q).
The request's cache advances by the accepted tokens only: the keys of rejected ones lie past it,
never sealed into the prefix cache, and the next feed writes over them.

Proposers, model-free: prompt lookup (`ngram`, proposers.NgramProposer, one per request) and
suffix matching (`suffix`, SuffixDecoding): one trie that every request's prompt and output go
into, so that a request proposes from earlier ones too. A draft model (`draft`, draft_rows.py):
a row of the draft's own cache per speculating request, every asked request drafted in the same
batched draft forwards; a sampled draft's distribution q goes to the verify. Lookahead decoding
(`lookahead`, `LookaheadRounds`): no proposer; while one request decodes, its round is a chunk of
the step (a tree and a window under one mask), not rows.

Who speculates: a request that has not opted out (`speculative: false`) and whose tokens are picked
by its Sampling alone: a grammar, logprobs, penalties or logit_bias, or a seed (its own random
stream) run it without proposals, token by token as before.

How many (spec_cost.py): each step the rows of proposals that give the most expected tokens per
second of the step (`share_rows`), from the step's own times by its rows (`RowCosts`: a step of
one request costs about the weights' read, each row more a fraction of it; with many rows it
computes, and a row costs about what a token gives) and each request's acceptance per proposal
position (its own, shrunk toward the server's): a lone request proposes many, a crowd few or
none. A draft's forwards count too (a proposal row past the step's decoding rows: a draft
forward more, k_max at most, as the draft drafts every asked request at once); a draft is asked
for as many as the rows it is hoped to get, not more (its catch-up chunks are not counted). A
request given no rows is still asked now and then (every PROBE_EVERY steps), its
proposals checked against the tokens decoded after them (`Shadow`), so that a proposer that
starts being right again is noticed without paying a verify.
"""
import time
from dataclasses import dataclass, field
from typing import Optional

from torch import Tensor

from errors import UserError
from lookahead import Branches, LookaheadProposer
from proposers import NgramProposer
from sampling import logits_to_probs
from spec_cost import Acceptance, LookaheadPlanner, RowCosts, Shadow, StepCosts, share_rows
from speculative import verify_on_host
from suffix import SuffixIndex
from tree import compact, greedy_path, path_slots, sampled_path

KINDS = ("ngram", "suffix", "draft", "lookahead")
PROBE_EVERY = 8  # a request given no rows is asked for proposals (watched, not verified) every this many steps
PROBE_DRAFTS = 2  # ... a draft model asked so drafts this many (each a forward)
NGRAM_MAX_N = 3  # prompt lookup matches the last 3 tokens, then 2, then 1 (generate.py --ngram 3)


class SharedSuffixIndex(SuffixIndex):
    """A SuffixIndex in which several requests generate at once: each has a sequence of its own in
    the one trie ([id, tokens, trie tails], switched in for its proposals); a finished one is stored
    with the earlier calls' sequences, the least recently used dropped past the cap."""

    def __init__(self, **options):
        super().__init__(**options)
        self.opened = 0  # sequence ids handed out

    def open(self) -> list:
        self.opened += 1
        return [self.opened, [], []]

    def propose(self, sequence: list, context: list, k: int) -> list:
        self.seq, self.tokens, self.tails = sequence
        try:
            return self.continuation(context, k)
        finally:
            sequence[2], self.tokens = self.tails, []  # (tokens grew in place)

    def close(self, sequence: list, context: list):
        """The request ended with these tokens: counted, and stored."""
        self.seq, self.tokens, self.tails = sequence
        self.extend(context)
        self.store()
        self.tokens, self.tails = [], []


class LookaheadRounds:
    """Lookahead decoding in the server (lookahead.py): while a step has one decoding request, its
    round is a chunk of the step, the verification tree and the window in one forward (a chunk
    with every token's logits and lookahead.Branches' mask), when spec_cost.LookaheadPlanner
    expects it to pay; with more decoding requests, plain rows (a round's window cannot ride in
    one-token rows). Each request keeps its own window and pool; the rounds' and the plain steps'
    times, the server's. After the forward, as lookahead_decode: the tree's accepted path, the
    window's guesses to the pool, and the path's keys and values moved to the positions it takes."""

    def __init__(self, window: int, ngram: int, candidates: int):
        self.sizes = window, ngram, candidates
        self.size = LookaheadProposer(*self.sizes).size  # the tokens a round feeds
        self.costs = StepCosts(self.size - 1)
        self.began = 0.0  # when the step of the last round proposed began
        self.model, self.block_size = None, 0  # the target's cache, where paths are compacted (Engine.setup)

    def start(self, state: "Speculating", context: list):
        state.lookahead = LookaheadProposer(*self.sizes)
        state.lookahead.start(context)
        state.planner = LookaheadPlanner(self.size, self.sizes[1] - 1, self.costs)

    def propose(self, req, state: "Speculating") -> Optional[Branches]:
        """req's round, if it has room (positions within what it may hold) and the planner asks for it."""
        context = req.known()
        last = len(context) - 1 + self.size  # past the chunk's last position
        if len(req.out) + 2 > req.max_new_tokens or last > len(req.prompt) + req.max_new_tokens:
            return None
        tree = state.lookahead.tree(context)
        if not state.planner.ask(tree.children(), tree.tokens, context):
            return None
        self.began = time.perf_counter()
        return state.lookahead.branches(context, tree)

    def accept(self, req, state: "Speculating", logits: Tensor, chunk: Branches) -> tuple:
        """(accepted nodes, the new tokens) of a round from its logits (size, V)."""
        tree, window = chunk.tree, state.lookahead.verify_size
        if req.sampling is None or req.sampling.temperature == 0:
            picks = logits.argmax(-1).tolist()  # one copy to the host
            path, token = greedy_path(tree, picks[:len(tree)])
            guesses = picks[window:]
        else:
            path, token = sampled_path(tree, logits_to_probs(logits[:len(tree)].float(), req.sampling))
            guesses = logits[window:].argmax(-1).tolist()
        state.planner.verified(tree.children(), path, time.perf_counter() - self.began)
        state.lookahead.observe(guesses)
        self.compact(req, path)
        return path, [tree.tokens[node] for node in path] + [token]

    def compact(self, req, path: list):
        """The accepted nodes' keys and values to positions req.fed + 1.. (node i was fed at req.fed + i)."""
        moved = [(i, node) for i, node in enumerate(path, 1) if node != i]
        if moved:
            bs, tables = self.block_size, req.tables()
            sources, targets = [req.fed + node for _, node in moved], [req.fed + i for i, _ in moved]
            compact(self.model, {sliding: (path_slots(table, bs, sources), path_slots(table, bs, targets))
                                 for sliding, table in ((False, tables[0]), (True, tables[1] or tables[0]))})


@dataclass(eq=False)
class Speculating:
    """A request's proposer state: its acceptance, its n-gram index or its sequence in the suffix trie
    (a draft's row is the DraftRows')."""
    acceptance: Acceptance
    shadow: Shadow = field(default_factory=Shadow)  # proposals it made without rows
    idle: int = 0  # steps since it was last asked for proposals
    ngram: Optional[NgramProposer] = None
    sequence: Optional[list] = None
    q: Optional[Tensor] = None  # a sampled draft's distributions (k, V), for its verify
    lookahead: Optional[LookaheadProposer] = None  # its window and pool, and whether its rounds pay
    planner: Optional[LookaheadPlanner] = None


class Speculation:
    """The server's proposer: proposals for a step's decoding requests, and each verify's tokens."""

    def __init__(self, kind: str, k_max: int = 8, draft=None, lookahead: tuple = (4, 3, 3)):
        """draft: with kind "draft", the draft_rows.DraftRows that proposes; lookahead: with kind
        "lookahead", its window, n-gram size and candidates (generate.py --lookahead W,N,G)."""
        if kind not in KINDS:
            raise UserError(f"--speculative {kind} is not served (choose {', '.join(KINDS)})")
        if k_max < 1:
            raise UserError("--speculate_k must be at least 1")
        if (kind == "draft") != (draft is not None):
            raise UserError("--speculative draft goes with a draft model (--draft_checkpoint)")
        self.kind, self.k_max, self.draft = kind, k_max, draft
        self.suffix = SharedSuffixIndex() if kind == "suffix" else None
        self.rounds = LookaheadRounds(*lookahead) if kind == "lookahead" else None
        self.states: dict = {}  # request -> Speculating
        self.acceptance = Acceptance(k_max)  # every request's rounds: the prior of each one's own
        self.row_costs = RowCosts()
        self.max_rows: Optional[int] = None  # the widest step the engine runs without compiling (warmup.widest_rows)
        self.proposed = self.accepted = self.verifies = 0

    def attach(self, model, block_size: int, max_rows: Optional[int]):
        """The engine's: its widest step that compiles nothing (warmup.widest_rows), and the target
        and its blocks' size, where a lookahead round's path is compacted."""
        self.max_rows = max_rows
        if self.rounds is not None:
            self.rounds.model, self.rounds.block_size = model, block_size

    @staticmethod
    def takes(req) -> bool:
        """Whether req speculates: not opted out, and its tokens picked by its Sampling alone."""
        s = req.sampling
        return (req.speculative and req.constraint is None and req.logprobs is None and req.generator is None
                and (s is None or not s.adjusts))

    def timed(self, rows: int, seconds: float):
        """A step of this many rows, each wanting its logits, took seconds (Engine.step)."""
        self.row_costs.observe(rows, seconds)
        if self.rounds is not None and rows == 1:  # the plain step a lookahead round stands against
            self.rounds.costs.observe(0, seconds)

    def propose(self, decoding: list) -> dict:
        """The proposals (request -> ids) of the step's decoding requests that speculate, as many
        as share_rows gives each (asked of those it hopes to give rows, and of the idle now and then)."""
        taking = [r for r in decoding if self.takes(r)]
        if not taking or self.rounds is not None and len(decoding) > 1:
            return {}
        if self.rounds is not None:  # (a request's round: lookahead.Branches, a chunk of the step)
            branches = self.rounds.propose(taking[0], self.states.get(taking[0]) or self.start(taking[0]))
            return {taking[0]: branches} if branches is not None else {}
        states = [self.states.get(r) or self.start(r) for r in taking]
        caps = [max(0, min(self.k_max, r.max_new_tokens - len(r.out) - 1)) for r in taking]
        widest = len(decoding) + sum(caps)
        seconds = self.row_costs.curve(widest if self.max_rows is None else max(min(widest, self.max_rows), len(decoding)))
        rates = []
        for req, state, cap in zip(taking, states, caps):
            state.shadow.check(req.known(), state.acceptance)
            rates.append(state.acceptance.rates()[:cap])
        asked = []
        for req, state, cap, hoped in zip(taking, states, caps, share_rows(len(decoding), rates,
                                                                          self.drafting(seconds, len(decoding)))):
            state.idle += 1
            if cap > 0 and (hoped > 0 or state.idle >= PROBE_EVERY):
                # a lookup costs nothing: all it has; a draft forwards for each, so the rows hoped for
                asked.append((req, cap if self.draft is None else hoped or min(cap, PROBE_DRAFTS)))
                state.idle = 0
        found = self.drafts(asked)
        drafts = [found.get(req, []) for req in taking]
        out = {}
        counts = share_rows(len(decoding), [r[:len(d)] for r, d in zip(rates, drafts)], seconds)
        for req, state, d, n in zip(taking, states, drafts, counts):
            if n:
                out[req] = d[:n]
            elif d:
                state.shadow.watch(d, len(req.known()))
        return out

    def drafting(self, seconds: list, base: int) -> list:
        """A step's seconds by its rows, with a draft's forwards: a proposal row past the base
        decoding rows is a draft forward more, k_max at most (the draft drafts every request at
        once); counted once both are timed (before, a step's are in one-row steps, not seconds)."""
        per = self.draft.seconds if self.draft is not None and self.row_costs.seconds else None
        if per is None:
            return seconds
        return [t + per * min(max(r - base, 0), self.k_max) for r, t in enumerate(seconds)]

    def drafts(self, asked: list) -> dict:
        """Each asked (request, k): its proposals, up to k (a draft's q kept for the verify)."""
        if self.draft is not None:
            found = self.draft.propose(asked)
            for req, (_, q) in found.items():
                self.states[req].q = q
            return {req: d for req, (d, _) in found.items()}
        out = {}
        for req, k in asked:
            state, context = self.states[req], req.known()
            out[req] = (state.ngram.propose(context, k, req.sampling)[0] if state.ngram is not None
                        else self.suffix.propose(state.sequence, context, k))
        return out

    def start(self, req) -> Speculating:
        state = Speculating(Acceptance(self.k_max, parent=self.acceptance))
        if self.suffix is not None:
            state.sequence = self.suffix.open()
        elif self.kind == "ngram":
            state.ngram = NgramProposer(NGRAM_MAX_N)
        elif self.rounds is not None:
            self.rounds.start(state, req.known())
        self.states[req] = state
        return state

    def accept(self, req, logits: Tensor, drafts: list) -> list:
        """A verify's new tokens from the target's logits (1 + m, V) over [last token, d_1 .. d_m]:
        the accepted proposals, then the target's own token (drafts: a lookahead round's Branches,
        its logits (size, V): its accepted path, then the target's token)."""
        state = self.states[req]
        if isinstance(drafts, Branches):  # a lookahead round's chunk: logits (size, V)
            path, new = self.rounds.accept(req, state, logits, drafts)
            n, proposed = len(path), len(drafts.tree) - 1
        else:
            q = None if state.q is None else state.q[:len(drafts)]  # a draft's draws; else point masses
            n, token = verify_on_host(logits.float(), drafts, q, req.sampling)
            state.acceptance.record(len(drafts), n)
            new, proposed = drafts[:n] + [token], len(drafts)
        self.verifies, self.proposed, self.accepted = self.verifies + 1, self.proposed + proposed, self.accepted + n
        return new

    def finish(self, req):
        """req ended: its state and draft row go; its prompt and output join the suffix store (whether
        it speculated or not)."""
        state = self.states.pop(req, None)
        if self.draft is not None:
            self.draft.release(req)
        if self.suffix is not None:
            self.suffix.close(state.sequence if state is not None else self.suffix.open(), req.known())
