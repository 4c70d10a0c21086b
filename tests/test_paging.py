"""The paged KV cache: blocks and their reference counts, the prefix cache and its eviction, the
scheduler's decisions (plain Python), preemption, sliding windows over blocks, and paged attention
against the contiguous reference."""
import copy

import pytest
import torch

import kernels
from blocks import ROOT, BlockManager, block_key
from conftest import TEST_DEVICE, random_model
from engine import Engine
from errors import UserError
from kvcache import ForwardBatch
from sampling import Sampling
from scheduler import Request, Scheduler

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- blocks

def test_blocks_are_handed_out_and_counted():
    m = BlockManager(4, 2)
    a = m.allocate(3)
    assert len(set(a)) == 3 and m.free_count() == 1 and m.allocate(2) is None and m.free_count() == 1
    m.acquire(a[:1])  # a second holder
    m.release(a)
    assert m.refs[a[0]] == 1 and m.free_count() == 3
    m.release(a[:1])
    assert m.free_count() == 4 and m.used_count() == 0


def test_full_blocks_are_found_by_their_content_and_prefix():
    m = BlockManager(8, 2)
    tokens = [5, 6, 7, 8, 9]
    blocks = m.allocate(3)
    key0 = m.seal(blocks[0], ROOT, tokens[0:2])
    m.seal(blocks[1], key0, tokens[2:4])
    assert m.match(tokens) == ([blocks[0], blocks[1]], block_key(key0, tokens[2:4]))
    assert m.match([5, 6, 7, 0])[0] == [blocks[0]]  # the second block differs
    assert m.match([6, 6, 7, 8])[0] == []  # the same block, after another beginning: another key
    assert m.match([5])[0] == []  # whole blocks only


def test_released_blocks_stay_cached_until_needed_least_recent_first():
    m = BlockManager(3, 1)
    a, b = m.allocate(1)[0], m.allocate(1)[0]
    ka = m.seal(a, ROOT, [1])
    kb = m.seal(b, ROOT, [2])
    m.release([a])
    m.release([b])  # a was released first: the older idle block
    assert m.match([1, 0])[0] == [a] and m.match([2, 0])[0] == [b]
    (fresh,) = m.allocate(1)  # the never-used block goes first
    assert fresh not in (a, b) and m.match([1, 0])[0] == [a]
    (evicted,) = m.allocate(1)  # then the least recently released cached one, forgetting its content
    assert evicted == a and m.match([1, 0])[0] == [] and m.match([2, 0])[0] == [b]
    m.acquire([b])  # a cached block taken again leaves the idle list
    assert m.allocate(1) is None and kb == m.key[b] and ka not in m.by_key


# ---------------------------------------------------------------- the scheduler (no model)

def scheduler(num_blocks=8, block_size=4, rows=4, **options) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), rows, **options)


def test_a_request_starts_on_the_cached_blocks_of_its_beginning():
    s = scheduler()
    first = Request(list(range(10)), 4)
    s.add(first)
    plan = s.schedule()
    assert [r for r in plan.chunk_requests] == [first] and plan.chunks[0][:2] == (list(range(10)), 0)
    s.postprocess(plan, {first: 10}, {first: 99})
    held = list(first.blocks)
    s.finish(first, "stop")  # its two full blocks stay cached
    second = Request(list(range(9)) + [42], 4)
    s.add(second)
    plan = s.schedule()
    assert second.cached_tokens == 8 and second.blocks[:2] == held[:2]
    assert plan.chunks[0][:2] == ([8, 42], 8)  # only what the cache lacks
    assert s.counters["prefix_hits"] == 8


def test_the_last_token_is_always_fed():
    """A prompt whose every block is cached still feeds its last token, whose logits it needs."""
    s = scheduler()
    first = Request(list(range(8)), 4)
    s.add(first)
    s.postprocess(s.schedule(), {first: 8}, {first: 1})
    s.finish(first, "stop")
    again = Request(list(range(8)), 4)
    s.add(again)
    plan = s.schedule()
    assert again.cached_tokens == 4 and plan.chunks[0][:2] == ([4, 5, 6, 7], 4)


def test_a_request_waits_for_the_one_computing_its_beginning():
    """Two requests that arrive together with one long beginning: the second waits while the first
    computes it, then finds it cached (computed once)."""
    s = scheduler(num_blocks=16, prefill_chunk=4)
    shared = list(range(100, 112))
    a, b = Request(shared + [1, 2], 2), Request(shared + [3, 4, 5], 2)
    s.add(a)
    s.add(b)
    plan = s.schedule()
    assert plan.chunk_requests == [a]  # b waits
    s.postprocess(plan, {a: 4}, {})
    plan = s.schedule()
    assert plan.chunk_requests == [a]
    s.postprocess(plan, {a: 4}, {})
    s.postprocess(s.schedule(), {a: 4}, {})  # a has fed its three shared blocks
    for _ in range(3):
        plan = s.schedule()
        if b in plan.chunk_requests:
            break
        s.postprocess(plan, {a: 2}, {a: 9})
    assert b in plan.chunk_requests and b.cached_tokens == 12 and b.blocks[:3] == a.blocks[:3]
    assert s.counters["prefix_hits"] == 12


def run_to_the_end(s: Scheduler) -> int:
    """Every step of s as the engine would run it (each request's next token 7); the most blocks in use."""
    peak = 0
    while s.has_work():
        plan = s.schedule()
        peak = max(peak, s.blocks.used_count())
        fed = {r: plan.requests.count(r) for r in plan.requests}
        fed.update({r: len(tokens) for r, (tokens, *_) in zip(plan.chunk_requests, plan.chunks)})
        done = [r for r, (tokens, start, *_) in zip(plan.chunk_requests, plan.chunks) if start + len(tokens) == len(r.known())]
        s.postprocess(plan, fed, {r: 7 for r in [plan.requests[i] for i in plan.wants] + done})
    return peak


@pytest.mark.parametrize("fused_rows", [0, 16])
def test_requests_that_share_a_system_prompt_hold_it_once(fused_rows):
    """Eight requests arrive together with one 8-block system prompt and a question of a block each:
    the blocks in use never pass the prompt once plus each request's own (question and output)."""
    s = scheduler(num_blocks=80, rows=8, prefill_chunk=8, fused_rows=fused_rows)
    system = list(range(100, 132))
    requests = [Request(system + [i] * 4, 4) for i in range(8)]
    for r in requests:
        s.add(r)
    assert run_to_the_end(s) <= 8 + 8 * 2
    assert all(len(r.out) == 4 for r in requests) and s.counters["prefix_hits"] == 7 * 32


def test_running_out_of_blocks_preempts_the_newest_request():
    s = scheduler(num_blocks=4, block_size=2, rows=2)
    old, new = Request([1, 2, 3, 4], 4), Request([7, 8, 9, 10], 4)
    s.add(old)
    s.add(new)
    plan = s.schedule()
    s.postprocess(plan, {old: 4, new: 4}, {old: 4, new: 10})  # each holds 2 full blocks
    plan = s.schedule()  # both need a third block: the newest gives its blocks to the oldest
    assert [r for r in plan.requests] == [old] and s.waiting[0] is new and new.fed == 0
    assert new.preemptions == 1 and s.counters["preemptions"] == 1 and len(old.blocks) == 3


def test_decoding_groups_take_turns_and_a_step_in_flight_is_not_planned_again():
    """With group_rows (pipeline parallelism's decoding groups) a plan takes a group of the decoding
    requests and the next the others, while the first's step is in flight; a group steps again once
    its step is post-processed; a request left alone waits for the others, to step beside them."""
    s = scheduler(num_blocks=40, rows=4)
    s.group_rows = lambda running: running // 2 if running >= 4 else running
    requests = [Request([i] * 3, 8) for i in range(4)]
    for r in requests:
        s.add(r)
    plan = s.schedule()  # the prompts, post-processed at once
    s.postprocess(plan, {r: 3 for r in requests}, {r: 7 for r in requests})
    a, b = s.schedule(), s.schedule()
    assert a.requests == requests[:2] and b.requests == requests[2:] and s.schedule().empty()
    s.postprocess(a, {r: 1 for r in a.requests}, {r: 7 for r in a.requests})
    a = s.schedule()
    assert a.requests == requests[:2] and all(r.fed == 4 for r in a.requests)
    s.finish(requests[2], "stop")
    s.postprocess(b, {r: 1 for r in b.requests}, {r: 7 for r in b.requests})
    assert s.schedule().empty()  # requests[3] alone waits for the group in flight
    s.postprocess(a, {r: 1 for r in a.requests}, {r: 7 for r in a.requests})
    assert s.schedule().requests == [requests[3], *requests[:2]] and requests[3].fed == 4


def test_a_request_too_large_for_the_cache_is_refused_with_the_figures():
    s = scheduler(num_blocks=4, block_size=4)
    with pytest.raises(UserError, match=r"need 5 KV cache blocks of 4 tokens; the cache has 4"):
        s.add(Request(list(range(10)), 10))


def test_sliding_layers_give_back_the_blocks_out_of_their_window():
    s = scheduler(num_blocks=16, block_size=4, window=6)
    req = Request(list(range(20)), 2)
    s.add(req)
    s.postprocess(s.schedule(), {req: 20}, {req: 7})
    # the next token (position 20) sees positions 15-20: blocks 0-2 (positions 0-11) are gone
    assert req.blocks[:3] == [-1, -1, -1] and all(b >= 0 for b in req.blocks[3:])
    assert s.blocks.used_count() == len(req.blocks) - 3


# ---------------------------------------------------------------- the engine

def greedy(engine: Engine, prompts: list, n: int) -> list:
    return engine.generate(prompts, n, Sampling())[0]


def test_prefix_hits_give_the_same_tokens_and_copy_nothing():
    model = random_model(device=TEST_DEVICE)
    engine = Engine(kernels.install(copy.deepcopy(model)), 2, 128)
    prompt = list(range(3, 60))
    (cold,) = greedy(engine, [prompt], 12)
    used = engine.blocks.used_count()
    (hot,), stats = engine.generate([prompt], 12, Sampling())
    assert hot == cold and stats.cached_tokens == 48 and used == 0
    # two requests with one beginning hold its blocks once
    a, b = Request(prompt + [1], 8, Sampling()), Request(prompt + [2], 8, Sampling())
    engine.submit(a)
    engine.submit(b)
    engine.step()
    assert a.blocks[:3] == b.blocks[:3] and engine.blocks.refs[a.blocks[0]] == 2


@pytest.mark.parametrize("arch", [{}, dict(sliding_window=8, architecture="mistral"),
                                  dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"])],
                         ids=["llama", "sliding", "mixed"])
def test_preempted_requests_resume_with_the_same_tokens(arch):
    """A cache too small for three requests at once: they run in turns (preempted, fed again), and
    each gives the tokens it gives alone."""
    model = random_model(device=TEST_DEVICE, **arch)
    prompts = [list(range(3, 40)), list(range(40, 58)), [5, 6, 7]]
    alone = [greedy(Engine(copy.deepcopy(model), 1, 128), [p], 30)[0] for p in prompts]
    engine = Engine(copy.deepcopy(model), 3, 128, kv_tokens=80, prefill_chunk=16)
    assert greedy(engine, prompts, 30) == alone
    assert engine.counters["preemptions"] > 0 and engine.blocks.used_count() == 0


def test_sliding_window_holds_its_window_only():
    """An all-sliding model decoding far past its window holds about a window of blocks."""
    model = random_model(device=TEST_DEVICE, sliding_window=8, architecture="mistral")
    engine = Engine(model, 1, 256)
    peak = []
    engine.scheduler.postprocess = (lambda post: lambda *a: (post(*a), peak.append(engine.blocks.used_count())))(
        engine.scheduler.postprocess)
    greedy(engine, [list(range(3, 50))], 150)
    assert max(peak[1:]) <= 8 // 16 + 2, peak  # the window and the block being written


def test_paged_attention_equals_contiguous_rows_in_float64():
    """The same tokens through a block table scattered over the pool and through contiguous rows."""
    model = random_model(device=TEST_DEVICE).double()
    tokens = torch.randint(0, 256, (2, 12), device=TEST_DEVICE)
    model.setup_caches(2, 48)
    want = model(tokens, torch.arange(12, device=TEST_DEVICE))
    model.setup_caches(1, 48, num_slots=64, block_size=4)
    table = torch.tensor([[9, 2, 14], [1, 12, 5]], device=TEST_DEVICE)
    positions = torch.arange(12, device=TEST_DEVICE).expand(2, -1)
    slots = table.gather(1, positions // 4) * 4 + positions % 4
    got = model(tokens, ForwardBatch(positions, slots, table, 4, 12))
    torch.testing.assert_close(got, want[:, :, :], atol=1e-10, rtol=0)


def test_a_prompt_larger_than_the_cache_is_a_user_error():
    engine = Engine(random_model(), 1, 64, kv_tokens=32)
    with pytest.raises(UserError, match="KV cache"):
        engine.generate([list(range(40))], 8, Sampling())


# ---------------------------------------------------------------- the prefix cache on disk

def test_a_restarted_engine_loads_the_prompt_blocks_from_disk(tmp_path, capfd):
    from conftest import save_checkpoint
    from prompt_store import open_store
    model = random_model(device=TEST_DEVICE)
    ckpt = save_checkpoint(model, tmp_path / "ckpt")
    prompt = list(range(3, 60))
    first = Engine(copy.deepcopy(model), 1, 128)
    store = open_store(tmp_path / "cache", ckpt, first.model, first)
    (cold,), stats = first.generate([prompt], 8, Sampling())
    files = sorted(store.folder.glob("*.safetensors"))
    assert stats.cached_tokens == 0 and len(files) == 3  # the prompt's three full blocks
    again = Engine(copy.deepcopy(model), 1, 128)  # a new process, as far as the cache knows
    open_store(tmp_path / "cache", ckpt, again.model, again)
    (hot,), stats = again.generate([prompt], 8, Sampling())
    assert hot == cold and stats.cached_tokens == 48
    files[1].write_bytes(b"not a block")  # a damaged file: skipped with a warning, the rest computed
    third = Engine(copy.deepcopy(model), 1, 128)
    open_store(tmp_path / "cache", ckpt, third.model, third)
    (out,), stats = third.generate([prompt], 8, Sampling())
    assert out == cold and stats.cached_tokens == 16 and "skipped" in capfd.readouterr().err


def test_the_disk_cache_keeps_under_its_size(tmp_path):
    from conftest import save_checkpoint
    from prompt_store import open_store
    model = random_model(device=TEST_DEVICE)
    engine = Engine(model, 1, 256)
    store = open_store(tmp_path / "cache", save_checkpoint(model, tmp_path / "ckpt"), model, engine, max_bytes=1)
    engine.generate([list(range(3, 100))], 4, Sampling())
    assert len(list(store.folder.glob("*.safetensors"))) <= 1
