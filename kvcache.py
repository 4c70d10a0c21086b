"""The paged KV cache and how a forward addresses it: every layer keeps its keys and values in one
preallocated pool of slots (`KVCache`), and a forward's `ForwardBatch` says where each token's key
and value go and which slots hold each row's earlier positions, through the row's block table (the
engine hands the blocks out). Imports nothing of the project: model.py reads it as a leaf.
"""
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor


@dataclass
class ForwardBatch:
    """What one forward computes: B rows of T tokens (a shorter row is padded at its end), each
    token at its position in its sequence. Keys and values live in the layers' slot pools: token
    (b, t) writes slot slots[b, t], and row b's queries read the keys of its positions 0..kv_len-1,
    held in the slots its block table names (position p: block_table[b, p // block_size] *
    block_size + p % block_size), each query the ones at or before its own position."""
    positions: Tensor  # (B, T) int64: each token's position in its sequence
    slots: Tensor  # (B, T) int64: where each token's key and value go (padding: a scratch slot)
    block_table: Tensor  # (B, blocks) int64: each row's blocks, in position order
    block_size: int = 16
    kv_len: int = 0  # the positions a row's queries may read, 0..kv_len-1, the same for every row
    last: Optional[Tensor] = None  # (B, 1) int64: only this token of each row goes through the last layer
    logit_rows: Optional[Tensor] = None  # (L,): the rows whose logits are wanted; None: all
    fresh: bool = False  # nothing cached before these tokens: attention reads the chunk's own keys
    # sliding-window layers with pools of their own (a model that mixes them with full attention):
    # their slots and block tables, whose blocks out of the window are gone (the scratch block)
    window_slots: Optional[Tensor] = None
    window_table: Optional[Tensor] = None
    # a tree of candidates (tree.py), or any chunk whose tokens see only some of the others (lookahead
    # decoding's branches, lookahead.py): token t's key and value go to the slot of position
    # positions[b, 0] + t (consecutive after the sequence), while its position is its own (a tree
    # node's: the sequence's length plus its depth); query t sees the cached keys and the chunk
    # tokens tree_mask[b, t] names
    tree_mask: Optional[Tensor] = None  # (B, T, T) bool: a node's ancestors and itself; any mask

    def context(self, block_table: Optional[Tensor] = None) -> Tensor:
        """(B, kv_len) the slot of each row's positions 0..kv_len-1 (in the window pools' blocks)."""
        table = self.block_table if block_table is None else block_table
        offsets = torch.arange(self.block_size, device=table.device)
        slots = (table.unsqueeze(-1) * self.block_size + offsets).flatten(1)  # (B, blocks * block_size)
        return slots[:, :self.kv_len]

    def views(self) -> dict:
        """sliding -> (slots, context) of the layers of that kind; a fresh chunk's context is None."""
        full = (self.slots, None if self.fresh else self.context())
        if self.window_slots is None:
            return {False: full, True: full}
        return {False: full, True: (self.window_slots, None if self.fresh else self.context(self.window_table))}

    @staticmethod
    def rows(input_pos: Tensor, batch_size: int, row_length: int, kv_len: Optional[int] = None,
             **options) -> "ForwardBatch":
        """Row b in slots b * row_length onwards, one block a row (what setup_caches(batch_size,
        row_length) lays out for callers that do not page): input_pos (T,) shared, or (B, T)."""
        positions = input_pos.view(-1, input_pos.shape[-1]).expand(batch_size, -1)
        first = torch.arange(batch_size, device=input_pos.device).unsqueeze(1)  # (B, 1) each row's block
        kv_len = int(positions.max()) + 1 if kv_len is None else kv_len
        return ForwardBatch(positions, first * row_length + positions, first, row_length, kv_len, **options)


class KVCache(nn.Module):
    """One layer's keys and values: num_slots slots in blocks of block_size, indexed as (blocks,
    n_kv_heads, block_size, head_dim) and stored head by head, so that a head's keys in a block, and
    in consecutive blocks, lie side by side; slot s is row s % block_size of block s // block_size.
    Written and read through a ForwardBatch's slots."""

    def __init__(self, num_slots: int, n_kv_heads: int, head_dim: int, dtype, device=None, zeros=torch.zeros,
                 block_size: Optional[int] = None):
        super().__init__()
        block_size = block_size or num_slots
        assert num_slots % block_size == 0, f"{num_slots} slots are not whole blocks of {block_size}"
        # stored head by head: a head's keys in consecutive blocks lie side by side (blocks.allocate
        # hands a prompt's blocks out in address order), so a row's keys read as a few long runs
        shape = (n_kv_heads, num_slots // block_size, block_size, head_dim)
        for name in ("k_cache", "v_cache"):
            pool = zeros(shape, dtype=dtype, device=device).permute(1, 0, 2, 3)  # (blocks, n_kv_heads, block_size, head_dim)
            self.register_buffer(name, pool, persistent=False)

    def at(self, slots: Tensor) -> tuple:
        """The index of slots (any shape) into a pool."""
        return slots // self.k_cache.shape[2], slice(None), slots % self.k_cache.shape[2]

    def get(self, slots: Tensor) -> tuple[Tensor, Tensor]:
        """The keys and values of slots: (*slots.shape, n_kv_heads, head_dim) each, copied."""
        return self.k_cache[self.at(slots)], self.v_cache[self.at(slots)]

    def put(self, slots: Tensor, k: Tensor, v: Tensor):
        """k, v (*slots.shape, n_kv_heads, head_dim) to slots."""
        self.k_cache[self.at(slots)], self.v_cache[self.at(slots)] = k, v

    def write(self, slots: Tensor, k: Tensor, v: Tensor):
        """k, v (B, n_kv_heads, T, head_dim) to slots (B, T)."""
        self.put(slots, k.transpose(1, 2), v.transpose(1, 2))

    def read(self, context: Tensor) -> tuple[Tensor, Tensor]:
        """The keys and values of slots context (B, S): (B, n_kv_heads, S, head_dim) each, copied."""
        return tuple(x.transpose(1, 2) for x in self.get(context))
