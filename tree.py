"""Tree verification for speculative decoding (SpecInfer, Miao et al. 2024): one target forward
checks a tree of candidate continuations instead of one chain, and the longest accepted path is kept.

- `Tree`: node 0 is the root (the last token, not yet through the target), every other node a
  candidate token after its parent; parents come before their children, so the nodes are fed in
  index order. Each node's position is the sequence's length plus its depth; its key and value go
  to the slot after the previous node's (ForwardBatch.tree_mask), and it attends to the cached
  keys and to its ancestors only (`Tree.ancestor_mask`).
- Acceptance: greedy follows, from the root, the child whose token is the target's argmax at its
  parent (token-identical to greedy decoding); sampling tries a node's children in turn by
  recursive rejection sampling (`sampled_path`), exact for point-mass candidates and for children
  drawn from a draft's distributions (`Tree.q`).
- `compact`: the accepted path's keys and values move from their nodes' slots to the positions the
  path takes in the sequence, in every layer, so that what rejected branches wrote is never read.
"""
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from sampling import sample_probs


@dataclass
class Tree:
    tokens: list  # node i's token; tokens[0] the root
    parents: list  # node i's parent, an earlier node; parents[0] = -1
    # (N, V): the distribution node i's children were drawn from, each independently (a draft's
    # q, staged.py); None: the candidates are point masses
    q: Optional[Tensor] = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if len(self.tokens) != len(self.parents) or not self.tokens or self.parents[0] != -1:
            raise ValueError("a tree needs a token and a parent per node, the root first with parent -1")
        if any(not 0 <= p < i for i, p in enumerate(self.parents) if i):
            raise ValueError("every node's parent must come before it")

    @classmethod
    def from_paths(cls, root: int, paths: list) -> "Tree":
        """The trie of token sequences `paths` after the root, a shared beginning one branch."""
        tokens, parents, index = [root], [-1], {}  # index: (parent, token) -> node
        for path in paths:
            node = 0
            for token in path:
                if (node, token) not in index:
                    index[node, token] = len(tokens)
                    tokens.append(token)
                    parents.append(node)
                node = index[node, token]
        return cls(tokens, parents)

    def subtree(self, nodes: list) -> "Tree":
        """The root and `nodes` (ascending, each one's parent among them or the root), renumbered."""
        kept = [0] + nodes
        index = {node: i for i, node in enumerate(kept)}
        return Tree([self.tokens[n] for n in kept], [-1] + [index[self.parents[n]] for n in nodes],
                    None if self.q is None else self.q[kept])

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depths(self) -> list:
        depths = [0] * len(self.parents)
        for i in range(1, len(self.parents)):
            depths[i] = depths[self.parents[i]] + 1
        return depths

    def children(self) -> list:
        """children()[i]: node i's children, in index order."""
        out = [[] for _ in self.parents]
        for i in range(1, len(self.parents)):
            out[self.parents[i]].append(i)
        return out

    @property
    def offsets(self) -> list:
        """Each node's position past the root's, as a forward feeds it (Engine.feed): its depth."""
        return self.depths

    def visible(self, device: Optional[torch.device] = None) -> Tensor:
        """Which of the chunk's tokens each node sees (ForwardBatch.tree_mask): its path."""
        return self.ancestor_mask(device)

    def ancestor_mask(self, device: Optional[torch.device] = None) -> Tensor:
        """(N, N) bool: [i, j] where node j is node i or one of its ancestors."""
        n = len(self.parents)
        mask = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):  # a parent's row is complete before its children's
            mask[i] |= mask[self.parents[i]]
        return mask.to(device)


def greedy_path(tree: Tree, target: list) -> tuple:
    """target[i]: the target's argmax after node i. Walks from the root to the child holding the
    target's token while there is one: (the accepted nodes, root excluded, the target's token after them)."""
    children, path, node = tree.children(), [], 0
    while True:
        follow = [c for c in children[node] if tree.tokens[c] == target[node]]
        if not follow:
            return path, target[node]
        node = follow[0]
        path.append(node)


def sampled_path(tree: Tree, probs: Tensor) -> tuple:
    """probs (N, V): the target's processed distribution after each node. At each node its
    children are tried in turn: child c is accepted with probability r(c), r the target's
    distribution with the tokens of the children rejected before zeroed and renormalized; if all are
    rejected, the token is drawn from r. This is recursive rejection sampling with point-mass
    proposals (SpecInfer's multi-step speculative sampling with q = one-hot): for distinct
    tokens each token comes out with probability exactly p. With tree.q, children drawn from q:
    accepted with probability min(1, r(c) / q(c)), and each rejection leaves r = norm(max(r - q, 0))
    (SpecInfer, with q the same for every child; one-hot q is the case above). Returns as `greedy_path`."""
    children, path, node = tree.children(), [], 0
    probs = probs.float().cpu()  # a few draws per node: on the host
    drawn = None if tree.q is None else tree.q.float().cpu()
    while True:
        residual, accepted = probs[node].clone(), None
        for child in children[node]:
            token = tree.tokens[child]
            total = residual.sum()
            q = 1.0 if drawn is None else drawn[node, token]
            if torch.rand(()) * total * q < residual[token]:  # u < r(c) / q(c)
                accepted = child
                break
            if drawn is None:
                residual[token] = 0
            else:
                residual = (residual / total - drawn[node]).clamp(min=0)
        if accepted is None:
            if residual.sum() <= 0:  # the children held all of p's mass, up to rounding
                residual = probs[node]
            return path, int(sample_probs(residual.unsqueeze(0)))
        node = accepted
        path.append(node)


def path_slots(table: list, block_size: int, positions: list) -> Tensor:
    """The slots of a row's positions, through its block table (blocks in position order)."""
    return torch.tensor([table[p // block_size] * block_size + p % block_size for p in positions])


def compact(model, moves: dict):
    """Every layer's keys and values copied from slots to slots: moves maps sliding -> (from, to),
    as ForwardBatch.views does (the sliding layers' own pools where a model has them)."""
    for layer in model.layers:
        attention = layer.attention
        source, target = moves[attention.sliding]
        cache = attention.kv_cache
        source, target = source.to(cache.k_cache.device), target.to(cache.k_cache.device)
        cache.put(target, *cache.get(source))
