"""What the CUDA path needs that a CPU can check: the oldest torch requirements.txt admits, the
device a user names, the test-device switch, the step shapes CUDA graphs take (rows padded to a
power of two) and tokens sampled on the device, and the decode loop that keeps its inputs on the
device."""
import copy
import re

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import compile as compile_
import forwards
import loading
import tp
from conftest import ROOT, TEST_DEVICE, device_flags, random_model
from engine import Engine
from scheduler import Request
from errors import UserError
from kvcache import ForwardBatch
from sampling import Sampling
from thresholds import THRESHOLDS

# API the engine calls -> the torch release that introduced it
SINCE = {
    "enable_gqa=": "2.5",
    "register_fake": "2.4",
    "is_compiling": "2.3",
    "assume_constant_result": "2.2",
    "set_stance": "2.6",
    "skip_guard_eval_unsafe": "2.7",
    "all_gather_single": "2.13",
}
# used only behind a fallback, each tested below
WITH_FALLBACK = {"set_stance", "skip_guard_eval_unsafe", "all_gather_single"}


def version(text: str) -> tuple:
    return tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", text).groups())


def torch_floor() -> tuple:
    line = next(x for x in (ROOT / "requirements.txt").read_text().splitlines() if x.startswith("torch"))
    return version(line.split(">=")[1])


def test_requirements_floor_covers_every_api_used_without_a_fallback():
    source = "\n".join(p.read_text() for p in ROOT.glob("*.py"))
    assert "enable_gqa=" in source and "all_gather_single" in source  # the scan sees the code
    too_new = [api for api, since in SINCE.items()
               if api in source and api not in WITH_FALLBACK and version(since) > torch_floor()]
    assert not too_new, f"requirements.txt's torch floor is older than what {too_new} need"


def test_all_gather_falls_back_to_the_name_older_torch_has(monkeypatch, tmp_path):
    """Before torch 2.13, all_gather_single is called all_gather_tensor."""
    calls = []
    # stands in for the old function: the new one wrapped, or on a torch before 2.13 the old one itself
    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    monkeypatch.delattr(funcol, "all_gather_single", raising=False)
    monkeypatch.setattr(funcol, "all_gather_tensor", lambda *a: calls.append(a) or gather(*a))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        x = torch.randn(2, 3)
        assert torch.equal(tp.all_gather_single(x, 1, dist.group.WORLD.group_name), x)
    finally:
        dist.destroy_process_group()
    assert len(calls) == 1


def test_guard_skipping_is_optional(monkeypatch):
    """Before torch 2.7 set_stance has no skip_guard_eval_unsafe; before 2.6 there is no set_stance."""
    assert compile_.stance_skips_guards()  # the torch this suite runs on has it
    monkeypatch.setattr(torch.compiler, "set_stance", lambda stance="default", *, force_backend=None: None)
    assert not compile_.stance_skips_guards()
    monkeypatch.delattr(torch.compiler, "set_stance")
    assert not compile_.stance_skips_guards()
    monkeypatch.setattr(compile_, "SKIPS_GUARDS", False)
    with compile_.guards_skipped(True):
        pass


def test_a_cuda_index_beyond_the_machine_is_a_user_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert loading.parse_device("cuda:1") == torch.device("cuda:1")
    assert loading.parse_device("cuda") == torch.device("cuda")
    with pytest.raises(UserError, match=r"'cuda:2' does not exist: this machine has 2 CUDA device"):
        loading.parse_device("cuda:2")


def test_a_rank_beyond_the_machines_gpus_is_a_user_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(UserError, match="rank 1 needs cuda:1, but this machine has 1 CUDA device"):
        tp.init_from_env("cuda")


def test_command_lines_run_on_the_test_device_in_float32():
    assert device_flags(["generate.py", "--prompt", "x"]) == ["--device", TEST_DEVICE, "--dtype", "float32"]
    assert device_flags([ROOT / "serve.py", "--device", "cpu"]) == ["--dtype", "float32"]
    assert device_flags(["eval.py", "--dtype", "bfloat16", "--device", "cpu"]) == []
    assert device_flags(["quantize.py", "--mode", "int8"]) == []  # takes no --device


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_cuda_step_shapes_and_sampling_on_the_device_give_the_same_tokens(compiled):
    """The engine as it runs on CUDA, against eager steps whose tokens are picked on the host:
    tokens sampled inside the step (no logits to the host) and, compiled, each step's rows padded
    to a power of two (pad_rows: one CUDA graph per width; the padding rows read and write the
    scratch block) change nothing, as rows stop at different steps, at max_new_tokens and at a
    stop id, and a step's width shrinks from 4 (3 rows) to 2 and 1."""
    model = random_model(device=TEST_DEVICE)
    prompts = [[5, 17, 3, 200, 42], [99, 4, 64], [7, 7, 1, 30, 2, 250, 11]]
    plain = Engine(model, 3, 128)
    free, _ = plain.generate(prompts, 24, Sampling(), host=True)
    stop = free[0][6]  # row 0 ends early; the others run to the end unless they meet the same token
    cuda_like = Engine(copy.deepcopy(model), 3, 128, compile=compiled, pad_rows=True)
    assert cuda_like.pad_rows == compiled and cuda_like.step_width(3) == (4 if compiled else 3)
    for n, stop_ids in [(24, ()), (24, [stop]), (1, ()), (2, [stop])]:
        want, want_stats = plain.generate(prompts, n, Sampling(), stop_ids=stop_ids, host=True)
        got, stats = cuda_like.generate(prompts, n, Sampling(), stop_ids=stop_ids)
        assert got == want
        assert stats.finish_reasons == want_stats.finish_reasons
        assert stats.cached_tokens == want_stats.cached_tokens
        if stop_ids:
            assert len(got[0]) < n or n < 7
    assert len(free[0]) == 24 and free[0].index(stop) == 6


def test_decode_steps_continue_on_the_device(monkeypatch):
    """After the first decode step, a step of the same rows sends nothing from the host: its tokens
    are the last step's sampled ones, its positions and slots computed on the device, its block
    table written in place where a row took a block (no torch.tensor per step); and the text is
    the one that steps built from the host give."""
    model = random_model(device=TEST_DEVICE)
    eng = Engine(model, 1, 64)
    made = []
    real = torch.tensor
    monkeypatch.setattr(forwards.torch, "tensor", lambda *a, **k: made.append(a) or real(*a, **k))
    counts = []

    def on_tokens(ids):
        counts.append(len(made))
    out, _ = eng.generate([[5, 6, 7]], 30, Sampling(), on_tokens=on_tokens)  # crosses two block boundaries
    assert len(out[0]) == 30 and len(counts) == 30
    assert counts[1] > counts[0] and counts[-1] == counts[1], counts  # the first decode step's tensors only
    eng.continues = False
    again, _ = eng.generate([[5, 6, 7]], 30, Sampling())
    assert again == out


@torch.inference_mode()
def test_attention_takes_sdpa_output_in_any_memory_order(monkeypatch):
    """CUDA's SDPA kernels return their output laid out (B, T, H, D) under a (B, H, T, D) shape:
    a prefill (a fresh chunk under SDPA's causal mask, and one under ours through the cache) and
    decode steps through an SDPA that does the same give the same logits."""
    torch.manual_seed(0)
    model = random_model(n_heads=4, n_kv_heads=2)  # grouped queries: attend folds each group into T
    prompt, steps = torch.randint(0, 256, (2, 9)), torch.randint(0, 256, (2, 3))
    long = torch.randint(0, 256, (1, THRESHOLDS.causal_sdpa_min_tokens + 8))  # a fresh chunk this long: SDPA's causal mask

    def run():
        model.setup_caches(2, long.shape[1])
        out = [model(long, ForwardBatch.rows(torch.arange(long.shape[1]), 1, long.shape[1], fresh=True))]
        out += [model(prompt, torch.arange(9))]
        out += [model(steps[:, i:i + 1], torch.tensor([9 + i])) for i in range(3)]
        return out

    expected = run()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls = []

    def cuda_like(*args, **kwargs):
        calls.append(1)
        return sdpa(*args, **kwargs).transpose(1, 2).contiguous().transpose(1, 2)  # same values, (B, T, H, D) in memory

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", cuda_like)
    got = run()
    assert calls, "the model did not call SDPA"
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_lookahead_launches_the_next_step_and_changes_no_token():
    """CUDA's lookahead (run here on CPU): the next step is launched before this one's tokens are
    read, and kept where the plan is that step (the same rows one position further), dropped where
    it is not (a row ended, another arrived). Every request's greedy tokens are its solo run's."""
    model = random_model(device=TEST_DEVICE)
    prompts = [[5, 6, 7], list(range(20, 60)), [9] * 17]
    alone = [Engine(model, 1, 128).generate([p], 24, Sampling())[0][0] for p in prompts]
    eng = Engine(model, 3, 128)
    eng.lookahead, kept = True, []
    run_rides = eng.run_rides

    def rides(plan):
        ahead = eng.ahead
        out = run_rides(plan)
        kept.append(ahead is not None and eng.last_out is ahead[1])
        return out
    eng.run_rides = rides
    reqs = [Request(p, 24 - 6 * i) for i, p in enumerate(prompts)]
    eng.submit(reqs[0])
    for step in range(200):
        if step == 5:
            eng.submit(reqs[1])
        if step == 9:
            eng.submit(reqs[2])
        if not eng.step() and step > 9:
            break
    assert [r.out for r in reqs] == [a[:len(r.out)] for a, r in zip(alone, reqs)]
    assert [len(r.out) for r in reqs] == [24, 18, 12]
    assert sum(kept) > 10 and not all(kept)
