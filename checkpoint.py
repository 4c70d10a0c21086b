"""A checkpoint directory: config.json (the `ModelArgs` fields), model.safetensors and the
tokenizer files. Reading checks everything a later step would trip over; writing goes to a
temporary directory that is renamed into place, so a failed write never leaves half a checkpoint.
"""
import json
import math
import mmap
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Optional

import torch

from errors import CheckpointError, ConfigError, one_line, require_dir
from model import ModelArgs, Transformer

CONFIG, WEIGHTS = "config.json", "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                   "special_tokens_map.json", "chat_template.jinja")


def read_config(checkpoint_dir) -> ModelArgs:
    """checkpoint_dir/config.json -> ModelArgs, or a one-line error naming what is wrong."""
    ckpt = require_dir(checkpoint_dir)
    try:
        return ModelArgs.from_json(ckpt / CONFIG)
    except (ValueError, TypeError, OSError) as e:  # model.py's ConfigError is a ValueError; OSError: unreadable
        raise ConfigError(f"{ckpt}/{CONFIG}: {one_line(e)}") from None


class ExpectedShapes(dict):
    """name -> shape, and in `dtypes` each tensor's dtype in the model, so that read_weights can
    refuse an integer tensor where the model computes in floats (and the reverse)."""

    def __init__(self, shapes: dict, dtypes: dict):
        super().__init__(shapes)
        self.dtypes = dtypes


def expected_shapes(model: torch.nn.Module) -> dict:
    """name -> shape of every tensor a checkpoint of `model` holds (a tied head is not stored)."""
    state = {name: t for name, t in model.state_dict().items()
             if not (model.args.tie_word_embeddings and name.startswith("output."))}
    return ExpectedShapes({name: t.shape for name, t in state.items()}, {name: t.dtype for name, t in state.items()})


def check_names(names, expected, where) -> None:
    """The file's tensor names must be exactly the expected ones."""
    names, expected = set(names), set(expected)
    missing, unexpected = sorted(expected - names), sorted(names - expected)
    if missing:
        raise CheckpointError(f"{where} lacks {len(missing)} weights, e.g. {', '.join(missing[:3])}")
    if unexpected:
        raise CheckpointError(f"{where} has {len(unexpected)} unexpected weights, e.g. {', '.join(unexpected[:3])}")


def read_weights(checkpoint_dir, expected: dict, device, dtype: torch.dtype,
                 keep_dtype: Callable[[str], bool] = lambda name: False,
                 read: Optional[Callable] = None, streamed: Callable[[str], bool] = lambda name: False,
                 view: Callable = lambda f: f) -> dict:
    """The weights of `expected` (name -> shape) from model.safetensors, on `device`. Float weights
    take `dtype` unless keep_dtype(name); integer (quantized) weights keep theirs. read(file, name)
    replaces the plain read (tensor parallelism reads one shard); the shapes are checked after it.
    The integer weights for which streamed(name) holds are read from the file into one block on
    2 MB pages (streamed_block), on CPU and without `read`. view(file): the file as this process
    reads it (a pipeline stage: its own layers' tensors only, pipeline.StageFile)."""
    from safetensors import SafetensorError, safe_open

    weights = Path(checkpoint_dir) / WEIGHTS
    if not weights.is_file():
        raise CheckpointError(f"{weights} not found")
    state = {}
    try:
        with safe_open(weights, framework="pt") as opened:  # memory-mapped: only what is read is loaded
            f = view(opened)
            check_names(f.keys(), expected, weights)
            block = converted_block(f, expected, device, dtype, keep_dtype)
            rows = streamed_block(weights, f, expected, device, streamed) if read is None else {}
            for name, shape in expected.items():
                t = rows[name] if name in rows else read(f, name) if read is not None else f.get_tensor(name)
                if t.shape != shape:
                    raise CheckpointError(f"{weights}: {name} has shape {tuple(t.shape)}, "
                                          f"config.json implies {tuple(shape)}")
                want = getattr(expected, "dtypes", {}).get(name)
                if want is not None and (t.dtype != want if not want.is_floating_point else not t.is_floating_point()):
                    raise CheckpointError(f"{weights}: {name} is {t.dtype}, the model needs "
                                          f"{want if not want.is_floating_point else 'floating point'}")
                keep = not t.is_floating_point() or keep_dtype(name)
                if name in block:
                    state[name] = block[name].copy_(t)
                else:
                    state[name] = t.to(device=device, dtype=t.dtype if keep else dtype)
    except (SafetensorError, OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"{weights} is unreadable or truncated ({one_line(e)})") from None
    return state


def stored_bytes(checkpoint_dir) -> int:
    """The bytes of model.safetensors' tensors as the file holds them (its header's offsets: no
    tensor is read)."""
    weights = Path(checkpoint_dir) / WEIGHTS
    try:
        with open(weights, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{weights} is unreadable or truncated ({one_line(e)})") from None
    return sum(t["data_offsets"][1] - t["data_offsets"][0] for n, t in header.items() if n != "__metadata__")


FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def converted_block(f, expected: dict, device, dtype: torch.dtype, keep_dtype: Callable[[str], bool]) -> dict:
    """name -> an empty tensor for each float weight that loading converts to `dtype` on CPU, all
    views of one allocation, in the model's order. Converted one by one, a model's tensors
    scatter over the heap, and a bfloat16 decode step of Gemma 3 270M that reads them there takes
    ~10% longer than one that reads them from a single block (docs/design.md). Weights that
    need no conversion stay where the file is mapped."""
    if torch.device(device).type != "cpu":
        return {}
    nbytes = {n: math.prod(shape) * dtype.itemsize for n, shape in expected.items()
              if FLOAT_DTYPES.get(f.get_slice(n).get_dtype(), dtype) != dtype and not keep_dtype(n)}
    return {name: v.view(dtype).view(expected[name]) for name, v in block_views(nbytes).items()}


def block_views(nbytes: dict) -> dict:
    """key -> a uint8 view of that many bytes, all in one huge_page_block, 64-byte aligned, in
    the dict's order."""
    aligned = lambda size: -(-size // 64) * 64  # noqa: E731
    block = huge_page_block(sum(map(aligned, nbytes.values())))
    views, offset = {}, 0
    for key, size in nbytes.items():
        views[key] = block[offset:offset + size]
        offset += aligned(size)
    return views


def streamed_block(path: Path, f, expected: dict, device, streamed: Callable[[str], bool]) -> dict:
    """name -> its int8 tensor, for each one that streamed(name) asks for on CPU, all read with
    file reads into one block on 2 MB pages, in the file's order. A decode step streams these
    rows; where the file is mapped, their speed depends on whether the page cache holds it in
    large folios (Qwen 0.5B int8 decodes 1.18x faster from the block than from a mapping on 4 kB
    pages, docs/design.md). Read through the mapping instead, the mapped pages would stay
    resident beside the copy."""
    names = [n for n in expected if streamed(n) and f.get_slice(n).get_dtype() == "I8"]
    if torch.device(device).type != "cpu" or not names:
        return {}
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    start = 8 + n
    names.sort(key=lambda name: header[name]["data_offsets"][0])
    views = block_views({name: header[name]["data_offsets"][1] - header[name]["data_offsets"][0] for name in names})
    fd = os.open(path, os.O_RDONLY)
    try:
        for name, view in views.items():
            buf, done, at = memoryview(view.numpy()), 0, start + header[name]["data_offsets"][0]
            while done < len(buf):
                got = os.preadv(fd, [buf[done:]], at + done)
                if got <= 0:
                    raise CheckpointError(f"{path} is truncated: {name} ends past the end of the file")
                done += got
    finally:
        os.close(fd)
    return {name: view.view(torch.int8).view(f.get_slice(name).get_shape()) for name, view in views.items()}


HUGE_PAGE = 2 << 20


def huge_page_block(nbytes: int) -> torch.Tensor:
    """nbytes of zeroed memory, asked for on 2 MB pages where Linux has them (transparent huge pages
    in "madvise" mode give them only to memory that asks). The decode loop streams every weight
    once a token, and on 4 kB pages each page is a TLB miss and a restart for the hardware
    prefetcher: Qwen2.5-Coder-1.5B's bfloat16 decode is ~6% faster on 2 MB pages (docs/design.md)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or nbytes < HUGE_PAGE:
        return torch.empty(nbytes, dtype=torch.uint8)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(advice)
    except OSError:  # a kernel without transparent huge pages: 4 kB pages, as torch.empty gives
        pass
    whole = torch.frombuffer(region, dtype=torch.uint8)  # holds a reference to region
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def huge_page_zeros(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """torch.zeros(shape) on 2 MB pages where a CPU has them (huge_page_block): the engine's KV
    pools, which a step reads in blocks scattered over them (16 decode rows' attention took 0.88-0.93x
    the time on 4 kB pages, benchmarks/kv-pool-pages.json)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    block = huge_page_block(math.prod(shape) * dtype.itemsize)
    return block.zero_().view(dtype).view(shape) if block.numel() < HUGE_PAGE else block.view(dtype).view(shape)


def read_model(checkpoint_dir, dtype: torch.dtype = torch.float32) -> Transformer:
    """The reference model of a float checkpoint, on CPU, with nothing installed (quantize.py's input)."""
    args = read_config(checkpoint_dir)
    with torch.device("meta"):
        model = Transformer(args)
    state = read_weights(checkpoint_dir, expected_shapes(model), "cpu", dtype)
    model.load_state_dict(state, strict=False, assign=True)
    if args.tie_word_embeddings:
        model.output.weight = model.tok_embeddings.weight
    return model.eval()


def check_state(state: dict, args: ModelArgs) -> None:
    """Names and shapes must be exactly those of Transformer(args), and every tensor floating point
    (a converted model is not quantized), so that loading cannot surprise."""
    try:  # the config.json about to be written must read back: the loader checks every field's range
        ModelArgs.from_dict(args.to_dict())
    except ValueError as e:
        raise CheckpointError(f"the converted config.json would not load: {one_line(e)}") from None
    with torch.device("meta"):
        expected = expected_shapes(Transformer(args))
    check_names(state, expected, "the converted checkpoint")
    for name, shape in expected.items():
        if tuple(state[name].shape) != tuple(shape):
            raise CheckpointError(f"tensor {name!r} has shape {tuple(state[name].shape)}, "
                                  f"expected {tuple(shape)} from config.json")
        if not state[name].is_floating_point():  # a float model's every tensor; read_weights would refuse it later
            raise CheckpointError(f"tensor {name!r} is {state[name].dtype}, expected floating point")


def write_json(path: Path, obj) -> None:
    """Write JSON through a temporary file, so a reader never sees half of it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def write_checkpoint(out_dir, args: ModelArgs, state: dict, add_files: Optional[Callable[[Path], None]] = None,
                     metadata: Optional[dict] = None) -> Path:
    """config.json + model.safetensors (+ whatever add_files(dir) writes, e.g. the tokenizer) into
    a temporary sibling directory, which then replaces out_dir. Returns out_dir."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    out_dir = Path(out_dir).resolve()
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    except OSError as e:
        raise CheckpointError(f"cannot write {out_dir}: {one_line(e)}") from None
    old = tmp.with_name(tmp.name + ".old")
    try:
        (tmp / CONFIG).write_text(json.dumps(args.to_dict(), indent=2) + "\n")
        tensors = {name: t.contiguous() for name, t in state.items()}
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt", **(metadata or {})})
        if add_files is not None:
            add_files(tmp)
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp and safetensors make private files; give the usual permissions
        for f in tmp.iterdir():
            f.chmod(0o666 & ~umask)
        if out_dir.exists():
            out_dir.rename(old)
        tmp.rename(out_dir)
    except (OSError, ValueError, RuntimeError, SafetensorError) as e:  # a full disk, a read-only directory
        raise CheckpointError(f"cannot write {out_dir}: {one_line(e)}") from None
    finally:
        if old.exists() and not out_dir.exists():  # the swap failed halfway: put the old output back
            old.rename(out_dir)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return out_dir


def copy_files(src_dir, names=TOKENIZER_FILES) -> Callable[[Path], None]:
    """An add_files for write_checkpoint: copy these files from src_dir where they exist."""
    def add(dst: Path):
        for name in names:
            if (Path(src_dir) / name).is_file():
                shutil.copy(Path(src_dir) / name, dst / name)
    return add
