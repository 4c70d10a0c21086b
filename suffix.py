"""What the suffix proposer (proposers.SuffixProposer) looks up: every stretch of up to `depth`
tokens of the prompt, the output so far and earlier calls' prompts and outputs, counted in a trie.

SuffixDecoding (Oliaro et al. 2024), model-free: find the longest suffix of the context that
occurred earlier, then follow its most frequent continuation token by token; stop where the
continuation's empirical probability (the product of each step's count / its siblings' total)
falls below `min_prob`, or where no suffix of at least `min_match` tokens has been seen followed
by anything. Plain Python, no torch:

- `SuffixTrie`: a trie of every substring of at most `depth` tokens, each node counting its
  occurrences. A sequence grows one token at a time in O(depth): the nodes of its last 1..depth-1
  tokens (its `tails`) each get a child for the new token. Removing a sequence walks its windows.
- `SuffixIndex.continuations`: for tree verification, the likeliest continuations as a tree:
  best first by that probability, up to a number of nodes.
- `SuffixIndex`: the sequence being generated, plus a store of earlier ones (a generate call's
  prompt and output, kept when the next call starts something else) capped at `store_tokens`,
  the least recently used dropped first; a sequence is used when a proposal follows it.
"""
import heapq
import itertools
from collections import OrderedDict
from typing import Optional


class Node:
    """A substring: how often it occurs, the nodes of it extended by one token, and the id of the
    sequence that last extended it (whose continuation a proposal through it follows)."""

    __slots__ = ("count", "next", "last")

    def __init__(self):
        self.count, self.next, self.last = 0, {}, -1


class SuffixTrie:
    def __init__(self, depth: int):
        if depth < 2:
            raise ValueError(f"a suffix trie needs depth >= 2 (got {depth})")
        self.depth, self.root = depth, Node()

    def extend(self, tails: list, tokens, seq: int) -> list:
        """Count tokens appended to sequence `seq`, whose last i + 1 tokens are at tails[i]; returns
        the new tails."""
        depth, root = self.depth, self.root
        for token in tokens:
            new = []
            for node in [root] + tails[:depth - 1]:
                child = node.next.get(token)
                if child is None:
                    child = node.next[token] = Node()
                child.count += 1
                child.last = seq
                new.append(child)
            tails = new
        return tails

    def remove(self, tokens: list):
        """Uncount a sequence that extend counted."""
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start:start + self.depth]:
                child = node.next[token]
                child.count -= 1
                if child.count == 0:  # a longer substring occurs no more often: the subtree was this window's alone
                    del node.next[token]
                    break
                node = child

    def find(self, tokens) -> Optional[Node]:
        node = self.root
        for token in tokens:
            node = node.next.get(token)
            if node is None:
                return None
        return node

    def longest_match(self, tokens: list, min_match: int) -> Optional[Node]:
        """The node of the longest suffix of tokens (at least min_match long) seen followed by
        something, or None."""
        # a suffix seen followed by c has every shorter suffix seen followed by c: binary search
        lo, hi, best = min_match, min(self.depth - 1, len(tokens)), None
        while lo <= hi:
            mid = (lo + hi) // 2
            node = self.find(tokens[len(tokens) - mid:])
            if node is not None and node.next:
                lo, best = mid + 1, node
            else:
                hi = mid - 1
        return best

    def count(self, tokens) -> int:
        node = self.find(tokens)
        return 0 if node is None else node.count


class SuffixIndex:
    """The trie over the sequence being generated and a store of earlier ones."""

    # from simulated grounded tasks: fewer target forwards than min_match 2, 12% fewer proposals than min_prob 0.1,
    # as many as depth 16; at depth 8 a token of English costs about 1.6 KB of trie (27 MB for a full store)
    def __init__(self, depth: int = 8, min_match: int = 1, min_prob: float = 0.3, store_tokens: int = 1 << 14):
        if not 1 <= min_match < depth:
            raise ValueError(f"a suffix index needs 1 <= min_match < depth (got {min_match}, {depth})")
        if not 0 <= min_prob <= 1 or store_tokens < 0:
            raise ValueError("a suffix index needs 0 <= min_prob <= 1 and store_tokens >= 0")
        self.trie = SuffixTrie(depth)
        self.min_match, self.min_prob, self.store_tokens = min_match, min_prob, store_tokens
        self.stored: OrderedDict = OrderedDict()  # sequence id -> tokens, least recently used first
        self.stored_size = 0
        self.seq, self.tokens, self.tails = 0, [], []  # the sequence being generated: id, tokens, trie tails

    def start(self, context: list):
        """A new generate call: one that continues the current sequence (a chat's next turn) extends
        it, any other stores it and starts a new one."""
        if context[:len(self.tokens)] != self.tokens:
            self.store()
            self.seq, self.tokens, self.tails = self.seq + 1, [], []
        self.extend(context)

    def extend(self, context: list):
        """Count what context holds past the current sequence's tokens (context extends them)."""
        new = context[len(self.tokens):]
        self.tails = self.trie.extend(self.tails, new, self.seq)
        self.tokens.extend(new)

    def store(self):
        """Keep the current sequence's counts under its id, then drop the least recently used
        sequences past the cap."""
        if self.tokens:
            self.stored[self.seq] = self.tokens
            self.stored_size += len(self.tokens)
        while self.stored_size > self.store_tokens:
            _, dropped = self.stored.popitem(last=False)
            self.trie.remove(dropped)
            self.stored_size -= len(dropped)

    def continuation(self, context: list, k: int) -> list:
        """Up to k tokens that most often followed the context's longest earlier-seen suffix."""
        self.extend(context)
        tail = context[-self.trie.depth:]
        out, node, prob = [], None, 1.0
        while len(out) < k:
            if node is None or not node.next:  # at the trie's depth or a sequence's end: match a shorter suffix
                node = self.trie.longest_match(tail + out, self.min_match)
                if node is None:
                    break
            total = sum(child.count for child in node.next.values())
            token, node = max(node.next.items(), key=lambda item: item[1].count)
            prob *= node.count / total
            if prob < self.min_prob:
                break
            if not out and node.last in self.stored:
                self.stored.move_to_end(node.last)
            out.append(token)
        return out

    def continuations(self, context: list, nodes: int, depth: int, min_prob: float = 0.05) -> tuple:
        """Up to `nodes` tokens in a tree of the context's likeliest continuations, at most `depth`
        deep, best first by their empirical probability (at least min_prob): (tokens, parents),
        parents[i] the index of token i's parent in tokens, -1 after the context. A node past the
        trie's depth continues from the longest earlier-seen suffix of the context and its path.
        min_prob is lower than a chain's: the node budget, not the probability, bounds a tree."""
        self.extend(context)
        tail = context[-self.trie.depth:]
        tokens, parents, frontier = [], [], []  # frontier: (-probability, order, parent, token, trie node, path)
        order = itertools.count()  # ties go first come, first served

        def expand(parent: int, node: Optional[Node], prob: float, path: list):
            if node is None or not node.next:  # at the trie's depth or a sequence's end: match a shorter suffix
                node = self.trie.longest_match(tail + path, self.min_match)
                if node is None:
                    return
            total = sum(child.count for child in node.next.values())
            for token, child in node.next.items():
                if prob * child.count / total >= min_prob:
                    heapq.heappush(frontier, (-prob * child.count / total, next(order), parent, token, child, path))

        expand(-1, None, 1.0, [])
        while frontier and len(tokens) < nodes:  # a child is never likelier than its parent: parents first
            negative_prob, _, parent, token, node, path = heapq.heappop(frontier)
            if not tokens and node.last in self.stored:
                self.stored.move_to_end(node.last)
            tokens.append(token)
            parents.append(parent)
            if len(path) + 1 < depth:
                expand(len(tokens) - 1, node, -negative_prob, path + [token])
        return tokens, parents
