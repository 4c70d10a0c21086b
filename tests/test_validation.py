"""Every input validated where it enters: a Hugging Face config.json of the wrong types or ranges,
an empty prompt, Ctrl-C, numeric flags out of range, a KV cache past the model's trained context,
and a tokenizer whose ids do not fit the weights. Each ends in one line (`error: ...`, exit 1) or,
for Ctrl-C, `interrupted` and exit 130: never a traceback."""
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import ROOT, device_flags, random_model, save_checkpoint
from convert_hf import hf_config_to_args
from loading import check_vocabulary
from errors import UserError
from model import ModelArgs
from rope import trained_context
from test_fuzz import EXAMPLES, fuzz_settings, loads_or_one_line_error
from tokenizer import Tokenizer

NAN, INF = float("nan"), float("inf")


def start(*args, **kwargs) -> subprocess.Popen:
    """One of the project's scripts, as a user starts it (on the test device)."""
    return subprocess.Popen([sys.executable, *map(str, args), *device_flags(args)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, **kwargs)


def run_side_by_side(commands: dict, timeout=300) -> dict:
    """name -> (exit status, stderr) of several scripts run at once (each start-up imports torch)."""
    procs = {name: start(*cmd) for name, cmd in commands.items()}
    results = {}
    for name, proc in procs.items():
        _, stderr = proc.communicate(timeout=timeout)
        results[name] = (proc.returncode, stderr.decode())
    return results


def assert_one_line_error(name, status, stderr, expected):
    assert status == 1, (name, status, stderr[-3000:])
    assert stderr.startswith("error: ") and len(stderr.strip().splitlines()) == 1, (name, stderr[-3000:])
    assert expected in stderr, (name, stderr)


# ---------------------------------------------------------------- Hugging Face config.json

BASE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": 2}
FAMILIES = {  # what each architecture's config.json adds to BASE
    "llama": {"architectures": ["LlamaForCausalLM"]},
    "mistral": {"model_type": "mistral", "sliding_window": 8},
    "qwen2": {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    "gemma": {"model_type": "gemma"},
    "gemma2": {"model_type": "gemma2"},
    "gemma3": {"model_type": "gemma3_text", "rope_local_base_freq": 10000.0},
    "qwen3": {"model_type": "qwen3"},
    "olmo2": {"model_type": "olmo2"},
    "smollm3": {"model_type": "smollm3", "no_rope_layer_interval": 2},
    "granite": {"model_type": "granite", "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                "attention_multiplier": 0.015625, "logits_scaling": 8.0},
    "phi3": {"model_type": "phi3", "original_max_position_embeddings": 256,
             "rope_scaling": {"type": "longrope", "long_factor": [1.5] * 8, "short_factor": [1.0] * 8}},
    "mixtral": {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "gpt_oss": {"model_type": "gpt_oss", "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8,
                "layer_types": ["sliding_attention", "full_attention"]},
}


def family_config(family: str) -> dict:
    return {**BASE, **FAMILIES[family]}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_base_config_converts(family):
    """The configs the cases below break are valid, so each error is the broken key's."""
    args = hf_config_to_args(family_config(family), {})
    assert ModelArgs.from_dict(args.to_dict()) == args


@pytest.mark.parametrize("family, key, value", [
    ("llama", "hidden_size", "wide"), ("llama", "hidden_size", [1]), ("llama", "hidden_size", {}),
    ("llama", "hidden_size", NAN), ("llama", "hidden_size", 0), ("llama", "hidden_size", -64),
    ("llama", "hidden_size", 64.5), ("llama", "hidden_size", True), ("llama", "hidden_size", 2),
    ("llama", "num_attention_heads", 0), ("llama", "num_hidden_layers", 10 ** 6), ("llama", "vocab_size", "256"),
    ("llama", "intermediate_size", None), ("llama", "num_key_value_heads", "2"), ("llama", "head_dim", -8),
    ("llama", "rms_norm_eps", "small"), ("llama", "rms_norm_eps", -1e-5), ("llama", "rms_norm_eps", INF),
    ("llama", "max_position_embeddings", 0), ("llama", "rope_theta", "big"), ("llama", "rope_theta", -1.0),
    ("llama", "rope_scaling", "linear"), ("llama", "rope_scaling", {"rope_type": "linear", "factor": "x"}),
    ("llama", "rope_scaling", {"rope_type": "dynamic", "factor": -2}), ("llama", "rope_scaling", {"type": "dynamic"}),
    ("llama", "rope_scaling", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": "long"}),
    ("llama", "rope_parameters", [1]), ("llama", "partial_rotary_factor", 2.0),
    ("llama", "eos_token_id", "2"), ("llama", "eos_token_id", [2, 1.5]), ("llama", "eos_token_id", 256),
    ("llama", "bos_token_id", [1, 2]), ("llama", "architectures", [["LlamaForCausalLM"]]),
    ("llama", "model_type", [1]), ("llama", "hidden_act", ["silu"]), ("llama", "attention_bias", "false"),
    ("llama", "tie_word_embeddings", 1),
    ("mistral", "sliding_window", "wide"), ("qwen2", "max_window_layers", "half"),
    ("gemma2", "sliding_window_pattern", 0), ("gemma2", "query_pre_attn_scalar", "x"),
    ("gemma2", "attn_logit_softcapping", NAN), ("gemma3", "rope_local_base_freq", "x"),
    ("smollm3", "no_rope_layer_interval", 0), ("smollm3", "no_rope_layers", 3),
    ("granite", "residual_multiplier", "x"), ("granite", "logits_scaling", 0),
    ("phi3", "original_max_position_embeddings", "x"),
    ("mixtral", "num_local_experts", "8"), ("mixtral", "num_experts_per_tok", 0),
    ("gpt_oss", "swiglu_limit", "x"), ("qwen3_moe", "moe_intermediate_size", -1),
])
def test_wrong_hf_config_value_is_one_line_naming_the_key(family, key, value):
    """What used to end in a TypeError, ValueError or ZeroDivisionError (or, for a zero or negative
    size, in a model nothing could load) is a ConvertError naming the config.json key."""
    with pytest.raises(UserError) as e:
        hf_config_to_args({**family_config(family), key: value}, {})
    message = str(e.value)
    assert key in message and "\n" not in message, message


def test_wrong_generation_config_value_is_one_line():
    with pytest.raises(UserError, match="generation_config.json key 'eos_token_id'"):
        hf_config_to_args(family_config("llama"), {"eos_token_id": ["2"]})


HF_KEYS = sorted({key for cfg in FAMILIES.values() for key in cfg} | set(BASE) | {
    "head_dim", "rope_scaling", "rope_parameters", "partial_rotary_factor", "attention_bias", "tie_word_embeddings",
    "hidden_act", "hidden_activation", "sliding_window_pattern", "query_pre_attn_scalar", "attn_logit_softcapping",
    "final_logit_softcapping", "no_rope_layers", "num_experts", "norm_topk_prob", "swiglu_limit", "swiglu_alpha",
    "text_config", "mlp_bias"})
ROPE_KEYS = ["rope_type", "type", "factor", "rope_theta", "low_freq_factor", "high_freq_factor",
             "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "long_factor", "short_factor", "partial_rotary_factor", "truncate", "full_attention",
             "sliding_attention"]
NUMBERS = st.sampled_from([0, -1, 1, 2, 3, 7, 2 ** 31, 2 ** 63, 1e300, 0.5, -0.5, NAN, INF, True, "1", [1], None, {},
                           "wide", [1.0] * 8, ["full_attention", "sliding_attention"]])
# sizes stay small: a valid but huge head_dim would only make the test slow (RoPE's tables are built to check them)
VALUES = st.recursive(st.none() | st.booleans() | st.integers(-3, 300) | st.floats() | st.text(max_size=6),
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                   max_size=3), max_leaves=5)


@st.composite
def corrupted_hf_config(draw):
    """An architecture's config.json with 1-3 keys of another type, out of range, missing, or
    changed inside its RoPE parameters; sometimes a generation_config.json with other token ids."""
    cfg = family_config(draw(st.sampled_from(sorted(FAMILIES))))
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["value", "number", "number", "drop", "rope"]))
        key = draw(st.sampled_from(HF_KEYS))
        if kind == "value":
            cfg[key] = draw(VALUES)
        elif kind == "number":
            cfg[key] = draw(NUMBERS)
        elif kind == "drop":
            cfg.pop(key, None)
        else:
            outer = draw(st.sampled_from(["rope_scaling", "rope_parameters"]))
            kinds = st.sampled_from(["default", "linear", "dynamic", "yarn", "llama3", "longrope"])
            inner = dict(cfg[outer]) if isinstance(cfg.get(outer), dict) else {"rope_type": draw(kinds)}
            inner[draw(st.sampled_from(ROPE_KEYS))] = draw(NUMBERS | VALUES | kinds)
            cfg[outer] = inner
    gen = draw(st.sampled_from([{}, {}, {"eos_token_id": draw(NUMBERS | VALUES)}, {"bos_token_id": draw(NUMBERS)}]))
    return cfg, gen


@pytest.mark.parametrize("examples", EXAMPLES)
def test_corrupted_hf_config_converts_or_fails_in_one_line(examples):
    """hf_config_to_args either gives ModelArgs that load again from their own config.json, or a
    one-line error: never another exception or a hang."""
    @fuzz_settings(examples)
    @given(corrupted_hf_config())
    def check(case):
        result = {}
        if loads_or_one_line_error(lambda: result.update(args=hf_config_to_args(*case))) is None:
            written = json.dumps(result["args"].to_dict())  # as write_checkpoint's config.json
            assert json.dumps(ModelArgs.from_dict(json.loads(written)).to_dict()) == written

    check()


def test_convert_cli_wrong_config_value_exits_1_naming_the_key(tmp_path):
    """convert_hf_checkpoint.py --checkpoint_dir on the values the issue names: one line, exit 1,
    no output directory. config.json is read before the weights, so none are needed."""
    commands = {}
    for i, value in enumerate(["wide", [1], {}, NAN, 0, -1]):
        src = tmp_path / f"hf{i}"
        src.mkdir()
        (src / "config.json").write_text(json.dumps({**family_config("llama"), "hidden_size": value}))
        commands[repr(value)] = ["convert_hf_checkpoint.py", "--checkpoint_dir", src, "--out", tmp_path / f"out{i}"]
    for name, (status, stderr) in run_side_by_side(commands).items():
        assert_one_line_error(name, status, stderr, "'hidden_size'")
    assert not list(tmp_path.glob("out*"))


# ---------------------------------------------------------------- generate.py, eval.py, serve.py

@pytest.fixture(scope="module")
def tiny(smollm2_dir, tmp_path_factory) -> Path:
    """A tiny random model with SmolLM2's tokenizer (whose BOS is <|im_start|>) and no BOS of its
    own; trained context 8192 tokens."""
    model = random_model(vocab_size=49152, eos_token_ids=[2], max_position_embeddings=8192)
    return save_checkpoint(model, tmp_path_factory.mktemp("tiny") / "ckpt", tokenizer_from=smollm2_dir)


def variant(src: Path, dst: Path, config=None, tokenizer_config=None) -> Path:
    """A copy of checkpoint src with config.json / tokenizer_config.json changed by the functions given."""
    shutil.copytree(src, dst)
    for name, edit in (("config.json", config), ("tokenizer_config.json", tokenizer_config)):
        if edit is not None:
            (dst / name).write_text(json.dumps(edit(json.loads((dst / name).read_text()))))
    return dst


def without_bos(d: dict) -> dict:
    return {key: value for key, value in d.items() if key != "bos_token"}


def test_empty_prompt_generates_from_bos_or_fails_in_one_line(tiny, tmp_path):
    """--prompt '': the model's BOS (config.json's bos_token_id, else the tokenizer's) alone is the
    prompt; with neither, a one-line error."""
    model_bos = variant(tiny, tmp_path / "model_bos", config=lambda c: {**c, "bos_token_id": 1},
                        tokenizer_config=without_bos)
    no_bos = variant(tiny, tmp_path / "no_bos", tokenizer_config=without_bos)
    generate = ["generate.py", "--prompt", "", "--no-compile", "--ignore_eos", "--max_new_tokens", "3", "--checkpoint"]
    results = run_side_by_side({
        "tokenizer_bos": [*generate, tiny, "--metrics_json", tmp_path / "tokenizer_bos.json"],
        "model_bos": [*generate, model_bos, "--metrics_json", tmp_path / "model_bos.json"],
        "no_bos": [*generate, no_bos]})
    for name in ("tokenizer_bos", "model_bos"):
        status, stderr = results[name]
        assert status == 0 and "Traceback" not in stderr, (name, stderr[-3000:])
        (metrics,) = json.loads((tmp_path / f"{name}.json").read_text())
        assert metrics["prompt_tokens"] == 1 and metrics["new_tokens"] == 3, (name, metrics)
    assert_one_line_error("no_bos", *results["no_bos"], "no BOS token")


@pytest.mark.parametrize("mode", ["plain", "chat", "interactive"])
def test_ctrl_c_during_generation_exits_130_without_a_traceback(tiny, mode):
    """SIGINT to the whole process group, as a terminal's Ctrl-C sends it, once the text streams."""
    args = ["generate.py", "--checkpoint", tiny, "--no-compile", "--ignore_eos", "--max_new_tokens", "3000"]
    args += {"plain": ["--prompt", "Once upon a time"], "chat": ["--chat", "--prompt", "Hi"],
             "interactive": ["--interactive"]}[mode]
    proc = start(*args, stdin=subprocess.PIPE, start_new_session=True)
    try:
        if mode == "interactive":
            proc.stdin.write(b"Tell me a story\n")
            proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], 180)
        assert ready and os.read(proc.stdout.fileno(), 1), "no text before the timeout"
    finally:
        stderr = interrupt(proc)
    assert proc.returncode == 130, (proc.returncode, stderr[-3000:])
    assert "Traceback" not in stderr and stderr.rstrip().endswith("interrupted"), stderr[-3000:]


def interrupt(proc) -> str:
    """Ctrl-C to the process group of a running command (as a terminal sends it); its stderr."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
        return proc.communicate(timeout=60)[1].decode()
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc to see torch being imported")
@pytest.mark.parametrize("script", ["generate.py", "eval.py"])
def test_ctrl_c_while_torch_imports_exits_130_without_a_traceback(tiny, script):
    """Before main() runs, the seconds that `import torch` takes: SIGINT as soon as libtorch is mapped."""
    proc = start(script, "--checkpoint", tiny, "--max_new_tokens" if script == "generate.py" else "--max_tokens", 64,
                 start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if "libtorch" in Path(f"/proc/{proc.pid}/maps").read_text():
                    break
            except OSError:
                pass
            time.sleep(0.002)
    finally:
        stderr = interrupt(proc)
    assert proc.returncode == 130 and "Traceback" not in stderr, (proc.returncode, stderr[-3000:])


def test_numeric_flags_out_of_range_are_one_line_errors(tiny):
    """Each flag checked before the weights load; a KV cache past the trained context (8192 here)
    needs --extend_context."""
    generate = ["generate.py", "--checkpoint", tiny, "--no-compile", "--max_new_tokens", "2"]
    cases = {
        "temperature_inf": ([*generate, "--temperature", "inf"], "--temperature"),
        "temperature_nan": ([*generate, "--temperature", "nan"], "--temperature"),
        "seed": ([*generate, "--seed", "-1"], "--seed"),
        "seed_too_big": ([*generate, "--seed", str(2 ** 64)], "--seed"),
        "top_p": ([*generate, "--top_p", "1.5"], "top_p"),
        "max_seq_length": ([*generate, "--max_seq_length", "100000000"], "--extend_context"),
        "max_new_tokens": ([*generate, "--max_new_tokens", "1000000"], "--extend_context"),
        "interactive": ([*generate, "--interactive", "--max_seq_length", "10000"], "--extend_context"),
        "speculate_k": ([*generate, "--ngram", "2", "--max_new_tokens", "8180", "--speculate_k", "30"],
                        "--speculate_k (30) is past the model's trained context of 8192"),
        "eval_window": (["eval.py", "--checkpoint", tiny, "--window", "10000", "--stride", "5000"], "--extend_context"),
        "serve_max_seq_length": (["serve.py", "--checkpoint", tiny, "--max_seq_length", "10000"], "--extend_context"),
        "serve_shutdown_timeout": (["serve.py", "--checkpoint", tiny, "--shutdown_timeout", "-1"],
                                   "--shutdown_timeout"),
    }
    results = run_side_by_side({name: cmd for name, (cmd, _) in cases.items()})
    for name, (status, stderr) in results.items():
        assert_one_line_error(name, status, stderr, cases[name][1])


WITHOUT_TORCH = "import runpy, sys; sys.modules['torch'] = None; sys.argv = sys.argv[1:]; " \
                "runpy.run_path(sys.argv[0], run_name='__main__')"  # `import torch` raises ImportError


# script -> the flags it needs beside --checkpoint; flags whose values it refuses, and the message
FLAG_ERRORS = {
    "generate.py": ([], {"--max_new_tokens 0": "error: --max_new_tokens must be at least 1",
                         "--pp 0": "error: --pp must be at least 1",
                         "--pp_groups 2": "error: --pp_groups goes with --pp"}),
    "serve.py": ([], {"--port 70000": "error: --port must be in 1..65535",
                      "--microbatches 2": "error: --microbatches goes with --pp",
                      "--max_seq_length 1": "error: --max_seq_length must be at least 2",
                      "--shutdown_timeout inf": "error: --shutdown_timeout must be a finite number"}),
    "eval.py": ([], {"--stride 0": "error: --window must be at least 2 and --stride between 1 and --window",
                     "--chunk -1": "error: --chunk must be 0"}),
    "quantize.py": (["--mode", "int4"], {"--mode int3": "error: unknown --mode 'int3'",
                                         "--groupsize 48": "error: --groupsize 48 is not supported"}),
}


def flag_error_cases():
    """(script, flags after --checkpoint, exit status, what stderr says): an unknown flag (argparse's
    usage error), a missing checkpoint directory, and each value out of range."""
    for script, (needed, refused) in FLAG_ERRORS.items():
        yield pytest.param(script, [*needed, "--bogus"], 2, "unrecognized arguments: --bogus",
                           id=f"{script}-unknown_flag")
        yield pytest.param(script, [*needed, "--checkpoint", "MISSING"], 1, "error: checkpoint directory",
                           id=f"{script}-missing_checkpoint")
        for flags, message in refused.items():
            yield pytest.param(script, [*needed, *flags.split()], 1, message,
                               id=f"{script}-{flags.strip('-').replace(' ', '=')}")


@pytest.mark.parametrize("script, flags, status, expected", list(flag_error_cases()))
def test_flag_errors_come_before_torch_is_imported(smollm2_dir, tmp_path, script, flags, status, expected):
    """A command line with torch made unimportable: a wrong flag still gets its usual message and exit status."""
    flags = [str(tmp_path / "none") if f == "MISSING" else f for f in flags]  # the last --checkpoint counts
    r = subprocess.run([sys.executable, "-c", WITHOUT_TORCH, script, "--checkpoint", str(smollm2_dir), *flags],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == status and expected in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
    if status == 1:
        assert_one_line_error(script, r.returncode, r.stderr, expected)


def test_extend_context_warns_and_runs(tiny):
    status, stderr = run_side_by_side({"extend": [
        "generate.py", "--checkpoint", tiny, "--no-compile", "--max_new_tokens", "2", "--max_seq_length", "8448",
        "--extend_context"]})["extend"]
    assert status == 0, stderr[-3000:]
    assert "warning: --max_seq_length 8448 is past the model's trained context of 8192 tokens" in stderr


def test_trained_context_follows_rope_scaling():
    """max_position_embeddings, extended by the scalings whose configs keep the original length there."""
    args = ModelArgs(vocab_size=32, dim=16, n_layers=1, n_heads=2, intermediate_size=32, max_position_embeddings=4096)
    assert trained_context(args) == 4096
    assert trained_context(replace(args, rope_scaling={"rope_type": "linear", "factor": 4.0})) == 16384
    assert trained_context(replace(args, rope_scaling={"rope_type": "dynamic", "factor": 2.0})) == 8192
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert trained_context(replace(args, rope_scaling=yarn)) == 131072
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 1024}
    assert trained_context(replace(args, rope_scaling=llama3)) == 4096  # max_position_embeddings is the long one


# ---------------------------------------------------------------- a tokenizer that does not fit the weights

def test_tokenizer_past_the_vocabulary_is_refused_at_load(smollm2_dir, tmp_path):
    """SmolLM2's 49152-token tokenizer beside a 256-token model: a one-line error before the weights
    load, not an index error in the embedding."""
    small = save_checkpoint(random_model(vocab_size=256), tmp_path / "small", tokenizer_from=smollm2_dir)
    results = run_side_by_side({
        "generate": ["generate.py", "--checkpoint", small, "--no-compile", "--max_new_tokens", "2"],
        "eval": ["eval.py", "--checkpoint", small, "--max_tokens", "64", "--window", "32", "--stride", "16"]})
    for name, (status, stderr) in results.items():
        assert_one_line_error(name, status, stderr, "past the model's vocabulary of 256")


def test_special_token_past_the_embedding_is_allowed_but_not_in_a_prompt(smollm2_dir, tmp_path):
    """Gemma 3's tokenizer has an image token one past its text model's embedding: the tokenizer
    loads, and only a prompt that holds the token is refused."""
    import generate
    import generate_args

    (tmp_path / "tok").mkdir()
    spec = json.loads((smollm2_dir / "tokenizer.json").read_text())
    spec["added_tokens"].append({"id": 49152, "content": "<image_soft_token>", "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": True})
    (tmp_path / "tok" / "tokenizer.json").write_text(json.dumps(spec))
    shutil.copy(smollm2_dir / "tokenizer_config.json", tmp_path / "tok")
    tok = Tokenizer(tmp_path / "tok")
    assert tok.vocab_size == 49153
    config = ModelArgs(vocab_size=49152, dim=64, n_layers=1, n_heads=4, intermediate_size=128)
    check_vocabulary(tok, config, "tok")
    with pytest.raises(UserError, match="past the model's vocabulary of 49000"):
        check_vocabulary(tok, replace(config, vocab_size=49000), "tok")
    args = generate_args.parse_args(["--checkpoint", str(tmp_path / "tok"), "--prompt", "an <image_soft_token>"])
    with pytest.raises(UserError, match="past the model's vocabulary of 49152"):
        generate.encode_prompts(tok, args, config)
    args.prompt = ["a cat"]
    assert max(generate.encode_prompts(tok, args, config)[0]) < 49152
