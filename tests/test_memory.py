"""Memory preflight: a run whose buffers do not fit is refused, before anything large is
allocated, with one line naming the buffer, both figures and the flag that lowers it."""
import gc
import mmap
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import checkpoint
import memory
import packing
import qlayers
import quantize
from conftest import ROOT, TEST_DEVICE, random_model, run_script, save_checkpoint
from loading import meta_model
from memory import Need, OutOfMemory, check_memory, kv_cache_bytes, weight_bytes
from tp import TensorParallel, sharded_bytes

FIGURES = r"would need [\d.]+ [kMGTP]?B\b.*, but [\d.]+ [kMGTP]?B is available on "


def refused(r, flag: str) -> str:
    """The one error line of a command line refused for memory, which names `flag`."""
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert r.returncode == 1 and len(errors) == 1, r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    assert re.search(FIGURES, errors[0]) and flag in errors[0].split(": ")[-1], errors[0]
    return errors[0]


# ---------------------------------------------------------------- the command lines, with the real free memory

@pytest.mark.parametrize("flags, flag", [
    (["--batch_size", 10**7], "--batch_size"),  # logits of 3.9 TB: beyond any GPU
    (["--max_new_tokens", 1000000, "--extend_context"], "--max_new_tokens"),
    (["--max_seq_length", 100000000, "--extend_context"], "--max_seq_length"),
], ids=["batch_size", "max_new_tokens", "max_seq_length"])
def test_generate_refuses_a_cache_beyond_memory(smollm2_dir, flags, flag):
    args = checkpoint.read_config(smollm2_dir)
    need = kv_cache_bytes(meta_model(args), 1, 1000000, torch.float32)
    if flags[0] == "--max_new_tokens" and need < memory.MEMORY_MARGIN * memory.available_memory(TEST_DEVICE):
        pytest.skip("a million tokens of SmolLM2's cache fit on this device")
    r = run_script("generate.py", "--checkpoint", smollm2_dir, "--no-compile", *flags, timeout=60)
    line = refused(r, flag)
    # sequences beyond what the cache holds run in turns: a huge batch is refused for its logits
    assert line.startswith("error: the logits of 10000000 sequences" if flag == "--batch_size" else "error: the KV cache for ")


def test_generate_runs_a_batch_beyond_the_cache_in_turns(smollm2_dir):
    """A cap on the memory that holds the weights and one sequence's cache, not sixty: the rows run
    in turns (a warning says so) and each gives its text alone."""
    env = dict(os.environ, MINILLM_AVAILABLE_MEMORY=str(int(0.75 * 10**9)))
    flags = ["--no-compile", "--max_new_tokens", "12", "--max_seq_length", "1024"]
    r = run_script("generate.py", "--checkpoint", smollm2_dir, "--prompt", "Once upon a time", "--batch_size", "60",
                   *flags, env=env, timeout=600)
    assert r.returncode == 0 and "the sequences run in turns" in r.stderr, r.stderr[-2000:]
    alone = run_script("generate.py", "--checkpoint", smollm2_dir, "--prompt", "Once upon a time", *flags, timeout=300)
    assert r.stdout.splitlines() == [line for b in range(60)
                                     for line in (f"--- row {b + 1} of 60 ---", *alone.stdout.splitlines())]


def test_eval_refuses_a_window_beyond_memory(smollm2_dir):
    # a short text: the trained-context check sees the window cut to the text, the cache is --window long
    r = run_script("eval.py", "--checkpoint", smollm2_dir, "--window", 100000000, "--max_tokens", 100, timeout=60)
    assert refused(r, "--window").startswith("error: the KV cache of 100000000 tokens")


def test_serve_refuses_slots_beyond_memory(smollm2_dir):
    r = run_script("serve.py", "--checkpoint", smollm2_dir, "--max_batch_size", 100000, "--no-compile", timeout=60)
    assert refused(r, "--max_batch_size").startswith("error: the KV cache for 409600000 tokens")


def test_generate_counts_the_draft(smollm2_dir, tmp_path, monkeypatch):
    # under a cap of 600 MB: the float32 draft's weights (538 MB) are the largest of what does not
    # fit beside a tiny target of the same vocabulary
    target = save_checkpoint(random_model(seed=4, vocab_size=49152, dim=32, intermediate_size=64), tmp_path / "t",
                             tokenizer_from=smollm2_dir)
    monkeypatch.setenv("MINILLM_AVAILABLE_MEMORY", str(600 * 10**6))
    r = run_script("generate.py", "--checkpoint", target, "--no-compile", "--draft_checkpoint", smollm2_dir,
                   "--max_new_tokens", 8, timeout=60)
    assert refused(r, "--draft_dtype").startswith("error: the draft's weights in float32 would need 538 MB")


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="CPU ranks share one machine's memory; a GPU rank has its own")
def test_each_tensor_parallel_rank_checks_its_shard(smollm2_dir):
    # SmolLM2's 3 KV heads split 2 + 1; a 6 GB cap is 3 GB for each rank, where rank 0's cache of one
    # sequence of 128k tokens does not fit (3.7 GB), and rank 1's (1.9 GB) does
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "generate.py",
           "--checkpoint", str(smollm2_dir), "--no-compile", "--max_new_tokens", "128000", "--extend_context",
           "--device", "cpu"]
    env = dict(os.environ, OMP_NUM_THREADS="1", MINILLM_TP_TIMEOUT_S="300", MINILLM_TP_STACKS="1",
               MINILLM_AVAILABLE_MEMORY=str(6 * 10**9))
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert r.returncode != 0 and len(errors) == 1, r.stderr[-3000:]
    assert errors[0].startswith("error: rank 0: the KV cache for one sequence of 128005 tokens would need 3.93 GB") \
        and "but 3 GB is available on cpu for each of the 2 ranks on this machine" in errors[0] \
        and errors[0].endswith(": lower --max_new_tokens"), errors[0]


# ---------------------------------------------------------------- quantize.py, under a cap on the free memory

def test_quantize_refuses_weights_beyond_memory(smollm2_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("MINILLM_AVAILABLE_MEMORY", str(300 * 10**6))
    r = run_script("quantize.py", "--checkpoint", smollm2_dir, "--mode", "int8", "--out", tmp_path / "q", timeout=60)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert r.returncode == 1 and len(errors) == 1 and re.search(FIGURES, errors[0]), r.stderr[-2000:]
    assert errors[0].startswith("error: the float weights of ") and "300 MB is available" in errors[0]
    assert not (tmp_path / "q").exists()


def test_quantize_refuses_calibration_beyond_memory(smollm2_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("MINILLM_AVAILABLE_MEMORY", str(2 * 10**9))
    r = run_script("quantize.py", "--checkpoint", smollm2_dir, "--mode", "int4-gptq", "--out", tmp_path / "q",
                   "--calibration_samples", 1, "--calibration_length", 8000, timeout=60)
    assert refused(r, "--calibration_length").startswith("error: the calibration forward of 8000 tokens")


# ---------------------------------------------------------------- the estimators

def cache_bytes(model) -> int:
    return sum(b.nbytes for name, b in model.named_buffers() if "cache" in name)


@pytest.mark.parametrize("overrides", [{}, {"sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]},
                                       {"n_kv_heads": 1, "head_dim": 24}], ids=["full", "ring", "mqa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_bytes_is_what_setup_caches_allocates(overrides, dtype):
    model = random_model(**overrides).to(dtype)
    for batch, length in [(1, 8), (3, 100), (2, 16)]:
        model.setup_caches(batch, length)
        assert kv_cache_bytes(model, batch, length, dtype) == cache_bytes(model)


def test_weight_bytes_is_what_load_model_reads(tmp_path, smollm2_dir):
    float_dir = save_checkpoint(random_model(vocab_size=320), tmp_path / "float")
    for ckpt in (float_dir, smollm2_dir.parent / "smollm2-135m-int4-g32"):
        if not ckpt.is_dir():
            continue
        for dtype in (torch.float32, torch.bfloat16):
            model = meta_model(checkpoint.read_config(ckpt))
            state = checkpoint.read_weights(ckpt, checkpoint.expected_shapes(model), "cpu", dtype,
                                            keep_dtype=qlayers.float_tensor_names(model).__contains__)
            assert weight_bytes(model, dtype) == sum(t.nbytes for t in state.values()), (ckpt, dtype)


def test_converted_weights_are_read_into_one_block_in_model_order(tmp_path):
    model = random_model(vocab_size=320)
    ckpt = save_checkpoint(model, tmp_path / "float")
    expected = checkpoint.expected_shapes(meta_model(checkpoint.read_config(ckpt)))
    state = checkpoint.read_weights(ckpt, expected, "cpu", torch.bfloat16)
    names = list(expected)
    assert [n for n, _ in sorted(state.items(), key=lambda kv: kv[1].data_ptr())] == names
    base = state[names[0]].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base for t in state.values())  # one allocation
    for name, t in model.state_dict().items():
        if name in state:
            assert torch.equal(state[name], t.to(torch.bfloat16)), name  # the same rounding as .to()
    kept = checkpoint.read_weights(ckpt, expected, "cpu", torch.float32)  # nothing to convert: no block
    assert len({t.untyped_storage().data_ptr() for t in kept.values()}) == len(kept)


def test_huge_page_block_is_aligned_zeroed_advised_and_outlives_its_views():
    nbytes = 3 * checkpoint.HUGE_PAGE + 100
    block = checkpoint.huge_page_block(nbytes)
    assert block.numel() == nbytes and block.dtype == torch.uint8 and not block.any()
    start = block.data_ptr()
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert start % checkpoint.HUGE_PAGE == 0
        flags = vma_flags(start)
        assert flags is not None and "hg" in flags  # the kernel took the advice for this mapping
    view = block[-100:].view(torch.bfloat16)
    view.fill_(1.5)
    del block
    gc.collect()
    assert view.sum().item() == 75  # the mapping lives as long as a view of it
    assert checkpoint.huge_page_block(1000).numel() == 1000  # small: plain memory


def test_the_engines_kv_pools_are_zeros_on_huge_pages():
    from engine import Engine
    model = random_model()
    engine = Engine.for_serving(model, 4, 2048, kv_tokens=20000)  # 2.6 MB a pool
    pool = model.layers[0].attention.kv_cache.k_cache
    assert pool.shape == (engine.blocks.num_blocks + 1, 2, 16, 16) and not pool.any()
    assert pool.nbytes > checkpoint.HUGE_PAGE and pool.data_ptr() % checkpoint.HUGE_PAGE == 0
    big = checkpoint.huge_page_zeros((3 * checkpoint.HUGE_PAGE // 8 + 5, 2), torch.float32, "cpu")
    assert big.shape == (3 * checkpoint.HUGE_PAGE // 8 + 5, 2) and not big.any()
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert big.data_ptr() % checkpoint.HUGE_PAGE == 0 and "hg" in vma_flags(big.data_ptr())
    small = checkpoint.huge_page_zeros((3, 5), torch.bfloat16, "cpu")  # under a page: plain memory, zeroed too
    assert small.dtype == torch.bfloat16 and not small.any()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_streamed_int8_rows_are_read_into_one_block_off_the_file_mapping(tmp_path, tied):
    """The int8 rows that a decode step streams (linear layers; the embedding only where the head
    is tied to it) are read with file reads into one 2 MB-page block: the same integers, but not
    the file's mapped pages, and load_model's packed layers read them there."""
    import kernels
    from loading import load_model
    model = random_model(vocab_size=4096, dim=256, intermediate_size=1024, tie_word_embeddings=tied)  # > 2 MB of int8
    src = save_checkpoint(model, tmp_path / "float")
    quantize.main(["--checkpoint", str(src), "--mode", "int8", "--out", str(tmp_path / "int8")])
    ckpt = tmp_path / "int8"
    meta = meta_model(checkpoint.read_config(ckpt))
    names = qlayers.streamed_int8_names(meta)
    linears = {f"{n}.weight" for n, m in meta.named_modules() if isinstance(m, qlayers.Int8Linear)} - {"output.weight"}
    assert linears and linears <= names and ("tok_embeddings.weight" in names) == tied
    expected, keep = checkpoint.expected_shapes(meta), qlayers.float_tensor_names(meta).__contains__
    names &= set(expected)  # a tied head is stored as the embedding
    assert ("output.weight" in names) == (not tied)
    plain = checkpoint.read_weights(ckpt, expected, "cpu", torch.float32, keep_dtype=keep)
    state = checkpoint.read_weights(ckpt, expected, "cpu", torch.float32, keep_dtype=keep, streamed=names.__contains__)
    assert state.keys() == plain.keys() and all(torch.equal(state[n], plain[n]) for n in state)
    base = state[min(names)].untyped_storage().data_ptr()
    assert all(state[n].untyped_storage().data_ptr() == base for n in names)  # one allocation
    mapped = file_mappings(ckpt / checkpoint.WEIGHTS)
    assert mapped  # safetensors maps the file for the other tensors
    for n, t in state.items():
        inside = any(lo <= t.data_ptr() < hi for lo, hi in mapped)
        assert inside == (n not in names), n  # the rest stay where the file is mapped
    assert sum(state[n].nbytes for n in names) > checkpoint.HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert "hg" in vma_flags(state[min(names)].data_ptr())
    if kernels.available():  # the CPU loops read the integers where they were read to
        loaded = load_model(ckpt)
        layer = loaded.layers[0].feed_forward.w2
        assert isinstance(layer, qlayers.Int8Linear) and not any(lo <= layer.packed.data_ptr() < hi
                                                                 for lo, hi in file_mappings(ckpt / checkpoint.WEIGHTS))


# without the kernels int4 packs in 32-bit lanes for inductor's expression, on the heap (tested in test_quantize.py)
@pytest.mark.skipif(not __import__("kernels").available(),
                    reason="int4 rows are the CPU kernels' layout; without the kernels there are none to place")
def test_int4_rows_are_packed_into_one_block(tmp_path):
    """The CPU loops' int4 rows are packed straight into one 2 MB-page block: the same bytes as
    packing alone gives, one allocation, and the int8 head beside them stays in its own block."""
    from loading import load_model
    model = random_model(vocab_size=4096, dim=256, intermediate_size=2048, n_layers=4, tie_word_embeddings=False)
    src = save_checkpoint(model, tmp_path / "float")
    quantize.main(["--checkpoint", str(src), "--mode", "int4", "--out", str(tmp_path / "int4")])
    loaded = load_model(tmp_path / "int4")
    layers = [m for m in loaded.modules() if isinstance(m, qlayers.Int4Linear)]
    assert layers and all(m.cpu_kernel_layout for m in layers)
    assert len({m.packed.untyped_storage().data_ptr() for m in layers}) == 1  # one allocation
    assert sum(m.packed.nbytes for m in layers) > checkpoint.HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert "hg" in vma_flags(layers[0].packed.data_ptr())
    meta = meta_model(checkpoint.read_config(tmp_path / "int4"))
    plain = checkpoint.read_weights(tmp_path / "int4", checkpoint.expected_shapes(meta), "cpu", torch.float32,
                                    keep_dtype=qlayers.float_tensor_names(meta).__contains__)
    for name, m in loaded.named_modules():
        if isinstance(m, qlayers.Int4Linear):
            assert torch.equal(m.packed, packing.pack_int4_rows(packing.bytes_to_nibbles(plain[f"{name}.weight"]))), name
    assert isinstance(loaded.output, qlayers.Int8Linear)
    assert loaded.output.packed.untyped_storage().data_ptr() != layers[0].packed.untyped_storage().data_ptr()


def file_mappings(path: Path) -> list:
    """(start, end) of each of this process's mappings of the file at path, from /proc/self/maps."""
    out, real = [], str(Path(path).resolve())
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == real:
            lo, hi = fields[0].split("-")
            out.append((int(lo, 16), int(hi, 16)))
    return out


def vma_flags(address: int):
    """The VmFlags of this process's mapping that holds address, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(a, 16) for a in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    return None


def test_tensor_parallel_rank_counts_its_shard():
    args = random_model(vocab_size=320, n_heads=4, n_kv_heads=2).args
    full = meta_model(args)
    shards = [meta_model(args, TensorParallel(rank, 2, group_name="unused")) for rank in range(2)]
    split, replicated = sharded_bytes(full)
    assert weight_bytes(full, torch.float32) == split + replicated
    assert sum(weight_bytes(m, torch.float32) for m in shards) == split + 2 * replicated
    assert sum(kv_cache_bytes(m, 2, 64, torch.float32) for m in shards) == kv_cache_bytes(full, 2, 64, torch.float32)


# ---------------------------------------------------------------- the free memory and the refusal

def test_cpu_free_memory_is_meminfo_available(tmp_path, monkeypatch):
    monkeypatch.delenv("MINILLM_AVAILABLE_MEMORY", raising=False)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24684100 kB\nMemFree:         1000000 kB\nMemAvailable:    2000000 kB\n")
    monkeypatch.setattr(memory, "MEMINFO", str(meminfo))
    assert memory.available_memory("cpu") == 2000000 * 1024
    monkeypatch.setenv("MINILLM_AVAILABLE_MEMORY", "1e9")  # a cap below it
    assert memory.available_memory("cpu") == 10**9
    monkeypatch.delenv("MINILLM_AVAILABLE_MEMORY")
    meminfo.write_text("MemTotal:       24684100 kB\n")  # an old kernel: unknown, nothing is refused
    assert memory.available_memory("cpu") is None
    check_memory([Need("the KV cache", 10**15, "lower --batch_size")], "cpu")
    monkeypatch.setattr(memory, "MEMINFO", str(tmp_path / "missing"))
    assert memory.available_memory("cpu") is None


def test_cuda_free_memory_is_mem_get_info(monkeypatch):
    monkeypatch.delenv("MINILLM_AVAILABLE_MEMORY", raising=False)
    asked = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: asked.append(device) or (5 * 10**9, 8 * 10**9))
    assert memory.available_memory("cuda:1") == 5 * 10**9 and asked == [torch.device("cuda:1")]
    with pytest.raises(OutOfMemory, match=r"^the weights would need 6 GB, but 5 GB is available on cuda "):
        check_memory([Need("the weights", 6 * 10**9, "pass a smaller --dtype")], "cuda:1")


def test_refusal_names_the_largest_need_both_figures_and_its_flag(monkeypatch):
    monkeypatch.setattr(memory, "meminfo_available", lambda: 64 * 10**9)  # whatever else runs on the machine
    monkeypatch.setenv("MINILLM_AVAILABLE_MEMORY", str(20 * 10**9))
    needs = [Need("the weights", 2 * 10**9, "pass a smaller --dtype", " of x in float32"),
             Need("the KV cache", 3100 * 10**9, "lower --batch_size or --max_new_tokens", " for 100000 sequences"),
             Need("the logits", 0, "lower --batch_size")]
    with pytest.raises(OutOfMemory) as e:
        check_memory(needs, "cpu")
    assert str(e.value) == ("the KV cache for 100000 sequences would need 3.1 TB (3.1 TB with the weights), but 20 GB "
                            "is available on cpu (a run plans 90% of it): lower --batch_size or --max_new_tokens")
    check_memory(needs[:1], "cpu")  # 2 GB fit
    with pytest.raises(OutOfMemory, match="but 2 GB is available on cpu for each of the 10 ranks on this machine"):
        check_memory(needs[:1], "cpu", ranks=10)
    with pytest.raises(OutOfMemory, match=r"would need 19 GB, but 20 GB .* \(a run plans 90% of it\)"):
        check_memory([Need("the weights", 19 * 10**9, "pass a smaller --dtype")], "cpu")  # within the margin only
