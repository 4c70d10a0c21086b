"""Lookahead decoding (Fu et al. 2024, arXiv 2402.02057): speculation without a second model. Each
round is one target forward over one chunk of three parts, which see each other only as a mask
(`Branches`) lets them:

- the root: the last token, not yet through the target; its logits give plain decoding's next token.
- the verification branch: the pool's n-grams that start with the root's token (up to G of them,
  N - 1 tokens after the key each), merged into a tree (tree.py) whose nodes see their ancestors;
  the longest path the target agrees with is kept, as a tree round keeps it (greedy: the argmax's
  child at each node; sampling: recursive rejection sampling over point masses, exact).
- the lookahead branch: a window of W guesses on each of N - 1 levels of a Jacobi iteration's
  trajectory. Level l's column i stands l + i + 1 positions past the root and sees the root, level
  0's columns 0..i, then column i of levels 1..l: a sequence at consecutive positions, after which
  its output guesses the next token. Each column with the last level's output is an n-gram for the
  pool (keyed by its first token); then the levels move up one and that output becomes the last.
  While the trajectory is shorter than N - 1 levels, the output of its last level is the next one.
  The context's own n-grams (the prompt's, then the output's as it grows) go into the pool too, as
  the authors' implementation does with POOL_FROM_PROMPT (from_context=False: the trajectory's alone).

Nothing in a branch sees the other's tokens, so the verification's logits are a tree round's; the
lookahead tokens' keys go to the slots past the tree's, which no later query sees and the next
forward writes over (only the accepted path's keys are moved, by tree.compact). The chunk has one
size per (W, N, G): the tree is padded to G * (N - 1) nodes, so a compiled forward serves every round.
The window and the pool follow the target's argmax even when sampling: they only choose what later
rounds propose, and point masses chosen before the forward keep rejection sampling exact.
"""
import random
import time
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from errors import UserError
from proposers import Proposer
from sampling import Sampling, logits_to_probs
from tree import Tree, greedy_path, sampled_path


@dataclass
class Branches:
    """One lookahead forward's chunk: tokens, token t at offsets[t] past the root's position and
    seeing the cached keys and the chunk tokens mask[t] names (what Engine.feed takes as `tree`).
    The verification tree's nodes come first, the root at 0; then padding, then the window, level
    by level."""
    tokens: list
    offsets: list
    mask: Tensor  # (T, T) bool
    tree: Tree  # the verification branch, tokens[:len(tree)]

    def visible(self, device: Optional[torch.device] = None) -> Tensor:
        return self.mask.to(device)


def window_mask(window: int, levels: int, first: int) -> Tensor:
    """(T, T) bool, T = first + window * levels: every token sees the root (token 0) and itself; the
    window's token at level l, column i (token first + l * window + i) also sees level 0's columns
    0..i and column i of levels 1..l."""
    at = lambda level, column: first + level * window + column  # noqa: E731
    mask = torch.eye(at(levels, 0), dtype=torch.bool)
    mask[:, 0] = True
    for level in range(levels):
        for column in range(window):
            mask[at(level, column), at(0, 0):at(0, column) + 1] = True
            for below in range(1, level):
                mask[at(level, column), at(below, column)] = True
    return mask


class LookaheadProposer(Proposer):
    """The window, the n-gram pool and the chunk layout of lookahead decoding; `lookahead_decode`
    runs its rounds. window W, ngram N, candidates G (the paper's names)."""

    name = "lookahead"

    def __init__(self, window: int, ngram: int, candidates: int, from_context: bool = True, seed: int = 0):
        if window < 1 or ngram < 2 or candidates < 1:
            raise UserError(f"lookahead needs a window >= 1, n-grams of >= 2 tokens and >= 1 candidate "
                            f"(got {window}, {ngram}, {candidates})")
        self.W, self.N, self.G, self.from_context, self.seed = window, ngram, candidates, from_context, seed
        self.verify_size = 1 + candidates * (ngram - 1)  # the root and the verification branch, padded
        self.size = self.verify_size + window * (ngram - 1)  # the tokens a round feeds
        self.mask = window_mask(window, ngram - 1, self.verify_size)
        self.window_offsets = [level + column + 1 for level in range(ngram - 1) for column in range(window)]
        self.start([0])

    def start(self, context: list, sampling: Optional[Sampling] = None):
        """A fresh pool, and a window of tokens drawn from the context (the same ones every call)."""
        draw = random.Random(self.seed)
        self.levels = [[draw.choice(context) for _ in range(self.W)] for _ in range(self.N - 1)]
        self.filled = 1  # levels that come from the trajectory; the others are only placeholders
        self.pool: dict = {}  # first token -> the n-grams' other N - 1 tokens (tuples), oldest first
        self.indexed = 0  # the context's n-grams that start before this are in the pool

    def candidates(self, context: list) -> list:
        """The pool's n-grams after the context's last token, most recent first, G at most; the
        context's n-grams join the pool first (from_context)."""
        if self.from_context:
            for start in range(self.indexed, len(context) - self.N + 1):
                self.remember(tuple(context[start:start + self.N]))
            self.indexed = max(self.indexed, len(context) - self.N + 1)
        return [list(gram) for gram in reversed(self.pool.get(context[-1], []))]

    def propose(self, context: list, k: int, sampling: Sampling) -> tuple:
        """The most recent n-gram after the last token, cut to k (a round picked on the host: a chain;
        the window does not move there), and q = None (a point mass)."""
        grams = self.candidates(context)
        return (grams[0][:k] if grams else []), None

    def tree(self, context: list) -> Tree:
        """The verification branch: the pool's n-grams after the last token, merged into a tree."""
        return Tree.from_paths(context[-1], self.candidates(context))

    def branches(self, context: list, tree: Optional[Tree] = None) -> Branches:
        """This round's chunk: the tree (of the pool's n-grams after the last token), padded, then the window."""
        tree = tree or self.tree(context)
        pad = self.verify_size - len(tree)
        mask = self.mask.clone()
        mask[:len(tree), :len(tree)] = tree.ancestor_mask()
        tokens = tree.tokens + [context[-1]] * pad + [t for level in self.levels for t in level]
        return Branches(tokens, tree.depths + [1] * pad + self.window_offsets, mask, tree)

    def observe(self, out: list):
        """out: the target's argmax after each of the window's tokens, level by level."""
        W, last = self.W, self.N - 2
        outputs = [out[level * W:(level + 1) * W] for level in range(last + 1)]
        if self.filled <= last:  # the trajectory grows a level
            self.levels[self.filled] = outputs[self.filled - 1]
            self.filled += 1
            return
        for column in range(W):
            self.remember(tuple(level[column] for level in self.levels) + (outputs[last][column],))
        self.levels = self.levels[1:] + [outputs[last]]

    def remember(self, gram: tuple):
        """An n-gram into the pool: the most recent of its key's, G kept per key."""
        grams = self.pool.setdefault(gram[0], [])
        if gram[1:] in grams:
            grams.remove(gram[1:])
        grams.append(gram[1:])
        if len(grams) > self.G:
            del grams[0]


def lookahead_decode(spec, row, budget: int, stop: set, stats) -> list:
    """One round of lookahead decoding for SpeculativeEngine `spec` (row, budget, stop and stats as
    its speculative_decode takes them): both branches in one target forward; the accepted path's keys
    and values move to the positions it takes. Returns the new tokens. With one token left to give,
    no room for the chunk, or (adaptive) a round that is not expected to pay, a plain step."""
    proposer, sampling, context = spec.proposer, row.sampling, row.known()
    stats.target_forwards += 1
    room = budget >= 2 and spec.max_seq_length - row.fed >= proposer.size
    tree, planner = proposer.tree(context) if room else None, spec.lookahead_planner
    # decided on the tree alone: the chunk's mask costs tensor operations a plain step need not pay
    if tree is None or (spec.adaptive and not planner.ask(tree.children(), tree.tokens, context)):
        stats.plain_steps += 1
        return [spec.plain_step(row)]
    chunk, start = proposer.branches(context, tree), time.perf_counter()
    logits = spec.engine.feed(row, chunk.tokens, every=True, tree=chunk)  # (T, V)
    window = proposer.verify_size
    if sampling.temperature == 0:
        picks = logits.argmax(-1).tolist()  # one copy to the host
        path, next_token = greedy_path(tree, picks[:len(tree)])
        guesses = picks[window:]
    else:
        path, next_token = sampled_path(tree, logits_to_probs(logits[:len(tree)], sampling))
        guesses = logits[window:].argmax(-1).tolist()
    planner.verified(tree.children(), path, time.perf_counter() - start)
    proposer.observe(guesses)
    spec.compact_path(row, path)
    stats.histogram[len(path)] += 1
    stats.proposed += len(tree) - 1
    return spec.kept([tree.tokens[node] for node in path] + [next_token], stop, budget)
