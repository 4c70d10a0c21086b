"""The subprocess side of scripts/bench.py: one engine, one dtype, one process.

    python -m scripts.bench_peers membw --out membw.json
    python -m scripts.bench_peers hf --gguf model.gguf --prompts ids.json --out hf.json

scripts/bench.py starts this module once per (round, engine, dtype) so that no two engines share
a thread pool, an allocator or a compile cache in memory. Each worker reads the prompt token ids
from a JSON file (the same ids for every engine), warms up, times, and writes a JSON object:

    {"engine": ..., "dtype": ..., "load_s": ..., "warmup_s": {...}, "weight_bytes": ...,
     "runs": {"short": [{"prompt_tokens", "new_tokens", "ttft_s", "decode_tokens_per_s"}, ...],
              "long": [...]}}

Workers:
  hf      Hugging Face transformers on the GGUF (dequantized on load), static cache +
          torch.compile(model.forward, mode="reduce-overhead", fullgraph=True) (on a GPU,
          generate() compiles it itself), or eager with the default dynamic cache (--no-compile).
  llama   llama-cpp-python on a GGUF file (greedy argmax over the logits, EOS ignored).
  membw   memory bandwidth over a 1 GiB float32 tensor: torch sum and kernels.stream_sum, best of a few.

It also holds `gguf_variant()`, which writes the F32 GGUF (same metadata, dequantized tensors)
and the BF16/Q8_0 files made from it with llama.cpp's own quantizer.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

THREADS = 2
OUTPUT_IDS_KEPT = 32  # enough to see whether two engines' greedy outputs agree


def set_threads(n: int):
    import torch
    torch.set_num_threads(n)


# ---------------------------------------------------------------- GGUF variants for llama.cpp

# llama.cpp's LLAMA_FTYPE_* values (include/llama.h), for llama_model_quantize
LLAMA_FTYPES = {"F32": 0, "Q4_1": 3, "Q8_0": 7, "BF16": 32}


def write_f32_gguf(src: Path, dst: Path):
    """Copy src's metadata and write every tensor dequantized to float32: the weights our
    converter and transformers see, in a form llama.cpp runs without its quantized kernels."""
    import gguf
    reader = gguf.GGUFReader(str(src))
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    tmp = dst.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch=arch)
    for field in reader.fields.values():
        # the writer adds the architecture and the GGUF.* header fields itself
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        value = field.contents()
        if field.name == gguf.Keys.General.FILE_TYPE:
            value = int(gguf.LlamaFileType.ALL_F32)
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    for t in reader.tensors:
        # numpy shape is the GGUF shape reversed: (rows, cols), which add_tensor expects
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype("float32")
        writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(dst)


def gguf_variant(src: Path, kind: str, cache_dir: Path) -> Path:
    """Path of src's weights as kind (F32, BF16, Q8_0, ...), made once and cached.
    ORIG is src itself (for SmolLM2: Q4_1 blocks with a Q8_0 embedding)."""
    if kind == "ORIG":
        return src
    cache_dir.mkdir(parents=True, exist_ok=True)
    stem = src.name[:-len(".gguf")]
    f32 = cache_dir / f"{stem}.F32.gguf"
    if not f32.exists():
        print(f"[bench] writing {f32} (dequantized to F32)", file=sys.stderr, flush=True)
        write_f32_gguf(src, f32)
    if kind == "F32":
        return f32
    out = cache_dir / f"{stem}.{kind}.gguf"
    if not out.exists():
        import llama_cpp
        print(f"[bench] writing {out} with llama_model_quantize", file=sys.stderr, flush=True)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = LLAMA_FTYPES[kind]
        params.nthread = THREADS
        tmp = out.with_suffix(".tmp")
        rc = llama_cpp.llama_model_quantize(str(f32).encode(), str(tmp).encode(), params)
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize to {kind} failed with {rc}")
        tmp.rename(out)
    return out


def gguf_tensor_bytes(path: Path) -> int:
    """Bytes of weights a decode step reads: every tensor once (tied embeddings are one tensor),
    except an embedding table beside its own output.weight, of which a step reads one row."""
    import gguf
    tensors = gguf.GGUFReader(str(path)).tensors
    untied = any(t.name == "output.weight" for t in tensors)
    return sum(int(t.n_bytes) for t in tensors if not (untied and t.name == "token_embd.weight"))


# ---------------------------------------------------------------- workers

def run_record(prompt_tokens: int, new_tokens: int, t0: float, t_first: float, t_end: float) -> dict:
    steps = new_tokens - 1  # decode steps after the token that prefill produced
    decode_s = t_end - t_first
    return {"prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "ttft_s": t_first - t0,
            "decode_s": decode_s, "decode_tokens_per_s": steps / decode_s if decode_s > 0 else 0.0}


def worker_hf(args, prompts: dict) -> dict:
    import torch
    set_threads(THREADS)
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        """Host time of each put(): first the prompt, then one per new token."""
        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    dtype = getattr(torch, args.dtype)
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(args.gguf.parent), gguf_file=args.gguf.name, dtype=dtype)
    model = model.to(args.device).eval()
    load_s = time.perf_counter() - start
    model.generation_config.eos_token_id = None  # exactly max_new_tokens, like --ignore_eos
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=0)
    if args.compile:
        # transformers' documented recipe; on CPU there are no CUDA graphs, inductor emits C++. On a GPU
        # generate() compiles the forward itself when the cache is static: wrapping it too made CUDA
        # graphs overwrite the cache's outputs (transformers 5.17 on an H200)
        kwargs["cache_implementation"] = "static"
        if args.device == "cpu":
            model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)

    def one(ids: list) -> dict:
        x = torch.tensor([ids], device=args.device)
        clock = Clock()
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = model.generate(x, streamer=clock, **kwargs)
            t_end = time.perf_counter()
        new = out[0, len(ids):].tolist()
        return run_record(len(ids), len(new), t0, clock.times[1], clock.times[-1]) | \
            {"total_s": t_end - t0, "output_ids": new[:OUTPUT_IDS_KEPT]}

    runs, warmup = {}, {}
    for name, ids in prompts.items():
        first = one(ids)  # compiles this prompt length's prefill and cache shape
        warmup[name] = first["total_s"]
        runs[name] = [one(ids) for _ in range(args.num_samples - 1)]
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"load_s": load_s, "warmup_s": warmup, "weight_bytes": weight_bytes, "runs": runs}


def worker_llama(args, prompts: dict) -> dict:
    import numpy as np
    import llama_cpp
    from llama_cpp import Llama
    n_ctx = max(len(ids) for ids in prompts.values()) + args.max_new_tokens + 16
    start = time.perf_counter()
    llm = Llama(model_path=str(args.gguf), n_threads=THREADS, n_threads_batch=THREADS, n_ctx=n_ctx,
                n_batch=512, verbose=False)
    load_s = time.perf_counter() - start
    n_vocab = llm.n_vocab()

    def argmax_last() -> int:
        # greedy on the last position's logits, read in place (Llama.eval no longer copies them)
        logits = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(logits, shape=(n_vocab,))))

    def one(ids: list) -> dict:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        tok = argmax_last()
        t_first = time.perf_counter()
        out = [tok]
        while len(out) < args.max_new_tokens:  # EOS ignored: always max_new_tokens
            llm.eval([tok])
            tok = argmax_last()
            out.append(tok)
        return run_record(len(ids), len(out), t0, t_first, time.perf_counter()) | {"output_ids": out[:OUTPUT_IDS_KEPT]}

    runs, warmup = {}, {}
    for name, ids in prompts.items():
        warmup[name] = timed(lambda: one(ids))
        runs[name] = [one(ids) for _ in range(args.num_samples - 1)]
    return {"load_s": load_s, "warmup_s": warmup, "weight_bytes": gguf_tensor_bytes(args.gguf), "runs": runs}


def worker_membw(args) -> dict:
    """Read bandwidth over 1 GiB of float32, best of a few passes, two ways: torch's sum (a
    reduction kernel) and kernels.stream_sum (plain sequential reads, 1 to 8 interleaved streams
    per thread). gb_s, the reference that "% bw" divides by, is the faster of the two."""
    import torch

    import kernels
    if args.device != "cpu":
        return gpu_membw(args)
    out = {}
    x = torch.ones(256 * 2**20)  # 1 GiB, far beyond any cache
    for threads in (1, THREADS):
        torch.set_num_threads(threads)
        x.sum()
        best = min(timed(lambda: x.sum()) for _ in range(args.repeats))
        out[f"gb_s_{threads}_threads"] = x.numel() * x.element_size() / best / 1e9
    out["gb_s_torch_sum"] = out[f"gb_s_{THREADS}_threads"]
    if kernels.available():
        streams = {}
        for n in (1, 2, 4, 8):
            kernels.stream_sum(x, n)
            best = min(timed(lambda: kernels.stream_sum(x, n)) for _ in range(args.repeats))
            streams[n] = x.numel() * x.element_size() / best / 1e9
        out["gb_s_stream_by_streams"] = streams
        out["gb_s_stream"] = max(streams.values())
    out["gb_s"] = max(out["gb_s_torch_sum"], out.get("gb_s_stream", 0))
    return out


def quantized_activations(device: str) -> str:
    """The activations' dtype of our int8/int4 runs: float32 on CPU (kernels.py's loops), bfloat16 on a GPU."""
    return "float32" if device == "cpu" else "bfloat16"


def gpu_membw(args) -> dict:
    """A GPU's read bandwidth: torch's sum over 4 GiB of float32 (far beyond its L2), best of a few."""
    import torch
    free, total = torch.cuda.mem_get_info(args.device)  # before this worker's own 4 GiB
    x = torch.ones(2**30, device=args.device)
    x.sum()
    times = []
    for _ in range(args.repeats):
        torch.cuda.synchronize(x.device)
        start = time.perf_counter()
        x.sum()
        torch.cuda.synchronize(x.device)
        times.append(time.perf_counter() - start)
    gb_s = x.numel() * x.element_size() / min(times) / 1e9
    return {"gb_s": gb_s, "gb_s_torch_sum": gb_s, "device": torch.cuda.get_device_name(x.device),
            "free_bytes": free, "total_bytes": total}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m scripts.bench_peers",
                                     description="One benchmark worker (started by scripts/bench.py).")
    parser.add_argument("worker", choices=["hf", "llama", "membw"])
    parser.add_argument("--gguf", type=Path, help="GGUF file (hf: the one to dequantize; llama: the one to run)")
    parser.add_argument("--dtype", default="float32", help="hf: torch dtype to load the weights in")
    parser.add_argument("--device", default="cpu", help="hf and membw: cpu or cuda")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="hf: static cache + torch.compile (default) or eager dynamic cache")
    parser.add_argument("--prompts", type=Path, help="JSON {name: [token ids]}")
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--num_samples", type=int, default=2, help="runs per prompt; the first is warm-up")
    parser.add_argument("--repeats", type=int, default=5, help="membw: passes per thread count")
    parser.add_argument("--out", type=Path, required=True, help="write the result JSON here")
    args = parser.parse_args(argv)
    if args.worker == "membw":
        result = worker_membw(args)
    else:
        prompts = json.loads(args.prompts.read_text())
        result = (worker_hf if args.worker == "hf" else worker_llama)(args, prompts)
    result["threads"] = THREADS
    result["pid"] = os.getpid()
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
