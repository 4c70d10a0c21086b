"""Staged speculative decoding (Spector and Re 2023, arXiv 2308.04623): a draft model proposes a
tree, not a chain, and the draft is itself sped up by a cheaper proposer.

    python generate.py --checkpoint checkpoints/qwen2.5-coder-1.5b --staged \\
        --draft_checkpoint checkpoints/qwen2.5-coder-0.5b --speculate_k 6 --prompt "def quicksort(xs):"

- The tree (`StagedProposer.propose_tree`): a main chain of the draft's picks (its argmax, or a draw
  from its distribution q when sampling), up to `depth` deep; where the draft is unsure (its most
  likely token below `branch_below`) the position gets a second child, a leaf: the draft's second
  choice, or a second independent draw from q. Siblings never take the slots the chain may still
  need, so the tree holds at most `nodes` candidates. The target checks the whole tree in one
  forward (speculative.speculative_tree_decode).
- The second stage: where prompt lookup (an n-gram of the context, proposers.NgramProposer)
  predicts the next tokens, the draft feeds them all in one forward of its own and keeps the
  prefix its own picks agree with (greedy: its argmax; sampling: each guess accepted with the
  draft's probability of it, else a draw from q without it, so every pick is still a draw from
  q), instead of one forward per token. Greedy, it drafts the very tokens it drafts alone.
- Sampling: node i's children are independent draws from q[i], which the tree carries (Tree.q);
  tree.sampled_path accepts a child with min(1, r / q) (SpecInfer's multi-step speculative
  sampling): the output is the target's distribution, and a draft close to the target is
  accepted nearly always (a point mass would be accepted with the target's probability only).
- The draft's cache holds its main chain; the target may keep a path that leaves it at a sibling,
  so each round first forgets what the draft fed past the context's common prefix, then feeds what
  it has not seen (the accepted path, the target's token) in the round's first forward, before
  the root and its guesses.
"""
from typing import Callable, Optional

import torch
from torch import Tensor

from compile import compile_chunk
from model import Transformer
from proposers import DraftProposer, NgramProposer, common_prefix
from sampling import Sampling, logits_to_probs, sample_probs
from tree import Tree

BRANCH_BELOW = 0.8  # a draft less sure than this of its pick adds its second choice as a sibling
LOOKUP_N = (3, 2)  # the second stage's n-grams: the last 3 tokens, then 2 (a single token guesses too often wrong)


def draft_rows(model: Transformer, tokens: Tensor, input_pos: Tensor) -> Tensor:
    """The draft's logits (T, V) after each of tokens (1, T), fed at positions input_pos (T,)."""
    return model(tokens, input_pos)[0]


def draw(q: Tensor, guess: Optional[int]) -> int:
    """A draw from q (V,) that takes `guess` where it can: the guess is accepted with probability
    q(guess), else the draw is from q without it (rejection sampling of a point mass: still q)."""
    if guess is not None:
        if float(torch.rand(())) < float(q[guess]):
            return guess
        q = q.clone()
        q[guess] = 0
        if float(q.sum()) <= 0:
            return guess
    return int(sample_probs(q.unsqueeze(0)))


class StagedProposer(DraftProposer):
    """A draft model that proposes trees (its main chain and, where unsure, second choices), its
    chain sped up by prompt lookup. lookup=False: one draft forward per chain token."""

    name = "staged"

    def __init__(self, model: Transformer, compile: bool = False, compile_mode: str = "default",
                 branch_below: float = BRANCH_BELOW, lookup: bool = True):
        super().__init__(model, compile, compile_mode)
        self.branch_below = branch_below
        self.lookup = NgramProposer(*LOOKUP_N) if lookup else None
        self.rows = compile_chunk(draft_rows, self.device) if compile else draft_rows
        self.rows_ready: Optional[Callable] = None  # the chunk compiled aside, taken up with the step
        self.sampling = Sampling()

    def start(self, context: list, sampling: Optional[Sampling]):
        if sampling is not None:  # (take_up starts over without one)
            self.sampling = sampling
        if self.lookup is not None:
            self.lookup.start(context)
        super().start(context, sampling)

    def warm_up(self, sampling: Sampling, host: bool = False) -> Callable:
        """The one-token step that returns logits (tree rounds pick on the host) and the chunk of
        several tokens, compiled at two lengths: one graph general in its length."""
        step = super().warm_up(sampling, host=True)
        compiled, self.rows = self.rows, draft_rows

        def work():
            for T in (3, 2):  # before the step's work, which marks the pair ready
                compiled(self.model, torch.zeros((1, T), dtype=torch.long, device=self.device),
                         torch.arange(T, device=self.device))
            self.rows_ready = compiled
            step()
        return work

    def take_up(self, context: list):
        if self.ready is not None and self.rows_ready is not None:
            self.rows, self.rows_ready = self.rows_ready, None
        super().take_up(context)

    def logits(self, tokens: list) -> Tensor:
        """The draft's logits (T, V) after each of tokens, fed from the next free slot."""
        if len(tokens) == 1:
            return self._logits(tokens[0], len(self.fed))
        self.forwards += 1
        pos = len(self.fed)
        return self.rows(self.model, torch.tensor([tokens], device=self.device),
                         torch.arange(pos, pos + len(tokens), device=self.device))

    def guesses(self, seq: list, m: int) -> list:
        """Up to m tokens prompt lookup predicts after seq (the context, then the chain drafted so
        far), from the context's n-grams (indexed by `matches`)."""
        if self.lookup is None or m <= 0:
            return []
        for n in range(self.lookup.max_n, self.lookup.min_n - 1, -1):
            start = self.lookup.index[n].get(tuple(seq[-n:]))
            if start is not None:
                return NgramProposer.continuation(seq, start, m)
        return []

    def picks(self, logits: Tensor, guesses: list) -> tuple:
        """The draft's pick after each fed token (logits (T, V); guesses: the T - 1 tokens fed after
        the first), up to the first that is not the guess fed after it: ([(token, its probability,
        a sibling or None)], the rows of q they were drawn from (None when greedy))."""
        out = []
        if self.sampling.temperature == 0:
            top = logits.float().softmax(-1).topk(2, dim=-1)
            for i, ((p1, _), (t1, t2)) in enumerate(zip(top.values.tolist(), top.indices.tolist())):
                out.append((t1, p1, t2 if p1 < self.branch_below else None))
                if i >= len(guesses) or t1 != guesses[i]:
                    return out, None
        q = logits_to_probs(logits.float(), self.sampling)  # (T, V)
        most = q.max(-1).values.tolist()
        for i in range(len(q)):
            guess = guesses[i] if i < len(guesses) else None
            token = draw(q[i], guess)
            sibling = int(sample_probs(q[i:i + 1])) if most[i] < self.branch_below else None
            out.append((token, float(q[i, token]), sibling))
            if guess is None or token != guess:
                break
        return out, q[:len(out)]

    def propose(self, context: list, k: int, sampling: Sampling) -> tuple:
        """A round over a chain: the tree's chain alone (a tree of k nodes k deep has no room for
        a sibling), up to k ids and the distributions q (m, V) they were drawn from (None when greedy)."""
        self.sampling = sampling
        tree = self.propose_tree(context, k, k)
        return tree.tokens[1:], (None if tree.q is None else tree.q[:-1])

    def propose_tree(self, context: list, nodes: int, depth: int) -> Tree:
        """The draft's tree after context: its chain up to depth (fewer where threshold drafting
        stops it) and siblings where it is unsure, at most `nodes` candidates."""
        self.take_up(context)
        del self.fed[min(common_prefix(self.fed, context), len(context) - 1):]  # a sibling's path was kept
        behind = context[len(self.fed):-1]  # what the draft has not seen: fed with its first forward
        if self.lookup is not None:
            self.lookup.matches(context)  # index the context's n-grams
        depth = min(depth, nodes)  # (the chain's slots must fit the cache as the tree's do)
        self.first_draft_slot = len(context)  # the root's position is len(context) - 1
        tree = Tree([context[-1]], [-1])
        qs, chain, node, prob = {}, [], 0, 1.0
        while len(chain) < depth and not (chain and self.unsure(prob)):
            fed = behind + [tree.tokens[node]] + self.guesses(context + chain, depth - len(chain) - 1)
            picked, q = self.picks(self.logits(fed)[len(behind):], fed[len(behind) + 1:])
            self.fed.extend(fed[:len(behind) + len(picked)])  # the tokens whose picks were kept
            behind = []
            for i, (token, p, sibling) in enumerate(picked):
                if chain and self.unsure(prob):
                    break
                if q is not None:
                    qs[node] = q[i]  # node's children are drawn from it
                node = self.add(tree, token, node)
                prob *= p
                chain.append(token)
                if sibling is not None and nodes - (len(tree) - 1) > depth - len(chain):
                    self.add(tree, sibling, tree.parents[node])  # a leaf: the chain keeps its slots
        del self.fed[self.first_draft_slot + len(chain) - 1:]  # the chain's last token is not fed
        return self.with_q(tree, qs)

    @staticmethod
    def add(tree: Tree, token: int, parent: int) -> int:
        tree.tokens.append(token)
        tree.parents.append(parent)
        return len(tree) - 1

    def with_q(self, tree: Tree, qs: dict) -> Tree:
        """The tree with q (N, V): node i's children's distribution (zeros where it has none)."""
        if not qs:
            return tree
        tree.q = torch.zeros(len(tree), next(iter(qs.values())).shape[-1], device=self.device)
        for node, row in qs.items():
            tree.q[node] = row
        return tree
