"""The figures of one generate call: when its tokens came (Stats), and what they come to
(decode_metrics: tokens/s, inter-token latency, bandwidth, memory)."""
import statistics
from dataclasses import dataclass, field

import torch
from torch._dynamo.utils import counters

from memory import peak_memory_bytes
from model import Transformer, param_bytes


@dataclass
class Stats:
    prompt_tokens: int
    new_tokens: int
    ttft_s: float
    decode_s: float
    token_times: list  # host time at which each decode round's tokens were ready (every running row's next)
    batch_size: int = 1
    finish_reasons: list = field(default_factory=list)  # per row: "stop" | "length"
    logprobs: list = field(default_factory=list)  # per row, per token (see sampling.token_logprobs), when asked for
    cached_tokens: int = 0  # prompt tokens found in the prefix cache
    eager_steps: int = 0  # steps run eagerly while the compiled ones compiled aside


def decode_metrics(stats: Stats, model: Transformer, device: torch.device) -> dict:
    steps = len(stats.token_times) - 1  # decode rounds after the first token
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
        # graphs this process compiled instead of finding them in the on-disk cache
        "compile_cache_misses": counters["inductor"]["fxgraph_cache_miss"],
        "eager_steps": stats.eager_steps,
    }
