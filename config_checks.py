"""What config.json may hold: the ranges of its numbers beyond their annotated types, and the
check of one field (ModelArgs.from_dict runs it on every field). Imports nothing of the project."""
import math
import types
import typing


class ConfigError(ValueError):
    """A config.json that this engine cannot run; the message is meant for the user."""


# Ranges of config.json numbers beyond their annotated type. Every integer is a size, a count or a
# token id, so 0 <= n < 2**31 unless listed; every float must be finite.
CONFIG_POSITIVE = {  # sizes, counts and scales that are divided by, multiplied through or must exist
    "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "intermediate_size",
    "max_position_embeddings", "sliding_window", "rope_dim", "n_experts_per_token", "moe_intermediate_size",
    "norm_eps", "rope_theta", "rope_local_theta", "query_pre_attn_scalar", "attn_logit_softcapping",
    "final_logit_softcapping", "logits_scaling", "embedding_scale", "attention_multiplier"}
CONFIG_MAX = {"n_layers": 4096}  # per-layer lists are built from it before any weight is read
CONFIG_ITEMS = {"layer_types": ("full_attention", "sliding_attention"), "eos_token_ids": int, "nope_layers": int}


def checked_config_value(name: str, value, annotation):
    """value (an int widened to float where a float is expected) if it has the annotated type and
    lies in CONFIG_POSITIVE / CONFIG_MAX / CONFIG_ITEMS' range; otherwise a ConfigError naming the field."""
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."

    def wrong(expected):
        return ConfigError(f"config field {name!r}: {shown} is not {expected}")

    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):  # Optional[X]
        if value is None and type(None) in args:
            return None
        annotation = next(a for a in args if a is not type(None))
    base = typing.get_origin(annotation) or annotation
    if base is bool:
        if not isinstance(value, bool):
            raise wrong("true or false")
    elif base is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise wrong("an integer")
        low = 1 if name in CONFIG_POSITIVE else 0
        high = CONFIG_MAX.get(name, 2 ** 31 - 1)
        if not low <= value <= high:
            raise wrong(f"an integer in {low}..{high}")
    elif base is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise wrong("a number")
        value = float(value)
        if not math.isfinite(value) or (name in CONFIG_POSITIVE and value <= 0):
            raise wrong("a positive finite number" if name in CONFIG_POSITIVE else "a finite number")
    elif base is str:
        if not isinstance(value, str):
            raise wrong("a string")
    elif base is dict:
        if not isinstance(value, dict):
            raise wrong("an object")
    elif base is list:
        if not isinstance(value, list):
            raise wrong("a list")
        items = CONFIG_ITEMS.get(name)
        if isinstance(items, tuple) and not all(isinstance(v, str) and v in items for v in value):
            raise wrong(f"a list of {' or '.join(items)}")
        if items is int and not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2 ** 31
                                    for v in value):
            raise wrong("a list of non-negative integers")
    return value
