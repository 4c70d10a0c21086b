"""Speculation in the server's batched step (serve.py --speculative): a request's proposals ride in
the step beside the other rows. Its last token and up to k proposals are one-token rows at their
positions, each wanting its logits (a *verify*); each verify accepts its own count with
speculative.py's rule (greedy: the longest prefix of proposals equal to the target's argmax, then
the target's own token; sampling: Leviathan et al.'s rejection sampling, a proposal a point mass).
The request's cache advances by the accepted tokens only: the keys of rejected ones lie past it,
never sealed into the prefix cache, and the next feed writes over them.

Proposers, model-free: prompt lookup (`ngram`, proposers.NgramProposer, one per request) and
suffix matching (`suffix`, SuffixDecoding): one trie that every request's prompt and output go
into, so that a request proposes from earlier ones too. A draft model would need a KV cache per
request of its own beside the target's; the server refuses it.

Who speculates: a request that has not opted out (`speculative: false`) and whose tokens are picked
by its Sampling alone: a grammar, logprobs, penalties or logit_bias, or a seed (its own random
stream) run it without proposals, token by token as before.

How many (spec_cost.py): each step the rows of proposals that give the most expected tokens per
second of the step (`share_rows`), from the step's own times by its rows (`RowCosts`: a step of
one request costs about the weights' read, each row more a fraction of it; with many rows it
computes, and a row costs about what a token gives) and each request's acceptance per proposal
position (its own, shrunk toward the server's): a lone request proposes many, a crowd few or
none. A request given no rows is still asked now and then (every PROBE_EVERY steps), its
proposals checked against the tokens decoded after them (`Shadow`), so that a proposer that
starts being right again is noticed without paying a verify.
"""
from dataclasses import dataclass, field
from typing import Optional

from torch import Tensor

from errors import UserError
from proposers import NgramProposer
from spec_cost import Acceptance, RowCosts, Shadow, share_rows
from speculative import verify_on_host
from suffix import SuffixIndex

KINDS = ("ngram", "suffix")
PROBE_EVERY = 8  # a request given no rows is asked for proposals (watched, not verified) every this many steps
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


@dataclass(eq=False)
class Speculating:
    """A request's proposer state: its acceptance, its n-gram index or its sequence in the suffix trie."""
    acceptance: Acceptance
    shadow: Shadow = field(default_factory=Shadow)  # proposals it made without rows
    idle: int = 0  # steps since it was last asked for proposals
    ngram: Optional[NgramProposer] = None
    sequence: Optional[list] = None


class Speculation:
    """The server's proposer: proposals for a step's decoding requests, and each verify's tokens."""

    def __init__(self, kind: str, k_max: int = 8):
        if kind not in KINDS:
            raise UserError(f"--speculative {kind} is not served (choose {', '.join(KINDS)}; a draft model "
                            "needs a KV cache per request of its own)")
        if k_max < 1:
            raise UserError("--speculate_k must be at least 1")
        self.kind, self.k_max = kind, k_max
        self.suffix = SharedSuffixIndex() if kind == "suffix" else None
        self.states: dict = {}  # request -> Speculating
        self.acceptance = Acceptance(k_max)  # every request's rounds: the prior of each one's own
        self.row_costs = RowCosts()
        self.max_rows: Optional[int] = None  # the widest step the engine runs without compiling (warmup.widest_rows)
        self.proposed = self.accepted = self.verifies = 0

    @staticmethod
    def takes(req) -> bool:
        """Whether req speculates: not opted out, and its tokens picked by its Sampling alone."""
        s = req.sampling
        return (req.speculative and req.constraint is None and req.logprobs is None and req.generator is None
                and (s is None or not s.adjusts))

    def timed(self, rows: int, seconds: float):
        """A step of this many rows, each wanting its logits, took seconds (Engine.step)."""
        self.row_costs.observe(rows, seconds)

    def propose(self, decoding: list) -> dict:
        """The proposals (request -> ids) of the step's decoding requests that speculate, as many
        as share_rows gives each (asked of those it hopes to give rows, and of the idle now and then)."""
        taking = [r for r in decoding if self.takes(r)]
        if not taking:
            return {}
        states = [self.states.get(r) or self.start(r) for r in taking]
        caps = [max(0, min(self.k_max, r.max_new_tokens - len(r.out) - 1)) for r in taking]
        widest = len(decoding) + sum(caps)
        seconds = self.row_costs.curve(widest if self.max_rows is None else max(min(widest, self.max_rows), len(decoding)))
        rates = []
        for req, state, cap in zip(taking, states, caps):
            state.shadow.check(req.known(), state.acceptance)
            rates.append(state.acceptance.rates()[:cap])
        drafts = []
        for req, state, cap, hoped in zip(taking, states, caps, share_rows(len(decoding), rates, seconds)):
            state.idle += 1
            asked = cap > 0 and (hoped > 0 or state.idle >= PROBE_EVERY)
            drafts.append(self.drafts(req, state, cap) if asked else [])
            state.idle = 0 if asked else state.idle
        out = {}
        counts = share_rows(len(decoding), [r[:len(d)] for r, d in zip(rates, drafts)], seconds)
        for req, state, d, n in zip(taking, states, drafts, counts):
            if n:
                out[req] = d[:n]
            elif d:
                state.shadow.watch(d, len(req.known()))
        return out

    def drafts(self, req, state: Speculating, k: int) -> list:
        context = req.known()
        return (state.ngram.propose(context, k, req.sampling)[0] if state.ngram is not None
                else self.suffix.propose(state.sequence, context, k))

    def start(self, req) -> Speculating:
        state = Speculating(Acceptance(self.k_max, parent=self.acceptance))
        if self.suffix is not None:
            state.sequence = self.suffix.open()
        else:
            state.ngram = NgramProposer(NGRAM_MAX_N)
        self.states[req] = state
        return state

    def accept(self, req, logits: Tensor, drafts: list) -> list:
        """A verify's new tokens from the target's logits (1 + m, V) over [last token, d_1 .. d_m]:
        the accepted proposals, then the target's own token."""
        n, token = verify_on_host(logits.float(), drafts, None, req.sampling)
        self.states[req].acceptance.record(len(drafts), n)
        self.verifies, self.proposed, self.accepted = self.verifies + 1, self.proposed + len(drafts), self.accepted + n
        return drafts[:n] + [token]

    def finish(self, req):
        """req ended: its state goes; its prompt and output join the suffix store (whether it speculated or not)."""
        state = self.states.pop(req, None)
        if self.suffix is not None:
            self.suffix.close(state.sequence if state is not None else self.suffix.open(), req.known())
