"""generate.py's flags and the checks they need no torch for: generate.py parses its command line
with this module before it imports torch, so that a wrong flag fails at once rather than after
the seconds torch takes to import. Imports nothing that imports torch."""
import argparse
import math
from pathlib import Path

from choices import COMPILE_MODES, MAX_LOGPROBS, SHAPES, TP_MODES
from errors import UserError, require_dir


def add_model_args(p):
    p.add_argument("--checkpoint", type=Path, default=None, help="checkpoint directory")
    p.add_argument("--shape", choices=SHAPES, default=None,
                   help="instead of --checkpoint, a model of this shape with random weights made on the device "
                        "(shapes.py): for speed; its prompt is --prompt_length token ids and it prints token ids")
    p.add_argument("--quantize", default=None, metavar="int8|int4-gN",
                   help="with --shape: quantize its weights in memory (int8, int4-g32, int4-g64, ...)")
    p.add_argument("--prompt_length", type=int, default=16, help="with --shape: prompt tokens (default: 16)")
    p.add_argument("--num_samples", type=int, default=1, help="generate this many times")
    p.add_argument("--batch_size", type=int, default=1, help="copies of a single prompt to decode together")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="compile the decode step with torch.compile (default: on)")
    p.add_argument("--compile_prefill", action="store_true", help="also compile prefill (dynamic shapes)")
    p.add_argument("--wait_for_compile", action="store_true",
                   help="compile before the first token, not on a thread while the eager step runs (implied "
                        "by --num_samples > 1, --profile, --compare_plain, CUDA, a draft under torchrun); the eager "
                        "and compiled steps round differently, so only then is a run's text independent of when "
                        "the compile ends")
    p.add_argument("--compile_mode", choices=COMPILE_MODES, default="default",
                   help="regional: compile one layer and reuse it for every layer alike (a fraction of the "
                        "compile time; a slower step on small models); max: on CPU, freeze "
                        "the weights and let inductor generate its own GEMM kernels "
                        "(fastest decode, especially in bfloat16, but every run compiles for minutes); "
                        "on CUDA, max-autotune")
    add_parallel_args(p)
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda where there is one, else cpu)")
    p.add_argument("--dtype", default=None,
                   help="float32, bfloat16 or float16 (default: bfloat16 where there is CUDA, else float32)")
    p.add_argument("--max_seq_length", type=int, default=None,
                   help="KV cache length (default: what the prompt and max_new_tokens need; 4096 when interactive; "
                        "at most the model's trained context)")
    p.add_argument("--extend_context", action="store_true",
                   help="allow a KV cache past the model's trained context (max_position_embeddings, or what its "
                        "RoPE scaling extends it to), with a warning: the output usually degrades there")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message for --chat / --interactive")
    p.add_argument("--interactive", action="store_true",
                   help="multi-turn chat on stdin; the KV cache is kept across turns")
    p.add_argument("--ignore_eos", action="store_true", help="always generate max_new_tokens (benchmarks)")


def add_sampling_args(p):
    p.add_argument("--prompt", action="append",
                   help='prompt text; repeat to generate for several prompts in one batch (default: "Hello, my '
                        'name is"; with --interactive, each turn is read from standard input)')
    p.add_argument("--max_new_tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top_k", type=int, default=None)
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--min_p", type=float, default=0.0, help="drop tokens less likely than this x the most likely")
    p.add_argument("--repetition_penalty", type=float, default=1.0,
                   help="divide a positive logit (multiply a negative one) of every token already in the prompt "
                        "or output by this (1: off)")
    p.add_argument("--presence_penalty", type=float, default=0.0,
                   help="subtract this from the logit of a token already in the output (OpenAI's; -2..2)")
    p.add_argument("--frequency_penalty", type=float, default=0.0,
                   help="subtract this times its count in the output from a token's logit (OpenAI's; -2..2)")
    p.add_argument("--logit_bias", action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS (-100..100) to token ID's logit; repeat for several tokens")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end the output where this text appears (not printed); repeat for several")
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help=f"print each token's log-probability and the N (0-{MAX_LOGPROBS}) most likely ones to stderr")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    constrain = p.add_mutually_exclusive_group()
    constrain.add_argument("--json", action="store_true", help="the output is a JSON object")
    constrain.add_argument("--json_schema", type=Path, default=None, metavar="FILE",
                           help="the output is JSON that matches the JSON schema in FILE")
    constrain.add_argument("--regex", default=None, metavar="PATTERN", help="the output matches this regex")
    constrain.add_argument("--grammar", type=Path, default=None, metavar="FILE",
                           help="the output matches the grammar in FILE (llguidance's Lark syntax)")
    p.add_argument("--jump_forward", action=argparse.BooleanOptionalAction, default=True,
                   help="feed the tokens a grammar forces as one chunk, not one decode step each (default: on)")


def add_parallel_args(p):
    """Tensor and pipeline parallelism under torchrun: generate.py's and serve.py's flags."""
    p.add_argument("--tp_mode", choices=TP_MODES, default="auto",
                   help="under torchrun: exact all-gathers so that a quantized model's ranks give one "
                        "process's output bit for bit; allreduce is Megatron's two all-reduces per layer, "
                        "fewer collectives, but a quantized model's text may drift from one process's; "
                        "auto (default): exact for quantized checkpoints, else allreduce (tp.py)")
    p.add_argument("--pp", type=int, default=1, metavar="N",
                   help="under torchrun: split the layers into N pipeline stages, each on its own ranks "
                        "(world = tp x pp: torchrun's ranks divided by N form each stage's tensor-parallel "
                        "group); the last stage's sampled tokens reach every rank (pipeline.py)")
    p.add_argument("--microbatches", type=int, default=1, metavar="M",
                   help="with --pp: a step's rows go through the stages in up to M parts, so that the stages run "
                        "at once; only a step of 256 tokens a part or more (a batch of prompts) is split "
                        "(default: 1: one part; pipeline.py)")
    p.add_argument("--pp_groups", type=int, default=None, metavar="G",
                   help="with --pp: decoding requests go in up to G groups whose steps are in the stages at once "
                        "(a stage runs one group's step while the next stage runs another's), groups of two "
                        "requests or more; 1: every request in each step, the stages in turn (default: N)")


def check_pipeline_args(args):
    """--pp and the flags that go with it (generate.py's and serve.py's)."""
    if args.pp < 1:
        raise UserError("--pp must be at least 1")
    if args.microbatches != 1 and (args.microbatches < 1 or args.pp == 1):
        raise UserError("--microbatches goes with --pp and must be at least 1")
    if args.pp_groups is not None and (args.pp_groups < 1 or args.pp == 1):
        raise UserError("--pp_groups goes with --pp and must be at least 1")


def add_speculation_args(p):
    p.add_argument("--draft_checkpoint", type=Path, default=None,
                   help="speculative decoding (speculative.py): this smaller or quantized model, with the "
                        "same tokenizer, proposes --speculate_k tokens that the target checks in one forward")
    p.add_argument("--draft_dtype", default=None,
                   help="the draft's weights and activations (default: --dtype). A bfloat16 draft for a float32 "
                        "target reads half the bytes per draft step; the output is still exactly the target's")
    p.add_argument("--ngram", type=int, default=None, metavar="N",
                   help="speculative decoding by prompt lookup: propose what followed the most recent earlier "
                        "occurrence of the last N tokens (then N-1, ..., 1) in the prompt and output")
    p.add_argument("--suffix", action="store_true",
                   help="speculative decoding by suffix matching (SuffixDecoding; suffix.py): propose the most "
                        "frequent continuation of the longest suffix seen earlier in the prompt and output, and in "
                        "earlier samples' and chat turns' prompts and outputs; nothing where none is likely enough")
    p.add_argument("--lookahead", nargs="?", const=LOOKAHEAD_DEFAULT, default=None, metavar="W,N,G",
                   help="speculative decoding without a proposer: lookahead decoding (lookahead.py; Fu et al. "
                        "2024). Each target forward also runs a Jacobi iteration over a window of W guesses on "
                        "N - 1 levels, which fills a pool of N-grams (with the prompt's and output's own), and "
                        "verifies up to G of them that start with the last token: 1 + (N - 1)(W + G) tokens a "
                        f"forward (default: {LOOKAHEAD_DEFAULT}, 15 tokens; the authors suggest 7,5,7 for a 7B model "
                        "on a GPU); with --adaptive_k a round runs where its candidates are expected to pay for "
                        "its cost, else a plain step (spec_cost.LookaheadPlanner); --speculate_k does not apply")
    p.add_argument("--speculate_k", type=int, default=5, help="tokens proposed per round, at most (default: 5)")
    p.add_argument("--adaptive_k", action=argparse.BooleanOptionalAction, default=True,
                   help="each round verify the number of proposals (up to --speculate_k, or none: a plain "
                        "step) that gives the most tokens per unit of time, from the measured cost of a verify "
                        "and the observed acceptance (spec_cost.py); a draft model stops drafting where it "
                        "grows unsure (default: on; --no-adaptive_k always proposes --speculate_k)")
    p.add_argument("--speculate_tree", type=int, default=0, metavar="NODES",
                   help="with --suffix, --ngram or --staged: verify a tree of up to NODES candidates (several "
                        "likely continuations, --speculate_k deep) in each forward instead of one chain, and keep "
                        "its longest accepted path (tree.py; a round that picks on the host keeps the chain); with "
                        "--adaptive_k, of each tree the nodes that pay for their cost, or none (a plain step)")
    p.add_argument("--staged", action="store_true",
                   help="with --draft_checkpoint: staged speculative decoding (staged.py): the draft proposes a "
                        "tree, its chain plus its second choice where it is unsure (--speculate_tree nodes, "
                        "default 2 x --speculate_k), and checks prompt-lookup guesses of its own chain several "
                        "tokens a forward")
    p.add_argument("--compare_plain", action="store_true",
                   help="with speculation: also decode without it and print both speeds (and, greedy, "
                        "whether the outputs are identical)")


def proposer_flags(args) -> list:
    """The speculative-decoding proposers asked for (one at most is allowed)."""
    return [flag for flag, on in (("--draft_checkpoint", args.draft_checkpoint), ("--ngram", args.ngram is not None),
                                  ("--suffix", args.suffix), ("--lookahead", args.lookahead is not None)) if on]


LOOKAHEAD_DEFAULT = "4,3,3"  # 15 tokens a forward: the compiled graph of a few queries after cached keys (<= 16)


def lookahead_sizes(text: str) -> tuple:
    """--lookahead's window W, n-gram size N and candidates G, each in its range."""
    try:
        W, N, G = (int(part) for part in text.split(","))
    except ValueError:
        raise UserError(f"--lookahead takes W,N,G, three integers (window, n-gram size, candidates), "
                        f"not {text!r}") from None
    if not (1 <= W <= 64 and 2 <= N <= 16 and 1 <= G <= 64):
        raise UserError(f"--lookahead {text}: W,N,G must satisfy 1 <= W <= 64, 2 <= N <= 16 and 1 <= G <= 64")
    return W, N, G


def verify_slots(args) -> tuple:
    """The cache slots past the last token that a round of speculation writes, and the flag that sets them."""
    if args.lookahead is not None:
        W, N, G = lookahead_sizes(args.lookahead)
        return (N - 1) * (W + G), "--lookahead"
    return (args.speculate_k, "--speculate_k") if proposer_flags(args) else (0, None)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Generate text with a checkpoint made by convert_hf_checkpoint.py or download.py.",
        epilog="Compilation (--compile) is on by default: the compiled decode step is several times "
               "faster. On CPU the eager step prints at once while the compiled one compiles on a thread "
               "(minutes the first time, cached on disk afterwards) and takes over when ready; "
               "--wait_for_compile compiles first, --no-compile never.")
    add_model_args(p)
    add_sampling_args(p)
    add_speculation_args(p)
    p.add_argument("--prompt_cache", type=Path, default=None, metavar="DIR",
                   help="keep the prompts' KV cache blocks on disk here too: a later run that meets the same "
                        "prompt beginning loads them instead of computing them")
    p.add_argument("--prompt_cache_gb", type=float, default=4.0, help="the --prompt_cache folder's size at most")
    p.add_argument("--profile", type=Path, default=None, help="write a torch.profiler trace of the last sample here")
    p.add_argument("--metrics_json", type=Path, default=None, help="write the metrics as a JSON list here")
    return p


def check_args(args):
    """The checks that need neither torch nor the checkpoint's contents (generate.parse_args adds the rest)."""
    if (args.checkpoint is None) == (args.shape is None):
        raise UserError("give either --checkpoint or --shape")
    if args.shape:
        text_only = [flag for flag, on in (("--prompt", args.prompt), ("--chat", args.chat),
                                          ("--interactive", args.interactive), ("--stop", args.stop),
                                          *((flag, True) for flag in proposer_flags(args)),
                                          ("--json", args.json or args.json_schema or args.regex or args.grammar))
                     if on]
        if text_only:
            raise UserError(f"{text_only[0]} needs a --checkpoint with a tokenizer, not a --shape")
        if args.prompt_length < 1:
            raise UserError("--prompt_length must be at least 1")
    elif args.quantize:
        raise UserError("--quantize goes with --shape; for a checkpoint run quantize.py once and load its output")
    for name in ("max_new_tokens", "num_samples", "batch_size"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name} must be at least 1")
    if not 0 <= args.temperature < math.inf:
        raise UserError("--temperature must be a finite number >= 0")
    if args.seed is not None and not 0 <= args.seed < 2 ** 63:  # tp.py sends it as an int64
        raise UserError("--seed must be in [0, 2**63)")
    if args.logprobs is not None and not 0 <= args.logprobs <= MAX_LOGPROBS:
        raise UserError(f"--logprobs must be in [0, {MAX_LOGPROBS}]")
    if args.max_seq_length is not None and args.max_seq_length < 2:
        raise UserError("--max_seq_length must be at least 2")
    if args.prompt and len(args.prompt) > 1 and args.batch_size > 1:
        raise UserError("give either several --prompt or --batch_size, not both")
    if len(proposer_flags(args)) > 1:
        given = " and ".join(proposer_flags(args))
        raise UserError(f"give one of --draft_checkpoint, --ngram, --suffix and --lookahead, not {given}")
    if args.lookahead is not None:
        lookahead_sizes(args.lookahead)
    if args.ngram is not None and args.ngram < 1:
        raise UserError("--ngram must be at least 1")
    check_pipeline_args(args)
    if args.pp > 1 and (proposer_flags(args) or args.prompt_cache or args.shape):
        raise UserError("--pp runs a --checkpoint without speculative decoding or --prompt_cache")
    if args.speculate_k < 1:
        raise UserError("--speculate_k must be at least 1")
    if args.staged and not args.draft_checkpoint:
        raise UserError("--staged needs --draft_checkpoint")
    if args.speculate_tree < 0 or (args.speculate_tree and not (args.suffix or args.ngram is not None or args.staged)):
        raise UserError("--speculate_tree takes a number of nodes >= 0 and goes with --suffix, --ngram or --staged")
    if args.draft_dtype and not args.draft_checkpoint:
        raise UserError("--draft_dtype needs --draft_checkpoint")
    if args.checkpoint is not None:
        require_dir(args.checkpoint)


def parse_args(argv=None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    check_args(args)
    return args
