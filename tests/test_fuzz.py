"""Fuzzed readers: corrupted GGUF files, safetensors files of our checkpoints, config.json and
tokenizer files. Every input must either load or end quickly in one of our one-line errors
(errors.UserError), never another exception, a hang or a half-written output directory.

Hypothesis draws the corruptions from a fixed seed (derandomize), so a run is reproducible; the
default suite runs several hundred cases in seconds, `-m slow` twenty times as many. A few cases
run the command lines themselves; the last ones fill the disk and press Ctrl-C during a write.
"""
import contextlib
import json
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ROOT
from errors import UserError

SECONDS_PER_CASE = 20  # a case that takes longer is a hang; each takes well under a second
FAST, SLOW = 150, 3000  # cases per test in the default suite / in the slow run
EXAMPLES = [FAST, pytest.param(SLOW, marks=pytest.mark.slow)]


def fuzz_settings(examples: int):
    return settings(max_examples=examples, derandomize=True, database=None, deadline=None,
                    suppress_health_check=list(HealthCheck), print_blob=False)


@contextlib.contextmanager
def time_limit(seconds=SECONDS_PER_CASE):
    def hang(signum, frame):
        raise TimeoutError(f"no answer after {seconds} s: a hang")
    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def loads_or_one_line_error(load, *args):
    """load(*args) either returns or raises a UserError with a one-line message; returns the error."""
    with time_limit():
        try:
            load(*args)
        except UserError as e:
            message = str(e)
            assert message and "\n" not in message and len(message) < 1000, repr(message)
            return e
    return None


def no_leftovers(out: Path):
    """A failed write leaves neither the output directory nor a temporary sibling."""
    assert not out.exists(), f"{out} was left behind"
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")], list(out.parent.iterdir())


# ---------------------------------------------------------------- seeds: a tiny valid GGUF and checkpoint

DIM, N_HEADS, N_KV_HEADS, FFN, N_LAYERS = 16, 2, 1, 32, 1
LETTERS = [chr(c) for c in range(ord("a"), ord("z") + 1)]


def gguf_spec(arch: str) -> tuple[dict, dict]:
    """A tiny model with every metadata key the converter reads, as (key -> (GGUFValueType, value),
    tensor name -> array): llama with a SentencePiece tokenizer, qwen2 (biases) with byte-level BPE."""
    from gguf import GGUFValueType as T

    if arch == "llama":
        tokens = ["<unk>", "<s>", "</s>", "\u2581"] + LETTERS + ["\u2581a", "ab"]
        types = [2, 3, 3] + [1] * (len(tokens) - 3)
    else:
        tokens = ["<|endoftext|>", "<|im_end|>", "\u0120"] + LETTERS + ["ab", "\u0120a"]
        types = [3, 3] + [1] * (len(tokens) - 2)
    vocab = len(tokens)
    meta = {
        "general.architecture": (T.STRING, arch),
        f"{arch}.block_count": (T.UINT32, N_LAYERS), f"{arch}.embedding_length": (T.UINT32, DIM),
        f"{arch}.feed_forward_length": (T.UINT32, FFN), f"{arch}.attention.head_count": (T.UINT32, N_HEADS),
        f"{arch}.attention.head_count_kv": (T.UINT32, N_KV_HEADS), f"{arch}.rope.freq_base": (T.FLOAT32, 1e4),
        f"{arch}.attention.layer_norm_rms_epsilon": (T.FLOAT32, 1e-6), f"{arch}.context_length": (T.UINT32, 64),
        f"{arch}.rope.scaling.type": (T.STRING, "linear"), f"{arch}.rope.scaling.factor": (T.FLOAT32, 2.0),
        "tokenizer.ggml.tokens": (T.ARRAY, tokens), "tokenizer.ggml.token_type": (T.ARRAY, types),
    }
    if arch == "llama":
        meta.update({"tokenizer.ggml.model": (T.STRING, "llama"),
                     "tokenizer.ggml.scores": (T.ARRAY, [float(-i) for i in range(vocab)]),
                     "tokenizer.ggml.bos_token_id": (T.UINT32, 1), "tokenizer.ggml.eos_token_id": (T.UINT32, 2)})
    else:
        meta.update({"tokenizer.ggml.model": (T.STRING, "gpt2"), "tokenizer.ggml.pre": (T.STRING, "qwen2"),
                     "tokenizer.ggml.merges": (T.ARRAY, ["a b", "\u0120 a"]),
                     "tokenizer.ggml.eos_token_id": (T.UINT32, 1),
                     "tokenizer.chat_template": (T.STRING, "{% for m in messages %}{{ m['content'] }}{% endfor %}")})
    head_dim = DIM // N_HEADS
    shapes = {"token_embd.weight": (vocab, DIM), "output_norm.weight": (DIM,), "output.weight": (vocab, DIM)}
    for i in range(N_LAYERS):
        shapes.update({
            f"blk.{i}.attn_norm.weight": (DIM,), f"blk.{i}.ffn_norm.weight": (DIM,),
            f"blk.{i}.attn_q.weight": (N_HEADS * head_dim, DIM), f"blk.{i}.attn_k.weight": (N_KV_HEADS * head_dim, DIM),
            f"blk.{i}.attn_v.weight": (N_KV_HEADS * head_dim, DIM), f"blk.{i}.attn_output.weight": (DIM, DIM),
            f"blk.{i}.ffn_gate.weight": (FFN, DIM), f"blk.{i}.ffn_up.weight": (FFN, DIM),
            f"blk.{i}.ffn_down.weight": (DIM, FFN)})
        if arch == "qwen2":
            shapes.update({f"blk.{i}.attn_{x}.bias": (n * head_dim,)
                           for x, n in (("q", N_HEADS), ("k", N_KV_HEADS), ("v", N_KV_HEADS))})
    rng = np.random.default_rng(0)
    # one F16 tensor, so a type mutation meets a second element size
    tensors = {name: rng.standard_normal(shape).astype(np.float16 if name == "output.weight" else np.float32)
               for name, shape in shapes.items()}
    return meta, tensors


def write_gguf(path: Path, meta: dict, tensors: dict) -> bytes:
    """The GGUF file of gguf_spec's (metadata, tensors); ffn_down goes in Q8_0 blocks while it is a
    float matrix whose rows fill whole blocks, so that dequantization meets a quantized type."""
    import gguf
    from gguf.quants import quantize

    writer = gguf.GGUFWriter(str(path), "unused")
    writer.kv_data[0].clear()  # the architecture comes from meta like every other key
    for key, (vtype, value) in meta.items():
        writer.add_key_value(key, value, vtype)
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    for name, t in tensors.items():
        if name.endswith("ffn_down.weight") and t.dtype == np.float32 and t.ndim == 2 and t.shape[1] % 32 == 0:
            writer.add_tensor(name, quantize(t, q8_0), raw_dtype=q8_0)
        else:
            writer.add_tensor(name, t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


def gguf_parts(path: Path) -> list:
    """(field name, [(byte offset, numpy dtype, count), ...]) for the header, every metadata field
    and every tensor's info (name, n_dims, dims, type, data offset), as laid out in the file."""
    import gguf

    reader = gguf.GGUFReader(path)
    fields = list(reader.fields.values()) + [t.field for t in reader.tensors]
    layout = []
    for f in fields:
        offset, parts = f.offset, []
        for p in f.parts:
            parts.append((offset, p.dtype, p.size))
            offset += p.nbytes
        layout.append((f.name, parts))
    return layout


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    """The seed GGUFs (bytes and layout), the checkpoints converted from them, and the qwen2 one
    quantized to int8."""
    import quantize
    from convert_gguf import convert_gguf

    root = tmp_path_factory.mktemp("seeds")
    out = {}
    for arch in ("llama", "qwen2"):
        data = write_gguf(root / f"{arch}.gguf", *gguf_spec(arch))
        out[arch] = (data, gguf_parts(root / f"{arch}.gguf"))
    with time_limit():
        for arch in ("llama", "qwen2"):
            convert_gguf(root / f"{arch}.gguf", root / f"ckpt-{arch}")
        quantize.main(["--checkpoint", str(root / "ckpt-qwen2"), "--mode", "int8", "--out", str(root / "ckpt-int8")])
    out["ckpt"] = root / "ckpt-qwen2"
    out["ckpt-spm"] = root / "ckpt-llama"
    out["ckpt-int8"] = root / "ckpt-int8"
    return out


INTERESTING_INTS = [0, 1, 2, 3, 5, 7, 255, 256, 2 ** 15, 2 ** 16 - 1, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1,
                    2 ** 32, 2 ** 40, 2 ** 62, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1]
INTERESTING_FLOATS = [0.0, -0.0, 1.0, -1.0, 0.5, 1e-30, 1e30, -1e30, float("inf"), float("-inf"), float("nan")]


def part_value(draw, dtype: np.dtype, count: int) -> bytes:
    """New bytes for one part of the layout: an edge value for numbers, anything for text."""
    if dtype.kind in "iu" and count == 1:
        value = draw(st.sampled_from(INTERESTING_INTS) | st.integers(0, 2 ** 64 - 1))
        return (value % 2 ** (8 * dtype.itemsize)).to_bytes(dtype.itemsize, "little")
    if dtype.kind == "f" and count == 1:
        with np.errstate(over="ignore"):  # a float64 past float32's range becomes inf, one more edge value
            return np.array(draw(st.sampled_from(INTERESTING_FLOATS) | st.floats()), dtype=dtype).tobytes()
    return draw(st.binary(min_size=count * dtype.itemsize, max_size=count * dtype.itemsize))


@st.composite
def corrupted_gguf(draw, seeds):
    """A seed GGUF cut short, or with a few of its header's numbers, lengths, type codes or bytes replaced."""
    arch = draw(st.sampled_from(["llama", "qwen2"]))
    data, layout = seeds[arch]
    data = bytearray(data)
    kind = draw(st.sampled_from(["truncate", "part", "part", "part", "bytes"]))
    if kind == "truncate":
        return bytes(data[:draw(st.integers(0, len(data) - 1))])
    header_end = max(offset + dtype.itemsize * count for _, parts in layout for offset, dtype, count in parts)
    for _ in range(draw(st.integers(1, 3))):
        if kind == "part" and draw(st.booleans()):  # and cut short, so that a length may run past the end
            data = data[:draw(st.integers(header_end, len(data)))]
        if kind == "part":  # a count, a type, a length, a dimension, a tensor offset, a value
            _, parts = draw(st.sampled_from(layout))
            offset, dtype, count = draw(st.sampled_from(parts[:40]))  # a long array: its length and first items
            new = part_value(draw, dtype, count)
        else:  # anything anywhere in the header
            offset = draw(st.integers(0, header_end - 1))
            new = draw(st.binary(min_size=1, max_size=8))
        data[offset:offset + len(new)] = new
    return bytes(data)


# ---------------------------------------------------------------- GGUF

@pytest.mark.parametrize("examples", EXAMPLES)
def test_corrupted_gguf_converts_or_fails_in_one_line(seeds, tmp_path, examples):
    from convert_gguf import convert_gguf

    path, out = tmp_path / "fuzzed.gguf", tmp_path / "ckpt" / "out"

    @fuzz_settings(examples)
    @given(corrupted_gguf(seeds))
    def check(data):
        path.write_bytes(data)
        out.parent.mkdir(exist_ok=True)
        if loads_or_one_line_error(convert_gguf, path, out) is None:
            assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
            shutil.rmtree(out)
        no_leftovers(out)

    check()


def any_gguf_value():
    """(type, value) of any GGUF metadata kind, edge values included."""
    from gguf import GGUFValueType as T

    ints = st.sampled_from(INTERESTING_INTS) | st.integers(0, 2 ** 64 - 1)
    return st.one_of(
        st.tuples(st.just(T.UINT32), ints.map(lambda v: v % 2 ** 32)),
        st.tuples(st.just(T.INT32), st.integers(-2 ** 31, 2 ** 31 - 1)),
        st.tuples(st.just(T.UINT64), ints),
        st.tuples(st.just(T.INT64), st.integers(-2 ** 63, -1)),
        st.tuples(st.just(T.FLOAT32), st.sampled_from(INTERESTING_FLOATS)),
        st.tuples(st.just(T.BOOL), st.booleans()),
        st.tuples(st.just(T.STRING), st.sampled_from(["", "none", "yarn", "llama", "gpt2", "qwen2", "gemma3", "wide"])
                  | st.text(max_size=8)),
        st.tuples(st.just(T.ARRAY), st.lists(st.integers(-2 ** 31, 2 ** 31 - 1), min_size=1, max_size=4)),
        st.tuples(st.just(T.ARRAY), st.lists(st.text(max_size=4), min_size=1, max_size=4)),
        st.tuples(st.just(T.ARRAY), st.lists(st.floats(width=32), min_size=1, max_size=4)))


@st.composite
def gguf_mutations(draw):
    """(arch, edits) for a well-formed GGUF whose metadata or tensors are wrong: values of another
    type or out of range, keys or tensors missing, tensors of another shape or type, extra tensors."""
    arch = draw(st.sampled_from(["llama", "qwen2"]))
    meta, tensors = gguf_spec(arch)
    extra_keys = [f"{arch}.attention.key_length", f"{arch}.attention.sliding_window", "tokenizer.ggml.add_bos_token",
                  f"{arch}.rope.scaling.original_context_length", "tokenizer.ggml.padding_token_id",
                  "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.add_space_prefix"]
    edits = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["value", "value", "value", "drop key", "drop tensor", "reshape", "retype",
                                     "extra tensor"]))
        if kind == "value":
            edits.append((kind, draw(st.sampled_from(sorted(meta) + extra_keys)), draw(any_gguf_value())))
        elif kind == "drop key":
            edits.append((kind, draw(st.sampled_from(sorted(meta))), None))
        elif kind == "reshape":
            edits.append((kind, draw(st.sampled_from(sorted(tensors))),
                          tuple(draw(st.lists(st.integers(1, 40), min_size=1, max_size=3)))))
        elif kind == "retype":
            edits.append((kind, draw(st.sampled_from(sorted(tensors))),
                          draw(st.sampled_from(["float16", "float64", "int8", "int32"]))))
        else:
            edits.append((kind, draw(st.sampled_from(sorted(tensors))),
                          draw(st.sampled_from(["rope_freqs.weight", f"blk.{N_LAYERS}.attn_q.weight", "x"]))))
    return arch, edits


def apply_gguf_mutations(arch, edits) -> tuple[dict, dict]:
    meta, tensors = gguf_spec(arch)
    for kind, name, value in edits:
        if kind == "value":
            meta[name] = value
        elif kind == "drop key":
            meta.pop(name, None)
        elif name not in tensors:
            continue
        elif kind == "drop tensor":
            del tensors[name]
        elif kind == "reshape":
            tensors[name] = np.zeros(value, dtype=tensors[name].dtype)
        elif kind == "retype":
            tensors[name] = tensors[name].astype(value)
        else:
            tensors[value] = tensors[name]
    return meta, tensors


@pytest.mark.parametrize("examples", EXAMPLES)
def test_wrong_gguf_metadata_and_tensors_convert_or_fail_in_one_line(tmp_path, examples):
    from convert_gguf import convert_gguf

    path, out = tmp_path / "fuzzed.gguf", tmp_path / "ckpt" / "out"
    out.parent.mkdir()

    @fuzz_settings(examples)
    @given(gguf_mutations())
    def check(mutations):
        write_gguf(path, *apply_gguf_mutations(*mutations))
        if loads_or_one_line_error(convert_gguf, path, out) is None:
            assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
            shutil.rmtree(out)
        no_leftovers(out)

    check()


# ---------------------------------------------------------------- our checkpoints: model.safetensors

def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    return dst


def load_and_run(ckpt: Path):
    """What generate.py does with a checkpoint, in small: config, tokenizer, weights, one step."""
    import checkpoint
    from loading import load_model
    from tokenizer import Tokenizer

    checkpoint.require_dir(ckpt)
    tok = Tokenizer(ckpt)
    ids = tok.encode("ab a") or [0]
    tok.decode(ids)
    model = load_model(ckpt, fast_kernels=False)
    model.setup_caches(1, 16)
    with torch.no_grad():
        model(torch.tensor([ids[:8]]), torch.arange(len(ids[:8])))


def safetensors_parts(data: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def safetensors_bytes(header: dict, body: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + body


SAFETENSORS_DTYPES = ["F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2",
                      "U16", "U32", "U64", "C64", "F4", "float32", ""]
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.sampled_from(INTERESTING_INTS)
    | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=5)


@st.composite
def corrupted_safetensors(draw, data: bytes):
    """Our model.safetensors with its header length, JSON, dtypes, shapes or offsets wrong, or cut short."""
    header, body = safetensors_parts(data)
    names = sorted(k for k in header if k != "__metadata__")
    kind = draw(st.sampled_from(["length", "truncate", "header bytes", "entry", "entry", "entry", "names",
                                 "metadata"]))
    if kind == "length":
        n = draw(st.sampled_from(INTERESTING_INTS) | st.integers(0, 2 ** 64 - 1))
        return struct.pack("<Q", n) + data[8:]
    if kind == "truncate":
        return data[:draw(st.integers(0, len(data) - 1))]
    if kind == "header bytes":
        (n,) = struct.unpack("<Q", data[:8])
        at = draw(st.integers(8, 8 + n - 1))
        new = draw(st.binary(min_size=1, max_size=4))
        return data[:at] + new + data[at + len(new):]
    if kind == "metadata":
        header["__metadata__"] = draw(JSON_VALUES)
        return safetensors_bytes(header, body)
    if kind == "names":
        name = draw(st.sampled_from(names))
        new_name = draw(st.sampled_from(["", "__metadata__", "output.weight", "layers.7.attention.wqkv.weight"])
                        | st.sampled_from(names))
        header[new_name] = header.pop(name)
        return safetensors_bytes(header, body)
    entry = header[draw(st.sampled_from(names))]
    key = draw(st.sampled_from(["dtype", "shape", "data_offsets", "drop", "extra"]))
    if key == "dtype":  # often one of the same width, which the file's own checks let through
        same_width = {"F32": ["I32", "U32"], "F16": ["BF16", "I16", "U16"], "BF16": ["F16", "I16"],
                      "I8": ["U8", "BOOL", "F8_E4M3"]}.get(entry["dtype"], SAFETENSORS_DTYPES)
        entry["dtype"] = draw(st.sampled_from(same_width) | st.sampled_from(SAFETENSORS_DTYPES) | JSON_VALUES)
    elif key == "shape":
        entry["shape"] = draw(st.lists(st.sampled_from([0, 1, 2, 16, 31, 32, -1, 2 ** 31, 2 ** 63, 2 ** 64 - 1])
                                       | st.integers(0, 64), max_size=4) | JSON_VALUES)
    elif key == "data_offsets":
        start, end = entry["data_offsets"]
        edge = st.sampled_from([0, 1, start, end, start - 1, end + 1, len(body), len(body) + 1, -1, 2 ** 63,
                                2 ** 64 - 1, 2 ** 64])
        entry["data_offsets"] = draw(st.lists(edge, min_size=2, max_size=2) | JSON_VALUES)
    elif key == "drop":
        entry.pop(draw(st.sampled_from(sorted(entry))))
    else:
        entry[draw(st.text(max_size=4))] = draw(JSON_VALUES)
    return safetensors_bytes(header, body)


@pytest.mark.parametrize("examples", EXAMPLES)
@pytest.mark.parametrize("kind", ["ckpt", "ckpt-int8"])
def test_corrupted_safetensors_loads_or_fails_in_one_line(seeds, tmp_path, kind, examples):
    ckpt = copy_checkpoint(seeds[kind], tmp_path / "ckpt")
    data = (ckpt / "model.safetensors").read_bytes()

    @fuzz_settings(examples)
    @given(corrupted_safetensors(data))
    def check(corrupted):
        (ckpt / "model.safetensors").write_bytes(corrupted)
        loads_or_one_line_error(load_and_run, ckpt)

    check()


# ---------------------------------------------------------------- Hugging Face weights

HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": DIM, "intermediate_size": FFN,
             "num_hidden_layers": N_LAYERS, "num_attention_heads": N_HEADS, "num_key_value_heads": N_KV_HEADS,
             "vocab_size": 32}


def write_hf_checkpoint(path: Path, shards: int) -> None:
    """A tiny Llama in Hugging Face's layout: config.json and model.safetensors, or `shards` files
    and model.safetensors.index.json."""
    from safetensors.torch import save_file

    head_dim = DIM // N_HEADS
    shapes = {"model.embed_tokens.weight": (32, DIM), "model.norm.weight": (DIM,), "lm_head.weight": (32, DIM)}
    for i in range(N_LAYERS):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (N_HEADS * head_dim, DIM), p + "self_attn.k_proj.weight": (N_KV_HEADS * head_dim, DIM),
            p + "self_attn.v_proj.weight": (N_KV_HEADS * head_dim, DIM), p + "self_attn.o_proj.weight": (DIM, DIM),
            p + "mlp.gate_proj.weight": (FFN, DIM), p + "mlp.up_proj.weight": (FFN, DIM), p + "mlp.down_proj.weight": (DIM, FFN),
            p + "input_layernorm.weight": (DIM,), p + "post_attention_layernorm.weight": (DIM,)})
    torch.manual_seed(0)
    tensors = {name: torch.randn(shape) for name, shape in shapes.items()}
    path.mkdir()
    (path / "config.json").write_text(json.dumps(HF_CONFIG))
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"))
        return
    names = sorted(tensors)
    weight_map = {}
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file({name: tensors[name] for name in names[k::shards]}, str(path / file))
        weight_map.update({name: file for name in names[k::shards]})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@st.composite
def corrupted_hf_checkpoint(draw, files: dict):
    """One weight file corrupted as our own, or the index's weight map given wrong file names."""
    files = dict(files)
    index = "model.safetensors.index.json"
    name = draw(st.sampled_from(sorted(files)))
    if name != index:
        files[name] = draw(corrupted_safetensors(files[name]))
        return files
    obj = json.loads(files[index])
    kind = draw(st.sampled_from(["file", "file", "map", "drop"]))
    if kind == "file":
        tensor = draw(st.sampled_from(sorted(obj["weight_map"])))
        obj["weight_map"][tensor] = draw(st.sampled_from(["", ".", "..", "../config.json", "/etc/passwd",
                                                          "config.json", "missing.safetensors"]) | JSON_VALUES)
    elif kind == "map":
        obj["weight_map"] = draw(JSON_VALUES)
    else:
        obj["weight_map"].pop(draw(st.sampled_from(sorted(obj["weight_map"]))))
    files[index] = json.dumps(obj).encode()
    return files


@pytest.mark.parametrize("examples", EXAMPLES)
@pytest.mark.parametrize("shards", [1, 2])
def test_corrupted_hf_weights_convert_or_fail_in_one_line(tmp_path, shards, examples):
    from convert_hf import convert_hf_checkpoint

    src, hf, out = tmp_path / "src", tmp_path / "hf", tmp_path / "ckpt" / "out"
    write_hf_checkpoint(src, shards)
    files = {p.name: p.read_bytes() for p in src.iterdir() if p.name != "config.json"}
    out.parent.mkdir()

    @fuzz_settings(examples // 2)
    @given(corrupted_hf_checkpoint(files))
    def check(corrupted):
        shutil.rmtree(hf, ignore_errors=True)
        shutil.copytree(src, hf)
        for name, data in corrupted.items():
            (hf / name).write_bytes(data)
        if loads_or_one_line_error(convert_hf_checkpoint, hf, out) is None:
            load_and_run_weights(out)
            shutil.rmtree(out)
        no_leftovers(out)

    check()


def load_and_run_weights(ckpt: Path):
    """A converted checkpoint without tokenizer files: its weights load and run one step."""
    from loading import load_model

    model = load_model(ckpt, fast_kernels=False)
    model.setup_caches(1, 4)
    with torch.no_grad():
        model(torch.tensor([[1, 2]]), torch.arange(2))


# ---------------------------------------------------------------- config.json

@st.composite
def corrupted_config(draw, config: dict):
    """config.json with fields of another type, out of range, missing or unknown."""
    config = dict(config)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["value", "value", "value", "number", "drop", "unknown"]))
        name = draw(st.sampled_from(sorted(config)))
        if kind == "value":
            config[name] = draw(JSON_VALUES)
        elif kind == "number":
            config[name] = draw(st.sampled_from([0, -1, 1, 2, 3, 2 ** 31, 2 ** 63, 1e300, 0.5, -0.5, float("nan"),
                                                 float("inf"), True, "1", [1], None]))
        elif kind == "drop":
            config.pop(name)
        else:
            config[draw(st.text(max_size=6))] = draw(JSON_VALUES)
    nested = {"rope_scaling": ["rope_type", "factor", "original_max_position_embeddings", "low_freq_factor",
                               "high_freq_factor"],
              "quantization": ["mode", "embedding", "output", "groupsize", "padded"]}
    name = draw(st.sampled_from(sorted(nested)))
    if draw(st.booleans()) and isinstance(config.get(name), dict):  # a value inside rope_scaling or quantization
        value = draw(JSON_VALUES | st.sampled_from(["int4", "int8", "int4-gptq", "float", "linear", "yarn", "llama3"]))
        config[name] = {**config[name], draw(st.sampled_from(nested[name])): value}
    return draw(st.sampled_from([config] * 8 + [[config], None]))


@pytest.mark.parametrize("examples", EXAMPLES)
@pytest.mark.parametrize("kind", ["ckpt", "ckpt-int8"])
def test_corrupted_config_loads_or_fails_in_one_line(seeds, tmp_path, kind, examples):
    ckpt = copy_checkpoint(seeds[kind], tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())

    @fuzz_settings(examples)
    @given(corrupted_config(config))
    def check(corrupted):
        (ckpt / "config.json").write_text(json.dumps(corrupted))
        loads_or_one_line_error(load_and_run, ckpt)

    check()


# ---------------------------------------------------------------- tokenizer files

@st.composite
def corrupted_tokenizer(draw, files: dict):
    """One tokenizer file replaced: cut short, bytes changed, or (JSON) a value of another type."""
    files = dict(files)
    name = draw(st.sampled_from(sorted(files)))
    data = files[name]
    kind = draw(st.sampled_from(["truncate", "bytes", "json", "json", "delete"]))
    if kind == "truncate":
        files[name] = data[:draw(st.integers(0, len(data) - 1))]
    elif kind == "bytes":
        at = draw(st.integers(0, len(data) - 1))
        new = draw(st.binary(min_size=1, max_size=4))
        files[name] = data[:at] + new + data[at + len(new):]
    elif kind == "delete":
        del files[name]
    elif name.endswith(".json"):
        obj = json.loads(data)
        key = draw(st.sampled_from(sorted(obj) + ["bos_token", "eos_token", "chat_template", "add_bos_token"]))
        value = draw(JSON_VALUES | st.sampled_from([{"content": 5}, [{"name": "default"}], [{"template": 1}],
                                                    "<unknown>", "{% if %}", 1]))
        if isinstance(obj, dict):
            obj[key] = value
        files[name] = json.dumps(obj).encode()
    return files


@pytest.mark.parametrize("examples", EXAMPLES)
@pytest.mark.parametrize("kind", ["ckpt", "ckpt-spm"])
def test_corrupted_tokenizer_loads_or_fails_in_one_line(seeds, tmp_path, kind, examples):
    from tokenizer import Tokenizer

    src = seeds[kind]
    names = [p.name for p in src.iterdir() if p.name.startswith("tokenizer")]
    files = {name: (src / name).read_bytes() for name in names}
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()

    def load(ckpt):
        tok = Tokenizer(ckpt)
        tok.decode(tok.encode("ab <s> a"))
        if tok.chat_template:
            tok.apply_chat_template([{"role": "user", "content": "a"}])

    @fuzz_settings(examples // 2)
    @given(corrupted_tokenizer(files))
    def check(corrupted):
        for name in names:
            (ckpt / name).unlink(missing_ok=True)
        for name, data in corrupted.items():
            (ckpt / name).write_bytes(data)
        loads_or_one_line_error(load, ckpt)

    check()


# ---------------------------------------------------------------- the command lines

def hf_dir_with_broken_weights(path: Path) -> Path:
    """A Hugging Face directory whose model.safetensors header claims more bytes than it has."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(HF_CONFIG))
    header = {"model.embed_tokens.weight": {"dtype": "F32", "shape": [32, DIM], "data_offsets": [0, 32 * DIM * 4]}}
    (path / "model.safetensors").write_bytes(safetensors_bytes(header, b"\0" * 100))
    return path


def test_command_lines_fail_in_one_line_and_leave_nothing(seeds, tmp_path):
    """The real scripts on a few broken inputs: exit status 1, `error: ...` on one line, no
    traceback, no output directory. They run side by side, since each start-up imports torch."""
    from gguf import GGUFValueType as T

    qwen2 = bytearray(seeds["qwen2"][0])
    types_count = next(offset for name, parts in seeds["qwen2"][1] if name == "tokenizer.ggml.token_type"
                         for offset, dtype, count in parts[4:5])  # the array's item count
    qwen2[types_count:types_count + 8] = (2 ** 62).to_bytes(8, "little")
    end = len(qwen2) - (len(qwen2) - types_count - 8) % 4  # whole int32 items up to the end of the file
    (tmp_path / "long-array.gguf").write_bytes(qwen2[:end])  # gguf's own reader spins on empty items
    meta, tensors = gguf_spec("llama")
    meta["llama.block_count"] = (T.STRING, "wide")
    write_gguf(tmp_path / "wide.gguf", meta, tensors)

    def broken_checkpoint(name, file, edit):
        ckpt = copy_checkpoint(seeds["ckpt"], tmp_path / name)
        (ckpt / file).write_bytes(edit((ckpt / file).read_bytes()))
        return ckpt

    def int_weights(data):
        header, body = safetensors_parts(data)
        header["layers.0.attention_norm.weight"]["dtype"] = "I32"
        return safetensors_bytes(header, body)

    wide = broken_checkpoint("wide", "config.json",
                             lambda data: json.dumps({**json.loads(data), "dim": "wide"}).encode())
    int_ckpt = broken_checkpoint("int", "model.safetensors", int_weights)
    bad_tok = broken_checkpoint("tok", "tokenizer_config.json", lambda data: data[:len(data) // 2])
    outs = {name: tmp_path / "out" / name for name in ("long-array", "wide", "hf")}
    (tmp_path / "out").mkdir()
    generate = ["generate.py", "--no-compile", "--max_new_tokens", "2", "--prompt", "ab", "--checkpoint"]
    commands = {
        "long-array": ["convert_hf_checkpoint.py", "--gguf", tmp_path / "long-array.gguf", "--out", outs["long-array"]],
        "wide": ["convert_hf_checkpoint.py", "--gguf", tmp_path / "wide.gguf", "--out", outs["wide"]],
        "hf": ["convert_hf_checkpoint.py", "--checkpoint_dir", hf_dir_with_broken_weights(tmp_path / "hf"),
               "--out", outs["hf"]],
        "config": [*generate, wide], "weights": [*generate, int_ckpt], "tokenizer": [*generate, bad_tok],
    }
    procs = {name: subprocess.Popen([sys.executable, *map(str, cmd)], cwd=ROOT, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for name, cmd in commands.items()}
    expected = {"long-array": "runs past the end of the file", "wide": "block_count is 'wide'",
                "hf": "cannot read", "config": "'dim': 'wide' is not an integer",
                "weights": "is torch.int32, the model needs floating point", "tokenizer": "cannot read"}
    for name, proc in procs.items():
        _, stderr = proc.communicate(timeout=180)
        assert proc.returncode == 1, (name, proc.returncode, stderr)
        assert stderr.startswith("error: ") and len(stderr.strip().splitlines()) == 1, (name, stderr)
        assert expected[name] in stderr, (name, stderr)
    for out in outs.values():
        no_leftovers(out)


# ---------------------------------------------------------------- a full disk, Ctrl-C

def limit_file_size(max_bytes: int):
    """preexec_fn: files past max_bytes fail to write with EFBIG, as on a full disk (Python ignores SIGXFSZ)."""
    import resource
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))


def writes_over_previous_outputs(seeds, tmp_path) -> tuple:
    """({name: output dir holding a previous output}, {name: the command line that rewrites it}) for a
    conversion of a tiny GGUF and an int8 quantization."""
    write_gguf(tmp_path / "tiny.gguf", *gguf_spec("qwen2"))
    outs = {name: tmp_path / "out" / name for name in ("convert", "quantize")}
    for out in outs.values():
        out.mkdir(parents=True)
        (out / "config.json").write_text("the previous output")
    commands = {"convert": ["convert_hf_checkpoint.py", "--gguf", tmp_path / "tiny.gguf", "--out", outs["convert"]],
                "quantize": ["quantize.py", "--checkpoint", seeds["ckpt"], "--mode", "int8", "--out",
                             outs["quantize"], "--force"]}
    return outs, commands


def test_full_disk_fails_in_one_line_and_keeps_the_old_output(seeds, tmp_path):
    """convert_hf_checkpoint.py and quantize.py with a file-size limit below the weights' size: exit
    status 1, one line saying why, no temporary directory, and an existing output left as it was."""
    outs, commands = writes_over_previous_outputs(seeds, tmp_path)
    procs = {name: subprocess.Popen([sys.executable, *map(str, cmd)], cwd=ROOT, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, preexec_fn=limit_file_size(4096))
             for name, cmd in commands.items()}
    for name, proc in procs.items():
        _, stderr = proc.communicate(timeout=180)
        assert proc.returncode == 1, (name, stderr)
        assert stderr.startswith("error: cannot write") and "File too large" in stderr, (name, stderr)
        assert len(stderr.strip().splitlines()) == 1, (name, stderr)
        assert (outs[name] / "config.json").read_text() == "the previous output"
        assert not [p for p in outs[name].parent.iterdir() if p.name.startswith(".")], name


def test_interrupted_write_leaves_nothing(seeds, tmp_path, capsys):
    """Ctrl-C while the checkpoint is written: the temporary directory goes, the old output stays,
    and the command line says `interrupted` and exits 130."""
    import checkpoint
    from errors import run_cli
    from model import ModelArgs

    def interrupt(directory):
        raise KeyboardInterrupt

    args = ModelArgs.from_json(seeds["ckpt"] / "config.json")
    state = {"x": torch.zeros(3)}
    out = tmp_path / "out" / "new"
    with pytest.raises(KeyboardInterrupt):
        checkpoint.write_checkpoint(out, args, state, add_files=interrupt)
    no_leftovers(out)
    out.mkdir()
    (out / "config.json").write_text("the previous output")
    with pytest.raises(KeyboardInterrupt):
        checkpoint.write_checkpoint(out, args, state, add_files=interrupt)
    assert (out / "config.json").read_text() == "the previous output"
    assert [p.name for p in out.parent.iterdir()] == ["new"]

    def main(argv):
        checkpoint.write_checkpoint(tmp_path / "out" / "other", args, state, add_files=interrupt)

    with pytest.raises(SystemExit) as exit:
        run_cli(main, [])
    assert exit.value.code == 130 and capsys.readouterr().err == "interrupted\n"
    no_leftovers(tmp_path / "out" / "other")


def test_ctrl_c_during_conversion_or_quantization_leaves_no_partial_checkpoint(seeds, tmp_path):
    """The scripts themselves, with SIGINT arriving just after model.safetensors is written (the
    write is wrapped to send it, so the moment is exact): exit status 130, `interrupted`, no
    temporary directory, and the previous output untouched."""
    outs, argvs = writes_over_previous_outputs(seeds, tmp_path)
    # a suite started as a background job inherits SIGINT ignored: give the script a terminal's Ctrl-C
    wrapper = ("import os, runpy, signal, sys\n"
               "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
               "import safetensors.torch\n"
               "save_file = safetensors.torch.save_file\n"
               "def save_then_ctrl_c(*args, **kwargs):\n"
               "    save_file(*args, **kwargs)\n"
               "    os.kill(os.getpid(), signal.SIGINT)\n"
               "safetensors.torch.save_file = save_then_ctrl_c\n"
               "sys.argv = sys.argv[1:]\n"
               "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    procs = {name: subprocess.Popen([sys.executable, "-c", wrapper, *map(str, argv)], cwd=ROOT,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, argv in argvs.items()}
    for name, proc in procs.items():
        _, stderr = proc.communicate(timeout=180)
        assert proc.returncode == 130 and stderr == "interrupted\n", (name, proc.returncode, stderr)
        assert (outs[name] / "config.json").read_text() == "the previous output"
        assert not [p for p in outs[name].parent.iterdir() if p.name.startswith(".")], name
