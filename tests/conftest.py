"""Fixtures shared by the test files: the real default model and small random checkpoints."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ROOT / "checkpoints" / "smollm2-135m"


def run_script(*args, stdin=None, timeout=900, env=None) -> subprocess.CompletedProcess:
    """Run one of the project's scripts the way a user would."""
    return subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, input=stdin, capture_output=True,
                          text=True, timeout=timeout, env=env)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct in our format (`make test` prepares it; prepared here if missing)."""
    if not (SMOLLM2 / "model.safetensors").exists():
        r = run_script("download.py", "smollm2-135m")
        assert r.returncode == 0, r.stderr
    return SMOLLM2


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: thread start-up costs more than it saves, and far more on a busy machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def random_model(seed=0, std=0.3, **overrides):
    """A tiny random Transformer whose weights are large enough that greedy decoding is not degenerate."""
    from model import ModelArgs, Transformer
    cfg = dict(vocab_size=256, dim=64, intermediate_size=128, n_layers=2, n_heads=4, n_kv_heads=2)
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = Transformer(ModelArgs(**cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, std)
    return model.eval()


def save_checkpoint(model, out_dir: Path, tokenizer_from: Path = None) -> Path:
    """Write `model` in our checkpoint format (checkpoint.py's writer), with tokenizer files copied
    from another checkpoint."""
    from checkpoint import copy_files, write_checkpoint
    state = dict(model.state_dict())
    if model.args.tie_word_embeddings:
        state.pop("output.weight")
    return write_checkpoint(out_dir, model.args, state, copy_files(tokenizer_from) if tokenizer_from else None)
