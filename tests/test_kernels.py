"""kernels.small_linear: the register-blocked few-token product used for speculative verifies."""
import pytest
import torch
import torch.nn.functional as F

import kernels
from model import Linear


def test_small_linear_is_built_on_avx2_machines():
    # the verify speed-ups in the README depend on it: a failed build must not go unnoticed
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert kernels.available()


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_small_linear_matches_float64_reference(wdtype):
    if not kernels.available():
        pytest.fail("kernels.small_linear could not be built here")
    g = torch.Generator().manual_seed(0)
    # row counts that leave remainders for the 8-row and 2-row blocks, K with a scalar tail
    for N, K in [(37, 20), (130, 96), (9, 1541)]:
        w = torch.randn(N, K, generator=g).to(wdtype)
        for T in range(1, 17):
            x = torch.randn(T, K, generator=g)
            ref = F.linear(x.double(), w.double())
            got = kernels.small_linear(x, w)
            assert got.shape == (T, N) and got.dtype == torch.float32
            err = (got.double() - ref).abs().max().item()
            assert err < 2e-5 * K ** 0.5, (N, K, T, err)


def test_compiled_linear_uses_small_linear_for_few_tokens(monkeypatch):
    torch.manual_seed(0)
    lin = Linear(64, 48, bias=True)
    x = torch.randn(1, 5, 64)  # 5 tokens: the small_linear path
    ref = x.double() @ lin.weight.double().t() + lin.bias.double()
    calls, graphs = [], []
    real = kernels.small_linear
    monkeypatch.setattr(kernels, "small_linear", lambda *a: calls.append(1) or real(*a))

    def recording_backend(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    with torch.inference_mode():
        eager = lin(x)  # eager keeps BLAS: the reference the compiled paths are tested against
        compiled = torch.compile(lin, fullgraph=True, backend=recording_backend)(x)
    assert len(calls) == 1 and any("minillm.small_linear" in g for g in graphs)
    for y in (eager, compiled):
        assert y.shape == (1, 5, 48)
        assert (y.double() - ref).abs().max().item() < 1e-5
