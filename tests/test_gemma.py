"""Gemma family: sliding windows over the paged KV cache (every position kept in blocks, keys
outside a query's window masked), chat and compile with them, Gemma 3's multimodal checkpoint, and
the real Gemma 3 270M (GGUF) against transformers: logits, tokenizer, golden output.

Tiny random Gemma 1/2/3 parity with transformers (prefill, cached decode, greedy tokens, windows
shorter than prompt and generation) is in tests/test_hf_parity.py.

Run: python -m pytest -q tests/test_gemma.py        (add -m slow for the transformers GGUF logits)
     PYTHONPATH=. python tests/test_gemma.py --update-golden
                                  (rewrites tests/golden/gemma3-270m.json, checked against
                                   transformers' greedy generate)
"""
import copy
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

import kernels
from conftest import ROOT, TEST_DEVICE, on_test_device, random_model, run_script
from engine import Chat, Engine
from loading import load_model
from memory import kv_cache_bytes
from kvcache import ForwardBatch
from model import ModelArgs, Transformer
from sampling import Sampling

GEMMA3 = ROOT / "checkpoints" / "gemma3-270m"
GOLDEN = Path(__file__).parent / "golden" / "gemma3-270m.json"
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
WINDOW = 8


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


def tiny_gemma3(seed=0, **overrides):
    """A random Gemma 3-shaped model: sliding and global layers, every Gemma field switched on."""
    cfg = dict(architecture="gemma3", n_layers=3, n_kv_heads=1, head_dim=32, hidden_act="gelu_tanh",
               sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
               norm_weight_offset=1.0, embedding_scale=8.0, query_pre_attn_scalar=24.0, post_norms=True,
               qk_norm=True, rope_theta=1e6, rope_local_theta=1e4, attn_logit_softcapping=20.0,
               tie_word_embeddings=True)
    cfg.update(overrides)
    return random_model(seed=seed, **cfg)


BLOCK = 4  # tokens a block in the paged tests below: a window (8) spans several blocks


def scattered_tables(rows: int, blocks_per_row: int, seed: int = 0) -> tuple[torch.Tensor, int]:
    """Block tables (rows, blocks_per_row) of distinct blocks taken at random from a pool with room
    to spare, as an engine that has run a while hands them out; and the pool's size in blocks."""
    num_blocks = rows * blocks_per_row + 5
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    return perm[:rows * blocks_per_row].view(rows, blocks_per_row), num_blocks


def paged_batch(positions: torch.Tensor, table: torch.Tensor, kv_len: int, device) -> ForwardBatch:
    """Rows at positions (B, T), each in the blocks of its table (B, blocks), reading up to kv_len."""
    slots = table.gather(1, positions // BLOCK) * BLOCK + positions % BLOCK  # (B, T)
    return ForwardBatch(positions.to(device), slots.to(device), table.to(device), BLOCK, kv_len)


@torch.inference_mode()
def paged_against_alone(paged, alone, chunks: list, lead: int = 5) -> tuple[float, torch.Tensor]:
    """Two sequences fed in chunks as one batch through `paged`'s slot pool, each row in blocks
    scattered over it, row 1 `lead` tokens ahead of row 0 (its own positions, no padding); against
    each sequence alone through `alone`'s contiguous cache (model(tokens, input_pos)). Returns the
    largest difference of their logits, and row 1's last logits alone."""
    device = paged.norm.weight.device
    S = lead + sum(chunks)
    table, num_blocks = scattered_tables(2, -(-S // BLOCK))
    paged.setup_caches(1, S, num_slots=num_blocks * BLOCK, block_size=BLOCK)
    ref = [alone, copy.deepcopy(alone)]  # a cache for each sequence
    for m in ref:
        m.setup_caches(1, S)
    seqs = torch.randint(0, 256, (2, S), generator=torch.Generator().manual_seed(0))
    head = torch.arange(lead).view(1, -1)  # row 1's first tokens, alone in a step
    got = paged(seqs[1:, :lead], paged_batch(head, table[1:], lead, device))
    worst = (got - ref[1](seqs[1:, :lead], head[0])).abs().max().item()
    pos = 0
    for n in chunks:
        positions = torch.stack([torch.arange(pos, pos + n), torch.arange(lead + pos, lead + pos + n)])  # (2, n)
        ids = seqs.gather(1, positions)  # (2, n)
        got = paged(ids, paged_batch(positions, table, lead + pos + n, device))
        for b in range(2):
            want = ref[b](ids[b:b + 1], positions[b])
            worst = max(worst, (got[b:b + 1] - want).abs().max().item())
        pos += n
    return worst, want


@pytest.mark.parametrize("fast_paths", [False, True], ids=["reference", "kernels-installed"])
@pytest.mark.parametrize("chunks", [[40], [3, 9, 1, 1, 20, 1, 1, 1], [8, 8, 1, 16, 1], [1] * 24])
def test_paged_cache_with_window_mask_matches_each_row_alone(chunks, fast_paths):
    """Prefill chunks longer than, equal to and shorter than the window, then single decode steps,
    for a batch of two rows at their own positions (one 5 tokens ahead), each in blocks scattered
    over the slot pool: the logits of each sequence alone through a contiguous cache, within
    float32 rounding. Sliding layers keep every position (as large a pool as the global layer's);
    the window is the mask's. Also with kernels.py's paths, whose `attend` reads the slots in place."""
    paged, alone = on_test_device(tiny_gemma3()), on_test_device(tiny_gemma3())
    if fast_paths:
        kernels.install(paged)
    worst, last = paged_against_alone(paged, alone, chunks)
    assert paged.layers[0].attention.sliding and not paged.layers[1].attention.sliding
    assert paged.layers[0].attention.kv_cache.k_cache.shape == paged.layers[1].attention.kv_cache.k_cache.shape
    assert last.std() > 0.5
    assert worst <= 1e-4, f"paged batch vs each row alone: max abs diff {worst:.2e}"  # logits ~20: float32 rounding


def test_window_mistake_is_caught():
    # the comparison above must be able to fail: a window one too wide changes the logits
    worst, _ = paged_against_alone(tiny_gemma3(), tiny_gemma3(sliding_window=WINDOW + 1), [30])
    assert worst > 1e-3


def cache_bytes(model) -> int:
    return sum(b.numel() * b.element_size() for n, b in model.named_buffers() if "cache" in n)


def gemma3_270m_args() -> ModelArgs:
    return ModelArgs(architecture="gemma3", vocab_size=262144, dim=640, n_layers=18, n_heads=4, n_kv_heads=1,
                     head_dim=256, intermediate_size=2048, sliding_window=512, hidden_act="gelu_tanh",
                     layer_types=["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(18)],
                     tie_word_embeddings=True, post_norms=True, qk_norm=True, norm_weight_offset=1.0)


def test_gemma3_270m_kv_cache_keeps_every_position_and_is_what_the_preflight_counts():
    """Gemma 3 270M's KV cache at 4k and 32k tokens (meta tensors: nothing is allocated). Sliding
    layers keep every position in their blocks (their window is a mask), so every layer's pool
    grows with the tokens; the memory preflight (memory.kv_cache_bytes, which Engine.allocate
    checks before allocating) counts exactly what setup_caches allocates. The figures:
    python -m pytest -q -s tests/test_gemma.py -k kv_cache_keeps_every_position"""
    with torch.device("meta"):
        model = Transformer(gemma3_270m_args())
    sizes = {}
    per_position = 2 * 1 * 256 * 2  # k and v, 1 KV head, head_dim 256, bf16
    for length in (4096, 32768):
        model.setup_caches(1, length, dtype=torch.bfloat16, device="meta")
        sizes[length] = cache_bytes(model)
        assert sizes[length] == 18 * length * per_position  # every layer, every position
        assert kv_cache_bytes(model, 1, length, torch.bfloat16) == sizes[length]
    print(f"Gemma 3 270M KV cache at 32768 tokens, bf16, batch 1: {sizes[32768] / 2**20:.1f} MiB")


class CharTokenizer:
    """Just enough of tokenizer.Tokenizer for Chat: one token per character (ids < 128 are ASCII,
    the rest map to other code points, so any ids decode and re-encode exactly), a plain template.
    marked_replies: the template writes replies as "A:" + text, so the rendered history no longer
    starts with the cached tokens (a rewind)."""
    eos_ids = []

    def __init__(self, marked_replies=False):
        self.marked_replies = marked_replies

    def encode(self, text, add_bos=None):
        return [ord(c) if ord(c) < 128 else ord(c) - 0x100 for c in text]

    def decode(self, ids):
        return "".join(chr(i) if i < 128 else chr(i + 0x100) for i in ids)

    def apply_chat_template(self, messages):
        mark = "A:" if self.marked_replies else ""
        return "".join(f"<{m['role']}>{mark if m['role'] == 'assistant' else ''}{m['content']}\n"
                       for m in messages) + "<assistant>"


@pytest.mark.parametrize("marked_replies", [False, True])
def test_chat_with_sliding_window_equals_reprefill(marked_replies):
    """A chat with sliding-window layers, whose blocks leave the cache once out of their window: no
    prefix is cached (a later turn could not find the keys its sliding layers need), every turn
    prefills the whole conversation, and the replies equal those of a chat that forgets its cache
    every turn."""
    reuse_engine, fresh_engine = Engine(tiny_gemma3(), 1, 512), Engine(tiny_gemma3(), 1, 512)
    tok = CharTokenizer(marked_replies)
    reuse, fresh = Chat(reuse_engine, tok), Chat(fresh_engine, tok, reuse_cache=False)
    assert not reuse_engine.blocks.prefix_caching
    for turn in ["Hello there, how are you?", "Tell me more.", "And then?"]:
        a, _ = reuse.reply(turn, 20, Sampling())
        b, _ = fresh.reply(turn, 20, Sampling())
        assert a == b
        ids = tok.encode(tok.apply_chat_template(reuse.messages[:-1]))
        assert fresh.last_prefill_tokens == reuse.last_prefill_tokens == reuse.last_prompt_tokens == len(ids)


def test_compiled_decode_with_sliding_window_matches_eager():
    """A compiled decode step, with the CPU fast paths, over a prompt and a generation longer than
    the window gives the reference's greedy tokens."""
    model = tiny_gemma3(device=TEST_DEVICE)
    prompt = [list(range(3, 22))]  # longer than the window

    def greedy(engine):
        engine.setup(1, 64)
        (out,), _ = engine.generate(prompt, 24, Sampling())
        return out

    fast = kernels.install(copy.deepcopy(model))  # the CPU fast paths, against the reference
    assert greedy(Engine(fast, compile=True)) == greedy(Engine(model))


@torch.inference_mode()
def test_gemma3_multimodal_checkpoint_converts_its_text_decoder(tmp_path):
    import transformers
    from convert_hf import convert_hf_checkpoint
    text = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, sliding_window=16, query_pre_attn_scalar=24)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=300, boi_token_index=301, eoi_token_index=302)
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.15)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_model(convert_hf_checkpoint(tmp_path / "hf", tmp_path / "ours"))
    ours.setup_caches(1, 64)
    ids = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(0))  # text tokens only
    expected = hf(input_ids=ids).logits
    diff = (ours(ids, torch.arange(40)) - expected).abs().max().item()
    assert expected.std() > 0.5 and diff <= 1e-4, diff


# ---------------------------------------------------------------- the real Gemma 3 270M

@pytest.fixture(scope="module")
def gemma3_dir() -> Path:
    """Gemma 3 270M in our format (made by download.py if missing)."""
    if not (GEMMA3 / "model.safetensors").exists():
        r = run_script("download.py", "gemma3-270m")
        assert r.returncode == 0, f"cannot prepare gemma3-270m: {r.stderr.strip()[-500:]}"
    return GEMMA3


def test_gemma3_sentencepiece_tokenizer_fits_its_model(gemma3_dir):
    """The real Gemma 3 checkpoint: its tokenizer passes engine.check_vocabulary."""
    from rope import trained_context
    from loading import check_vocabulary
    from tokenizer import Tokenizer
    config = ModelArgs.from_json(gemma3_dir / "config.json")
    check_vocabulary(Tokenizer(gemma3_dir), config, gemma3_dir)
    assert trained_context(config) == config.max_position_embeddings


def gguf_path() -> Path:
    from download import fetch_gguf
    return fetch_gguf("gemma3-270m")


@pytest.fixture(scope="module")
def gemma3(gemma3_dir):
    from tokenizer import Tokenizer
    return load_model(gemma3_dir), Tokenizer(gemma3_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(gemma3_dir):
    """transformers' tokenizer for the GGUF. Building it takes ~25 s (it derives 500k merges), so
    its tokenizer.json is kept beside the downloaded models, keyed by the GGUF and transformers
    versions (written under a temporary name, then renamed)."""
    import transformers
    from download import cache_dir
    path = gguf_path()
    key = hashlib.sha256(f"{path.stat().st_size}-{transformers.__version__}".encode()).hexdigest()[:16]
    cached = cache_dir() / "test-oracles" / f"gemma3-270m-hf-tokenizer-{key}"
    if not (cached / "tokenizer.json").exists():
        tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
        transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(tmp)
        shutil.rmtree(cached, ignore_errors=True)
        tmp.rename(cached)
    return transformers.AutoTokenizer.from_pretrained(cached)


TOKENIZER_STRINGS = [
    "Hello world", "héllo wörld ñ Ünïcödé ẞ", "日本語のテキスト 中文 한국어", "Привет, мир! مرحبا नमस्ते",
    "emoji 😀👍🏽 🇫🇷 🧬 👨‍👩‍👧", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ｆｕｌｌｗｉｄｔｈ ﬁ", "a  b   c    d", "a" + " " * 40 + "b", " " * 70,
    "  leading and trailing  ", "lines\n\n\nand\ttabs\t\t\there\r\n", "\n" * 40,
    "def f(x):\n    return x ** 2  # square\n\nif __name__ == '__main__':\n\tprint(f(3))\n",
    "<div><b>bold</b></div> {\"json\": [1, 2.5e-3]}", "<bos>text<eos> <start_of_turn>user\nhi<end_of_turn>\n",
    "<pad><unk><mask> [multimodal]", "0.0000001 1e-9 2**64 3.14159", "\x00\x01\x7f control", "",
]


def test_gemma3_tokenizer_matches_transformers(gemma3, hf_tokenizer):
    """Our tokenizer.model, rebuilt from the GGUF and run by sentencepiece, against transformers'
    tokenizer for the same GGUF: same ids (with and without BOS) and the same decoded text."""
    _, tok = gemma3
    assert tok._sp is not None, "the Gemma checkpoint should use the SentencePiece backend"
    for s in TOKENIZER_STRINGS:
        ids = tok.encode(s, add_bos=False)
        assert ids == hf_tokenizer.encode(s, add_special_tokens=False), s
        assert tok.encode(s) == hf_tokenizer.encode(s), s
        assert tok.decode(ids) == hf_tokenizer.decode(ids) == s, s


@pytest.mark.slow
@torch.inference_mode()
def test_gemma3_270m_logits_match_transformers_gguf(gemma3):
    """Prefill (longer than the 512 window) and cached decode steps against transformers' GGUF loader."""
    import transformers
    model, _ = gemma3
    path = gguf_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    ids = torch.randint(0, 262144, (1, 540), generator=torch.Generator().manual_seed(0))
    ids[0, 0] = 2  # <bos>
    prompt = 530
    model.setup_caches(1, 1024)
    out = hf(ids[:, :prompt], use_cache=True)
    diffs = [(model(ids[:, :prompt], torch.arange(prompt)) - out.logits).abs().max().item()]
    for t in range(prompt, ids.shape[1]):
        out = hf(ids[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
        diffs.append((model(ids[:, t:t + 1], torch.tensor([t])) - out.logits).abs().max().item())
    print(f"gemma3-270m vs transformers GGUF: prefill {diffs[0]:.2e}, decode max {max(diffs[1:]):.2e}")
    assert max(diffs) <= 1e-4, diffs


def golden_outputs(model, cases):
    engine = Engine(model)
    outs = []
    for case in cases:
        engine.setup(1, 1024)  # > the 512 window: sliding layers mask the keys before it
        (out,), _ = engine.generate([case["prompt_ids"]], case["max_new_tokens"], Sampling(),
                                    stop_ids=model.args.eos_token_ids)
        outs.append(out)
    return outs


def test_golden_greedy_output_gemma3_270m(gemma3):
    # tests/golden/gemma3-270m.json was written by `python tests/test_gemma.py --update-golden` and
    # checked then against transformers' greedy generate on the same GGUF
    model, tok = gemma3
    cases = json.loads(GOLDEN.read_text())
    for case, out in zip(cases, golden_outputs(model, cases)):
        assert tok.encode(case["prompt"]) == case["prompt_ids"]
        assert out == case["output_ids"], case["prompt"][:40]
        assert tok.decode(out) == case["output_text"]


def long_prompt() -> str:
    # ~560 tokens, so the prefill chunk is longer than the 512-token window
    facts = [f"Fact {i}: the number {i} squared is {i * i}." for i in range(1, 49)]
    return " ".join(facts) + " Fact 49:"


def update_golden():
    import transformers
    from tokenizer import Tokenizer
    model, tok = load_model(GEMMA3), Tokenizer(GEMMA3)
    cases = [{"prompt": p, "max_new_tokens": n} for p, n in [
        ("Once upon a time, there was a little", 32), ("def fibonacci(n):", 32),
        ("The capital of France is", 16), (long_prompt(), 24)]]
    for case in cases:
        case["prompt_ids"] = tok.encode(case["prompt"])
    path = gguf_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    for case, out in zip(cases, golden_outputs(model, cases)):
        ids = torch.tensor([case["prompt_ids"]])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=case["max_new_tokens"],
                          do_sample=False, eos_token_id=model.args.eos_token_ids,
                          pad_token_id=0)[0, ids.shape[1]:].tolist()
        assert ref == out, (case["prompt"][:40], ref, out)
        case.update(output_ids=out, output_text=tok.decode(out))
        print(f"{len(case['prompt_ids'])} prompt tokens: {case['prompt'][-40:]!r} -> {case['output_text']!r}")
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(cases, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    if sys.argv[1:] == ["--update-golden"]:
        torch.set_num_threads(1)
        update_golden()
