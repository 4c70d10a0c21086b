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

How many: each request's k follows speculative.next_k (twice as many after a block accepted whole,
one more than were accepted after a rejection); a step holds at most STEP_VERIFY_ROWS rows less
one per decoding request of proposals, shared out among the speculating ones. On 2 CPU cores a
step of a few rows costs the weights' read, each row more a fraction of it; with many rows it
computes, and a proposal row costs about what a token gives (benchmarks/serve-speculative.json).
"""
from dataclasses import dataclass
from typing import Optional

from torch import Tensor

from errors import UserError
from proposers import NgramProposer
from speculative import ADAPTIVE_MIN_K, next_k, verify_on_host
from suffix import SuffixIndex

KINDS = ("ngram", "suffix")
# rows of proposals a step takes, less one per decoding request: none from this many streams on
STEP_VERIFY_ROWS = 12
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
    """A request's proposer state: its k, and its n-gram index or its sequence in the suffix trie."""
    k: int
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
        self.proposed = self.accepted = self.verifies = 0

    @staticmethod
    def takes(req) -> bool:
        """Whether req speculates: not opted out, and its tokens picked by its Sampling alone."""
        s = req.sampling
        return (req.speculative and req.constraint is None and req.logprobs is None and req.generator is None
                and (s is None or not s.adjusts))

    def propose(self, decoding: list) -> dict:
        """The proposals (request -> ids) of the step's decoding requests that speculate, within
        the step's rows of proposals and each one's remaining tokens."""
        taking = [r for r in decoding if self.takes(r)]
        rows = STEP_VERIFY_ROWS - len(decoding)
        if not taking or rows <= 0:
            return {}
        share, out = max(1, rows // len(taking)), {}
        for req in taking[:rows]:
            state = self.states.get(req) or self.start(req)
            k = min(state.k, share, req.max_new_tokens - len(req.out) - 1)
            if k < 1:
                continue
            context = req.known()
            drafts = (state.ngram.propose(context, k, req.sampling)[0] if state.ngram is not None
                      else self.suffix.propose(state.sequence, context, k))
            if drafts:
                out[req] = drafts
        return out

    def start(self, req) -> Speculating:
        state = Speculating(min(ADAPTIVE_MIN_K, self.k_max))
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
        state = self.states[req]
        state.k = next_k(state.k, n, len(drafts), self.k_max)
        self.verifies, self.proposed, self.accepted = self.verifies + 1, self.proposed + len(drafts), self.accepted + n
        return drafts[:n] + [token]

    def finish(self, req):
        """req ended: its state goes; its prompt and output join the suffix store (whether it speculated or not)."""
        state = self.states.pop(req, None)
        if self.suffix is not None:
            self.suffix.close(state.sequence if state is not None else self.suffix.open(), req.known())
