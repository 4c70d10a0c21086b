"""shapes.py: models of a published shape with random weights, and generate.py --shape."""
import pytest
import torch

import qlayers
import shapes
from conftest import TEST_DEVICE, run_script
from engine import Engine
from sampling import Sampling


@pytest.mark.parametrize("name,params", [("llama-2-7b", 6_738_415_616), ("llama-3.1-8b", 8_030_261_248)])
def test_shape_has_the_published_parameter_count(name, params):
    model = qlayers.meta_model(shapes.shape_args(name))
    assert sum(p.numel() for p in model.parameters()) == params


def logits(model, tokens):
    model.setup_caches(1, 64)
    with torch.inference_mode():
        return model(torch.tensor([tokens], device=model.norm.weight.device), torch.arange(len(tokens),
                     device=model.norm.weight.device)).float().cpu()


# int8 on a CPU test device also rounds the activations (kernels.py); int4 rounds N(0, 0.02) weights by ~12%
@pytest.mark.parametrize("quantization,tolerance", [("int8", 0.05), ("int4-g32", 0.3), ("int4-g64", 0.3)])
def test_quantized_shape_is_its_float_model_rounded(quantization, tolerance):
    """The same seed draws the same float weights, which --quantize rounds as quantize.py would:
    the quantized model's logits are the float model's, up to that rounding."""
    prompt = shapes.random_prompt("tiny", 12)
    want = logits(shapes.random_model("tiny", TEST_DEVICE), prompt)
    model = shapes.random_model("tiny", TEST_DEVICE, quantization=quantization)
    layer = model.layers[0].feed_forward.w1
    assert isinstance(layer, qlayers.Int8Linear if quantization == "int8" else qlayers.Int4Linear)
    got = logits(model, prompt)
    assert ((got - want).norm() / want.norm()).item() < tolerance
    other = logits(shapes.random_model("tiny", TEST_DEVICE, seed=1), prompt)  # another seed: other weights
    assert ((other - want).norm() / want.norm()).item() > 1


def test_shape_model_generates_the_same_tokens_twice():
    model = shapes.random_model("tiny", TEST_DEVICE, quantization="int4-g32")
    engine = Engine(model)
    engine.setup(2, 64)
    prompt = shapes.random_prompt("tiny", 16)
    first, _ = engine.generate([prompt, prompt], 8, Sampling(0.0))
    again, _ = engine.generate([prompt, prompt], 8, Sampling(0.0))
    assert first == again and first[0] == first[1] and len(first[0]) == 8


def test_generate_shape_prints_token_ids():
    r = run_script("generate.py", "--shape", "tiny", "--quantize", "int8", "--max_new_tokens", "6", "--ignore_eos",
                   "--no-compile", "--batch_size", "2")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "--- row 1 of 2 ---" and lines[2] == "--- row 2 of 2 ---"  # each row labelled
    rows = lines[1::2]
    assert [len(row.split()) for row in rows[:2]] == [6, 6] and all(t.isdigit() for t in rows[0].split())
    assert "made tiny with random weights (llama, " in r.stderr and " MB of weights: int8, " in r.stderr


@pytest.mark.parametrize("flags,message", [
    (["--shape", "tiny", "--chat"], "--chat needs a --checkpoint"),
    (["--shape", "tiny", "--quantize", "int4"], "unknown quantization 'int4'"),
    (["--shape", "tiny", "--quantize", "int4-g48"], "unknown quantization"),
    (["--checkpoint", "checkpoints/x", "--quantize", "int8"], "--quantize goes with --shape"),
    (["--shape", "tiny", "--checkpoint", "checkpoints/x"], "either --checkpoint or --shape"),
    ([], "either --checkpoint or --shape"),
])
def test_generate_shape_refuses_what_it_cannot_do(flags, message):
    r = run_script("generate.py", *flags)
    assert r.returncode != 0 and message in r.stderr and "Traceback" not in r.stderr
