"""A decoder-only transformer: one `Transformer` for the Llama family (Llama 2/3, Mistral,
SmolLM2/3, Qwen2/3, Granite, Phi-3), the Gemma family (Gemma 1, 2, 3), OLMo 2 and the mixtures of
experts Mixtral, Qwen3-MoE and gpt-oss. Every variation is a field of `ModelArgs`, read from the
checkpoint's config.json, never guessed from names.

This is the reference: nn.Linear and SDPA, one path per module. kernels.install(model) swaps in
the CPU fast paths, qlayers.py its packed linears, tp.py its shards; this file knows none of them.

The KV cache is paged (kvcache.py): every layer keeps its keys and values in one preallocated pool
of slots (`KVCache`), and a forward's `ForwardBatch` says where each token's key and value go and
which slots hold each row's earlier positions, through the row's block table. A step's rows are
sequences at any point of their generation, each at its own positions; nothing is copied when
sequences share a prefix's blocks.
"""
import json
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from config_checks import ConfigError, checked_config_value
from kvcache import ForwardBatch, KVCache
from rope import ROPE_TYPES, Rotary, apply_rope, rope_inv_freq
from thresholds import THRESHOLDS

ARCHITECTURES = ("llama", "mistral", "qwen2", "gemma", "gemma2", "gemma3", "qwen3", "olmo2", "smollm3",
                 "granite", "phi3", "mixtral", "qwen3_moe", "gpt_oss")
ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu}


@dataclass
class ModelArgs:
    architecture: str = "llama"  # family name, kept so a checkpoint says what it is
    vocab_size: int = 32000
    dim: int = 4096  # residual stream width
    n_layers: int = 32
    n_heads: int = 32  # query heads
    n_kv_heads: Optional[int] = None  # < n_heads: grouped-query attention; 1: multi-query
    head_dim: Optional[int] = None  # defaults to dim // n_heads
    intermediate_size: int = 11008  # feed-forward hidden width
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF-style RoPE scaling: {"rope_type": linear|dynamic|llama3|yarn, "factor": ..., ...}
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 4096  # trained context; dynamic NTK and YaRN scale from it
    attention_bias: bool = False  # q/k/v projections carry biases (Qwen2)
    tie_word_embeddings: bool = False  # output head reuses tok_embeddings (no output.weight)
    sliding_window: Optional[int] = None  # Mistral-style local attention over this many keys
    # Per layer "full_attention" | "sliding_attention"; None: every layer slides if sliding_window
    layer_types: Optional[list] = None
    hidden_act: str = "silu"  # gate activation: silu (SwiGLU), gelu_tanh (Gemma's GeGLU)
    # Gemma family. Norm weights are stored as in HF checkpoints; the norm multiplies by
    # (norm_weight_offset + weight), so Gemma's (1 + w) is offset 1.0.
    norm_weight_offset: float = 0.0
    embedding_scale: Optional[float] = None  # Gemma: embeddings times sqrt(dim), rounded to the model dtype
    query_pre_attn_scalar: Optional[float] = None  # attention scale is this**-0.5, not head_dim**-0.5 (Gemma 2/3)
    attn_logit_softcapping: Optional[float] = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcapping: Optional[float] = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    post_norms: bool = False  # "sandwich": also normalize each sublayer's output before the residual add (Gemma 2/3)
    qk_norm: bool = False  # RMSNorm over each query and key head before RoPE (Gemma 3, Qwen3)
    qk_norm_full_width: bool = False  # with qk_norm: over all heads of q (and of k) at once (OLMo 2)
    pre_norms: bool = True  # normalize each sublayer's input; False: only its output, with post_norms (OLMo 2)
    nope_layers: list = field(default_factory=list)  # indices of layers that apply no RoPE (SmolLM3)
    rope_dim: Optional[int] = None  # leading dims of each head that RoPE rotates; None: all (Phi-4-mini: 3/4)
    attention_multiplier: Optional[float] = None  # the attention scale itself, not head_dim**-0.5 (Granite)
    residual_multiplier: float = 1.0  # sublayer outputs times this before the residual add (Granite)
    logits_scaling: float = 1.0  # logits divided by this (Granite)
    # Mixture of experts (Mixtral, Qwen3-MoE, gpt-oss): every layer's feed-forward is n_experts
    # SwiGLUs, of which a router picks n_experts_per_token per token by softmax over its logits.
    n_experts: int = 0  # 0: a dense feed-forward
    n_experts_per_token: int = 2
    moe_intermediate_size: Optional[int] = None  # each expert's hidden width; None: intermediate_size
    norm_topk_prob: bool = True  # chosen probabilities rescaled to sum to 1 (Mixtral; Qwen3-MoE per config)
    moe_bias: bool = False  # the router and every expert carry biases (gpt-oss)
    # gpt-oss's SwiGLU: gate clamped to <= limit, up to [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate)
    swiglu_limit: Optional[float] = None
    swiglu_alpha: float = 1.702
    attention_out_bias: bool = False  # wo carries a bias too (gpt-oss)
    attention_sinks: bool = False  # a learned logit per head joins each softmax over the keys (gpt-oss)
    rope_local_theta: Optional[float] = None  # RoPE base of sliding layers, unscaled; None: as global (Gemma 3)
    bos_token_id: Optional[int] = None
    eos_token_ids: list = field(default_factory=list)  # generation stops at any of these
    quantization: Optional[dict] = None  # scheme written by quantize.py; None for float weights

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(f"unsupported architecture {self.architecture!r} "
                              f"(supported: {', '.join(ARCHITECTURES)})")
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"unsupported activation {self.hidden_act!r}")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ConfigError(f"unsupported RoPE scaling {rope_type!r} (supported: {', '.join(ROPE_TYPES)})")
        if self.layer_types is None:
            kind = "sliding_attention" if self.sliding_window else "full_attention"
            self.layer_types = [kind] * self.n_layers
        if len(self.layer_types) != self.n_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries for {self.n_layers} layers")
        if self.n_experts and not 0 < self.n_experts_per_token <= self.n_experts:
            raise ConfigError(f"n_experts_per_token={self.n_experts_per_token} is not in 1..n_experts={self.n_experts}")
        if self.rope_dim is not None and (self.rope_dim % 2 or not 0 < self.rope_dim <= self.head_dim):
            raise ConfigError(f"rope_dim={self.rope_dim} is not an even number in 1..head_dim={self.head_dim}")

    @classmethod
    def from_dict(cls, d: dict) -> "ModelArgs":
        """config.json's fields -> ModelArgs, each checked against its annotation and CONFIG_RANGES
        first, so that a wrong value is a line naming the field rather than an error deep in the model."""
        annotations = typing.get_type_hints(cls)
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ConfigError(f"unknown config fields: {', '.join(map(repr, unknown))}")
        d = {name: checked_config_value(name, value, annotations[name]) for name, value in d.items()}
        vocab_size = d.get("vocab_size", cls.vocab_size)
        for name in ("bos_token_id", "eos_token_ids"):  # an id past the embedding fails only mid-generation
            ids = d.get(name) if isinstance(d.get(name), list) else [d.get(name)]
            if any(i is not None and i >= vocab_size for i in ids):
                raise ConfigError(f"config field {name!r}: {d[name]!r} is outside the vocabulary of {vocab_size}")
        args = cls(**d)
        try:  # the RoPE variant's parameters: a missing or non-numeric one fails here, not at load
            rope_inv_freq(args)
        except (KeyError, TypeError, ValueError, ZeroDivisionError, OverflowError, RuntimeError) as e:
            raise ConfigError(f"config field 'rope_scaling': {args.rope_scaling!r} is unusable ({type(e).__name__}: {e})") from None
        return args

    @classmethod
    def from_json(cls, path) -> "ModelArgs":
        try:
            d = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path} not found") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON ({e})") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{path} does not hold a JSON object")
        return cls.from_dict(d)

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, weight_offset: float = 0.0):
        super().__init__()
        self.eps, self.weight_offset = eps, weight_offset
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # normalize in float32 so bf16/fp16 activations do not lose the variance
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_offset:  # Gemma scales by (1 + w) in float32 and rounds once, as its reference does
            return (xf * (self.weight_offset + self.weight.float())).type_as(x)
        return self.weight * xf.type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, sliding: bool, rope: bool = True):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.sliding, self.rope = sliding, rope
        qkv_dim = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
        self.wqkv = nn.Linear(args.dim, qkv_dim, bias=args.attention_bias)  # q, k, v fused: one matmul
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=args.attention_out_bias)
        self.sinks = nn.Parameter(torch.zeros(args.n_heads)) if args.attention_sinks else None
        self.qk_norm_full_width = args.qk_norm_full_width
        q_width, k_width = (args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim) \
            if args.qk_norm_full_width else (args.head_dim, args.head_dim)
        self.q_norm = RMSNorm(q_width, args.norm_eps, args.norm_weight_offset) if args.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(k_width, args.norm_eps, args.norm_weight_offset) if args.qk_norm else nn.Identity()
        # None: SDPA's 1/sqrt(head_dim)
        self.scale = args.attention_multiplier or (
            args.query_pre_attn_scalar ** -0.5 if args.query_pre_attn_scalar else None)
        self.softcap = args.attn_logit_softcapping
        self.kv_cache: Optional[KVCache] = None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Optional[Tensor], slots: Tensor,
                context: Optional[Tensor], last: Optional[Tensor] = None) -> Tensor:
        """mask: additive (B, 1, T, S) over the keys read, or None for a fresh chunk's causal
        attention; slots (B, T): where this chunk's keys and values go; context (B, S): the slots
        of the keys read (None: a fresh chunk reads its own). last (B, 1): the token of each row
        whose output alone goes on (the last layer of a prefill)."""
        B, T, _ = x.shape
        hd, nh, nkv = self.head_dim, self.n_heads, self.n_kv_heads
        q, k, v = self.wqkv(x).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        if self.qk_norm_full_width:  # OLMo 2 normalizes the whole projection, before the head split
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, T, nh, hd).transpose(1, 2)  # (B, n_heads, T, head_dim)
        k = k.view(B, T, nkv, hd).transpose(1, 2)  # (B, n_kv_heads, T, head_dim)
        v = v.view(B, T, nkv, hd).transpose(1, 2)
        if not self.qk_norm_full_width:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:  # SmolLM3's NoPE layers skip it
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        self.kv_cache.write(slots, k, v)
        if last is not None:  # the only query whose output goes on: (B, n_heads, 1, head_dim)
            q = q.gather(2, last.view(B, 1, 1, 1).expand(B, nh, 1, hd))
            if mask is not None:
                mask = mask.gather(2, last.view(B, 1, 1, 1).expand(B, 1, 1, mask.shape[-1]))
            T = 1
        if context is None:
            y = self.attend(q, k, v, mask)  # (B, n_heads, T, head_dim)
        else:
            y = self.attend_cache(q, mask, context)
        if self.sinks is not None:  # the sink's exp(logit) joins the softmax's sum: every weight shrinks
            keys = k if context is None else self.kv_cache.read(context)[0]
            y = y * torch.sigmoid(self.logsumexp(q, keys, mask) - self.sinks.view(1, -1, 1, 1)).type_as(y)
        return self.wo(y.transpose(1, 2).reshape(B, T, nh * hd))

    def logsumexp(self, q: Tensor, k: Tensor, mask: Optional[Tensor]) -> Tensor:
        """log of the softmax's sum over the keys attend() weighs, per query: (B, n_heads, T, 1) float32."""
        B, nh, T, hd = q.shape
        scores = q.reshape(B, k.shape[1], -1, hd) @ k.transpose(-2, -1)  # (B, n_kv_heads, group*T, S)
        scores = scores.float().view(B, nh, T, -1) * (self.scale or hd ** -0.5)  # (B, n_heads, T, S)
        if mask is None:  # a fresh chunk: causal
            mask = torch.full((T, T), float("-inf"), device=q.device).triu(1)
        return torch.logsumexp(scores + mask.float(), dim=-1, keepdim=True)

    def attend_cache(self, q: Tensor, mask: Tensor, context: Tensor) -> Tensor:
        """attend() over the cached keys and values of slots context (B, S), gathered."""
        k, v = self.kv_cache.read(context)
        return self.attend(q, k, v, mask)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> Tensor:
        """softmax(scale * q k^T + mask) v: q (B, n_heads, T, head_dim), k and v
        (B, n_kv_heads, S, head_dim); mask (B, 1, T, S) or None (causal). Returns q's shape."""
        B, nh, T, hd = q.shape
        if mask is None:  # SDPA's own causal mask; the last position alone sees every key
            return F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, scale=self.scale, enable_gqa=True)
        # Grouped-query attention without repeating K/V: fold each KV head's query group into
        # the query length, so one SDPA call reads every cached key once.
        nkv, S = k.shape[1], mask.shape[-1]
        group = nh // nkv
        q = q.reshape(B, nkv, group * T, hd)  # (B, n_kv_heads, group*T, head_dim)
        mask = mask.unsqueeze(2).expand(B, 1, group, T, S).reshape(B, 1, group * T, S)
        if mask.device.type != "cpu":  # one query (T = 1) leaves a view whose rows have stride 0, and a
            mask = mask.contiguous()  # prefill's last row starts mid-tensor: CUDA's SDPA read it misaligned
        if self.softcap:  # SDPA cannot soft-cap the scores: spell attention out
            scores = q @ k.transpose(-2, -1) * (self.scale or hd ** -0.5)  # (B, n_kv_heads, group*T, S)
            scores = torch.tanh(scores / self.softcap) * self.softcap + mask
            y = torch.softmax(scores.float(), dim=-1).type_as(q) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return y.reshape(B, nh, T, hd)  # (B, n_heads, T, head_dim); CUDA's SDPA may return (B, T, H, D) memory order


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.intermediate_size, bias=False)  # gate
        self.w3 = nn.Linear(args.dim, args.intermediate_size, bias=False)  # up
        self.w2 = nn.Linear(args.intermediate_size, args.dim, bias=False)  # down
        self.act = ACTIVATIONS[args.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(self.act(self.w1(x)) * self.w3(x))


class Experts(nn.Module):
    """n_experts bias-free linear layers in one matrix (n_experts * out, in): rows e * out to
    (e + 1) * out are expert e's, so quantize.py and tp.py treat it like a linear layer's weight
    (in_features, out_features: the matrix's). qlayers.py's experts layers answer the same calls."""

    def __init__(self, n_experts: int, in_features: int, out_per_expert: int, bias: bool = False):
        super().__init__()
        self.n_experts, self.in_features, self.out_features = n_experts, in_features, n_experts * out_per_expert
        self.weight = nn.Parameter(torch.empty(n_experts * out_per_expert, in_features))
        self.bias = nn.Parameter(torch.empty(n_experts * out_per_expert)) if bias else None

    def forward(self, x: Tensor, ids: Tensor) -> Tensor:
        return through_experts(self, x, ids)

    def gathered(self, ids: Tensor, dtype: torch.dtype) -> Tensor:
        """The weights of the experts ids (N, k): (N, k, out, in)."""
        return self.weight.view(self.n_experts, -1, self.weight.shape[-1])[ids]

    def expert(self, e: int, dtype: torch.dtype) -> Tensor:
        """Expert e's weight (out, in) in dtype, as an nn.Linear holds it."""
        return self.weight.view(self.n_experts, -1, self.weight.shape[-1])[e].to(dtype)


def through_experts(layer: nn.Module, x: Tensor, ids: Tensor) -> Tensor:
    """Token slot (n, j) through expert ids[n, j] of `layer`: x (N, in) or (N, k, in) -> (N, k, out),
    reading only the chosen experts. Few slots (decode): their experts' weights are gathered,
    static shapes for a compiled step. More slots than experts (a prompt, a wide batch): expert
    by expert over the slots that chose it. A compiled graph cannot trace that loop: there it is
    an opaque op, or, for qlayers.py's layers, the gather, which reads their integers."""
    N, k = ids.shape
    x = x.unsqueeze(1).expand(N, k, x.shape[-1]) if x.dim() == 2 else x  # (N, k, in)
    compiling = torch.compiler.is_compiling()
    if N * k <= layer.n_experts or (compiling and type(layer) is not Experts):
        y = torch.einsum("nki,nkoi->nko", x, layer.gathered(ids, x.dtype))
    elif compiling:
        y = torch.ops.minillm_model.experts_grouped(x, ids, layer.weight, layer.n_experts)
    else:
        y = experts_grouped(x, ids, layer.expert)
    if layer.bias is not None:
        y = y + layer.bias.view(layer.n_experts, -1)[ids].to(y.dtype)  # (N, k, out)
    return y


def experts_grouped(x: Tensor, ids: Tensor, weight_of) -> Tensor:
    """x (N, k, in) times weight_of(ids[n, j], dtype) (out, in) for each slot, one product per
    chosen expert: (N, k, out). An expert no slot chose is not read."""
    flat = x.reshape(-1, x.shape[-1])  # (N * k, in)
    slots = ids.flatten().argsort(stable=True)  # slots grouped by expert
    counts = torch.bincount(ids.flatten()).tolist()  # slots per expert, up to the last one chosen
    out, start = None, 0
    for e, n in enumerate(counts):
        if n:
            chosen = slots[start:start + n]
            y = F.linear(flat[chosen], weight_of(e, x.dtype))  # (n, out)
            if out is None:
                out = x.new_empty(flat.shape[0], y.shape[-1])
            out[chosen] = y
            start += n
    return out.view(*ids.shape, -1)


@torch.library.custom_op("minillm_model::experts_grouped", mutates_args=())
def _experts_grouped_op(x: Tensor, ids: Tensor, weight: Tensor, n_experts: int) -> Tensor:
    experts = weight.view(n_experts, -1, weight.shape[-1])
    return experts_grouped(x, ids, lambda e, dtype: experts[e].to(dtype))


@_experts_grouped_op.register_fake
def _(x, ids, weight, n_experts):
    return x.new_empty(ids.shape[0], ids.shape[1], weight.shape[0] // n_experts)


class MoEFeedForward(nn.Module):
    """A mixture of SwiGLU experts (Mixtral, Qwen3-MoE, gpt-oss): the router's softmax picks the
    top n_experts_per_token experts of each token, whose outputs are summed weighted by their
    probabilities (renormalized over the chosen ones with norm_topk_prob)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        hidden, E = args.moe_intermediate_size or args.intermediate_size, args.n_experts
        self.gate = nn.Linear(args.dim, E, bias=args.moe_bias)  # the router
        bias = args.moe_bias
        self.experts = nn.ModuleDict(dict(w1=Experts(E, args.dim, hidden, bias), w3=Experts(E, args.dim, hidden, bias),
                                          w2=Experts(E, hidden, args.dim, bias)))  # gate, up, down
        self.act = ACTIVATIONS[args.hidden_act]
        self.top_k, self.norm_topk_prob = args.n_experts_per_token, args.norm_topk_prob
        self.swiglu_limit, self.swiglu_alpha = args.swiglu_limit, args.swiglu_alpha

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, dim)
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # (N, n_experts)
        weights, ids = probs.topk(self.top_k, dim=-1)  # (N, k)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        experts = self.experts
        h = self.glu(experts["w1"](x, ids), experts["w3"](x, ids))  # (N, k, hidden)
        y = experts["w2"](h, ids)  # (N, k, dim)
        return (y * weights.to(y.dtype).unsqueeze(-1)).sum(1).view(shape)

    def glu(self, gate: Tensor, up: Tensor) -> Tensor:
        if self.swiglu_limit is None:
            return self.act(gate) * up
        gate, up = gate.clamp(max=self.swiglu_limit), up.clamp(-self.swiglu_limit, self.swiglu_limit)
        return (up + 1) * gate * torch.sigmoid(gate * self.swiglu_alpha)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_type: str, rope: bool = True):
        super().__init__()
        self.attention = Attention(args, sliding=layer_type == "sliding_attention", rope=rope)
        self.feed_forward = MoEFeedForward(args) if args.n_experts else FeedForward(args)
        norm = lambda: RMSNorm(args.dim, args.norm_eps, args.norm_weight_offset)  # noqa: E731
        self.attention_norm = norm() if args.pre_norms else nn.Identity()
        self.ffn_norm = norm() if args.pre_norms else nn.Identity()
        self.post_attention_norm = norm() if args.post_norms else nn.Identity()
        self.post_ffn_norm = norm() if args.post_norms else nn.Identity()
        self.residual_multiplier = args.residual_multiplier

    def forward(self, x, cos, sin, masks, views: dict, last: Optional[Tensor] = None):
        """views: ForwardBatch.views(); last (B, 1): the last layer of a prefill, its token alone goes on."""
        sliding = self.attention.sliding
        a = self.attention(self.attention_norm(x), cos, sin, masks[1] if sliding else masks[0], *views[sliding], last)
        if last is not None:  # the residual of the tokens that go on
            x = x.gather(1, last.view(-1, 1, 1).expand(-1, 1, x.shape[-1]))
        h = x + self.post_attention_norm(a) * self.residual_multiplier
        return h + self.post_ffn_norm(self.feed_forward(self.ffn_norm(h))) * self.residual_multiplier


@torch.compiler.nested_compile_region
def block_region(layer: TransformerBlock, *args, **kwargs) -> Tensor:
    """A layer as a region torch.compile compiles once and calls again for every layer alike
    (regional compilation); called outside torch.compile it is the layer's plain call."""
    return layer(*args, **kwargs)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args, t, rope=i not in args.nope_layers)
                                    for i, t in enumerate(args.layer_types))
        self.norm = RMSNorm(args.dim, args.norm_eps, args.norm_weight_offset)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.max_batch_size = self.max_seq_length = self.num_slots = -1
        self.regional = False  # under torch.compile: compile one layer and reuse it (block_region)

    def setup_caches(self, max_batch_size: int, max_seq_length: int, dtype=None, device=None,
                     num_slots: Optional[int] = None, window_slots: Optional[int] = None, zeros=torch.zeros,
                     block_size: Optional[int] = None):
        """Preallocate every layer's slot pool, num_slots of them (default max_batch_size *
        max_seq_length: ForwardBatch.rows' layout, row b from slot b * max_seq_length), or for
        sliding-window layers window_slots when they have pools of their own, in blocks of
        block_size slots (default a row's), from zeros(shape, dtype=, device=); call again to resize."""
        dtype = dtype or self.norm.weight.dtype  # norms stay float in quantized models too
        device = device or self.norm.weight.device
        self.max_batch_size, self.max_seq_length = max_batch_size, max_seq_length
        self.num_slots = num_slots or max_batch_size * max_seq_length
        # RoPE tables live with the caches, so a model built on the meta device needs no re-init
        self.rotary = Rotary(self.args, device=device)
        self.local_rotary = Rotary(self.args, local=True, device=device) if self.args.rope_local_theta else None
        for layer in self.layers:
            a = layer.attention
            slots = window_slots if a.sliding and window_slots else self.num_slots
            a.kv_cache = KVCache(slots, a.n_kv_heads, a.head_dim, dtype, device, zeros, block_size or max_seq_length)

    def masks(self, positions: Tensor, kv_len: int, dtype: torch.dtype, sdpa_causal: bool = False,
              tree_mask: Optional[Tensor] = None) -> tuple[Optional[Tensor], Optional[Tensor]]:
        """Additive (B, 1, T, kv_len) masks over keys at positions 0..kv_len-1, 0 where a query at
        positions (B, T) may attend and -inf elsewhere: (global, sliding window). Additive masks run
        faster than boolean ones in CPU SDPA. sdpa_causal: the global mask is None (SDPA's own).
        tree_mask (B, T, T): the chunk lies in the slots from positions[:, 0] on, each token seeing
        the cached keys and the chunk tokens its row names (ForwardBatch), at their own positions."""
        query_pos = positions.unsqueeze(-1)  # (B, T, 1)
        key_pos = torch.arange(kv_len, device=positions.device).view(1, 1, -1)  # (1, 1, S)
        causal = key_pos <= query_pos
        if tree_mask is not None:  # the cached keys, then the chunk tokens the query sees (a tree: its ancestors)
            T = tree_mask.shape[-1]
            chunk_index = key_pos - positions[:, :1, None]  # (B, 1, S): the chunk token in each slot
            in_chunk, node = (chunk_index >= 0) & (chunk_index < T), chunk_index.clamp(0, T - 1)
            causal = (chunk_index < 0) | (in_chunk & tree_mask.gather(2, node.expand(-1, T, -1)))  # (B, T, S)
            # a chunk key's position, for the window, is its token's (a tree node's: the sequence's length + depth)
            key_pos = torch.where(in_chunk, positions.unsqueeze(1).gather(2, node), key_pos)
        window = self.args.sliding_window

        def additive(allowed):
            return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
                ~allowed, float("-inf")).unsqueeze(1)

        local = additive(causal & (query_pos - key_pos < window)) if window else None
        return None if sdpa_causal else additive(causal), local

    def forward(self, tokens: Tensor, batch: Union[ForwardBatch, Tensor]) -> Tensor:
        """tokens (B, T) at batch's positions, or at input_pos (T,) or (B, T) in rows 0..B-1 of
        setup_caches' rows (ForwardBatch.rows, reading the whole row). Returns float logits (B, T,
        vocab); (B, 1, vocab) with batch.last; only batch.logit_rows' rows with those."""
        batch = self.forward_batch(tokens, batch)
        return self.head(self.blocks(self.embed(tokens), batch, batch.last), batch)

    def forward_batch(self, tokens: Tensor, batch: Union[ForwardBatch, Tensor]) -> ForwardBatch:
        assert self.num_slots > 0, "call setup_caches() first"
        return batch if isinstance(batch, ForwardBatch) else ForwardBatch.rows(
            batch, tokens.shape[0], self.max_seq_length, kv_len=self.max_seq_length)

    def embed(self, tokens: Tensor) -> Tensor:
        x = self.tok_embeddings(tokens)  # (B, T, dim)
        if self.args.embedding_scale:  # the scale rounded to the model dtype first, as Gemma's reference does
            x = x * torch.tensor(self.args.embedding_scale, dtype=x.dtype, device=x.device)
        return x

    def blocks(self, x: Tensor, batch: ForwardBatch, last: Optional[Tensor]) -> Tensor:
        """x (B, T, dim) through self.layers; the last one computes only `last`'s token (B, 1) when given."""
        B, T, _ = x.shape
        cos, sin = self.rotary(batch.positions)
        local_rope = self.local_rotary(batch.positions) if self.local_rotary is not None else (cos, sin)
        # one whole sequence from position 0: full-attention layers use SDPA's causal mask
        sdpa_causal = (batch.fresh and B == 1 and T > THRESHOLDS.causal_sdpa_min_tokens
                       and not self.args.attn_logit_softcapping and batch.tree_mask is None)
        masks = self.masks(batch.positions, T if batch.fresh else batch.kv_len, x.dtype, sdpa_causal, batch.tree_mask)
        views = batch.views()  # the slots and contexts, shared by the layers
        for i, layer in enumerate(self.layers):
            c, s = local_rope if layer.attention.sliding else (cos, sin)
            # past the last layer's keys and values (the cache needs them), a prefill needs only the
            # next token's output: the last layer computes batch.last's token alone
            x = (block_region if self.regional else TransformerBlock.__call__)(
                layer, x, c, s, masks, views, last=last if i == len(self.layers) - 1 else None)
        return x

    def head(self, x: Tensor, batch: ForwardBatch) -> Tensor:
        """The last layer's output (B, T, dim) -> float logits of batch.logit_rows' rows."""
        if batch.logit_rows is not None:
            x = x[batch.logit_rows]
        logits = self.output(self.norm(x))
        if self.args.logits_scaling != 1.0:
            logits = logits / self.args.logits_scaling
        if self.args.final_logit_softcapping:
            cap = self.args.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits.float()


def param_bytes(model: nn.Module, tokens: int = 1) -> int:
    """Bytes of weights read per decode step of `tokens` token slots (batch rows): every parameter
    and weight buffer once, except an untied embedding table, of which a step reads only one row
    per token, and a mixture's experts, of which it reads only the chosen ones: n_experts_per_token
    of n_experts for one token. For more tokens, min(n_experts, tokens * n_experts_per_token)
    experts, as if no two tokens chose the same expert: an upper bound, which real routing
    (tokens sharing experts) stays under."""
    untied = not getattr(model, "args", None) or not model.args.tie_word_embeddings
    tensors = dict(model.named_parameters())  # shared (tied) parameters appear once
    tensors.update((n, b) for n, b in model.named_buffers() if "cache" not in n)
    experts = tuple(f"{name}.experts." for name, m in model.named_modules() if isinstance(m, MoEFeedForward))
    read = 1.0
    if experts:  # each expert's rows of the stacked matrices (and of their scales) are a share n_experts
        args = model.args
        read = min(args.n_experts, tokens * args.n_experts_per_token) / args.n_experts
    return round(sum(t.numel() * t.element_size() * (read if n.startswith(experts) else 1.0) for n, t in tensors.items()
                     if not n.startswith(("rotary.", "local_rotary."))
                     and not (untied and n.startswith("tok_embeddings."))))
