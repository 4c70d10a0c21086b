"""The library: load a checkpoint, then prefill the prompt and run a compiled one-token decode loop.

    from engine import Engine, Sampling, load_model
    model = load_model("checkpoints/smollm2-135m")
    engine = Engine(model, compile=True)
    engine.setup(batch_size=1, max_seq_length=256)
    (ids,), stats = engine.generate([prompt_ids], max_new_tokens=50, sampling=Sampling())

Data flows one way: checkpoint directory -> `load_model` -> `Transformer` -> `Engine` (prefill,
then `decode_one_token` per step) -> token ids. `Chat` keeps a conversation's KV cache between
turns. speculative.py's `SpeculativeEngine` has the same interface (`Generator`).
"""
import collections
import functools
import resource
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Protocol

import torch
from torch import Tensor

import checkpoint
import kernels
import qlayers
from compile import compile_step, guards_skipped, tag_compile_cache
from errors import TokenizerError, UserError
from grammar import token_masks, unpack_mask
from memory import Need, check_memory, dtype_name, kv_cache_bytes, weight_bytes
from model import Transformer, param_bytes
from sampling import Sampling, pick_tokens, sample
from tp import ranks_on_this_machine

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def log(*args):
    print(*args, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- loading

@functools.cache  # once per process: load_model calls it for the target and the draft
def keep_freed_memory() -> bool:
    """Let glibc keep freed memory for reuse instead of returning it to the kernel: otherwise every
    tensor above 128 KiB is a fresh mmap, and each prefill and verify pays page faults for new,
    zeroed pages. Returns whether the allocator took the settings (False off glibc)."""
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # malloc.h
    # mmap only above 32 MiB (glibc's largest dynamic threshold); keep up to 1 GiB free at the top
    return bool(libc.mallopt(M_MMAP_THRESHOLD, 32 << 20) and libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))


def meta_model(args, tp=None) -> Transformer:
    """The model load_model builds before reading any weight: on the meta device, with a quantized
    checkpoint's layers and, with `tp`, only this rank's shard of each weight."""
    model = qlayers.meta_model(args)
    if tp is not None:
        tp.shard_modules(model)  # shrink the sharded layers to this rank's part
    return model


def load_model(checkpoint_dir, device="cpu", dtype=torch.float32, tp=None, fast_kernels: bool = True,
               needs: Optional[Callable[[Transformer], list]] = None) -> Transformer:
    """checkpoint dir -> ModelArgs + weights -> Transformer on `device` in `dtype` (eval mode).
    A quantized checkpoint (config.json names its scheme) gets qlayers.py's layers; with `tp`
    (tp.py) this process builds and reads only its shard of each weight; on CPU, kernels.py's
    fast paths are installed unless fast_kernels is False (the reference model alone).
    Before any weight is read, the weights and what needs(meta model) lists (the run's other
    buffers, as `Need`s) are checked against the free memory (check_memory)."""
    keep_freed_memory()
    args = checkpoint.read_config(checkpoint_dir)
    model = meta_model(args, tp)
    device = torch.device(device)
    # CPU ranks on one machine load at once from the same free memory: each may plan its part only
    preflight(model, checkpoint_dir, device, dtype, needs,
              ranks=ranks_on_this_machine() if tp is not None and device.type == "cpu" else 1)
    keep_dtype = qlayers.float_tensor_names(model)  # a quantized layer's scales and zeros
    streamed = qlayers.streamed_int8_names(model)  # int8 rows read into one block on 2 MB pages (CPU)
    state = checkpoint.read_weights(checkpoint_dir, checkpoint.expected_shapes(model), device, dtype,
                                    keep_dtype=keep_dtype.__contains__, read=tp.read if tp is not None else None,
                                    streamed=streamed.__contains__)
    model.load_state_dict(state, strict=False, assign=True)
    if args.tie_word_embeddings:
        model.output.weight = model.tok_embeddings.weight
    if args.quantization:
        qlayers.prepare_for_device(model)  # ties scales, packs the weights for this device's kernel
    if fast_kernels:
        kernels.install(model)
    return model.eval()


# ---------------------------------------------------------------- memory preflight (memory.py)

def preflight(model: Transformer, checkpoint_dir, device, dtype: torch.dtype,
              needs: Optional[Callable[[Transformer], list]] = None, ranks: int = 1) -> None:
    """check_memory for the weights of `model` (as meta_model builds it) in `dtype` and what
    needs(model) lists."""
    weights = Need("the weights", weight_bytes(model, dtype), "pass a smaller --dtype or a quantized checkpoint "
                   "(quantize.py)", f" of {checkpoint_dir} in {dtype_name(dtype)}")
    check_memory([weights, *(needs(model) if needs else [])], device, ranks)


def check_cache(model: Transformer, batch_size: int, max_seq_length: int, name: str = "the KV cache") -> None:
    """check_memory for the KV cache model.setup_caches(batch_size, max_seq_length) is about to
    allocate (the one it replaces is freed first), where a library caller sizes it."""
    dtype = model.norm.weight.dtype
    old = kv_cache_bytes(model, model.max_batch_size, model.max_seq_length, dtype) if model.max_seq_length > 0 else 0
    check_memory([Need(name, kv_cache_bytes(model, batch_size, max_seq_length, dtype) - old,
                       "lower the batch size or the sequence length",
                       f" for {batch_size} x {max_seq_length} tokens")], model.norm.weight.device)


def trained_context(args) -> int:
    """Positions the model was trained for: max_position_embeddings, times the factor of the RoPE
    scalings whose configs keep the original length there (linear, dynamic, YaRN), as vLLM reads them."""
    scaling = args.rope_scaling or {}
    factor = scaling.get("factor")
    if scaling.get("rope_type") not in ("linear", "dynamic", "yarn") or not isinstance(factor, (int, float)) \
            or not 1 < factor < 2 ** 31:
        return args.max_position_embeddings
    original = scaling.get("original_max_position_embeddings") if scaling["rope_type"] == "yarn" else None
    original = original if isinstance(original, int) and original > 0 else args.max_position_embeddings
    return max(args.max_position_embeddings, int(original * factor))


def check_vocabulary(tok, args, where) -> None:
    """Every token id the tokenizer gives text, and its BOS and EOS, must index the model's
    embedding: tokenizer files of another model fail here, not as an index error mid-generation.
    Special tokens past the embedding are allowed (Gemma 3's image token); a prompt that holds one
    is refused where it is encoded."""
    past = sorted(i for i in tok.text_ids() if i >= args.vocab_size)
    if past:
        raise TokenizerError(f"{where}: the tokenizer has token ids up to {past[-1]} ({len(past)} of them past the "
                        f"model's vocabulary of {args.vocab_size}): tokenizer files of another model?")


def parse_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"unknown device {name!r} (try cpu or cuda)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError("device cuda is not available on this machine")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise UserError(f"device {name!r} does not exist: this machine has {torch.cuda.device_count()} "
                        f"CUDA device(s), cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError("device mps is not available on this machine")
    if device.type not in ("cpu", "cuda", "mps"):
        raise UserError(f"unsupported device {name!r} (try cpu or cuda)")
    return device


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise UserError(f"unknown dtype {name!r} (choose {', '.join(DTYPES)})")
    return DTYPES[name]


# ---------------------------------------------------------------- the two phases

def prefill(model: Transformer, tokens: Tensor, input_pos: Tensor, pad: Tensor, sampling: Optional[Sampling],
            kv_len: Optional[int] = None) -> Tensor:
    """The next token of each row (B, 1); with sampling None its logits (B, V), for pick_tokens."""
    logits = model(tokens, input_pos, pad, last_logits_only=True, kv_len=kv_len)  # (B, 1, V)
    return logits[:, -1] if sampling is None else sample(logits[:, -1], sampling)


def decode_one_token(model: Transformer, cur: Tensor, input_pos: Tensor, pad: Tensor,
                     sampling: Optional[Sampling], mask: Optional[Tensor] = None) -> Tensor:
    """As prefill, for one token per row (B, 1) at position input_pos (1,). mask: the tokens each
    row's grammar allows, (B, ceil(V / 32)) int32 bits (grammar.token_masks), applied in the step."""
    logits = model(cur, input_pos, pad)[:, -1]  # (B, V)
    if mask is not None:
        logits = logits.masked_fill(~unpack_mask(mask, logits.shape[-1]), float("-inf"))
    return logits if sampling is None else sample(logits, sampling)


def check_fits(start_pos: int, prompt_tokens: int, max_new_tokens: int, max_seq_length: int):
    """The cache must hold the cached tokens, the prompt and every new token."""
    if start_pos + prompt_tokens + max_new_tokens > max_seq_length:
        raise UserError(f"prompt ({start_pos + prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) "
                        f"exceeds the KV cache (max_seq_length {max_seq_length})")


ONE_SEQUENCE = "speculative decoding runs one sequence at a time: use a single prompt and --batch_size 1"


def longrope_switch(args) -> Optional[int]:
    """The sequence length past which a LongRoPE model (Phi-3) rotates with its long factors; None
    for other models."""
    scaling = args.rope_scaling or {}
    return scaling["original_max_position_embeddings"] if scaling.get("rope_type") == "longrope" else None


def crosses_longrope_switch(args, start_pos: int, prompt_tokens: int, max_new_tokens: int) -> bool:
    """Whether a generation onto start_pos cached tokens feeds a forward that outgrows LongRoPE's
    original context while keys rotated with the short factors sit in the cache. transformers'
    Phi-3 generate() then computes the whole sequence again (Engine.generate does too); a prompt
    that is already past the switch from slot 0 is rotated long from the start."""
    switch = longrope_switch(args)
    end = start_pos + prompt_tokens + max_new_tokens - 1  # the last new token is never fed
    return switch is not None and start_pos <= switch < end and (start_pos > 0 or prompt_tokens <= switch)


def check_longrope_batching(args, max_seq_length: int):
    """Continuous batching (BatchEngine) does not recompute a request's keys when it crosses LongRoPE's
    switch, and one row past it would turn every row of the step to the long factors: its cache
    must end there."""
    switch = longrope_switch(args)
    if switch is not None and max_seq_length > switch:
        raise UserError(f"max_seq_length {max_seq_length} is past this LongRoPE model's original context ({switch} "
                        f"tokens), where continuous batching would have to recompute every cached key: use at most {switch}")


def common_prefix(a: list, b: list) -> int:
    lo, hi = 0, min(len(a), len(b))  # slices compare in C: a binary search over their length
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def reusable_prefix(cached: list, ids: list, ring_window: Optional[int]) -> int:
    """How many leading tokens of `ids` can keep their cached keys and values: the common prefix
    with `cached`, leaving at least one token to feed. A ring cache cannot rewind: once it has
    wrapped, going back before its end means starting over."""
    keep = min(common_prefix(cached, ids), len(ids) - 1)
    if ring_window and keep < len(cached) and len(cached) > ring_window:
        return 0
    return keep


# ---------------------------------------------------------------- the engine

@dataclass
class Stats:
    prompt_tokens: int
    new_tokens: int
    ttft_s: float
    decode_s: float
    token_times: list  # host time at which each decode step's tokens were ready
    batch_size: int = 1
    finish_reasons: list = field(default_factory=list)  # per row: "stop" | "length"
    logprobs: list = field(default_factory=list)  # per row, per token (see token_logprobs), when asked for
    cached_tokens: Optional[int] = None  # one row: the tokens its cache holds (start_pos + prompt + fed output)


class Generator(Protocol):
    """What a command line or a server drives: `Engine`, and speculative.py's `SpeculativeEngine`."""
    model: Transformer
    device: torch.device

    def setup(self, batch_size: int, max_seq_length: int) -> None:
        """Allocate the KV caches (again only when the sizes change)."""

    def warm_up(self, prompts: list, sampling: Sampling, host: bool = False, constrained: bool = False) -> None:
        """Run every compiled graph once, so that the next call measures generation, not compilation:
        host, the graphs whose logits go to the host; constrained, those that apply a grammar."""

    def generate(self, prompts: list, max_new_tokens: int, sampling: Sampling, stop_ids=(), start_pos: int = 0,
                 on_tokens: Optional[Callable] = None, constraints: Optional[list] = None,
                 logprobs: Optional[int] = None, host: bool = False) -> tuple:
        """(each row's new token ids, Stats)."""

    def metrics(self, stats: Stats) -> dict:
        """The figures of one generate call, as a flat dict."""


class Engine(Generator):
    """A model with its (optionally compiled) prefill and decode step, and its KV cache."""

    def __init__(self, model: Transformer, compile: bool = False, compile_prefill: bool = False,
                 compile_mode: str = "default"):
        self.model = model
        self.device = model.norm.weight.device
        self.prefill, self.decode_one_token = prefill, decode_one_token
        self.compiled = compile or compile_prefill
        self.jump_forward = True  # feed the tokens a grammar forces as one chunk (False: one step each)
        # queue the next decode step before reading this one's tokens back; it pays only where
        # kernels run asynchronously (CUDA), and costs one unused step when a row stops at EOS
        self.lookahead = self.device.type == "cuda"
        if compile:
            self.decode_one_token = compile_step(decode_one_token, model, compile_mode)
        if compile_prefill:
            tag_compile_cache()
            self.prefill = torch.compile(prefill, dynamic=True, fullgraph=True)
        # forced tokens after a sampled one (jump-forward): a few tokens, compiled for any count
        # (compiled when first used; warm_up(host=True) does it)
        self.chunk = torch.compile(prefill, dynamic=True, fullgraph=True) if compile else self.prefill

    def setup(self, batch_size: int, max_seq_length: int):
        model = self.model
        if model.max_batch_size != batch_size or model.max_seq_length != max_seq_length:
            check_cache(model, batch_size, max_seq_length)
            model.setup_caches(batch_size, max_seq_length)

    def warm_up(self, prompts: list, sampling: Sampling, steps: int = 3, host: bool = False,
                constrained: bool = False):
        """Compile the graphs a generate call will use: host (its logits go to the host) or
        constrained (a grammar's mask in the step, and the chunk of tokens it forces)."""
        if not self.compiled:
            return
        steps = min(steps, self.model.max_seq_length - max(len(p) for p in prompts))
        log("compiling (about a minute the first time, cached on disk afterwards"
            "; every run with --compile_mode max)...")
        start = time.perf_counter()
        # prefill + decode steps: the compiled graph runs from the second on
        self.generate(prompts, steps, sampling, host=host)
        if constrained and not host:  # the step that takes a mask: every token allowed
            with torch.inference_mode():
                B, device = len(prompts), self.device
                mask = torch.full((B, (self.model.args.vocab_size + 31) // 32), -1, dtype=torch.int32, device=device)
                for step in range(2):
                    with guards_skipped(step > 0):
                        self.decode_one_token(self.model, torch.zeros(B, 1, dtype=torch.long, device=device),
                                              torch.tensor([steps], device=device),
                                              torch.zeros(B, dtype=torch.long, device=device), sampling, mask)
        if (host or constrained) and len(prompts) == 1:  # the chunk of forced tokens, two lengths (one dynamic graph)
            with torch.inference_mode():
                for T in (2, 3):  # at positions a chunk has (a cache length below 16 compiles apart)
                    pos = min(64, self.model.max_seq_length - T)
                    self.chunk(self.model, torch.zeros(1, T, dtype=torch.long, device=self.device),
                               torch.arange(pos, pos + T, device=self.device),
                               torch.zeros(1, dtype=torch.long, device=self.device), None, pos + T)
        log(f"compiled in {time.perf_counter() - start:.1f} s")

    @torch.inference_mode()
    def generate(self, prompts: list, max_new_tokens: int, sampling: Sampling, stop_ids=(), start_pos: int = 0,
                 on_tokens: Optional[Callable] = None, constraints: Optional[list] = None,
                 logprobs: Optional[int] = None, host: bool = False) -> tuple:
        """Generate for a batch of token-id prompts (left-padded to a common length).
        start_pos > 0 continues a single conversation whose first start_pos tokens are cached.
        on_tokens(list of per-row new ids, None for a row that has ended) is called as tokens
        arrive; it may return rows to end there (a stop string). constraints: per row a
        grammar.Constraint or None; logprobs: record each token's logprob and this many top ones.
        Returns (outputs, Stats): each row's new tokens, ending at (and including) its stop token
        if it met one.

        Penalties, logit_bias, constraints and logprobs (or host=True) take the step's logits to
        the host (pick_tokens) instead of sampling inside the compiled step. At batch size 1,
        tokens a grammar forces go through the model as one chunk with the sampled token before
        them, not one step each; a batch shares one position per step, so there each row's
        forced tokens come one per step (its mask allows nothing else).

        LongRoPE (Phi-3): the step whose tokens first take the sequence past the original context
        runs the whole sequence again from slot 0 instead (`rerun`), so that every cached key is
        rotated with the long factors, as transformers' generate() does; the longest row of a
        batch decides when."""
        batch, prompt_len = len(prompts), max(len(p) for p in prompts)
        device = self.device
        check_fits(start_pos, prompt_len, max_new_tokens, self.model.max_seq_length)
        if start_pos and crosses_longrope_switch(self.model.args, start_pos, prompt_len, max_new_tokens):
            raise UserError(f"continuing {start_pos} cached tokens past LongRoPE's original context "
                            f"({longrope_switch(self.model.args)} tokens) recomputes them: pass the whole sequence (start_pos 0)")
        pad = torch.tensor([prompt_len - len(p) for p in prompts], device=device)
        tokens = torch.tensor([[0] * (prompt_len - len(p)) + list(p) for p in prompts], device=device)
        stop = frozenset(stop_ids)
        rows = [Request(list(p), max_new_tokens, sampling, stop_ids=stop, constraint=constraints[b] if constraints
                        else None, logprobs=logprobs) for b, p in enumerate(prompts)]
        host = host or sampling.adjusts or logprobs is not None
        # grammars alone: the step masks its logits with their bits and samples as usual
        masked = not host and any(r.constraint for r in rows)

        def accept(ids: list) -> list:
            """Hand out each live row's sampled token (and what its grammar forces after it);
            returns the tokens to feed next (one row: all of them)."""
            fresh = [None if r.finish_reason is not None else
                     r.take(token, jump=self.jump_forward and batch == 1 and token not in stop)
                     for r, token in zip(rows, ids)]
            hand_out(fresh)
            return [f if f is not None else [0] for f in fresh]

        def hand_out(fresh: list):
            for r, new in zip(rows, fresh):
                if new is None:
                    continue
                r.out.extend(new)
                r.finish_reason = r.end_reason()
            if on_tokens:
                for i in range(max(len(f) for f in fresh if f is not None)):
                    for b in on_tokens([f[i] if f is not None and i < len(f) else None for f in fresh]) or ():
                        del rows[b].out[len(rows[b].out) - len(fresh[b]) + i + 1:]  # what followed was never said
                        fresh[b] = fresh[b][:i + 1]
                        rows[b].finish_reason = "stop"

        def pick(logits: Tensor) -> list:
            live = [b for b, r in enumerate(rows) if r.finish_reason is None]
            ids = [0] * batch
            for b, token in zip(live, pick_tokens(logits[live], [rows[b] for b in live])):
                ids[b] = token
            return ids

        start = time.perf_counter()
        if batch == 1 and self.jump_forward and rows[0].constraint is not None:
            # what the grammar forces before any choice (a JSON object's first key) is prefilled with the prompt
            lead = rows[0].take(None)
            if lead:
                hand_out([lead])
                tokens = torch.cat([tokens, torch.tensor([rows[0].out], device=device)], 1)
                prompt_len += len(rows[0].out)
        input_pos = torch.arange(start_pos, start_pos + prompt_len, device=device)
        history = [tokens]  # what has gone through the model, (B, T) chunks from slot 0: a LongRoPE re-run's input
        prefilled = rows[0].finish_reason is None  # else a grammar forced the whole output: nothing to compute
        if not prefilled:
            feed = [[0]]
        elif host or masked:
            logits = self.prefill(self.model, tokens, input_pos, pad, None, start_pos + prompt_len)
            feed = accept(pick(logits))
        else:
            out = self.prefill(self.model, tokens, input_pos, pad, sampling, start_pos + prompt_len)
            feed = accept(out.view(-1).tolist())
        first = time.perf_counter()
        times = []
        pos = start_pos + prompt_len if prefilled else start_pos  # where the next fed token goes
        if not host and not masked:
            pos = self.decode_on_device(out, pos, pad, sampling, rows, accept, times, history)
        steps = 0
        while not all(r.finish_reason for r in rows):  # tokens come back to the host: grammars, penalties
            T, fed = len(feed[0]), torch.tensor(feed, device=device)
            if self.needs_rerun(pos, T):  # LongRoPE's switch: the whole sequence again, picked on the host
                ids = pick(self.rerun(history + [fed], pad, None))
            elif T > 1:  # one row: its sampled token and the ones its grammar forced, as one chunk
                ids = pick(self.chunk(self.model, fed, torch.arange(pos, pos + T, device=device), pad, None, pos + T))
            else:
                mask = None
                if masked:  # a row that has ended, or has no grammar, allows every token
                    mask = token_masks([r.constraint if r.finish_reason is None else None for r in rows],
                                       self.model.args.vocab_size).to(device)
                with guards_skipped(steps > 0):  # clone: a CUDA graph's next replay overwrites its output
                    out = self.decode_one_token(self.model, fed, torch.tensor([pos], device=device), pad,
                                                sampling if masked else None, mask).clone()
                steps += 1
                ids = out.view(-1).tolist() if masked else pick(out)
            history.append(fed)
            pos += len(feed[0])
            feed = accept(ids)
            times.extend([time.perf_counter()] * len(feed[0]))  # a chunk's tokens arrive at once
        end = times[-1] if times else first
        stats = Stats(prompt_tokens=sum(len(p) for p in prompts), new_tokens=sum(len(r.out) for r in rows),
                      ttft_s=first - start, decode_s=end - first, token_times=[first] + times, batch_size=batch,
                      finish_reasons=[r.finish_reason for r in rows],
                      logprobs=[r.token_logprobs for r in rows] if logprobs is not None else [],
                      cached_tokens=pos)
        return [r.out for r in rows], stats

    def decode_on_device(self, out: Tensor, pos: int, pad: Tensor, sampling: Sampling, rows: list,
                         accept: Callable, times: list, history: list) -> int:
        """The decode loop when sampling runs inside the compiled step: a step's input is the
        previous step's output and its position a device counter, so nothing goes from the host to
        the device; the host only reads the tokens back (to stop, and to print). Returns the
        position after the last step whose tokens were read. history: the (B, T) chunks fed so
        far, from slot 0; the steps' inputs are appended."""
        input_pos = torch.tensor([pos], device=self.device)
        budget = rows[0].max_new_tokens - len(rows[0].out)  # steps that can still hand out a token
        first, launched, stepped = pos, 0, 0

        def launch(cur: Tensor) -> Tensor:
            nonlocal launched, stepped
            if self.needs_rerun(first + launched, 1):  # LongRoPE's switch: the whole sequence again
                nxt = self.rerun(history + [cur], pad, sampling)
            else:
                with guards_skipped(stepped > 0):
                    # clone: under CUDA graphs the next replay overwrites the previous step's output buffer
                    nxt = self.decode_one_token(self.model, cur, input_pos, pad, sampling).clone()
                stepped += 1
            history.append(cur)
            input_pos.add_(1)
            launched += 1
            return nxt

        if all(r.finish_reason for r in rows):
            return pos
        out = launch(out)
        while True:
            ahead = launch(out) if self.lookahead and launched < budget else None
            accept(out.view(-1).tolist())
            times.append(time.perf_counter())
            pos += 1
            if all(r.finish_reason for r in rows):
                return pos
            out = ahead if ahead is not None else launch(out)

    def needs_rerun(self, pos: int, T: int) -> bool:
        """Whether feeding T tokens at slot pos first takes a LongRoPE model's sequence past its
        original context, with keys rotated by the short factors in the cache (slots before pos)."""
        switch = longrope_switch(self.model.args)
        return switch is not None and 0 < pos <= switch < pos + T

    def rerun(self, history: list, pad: Tensor, sampling: Optional[Sampling]) -> Tensor:
        """The whole sequence (history: (B, T) chunks from slot 0) through the model again, which
        rewrites every cached key with the long factors: as a prefill, each row's next token
        (B, 1), or with sampling None its logits (B, V)."""
        tokens = torch.cat(history, dim=1)  # (B, length so far)
        n = tokens.shape[1]
        return self.prefill(self.model, tokens, torch.arange(n, device=self.device), pad, sampling, n)

    def metrics(self, stats: Stats) -> dict:
        return decode_metrics(stats, self.model, self.device)


# ---------------------------------------------------------------- chat

class Chat:
    """A multi-turn conversation that keeps the KV cache between turns: each turn renders the
    whole conversation with the chat template and prefills only the tokens the cache lacks."""

    def __init__(self, engine: Generator, tokenizer, system: Optional[str] = None, reuse_cache: bool = True):
        self.engine, self.tokenizer, self.reuse_cache = engine, tokenizer, reuse_cache
        self.messages = [{"role": "system", "content": system}] if system else []
        self.cached: list = []  # token ids whose keys/values are in the cache, in order
        self.last_prompt_tokens = self.last_prefill_tokens = 0

    def reply(self, text: str, max_new_tokens: int, sampling: Sampling, on_tokens=None, **options) -> tuple:
        """The assistant's next turn; options go to the engine's generate (constraints, logprobs)."""
        self.messages.append({"role": "user", "content": text})
        ids = self.tokenizer.encode(self.tokenizer.apply_chat_template(self.messages), add_bos=False)
        keep = reusable_prefix(self.cached, ids, self.engine.model.ring_window) if self.reuse_cache else 0
        room = self.engine.model.max_seq_length - len(ids)
        if room < 2:
            raise UserError(f"the conversation ({len(ids)} tokens) fills the KV cache; "
                            "start again with a larger --max_seq_length")
        if keep and crosses_longrope_switch(self.engine.model.args, keep, len(ids) - keep, min(max_new_tokens, room)):
            keep = 0  # the cached keys were rotated with LongRoPE's short factors: the turn recomputes them
        self.last_prompt_tokens, self.last_prefill_tokens = len(ids), len(ids) - keep
        (out,), stats = self.engine.generate([ids[keep:]], min(max_new_tokens, room), sampling,
                                             self.tokenizer.eos_ids, start_pos=keep, on_tokens=on_tokens, **options)
        # the last sampled token (and any a grammar forced after it) never went through the model
        self.cached = (ids + out)[:stats.cached_tokens if stats.cached_tokens is not None else -1]
        reply_ids = out[:-1] if out and out[-1] in self.tokenizer.eos_ids else out
        self.messages.append({"role": "assistant", "content": self.tokenizer.decode(reply_ids)})
        return out, stats


# ---------------------------------------------------------------- metrics

def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def decode_metrics(stats: Stats, model: Transformer, device: torch.device) -> dict:
    steps = len(stats.token_times) - 1  # decode steps after the first token
    gaps = [b - a for a, b in zip(stats.token_times, stats.token_times[1:])]
    tokens_per_s = steps * stats.batch_size / stats.decode_s if stats.decode_s > 0 else 0.0
    steps_per_s = steps / stats.decode_s if stats.decode_s > 0 else 0.0
    deciles = statistics.quantiles(gaps, n=10) if len(gaps) >= 2 else [gaps[0] if gaps else 0.0] * 9
    return {
        "prompt_tokens": stats.prompt_tokens,
        "new_tokens": stats.new_tokens,
        "ttft_s": stats.ttft_s,
        "decode_tokens_per_s": tokens_per_s,
        "inter_token_latency_median_s": statistics.median(gaps) if gaps else 0.0,
        "inter_token_latency_p90_s": deciles[8],
        # a step reads every dense weight once, whatever the batch size; a mixture's experts, those its rows chose
        "bandwidth_gb_s": param_bytes(model, stats.batch_size) * steps_per_s / 1e9,
        "peak_memory_bytes": peak_memory_bytes(device),
    }


# ---------------------------------------------------------------- continuous batching

@dataclass(eq=False)
class Request:
    """One sequence: what it asks for, and its state (a BatchEngine request, or a row of
    Engine.generate). The callbacks run on the thread that calls BatchEngine.step()."""
    prompt: list
    max_new_tokens: int
    sampling: Sampling = Sampling()
    seed: Optional[int] = None  # its own random stream: the same tokens whatever runs beside it
    stop_ids: frozenset = frozenset()
    on_token: Optional[Callable] = None  # (request, token id) -> True to stop after this token
    on_finish: Optional[Callable] = None  # (request), once finish_reason is set
    out: list = field(default_factory=list)  # the new token ids
    finish_reason: Optional[str] = None  # "stop" | "length" | "cancelled" | "error"
    error: Optional[str] = None
    cached_tokens: int = 0  # leading prompt tokens whose keys and values a previous request left
    slot: Optional[int] = None
    admitted: int = 0  # its place in the order the engine gave out slots
    fed: int = 0  # tokens of prompt + out in the cache so far
    cancelled: bool = False  # set from any thread: the engine ends the request at its next step
    generator: Optional[torch.Generator] = None
    constraint: Optional[object] = None  # a grammar.Constraint: the output must match it
    logprobs: Optional[int] = None  # record each token's logprob and this many top ones (token_logprobs)
    token_logprobs: list = field(default_factory=list)

    def take(self, token: Optional[int], jump: bool = True) -> list:
        """The tokens the request gains from sampling `token`: it, then (jump) the ones its grammar
        forces after it, within max_new_tokens. Sets `error` if the grammar rejects the token.
        token None: only what the grammar forces at the start (leaving room for one sampled token)."""
        c = self.constraint
        if c is None:
            return [token]
        if token is not None and not c.accept(token):
            self.error = c.error() or f"the grammar rejects token {token}"
            return [token]
        new = [] if token is None else [token]
        room = self.max_new_tokens - len(self.out) - len(new) - (token is None)
        # forced tokens skip the logits; with logprobs asked for, the mask forces them one step at a time
        jump = jump and self.logprobs is None and not c.done()
        forced = c.forced()[:max(room, 0)] if jump else []
        if forced and not c.accept_all(forced):
            self.error = c.error() or "the grammar rejects its own forced tokens"
            return new
        return new + forced

    def end_reason(self, last: bool = True) -> Optional[str]:
        """Why the request ends after its newest token, if it does: "error" (its grammar rejected a
        token), "stop" (a stop token; or, after the last of the tokens it just gained, a complete
        grammar), "length" (max_new_tokens reached); else None."""
        if self.error:
            return "error"
        if self.out[-1] in self.stop_ids or (last and self.constraint is not None and self.constraint.done()):
            return "stop"
        return "length" if len(self.out) >= self.max_new_tokens else None


@dataclass(eq=False)
class Slot:
    """One row of the KV cache: the tokens whose keys and values it holds, kept after its request
    ends, so that the next request with the same beginning prefills only the rest."""
    cached: list = field(default_factory=list)
    request: Optional[Request] = None
    last_used: int = 0


@dataclass
class StepPlan:
    """What one step computes, as plain lists (a tensor-parallel rank 0 sends it to the others):
    one token for each decoding row; prompt chunks that ride in the same forward pass, one row per
    token (fused); and prompt chunks prefilled on their own (prefill)."""
    decode: list = field(default_factory=list)  # (cache row, token id, position)
    fused: list = field(default_factory=list)  # (cache row, [token ids], start position)
    prefill: list = field(default_factory=list)  # (cache row, [token ids], start position)
    copies: list = field(default_factory=list)  # (from cache row, to cache row, start, end): done first


# the prompt rows a step takes beside decoding ones, in units of one row's products: the step reads
# the weights once (as long as STEP_ROWS rows' products on this CPU) and a row attends over its
# positions (one unit per ROW_POSITIONS, tuned on SmolLM2 float32, 2 cores); at least MIN_PROMPT_ROWS
STEP_ROWS, ROW_POSITIONS, MIN_PROMPT_ROWS = 32, 100, 8
MIN_SHARED = 16  # tokens: a shorter common beginning with another cache row is computed, not copied


def bucket(n: int, limit: int, smallest: int = 128) -> int:
    """n rounded up to a power of two (at least `smallest`, at most `limit`): the cache length a
    decode step attends over, so that a few compiled graphs serve every length."""
    b = smallest
    while b < n:
        b *= 2
    return min(b, limit)


def buckets(limit: int, smallest: int = 128) -> list:
    """Every cache length bucket() gives for lengths up to limit."""
    out = [min(smallest, limit)]
    while out[-1] < limit:
        out.append(min(2 * out[-1], limit))
    return out


def decode_logits(model: Transformer, tokens: Tensor, input_pos: Tensor, rows: Tensor, kv_len: int,
                  logit_rows: Tensor) -> Tensor:
    """One token for each row (B, 1) at its own position (B, 1) of its own cache row (B,): the
    logits (L, V) of the batch rows logit_rows (L,)."""
    return model(tokens, input_pos, kv_len=kv_len, rows=rows, logit_rows=logit_rows)[:, -1]


class BatchEngine:
    """Continuous batching over a static per-row KV cache (a server's engine).

    Each request gets a cache row (a slot) of its own. Every step decodes one token for every
    request past its prompt, all in one forward pass where each row has its own positions and
    cache row. Prompts are prefilled in the same pass, one row per token, up to `fused_rows` rows
    in all, so that running streams keep flowing while a long prompt arrives; with no stream
    running (or no room), in chunks of `prefill_chunk` tokens of their own. Requests join and
    leave between steps. A finished request's slot keeps its keys and values: a new request takes
    the free slot that shares the longest beginning with its prompt and prefills only the rest.

    A request's output does not depend on what runs beside it on CPU: every decode row goes through
    the same kernels whatever the others are (a compiled step has at least two rows, a lone request
    padded with one that writes to a scratch cache row; at most `fused_rows`, so one kernel serves
    every step), and seeded requests draw from their own generator. How its prompt was split into
    chunks can change the last bits of its keys and values (as a prefix hit does), which the tests
    check does not change greedy text in float32. On CUDA (`pad_rows`) prompts prefill apart and a
    step's rows are padded to a power of two, each shape one CUDA graph; cuBLAS may then give a row
    other bits beside other rows.

    submit() and cancel() may be called from any thread; step() from one thread only.
    """

    def __init__(self, model: Transformer, max_batch_size: int, max_seq_length: int, compile: bool = False,
                 compile_mode: str = "default", prefill_chunk: int = 256, max_waiting: int = 64,
                 prefix_reuse: bool = True, fused_rows: Optional[int] = None, prepack: bool = True,
                 pad_rows: Optional[bool] = None):
        check_longrope_batching(model.args, max_seq_length)
        if prepack:  # steps of many rows: their products read oneDNN's layout of the weights
            kernels.prepack(model)
        self.model, self.device = model, model.norm.weight.device
        self.max_batch_size, self.max_seq_length = max_batch_size, max_seq_length
        self.prefill_chunk, self.max_waiting, self.prefix_reuse = prefill_chunk, max_waiting, prefix_reuse
        # the last row: padding rows write there; one position more than a step attends over, since
        # a step over the whole cache would compile a graph of its own
        check_cache(model, max_batch_size + 1, max_seq_length + 1)
        model.setup_caches(max_batch_size + 1, max_seq_length + 1)
        self.scratch_row = max_batch_size
        self.slots = [Slot() for _ in range(max_batch_size)]
        self.waiting: collections.deque = collections.deque()
        self.lock = threading.Lock()
        self.wakeup = threading.Event()  # set by submit and cancel
        self.steps = self.admissions = 0
        self.counters = {"prompt_tokens": 0, "prefilled_tokens": 0, "cached_tokens": 0, "generated_tokens": 0,
                         "requests_finished": 0}
        self.decode = decode_logits
        self.min_rows = 1
        # On CUDA every step shape is a CUDA graph of its own: rows are padded to a power of two, and
        # the step is compiled general in every size from the start (one compile, not two)
        self.pad_rows = compile and (self.device.type == "cuda" if pad_rows is None else pad_rows)
        if compile:
            self.decode = compile_step(decode_logits, model, compile_mode,  # rows and kv_len vary
                                       dynamic=True if self.pad_rows and compile_mode != "regional" else None)
            # a lone row would take the one-token kernels on CPU, other bits than beside others; and
            # a size of 1 is never general in a compiled graph: it would compile a graph of its own
            self.min_rows = min(2, max_batch_size + 1)
        # Rows of one compiled step: while requests decode, prompt tokens ride in the same step
        # (each a row of its own, at its position), so a prompt costs the running streams a larger
        # step rather than a whole prefill; 0: prompts prefill apart. The CPU kernels serve up to
        # 128 float tokens per call (64 quantized) with the same bits for a row whatever the others.
        if fused_rows is None:
            fused = compile and self.device.type == "cpu" and kernels.available() and not self.pad_rows
            fused_rows = 64 if fused else 0
        if model.ring_window:  # a ring cache reads a row's window before the step writes it: a prompt
            fused_rows = 0     # token would miss the keys of the tokens beside it in the same step
        self.fused_rows = fused_rows
        self.jump_forward = True  # feed the tokens a grammar forces as one chunk (False: one step each)
        self.broadcast: Optional[Callable] = None  # tensor parallelism: rank 0 sends each plan to the others

    # ---- from any thread

    def submit(self, request: Request):
        """Queue a request; UserError if it can never fit, QueueFull if too many wait."""
        if not request.prompt:
            raise UserError("the prompt is empty")
        check_fits(0, len(request.prompt), request.max_new_tokens, self.max_seq_length)
        if request.seed is not None and request.generator is None:
            request.generator = torch.Generator(self.device).manual_seed(request.seed)
        with self.lock:
            free = sum(s.request is None for s in self.slots)  # requests that the next step admits
            if len(self.waiting) >= self.max_waiting + free:
                raise QueueFull(f"{self.max_batch_size} requests are running and {self.max_waiting} waiting")
            self.waiting.append(request)
        self.wakeup.set()

    def cancel(self, request: Request):
        request.cancelled = True
        self.wakeup.set()

    def counts(self) -> tuple[int, int]:
        """(running, waiting) requests."""
        return sum(s.request is not None for s in self.slots), len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.waiting) or any(s.request is not None for s in self.slots)

    # ---- the engine's thread

    @torch.inference_mode()
    def step(self) -> bool:
        """Admit, plan, compute and hand out one step's tokens. False when there was nothing to do."""
        self.steps += 1
        self._admit()
        plan = self._plan()
        if not plan.decode and not plan.fused and not plan.prefill and not plan.copies:
            return False
        if self.broadcast is not None:
            self.broadcast(plan)
        try:
            decoded, prefilled = self.run(plan)
        except Exception as e:  # a fault in the forward pass ends the requests in it, not the engine
            log(f"engine: step failed ({type(e).__name__}: {e})")
            rows = [r for r, *_ in plan.decode + plan.fused + plan.prefill] + [d for _, d, *_ in plan.copies]
            for row in {r for r in rows if r != self.scratch_row}:
                self.slots[row].cached = []  # the row's keys and values may be half written
                self._finish(self.slots[row].request, "error", f"{type(e).__name__}: {e}")
            return True
        self._commit(plan, decoded, prefilled)
        return True

    def run(self, plan: StepPlan) -> tuple[Optional[Tensor], list]:
        """The model's part of a step (every tensor-parallel rank runs it): the decode rows'
        logits (B, V), first the decoding rows', and each fused and prefill chunk's last logits (V,)."""
        device, decoded = self.device, None
        prefilled = []
        for src, dst, start, end in plan.copies:
            self.model.copy_cache(src, dst, start, end)
        if plan.decode or plan.fused:
            rows = list(plan.decode)
            keep = list(range(len(rows)))  # the rows whose logits are wanted: decoding ones, chunks' last
            for row, ids, start in plan.fused:
                rows += [(row, t, start + j) for j, t in enumerate(ids)]
                keep.append(len(rows) - 1)  # its logits matter when the prompt ends there
            width = self.step_width(len(rows))
            rows += [(self.scratch_row, 0, 0)] * (width - len(rows))
            # the same kernels for the logits as for the rest; padded, as many logits as rows (one size)
            keep += [0] * ((width if self.pad_rows else self.min_rows) - len(keep))
            kv_len = bucket(max(pos for _, _, pos in rows) + 1, self.max_seq_length)
            logits = self.decode(self.model, torch.tensor([[t] for _, t, _ in rows], device=device),
                                 torch.tensor([[p] for _, _, p in rows], device=device),
                                 torch.tensor([r for r, _, _ in rows], device=device), kv_len,
                                 torch.tensor(keep, device=device))
            decoded = logits[:len(plan.decode)]
            prefilled = [logits[len(plan.decode) + j] for j in range(len(plan.fused))]
        for row, ids, start in plan.prefill:
            T = len(ids)
            logits = self.model(torch.tensor([ids], device=device), torch.arange(start, start + T, device=device)[None],
                                last_logits_only=True, kv_len=start + T, rows=torch.tensor([row], device=device))
            prefilled.append(logits[0, -1])
        return decoded, prefilled

    def step_width(self, rows: int) -> int:
        """The rows a step of `rows` runs with: at least min_rows; with pad_rows, a power of two."""
        width = max(self.min_rows, rows)
        return 1 << (width - 1).bit_length() if self.pad_rows else width

    def follow(self, receive: Callable):
        """A tensor-parallel rank other than 0: run every plan rank 0 sends, until it sends None."""
        with torch.inference_mode():
            while (plan := receive()) is not None:
                self.run(plan)

    def _admit(self):
        with self.lock:
            for req in [r for r in self.waiting if r.cancelled]:
                self.waiting.remove(req)
                self._finish(req, "cancelled")
            for slot in self.slots:
                if slot.request is not None and slot.request.cancelled:
                    self._finish(slot.request, "cancelled")
            free = [i for i, s in enumerate(self.slots) if s.request is None]
            while free and self.waiting:
                req = self.waiting.popleft()
                # the free slot whose cache shares the longest beginning with the prompt; else the least recently used
                keep, i = max((reusable_prefix(self.slots[i].cached, req.prompt, self.model.ring_window)
                               if self.prefix_reuse else 0, -self.slots[i].last_used, i) for i in free)[0::2]
                free.remove(i)
                slot = self.slots[i]
                slot.request, slot.cached = req, slot.cached[:keep]
                req.slot, req.fed, req.cached_tokens = i, keep, keep
                self.admissions += 1
                req.admitted = self.admissions
                self.counters["prompt_tokens"] += len(req.prompt)
                self.counters["cached_tokens"] += keep
                if req.constraint is not None and self.jump_forward:  # what the grammar forces first is
                    lead = req.take(None)                             # prefilled with the prompt
                    if lead:
                        self._hand_out(req, lead)

    def _plan(self) -> StepPlan:
        plan = StepPlan()
        prefilling = []  # requests with more than one token to feed: a prompt, or tokens a grammar forced
        for i, slot in enumerate(self.slots):
            req = slot.request
            if req is None:
                continue
            if req.out and req.fed == len(req.prompt) + len(req.out) - 1:  # its last token goes in next
                plan.decode.append((i, req.out[-1], req.fed))
            else:
                prefilling.append(req)
        share = self.prefix_reuse and not self.model.ring_window
        budget = self.prefill_chunk
        # prompt rows beside the decoding ones, up to fused_rows in all: while their attention costs
        # less than the decoding rows' whole step (so a step at most about twice as long), or 8 rows.
        # Short prompts fill the step (the weights are read once for all its rows); rows far into a
        # long prompt read many keys each, and gain nothing from sharing a step, so few ride at once
        D = len(plan.decode)
        room = self.fused_rows - D if D else 0
        spend = STEP_ROWS + sum(1 + pos / ROW_POSITIONS for *_, pos in plan.decode)
        floor = MIN_PROMPT_ROWS
        order = sorted(prefilling, key=lambda r: (self.slots[r.slot].last_used, r.admitted))  # first come, first served
        for k, req in enumerate(order):
            known = req.prompt + req.out if req.out else req.prompt
            start = self._share(plan, req, known, order[:k]) if share else req.fed
            if start is None:
                continue  # an earlier request is computing the beginning they share: copied when done
            pending = known[start:]
            # ride in the decode step; where only a few rows are left (a step nearly full of
            # streams), a long prompt takes a chunk instead of a row or two per step
            if room > 0 and room >= min(len(pending), MIN_PROMPT_ROWS):
                n = 0
                while n < min(room, len(pending)) and (n < floor or spend > 0):
                    spend -= (start + n) / ROW_POSITIONS
                    n += 1
                plan.fused.append((req.slot, pending[:n], start))
                floor -= n
                room = room - n if spend > 0 or floor > 0 else 0
                continue
            if plan.fused:
                break
            # chunks at fixed offsets from where the request starts, whatever else runs
            n = min(self.prefill_chunk, len(pending))
            if n > budget and plan.prefill:
                break
            plan.prefill.append((req.slot, pending[:n], start))
            budget -= n
        return plan

    def _share(self, plan: StepPlan, req: Request, known: list, ahead: list) -> Optional[int]:
        """Where a prompt's feeding starts this step: past the longest beginning that another cache
        row holds (busy or free), copied into its own row first; None while a request ahead of it
        is still computing a beginning they share (requests that arrive together with one system
        prompt compute it once)."""
        start = req.fed
        if len(known) - 1 - start < MIN_SHARED:
            return start
        probe = known[:start + MIN_SHARED]  # a row must hold at least this to be worth a copy

        def shared(ids: list) -> int:
            return reusable_prefix(ids, known, None) if ids[:len(probe)] == probe else 0

        best, src = start, None
        for j, slot in enumerate(self.slots):
            if j != req.slot and (n := shared(slot.cached)) > best:
                best, src = n, j
        if any(best < n and other.fed < n and n - start >= MIN_SHARED for other in ahead
               for n in [shared(other.prompt)]):
            return None
        if src is None or best - start < MIN_SHARED:
            return start
        plan.copies.append((src, req.slot, start, best))
        return best

    def _commit(self, plan: StepPlan, decoded: Optional[Tensor], prefilled: list):
        for src, dst, start, end in plan.copies:
            req = self.slots[dst].request
            self.slots[dst].cached.extend(self.slots[src].cached[start:end])
            req.fed += end - start
            req.cached_tokens += end - start
            self.counters["cached_tokens"] += end - start
        ready = []  # (request, its logits)
        if plan.decode:
            for b, (row, token, _) in enumerate(plan.decode):
                req = self.slots[row].request
                self.slots[row].cached.append(token)
                req.fed += 1
                ready.append((req, decoded[b]))
        for (row, ids, start), logits in zip(plan.fused + plan.prefill, prefilled):
            req = self.slots[row].request
            self.slots[row].cached.extend(ids)
            req.fed += len(ids)
            self.counters["prefilled_tokens"] += max(0, min(len(ids), len(req.prompt) - start))
            if req.fed == len(req.prompt) + len(req.out):
                ready.append((req, logits))
        if not ready:
            return
        try:
            ids = pick_tokens(torch.stack([logits for _, logits in ready]), [r for r, _ in ready])
        except Exception as e:
            for req, _ in ready:
                self._finish(req, "error", f"sampling failed: {type(e).__name__}: {e}")
            return
        for (req, _), token in zip(ready, ids):
            self.slots[req.slot].last_used = self.steps
            self._hand_out(req, req.take(token, jump=self.jump_forward and token not in req.stop_ids))

    def _hand_out(self, req: Request, tokens: list):
        """A request's new tokens (a sampled one and any its grammar forced after it): to its
        output and its on_token callback, until one ends it."""
        for i, token in enumerate(tokens):
            req.out.append(token)
            self.counters["generated_tokens"] += 1
            try:
                stop = bool(req.on_token(req, token)) if req.on_token else False
            except Exception as e:  # a fault in one request's handling ends that request only
                self._finish(req, "error", f"{type(e).__name__}: {e}")
                return
            reason = "stop" if stop and not req.error else req.end_reason(last=i == len(tokens) - 1)
            if reason is not None:
                self._finish(req, reason, req.error)
                return

    def _finish(self, req: Request, reason: str, error: Optional[str] = None):
        if req.finish_reason is not None:
            return
        req.finish_reason, req.error = reason, error
        if req.slot is not None and self.slots[req.slot].request is req:
            self.slots[req.slot].request = None
            self.slots[req.slot].last_used = self.steps
        self.counters["requests_finished"] += 1
        if req.on_finish:
            try:
                req.on_finish(req)
            except Exception as e:
                log(f"engine: on_finish failed ({type(e).__name__}: {e})")


class QueueFull(UserError):
    """Every slot is busy and the waiting queue is full: try again later."""
