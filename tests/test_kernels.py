"""kernels.py: the register-blocked few-token float product used for speculative verifies, the
build variants of the integer loops (their products are checked in test_quantize.py), and
install(), which swaps the CPU fast paths into a model."""
import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels
import model as reference
import packing
import qlayers
from conftest import random_model, run_script
from thresholds import THRESHOLDS


def recording(graphs: list):
    """A torch.compile backend that appends each traced graph's code to `graphs` and runs it as traced."""
    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward
    return backend


def test_small_linear_is_built_on_avx2_machines():
    # the verify speed-ups in the README depend on it: a failed build must not go unnoticed
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("no AVX2 on this CPU: the kernels are not built, callers take F.linear, SDPA and inductor")
    assert kernels.available()


def test_kernels_are_loaded_from_this_checkout_s_own_build(tmp_path):
    """Each checkout and kernels.cpp text (and flags, and torch) builds under its own name: under
    one name, two checkouts on a machine rebuilt it at every switch, and a process could load the
    other's kernels, or find the library it runs replaced on disk."""
    flags = kernels.build_flags(kernels.has_vnni())
    name = kernels.build_name(kernels.SOURCE, flags)
    same, edited = tmp_path / "same" / "kernels.cpp", tmp_path / "edited" / "kernels.cpp"
    for source, text in [(same, kernels.SOURCE.read_bytes()), (edited, kernels.SOURCE.read_bytes() + b"// edited\n")]:
        source.parent.mkdir()
        source.write_bytes(text)
    assert name == kernels.build_name(kernels.SOURCE, list(flags))
    assert len({name, kernels.build_name(same, flags), kernels.build_name(edited, flags),
                kernels.build_name(kernels.SOURCE, kernels.build_flags(not kernels.has_vnni()))}) == 4
    if not kernels.available():  # nothing loaded to check (test_small_linear_is_built_on_avx2_machines says why)
        return
    with open("/proc/self/maps") as f:
        loaded = {line.split(maxsplit=5)[-1].strip() for line in f if "minillm_kernels" in line}
    assert len(loaded) == 1, loaded
    path = Path(loaded.pop())
    assert (path.parent.name, path.name) == (name, f"{name}.so")  # not "(deleted)": nothing rebuilt it since


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_small_linear_matches_float64_reference(wdtype):
    if not kernels.available():
        pytest.fail("kernels.small_linear could not be built here")
    g = torch.Generator().manual_seed(0)
    # row counts that leave remainders for the 8-row and 2-row blocks; K with a scalar tail, and
    # (bfloat16, one token) a 32-column block, a 16-column one and a masked tail after the 64s
    for N, K in [(37, 20), (130, 96), (9, 1541), (5, 117)]:
        w = torch.randn(N, K, generator=g).to(wdtype)
        for T in range(1, 17):
            x = torch.randn(T, K, generator=g)
            ref = F.linear(x.double(), w.double())
            got = kernels.small_linear(x, w)
            assert got.shape == (T, N) and got.dtype == torch.float32
            err = (got.double() - ref).abs().max().item()
            assert err < 2e-5 * K ** 0.5, (N, K, T, err)


def test_bfloat16_token_loop_matches_float64_reference():
    """One bfloat16 token times bfloat16 weights (a bfloat16 model's decode step) through AVX-512
    BF16's dot products: float64's value within float32 sums of exact products, as the float32
    token's loop; K with 128-column blocks, 32-column ones and a masked tail. More tokens, or
    float32 weights, are refused with a message."""
    if not (kernels.BF16_DOT and kernels.available()):
        pytest.skip("the bfloat16 token loop needs AVX-512 BF16 (avx512_bf16 in /proc/cpuinfo)")
    g = torch.Generator().manual_seed(0)
    for N, K in [(37, 20), (130, 96), (9, 1541), (5, 117), (300, 4864), (3, 160)]:
        w = torch.randn(N, K, generator=g).bfloat16()
        x = torch.randn(1, K, generator=g).bfloat16()
        got = kernels.small_linear(x, w)
        assert got.shape == (1, N) and got.dtype == torch.float32
        err = (got.double() - F.linear(x.double(), w.double())).abs().max().item()
        assert err < 2e-5 * K ** 0.5, (N, K, err)
    with pytest.raises(RuntimeError, match="a bfloat16 x must be one token"):
        kernels.small_linear(torch.ones(2, 64).bfloat16(), torch.ones(8, 64).bfloat16())
    with pytest.raises(RuntimeError, match="a bfloat16 x must be one token"):
        kernels.small_linear(torch.ones(1, 64).bfloat16(), torch.ones(8, 64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_linear_gives_a_token_the_same_bits_whatever_the_token_count(dtype):
    # rows go several at a time and the rest one by one, tokens in blocks that depend on the
    # count: none of that may change a token's sums (a verify of k tokens must score a token as
    # a verify of more tokens would; a batch step's row, as beside any other rows)
    if not kernels.available():
        pytest.fail("kernels.small_linear could not be built here")
    g = torch.Generator().manual_seed(1)
    w = torch.randn(101, 200, generator=g).to(dtype)  # 200: a last step of 8 columns
    x = torch.randn(THRESHOLDS.tile_max_tokens, 200, generator=g)
    full = kernels.small_linear(x, w)
    for T in range(2, THRESHOLDS.tile_max_tokens):
        assert torch.equal(kernels.small_linear(x[:T], w), full[:T]), T
        assert torch.equal(kernels.small_linear(x[-T:], w), full[-T:]), T


def test_integer_loops_give_a_row_the_same_bits_whatever_the_other_rows():
    # rows go four at a time and the rest one by one: both must add a row's lanes in one order,
    # so that a tensor-parallel rank holding some of the rows computes them as one process does
    if not kernels.available():
        pytest.fail("the integer kernels could not be built here")
    g = torch.Generator().manual_seed(2)
    N, K = 23, 256
    x = torch.randn(5, K, generator=g)
    w8 = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    s8 = torch.rand(N, generator=g)
    q4 = packing.pack_int4_rows(torch.randint(0, 16, (N, K), generator=g))
    s4, z4 = torch.rand(N, 8, generator=g).half(), torch.randn(N, 8, generator=g).half()
    full8, full4 = kernels.q8_linear(x, w8, s8), kernels.q4_linear(x, q4, s4, z4, 32)
    for a, b in [(0, 1), (1, 6), (3, 22), (5, 9), (2, 23)]:
        assert torch.equal(kernels.q8_linear(x, w8[a:b].contiguous(), s8[a:b].contiguous()), full8[:, a:b]), (a, b)
        assert torch.equal(kernels.q4_linear(x, q4[a:b].contiguous(), s4[a:b].contiguous(), z4[a:b].contiguous(), 32),
                           full4[:, a:b]), (a, b)


def test_integer_loops_give_a_token_the_same_bits_whatever_the_other_tokens():
    # a serving step's rows (up to THRESHOLDS.loop_max_tokens) are other requests' tokens
    if not kernels.available():
        pytest.fail("the integer kernels could not be built here")
    g = torch.Generator().manual_seed(3)
    N, K, T = 37, 576, THRESHOLDS.loop_max_tokens
    x = torch.randn(T, K, generator=g)
    w8, s8 = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8), torch.rand(N, generator=g)
    q4 = packing.pack_int4_rows(torch.randint(0, 16, (N, K), generator=g))
    s4, z4 = torch.rand(N, 24, generator=g).half(), torch.randn(N, 24, generator=g).half()
    full8, full4 = kernels.q8_linear(x, w8, s8), kernels.q4_linear(x, q4, s4, z4, 32)
    for a, b in [(0, 1), (0, 2), (3, 19), (10, T), (0, 16), (17, 50), (T - 5, T)]:
        assert torch.equal(kernels.q8_linear(x[a:b], w8, s8), full8[a:b]), (a, b)
        assert torch.equal(kernels.q4_linear(x[a:b], q4, s4, z4, 32), full4[a:b]), (a, b)


def reference_attention(q, k, v, mask, scale: float, softcap: float):
    """model.Attention.attend in float64: q (B, H, group * T, D) as attend takes it (row g * T + t is
    query t of head h * group + g), k and v (B, H, S, D), mask (B, 1, T, S); the output in q's layout."""
    B, H, R, D = q.shape
    T = mask.shape[2]
    args = reference.ModelArgs(dim=H * (R // T) * D, n_heads=H * (R // T), n_kv_heads=H, head_dim=D, n_layers=1,
                               vocab_size=8, attention_multiplier=scale, attn_logit_softcapping=softcap or None)
    layer = reference.Attention(args, sliding=False)
    y = layer.attend(q.double().reshape(B, -1, T, D), k.double(), v.double(), mask.double())  # (B, n_heads, T, D)
    return y.reshape(B, H, R, D)


def paged_pools(k: torch.Tensor, v: torch.Tensor, block: int, g: torch.Generator) -> tuple:
    """Rows k and v (B, H, S, D) stored in pools of blocks (N, H, block, D), each row's positions in
    blocks scattered at random over the pool (blocks that no row holds are NaN), as an engine's
    cache holds them: (k_pool, v_pool, slots (B, S): the slot of each row's position)."""
    B, H, S, D = k.shape
    per_row = -(-S // block)
    num_blocks = B * per_row + 3
    table = torch.randperm(num_blocks, generator=g)[:B * per_row].view(B, per_row)  # (B, blocks)
    positions = torch.arange(S)
    slots = table[:, positions // block] * block + positions % block  # (B, S)
    pools = []
    for x in (k, v):
        pool = torch.full((num_blocks, H, block, D), float("nan"), dtype=x.dtype)
        pool[slots // block, :, slots % block] = x.transpose(1, 2)
        pools.append(pool)
    return *pools, slots


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("G,T,D", [(7, 1, 64), (3, 1, 24), (4, 3, 72), (2, 2, 16), (1, 1, 40), (4, 1, 256),
                                   (2, 2, 128)])
def test_attend_matches_float64_and_gives_each_row_its_bits_alone(G, T, D, kv_dtype):
    """A batch step's attention (GQA groups of 1 to 7 queries, verify tokens, head sizes with a
    tail) over a paged cache: each row's keys and values in blocks scattered over a slot pool, read
    in place through `slots`. Against model.Attention.attend over the gathered keys in float64;
    the same bits as `attend` over the gathered keys (contiguous rows), and each row's bits those
    of the row alone; with soft-capping, masks with holes, and NaN in slots that a row's mask hides."""
    if not kernels.available():
        pytest.fail("the kernels could not be built here")
    g = torch.Generator().manual_seed(G * 100 + T * 10 + D)
    B, H, S = 6, 2, 50
    q = torch.randn(B, H, G * T, D, generator=g)
    k, v = (torch.randn(B, H, S, D, generator=g).to(kv_dtype) for _ in range(2))
    mask = torch.zeros(B, 1, T, S)
    for b in range(B):
        for t in range(T):
            mask[b, 0, t, 30 + 3 * b + t:] = float("-inf")
    mask[1, 0, :, :5] = float("-inf")  # a sliding window's start
    mask[2, 0, :, 7:9] = float("-inf")  # a hole
    dirty_k, dirty_v = k.clone(), v.clone()  # slots no query sees may hold anything
    dirty_k[2, :, 7], dirty_v[2, :, 8] = float("nan"), float("nan")
    dirty_k[5, :, S - 1] = float("inf")
    k_pool, v_pool, slots = paged_pools(dirty_k, dirty_v, 16, g)
    for softcap in (0.0, 5.0):
        out = kernels.attend(q, k_pool, v_pool, mask, 0.3, softcap, slots)
        want = reference_attention(q, k, v, mask, 0.3, softcap)
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
        k_rows, v_rows = (pool[slots // 16, :, slots % 16].transpose(1, 2) for pool in (k_pool, v_pool))
        gathered = kernels.attend(q, k_rows, v_rows, mask, 0.3, softcap)
        assert torch.equal(gathered, out), softcap
        for b in range(B):
            for h in range(H):
                alone = kernels.attend(q[b:b + 1, h:h + 1], k_pool[:, h:h + 1], v_pool[:, h:h + 1], mask[b:b + 1],
                                       0.3, softcap, slots[b:b + 1])
                assert torch.equal(alone[0, 0], out[b, h]), (softcap, b, h)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("G,D", [(3, 64), (1, 40), (7, 16), (2, 256)])
def test_attend_rows_of_one_sequence_keep_their_bits(G, D, kv_dtype):
    """A batch step carries a prompt as rows of one token each, all with its sequence's slots:
    attend reads each key once for a tile of them (and of a GQA group's queries). Each query gets
    the bits it gets alone, beside decode rows of other sequences; also rows whose window starts
    later (run apart) and a fully masked row (zeros)."""
    if not kernels.available():
        pytest.fail("the kernels could not be built here")
    g = torch.Generator().manual_seed(G * 1000 + D)
    H, S, P = 2, 70, 20  # a prompt of P tokens at positions 40..59, as rows 2..P+1
    k, v = (torch.randn(3, H, S, D, generator=g).to(kv_dtype) for _ in range(2))
    k_pool, v_pool, seq_slots = paged_pools(k, v, 16, g)
    seqs = torch.tensor([0, 1] + [2] * P + [1])  # the last row: sequence 1 again, apart from its first
    positions = [65, 33] + [40 + i for i in range(P)] + [34]
    mask = torch.zeros(len(seqs), 1, 1, S)
    for b, pos in enumerate(positions):
        mask[b, ..., pos + 1:] = float("-inf")
    mask[2 + 5:2 + 7, ..., :3] = float("-inf")  # a window that starts later
    mask[2 + 9, ..., :8] = float("-inf")
    mask[2 + 12] = float("-inf")  # a row that reads nothing
    q = torch.randn(len(seqs), H, G, D, generator=g)
    slots = seq_slots[seqs]
    for softcap in (0.0, 5.0):
        out = kernels.attend(q, k_pool, v_pool, mask, 0.3, softcap, slots)
        want = reference_attention(q, k[seqs], v[seqs], mask, 0.3, softcap)
        rows = torch.arange(len(seqs)) != 2 + 12
        torch.testing.assert_close(out[rows].double(), want[rows], rtol=1e-5, atol=1e-5)
        assert not out[2 + 12].any()
        for b in range(len(seqs)):
            for h in range(H):
                for r in range(G):
                    alone = kernels.attend(q[b:b + 1, h:h + 1, r:r + 1], k_pool[:, h:h + 1], v_pool[:, h:h + 1],
                                           mask[b:b + 1], 0.3, softcap, slots[b:b + 1])
                    assert torch.equal(alone[0, 0, 0], out[b, h, r]), (softcap, b, h, r)


def test_the_build_line_only_when_it_builds():
    if not kernels.available():
        pytest.fail("the kernels could not be built here")
    vnni = kernels.has_vnni()
    built = kernels.build_name(kernels.SOURCE, kernels.build_flags(vnni))
    assert kernels.build_line(built, vnni) is None
    assert "building the CPU kernels" in kernels.build_line("minillm_kernels_never_built", vnni)


def test_attend_refuses_a_slot_outside_its_pool():
    if not kernels.available():
        pytest.fail("the kernels could not be built here")
    q, pool, mask = torch.randn(2, 1, 1, 16), torch.randn(8, 1, 4, 16), torch.zeros(2, 1, 1, 4)
    for bad in (32, -1):
        slots = torch.tensor([[0, 1, 2, 3], [4, 5, bad, 7]])
        with pytest.raises(RuntimeError, match="slot out of range"):
            kernels.attend(q, pool, pool, mask, 0.25, 0.0, slots)


def test_kernels_give_the_same_bits_with_any_thread_count():
    # the loops split output rows (or attention rows) between threads, never a sum: the test suite
    # runs one thread per worker, so the split itself is checked here
    if not kernels.available():
        pytest.fail("the kernels could not be built here")
    g = torch.Generator().manual_seed(4)
    N, K, T = 75, 256, 3
    x = torch.randn(T, K, generator=g)
    w = torch.randn(N, K, generator=g)
    w8, s8 = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8), torch.rand(N, generator=g)
    q4 = packing.pack_int4_rows(torch.randint(0, 16, (N, K), generator=g))
    s4, z4 = torch.rand(N, 8, generator=g).half(), torch.randn(N, 8, generator=g).half()
    q, k, v = (torch.randn(2, 3, s, 16, generator=g) for s in (2, 40, 40))
    mask = torch.zeros(2, 1, 1, 40)
    mask[1, ..., 30:] = float("-inf")
    k_pool, v_pool, slots = paged_pools(k, v, 16, g)
    calls = [lambda: kernels.small_linear(x, w), lambda: kernels.small_linear(x, w.bfloat16()),
             lambda: kernels.small_linear(x[:1], w), lambda: kernels.small_linear(x[:1], w.bfloat16()),  # decode
             lambda: kernels.q8_linear(x, w8, s8), lambda: kernels.q4_linear(x, q4, s4, z4, 32),
             lambda: kernels.q8_linear(x[:1], w8, s8), lambda: kernels.q4_linear(x[:1], q4, s4, z4, 32),
             lambda: kernels.attend(q, k, v, mask, 0.25),
             lambda: kernels.attend(q, k.bfloat16(), v.bfloat16(), mask, 0.25),
             lambda: kernels.attend(q, k_pool, v_pool, mask, 0.25, 0.0, slots)]
    if kernels.BF16_DOT:  # a bfloat16 model's decode token
        calls.append(lambda: kernels.small_linear(x[:1].bfloat16(), w.bfloat16()))
    n = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append([f() for f in calls])
    finally:
        torch.set_num_threads(n)
    for i in range(len(calls)):
        assert torch.equal(results[0][i], results[1][i]) and torch.equal(results[0][i], results[2][i]), i


def test_compiled_linear_uses_small_linear_for_few_tokens(monkeypatch):
    torch.manual_seed(0)
    lin = kernels.CpuLinear(64, 48, bias=True)
    x = torch.randn(1, 5, 64)  # 5 tokens: the small_linear path
    ref = x.double() @ lin.weight.double().t() + lin.bias.double()
    calls, graphs = [], []
    real = kernels.small_linear
    monkeypatch.setattr(kernels, "small_linear", lambda *a: calls.append(1) or real(*a))

    with torch.inference_mode():
        eager = lin(x)  # eager keeps BLAS: the reference the compiled paths are tested against
        compiled = torch.compile(lin, fullgraph=True, backend=recording(graphs))(x)
    assert len(calls) == 1 and any("minillm.small_linear" in g for g in graphs)
    for y in (eager, compiled):
        assert y.shape == (1, 5, 48)
        assert (y.double() - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompt_sized_products_take_onednn_compiled_or_not(monkeypatch, dtype):
    # a prompt, a batch of requests: oneDNN's GEMM from 16 float32 or 8 bfloat16 tokens; a
    # compiled float32 product with AVX-512 keeps small_linear's tiles up to 64 tokens
    torch.manual_seed(0)
    lin = kernels.CpuLinear(96, 40, bias=True).to(dtype)
    expected_onednn = kernels.ONEDNN and (dtype == torch.float32 or kernels.CPU_HAS_BF16)
    eager_from, compiled_from = kernels.onednn_min_tokens(dtype), kernels.compiled_onednn_min_tokens(dtype)
    assert compiled_from == (65 if dtype == torch.float32 and kernels.AVX512 else eager_from)
    calls, graphs = [], []
    real = kernels.dense_linear
    monkeypatch.setattr(kernels, "dense_linear", lambda *a: calls.append(1) or real(*a))

    tol = 1e-4 if dtype == torch.float32 else 0.05  # bfloat16 output: one rounding of ~8 bits
    for tokens in sorted({eager_from - 1, eager_from, 40, compiled_from - 1, compiled_from}):
        graphs.clear()
        x = torch.randn(1, tokens, 96).to(dtype)
        ref = x.double() @ lin.weight.double().t() + lin.bias.double()
        torch._dynamo.reset()
        with torch.inference_mode():
            calls.clear()
            eager = lin(x)
            assert bool(calls) == (expected_onednn and tokens >= eager_from), tokens
            calls.clear()
            compiled = torch.compile(lin, fullgraph=True, backend=recording(graphs))(x)
            inductor = torch.compile(lin, fullgraph=True)(x)
        onednn = expected_onednn and tokens >= compiled_from
        assert (len(calls) == 2) == onednn and any("minillm_dnn.linear" in g for g in graphs) == onednn, tokens
        for got in (eager, compiled, inductor):
            assert got.shape == (1, tokens, 40) and (got.double() - ref).abs().max().item() < tol, tokens


def cpu_features(monkeypatch, every: bool):
    """This process's kernels.py as on a CPU with AVX-512, its BF16 part, bf16 instructions and oneDNN
    (every), or with oneDNN alone; the kernels built either way."""
    for flag in ("AVX512", "BF16_DOT", "CPU_HAS_BF16"):
        monkeypatch.setattr(kernels, flag, every)
    monkeypatch.setattr(kernels, "ONEDNN", True)
    monkeypatch.setitem(kernels._state, "built", True)


def test_linear_path_follows_the_thresholds_table(monkeypatch):
    """CpuLinear.linear_path by (weight and x dtype, tokens, compiled), the counts read from THRESHOLDS."""
    t, f32 = THRESHOLDS, kernels.CpuLinear(8, 8)
    bf16 = kernels.CpuLinear(8, 8).to(torch.bfloat16)
    cpu_features(monkeypatch, every=True)
    table = {(bf16, 1, True): "small_linear",  # a bfloat16 decode step, compiled: AVX-512 BF16's token loop
             (bf16, 1, False): "small_linear", (f32, 1, True): "small_linear",
             (bf16, t.onednn_min_tokens_bf16 - 1, True): "small_linear",
             (bf16, t.onednn_min_tokens_bf16 - 1, False): "torch",  # eager: BLAS, the reference
             (bf16, t.onednn_min_tokens_bf16, True): "onednn", (bf16, 300, False): "onednn",  # a prompt
             (f32, t.onednn_min_tokens - 1, False): "torch", (f32, t.onednn_min_tokens, False): "onednn",
             (f32, t.onednn_min_tokens, True): "small_linear", (f32, t.tile_max_tokens, True): "small_linear",
             (f32, t.tile_max_tokens + 1, True): "onednn", (f32, 300, False): "onednn"}
    assert {case: case[0].linear_path(case[1], case[0].weight.dtype, case[2]) for case in table} == table
    cpu_features(monkeypatch, every=False)
    table = {(bf16, 1, True): "reduction", (f32, 1, True): "reduction", (f32, 1, False): "torch",
             (f32, t.onednn_min_tokens - 1, True): "small_linear", (f32, t.onednn_min_tokens, True): "onednn",
             (bf16, t.linear_max_tokens, True): "small_linear",  # no oneDNN in bfloat16 without bf16 instructions
             (bf16, t.linear_max_tokens + 1, True): "float32", (bf16, 300, False): "float32",
             (bf16, 1, False): "torch"}
    assert {case: case[0].linear_path(case[1], case[0].weight.dtype, case[2]) for case in table} == table
    with kernels.switched_off():
        assert [f32.linear_path(tokens, torch.float32, True) for tokens in (5, 1)] == ["torch", "reduction"]


def test_attention_path_follows_the_thresholds_table(monkeypatch):
    """CpuAttention.attention_path by (key dtype, queries, masked, compiled), the counts read from THRESHOLDS."""
    t, layer = THRESHOLDS, kernels.install(random_model()).layers[0].attention  # head_dim 16
    cpu_features(monkeypatch, every=True)
    chunked = 2 * t.prompt_query_chunk
    f32, bf16 = torch.float32, torch.bfloat16
    table = {(1, bf16, True, True): "kernel",  # a bfloat16 decode step, compiled
             (t.attend_max_queries, f32, True, False): "kernel", (t.attend_max_queries + 1, f32, True, False): "model",
             (chunked - 1, f32, True, False): "model", (chunked, f32, True, False): "chunks",
             (300, bf16, True, False): "chunks",  # a prompt
             (300, f32, True, True): "model", (300, f32, False, False): "model",  # compiled; SDPA's causal mask
             (1, torch.float16, True, True): "spelled_out", (1, torch.float16, True, False): "model"}
    assert {case: layer.attention_path(*case) for case in table} == table
    with kernels.switched_off():
        assert [layer.attention_path(1, f32, True, compiled) for compiled in (True, False)] == ["spelled_out", "model"]


def test_packed_linear_path_follows_the_thresholds_table():
    """qlayers.PackedLinear.linear_path by (layout, tokens, compiled), the counts read from THRESHOLDS."""
    t, layer = THRESHOLDS, qlayers.Int8Linear(64, 32)
    layer.cpu_kernel_layout, layer.layout = True, "lanes"  # packed for kernels.py's loops
    table = {(1, True): "loop", (t.loop_max_tokens, False): "loop", (t.loop_max_tokens + 1, True): "dequantized"}
    assert {case: layer.linear_path(*case) for case in table} == table
    layer.cpu_kernel_layout = False  # the unpacking expression's lanes (no kernels.py)
    assert [layer.linear_path(1, True), layer.linear_path(1, False)] == ["matvec", "dequantized"]
    layer.layout = "rows"  # CUDA's
    assert [layer.linear_path(1, True), layer.linear_path(5, True)] == ["matvec", "rows"]
    layer.tinygemm = True
    assert layer.linear_path(1, True) == "tinygemm"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepacked_weights_give_the_same_bits_and_are_the_ones_read(dtype):
    packable = kernels.ONEDNN and (dtype == torch.float32 or kernels.CPU_HAS_BF16)
    m = kernels.install(random_model(tie_word_embeddings=True).to(dtype))
    linears = [mod for mod in m.modules() if isinstance(mod, kernels.CpuLinear)]
    weights = {id(mod.weight): mod.weight for mod in linears}  # the output head shares the embedding's
    meta = reference.Transformer(m.args).to("meta")
    expected = sum(w.numel() for w in weights.values()) * dtype.itemsize if packable else 0
    assert kernels.prepack_bytes(meta, torch.device("cpu"), dtype) == expected
    assert kernels.prepack_bytes(meta, torch.device("meta"), dtype) == 0
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(tokens, m.args.dim, generator=g).to(dtype) for tokens in (1, 8, 16, 40, 300)]
    with torch.inference_mode():
        before = [m.output(x) for x in xs]
        assert kernels.prepack(m) == (len(linears) if packable else 0)
        assert kernels.prepack(m) == 0  # once
        if not packable:
            return
        assert len({mod.packed for mod in linears}) == len(weights)
        assert [torch.equal(a, m.output(x)) for a, x in zip(before, xs)] == [True] * len(xs)
        # the copy is what a product of many tokens reads: swapped for zeros, it gives zeros
        real = kernels._PACKED[m.output.packed]
        kernels._PACKED[m.output.packed] = torch.ops.mkldnn._reorder_linear_weight(
            torch.zeros_like(m.output.weight), kernels.onednn_min_tokens(dtype))
        assert not m.output(xs[3]).any() and m.output(xs[0]).any()  # one token reads the plain weight
        torch._dynamo.reset()
        assert not torch.compile(m.output, fullgraph=True)(xs[4]).any()  # and so does a compiled step
        kernels._PACKED[m.output.packed] = real
    handles = {mod.packed for mod in linears}
    del m, linears, weights, real
    import gc
    gc.collect()
    assert not handles & kernels._PACKED.keys()  # the copies go with the model


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_one_token_linear_takes_the_avx512_loop_where_built(monkeypatch, wdtype):
    # the decode step's products and a prompt's output head: small_linear's one-token loop with
    # AVX-512, compiled or not; else inductor's multiply-and-sum, or BLAS in eager; all must
    # give F.linear's values
    torch.manual_seed(0)
    lin = kernels.CpuLinear(4864, 40, bias=True).to(wdtype)  # a long row, as Qwen's down projection
    x = torch.randn(1, 1, 4864).to(wdtype)
    ref = x.double() @ lin.weight.double().t() + lin.bias.double()
    graphs, calls = [], []
    real = kernels.small_linear
    monkeypatch.setattr(kernels, "small_linear", lambda *a: calls.append(a[0].dtype) or real(*a))

    with torch.inference_mode():
        eager = lin(x)
        y = torch.compile(lin, fullgraph=True, backend=recording(graphs))(x)
        inductor = torch.compile(lin, fullgraph=True)(x)
    loop = kernels.AVX512 and kernels.available()
    assert any("minillm.small_linear" in g for g in graphs) == loop and (len(calls) == 3) == loop
    if loop:  # a bfloat16 token as it is where AVX-512 BF16's loop is built, else widened
        assert set(calls) == {torch.bfloat16 if kernels.BF16_DOT and wdtype == torch.bfloat16 else torch.float32}
    tol = 1e-4 if wdtype == torch.float32 else 0.05  # bfloat16 output: one rounding of ~8 bits
    for got in (eager, y, inductor):
        assert got.shape == (1, 1, 40) and (got.double() - ref).abs().max().item() < tol


def test_stream_sum_is_the_sum():
    if not kernels.available():
        pytest.fail("the kernels could not be built here")
    g = torch.Generator().manual_seed(3)
    for n in (16, 16 * 4097, 16 * 100003):  # lines that do not split evenly into threads and streams
        t = torch.rand(n, generator=g)
        for streams in (1, 2, 3, 8):
            assert abs(kernels.stream_sum(t, streams) - t.double().sum().item()) < 1e-4 * n, (n, streams)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernels.stream_sum(torch.ones(17), 1)


@pytest.mark.slow  # a second build of the kernels, a minute on a fresh machine
def test_the_other_build_of_the_integer_loops_gives_the_same_products():
    """Where the CPU has AVX-512 VNNI the kernels are built with it, so the AVX2 loops (what
    every AVX2-only machine runs) would go untested: run test_quantize.py's kernel cases once
    more, in a process that builds and loads those (MINILLM_KERNELS_VNNI=0). On an AVX2-only
    machine they are the default build, which the rest of the suite tests."""
    if not kernels.has_vnni():
        pytest.skip("the default build here is the AVX2 one, tested by the rest of the suite")
    root = Path(__file__).resolve().parents[1]
    script = ("import kernels, sys; assert kernels.available() and not kernels.has_vnni(); "
              "import pytest; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/test_quantize.py', "
              "'-k', 'quantized_linear_equals_dequantized_matmul and cpp-kernel']))")
    r = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "MINILLM_KERNELS_VNNI": "0", "PYTHONPATH": str(root)})
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "AVX2; built once" in r.stderr and " passed" in r.stdout


def test_install_swaps_float_linears_and_attention_only_once():
    model = random_model(tie_word_embeddings=True)
    linears = {name for name, m in model.named_modules() if type(m) is nn.Linear}
    weights = {name: p for name, p in model.named_parameters()}
    assert kernels.install(model) is model
    assert all(type(model.get_submodule(name)) is kernels.CpuLinear for name in linears)
    assert all(type(layer.attention) is kernels.CpuAttention for layer in model.layers)
    assert all(p is weights[name] for name, p in model.named_parameters())  # same tensors, tie kept
    assert model.output.weight is model.tok_embeddings.weight
    kernels.install(model)
    assert type(model.output) is kernels.CpuLinear and type(model.layers[0].attention) is kernels.CpuAttention


def test_install_leaves_packed_layers_and_models_off_the_cpu():
    model = random_model(n_layers=1)
    qlayers.use_quantized_layers(model, {"mode": "int8"})
    kernels.install(model)
    assert isinstance(model.layers[0].feed_forward.w1, qlayers.Int8Linear)
    with torch.device("meta"):
        off_cpu = reference.Transformer(reference.ModelArgs(vocab_size=64, dim=32, intermediate_size=64,
                                                            n_layers=1, n_heads=2))
    kernels.install(off_cpu)
    assert type(off_cpu.output) is nn.Linear and type(off_cpu.layers[0].attention) is reference.Attention


@pytest.mark.parametrize("variant", [
    dict(n_kv_heads=1, attention_bias=True),  # MQA, q/k/v biases
    dict(sliding_window=5, attn_logit_softcapping=20.0, tie_word_embeddings=False),  # sliding window, soft-capping
])
@pytest.mark.parametrize("with_kernels", [True, False], ids=["kernels", "without-kernels"])
def test_installed_model_matches_the_reference(variant, with_kernels, one_thread):
    """The fast paths against model.py's reference: eager (attend for a few queries), a
    compiled decode step (multiply-and-sum products; attend, or attention spelled out without
    the kernels) and a compiled 5-token forward (small_linear), from the same cache."""
    ref = random_model(**variant)
    fast = kernels.install(copy.deepcopy(ref))
    torch._dynamo.reset()  # a compiled graph reads kernels.available() when it is traced
    step = torch.compile(lambda m, t, p: m(t, p), fullgraph=True)
    with torch.inference_mode(), (kernels.switched_off() if not with_kernels else torch.no_grad()):
        for m in (ref, fast):
            m.setup_caches(1, 32)
            m(torch.arange(3, 11).view(1, -1), torch.arange(8))
        for i, t in enumerate([17, 99, 4, 250, 31, 8]):
            tokens, pos = torch.tensor([[t]]), torch.tensor([8 + i])
            if i % 2:
                expected, got = ref(tokens, pos), step(fast, tokens, pos)
            else:
                expected, got = ref(tokens, pos), fast(tokens, pos)
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
        chunk, chunk_pos = torch.tensor([[5, 6, 7, 8, 9]]), torch.arange(14, 19)
        torch.testing.assert_close(step(fast, chunk, chunk_pos), ref(chunk, chunk_pos), atol=1e-4, rtol=0)


def two_rows_apart(models, tokens: torch.Tensor, lead: int = 37) -> torch.Tensor:
    """Caches for a batch of two sequences, and their positions (2, T) for the chunk tokens (2, T)
    that the callers feed next: row 0 from position 0, row 1 from `lead` (its first `lead` positions
    fed here, row 0's overwritten by the chunk), so that each row's queries see other keys."""
    T = tokens.shape[1]
    head = torch.randint(0, 256, (2, lead), generator=torch.Generator().manual_seed(1))
    for m in models:
        m.setup_caches(2, lead + T + 3)
        m(head, torch.arange(lead))
    return torch.stack([torch.arange(T), torch.arange(lead, lead + T)])


@pytest.mark.parametrize("variant", [dict(), dict(sliding_window=40, tie_word_embeddings=False),
                                     dict(attn_logit_softcapping=5.0)], ids=["global", "window", "softcap"])
def test_long_prompt_attention_in_chunks_matches_the_reference(variant, monkeypatch):
    # a batch of two 300-token chunks, each row at its own positions (row 1 37 ahead, over its
    # cached keys): each chunk of queries sees only the keys up to its last query's, and no query
    # loses a key it may see (sliding windows: the keys inside its window before the chunk too);
    # with oneDNN each chunk is its GEMMs, soft-capped scores included
    ref = random_model(max_position_embeddings=512, **variant)
    fast = kernels.install(copy.deepcopy(ref))
    calls, gemm_calls = [], []
    real, real_gemms = kernels.CpuAttention.attend_in_chunks, kernels.chunk_attention
    monkeypatch.setattr(kernels.CpuAttention, "attend_in_chunks", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(kernels, "chunk_attention", lambda *a: gemm_calls.append(1) or real_gemms(*a))
    tokens = torch.randint(0, 256, (2, 300))
    with torch.inference_mode():
        positions = two_rows_apart((ref, fast), tokens)
        calls.clear()
        gemm_calls.clear()
        expected, got = ref(tokens, positions), fast(tokens, positions)
    chunked = kernels.ONEDNN or "attn_logit_softcapping" not in variant  # SDPA cannot soft-cap
    assert len(calls) == (2 if chunked else 0)  # both layers
    assert len(gemm_calls) == (2 * 3 if kernels.ONEDNN else 0)  # 3 chunks of queries per layer
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gated_activation_matches_float64(act, dtype, monkeypatch):
    # act(gate) * up in one pass, rounded once: within a rounding of the float64 value (a length
    # that is not a multiple of 8 takes the padded last block); an eager prompt's feed-forward
    # takes it, and gives the reference layer's output
    if not kernels.available():
        pytest.skip("kernels not built here: the feed-forward takes torch's activation")
    torch.manual_seed(0)
    gate, up = (torch.randn(37, 203) * 4).to(dtype), torch.randn(37, 203).to(dtype)
    gate[0, :4] = torch.tensor([0.0, -0.0, 100.0, -100.0])
    fn = reference.ACTIVATIONS[act]
    got, want = kernels.gated(gate, up, fn), (fn(gate.double()) * up.double())
    assert got.dtype == dtype and got.shape == gate.shape
    # a rounding in bfloat16; in float32 a few ulp (exp_neg's 2 and the products'); below e^-87 exp_neg gives 0
    rtol = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -20
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=1e-6)
    layer = reference.FeedForward(reference.ModelArgs(dim=64, intermediate_size=96, n_layers=1, n_heads=4,
                                                      vocab_size=8, hidden_act=act)).to(dtype)
    fast = kernels.install(copy.deepcopy(layer))
    calls, real = [], kernels.gated
    monkeypatch.setattr(kernels, "gated", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(1, 50, 64)
    with torch.inference_mode():
        got, want = fast(x.to(dtype)), layer(x.to(dtype))
    if dtype == torch.bfloat16:  # one rounding fewer than the reference's, then w2
        torch.testing.assert_close(got, want, atol=1e-2, rtol=2 ** -6)
    else:
        assert torch.equal(got, want)
    # bfloat16 only: float32 keeps the reference's arithmetic
    assert type(fast) is kernels.CpuFeedForward and calls == ([1] if dtype == torch.bfloat16 else [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_matches_the_reference_layer(offset, dtype):
    # the same arithmetic as model.RMSNorm, its roundings where the reference's are: in bfloat16 the
    # same bits but for a rare last-place difference (the sum of squares in another order); float32
    # is the reference's own; a transposed input (a head's q or k norm) included
    if not kernels.available():
        pytest.skip("kernels not built here: the norm is the reference's")
    torch.manual_seed(0)
    for x in (torch.randn(3, 50, 64) * 3, torch.randn(1, 50, 4, 32).transpose(1, 2)):
        norm = reference.RMSNorm(x.shape[-1], 1e-6, offset).to(dtype)
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
        fast = kernels.install(copy.deepcopy(norm))
        assert type(fast) is kernels.CpuRMSNorm
        with torch.inference_mode():
            want, got = norm(x.to(dtype)), fast(x.to(dtype))
        assert got.dtype == want.dtype and got.shape == want.shape
        if dtype == torch.bfloat16:
            assert (got == want).float().mean() > 0.99
            torch.testing.assert_close(got, want, atol=0, rtol=2 ** -7)
        else:  # float32 keeps the reference's own sums
            assert torch.equal(got, want)


def needs_prompt_attend():
    if not (kernels.PROMPT_ATTEND and kernels.available()):
        pytest.skip("no AVX-512 BF16 on this CPU: a bfloat16 prompt's attention takes chunk_attention, "
                    "tested by test_long_prompt_attention_in_chunks_matches_the_reference")


@pytest.mark.parametrize("B,n_kv,group,T,S,D", [(1, 2, 7, 128, 493, 64), (2, 1, 4, 37, 301, 256),
                                               (1, 2, 3, 128, 200, 128), (1, 3, 1, 5, 17, 64)])
def test_prompt_attend_matches_float64_attention(B, n_kv, group, T, S, D):
    # bfloat16 q, k, v; queries at the last T positions of S keys (a chunk of a causal prompt),
    # row 0 of batch row 0 behind a ring cache's leading empty slots, and a query that sees no key
    needs_prompt_attend()
    torch.manual_seed(0)
    q = torch.randn(B, n_kv * group, T, D).bfloat16()
    k, v = torch.randn(B, n_kv, S, D).bfloat16(), torch.randn(B, n_kv, S, D).bfloat16()
    pos = torch.arange(S - T, S)
    mask = torch.where(torch.arange(S) <= pos[:, None], 0.0, float("-inf")).expand(B, 1, T, S).clone()
    mask[0, 0, 0, :3] = float("-inf")
    mask[-1, 0, T // 2] = float("-inf")
    scale = D ** -0.5
    got = kernels.prompt_attend(q, k, v, mask, scale)
    want = attention_float64(q, k, v, mask, scale)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert (got[-1, :, T // 2] == 0).all()
    # the probabilities rounded to bfloat16 (2^-9 relative) for their product with v
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=0)


def attention_float64(q, k, v, mask, scale):
    """softmax(scale * q k^T + mask) v in float64: q (B, n_heads, T, D), k and v (B, n_kv_heads, S, D),
    mask (B, 1, T, S); a query that sees no key gets 0."""
    B, n_heads, T, D = q.shape
    n_kv = k.shape[1]
    scores = q.double().view(B, n_kv, -1, T, D) @ k.double().unsqueeze(2).transpose(-1, -2) * scale
    probs = torch.softmax(scores + mask.double().unsqueeze(2), dim=-1).nan_to_num(0.0)
    return (probs @ v.double().unsqueeze(2)).view(B, n_heads, T, D)


def test_bfloat16_long_prompt_attention_through_prompt_attend(monkeypatch):
    # a bfloat16 batch of two 300-token chunks at their own positions (64-wide heads, as in
    # test_long_prompt_attention_in_chunks_matches_the_reference): each chunk of queries goes
    # through prompt_attend, which matches float64 attention on the chunk it is given, and the
    # logits agree with a float32 model's as often as with the oneDNN float32 chunks
    needs_prompt_attend()
    ref = random_model(dim=256, n_heads=4, n_kv_heads=2, max_position_embeddings=512)
    fast = kernels.install(copy.deepcopy(ref).to(torch.bfloat16))
    errors, real = [], kernels.prompt_attend

    def checked(q, k, v, mask, scale):
        y = real(q, k, v, mask, scale)
        # relative to the largest value: the probabilities are rounded to bfloat16 (2^-9) for p v
        errors.append((y.double() - attention_float64(q, k, v, mask, scale)).abs().max().item() / v.abs().max().item())
        return y

    tokens = torch.randint(0, 256, (2, 300))
    with torch.inference_mode():
        positions = two_rows_apart((ref, fast), tokens)
        monkeypatch.setattr(kernels, "prompt_attend", checked)
        want = ref(tokens, positions)
        got = fast(tokens, positions)
        monkeypatch.setattr(kernels, "PROMPT_ATTEND", False)
        other = fast(tokens, positions)
    assert len(errors) == 2 * 3 and max(errors) < 4e-3, errors  # 2 layers, 3 chunks of queries
    agree, other_agree = [(x.argmax(-1) == want.argmax(-1)).float().mean().item() for x in (got, other)]
    assert agree > other_agree - 0.02, (agree, other_agree)


def test_bench_kernels_script_help_and_missing_checkpoint(tmp_path):
    r = run_script("-m", "scripts.bench_kernels", "--help")
    assert r.returncode == 0 and "--what" in r.stdout
    r = run_script("-m", "scripts.bench_kernels", "--checkpoint", tmp_path / "nothing", "--what", "layers")
    assert r.returncode == 1 and r.stderr.strip().startswith("error: no checkpoint at")


@pytest.mark.parametrize("onednn", [True, False])
def test_bench_kernels_prefill_parts_adds_up_and_restores_the_kernels(onednn, monkeypatch):
    if onednn and not kernels.ONEDNN:
        pytest.skip("no oneDNN GEMM on this CPU; the case without it runs below")
    monkeypatch.setattr(kernels, "ONEDNN", onednn)
    from scripts.bench_kernels import prefill, prefill_parts
    model = kernels.install(random_model())
    model.setup_caches(1, 320)
    T = 300  # past 2 * THRESHOLDS.prompt_query_chunk: attention in chunks
    tokens = torch.randint(0, 256, (1, T))
    dense, attend = kernels.dense_linear, kernels.CpuAttention.attend
    with torch.inference_mode():
        parts = prefill_parts(model, lambda: prefill(model, tokens), rounds=1)
    assert kernels.dense_linear is dense and kernels.CpuAttention.attend is attend
    # per layer wqkv (64 -> 128), wo, w1, w3, w2; the last layer's products take the last position only
    # (one token: small_linear, not timed as a GEMM), except wqkv, whose keys and values the cache needs
    qkv, ffn = (4 + 2 * 2) * 16 * 64, 3 * 64 * 128
    want = 2 * (T * (qkv + 64 * 64 + ffn) + T * qkv) / 1e9
    if onednn:
        assert parts["gflop"] == pytest.approx(want)
        assert parts["gemm"] > 0 and parts["gemm_hot"] > 0
    else:  # a prompt's products take F.linear, not the oneDNN GEMM that the parts time
        assert parts["gflop"] == parts["gemm"] == parts["gemm_hot"] == 0
    assert parts["attention"] > 0
    assert parts["whole"] == pytest.approx(parts["gemm"] + parts["attention"] + parts["rest"])
