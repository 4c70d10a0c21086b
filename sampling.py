"""How a row picks its next token from its logits: one batched sampler for every engine.

Temperature, top-k, top-p and min-p shape the distribution (in that order, as transformers does);
`filtered_probs` is the one implementation, for one setting shared by the rows (inside a compiled
step, `sample`) or a setting per row (`sample_rows`). A draw is the exponential race,
argmax(p / Exp(1)), which needs no multinomial and no host sync; a seeded row draws its noise from
its own generator, so its tokens do not depend on what runs beside it. The penalties and
logit_bias depend on the tokens so far and run on the host's side of a step (`adjust_logits`),
as do a grammar's mask and the logprobs a request asks for (`pick_tokens`).
"""
from dataclasses import dataclass
from typing import NamedTuple, Optional, Union

import torch
from torch import Tensor

from errors import UserError
from grammar import allow_tokens


@dataclass(frozen=True)
class Sampling:
    """How a row picks its next token."""
    temperature: float = 0.0  # 0: greedy
    top_k: Optional[int] = None
    top_p: float = 1.0
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one (Nguyen et al. 2024)
    repetition_penalty: float = 1.0  # a token of the prompt or output: logit / p if positive, x p if not (CTRL)
    presence_penalty: float = 0.0  # OpenAI's: minus this once a token is in the output ...
    frequency_penalty: float = 0.0  # ... and minus this times how often it is
    logit_bias: tuple = ()  # ((token id, bias added to its logit), ...)

    @property
    def adjusts(self) -> bool:
        """Whether the logits depend on the tokens so far (or on a bias): sampled outside the compiled step."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.logit_bias))


def check_sampling(s: Sampling, vocab_size: int):
    """UserError for a setting out of range (the ranges OpenAI and vLLM accept)."""
    if not s.temperature >= 0:
        raise UserError("temperature must be >= 0")
    if s.top_k is not None and s.top_k < 1:
        raise UserError("top_k must be at least 1")
    if not 0 < s.top_p <= 1:
        raise UserError("top_p must be in (0, 1]")
    if not 0 <= s.min_p <= 1:
        raise UserError("min_p must be in [0, 1]")
    if not 0 < s.repetition_penalty <= 10:
        raise UserError("repetition_penalty must be in (0, 10]")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2 <= getattr(s, name) <= 2:
            raise UserError(f"{name} must be in [-2, 2]")
    for token, bias in s.logit_bias:
        if not 0 <= token < vocab_size:
            raise UserError(f"logit_bias: token id {token} is out of range [0, {vocab_size})")
        if not -100 <= bias <= 100:
            raise UserError(f"logit_bias: the bias of token {token} must be in [-100, 100]")


Value = Union[float, Tensor]  # one setting for every row, or a column (R, 1) of per-row settings


def filtered_probs(logits: Tensor, temperature: Value, top_k: Optional[Union[int, Tensor]], top_p: Optional[Value],
                   min_p: Optional[Value]) -> Tensor:
    """(R, V) float logits -> (R, V) probabilities after temperature, top-k, top-p and min-p. None
    (or top_k None) leaves a filter out; each setting is a number or an (R, 1) column. Top-k keeps
    the k highest (ties at the k-th kept), top-p then drops a token when the tokens ranked above it
    already reach top_p (the first always stays), min-p drops tokens under min_p x the most likely."""
    V = logits.shape[-1]
    x = logits / temperature
    if top_p is not None:  # one sort serves both: top-k by rank, top-p by the running sum
        ranked, order = torch.sort(x, dim=-1, descending=True)
        if top_k is not None:
            ranked = ranked.masked_fill(torch.arange(V, device=x.device) >= top_k, float("-inf"))
        probs = torch.softmax(ranked, dim=-1)
        ranked = ranked.masked_fill((probs.cumsum(-1) - probs) >= top_p, float("-inf"))
        x = torch.empty_like(x).scatter_(-1, order, ranked)
    elif top_k is not None:
        k = top_k if isinstance(top_k, int) else int(top_k.max())
        kth = torch.topk(x, k, dim=-1).values
        kth = kth[:, -1:] if isinstance(top_k, int) else kth.gather(1, top_k - 1)
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if min_p is not None:
        probs = probs.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), 0.0)
    return probs


def logits_to_probs(logits: Tensor, sampling: Sampling) -> Tensor:
    """(B, V) float logits -> (B, V) probabilities under one Sampling for every row (normalized)."""
    V = logits.shape[-1]
    top_k = sampling.top_k if sampling.top_k is not None and sampling.top_k < V else None
    probs = filtered_probs(logits, max(sampling.temperature, 1e-5), top_k,
                           sampling.top_p if sampling.top_p < 1 else None, sampling.min_p or None)
    return probs / probs.sum(-1, keepdim=True) if sampling.min_p > 0 else probs


def sample_probs(probs: Tensor, noise: Optional[Tensor] = None) -> Tensor:
    """(B, V) probabilities -> (B, 1) ids: argmax(p / Exp(1)) draws from p (the exponential race),
    with no multinomial and no host sync; noise: the Exp(1) draws, when a row has its own generator."""
    noise = torch.empty_like(probs).exponential_(1) if noise is None else noise
    return (probs / noise).argmax(-1, keepdim=True)


class StepSampling(NamedTuple):
    """One Sampling as a compiled step takes it: what changes the graph (greedy or not, which
    filters, top-k's count) as constants, the numbers (temperature, top-p, min-p) as a tensor (3,),
    so that one graph serves every temperature, top-p and min-p."""
    greedy: bool
    top_k: Optional[int]
    top_p: bool
    min_p: bool
    values: Optional[Tensor]


def step_sampling(s: Sampling, vocab_size: int, device) -> StepSampling:
    if s.temperature == 0:
        return StepSampling(True, None, False, False, None)
    values = torch.tensor([max(s.temperature, 1e-5), s.top_p, s.min_p], device=device)
    top_k = s.top_k if s.top_k is not None and s.top_k < vocab_size else None
    return StepSampling(False, top_k, s.top_p < 1, s.min_p > 0, values)


def sample_in_step(logits: Tensor, s: StepSampling) -> Tensor:
    """(B, V) logits -> (B, 1) token ids under s (inside a compiled step): as sample()."""
    if s.greedy:
        return logits.argmax(-1, keepdim=True)
    temperature, top_p, min_p = s.values[0], s.values[1], s.values[2]
    probs = filtered_probs(logits, temperature, s.top_k, top_p if s.top_p else None, min_p if s.min_p else None)
    return sample_probs(probs / probs.sum(-1, keepdim=True) if s.min_p else probs)


def sample(logits: Tensor, sampling: Sampling) -> Tensor:
    """(B, V) logits -> (B, 1) token ids, on device: every row under one Sampling (a compiled step's)."""
    if sampling.temperature == 0:
        return logits.argmax(-1, keepdim=True)
    return sample_probs(logits_to_probs(logits, sampling))


def sample_rows(logits: Tensor, params: list, generators: list) -> Tensor:
    """(B, V) logits -> (B,) token ids, row b under its own Sampling params[b]; a row's random
    draws come from generators[b] (None: torch's global one). One batched computation for the
    rows that sample, argmax for the greedy ones; no host sync."""
    ids = logits.argmax(-1)
    hot = [b for b, p in enumerate(params) if p.temperature > 0]
    if not hot:
        return ids
    V, device = logits.shape[-1], logits.device
    chosen = [params[b] for b in hot]

    def column(values, dtype=None):
        return torch.tensor(values, device=device, dtype=dtype).unsqueeze(1)

    top_k = column([min(p.top_k or V, V) for p in chosen]) if any(p.top_k for p in chosen) else None
    top_p = column([p.top_p for p in chosen]) if any(p.top_p < 1 for p in chosen) else None
    min_p = column([p.min_p for p in chosen]) if any(p.min_p > 0 for p in chosen) else None
    probs = filtered_probs(logits[hot], column([p.temperature for p in chosen]), top_k, top_p, min_p)
    noise = torch.stack([torch.empty(V, device=device).exponential_(1, generator=generators[b]) for b in hot])
    ids[hot] = sample_probs(probs, noise).view(-1)
    return ids


def adjust_logits(logits: Tensor, rows: list) -> Tensor:
    """(B, V) float logits with each row's penalties and logit_bias applied (rows[b]: a Request;
    the penalties count its prompt and output tokens as vLLM does: repetition over both, presence
    and frequency over the output). Returns a new tensor when anything changes."""
    adjusted = [b for b, r in enumerate(rows) if r.sampling.adjusts]
    if not adjusted:
        return logits
    logits, device, V = logits.clone(), logits.device, logits.shape[-1]
    R = len(adjusted)
    index = torch.tensor(adjusted, device=device)
    x = logits[index]  # (R, V)

    def counts(seqs: list) -> Tensor:  # (R, V): how often each token occurs in each row's ids
        c = torch.zeros(R * V, device=device)
        flat = [i * V + t for i, ids in enumerate(seqs) for t in ids]
        if flat:
            c.index_add_(0, torch.tensor(flat, device=device), torch.ones(len(flat), device=device))
        return c.view(R, V)

    params = [rows[b].sampling for b in adjusted]
    out = counts([rows[b].out for b in adjusted])
    column = lambda values: torch.tensor(values, device=device, dtype=x.dtype).unsqueeze(1)  # noqa: E731
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = (out + counts([rows[b].prompt for b in adjusted])) > 0
        penalty = column([p.repetition_penalty for p in params])
        x = torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)
    if any(p.presence_penalty or p.frequency_penalty for p in params):
        x = x - column([p.presence_penalty for p in params]) * (out > 0) - column([p.frequency_penalty for p in params]) * out
    for i, p in enumerate(params):
        if p.logit_bias:
            tokens, biases = zip(*p.logit_bias)
            x[i, list(tokens)] += torch.tensor(biases, device=device, dtype=x.dtype)
    logits[index] = x
    return logits


def token_logprobs(logits: Tensor, ids: list, top: list) -> list:
    """The model's log-probabilities (log-softmax of its logits, before penalties, temperature or a
    grammar): for each row b with top[b] not None, (logprob of ids[b], [(token, logprob)] of its
    top[b] most likely tokens); None for the others."""
    want = [b for b, k in enumerate(top) if k is not None]
    result = [None] * len(ids)
    if not want:
        return result
    logp = torch.log_softmax(logits[want].float(), dim=-1)
    chosen = logp.gather(1, torch.tensor([[ids[b]] for b in want], device=logits.device)).view(-1).tolist()
    k = max(top[b] for b in want)
    values, tokens = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
    values, tokens = values.tolist(), tokens.tolist()
    for i, b in enumerate(want):
        result[b] = (chosen[i], list(zip(tokens[i][:top[b]], values[i][:top[b]])))
    return result


def pick_tokens(logits: Tensor, rows: list) -> list:
    """Each row's next token from its logits (B, V): its penalties and logit_bias, its grammar's
    mask, then its Sampling, drawn from its own generator; records the logprobs a row asked for.
    rows[b]: a Request (its sampling, prompt, out, constraint, generator, logprobs)."""
    x = allow_tokens(adjust_logits(logits.float(), rows), [r.constraint for r in rows])
    ids = sample_rows(x, [r.sampling for r in rows], [r.generator for r in rows]).tolist()
    for r, lp in zip(rows, token_logprobs(logits, ids, [r.logprobs for r in rows])):
        if lp is not None:
            r.token_logprobs.append(lp)
    return ids


def score_prompt(req, start: int, count: int, logits: Tensor):
    """The logprobs of the prompt tokens that the logits (count, V) of its positions start.. predict
    (req.prompt_token_logprobs[i]: token i + 1's); a chunk fed again after a preemption rewrites its own."""
    end = min(start + count, len(req.prompt) - 1)
    if end <= start:
        return
    targets = req.prompt[start + 1:end + 1]
    del req.prompt_token_logprobs[start:]
    req.prompt_token_logprobs += token_logprobs(logits[:end - start], targets, [req.prompt_logprobs] * len(targets))
