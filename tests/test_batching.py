"""The serving engine (engine.Engine.for_serving, what serve.py runs): continuous batching gives each
request what it gets alone (float32 greedy), the prefix cache, per-request seeds and sampling,
cancellation and faults that end one request only."""
import collections
import copy
import random
import shutil
from pathlib import Path

import pytest
import torch

import kernels
from conftest import TEST_DEVICE, random_model
from engine import Engine
from errors import UserError
from model import Transformer
from sampling import Sampling, sample_rows
from scheduler import QueueFull, Request
from thresholds import THRESHOLDS

pytestmark = pytest.mark.usefixtures("one_thread")


def alone(model, prompt, n):
    """What Engine.generate (generate.py's engine) gives for one prompt, greedy (on a copy: its
    caches are the model's)."""
    engine = Engine(copy.deepcopy(model), 1, 128)
    (out,), _ = engine.generate([prompt], n, Sampling())
    return out


def serving(model, max_batch_size, max_seq_length, **options) -> Engine:
    """The engine as serve.py builds it (weights prepacked for oneDNN, as serve.py's default)."""
    return Engine.for_serving(model, max_batch_size, max_seq_length, **{"prepack": True, **options})


def run_all(engine: Engine, arrivals: dict, max_steps=1000):
    """arrivals: step -> requests submitted before that step. Steps until every request ends."""
    everyone = [r for rs in arrivals.values() for r in rs]
    for step in range(max_steps):
        for r in arrivals.get(step, []):
            engine.submit(r)
        engine.step()
        if step >= max(arrivals) and all(r.finish_reason for r in everyone):
            return everyone
    raise AssertionError("requests did not finish")


def record_widths(engine: Engine) -> list:
    """The rows of each step's one forward that the engine plans from now on (decoding rows and
    the prompt tokens riding beside them; steps of prompt chunks alone are left out)."""
    widths, schedule = [], engine.scheduler.schedule
    engine.scheduler.schedule = lambda: (p := schedule(), p.rides and widths.append(len(p.rides)))[0]
    return widths


def prompts(n, seed=0, vocab=256):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


@pytest.mark.parametrize("arch", ["llama", "sliding"])
@pytest.mark.parametrize("compiled", [False, True])
def test_each_request_as_alone(arch, compiled):
    """Requests of different lengths joining at different steps, some while others are mid-way:
    each one's greedy tokens equal its solo run, eager and compiled (the CPU fast paths)."""
    over = dict(sliding_window=8, architecture="mistral") if arch == "sliding" else {}
    model = random_model(device=TEST_DEVICE, **over)
    ps = prompts(7, seed=1)
    want = [alone(model, p, 12) for p in ps]
    fast = kernels.install(copy.deepcopy(model))
    engine = serving(fast, 4, 128, compile=compiled, prefill_chunk=16)
    reqs = [Request(p, 12) for p in ps]
    run_all(engine, {0: reqs[:2], 3: reqs[2:5], 9: reqs[5:]})  # more requests than rows: some wait
    assert [r.out for r in reqs] == want
    assert all(r.finish_reason == "length" for r in reqs)


def test_wide_steps_as_alone():
    """Eleven streams decoding while two long prompts arrive: steps of more than 16 rows (prompt
    tokens as many as decoding rows), and still each request's greedy tokens are its solo run's."""
    model = random_model(device=TEST_DEVICE)
    ps = [p[:3] for p in prompts(11, seed=3)] + [list(range(3, 60)), list(range(5, 90))]
    assert_wide_steps_as_alone(model, kernels.install(copy.deepcopy(model)), ps, 24)


def assert_wide_steps_as_alone(solo: Transformer, served: Transformer, ps: list, n: int):
    """11 prompts at once and 2 more at step 6 through a compiled serving engine on `served`: each
    request's greedy tokens are its solo run's on `solo`, and a step took more than 16 rows."""
    want = [alone(solo, p, n) for p in ps]
    engine = serving(served, 13, 128, compile=True, prefill_chunk=16)
    widths = record_widths(engine)
    reqs = [Request(p, n) for p in ps]
    run_all(engine, {0: reqs[:11], 6: reqs[11:]})
    assert [r.out for r in reqs] == want
    if engine.fused_rows:  # prompt tokens ride in the step (CPU kernels; on CUDA prompts prefill apart)
        assert max(widths) > 16, widths


def test_quantized_wide_steps_as_alone(tmp_path):
    """The same with an int8 checkpoint: its integer loops give a row the same bits in a step of
    up to 64 rows, so prompt tokens fill the step beside the streams as with float weights."""
    from conftest import run_script, save_checkpoint
    from loading import load_model
    src = save_checkpoint(random_model(), tmp_path / "float")
    r = run_script("quantize.py", "--checkpoint", src, "--mode", "int8", "--out", tmp_path / "int8")
    assert r.returncode == 0, r.stderr
    model = load_model(tmp_path / "int8", TEST_DEVICE)
    # prompts that the solo run also feeds through the loops (a longer one, dequantized weights)
    ps = [p[:3] for p in prompts(11, seed=3)] + [list(range(3, 60)), list(range(5, 5 + THRESHOLDS.loop_max_tokens))]
    assert_wide_steps_as_alone(model, model, ps, 16)


def test_warm_up_compiles_every_step_shape():
    """After serve.py's warm-up, no step recompiles: narrow and wide steps (the float products
    change kernels at 16 rows), short caches and the whole of it (a request would otherwise wait
    for the compiler in the middle of serving)."""
    import serve
    model = kernels.install(random_model(device=TEST_DEVICE))
    engine = serving(model, 17, 300, compile=True, prefill_chunk=64)
    torch._dynamo.reset()
    serve.warm_up(engine)
    reqs = [Request(p[:4], 40) for p in prompts(16, seed=6)] + [Request([1 + i % 200 for i in range(256)], 40)]
    widths, kv_lens, rides = record_widths(engine), [], engine.rides
    engine.rides = lambda model, tokens, positions, block_size, kv_len, *args, **views: (
        kv_lens.append(kv_len), rides(model, tokens, positions, block_size, kv_len, *args, **views))[1]
    with torch.compiler.set_stance("fail_on_recompile"):
        run_all(engine, {0: reqs[:3], 2: reqs[16:], 8: reqs[3:16]})
    assert all(r.error is None for r in reqs) and len(reqs[16].prompt) + len(reqs[16].out) > 256
    # whole blocks, the longest too (300 tokens: 304), as the table's width in a graph cached on disk says
    assert max(kv_lens) == 304 and all(n % engine.block_size == 0 for n in kv_lens)
    if kernels.available():
        assert max(widths) > 16 and min(widths) < 16, widths


def test_compile_aside_serves_eagerly_then_switches():
    """serve.py's default on CPU: steps run eagerly at once while a thread compiles the warm-up's
    shapes, then take up the compiled graphs; each request's greedy tokens are its solo run's
    either way, and once switched no step compiles."""
    import serve
    model = random_model(device=TEST_DEVICE)
    ps = prompts(6, seed=11)
    want = [alone(model, p, 12) for p in ps]
    engine = serving(kernels.install(copy.deepcopy(model)), 4, 200, compile=True, prefill_chunk=64)
    torch._dynamo.reset()
    thread = serve.warm_up(engine, aside=True)
    assert thread.is_alive() and not engine.step_compiled
    first = run_all(engine, {0: [Request(p, 12) for p in ps[:3]]})
    thread.join(timeout=900)
    assert engine.step_compiled  # an idle server says so before its next step
    with torch.compiler.set_stance("fail_on_recompile"):
        rest = run_all(engine, {0: [Request(p, 12) for p in ps[3:]]})
    assert engine.step_compiled
    assert [r.out for r in first + rest] == want


def test_padded_rows_compile_once_and_change_no_token():
    """The CUDA step (run here on CPU): rows padded to powers of two, compiled general in every
    size from the first call. After the warm-up no step compiles, every step has a power-of-two
    width, and each request's greedy tokens are its solo run's."""
    import serve
    model = random_model(device=TEST_DEVICE)
    ps = prompts(9, seed=8)
    want = [alone(model, p, 10) for p in ps]
    engine = serving(kernels.install(copy.deepcopy(model)), 5, 200, compile=True, prefill_chunk=16, pad_rows=True)
    widths = []  # the rows of each compiled call
    rides = engine.rides
    engine.rides = lambda model, tokens, *args, **views: (widths.append(len(tokens)),
                                                          rides(model, tokens, *args, **views))[1]
    torch._dynamo.reset()
    serve.warm_up(engine)
    assert widths == [2] * 4 + [4] * 4 + [8] * 4  # (rows 2, 4, 8) x (cache lengths 128, 200) x 2
    widths.clear()
    reqs = [Request(p, 10) for p in ps]
    with torch.compiler.set_stance("fail_on_recompile"):
        run_all(engine, {0: reqs[:1], 3: reqs[1:4], 7: reqs[4:]})
    assert [r.out for r in reqs] == want
    assert set(widths) == {2, 4, 8}


def test_compile_caches_are_keyed_by_the_traced_code(tmp_path):
    """A graph that other code cached brings that code's shape guards along (a float32 step split at
    16 rows: the warm-up's steps then compile again in the middle of serving), so compiled steps key
    torch.compile's on-disk caches by a hash of the sources they trace, beside the user's own tag."""
    import compile as compile_
    root = Path(compile_.__file__).resolve().parent
    same, edited = tmp_path / "same", tmp_path / "edited"
    for folder in (same, edited):
        folder.mkdir()
        for name in compile_.TRACED_SOURCES:
            shutil.copy(root / name, folder / name)
    source = (root / "thresholds.py").read_text()
    assert "tile_max_tokens: int = 64" in source
    (edited / "thresholds.py").write_text(source.replace("tile_max_tokens: int = 64", "tile_max_tokens: int = 48"))
    assert compile_.compile_cache_tag(same) == compile_.compile_cache_tag(root) != compile_.compile_cache_tag(edited)
    with torch.compiler.config.patch(cache_key_tag="mine"):  # (monkeypatch's undo deletes a config entry)
        serving(random_model(), 2, 32, compile=True)
        assert torch.compiler.config.cache_key_tag == "mine:" + compile_.compile_cache_tag()


def occupy(engine: Engine, streams: int, prompt_len: int) -> tuple[list, Request]:
    """`streams` requests decoding (40 tokens in, their blocks taken), then a prompt of prompt_len
    tokens not yet fed, all running: (the streams, the prompt)."""
    scheduler, blocks = engine.scheduler, engine.blocks
    running = []
    for i in range(streams):
        stream = Request([1] * 40, 100, Sampling())
        stream.out, stream.fed, stream.blocks = [2], 40, blocks.allocate(blocks.blocks_for(41))
        running.append(stream)
    prompt = Request([3] * prompt_len, 4, Sampling())
    for i, req in enumerate(running + [prompt]):
        req.admitted = i + 1
    scheduler.running.extend(running + [prompt])
    return running, prompt


def prompt_rides(plan, req: Request) -> list:
    """The positions of req's tokens that ride in the plan's one forward."""
    return [pos for (_, pos, _), r in zip(plan.rides, plan.requests) if r is req]


def test_prompt_rows_fill_the_step_at_short_positions_only():
    """Beside 8 decoding streams, a prompt's start fills the step (its rows cost little beside the
    weights' read), while rows 1,500 positions in (each reading its keys apart) ride 8 at a time."""
    engine = serving(random_model(device=TEST_DEVICE), 9, 2100, fused_rows=64)
    streams, long = occupy(engine, 8, 2000)
    for fed, rows in [(0, 56), (1500, 8)]:
        long.fed = fed  # with the blocks of what it has fed
        long.blocks += engine.blocks.allocate(max(0, engine.blocks.blocks_for(fed) - len(long.blocks)))
        plan = engine.scheduler.schedule()
        assert plan.requests[:8] == streams and plan.wants[:8] == list(range(8)) and not plan.chunks
        assert [pos for _, pos, _ in plan.rides[:8]] == [40] * 8
        assert len(plan.rides) == 8 + rows and prompt_rides(plan, long) == list(range(fed, fed + rows))


def test_a_prompt_takes_a_chunk_where_a_full_step_leaves_a_row_or_two():
    """Beside 15 streams in a 16-row step, a prompt is prefilled in a chunk of its own rather than
    one row per step; a short remainder still rides in the step."""
    engine = serving(random_model(device=TEST_DEVICE), 16, 300, fused_rows=16, prefill_chunk=64)
    streams, new = occupy(engine, 15, 200)
    plan = engine.scheduler.schedule()
    assert plan.requests == streams and len(plan.rides) == 15
    assert plan.chunk_requests == [new] and [(len(t), s) for t, s, *_ in plan.chunks] == [(64, 0)]
    new.fed = 199  # its last token
    plan = engine.scheduler.schedule()
    assert not plan.chunks and prompt_rides(plan, new) == [199] and plan.wants[-1] == len(plan.rides) - 1


def test_prefix_reuse():
    """A request that shares a finished request's beginning finds its full blocks in the prefix
    cache (its output's too) and prefills only the rest, with the same output as a cold run; a
    request with nothing in common takes fresh blocks first, leaving the cached ones cached."""
    model = random_model(device=TEST_DEVICE)
    base = prompts(1, seed=2)[0] + list(range(40))
    engine = serving(model, 2, 128)
    bs = engine.blocks.block_size
    first = Request(base, 6)
    run_all(engine, {0: [first]})
    assert first.cached_tokens == 0
    fed = len(base) + len(first.out) - 1  # the last sampled token was never fed
    other = Request(prompts(1, seed=9)[0], 6)  # nothing in common: fresh blocks, not the cached ones
    run_all(engine, {0: [other]})
    assert other.cached_tokens == 0 and not set(other.blocks) & set(first.blocks[:fed // bs])
    follow = base + first.out + [7, 8, 9]  # a second turn: the conversation so far, then more
    second = Request(follow, 6)
    run_all(engine, {0: [second]})
    assert second.cached_tokens == fed // bs * bs > len(base)  # every full block, output included
    assert second.blocks[:fed // bs] == first.blocks[:fed // bs]  # the very blocks the first one wrote
    assert second.out == alone(model, follow, 6)
    assert engine.counters["cached_tokens"] == engine.counters["prefix_hits"] == second.cached_tokens
    assert engine.counters["prefilled_tokens"] == len(base) + len(other.prompt) + len(follow) - second.cached_tokens
    same = Request(list(base), 6)  # the whole prompt cached: its last token (and block) is fed again
    run_all(engine, {0: [same]})
    assert same.cached_tokens == (len(base) - 1) // bs * bs >= len(base) - bs and same.out == first.out


def test_prompt_logprobs_as_eval():
    """A request that asks for its prompt's logprobs (serve.py's echo) scores every prompt token as
    eval.py does (the window's logits, log-softmax), in chunks beside a decoding request (never riding
    with it), not from the prefix cache that holds its prompt, and again after a preemption mid-prompt;
    with max_new_tokens 0 it ends once its prompt is fed, with no output."""
    import eval as ev
    model = random_model(device=TEST_DEVICE)
    prompt = prompts(1, seed=4)[0] + list(range(50))
    logits = ev.window_logits(Engine(copy.deepcopy(model), 1, 128, prefix_caching=False), prompt, 0)
    targets = torch.tensor(prompt[1:], device=logits.device).view(-1, 1)
    expected = torch.log_softmax(logits[:-1].float(), -1).gather(1, targets).view(-1)
    engine = serving(model, 4, 128, fused_rows=16, prefill_chunk=16)
    run_all(engine, {0: [Request(list(prompt), 2)]})  # its blocks are cached now
    decoding, scored = Request(prompts(1, seed=5)[0], 40), Request(list(prompt), 0, prompt_logprobs=2)
    rode, schedule = [], engine.scheduler.schedule
    engine.scheduler.schedule = lambda: (p := schedule(), rode.append(scored in p.requests))[0]
    engine.submit(decoding)
    while not decoding.out:
        engine.step()
    engine.submit(scored)
    while scored.fed == 0:
        engine.step()
    assert len(scored.prompt_token_logprobs) == scored.fed < len(prompt) - 1
    engine.scheduler.preempt(scored)  # mid-prompt: it starts again from its first token
    for _ in range(100):
        if not engine.step():
            break
    assert scored.preemptions == 1 and scored.cached_tokens == 0 and not any(rode)
    assert scored.finish_reason == "length" and scored.out == [] and decoding.finish_reason
    got = [lp for lp, _ in scored.prompt_token_logprobs]
    assert len(got) == len(prompt) - 1 and got == pytest.approx(expected.tolist(), abs=1e-4)
    assert all(len(top) == 2 and top[0][1] >= lp for lp, top in scored.prompt_token_logprobs)


@pytest.mark.parametrize("compiled", [False, True])
def test_shared_beginning_computed_once(compiled):
    """Requests that arrive together with one long beginning (a system prompt) compute it once:
    the others wait for its blocks (scheduler.waits_for_others) and find them in the prefix cache;
    a request that arrives while the first one decodes finds the blocks that request still holds.
    Each one's greedy tokens are its solo run's, and the shared tokens count as cached."""
    model = random_model(device=TEST_DEVICE)
    system = prompts(1, seed=5)[0] + list(range(40, 80))
    ps = [system + [200 + i] + list(range(i, i + 5)) for i in range(4)]
    want = [alone(model, p, 8) for p in ps]
    # chunks of up to 256 tokens (for_serving's): room for every prompt in one step, so that only
    # waiting keeps the others from computing the system prompt too
    engine = serving(kernels.install(copy.deepcopy(model)), 4, 128, compile=compiled)
    reqs = [Request(p, 8) for p in ps]
    shared = len(system) // engine.blocks.block_size  # the system prompt's full blocks
    fed = collections.Counter()  # position -> times its keys were computed, for the system prompt's blocks
    busy = []  # when the fourth request joined: whether a running request held the blocks it found
    schedule = engine.scheduler.schedule

    def watch():
        plan = schedule()
        for pos in [pos for _, pos, _ in plan.rides] + [p for t, s, *_ in plan.chunks for p in range(s, s + len(t))]:
            if pos < shared * engine.blocks.block_size:
                fed[pos] += 1
        if reqs[3] in engine.scheduler.running and not busy:
            busy.append(min(engine.blocks.refs[b] for b in reqs[3].blocks[:shared]) > 1)
        return plan

    engine.scheduler.schedule = watch
    run_all(engine, {0: reqs[:3], 6: reqs[3:]})
    assert [r.out for r in reqs] == want
    cached = shared * engine.blocks.block_size
    assert cached >= len(system) - engine.blocks.block_size
    assert [r.cached_tokens for r in reqs] == [0] + [cached] * 3
    assert all(r.blocks[:shared] == reqs[0].blocks[:shared] for r in reqs[1:])  # one copy of the blocks
    assert set(fed.values()) == {1} and len(fed) == cached, fed  # each position of them computed once
    assert engine.counters["prefilled_tokens"] == sum(len(p) for p in ps) - 3 * cached
    assert engine.counters["cached_tokens"] == engine.counters["prefix_hits"] == 3 * cached
    assert busy == [True]  # the fourth found blocks that a running request held


def test_sampling_per_request():
    """Seeded requests give the same tokens alone and beside others; greedy rows stay greedy."""
    model = random_model(device=TEST_DEVICE)
    p = prompts(3, seed=3)
    hot = Sampling(temperature=0.8, top_k=50, top_p=0.9)

    def seeded():
        return Request(p[0], 10, hot, seed=1234)

    engine = serving(model, 3, 128)
    a = seeded()
    run_all(engine, {0: [a]})
    b, greedy, other = seeded(), Request(p[1], 10), Request(p[2], 10, hot)
    run_all(engine, {0: [other, greedy], 2: [b]})
    assert a.out == b.out
    assert greedy.out == alone(model, p[1], 10)
    c = Request(p[0], 10, hot, seed=99)
    run_all(engine, {0: [c]})
    assert c.out != a.out


def test_sample_rows():
    torch.manual_seed(0)
    logits = torch.randn(4, 100)
    params = [Sampling(), Sampling(1.0, top_k=1), Sampling(1.0, top_p=1e-6), Sampling(0.7)]
    ids = sample_rows(logits, params, [None] * 4)
    assert ids[:3].tolist() == logits[:3].argmax(-1).tolist()
    # the frequencies of a sampled row follow its distribution (top-k 3 at temperature 1)
    draws = torch.stack([sample_rows(logits[:1], [Sampling(1.0, top_k=3)], [None]) for _ in range(3000)]).view(-1)
    top3 = logits[0].topk(3)
    want = torch.softmax(top3.values, -1)
    got = torch.stack([(draws == i).float().mean() for i in top3.indices])
    assert set(draws.tolist()) <= set(top3.indices.tolist())
    assert torch.allclose(got, want, atol=0.04)


def test_stop_cancel_and_faults():
    model = random_model(device=TEST_DEVICE)
    p = prompts(4, seed=4)
    engine = serving(model, 2, 80, max_waiting=2)
    want = alone(model, p[0], 8)
    stopper = Request(p[0], 8, stop_ids=frozenset([want[3]]))
    broken = Request(p[1], 8, on_token=lambda r, t: 1 / 0 if len(r.out) == 2 else False)
    run_all(engine, {0: [stopper, broken]})
    assert stopper.out == want[:want.index(want[3]) + 1] and stopper.finish_reason == "stop"
    assert broken.finish_reason == "error" and "ZeroDivisionError" in broken.error and len(broken.out) == 2
    # a cancelled request frees its row and blocks at the next step; one waiting is admitted at once
    long1, long2, queued = Request(p[2], 20), Request(p[3], 20), Request(p[0], 4)
    for r in (long1, long2):
        engine.submit(r)
    engine.step()
    engine.submit(queued)
    engine.step()
    assert engine.scheduler.running == [long1, long2] and list(engine.scheduler.waiting) == [queued]
    engine.cancel(long1)
    engine.step()
    assert long1.finish_reason == "cancelled" and engine.scheduler.running == [long2, queued]
    assert engine.counts() == (2, 0) and all(engine.blocks.refs[b] == int(b in queued.blocks) for b in long1.blocks)
    # the queue is bounded; requests that can never fit are refused
    engine.submit(Request(p[0], 4))
    engine.submit(Request(p[0], 4))
    with pytest.raises(QueueFull):
        engine.submit(Request(p[0], 4))
    with pytest.raises(UserError, match="exceeds the KV cache"):
        engine.submit(Request(p[0], 80))
    with pytest.raises(UserError, match="empty"):
        engine.submit(Request([], 4))


def test_forward_fault_ends_its_requests():
    """An exception in a step's forward pass ends the requests in it; the engine goes on."""
    model = random_model(device=TEST_DEVICE)
    engine = serving(model, 2, 64)
    a = Request(prompts(1)[0], 6)
    engine.submit(a)
    real = engine.run
    engine.run = lambda plan, fly=False: (_ for _ in ()).throw(RuntimeError("boom"))
    engine.step()
    assert a.finish_reason == "error" and "boom" in a.error
    engine.run = real
    b = Request(prompts(1)[0], 6)
    run_all(engine, {0: [b]})
    assert b.out == alone(model, b.prompt, 6)
