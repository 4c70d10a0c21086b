"""Fixtures shared by the test files: the real default model and small random checkpoints."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ROOT / "checkpoints" / "smollm2-135m"
# MINILLM_TEST_DEVICE=cuda runs the device-agnostic tests (and the command lines) on that device;
# their references stay float32, so the command lines are pinned to float32 as well
TEST_DEVICE = os.environ.get("MINILLM_TEST_DEVICE", "cpu")
DEVICE_SCRIPTS = ("generate.py", "eval.py", "serve.py")  # the command lines that take --device


def pytest_configure(config):
    workers = getattr(config, "workerinput", {}).get("workercount", 1)  # pytest-xdist's workers share the cores
    cores = len(os.sched_getaffinity(0))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        # more OpenMP threads than cores: each eager op waits at its barrier for a descheduled thread
        # (an eager decode test took 6x as long beside another worker); the command lines inherit it
        threads = max(1, cores // workers)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        device = torch.device(TEST_DEVICE)
    except RuntimeError:
        raise pytest.UsageError(f"MINILLM_TEST_DEVICE={TEST_DEVICE!r} is not a torch device") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"MINILLM_TEST_DEVICE={TEST_DEVICE} but CUDA is not available")


def pytest_runtest_logreport(report):
    """MINILLM_EARLY_TRACEBACKS=1: a failure's traceback as it happens, not in the summary, which a run
    cut at its time cap (scripts/gpu_session.sh) never prints."""
    if report.failed and os.environ.get("MINILLM_EARLY_TRACEBACKS"):
        sys.stdout.write(f"\n==== {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n")


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device(TEST_DEVICE)


def device_flags(args) -> list:
    """--device and --dtype for a command line that names neither: the test device, float32."""
    args = [str(a) for a in args]
    if not any(str(a).endswith(DEVICE_SCRIPTS) for a in args):
        return []
    return ([] if "--device" in args else ["--device", TEST_DEVICE]) + \
        ([] if "--dtype" in args else ["--dtype", "float32"])


def needs_devices(n: int):
    """Skip a test that runs n ranks when the test device is a GPU and there are fewer than n."""
    if TEST_DEVICE.startswith("cuda") and torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs (one per rank); this machine has {torch.cuda.device_count()}")


def run_script(*args, stdin=None, timeout=900, env=None) -> subprocess.CompletedProcess:
    """Run one of the project's scripts the way a user would (on the test device, see device_flags)."""
    return subprocess.run([sys.executable, *map(str, args), *device_flags(args)], cwd=ROOT, input=stdin,
                          capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct in our format (`make test` prepares it; prepared here if missing)."""
    if not (SMOLLM2 / "model.safetensors").exists():
        r = run_script("download.py", "smollm2-135m")
        assert r.returncode == 0, r.stderr
    return SMOLLM2


@pytest.fixture(scope="session")
def int8_dir(smollm2_dir, tmp_path_factory) -> Path:
    """SmolLM2-135M quantized to int8 (a clean checkout has only the float checkpoint)."""
    out = tmp_path_factory.mktemp("int8") / "smollm2-135m-int8"
    r = run_script("quantize.py", "--checkpoint", smollm2_dir, "--mode", "int8", "--out", out, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: thread start-up costs more than it saves, and far more on a busy machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def random_model(seed=0, std=0.3, device=None, **overrides):
    """A tiny random Transformer whose weights are large enough that greedy decoding is not degenerate
    (drawn on the CPU, so a seed gives the same weights on every device, then moved to `device`)."""
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
    return (model.to(device) if device is not None else model).eval()


def on_test_device(model: torch.nn.Module) -> torch.nn.Module:
    """`model` moved to the test device, still called with CPU tensors and returning CPU ones, so a
    test compares it with its CPU references unchanged."""
    if torch.device(TEST_DEVICE).type == "cpu":
        return model

    def to_device(module, args, kwargs):
        move = lambda x: x.to(TEST_DEVICE) if isinstance(x, torch.Tensor) else x  # noqa: E731
        return tuple(map(move, args)), {k: move(v) for k, v in kwargs.items()}

    model.register_forward_pre_hook(to_device, with_kwargs=True)
    model.register_forward_hook(lambda module, args, out: out.cpu())
    return model.to(TEST_DEVICE)


def save_checkpoint(model, out_dir: Path, tokenizer_from: Path = None) -> Path:
    """Write `model` in our checkpoint format (checkpoint.py's writer), with tokenizer files copied
    from another checkpoint."""
    from checkpoint import copy_files, write_checkpoint
    state = {name: t.cpu() for name, t in model.state_dict().items()}
    if model.args.tie_word_embeddings:
        state.pop("output.weight")
    return write_checkpoint(out_dir, model.args, state, copy_files(tokenizer_from) if tokenizer_from else None)
