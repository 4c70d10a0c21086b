"""Generate text from a checkpoint: prefill the prompt, then a compiled one-token decode loop.

    python generate.py --checkpoint checkpoints/smollm2-135m --prompt "Once upon a time"
    python generate.py --checkpoint checkpoints/smollm2-135m --chat --prompt "What is a KV cache?"
    python generate.py --checkpoint checkpoints/smollm2-135m --interactive

Generated text goes to stdout; logs and metrics go to stderr.
"""
import argparse
import contextlib
import functools
import json
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import Tensor

from model import ConfigError, ModelArgs, Transformer, param_bytes
from tp import TPError, init_from_env

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UserError(Exception):
    """Bad input from the user: printed as one line, exit status 1."""


def log(*args):
    print(*args, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- loading

@functools.cache  # once per process: load_model calls it for the target and the draft
def keep_freed_memory() -> bool:
    """Let glibc keep freed memory for reuse instead of returning it to the kernel.

    By default every tensor above 128 KiB is a fresh mmap and is unmapped when freed, so each
    prefill touches new pages: a 494-token SmolLM2 prefill took 10k-64k page faults per call
    (zeroed by the kernel, one at a time) and about 8% longer than with the heap kept, which
    takes none after the first call. A verify's logits (T x vocab) paid the same each round.
    Returns whether the allocator took the settings (False off glibc)."""
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


def load_model(checkpoint_dir, device="cpu", dtype=torch.float32, tp=None) -> Transformer:
    """checkpoint dir -> ModelArgs + weights -> Transformer on `device` in `dtype` (eval mode).
    A quantized checkpoint (config.json names its scheme) gets quantize.py's linear layers; with
    `tp` (tp.py), this process builds and reads only its shard of each weight."""
    from safetensors import SafetensorError, safe_open

    keep_freed_memory()
    ckpt = Path(checkpoint_dir)
    if not ckpt.is_dir():
        raise UserError(f"checkpoint directory {ckpt} does not exist (prepare one with scripts/prepare.py)")
    try:
        args = ModelArgs.from_json(ckpt / "config.json")
    except (ConfigError, TypeError) as e:
        raise UserError(f"{ckpt}/config.json: {e}") from None
    weights = ckpt / "model.safetensors"
    if not weights.is_file():
        raise UserError(f"{weights} not found")

    with torch.device("meta"):  # no random init: every weight comes from the file
        model = Transformer(args)
    if args.quantization:
        import quantize  # quantized layers live in quantize.py; model.py does not know them
        try:
            quantize.use_quantized_layers(model, args.quantization)
        except quantize.QuantizeError as e:
            raise UserError(f"{ckpt}/config.json: {e}") from None
    if tp is not None:
        tp.shard_modules(model)  # shrink the sharded layers to this rank's part
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if args.tie_word_embeddings:
        expected = {k: v for k, v in expected.items() if not k.startswith("output.")}
    state = {}
    try:
        with safe_open(weights, framework="pt") as f:  # memory-mapped: only what is read is loaded
            names = set(f.keys())
            missing, unexpected = sorted(set(expected) - names), sorted(names - set(expected))
            if missing:
                raise UserError(f"{weights} lacks {len(missing)} weights, e.g. {', '.join(missing[:3])}")
            if unexpected:
                raise UserError(f"{weights} has {len(unexpected)} unexpected weights, "
                                f"e.g. {', '.join(unexpected[:3])}")
            for name, shape in expected.items():
                t = tp.read(f, name) if tp is not None else f.get_tensor(name)
                if t.shape != shape:
                    raise UserError(f"{weights}: {name} has shape {tuple(t.shape)}, "
                                    f"config.json implies {tuple(shape)}")
                # float weights take the requested dtype; quantized integers and their scales stay
                keep = not t.is_floating_point() or name.endswith((".scales", ".zeros"))
                state[name] = t.to(device=device, dtype=t.dtype if keep else dtype)
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{weights} is unreadable or truncated ({e})") from None
    model.load_state_dict(state, strict=False, assign=True)
    if args.tie_word_embeddings:
        model.output.weight = model.tok_embeddings.weight
        if args.quantization:
            quantize.tie_scales(model)
    if args.quantization:
        quantize.prepare_for_device(model)  # pack the weights for this device's fast kernel
    return model.eval()


def parse_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"unknown device {name!r} (try cpu or cuda)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError("device cuda is not available on this machine")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError("device mps is not available on this machine")
    if device.type not in ("cpu", "cuda", "mps"):
        raise UserError(f"unsupported device {name!r} (try cpu or cuda)")
    return device


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise UserError(f"unknown dtype {name!r} (choose {', '.join(DTYPES)})")
    return DTYPES[name]


# ---------------------------------------------------------------- sampling

@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: Optional[int] = None
    top_p: float = 1.0


def logits_to_probs(logits: Tensor, s: Sampling) -> Tensor:
    """(B, V) float logits -> (B, V) probabilities after temperature, top-k and top-p."""
    logits = logits / max(s.temperature, 1e-5)
    if s.top_k is not None and s.top_k < logits.shape[-1]:
        kth = torch.topk(logits, s.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens ranked above it already reach top_p (the first always stays)
        drop = (probs.cumsum(-1) - probs) >= s.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return torch.softmax(logits, dim=-1)


def sample(logits: Tensor, s: Sampling) -> Tensor:
    """(B, V) logits -> (B, 1) token ids, on device."""
    if s.temperature == 0:
        return logits.argmax(-1, keepdim=True)
    probs = logits_to_probs(logits, s)
    # argmax(p / Exp(1)) draws from p (the exponential race): no multinomial, no host sync
    return (probs / torch.empty_like(probs).exponential_(1)).argmax(-1, keepdim=True)


# ---------------------------------------------------------------- the two phases

def prefill(model: Transformer, tokens: Tensor, input_pos: Tensor, pad: Tensor, s: Sampling,
            kv_len: Optional[int] = None) -> Tensor:
    logits = model(tokens, input_pos, pad, last_logits_only=True, kv_len=kv_len)  # (B, 1, V)
    return sample(logits[:, -1], s)


def decode_one_token(model: Transformer, cur: Tensor, input_pos: Tensor, pad: Tensor, s: Sampling) -> Tensor:
    logits = model(cur, input_pos, pad)  # (B, 1, V)
    return sample(logits[:, -1], s)


def compile_options(device: torch.device, compile_mode: str) -> dict:
    """torch.compile arguments for the decode step."""
    if device.type == "cuda":  # CUDA graphs remove the per-kernel launch cost
        return {"mode": "max-autotune" if compile_mode == "max" else "reduce-overhead"}
    if compile_mode == "max":
        # Freeze the weights into the graph so inductor can pre-pack them for its own C++ GEMM
        # micro-kernels, much faster than oneDNN for bf16 matrix-vector products. The price:
        # frozen graphs are not cached on disk, so every run compiles (a minute or more on CPU).
        # Set globally: passed as per-call options, freezing did not take effect (43 vs 57 tok/s).
        import torch._inductor.config as inductor_config
        inductor_config.freezing = True
        inductor_config.max_autotune = True
        inductor_config.max_autotune_gemm_backends = "CPP,ATEN"
        return {}
    # default: inductor's C++ kernels, cached on disk across runs, called from C++ rather than
    # Python: a quantized SmolLM2 step calls ~180 kernels.py operators, and int8/int4 decoded
    # 15-18% faster this way (float32 the same; in-process A/B, one-off). Not under tensor
    # parallelism: the C++ wrapper cannot call the functional collectives.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return {}
    return {"options": {"cpp_wrapper": True}}


@dataclass
class Stats:
    prompt_tokens: int
    new_tokens: int
    ttft_s: float
    decode_s: float
    token_times: list  # host time at which each decode step's tokens were ready


class Engine:
    """A model with its (optionally compiled) prefill and decode step, and its KV cache."""

    def __init__(self, model: Transformer, compile: bool = False, compile_prefill: bool = False,
                 compile_mode: str = "default"):
        self.model = model
        self.device = model.norm.weight.device
        self.prefill, self.decode_one_token = prefill, decode_one_token
        if compile:
            self.decode_one_token = torch.compile(decode_one_token, fullgraph=True,
                                                  **compile_options(self.device, compile_mode))
        if compile_prefill:
            self.prefill = torch.compile(prefill, dynamic=True, fullgraph=True)

    def setup(self, batch_size: int, max_seq_length: int):
        m = self.model
        if m.max_batch_size != batch_size or m.max_seq_length != max_seq_length:
            m.setup_caches(batch_size, max_seq_length)

    @torch.inference_mode()
    def generate(self, prompts: list, max_new_tokens: int, s: Sampling, stop_ids=(), start_pos: int = 0,
                 on_tokens: Optional[Callable] = None) -> tuple:
        """Generate for a batch of token-id prompts (left-padded to a common length).
        start_pos > 0 continues a single conversation whose first start_pos tokens are cached.
        on_tokens(list of per-row new ids) is called as tokens arrive. Returns (outputs, Stats):
        each row's new tokens, ending at (and including) its stop token if it met one."""
        B, T = len(prompts), max(len(p) for p in prompts)
        dev = self.device
        if start_pos + T + max_new_tokens > self.model.max_seq_length:
            raise UserError(f"prompt ({start_pos + T} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                            f"the KV cache (max_seq_length {self.model.max_seq_length})")
        pad = torch.tensor([T - len(p) for p in prompts], device=dev)
        tokens = torch.tensor([[0] * (T - len(p)) + list(p) for p in prompts], device=dev)
        stop = set(stop_ids)
        outputs, done = [[] for _ in range(B)], [False] * B

        def accept(ids: list) -> list:
            fresh = []
            for row, t in enumerate(ids):
                if done[row]:
                    fresh.append(None)
                    continue
                outputs[row].append(t)
                done[row] = t in stop
                fresh.append(t)
            if on_tokens:
                on_tokens(fresh)
            return fresh

        t0 = time.perf_counter()
        input_pos = torch.arange(start_pos, start_pos + T, device=dev)
        cur = self.prefill(self.model, tokens, input_pos, pad, s, start_pos + T)
        accept(cur.view(-1).tolist())
        t_first = time.perf_counter()
        times = []
        pos = start_pos + T
        for step in range(max_new_tokens - 1):
            if all(done):
                break
            input_pos = torch.tensor([pos], device=dev)
            # After the first step has checked its guards (and compiled if needed), the rest of
            # this loop calls the same graph with inputs of the same shapes: skip re-checking
            # the guards, which costs about a millisecond per token on CPU.
            with torch.compiler.set_stance(skip_guard_eval_unsafe=step > 0):
                # clone: under CUDA graphs the next replay overwrites the previous step's output buffer
                cur = self.decode_one_token(self.model, cur.clone(), input_pos, pad, s)
            accept(cur.view(-1).tolist())  # the host needs the tokens anyway: to stop at EOS and to print
            times.append(time.perf_counter())
            pos += 1
        end = times[-1] if times else t_first
        stats = Stats(prompt_tokens=sum(len(p) for p in prompts), new_tokens=sum(len(o) for o in outputs),
                      ttft_s=t_first - t0, decode_s=end - t_first, token_times=[t_first] + times)
        return outputs, stats


# ---------------------------------------------------------------- chat

def common_prefix(a: list, b: list) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class Chat:
    """A multi-turn conversation that keeps the KV cache between turns: each turn renders the
    whole conversation with the chat template and prefills only the tokens the cache lacks."""

    def __init__(self, engine: Engine, tokenizer, system: Optional[str] = None, reuse_cache: bool = True):
        self.engine, self.tokenizer, self.reuse_cache = engine, tokenizer, reuse_cache
        self.messages = [{"role": "system", "content": system}] if system else []
        self.cached: list = []  # token ids whose keys/values are in the cache, in order
        self.last_prompt_tokens = self.last_prefill_tokens = 0

    def reply(self, text: str, max_new_tokens: int, s: Sampling, on_tokens=None) -> tuple:
        self.messages.append({"role": "user", "content": text})
        ids = self.tokenizer.encode(self.tokenizer.apply_chat_template(self.messages), add_bos=False)
        keep = min(common_prefix(self.cached, ids), len(ids) - 1) if self.reuse_cache else 0
        window = self.engine.model.ring_window
        if window and keep < len(self.cached) and len(self.cached) > window:
            keep = 0  # a ring cache cannot rewind: the window before `keep` was overwritten by later positions
        room = self.engine.model.max_seq_length - len(ids)
        if room < 2:
            raise UserError(f"the conversation ({len(ids)} tokens) fills the KV cache; "
                            "start again with a larger --max_seq_length")
        self.last_prompt_tokens, self.last_prefill_tokens = len(ids), len(ids) - keep
        (out,), stats = self.engine.generate([ids[keep:]], min(max_new_tokens, room), s,
                                             self.tokenizer.eos_ids, start_pos=keep, on_tokens=on_tokens)
        self.cached = (ids + out)[:-1]  # the last sampled token was never fed through the model
        reply_ids = out[:-1] if out and out[-1] in self.tokenizer.eos_ids else out
        self.messages.append({"role": "assistant", "content": self.tokenizer.decode(reply_ids)})
        return out, stats


# ---------------------------------------------------------------- metrics

def metrics(stats: Stats, model: Transformer, device: torch.device, batch_size: int) -> dict:
    steps = len(stats.token_times) - 1  # decode steps after the first token
    gaps = [b - a for a, b in zip(stats.token_times, stats.token_times[1:])]
    tps = steps * batch_size / stats.decode_s if stats.decode_s > 0 else 0.0
    steps_per_s = steps / stats.decode_s if stats.decode_s > 0 else 0.0
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    q = statistics.quantiles(gaps, n=10) if len(gaps) >= 2 else [gaps[0] if gaps else 0.0] * 9
    return {
        "prompt_tokens": stats.prompt_tokens,
        "new_tokens": stats.new_tokens,
        "ttft_s": stats.ttft_s,
        "decode_tokens_per_s": tps,
        "inter_token_latency_median_s": statistics.median(gaps) if gaps else 0.0,
        "inter_token_latency_p90_s": q[8],
        # decode reads every weight once per step, whatever the batch size
        "bandwidth_gb_s": param_bytes(model) * steps_per_s / 1e9,
        "peak_memory_bytes": peak,
    }


def print_metrics(m: dict):
    log(f"prompt tokens {m['prompt_tokens']}, new tokens {m['new_tokens']}, "
        f"time to first token {m['ttft_s'] * 1000:.1f} ms")
    log(f"decode {m['decode_tokens_per_s']:.2f} tokens/s, inter-token latency median "
        f"{m['inter_token_latency_median_s'] * 1000:.1f} ms, p90 {m['inter_token_latency_p90_s'] * 1000:.1f} ms")
    log(f"memory bandwidth {m['bandwidth_gb_s']:.2f} GB/s, peak memory {m['peak_memory_bytes'] / 1e9:.2f} GB")
    if "acceptance_histogram" in m:  # speculative decoding
        from speculative import print_speculation
        print_speculation(m)


# ---------------------------------------------------------------- command line

class StdoutStream:
    """Prints one row's tokens as text as they arrive (multi-byte characters held until whole)."""

    def __init__(self, tokenizer, stop_ids):
        from tokenizer import StreamDecoder
        self.decoder, self.stop = StreamDecoder(tokenizer), set(stop_ids)

    def __call__(self, ids):
        t = ids[0]
        if t is not None and t not in self.stop:
            sys.stdout.write(self.decoder.push(t))
            sys.stdout.flush()

    def close(self):
        sys.stdout.write(self.decoder.flush() + "\n")
        sys.stdout.flush()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Generate text with a checkpoint made by convert_hf_checkpoint.py or scripts/prepare.py.",
        epilog="Compilation (--compile) is on by default: the compiled decode step is several times "
               "faster, and its first run compiles (about a minute on CPU, cached on disk afterwards). "
               "Pass --no-compile for a quick one-off run.")
    p.add_argument("--checkpoint", type=Path, required=True, help="checkpoint directory")
    p.add_argument("--prompt", action="append",
                   help="prompt text; repeat to generate for several prompts in one batch")
    p.add_argument("--max_new_tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top_k", type=int, default=None)
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--num_samples", type=int, default=1, help="generate this many times")
    p.add_argument("--batch_size", type=int, default=1, help="copies of a single prompt to decode together")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="compile the decode step with torch.compile (default: on)")
    p.add_argument("--compile_prefill", action="store_true", help="also compile prefill (dynamic shapes)")
    p.add_argument("--compile_mode", choices=["default", "max"], default="default",
                   help="max: on CPU, freeze the weights and let inductor generate its own GEMM kernels "
                        "(fastest decode, especially in bfloat16, but every run compiles for minutes); "
                        "on CUDA, max-autotune")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32" if not torch.cuda.is_available() else "bfloat16",
                   help="float32, bfloat16 or float16")
    p.add_argument("--max_seq_length", type=int, default=None,
                   help="KV cache length (default: what the prompt and max_new_tokens need; 4096 when interactive)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message for --chat / --interactive")
    p.add_argument("--interactive", action="store_true",
                   help="multi-turn chat on stdin; the KV cache is kept across turns")
    p.add_argument("--ignore_eos", action="store_true", help="always generate max_new_tokens (benchmarks)")
    p.add_argument("--draft_checkpoint", type=Path, default=None,
                   help="speculative decoding (speculative.py): this smaller or quantized model, with the "
                        "same tokenizer, proposes --speculate_k tokens that the target checks in one forward")
    p.add_argument("--draft_dtype", default=None,
                   help="the draft's weights and activations (default: --dtype). A bfloat16 draft for a float32 "
                        "target reads half the bytes per draft step; the output is still exactly the target's")
    p.add_argument("--ngram", type=int, default=None, metavar="N",
                   help="speculative decoding by prompt lookup: propose what followed the most recent earlier "
                        "occurrence of the last N tokens (then N-1, ..., 1) in the prompt and output")
    p.add_argument("--speculate_k", type=int, default=5, help="tokens proposed per round, at most (default: 5)")
    p.add_argument("--adaptive_k", action=argparse.BooleanOptionalAction, default=True,
                   help="adapt the tokens proposed per round to recent acceptance: twice as many after a "
                        "block accepted whole (up to --speculate_k), fewer after a rejection (default: on; "
                        "--no-adaptive_k always proposes --speculate_k)")
    p.add_argument("--compare_plain", action="store_true",
                   help="with speculation: also decode without it and print both speeds (and, greedy, "
                        "whether the outputs are identical)")
    p.add_argument("--profile", type=Path, default=None, help="write a torch.profiler trace of the last sample here")
    p.add_argument("--metrics_json", type=Path, default=None, help="write the metrics as a JSON list here")
    return p


def check_args(a):
    for name in ("max_new_tokens", "num_samples", "batch_size"):
        if getattr(a, name) < 1:
            raise UserError(f"--{name} must be at least 1")
    if a.temperature < 0:
        raise UserError("--temperature must be >= 0")
    if a.top_k is not None and a.top_k < 1:
        raise UserError("--top_k must be at least 1")
    if not 0 < a.top_p <= 1:
        raise UserError("--top_p must be in (0, 1]")
    if a.max_seq_length is not None and a.max_seq_length < 2:
        raise UserError("--max_seq_length must be at least 2")
    if a.prompt and len(a.prompt) > 1 and a.batch_size > 1:
        raise UserError("give either several --prompt or --batch_size, not both")
    if a.draft_checkpoint and a.ngram is not None:
        raise UserError("give either --draft_checkpoint or --ngram, not both")
    if a.ngram is not None and a.ngram < 1:
        raise UserError("--ngram must be at least 1")
    if a.speculate_k < 1:
        raise UserError("--speculate_k must be at least 1")
    if (a.draft_checkpoint or a.ngram) and (a.batch_size > 1 or (a.prompt and len(a.prompt) > 1)):
        raise UserError("speculative decoding runs one sequence at a time: use a single prompt and --batch_size 1")


def write_json(path: Path, obj):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)  # never leave a half-written file behind


def warm_up(engine: Engine, prompts: list, s: Sampling, n: int = 3):
    """Compile before the first sample, so that its metrics measure generation, not compilation."""
    if hasattr(engine, "proposer"):  # speculative.SpeculativeEngine: also its verify and draft graphs
        return engine.warm_up(prompts, s)
    if engine.decode_one_token is decode_one_token and engine.prefill is prefill:
        return
    log("compiling (about a minute the first time, cached on disk afterwards"
        "; every run with --compile_mode max)...")
    t0 = time.perf_counter()
    engine.generate(prompts, n, s)  # prefill + decode steps: the compiled graph runs from the second on
    log(f"compiled in {time.perf_counter() - t0:.1f} s")


def encode_prompts(tok, a) -> list:
    from tokenizer import TokenizerError
    texts = a.prompt or ["Hello, my name is"]
    if a.chat:
        system = [{"role": "system", "content": a.system}] if a.system else []
        try:
            texts = [tok.apply_chat_template(system + [{"role": "user", "content": t}]) for t in texts]
        except TokenizerError as e:
            raise UserError(str(e)) from None
        prompts = [tok.encode(t, add_bos=False) for t in texts]  # the template writes any BOS itself
    else:
        prompts = [tok.encode(t) for t in texts]
    prompts = prompts * a.batch_size if len(prompts) == 1 else prompts
    longest = max(len(p) for p in prompts)
    if a.max_seq_length is not None and longest >= a.max_seq_length:
        raise UserError(f"the prompt has {longest} tokens, more than --max_seq_length {a.max_seq_length} allows")
    if a.max_seq_length is not None and longest + a.max_new_tokens > a.max_seq_length:
        raise UserError(f"prompt ({longest} tokens) + --max_new_tokens ({a.max_new_tokens}) exceeds "
                        f"--max_seq_length {a.max_seq_length}")
    return prompts


def run_interactive(engine, tok, a, s):
    chat = Chat(engine, tok, system=a.system)
    log("interactive chat: type a message, an empty line or Ctrl-D ends")
    all_metrics = []
    while True:
        sys.stderr.write("> ")
        sys.stderr.flush()
        line = sys.stdin.readline()
        if not line.strip():
            break
        stream = StdoutStream(tok, tok.eos_ids)
        _, stats = chat.reply(line.rstrip("\n"), a.max_new_tokens, s, on_tokens=stream)
        stream.close()
        m = metrics(stats, engine.model, engine.device, 1)
        if hasattr(engine, "proposer"):  # speculative.SpeculativeEngine
            m.update(engine.speculation_metrics(stats))
        m["conversation_tokens"], m["prefilled_tokens"] = chat.last_prompt_tokens, chat.last_prefill_tokens
        print_metrics(m)
        all_metrics.append(m)
    return all_metrics


def main(argv=None):
    a = build_parser().parse_args(argv)
    check_args(a)
    tp, a.device = init_from_env(a.device)  # under torchrun: this rank's shard and device (tp.py)
    if tp is not None and a.interactive:
        raise UserError("--interactive is not supported with tensor parallelism (torchrun)")
    speculate = bool(a.draft_checkpoint or a.ngram)
    device, dtype = parse_device(a.device), parse_dtype(a.dtype)
    draft_dtype = parse_dtype(a.draft_dtype) if a.draft_dtype else dtype
    if a.draft_dtype and not a.draft_checkpoint:
        raise UserError("--draft_dtype needs --draft_checkpoint")
    seed = tp.same_seed(a.seed) if tp is not None else a.seed  # ranks must sample the same tokens
    if seed is not None:
        torch.manual_seed(seed)
    from tokenizer import Tokenizer, TokenizerError
    try:
        tok = Tokenizer(a.checkpoint)
    except TokenizerError as e:
        if not a.checkpoint.is_dir():
            raise UserError(f"checkpoint directory {a.checkpoint} does not exist "
                            "(prepare one with scripts/prepare.py)") from None
        raise UserError(str(e)) from None
    s = Sampling(a.temperature, a.top_k, a.top_p)
    prompts = None if a.interactive else encode_prompts(tok, a)  # check lengths before loading weights
    if a.draft_checkpoint:
        from speculative import check_same_tokenizer
        check_same_tokenizer(a.checkpoint, a.draft_checkpoint)
    t0 = time.perf_counter()
    if tp is not None:  # every rank loads its shard; if one fails, all stop with its message
        model = tp.all_ranks_ok(load_model, a.checkpoint, device, dtype, tp=tp)
    else:
        model = load_model(a.checkpoint, device, dtype)
    log(f"loaded {a.checkpoint} ({model.args.architecture}, {param_bytes(model) / 1e6:.0f} MB of weights "
        f"in {a.dtype} on {device}) in {time.perf_counter() - t0:.1f} s")
    stop_ids = [] if a.ignore_eos else sorted(set(model.args.eos_token_ids) | set(tok.eos_ids))
    engine = Engine(model, compile=a.compile, compile_prefill=a.compile_prefill, compile_mode=a.compile_mode)
    if speculate:
        import speculative
        draft = None
        if a.draft_checkpoint:  # under torchrun every rank holds the whole (small) draft
            draft = (tp.all_ranks_ok(load_model, a.draft_checkpoint, device, draft_dtype) if tp is not None
                     else load_model(a.draft_checkpoint, device, draft_dtype))
        if draft is not None:
            log(f"loaded draft {a.draft_checkpoint} ({param_bytes(draft) / 1e6:.0f} MB of weights "
                f"in {a.draft_dtype or a.dtype})")
        engine = speculative.build(engine, a.speculate_k, draft=draft, ngram=a.ngram, compile=a.compile,
                                   compile_mode=a.compile_mode, adaptive=a.adaptive_k)

    if a.interactive:
        engine.setup(1, a.max_seq_length or 4096)
        warm_up(engine, [[0]], s)
        all_metrics = run_interactive(engine, tok, a, s)
    else:
        longest = max(len(p) for p in prompts)
        # round up so that nearby lengths share one compiled graph
        spare = a.speculate_k if speculate else 0  # a verify forward writes k slots past the last token
        engine.setup(len(prompts), a.max_seq_length or -(-(longest + a.max_new_tokens + spare) // 256) * 256)
        warm_up(engine, prompts, s, min(3, a.max_new_tokens))
        all_metrics = []
        for i in range(a.num_samples):
            profiling = a.profile is not None and i == a.num_samples - 1 and (tp is None or tp.rank == 0)
            prof = torch.profiler.profile() if profiling else contextlib.nullcontext()
            stream = StdoutStream(tok, stop_ids) if len(prompts) == 1 else None
            with prof:
                outs, stats = engine.generate(prompts, a.max_new_tokens, s, stop_ids, on_tokens=stream)
            if stream:
                stream.close()
            else:
                for out in outs:
                    print(tok.decode([t for t in out if t not in stop_ids]), flush=True)
            if profiling:
                prof.export_chrome_trace(str(a.profile))
                log(f"wrote profiler trace to {a.profile}")
            m = metrics(stats, model, device, len(prompts))
            if speculate:
                m.update(engine.speculation_metrics(stats))
                if a.compare_plain:
                    m.update(speculative.compare_with_plain(engine, prompts, a.max_new_tokens, s, stop_ids, m, outs))
            if tp is not None:
                m.update(tp.rank_metrics(m, model))
            print_metrics(m)
            all_metrics.append(m)
    if a.metrics_json and (tp is None or tp.rank == 0):
        write_json(a.metrics_json, all_metrics)


if __name__ == "__main__":
    # speculative.py imports generate: let it find this module, not a second copy with its own UserError
    sys.modules.setdefault("generate", sys.modules[__name__])
    try:
        main()
    except (UserError, ConfigError, TPError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
