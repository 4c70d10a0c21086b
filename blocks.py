"""The KV cache's blocks: which are free, which sequences hold them, and which hold a prefix that a
later request can use again (no torch: plain bookkeeping the scheduler runs, and a `store` for the
blocks on disk, prompt_store.PromptStore, which the engine gives it).

The cache is num_blocks blocks of block_size token slots (kvcache.KVCache's pools). A sequence holds
a block table, its blocks in position order. A block whose slots are all written is *full*, and is
content-addressed: its key is a hash of every token up to its end (the tokens of the block and
the key of the block before it, as vLLM's automatic prefix caching does), so two requests whose
prompts begin alike find the same blocks. Blocks are reference-counted: a prefix held by several
sequences is stored once. A full block nobody holds stays cached until a fresh block is needed,
then the least recently released goes first.
"""
import collections
import hashlib
from typing import Optional

ROOT = b"minillm"  # the key "before" a sequence's first block


def block_key(parent: bytes, tokens: list) -> bytes:
    """The key of a full block: a digest of its parent's key and its own tokens (stable across
    processes, so a key can also name a file)."""
    return hashlib.blake2b(parent + b"".join(t.to_bytes(4, "little") for t in tokens), digest_size=16).digest()


class BlockManager:
    """num_blocks blocks of block_size slots: handing them out, sharing full ones by content."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.refs = [0] * num_blocks
        self.key: list[Optional[bytes]] = [None] * num_blocks  # a full block's content key
        self.by_key: dict = {}  # content key -> block, for the blocks that hold it
        self.fresh = collections.deque(range(num_blocks))  # blocks holding nothing worth keeping
        self.idle: collections.OrderedDict = collections.OrderedDict()  # cached blocks nobody holds, oldest first
        self.store = None  # blocks on disk: has(key), load(key, block), save(key, block)

    def free_count(self) -> int:
        """Blocks that allocate() can hand out: fresh ones and idle cached ones."""
        return len(self.fresh) + len(self.idle)

    def used_count(self) -> int:
        return self.num_blocks - self.free_count()

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def match(self, tokens: list) -> tuple[list, bytes]:
        """The cached full blocks that hold the longest beginning of tokens (whole blocks), and the
        key of the last of them (ROOT for none). Nothing is taken: acquire() them."""
        blocks, parent = [], ROOT
        if not self.prefix_caching:
            return blocks, parent
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
            key = block_key(parent, tokens[start:start + self.block_size])
            block = self.by_key.get(key)
            if block is None:
                block = self.from_store(key)
            if block is None:
                break
            blocks.append(block)
            parent = key
        return blocks, parent

    def from_store(self, key: bytes) -> Optional[int]:
        """A block loaded from the store under key (cached, nobody holding it), or None."""
        if self.store is None or not self.store.has(key) or not (got := self.allocate(1)):
            return None
        if not self.store.load(key, got[0]):
            self.release(got)
            return None
        self.key[got[0]], self.by_key[key] = key, got[0]
        self.release(got)
        return got[0]

    def acquire(self, blocks: list):
        """One more holder for each of blocks (cached ones leave the idle list)."""
        for b in blocks:
            if self.refs[b] == 0:
                self.idle.pop(b, None)
            self.refs[b] += 1

    def allocate(self, n: int) -> Optional[list]:
        """n blocks for one holder, fresh ones first, then the least recently idle cached ones
        (forgetting what they held); None, taking nothing, when fewer than n are free."""
        if n > self.free_count():
            return None
        out = []
        for _ in range(n):
            if self.fresh:
                b = self.fresh.popleft()
            else:
                b, _ = self.idle.popitem(last=False)
                self.forget(b)
            self.refs[b] = 1
            out.append(b)
        return sorted(out)  # in address order: a prompt's keys are read as one run (kvcache.KVCache)

    def release(self, blocks: list):
        """One holder fewer for each of blocks: a block nobody holds stays cached if it is full
        (most recently used last), else it is fresh again. Released last block first, so that a
        sequence's beginning, which others are likelier to share, is evicted last."""
        for b in reversed(blocks):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if self.key[b] is not None:
                    self.idle[b] = None
                else:
                    self.fresh.append(b)

    def seal(self, block: int, parent: bytes, tokens: list, persist: bool = False) -> bytes:
        """Block is full with tokens after the block whose key is parent: give it its content key,
        findable by match() unless another block already holds that content, and (persist) write
        it to the store. Returns the key."""
        key = block_key(parent, tokens)
        if self.prefix_caching and self.key[block] is None and key not in self.by_key:
            self.key[block], self.by_key[key] = key, block
        if persist and self.store is not None:
            self.store.save(key, block)
        return key

    def forget(self, block: int):
        if self.key[block] is not None:
            del self.by_key[self.key[block]]
            self.key[block] = None

    def forget_idle(self):
        """Drop every cached block that no request holds (least recently used first)."""
        while self.idle:
            b, _ = self.idle.popitem(last=False)
            self.forget(b)
            self.fresh.append(b)
