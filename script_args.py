"""serve.py's, eval.py's and quantize.py's flags and the checks they need no torch for (generate.py's
are generate_args.py's): each script parses its command line with this module before it imports
torch, so that a wrong flag fails at once rather than after the seconds torch takes to import.
Imports nothing that imports torch; a default that depends on CUDA is None here, and the script
sets it once torch is imported."""
import argparse
import os
from pathlib import Path

from choices import BLOCK_SIZE, COMPILE_MODES, GPTQ_MODES, GROUPED_MODES, GROUPSIZES, QUANTIZE_MODES
from errors import QuantizeError, UserError, require_dir
from generate_args import LOOKAHEAD_DEFAULT, add_parallel_args, check_pipeline_args, lookahead_sizes

DATA = Path(__file__).resolve().parent / "data"
DEFAULT_TEXT = DATA / "hamlet.txt"  # eval.py's
DEFAULT_CALIBRATION = DATA / "macbeth.txt"  # quantize.py's, for GPTQ
DEVICE_HELP = "cpu, cuda, cuda:1, ... (default: cuda where there is one, else cpu)"
SERVED_PROPOSERS = ("ngram", "suffix", "draft", "lookahead")  # speculation.KINDS: serve.py --speculative


# ---------------------------------------------------------------- serve.py

def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Serve a checkpoint over an OpenAI-compatible HTTP API, "
                                            "with continuous batching and prefix reuse.",
                                epilog="Structured output: send response_format json_object or json_schema "
                                       "(client.chat.completions.parse works), or the extra fields `regex` or "
                                       "`grammar` (llguidance Lark); tools with tool_choice \"required\" or a named "
                                       "function come back as tool_calls. Needs the checkpoint's tokenizer.json.")
    p.add_argument("--checkpoint", type=Path, required=True, help="checkpoint directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max_batch_size", type=int, default=16, help="requests running at once (the rows of a step)")
    p.add_argument("--kv_cache_tokens", type=int, default=None,
                   help="the KV cache, in tokens, that the running requests share (blocks of "
                        f"{BLOCK_SIZE}; default: --max_batch_size x --max_seq_length)")
    p.add_argument("--max_seq_length", type=int, default=None,
                   help="tokens per request: prompt + output (default: 4096, or the model's trained context if shorter)")
    p.add_argument("--extend_context", action="store_true",
                   help="allow a --max_seq_length past the model's trained context (max_position_embeddings, or what "
                        "its RoPE scaling extends it to), with a warning: the output usually degrades there")
    p.add_argument("--max_waiting", type=int, default=64, help="requests queued for a slot; more get a 429")
    p.add_argument("--prefill_chunk", type=int, default=256,
                   help="prompt tokens prefilled per step, between decode steps")
    p.add_argument("--prepack", action=argparse.BooleanOptionalAction, default=True,
                   help="CPU, float weights: keep a second copy of the weights in oneDNN's layout, for faster steps of "
                        "many rows (--no-prepack saves that memory)")
    p.add_argument("--prefix_reuse", action=argparse.BooleanOptionalAction, default=True,
                   help="the prefix cache: a request uses the cached blocks of the longest beginning it shares with "
                        "earlier requests and prefills only the rest (default: on)")
    p.add_argument("--prompt_cache", type=Path, default=None, metavar="DIR",
                   help="keep the prompts' KV cache blocks on disk here too: after a restart a request that "
                        "begins like an earlier one loads them instead of computing them")
    p.add_argument("--prompt_cache_gb", type=float, default=4.0, help="the --prompt_cache folder's size at most")
    p.add_argument("--speculative", default=None, metavar="|".join(SERVED_PROPOSERS),
                   help="speculative decoding in the batched step: ngram (prompt lookup), suffix (the most frequent "
                        "continuation in a trie of this and earlier requests' prompts and outputs), draft (a "
                        "smaller model, --draft_checkpoint, drafting for every speculating request at once) or "
                        "lookahead (--lookahead; while one request decodes); a request opts out with "
                        "\"speculative\": false. Each step takes the proposal rows that pay for their cost, from the "
                        "step's own times by its rows (and a draft's forwards) and each request's acceptance: many "
                        "at one request, few or none as more decode (default: off)")
    p.add_argument("--speculate_k", type=int, default=8,
                   help="with --speculative: tokens a request proposes per step, at most (default: 8)")
    p.add_argument("--draft_checkpoint", type=Path, default=None, metavar="DIR",
                   help="with --speculative draft: the draft model's checkpoint (float or quantized, the target's "
                        "tokenizer); it holds a KV cache of --max_batch_size x --max_seq_length of its own")
    p.add_argument("--lookahead", default=LOOKAHEAD_DEFAULT, metavar="W,N,G",
                   help="with --speculative lookahead: its window W, n-gram size N and candidates G, as generate.py "
                        f"--lookahead takes them (default: {LOOKAHEAD_DEFAULT}). While a step has one decoding "
                        "request, its round (1 + (N - 1)(W + G) tokens) runs where spec_cost.LookaheadPlanner "
                        "expects it to pay; with more, plain rows")
    add_serve_running_args(p)
    return p


def add_serve_running_args(p):
    """How serve.py runs the model (device, compilation, tensor parallelism) and meets its clients."""
    add_parallel_args(p)  # rank 0 serves
    p.add_argument("--device", default=None, help=DEVICE_HELP)
    p.add_argument("--dtype", default=None,
                   help="float32, bfloat16 or float16 (default: bfloat16 where there is CUDA, else float32)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="compile the decode step (default: on)")
    p.add_argument("--wait_for_compile", action="store_true",
                   help="answer only once the step is compiled (default on CPU: serve with the eager step "
                        "at once and switch to the compiled one when it is ready; on CUDA it always waits)")
    p.add_argument("--compile_mode", choices=COMPILE_MODES, default="default",
                   help="regional: compile one layer and reuse it for every layer, a fraction of the startup; "
                        "max: see generate.py --help")
    p.add_argument("--api_key", default=os.environ.get("MINILLM_API_KEY"),
                   help="require `Authorization: Bearer KEY` (default: $MINILLM_API_KEY, or none)")
    p.add_argument("--cors_origins", default=None, metavar="ORIGIN[,ORIGIN...]",
                   help="let web pages from these origins (or * for any) call the API from a browser (CORS; "
                        "default: none)")
    p.add_argument("--model_name", default=None, help="the model id clients name (default: the checkpoint's name)")
    p.add_argument("--shutdown_timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let running requests finish")


def check_serve_args(args):
    for name in ("max_batch_size", "max_waiting", "prefill_chunk"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name} must be at least 1")
    if args.max_seq_length is not None and args.max_seq_length < 2:
        raise UserError("--max_seq_length must be at least 2")
    if args.kv_cache_tokens is not None and args.kv_cache_tokens < BLOCK_SIZE:
        raise UserError(f"--kv_cache_tokens must be at least {BLOCK_SIZE}")
    if not 0 < args.port < 65536:
        raise UserError("--port must be in 1..65535")
    if not 0 <= args.shutdown_timeout < float("inf"):
        raise UserError("--shutdown_timeout must be a finite number of seconds >= 0")
    check_pipeline_args(args)
    if args.pp > 1 and args.prompt_cache is not None:
        raise UserError("--pp runs without --prompt_cache")
    if args.speculative is not None and args.speculative not in SERVED_PROPOSERS:
        raise UserError(f"unknown --speculative {args.speculative!r} (choose {', '.join(SERVED_PROPOSERS)})")
    if (args.speculative == "draft") != (args.draft_checkpoint is not None):
        raise UserError("--speculative draft and --draft_checkpoint go together")
    if args.draft_checkpoint is not None:
        require_dir(args.draft_checkpoint)
    if args.lookahead != LOOKAHEAD_DEFAULT and args.speculative != "lookahead":
        raise UserError("--lookahead goes with --speculative lookahead")
    lookahead_sizes(args.lookahead)
    if args.speculate_k < 1:
        raise UserError("--speculate_k must be at least 1")
    require_dir(args.checkpoint)


def parse_serve_args(argv=None) -> argparse.Namespace:
    args = serve_parser().parse_args(argv)
    check_serve_args(args)
    return args


# ---------------------------------------------------------------- eval.py

def eval_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Perplexity of a checkpoint over a text file (sliding window).")
    p.add_argument("--checkpoint", type=Path, required=True, help="checkpoint directory (float or quantized)")
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="UTF-8 text file (default: data/hamlet.txt)")
    p.add_argument("--window", type=int, default=1024, help="tokens per forward pass (default 1024)")
    p.add_argument("--stride", type=int, default=512, help="tokens between window starts (default 512)")
    p.add_argument("--max_tokens", type=int, default=None, help="score only the text's first N tokens")
    p.add_argument("--chunk", type=int, default=0,
                   help="feed each window N tokens at a time through the KV cache, as decoding does "
                        "(N <= 16 on CPU: the int8-activation kernels of quantized layers); default: whole windows")
    p.add_argument("--extend_context", action="store_true",
                   help="allow a --window past the model's trained context (max_position_embeddings, or what its "
                        "RoPE scaling extends it to), with a warning")
    p.add_argument("--device", default=None, help=DEVICE_HELP)
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    return p


def parse_eval_args(argv=None) -> argparse.Namespace:
    args = eval_parser().parse_args(argv)
    if args.window < 2 or not 1 <= args.stride <= args.window:
        raise UserError("--window must be at least 2 and --stride between 1 and --window")
    if args.chunk < 0:
        raise UserError("--chunk must be 0 (whole windows) or a positive number of tokens")
    if args.max_tokens is not None and args.max_tokens < 2:
        raise UserError("--max_tokens must be at least 2")
    if not args.text.is_file():
        raise UserError(f"text file {args.text} not found")
    require_dir(args.checkpoint)
    return args


# ---------------------------------------------------------------- quantize.py

def quantize_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Quantize a float checkpoint's weights to int8 or int4; writes a new checkpoint directory.",
        epilog="int8: symmetric per output channel. int4: asymmetric per group of --groupsize inputs, "
               "round to nearest. int4-gptq: int4 with GPTQ error compensation, calibrated on "
               "--calibration (default: data/macbeth.txt, public domain). The output head is int8 in "
               "every mode. Run generate.py / eval.py on the output like on any checkpoint.")
    p.add_argument("--checkpoint", type=Path, required=True, help="float checkpoint directory")
    p.add_argument("--mode", required=True, help=", ".join(QUANTIZE_MODES))
    p.add_argument("--groupsize", type=int, default=32,
                   help=f"int4: inputs per scale/zero, one of {', '.join(map(str, GROUPSIZES))}")
    p.add_argument("--out", type=Path, default=None,
                   help="output directory (default: <checkpoint>-int8, -int4-g32, -int4-gptq-g32)")
    p.add_argument("--calibration", type=Path, default=DEFAULT_CALIBRATION, help="int4-gptq: calibration text file")
    p.add_argument("--calibration_samples", type=int, default=32, help="int4-gptq: sequences of calibration text")
    p.add_argument("--calibration_length", type=int, default=512, help="int4-gptq: tokens per sequence")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    return p


def parse_quantize_args(argv=None) -> argparse.Namespace:
    args = quantize_parser().parse_args(argv)
    if args.mode not in QUANTIZE_MODES:
        raise QuantizeError(f"unknown --mode {args.mode!r} (choose {', '.join(QUANTIZE_MODES)})")
    if args.mode in GROUPED_MODES and args.groupsize not in GROUPSIZES:
        raise QuantizeError(f"--groupsize {args.groupsize} is not supported "
                            f"(choose {', '.join(map(str, GROUPSIZES))})")
    if args.mode in GPTQ_MODES and not args.calibration.is_file():
        raise QuantizeError(f"calibration file {args.calibration} not found")
    require_dir(args.checkpoint)
    return args
