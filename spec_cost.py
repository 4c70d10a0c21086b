"""How many proposals a speculative round verifies (speculative.py, --adaptive_k): the count that
gives the most tokens per unit of time, from what a verify costs and how often proposals are
accepted, or none (a plain decoding step) when no count beats plain decoding.

    E[tokens(n)] = 1 + sum_{i=1..n} prod_{j<=i} a_j       (Leviathan et al. 2023, sec. 3.1, with
                                                           a rate per position instead of one)
    cost(n)      = f(n) + n * c                           in plain decoding steps
    n*           = argmax_n E[tokens(n)] / cost(n), and 0 unless that beats 1 by MIN_GAIN

- f(n) (`StepCosts`): a target forward over n + 1 tokens (a verify of n proposals) against a
  plain one-token step: running means of the rounds' own times, a prior (optimistic, so that
  verifies get tried and timed) where a size has not run. (Steps timed on the scratch block at
  warm-up took 15-30x a real step's time here: no guide to the real ones.)
- a_j (`Acceptance`): P(the j-th proposal is accepted | the ones before it were), decayed counts.
  Proposals that were not verified still count: the tokens decoded after them say how many
  would have been accepted (`Shadow`), so a proposer that starts being right again is noticed
  without paying a verify.
- c: one proposal's own cost (a draft model's step) in plain steps; n-gram and suffix lookups
  cost nothing next to a forward. A costly proposer that is not worth its cost is asked again
  only now and then (`Probe`: every 2, 4, 8 ... rounds while it keeps losing).
- The server (speculation.py): `RowCosts`, its batched step's time by its rows, and `share_rows`,
  each step's proposal rows per request (none where they do not pay), from each request's own
  `Acceptance` shrunk toward the server's.
- Trees (--speculate_tree): `TreePlanner` keeps the nodes of the proposer's tree that give the
  most expected tokens per cost (`best_tree`), from `TreeAcceptance`'s rate per depth and sibling
  rank and the StepCosts of a verify of that many tokens; none (a plain step) where no cut pays.
- Lookahead decoding (`LookaheadPlanner`): a round is one forward of a fixed size whatever its
  verification tree holds; it runs where that tree's expected tokens beat the forward's f(n), and
  otherwise only now and then (`Probe`), so that its window keeps moving.
- `ChainThreshold`: a draft model drafts until its chain's probability (the product of its
  probabilities of the tokens it chose) falls below a threshold that drops when its recent
  proposals were accepted and rises when they were not.
"""
import heapq
from typing import Optional

MIN_GAIN = 1.02  # the estimates are noisy: a count must beat plain decoding by this to be chosen
PRIOR_PER_TOKEN = 0.05  # f(n) = 1 + 0.05 n until measured (a CPU verify of a few tokens reads the weights once)
SMOOTH, FALL = 0.2, 0.5  # running means of times: the weight of a slower observation, of a faster one
DECAY = 0.8  # acceptance counts: an observation's weight falls by this at each newer one (about 5 rounds)
PRIOR_RATE, PRIOR_WEIGHT = 0.5, 1.0  # an acceptance rate before any observation, worth 1 observation


def running_mean(old: Optional[float], new: float) -> float:
    """A time's running mean: quick to fall, slow to rise (a slow step is mostly another process's
    doing, or a first call's; one moves the mean by at most a fifth of its size)."""
    if old is None:
        return new
    if new < old:
        return old + FALL * (new - old)
    return old + SMOOTH * (min(new, old * 2) - old)


def expected_tokens(rates: list) -> list:
    """E[tokens(n)] for n = 0 .. len(rates): the accepted proposals plus the target's own token."""
    out, survive = [1.0], 1.0
    for a in rates:
        survive *= a
        out.append(out[-1] + survive)
    return out


def best_count(rates: list, costs: list, per_proposal: float = 0.0, min_gain: float = MIN_GAIN) -> int:
    """The n in 0 .. len(rates) with the most expected tokens per plain step of cost: rates[j - 1] is
    a_j, costs[n] is f(n) (costs[0] = 1), per_proposal the proposer's cost of one proposal. 0 unless
    some n beats plain decoding (1 token per step) by min_gain."""
    best, best_gain = 0, min_gain
    for n, tokens in enumerate(expected_tokens(rates)):
        gain = tokens / (costs[n] + n * per_proposal)
        if n and gain > best_gain:
            best, best_gain = n, gain
    return best


class StepCosts:
    """Seconds of a target forward with n = 0 .. k proposals (0: a plain step), as running means;
    f(n) in plain steps, sizes not yet timed interpolated between the timed ones."""

    def __init__(self, k: int):
        self.seconds: list = [None] * (k + 1)

    def observe(self, n: int, seconds: float):
        old = self.seconds[n]
        if old is None and n and self.seconds[0] is not None:  # from the prior: one slow first call condemns no size
            old = self.seconds[0] * (1 + PRIOR_PER_TOKEN * n)
        self.seconds[n] = running_mean(old, seconds)

    def plain_seconds(self) -> Optional[float]:
        """A plain step's time: timed, or (none taken yet) a timed verify's over its prior f(n)."""
        if self.seconds[0] is not None:
            return self.seconds[0]
        return min((s / (1 + PRIOR_PER_TOKEN * n) for n, s in enumerate(self.seconds) if s is not None), default=None)

    def ratios(self) -> list:
        """f(0 .. k): at least 1, and f(n) at most f(m) for m > n (a shorter verify is never dearer:
        a slow outlier is overruled by a longer verify's time, and so gets tried and timed again)."""
        plain = self.plain_seconds()
        if plain is None:
            return [1 + PRIOR_PER_TOKEN * n for n in range(len(self.seconds))]
        timed = [(0, 1.0)] + [(n, s / plain) for n, s in enumerate(self.seconds) if n and s is not None]
        out = []
        for n in range(len(self.seconds)):
            below = max((x for x in timed if x[0] <= n), key=lambda x: x[0])
            above = [x for x in timed if x[0] > n]
            if below[0] == n:
                f = below[1]
            elif above:
                (n0, f0), (n1, f1) = below, min(above, key=lambda x: x[0])
                f = f0 + (f1 - f0) * (n - n0) / (n1 - n0)
            else:
                f = below[1] + PRIOR_PER_TOKEN * (n - below[0])
            out.append(max(f, 1.0))
        for n in range(len(out) - 2, 0, -1):
            out[n] = min(out[n], out[n + 1])
        return out


class Acceptance:
    """a_j = P(the j-th proposal is accepted | the ones before it were), j = 1 .. k, from decayed
    counts, each position's shrunk toward the pooled rate where it has few observations, or toward
    a parent's rates (the server's: every request's rounds, a prior for a request's own)."""

    def __init__(self, k: int, parent: Optional["Acceptance"] = None):
        self.tried, self.kept, self.parent = [0.0] * k, [0.0] * k, parent

    def record(self, proposed: int, accepted: int):
        """A round of `proposed` proposals of which the first `accepted` were (or would have been) kept."""
        for j in range(min(accepted + 1, proposed)):  # positions after the first rejection were not tried
            self.tried[j] = self.tried[j] * DECAY + 1
            self.kept[j] = self.kept[j] * DECAY + (j < accepted)
        if self.parent is not None:
            self.parent.record(proposed, accepted)

    def rates(self) -> list:
        if self.parent is not None:
            prior = self.parent.rates()
        else:
            prior = [(sum(self.kept) + PRIOR_RATE * PRIOR_WEIGHT) / (sum(self.tried) + PRIOR_WEIGHT)] * len(self.kept)
        return [(kept + p * PRIOR_WEIGHT) / (tried + PRIOR_WEIGHT) for kept, tried, p in zip(self.kept, self.tried, prior)]


class Shadow:
    """Proposals that were not verified, checked against the tokens decoded after them."""

    def __init__(self):
        self.drafts, self.at = [], 0

    def watch(self, drafts: list, at: int):
        """drafts proposed for positions at, at + 1, ...; ignored while earlier ones are unresolved."""
        if not self.drafts:
            self.drafts, self.at = list(drafts), at

    def check(self, known: list, acceptance: Acceptance):
        """Record how many would have been accepted once the tokens decoded since say so."""
        if not self.drafts:
            return
        seen = known[self.at:self.at + len(self.drafts)]
        n = 0
        while n < len(seen) and seen[n] == self.drafts[n]:
            n += 1
        if n < len(seen) or n == len(self.drafts):  # a mismatch, or all of them matched
            acceptance.record(len(self.drafts), n)
            self.drafts = []


class Probe:
    """How often a costly proposer that is not worth its cost is asked anyway: after 2 rounds,
    then 4, 8 ... (up to 64) while its proposals keep losing; every round again once one wins."""

    def __init__(self):
        self.interval, self.waited = 2, 0

    def due(self) -> bool:
        self.waited += 1
        return self.waited >= self.interval

    def outcome(self, won: bool):
        self.interval, self.waited = (2 if won else min(64, self.interval * 2)), 0


class ChainThreshold:
    """Threshold drafting: a draft stops once its chain's probability (the product of its
    probabilities of the tokens it chose) is below `value`, which moves with the acceptance of its
    recent proposals: LOWEST when they were all accepted (the draft is right more often than it
    thinks: draft further), HIGHEST when none were (propose only what it is sure of)."""

    LOWEST, HIGHEST = 0.05, 0.6

    def __init__(self, rate: float = PRIOR_RATE):
        self.rate = rate  # the running fraction of proposals accepted

    @property
    def value(self) -> float:
        return self.HIGHEST - (self.HIGHEST - self.LOWEST) * self.rate

    def update(self, proposed: int, accepted: int):
        if proposed:
            self.rate += SMOOTH * (accepted / proposed - self.rate)


class RoundPlanner:
    """Each round's proposal count for one SpeculativeEngine: `ask` before proposing (how many the
    proposer may make), `choose` with proposals in hand (how many to verify), then `verified` or
    `plain` with the target's time. cheap: the proposer costs nothing next to a target step."""

    def __init__(self, k: int, cheap: bool, costs: StepCosts):
        self.k, self.cheap, self.costs = k, cheap, costs
        self.acceptance, self.shadow, self.probe = Acceptance(k), Shadow(), Probe()
        self.proposal_seconds: Optional[float] = None  # a costly proposer's time per proposal, running mean

    def per_proposal(self) -> float:
        plain = self.costs.plain_seconds()
        if self.cheap or plain is None or self.proposal_seconds is None:
            return 0.0
        return self.proposal_seconds / plain

    def ask(self, known: list, limit: int) -> int:
        """How many proposals to make this round (0: none, a plain step), at most limit."""
        self.shadow.check(known, self.acceptance)
        if self.cheap or limit <= 0:
            return limit
        n = best_count(self.acceptance.rates()[:limit], self.costs.ratios(), self.per_proposal())
        if n == 0 and self.probe.due():
            return min(2, limit)
        return n

    def choose(self, drafts: list, at: int) -> int:
        """How many of the proposals in hand (for positions at, at + 1, ...) to verify; the rest are
        watched (cheap proposers: the proposals cost nothing, only the verify counts)."""
        if not self.cheap:
            return len(drafts)
        n = best_count(self.acceptance.rates()[:len(drafts)], self.costs.ratios())
        if n == 0:
            self.shadow.watch(drafts, at)
        return n

    def proposed(self, n: int, seconds: float):
        """A costly proposer took `seconds` for n proposals."""
        if n:
            self.proposal_seconds = running_mean(self.proposal_seconds, seconds / n)

    def verified(self, proposed: int, accepted: int, seconds: float):
        self.costs.observe(proposed, seconds)
        self.acceptance.record(proposed, accepted)
        if not self.cheap:
            self.probe.outcome(best_count(self.acceptance.rates()[:proposed], self.costs.ratios(),
                                          self.per_proposal()) > 0)

    def plain(self, seconds: float):
        self.costs.observe(0, seconds)


# ---------------------------------------------------------------- the server's batched step

class RowCosts:
    """Seconds of the server's batched step by its rows (steps whose every row wants logits:
    decoding and verify rows), as running means. A count not yet timed is interpolated between
    timed ones; past the largest at the mean slope of the timed ones (at least PRIOR_PER_TOKEN of
    a one-row step per row: optimistic, so that a larger step gets tried and timed)."""

    def __init__(self):
        self.seconds: dict = {}

    def observe(self, rows: int, seconds: float):
        old = self.seconds.get(rows)
        if old is None and self.seconds:  # from the estimate: one slow first step condemns no count
            old = self.curve(rows)[rows]
        self.seconds[rows] = running_mean(old, seconds)

    def curve(self, upto: int) -> list:
        """t(0 .. upto), in seconds (in one-row steps while nothing is timed); t(r) never above t(r + 1)."""
        timed = sorted(self.seconds.items())
        if not timed:
            return [1 + PRIOR_PER_TOKEN * (r - 1) for r in range(upto + 1)]
        (r0, t0), (r1, t1) = timed[0], timed[-1]
        least = PRIOR_PER_TOKEN * t0 / (1 + PRIOR_PER_TOKEN * max(r0 - 1, 0))
        slope = max(least, (t1 - t0) / (r1 - r0) if r1 > r0 else 0.0)
        out, i = [], 0
        for r in range(max(upto, r1) + 1):  # (to the widest timed, which caps the narrower)
            while i < len(timed) and timed[i][0] < r:
                i += 1  # timed[i]: the first count timed at r or above
            if i == len(timed):
                out.append(t1 + slope * (r - r1))
            elif timed[i][0] == r:
                out.append(timed[i][1])
            elif i == 0:
                out.append(max(t0 - least * (r0 - r), least))
            else:
                (ra, ta), (rb, tb) = timed[i - 1], timed[i]
                out.append(ta + (tb - ta) * (r - ra) / (rb - ra))
        for r in range(len(out) - 2, -1, -1):
            out[r] = min(out[r], out[r + 1])
        return out[:upto + 1]


def share_rows(base: int, rates: list, seconds: list, min_gain: float = MIN_GAIN) -> list:
    """How many proposal rows each request gets in a step of `base` decoding rows: rates[i] are
    request i's a_j for the proposals it has (or may have), seconds[r] the step's time with r rows
    (as long as base plus every proposal). Rows go one at a time to the request whose next
    proposal is likeliest to be accepted (the probability that it and those before it are: what it
    adds to the expected tokens, never more than its previous one's), and the step takes the
    number of rows whose expected tokens per second is highest, none unless that beats the base
    step's `base` tokens by min_gain. At one request a verify of many rows costs little more than
    a plain step; at many, each row costs what a token gives and none pay."""
    given, heap = [0] * len(rates), [(-r[0], i) for i, r in enumerate(rates) if r]
    heapq.heapify(heap)
    order, tokens, best, best_gain = [], float(base), 0, min_gain * base / seconds[base]
    while heap and base + len(order) + 1 < len(seconds):
        gain, i = heapq.heappop(heap)  # (negated)
        order.append(i)
        given[i] += 1
        tokens -= gain
        if given[i] < len(rates[i]):
            heapq.heappush(heap, (gain * rates[i][given[i]], i))
        if tokens / seconds[base + len(order)] > best_gain:
            best, best_gain = len(order), tokens / seconds[base + len(order)]
    counts = [0] * len(rates)
    for i in order[:best]:
        counts[i] += 1
    return counts


# ---------------------------------------------------------------- trees (speculative.py --speculate_tree)

RANKS = 3  # a node's children from the third on share the third's rate


class TreeAcceptance:
    """a[d][r] = P(the target's token after a node at depth d is its r-th child's | it is none of the
    children before it), from decayed counts, each cell shrunk toward its rank's pooled rate."""

    def __init__(self, depth: int):
        self.tried = [[0.0] * RANKS for _ in range(depth)]
        self.kept = [[0.0] * RANKS for _ in range(depth)]

    def record(self, children: list, path: list):
        """A verified tree (children[i]: node i's children in order) whose accepted nodes were path."""
        for d, node in enumerate([0] + path[:len(self.tried) - 1]):
            chosen = path[d] if d < len(path) else None
            for r, child in enumerate(children[node]):  # children after the chosen one were not tried
                cell = min(r, RANKS - 1)
                self.tried[d][cell] = self.tried[d][cell] * DECAY + 1
                self.kept[d][cell] = self.kept[d][cell] * DECAY + (child == chosen)
                if child == chosen:
                    break

    def rates(self) -> list:
        pooled = [(sum(k[r] for k in self.kept) + PRIOR_RATE * PRIOR_WEIGHT) /
                  (sum(t[r] for t in self.tried) + PRIOR_WEIGHT) for r in range(RANKS)]
        return [[(k + p * PRIOR_WEIGHT) / (t + PRIOR_WEIGHT) for k, t, p in zip(kept, tried, pooled)]
                for kept, tried in zip(self.kept, self.tried)]


def grow_tree(children: list, rates: list) -> list:
    """A tree's candidates in the order that adds the most expected tokens first, each with the
    probability that the accepted path passes through it: [(node, probability)]. A node joins after
    its parent and its elder siblings (its probability counts their rejection): E[tokens] of the
    first n is 1 plus their probabilities (the path's nodes, then the target's own token)."""
    out, heap = [], []

    def offer(parent: int, rank: int, depth: int, reach: float, missed: float):
        if rank < len(children[parent]) and depth < len(rates):
            p = reach * missed * rates[depth][min(rank, RANKS - 1)]
            heapq.heappush(heap, (-p, children[parent][rank], parent, rank, depth, reach, missed))
    offer(0, 0, 0, 1.0, 1.0)
    while heap:
        p, node, parent, rank, depth, reach, missed = heapq.heappop(heap)
        out.append((node, -p))
        offer(node, 0, depth + 1, -p, 1.0)
        offer(parent, rank + 1, depth, reach, missed * (1 - rates[depth][min(rank, RANKS - 1)]))
    return out


def best_tree(children: list, rates: list, costs: list, min_gain: float = MIN_GAIN) -> list:
    """The candidates (node indices, ascending) of the proposer's tree to verify: the first n of
    grow_tree's order with the most expected tokens per plain step of cost (costs[n] = f(n), a verify
    of n candidates); [] (a plain step) unless that beats plain decoding by min_gain."""
    grown = grow_tree(children, rates)[:len(costs) - 1]
    tokens, best, best_gain = 1.0, 0, min_gain
    for n, (_, p) in enumerate(grown, 1):
        tokens += p
        if tokens / costs[n] > best_gain:
            best, best_gain = n, tokens / costs[n]
    return sorted(node for node, _ in grown[:best])


class TreeShadow:
    """A tree that was not verified, checked against the tokens decoded after it (as `Shadow`)."""

    def __init__(self):
        self.children: Optional[list] = None

    def watch(self, children: list, tokens: list, at: int):
        """tokens[i]: node i's; its candidates at depth d are for position at + d - 1."""
        if self.children is None:
            self.children, self.tokens, self.at = children, tokens, at

    def check(self, known: list, acceptance: TreeAcceptance):
        if self.children is None:
            return
        node, path = 0, []
        while self.children[node]:
            if self.at + len(path) >= len(known):
                return  # the token that decides is not decoded yet
            follow = [c for c in self.children[node] if self.tokens[c] == known[self.at + len(path)]]
            if not follow:
                break
            node = follow[0]
            path.append(node)
        acceptance.record(self.children, path)
        self.children = None


class TreePlanner:
    """Each tree round's candidates for one SpeculativeEngine (--speculate_tree with --adaptive_k): of
    the proposer's tree, the ones `best_tree` picks from the shared StepCosts and the per-depth
    acceptance, or none (a plain step: the tree is watched instead), so that a tree round is never
    expected to do worse than a chain of its likeliest branch or a plain step."""

    def __init__(self, depth: int, costs: StepCosts):
        self.costs, self.acceptance, self.shadow = costs, TreeAcceptance(depth), TreeShadow()

    def choose(self, children: list, tokens: list, known: list) -> list:
        """The nodes to verify of a tree after the sequence known (its root is known[-1])."""
        self.shadow.check(known, self.acceptance)
        nodes = best_tree(children, self.acceptance.rates(), self.costs.ratios())
        if not nodes:
            self.shadow.watch(children, tokens, len(known))
        return nodes

    def verified(self, children: list, path: list, seconds: float):
        """A verify of the tree cut to what was chosen (children of its nodes) took seconds."""
        self.costs.observe(len(children) - 1, seconds)
        self.acceptance.record(children, path)


class LookaheadPlanner:
    """Whether a lookahead round (lookahead.py: one forward of `size` tokens, whatever its
    verification tree holds) beats a plain step: the tree's expected tokens (grow_tree over
    TreeAcceptance's rates, kept up by TreeShadow where no round ran) against f(size - 1). A round
    that does not pay still runs now and then (Probe), so that the window's trajectory moves on and
    fills the pool where the text turns repetitive."""

    def __init__(self, size: int, depth: int, costs: StepCosts):
        self.n, self.costs = size - 1, costs
        self.acceptance, self.shadow, self.probe = TreeAcceptance(depth), TreeShadow(), Probe()

    def pays(self, children: list) -> bool:
        tokens = 1 + sum(p for _, p in grow_tree(children, self.acceptance.rates()))
        return tokens > self.costs.ratios()[self.n] * MIN_GAIN

    def ask(self, children: list, tokens: list, known: list) -> bool:
        """Whether to run the round whose tree (children, tokens) follows the sequence known."""
        self.shadow.check(known, self.acceptance)
        if self.pays(children):
            return True
        if len(children) > 1:
            self.shadow.watch(children, tokens, len(known))
        return self.probe.due()

    def verified(self, children: list, path: list, seconds: float):
        """A round took seconds and accepted path."""
        self.costs.observe(self.n, seconds)
        self.acceptance.record(children, path)
        self.probe.outcome(self.pays(children))  # one lucky path is not a trend: what the rates now say
