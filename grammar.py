"""Constrained decoding: output that matches a JSON schema, a regex or a grammar, through llguidance.

    grammars = Grammars("checkpoints/smollm2-135m", vocab_size=model.args.vocab_size)
    spec = grammars.compile("json_schema", {"type": "object", ...})   # UserError if invalid
    constraint = grammars.constraint(spec)                             # one per sequence
    logits = allow_tokens(logits, [constraint])  # -inf where the grammar forbids; then sample; then
    constraint.accept(token); constraint.forced()                     # tokens the grammar leaves no choice on

llguidance (Microsoft; what OpenAI's structured outputs and llama.cpp's use) reads tokenizer.json
itself, compiles a schema or grammar lazily (no start-up cost for a new schema), computes a
token mask in tens of microseconds, and tells which tokens the grammar forces next, so those go
through the model as one chunk instead of one decode step each (jump-forward). Grammars are
written in its Lark dialect (https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md),
which can embed JSON schemas and regexes.
"""
import json
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from errors import UserError

KINDS = ("json_object", "json_schema", "regex", "grammar")
ANY_JSON_OBJECT = {"type": "object"}
# JSON on one line with fixed separators, as json.dumps writes it: no whitespace for the model to
# choose means the keys, colons and commas of a schema are forced tokens (jump-forward)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def one_line(message: str) -> str:
    """llguidance reports errors over several lines (the source, a caret under the spot): keep
    the first and the ones that say what is wrong."""
    lines = [line.strip() for line in message.strip().splitlines()]
    said = [line.removeprefix("error: ") for line in lines[1:] if line.startswith("error:")]
    return " ".join(lines[:1] + said) or "invalid grammar"


class Grammars:
    """The tokenizer as llguidance sees it, and compiled grammars for it. One per model."""

    def __init__(self, checkpoint_dir, vocab_size: int, eos_ids=()):
        import llguidance

        path = Path(checkpoint_dir) / "tokenizer.json"
        if not path.is_file():
            raise UserError(f"constrained decoding needs {path} (a Hugging Face tokenizer file); this checkpoint "
                            "has a SentencePiece tokenizer.model only")
        # n_vocab: the logits' width, which may exceed the tokenizer's (padding rows never allowed)
        self.tokenizer = llguidance.LLTokenizer(str(path), n_vocab=vocab_size,
                                                eos_token=list(eos_ids) or None)
        self.vocab_size = vocab_size

    def compile(self, kind: str, spec) -> str:
        """A grammar in llguidance's format from a JSON schema (dict or JSON text), a regex, a Lark
        grammar, or "json_object" (any JSON object). UserError with the library's message if invalid."""
        from llguidance import LLMatcher

        if kind == "json_object":
            grammar = LLMatcher.grammar_from_json_schema(ANY_JSON_OBJECT, defaults=JSON_OPTIONS)
        elif kind == "json_schema":
            if isinstance(spec, str):
                try:
                    spec = json.loads(spec)
                except json.JSONDecodeError as e:
                    raise UserError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(spec, (dict, bool)):
                raise UserError("a JSON schema must be a JSON object")
            grammar = LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
        elif kind == "regex":
            if not isinstance(spec, str) or not spec:
                raise UserError("a regex must be a non-empty string")
            grammar = LLMatcher.grammar_from_regex(spec)
        elif kind == "grammar":
            if not isinstance(spec, str) or not spec.strip():
                raise UserError("a grammar must be non-empty Lark text")
            grammar = LLMatcher.grammar_from_lark(spec)
        else:
            raise ValueError(f"unknown constraint kind {kind!r} (one of {', '.join(KINDS)})")
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise UserError(f"invalid {kind.replace('_', ' ')}: {one_line(messages[0])}")
        return grammar

    def constraint(self, grammar: str) -> "Constraint":
        return Constraint(self, grammar)


class Constraint:
    """One sequence's position in a grammar: which tokens may come next, which are forced."""

    def __init__(self, grammars: Grammars, grammar: str):
        from llguidance import LLMatcher

        self.grammars, self.grammar = grammars, grammar
        self.matcher = LLMatcher(grammars.tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise UserError(one_line(self.matcher.get_error()))
        self.words = (grammars.vocab_size + 31) // 32

    def fresh(self) -> "Constraint":
        """The same grammar from its start (for another sequence)."""
        return Constraint(self.grammars, self.grammar)

    def fill_mask(self, out: Tensor):
        """Write the allowed next tokens into `out`, an int32 CPU tensor of ceil(V / 32) words
        (bit t % 32 of word t // 32)."""
        self.matcher.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * 4)

    def accept(self, token: int) -> bool:
        """Advance past a token; False (and the matcher is in error) if the grammar forbids it."""
        return self.matcher.consume_token(token)

    def accept_all(self, tokens: list) -> bool:
        return self.matcher.consume_tokens(tokens) if tokens else True

    def valid_prefix(self, tokens: list) -> int:
        """How many leading tokens of `tokens` the grammar allows from here (nothing consumed)."""
        return self.matcher.validate_tokens(tokens) if tokens else 0

    def rollback(self, n: int):
        if n:
            self.matcher.rollback(n)

    def forced(self) -> list:
        """Tokens the grammar allows no alternative to, from here (jump-forward)."""
        return self.matcher.compute_ff_tokens()

    def done(self) -> bool:
        """The grammar is complete and allows nothing more (but end of sequence)."""
        return self.matcher.is_stopped()

    def error(self) -> Optional[str]:
        return one_line(self.matcher.get_error()) if self.matcher.is_error() else None


def token_masks(constraints: list, vocab_size: int) -> Tensor:
    """(B, ceil(V / 32)) int32 bitmask, one row per constraint (None: every token allowed)."""
    masks = torch.full((len(constraints), (vocab_size + 31) // 32), -1, dtype=torch.int32)
    for b, c in enumerate(constraints):
        if c is not None:
            c.fill_mask(masks[b])
    return masks


def unpack_mask(masks: Tensor, vocab_size: int) -> Tensor:
    """(B, W) int32 bitmask -> (B, V) bool: token t allowed iff bit t % 32 of word t // 32 is set.
    Written in tensor ops, so that inside a compiled step it fuses with the masking."""
    bits = torch.bitwise_left_shift(torch.ones((), dtype=torch.int32, device=masks.device),
                                    torch.arange(32, dtype=torch.int32, device=masks.device))
    return (masks.unsqueeze(-1) & bits).ne(0).flatten(1)[:, :vocab_size]


def unpack_mask_on_host(masks: Tensor, vocab_size: int) -> Tensor:
    """unpack_mask for a CPU bitmask, through numpy's unpackbits (many times faster in eager mode;
    byte j of the little-endian words holds tokens 8j to 8j + 7)."""
    bits = np.unpackbits(masks.numpy().view(np.uint8), axis=-1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(bits).bool()


def apply_mask(logits: Tensor, allowed: Tensor) -> Tensor:
    """(B, V) logits, -inf where `allowed` (B, V) bool is False."""
    return torch.where(allowed, logits, torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))


def allow_tokens(logits: Tensor, constraints: list) -> Tensor:
    """(B, V) logits, -inf wherever row b's constraint forbids the token (rows whose constraint is
    None keep every token). A new tensor, unless no row has a constraint."""
    if all(c is None for c in constraints):
        return logits
    V = logits.shape[-1]
    return apply_mask(logits, unpack_mask_on_host(token_masks(constraints, V), V).to(logits.device))
