"""The prefix cache on disk (--prompt_cache DIR): a full block of a prompt is written under its
content key (blocks.block_key: a digest of every token up to its block's end), so that a restarted
generate.py or serve.py that meets the same prompt beginning loads its keys and values instead of
computing them, as llama.cpp's --prompt-cache does.

A block's file holds every layer's keys and values of its block_size positions (safetensors),
under a folder named after the model (its config, the size and the ends of its weights file),
the dtype, the block size and the tensor-parallel rank, so that nothing is read into a cache it
was not made for; a file that does not read, or does not match, is skipped with a warning. The
folder is kept under max_bytes by deleting the least recently used files.
"""
import hashlib
import os
import sys
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

import checkpoint


def model_fingerprint(checkpoint_dir) -> str:
    """A digest of config.json, and the size and first and last MiB of the weights file."""
    d = Path(checkpoint_dir)
    digest = hashlib.sha256((d / checkpoint.CONFIG).read_bytes())
    weights = d / checkpoint.WEIGHTS
    size = weights.stat().st_size
    digest.update(str(size).encode())
    with open(weights, "rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        digest.update(f.read())
    return digest.hexdigest()[:16]


class PromptStore:
    """Reads and writes the blocks of one model's cache (`pools`: each layer's KVCache, in order)."""

    def __init__(self, folder, checkpoint_dir, pools: list, block_size: int, rank: int = 0,
                 max_bytes: int = 4 << 30):
        dtype = str(pools[0].k_cache.dtype).removeprefix("torch.")
        name = f"{model_fingerprint(checkpoint_dir)}-{dtype}-b{block_size}" + (f"-rank{rank}" if rank else "")
        self.folder = Path(folder) / name
        self.folder.mkdir(parents=True, exist_ok=True)
        self.pools, self.block_size, self.max_bytes = pools, block_size, max_bytes
        self.shapes = [(block_size, p.k_cache.shape[1], p.k_cache.shape[3]) for p in pools]  # (slots, heads, head_dim)

    def slots(self, block: int):
        device = self.pools[0].k_cache.device
        return torch.arange(block * self.block_size, (block + 1) * self.block_size, device=device)

    def path(self, key: bytes) -> Path:
        return self.folder / f"{key.hex()}.safetensors"

    def has(self, key: bytes) -> bool:
        return self.path(key).is_file()

    def load(self, key: bytes, block: int) -> bool:
        """The file of key into block's slots of every layer; False (and a warning) where it does
        not read or does not fit this cache."""
        path = self.path(key)
        try:
            tensors = load_file(path)
            parts = [(tensors[f"k.{i}"], tensors[f"v.{i}"]) for i in range(len(self.pools))]
            if any(k.shape != s or v.shape != s for (k, v), s in zip(parts, self.shapes)):
                raise ValueError("its shapes are not this cache's")
        except (OSError, SafetensorError, KeyError, ValueError) as e:
            print(f"warning: prompt cache file {path} skipped ({type(e).__name__}: {e})", file=sys.stderr)
            return False
        slots = self.slots(block)
        for pool, (k, v) in zip(self.pools, parts):
            pool.put(slots, k.to(pool.k_cache.dtype), v.to(pool.v_cache.dtype))
        os.utime(path)  # recently used: the last to go
        return True

    def save(self, key: bytes, block: int):
        """block's keys and values of every layer, written under key (atomically), unless there."""
        path = self.path(key)
        if path.exists():
            return
        slots, tensors = self.slots(block), {}
        for i, pool in enumerate(self.pools):
            k, v = pool.get(slots)
            tensors[f"k.{i}"], tensors[f"v.{i}"] = k.cpu(), v.cpu()
        tmp = path.with_suffix(".tmp")
        try:
            save_file(tensors, tmp)
            os.replace(tmp, path)
        except OSError as e:  # a full disk: the cache in memory goes on without it
            tmp.unlink(missing_ok=True)
            print(f"warning: prompt cache: cannot write {path} ({e.strerror})", file=sys.stderr)
            return
        self.trim()

    def trim(self):
        """Delete the least recently used files while the folder is over max_bytes."""
        files = [(p.stat().st_mtime, p.stat().st_size, p) for p in self.folder.glob("*.safetensors")]
        total = sum(size for _, size, _ in files)
        for _, size, p in sorted(files):
            if total <= self.max_bytes:
                break
            p.unlink(missing_ok=True)
            total -= size


def open_store(folder: Optional[str], checkpoint_dir, model, engine, rank: int = 0,
               max_bytes: int = 4 << 30) -> Optional[PromptStore]:
    """A PromptStore for engine's cache (its blocks then read and write it), or None without a folder."""
    if folder is None:
        return None
    pools = [layer.attention.kv_cache for layer in model.layers]
    store = PromptStore(folder, checkpoint_dir, pools, engine.block_size, rank, max_bytes)
    engine.store = engine.blocks.store = store
    return store
