"""Generate text from a checkpoint: the command line over engine.py.

    python generate.py --checkpoint checkpoints/smollm2-135m --prompt "Once upon a time"
    python generate.py --checkpoint checkpoints/smollm2-135m --chat --prompt "What is a KV cache?"
    python generate.py --checkpoint checkpoints/smollm2-135m --interactive
    python generate.py --checkpoint checkpoints/smollm2-135m --ngram 3 --chat --prompt "..."
    python generate.py --checkpoint checkpoints/smollm2-135m --suffix --chat --prompt "..."
    python generate.py --checkpoint checkpoints/smollm2-135m --lookahead 4,3,3 --chat --prompt "..."
    python generate.py --checkpoint checkpoints/smollm2-135m --chat --prompt "A person as JSON" --json_schema person.json
    python generate.py --shape llama-2-7b --quantize int4-g32 --device cuda --max_new_tokens 256 --ignore_eos
    torchrun --nproc_per_node=2 generate.py --checkpoint checkpoints/smollm2-135m --prompt "..."

Generated text goes to stdout; logs and metrics go to stderr.
"""
import contextlib
import fcntl
import os
import sys
import time
from pathlib import Path
from typing import Callable

import errors
import generate_args

if __name__ == "__main__":
    errors.run_cli(generate_args.parse_args)  # a wrong flag fails now, not after torch's seconds of importing
    errors.quiet_ctrl_c()  # Ctrl-C while torch imports exits 130 as it does later

import torch

import checkpoint
import lookahead
import shapes
import proposers
import speculative
import staged
from checkpoint import write_json
from engine import ONE_SEQUENCE, Chat, Engine, log
from loading import check_vocabulary, describe_weights, load_model, meta_model, parse_device, parse_dtype
from errors import UserError, run_cli
from grammar import Grammars
from memory import Need, activation_bytes, dtype_name, kv_cache_bytes, logits_bytes, tokens_that_fit, weight_bytes
from model import ModelArgs
from prompt_store import open_store
from rope import trained_context
from sampling import Sampling, check_sampling
from tokenizer import StopStrings, Tokenizer
from pipeline import init_from_env, leads
from tp import ranks_on_this_machine


def print_metrics(metrics: dict):
    log(f"prompt tokens {metrics['prompt_tokens']}, new tokens {metrics['new_tokens']}, "
        f"time to first token {metrics['ttft_s'] * 1000:.1f} ms")
    peak = f"peak memory {metrics['peak_memory_bytes'] / 1e9:.2f} GB"
    if metrics["decode_tokens_per_s"] == 0:  # one token, or a grammar forced the rest: no step to time
        log(f"no decode step to time (the tokens after the first were forced, or there were none); {peak}")
    else:
        eager = metrics["eager_steps"]  # steps run while the compiled step compiled aside
        eager = f" ({eager} steps eager while the compiled step compiled)" if eager else ""
        log(f"decode {metrics['decode_tokens_per_s']:.2f} tokens/s{eager}, inter-token latency median "
            f"{metrics['inter_token_latency_median_s'] * 1000:.1f} ms, "
            f"p90 {metrics['inter_token_latency_p90_s'] * 1000:.1f} ms")
        log(f"memory bandwidth {metrics['bandwidth_gb_s']:.2f} GB/s, {peak}")
    if "acceptance_histogram" in metrics:  # speculative decoding
        log(f"speculation ({metrics['proposer']}, k={metrics['speculate_k']}): "
            f"{metrics['tokens_per_target_forward']:.2f} tokens per target forward ({metrics['target_forwards']} "
            f"forwards, {metrics['plain_steps']} without a proposal), "
            f"{metrics['mean_accepted_proposals']:.2f} proposals accepted per verify")
        log("acceptance histogram (accepted proposals: verify forwards): "
            + ", ".join(f"{i}: {h}" for i, h in enumerate(metrics["acceptance_histogram"])))


def compare_with_plain(spec: speculative.SpeculativeEngine, prompts: list, max_new_tokens: int,
                       sampling: Sampling, stop_ids, metrics: dict, spec_outputs: list, options: dict) -> dict:
    """Decode the same prompt without speculation (the target's own Engine) and compare speeds
    and, greedy, the outputs. metrics: the speculative run's; options: generate's (a fresh constraint)."""
    host = options["logprobs"] is not None or sampling.adjusts
    spec.engine.warm_up(prompts, sampling, host=host, constrained=options["constraints"] is not None)
    spec.forget_prefixes()  # the plain run computes the prompt, as the speculative one did
    outputs, stats = spec.engine.generate(prompts, max_new_tokens, sampling, stop_ids, **options)
    plain = spec.engine.metrics(stats)["decode_tokens_per_s"]
    result = {"plain_decode_tokens_per_s": plain,
              "speedup": metrics["decode_tokens_per_s"] / plain if plain else 0.0}
    if sampling.temperature == 0:
        result["identical_to_plain"] = outputs == spec_outputs
    log(f"plain decoding {plain:.2f} tokens/s: speculation is {result['speedup']:.2f}x"
        + ({True: ", output identical", False: ", OUTPUT DIFFERS"}[result["identical_to_plain"]]
           if "identical_to_plain" in result else ""))
    return result


class TextRows:
    """Each row's text as its tokens arrive, cut at a stop string (on_tokens for Engine.generate:
    returns the rows a stop string ended); a single row is printed as it comes."""

    def __init__(self, tokenizer: Tokenizer, rows: int, stop_ids, stop_strings=(), print_row: bool = False):
        self.rows = [StopStrings(tokenizer, stop_strings) for _ in range(rows)]
        self.stop_ids, self.print_row, self.printed = set(stop_ids), print_row, 0

    def __call__(self, ids) -> list:
        ended = [b for b, token in enumerate(ids)
                 if token is not None and token not in self.stop_ids and self.rows[b].push(token)]
        if self.print_row:
            self.write(self.rows[0].ready())
        return ended

    def write(self, text: str):
        if len(text) > self.printed:
            sys.stdout.write(text[self.printed:])
            sys.stdout.flush()
            self.printed = len(text)

    def finish(self) -> list:
        texts = [r.finish() for r in self.rows]
        if self.print_row:
            self.write(texts[0])
            sys.stdout.write("\n")
        else:  # several rows: each under a line of its own, so that texts with newlines stay apart
            for b, text in enumerate(texts):
                print(f"--- row {b + 1} of {len(texts)} ---\n{text}", flush=True)
        return texts


def print_logprobs(tok: Tokenizer, logprobs: list):
    """Each generated token with its logprob and the most likely alternatives (stderr)."""
    for row, entries in enumerate(logprobs):
        log(f"logprobs of row {row}:" if len(logprobs) > 1 else "logprobs:")
        for chosen, top in entries:
            log(f"  {chosen:9.4f}  " + "  ".join(f"{tok.decode([t])!r} {lp:.4f}" for t, lp in top))


def parse_args(argv=None):
    """generate_args' flags, checked, and what they need torch for: the defaults that depend on
    CUDA, the --quantize label, a speculative run's single sequence."""
    args = generate_args.parse_args(argv)
    cuda = torch.cuda.is_available()
    args.device = args.device or ("cuda" if cuda else "cpu")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    if args.quantize:
        shapes.parse_quantization(args.quantize)
    if generate_args.proposer_flags(args) and (args.batch_size > 1 or (args.prompt and len(args.prompt) > 1)):
        raise UserError(ONE_SEQUENCE)
    return args


def parse_sampling(args) -> Sampling:
    bias = []
    for item in args.logit_bias:
        token, sep, value = item.partition("=")
        try:
            bias.append((int(token), float(value)))
        except ValueError:
            raise UserError(f"--logit_bias {item!r}: expected ID=BIAS, e.g. 28=-100") from None
    return Sampling(args.temperature, args.top_k, args.top_p, args.min_p, args.repetition_penalty,
                    args.presence_penalty, args.frequency_penalty, tuple(bias))


def read_constraint(args, tok: Tokenizer, vocab_size: int):
    """The compiled grammar the flags ask for, and its Grammars (None, None without one)."""
    if args.json:
        kind, spec = "json_object", None
    elif args.json_schema:
        kind, spec = "json_schema", read_text(args.json_schema, "--json_schema")
    elif args.regex is not None:
        kind, spec = "regex", args.regex
    elif args.grammar:
        kind, spec = "grammar", read_text(args.grammar, "--grammar")
    else:
        return None, None
    grammars = Grammars(args.checkpoint, vocab_size, tok.eos_ids)
    return grammars, grammars.compile(kind, spec)


def read_text(path: Path, flag: str) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{flag}: cannot read {path} ({e.strerror if isinstance(e, OSError) else e})") from None


def encode_prompts(tok: Tokenizer, args, config: ModelArgs) -> list:
    """Each prompt's token ids; an empty prompt is the model's BOS token alone (generation from scratch)."""
    texts = args.prompt or ["Hello, my name is"]
    if args.chat:
        system = [{"role": "system", "content": args.system}] if args.system else []
        texts = [tok.apply_chat_template(system + [{"role": "user", "content": t}]) for t in texts]
        prompts = [tok.encode(t, add_bos=False) for t in texts]  # the template writes any BOS itself
    else:
        prompts = [tok.encode(t) for t in texts]
    bos = config.bos_token_id if config.bos_token_id is not None else tok.bos_id
    if any(not p for p in prompts):
        if bos is None:
            raise UserError("the prompt is empty and this model has no BOS token to start from "
                            "(neither config.json's bos_token_id nor the tokenizer's): give some text")
        prompts = [p or [bos] for p in prompts]
    past = next((t for p in prompts for t in p if t >= config.vocab_size), None)
    if past is not None:  # a special token typed as text, past the embedding
        raise UserError(f"the prompt holds token {past} ({tok.decode([past])!r}), past the model's vocabulary "
                        f"of {config.vocab_size}")
    prompts = prompts * args.batch_size if len(prompts) == 1 else prompts
    longest = max(len(p) for p in prompts)
    if args.max_seq_length is not None and longest >= args.max_seq_length:
        raise UserError(f"the prompt has {longest} tokens, more than --max_seq_length {args.max_seq_length} allows")
    if args.max_seq_length is not None and longest + args.max_new_tokens > args.max_seq_length:
        raise UserError(f"prompt ({longest} tokens) + --max_new_tokens ({args.max_new_tokens}) exceeds "
                        f"--max_seq_length {args.max_seq_length}")
    return prompts


def cache_length(args, config: ModelArgs, prompts) -> int:
    """The KV cache's length: --max_seq_length, or what the prompts, --max_new_tokens and a
    verify's k slots past the last token need, rounded up to 256 so that nearby lengths share one
    compiled graph (4096 interactive); past the model's trained context only with --extend_context."""
    context = trained_context(config)
    if args.max_seq_length is not None:
        length = need = args.max_seq_length
        asked = f"--max_seq_length {need}"
    elif prompts is None:
        return min(4096, context)
    else:
        longest = max(len(p) for p in prompts)
        spare, flag = generate_args.verify_slots(args)
        need = longest + args.max_new_tokens + spare
        asked = f"the prompt ({longest} tokens) + --max_new_tokens ({args.max_new_tokens})" + \
            (f" + {flag} ({spare})" if spare else "")
        length = max(min(-(-need // 256) * 256, context), need)
    if need > context:
        where = f"the model's trained context of {context} tokens (max_position_embeddings in config.json" + \
            (", with its RoPE scaling)" if context != config.max_position_embeddings else ")")
        if not args.extend_context:
            raise UserError(f"{asked} is past {where}: lower it, or pass --extend_context to go past it anyway")
        log(f"warning: {asked} is past {where}; the output usually degrades there")
    return length


def report(tok: Tokenizer, stats, constrained: bool):
    """After the text: logprobs, and an error (exit 1) for output that is not a complete match of
    the grammar because --max_new_tokens ran out."""
    if stats.logprobs:
        print_logprobs(tok, stats.logprobs)
    for row, reason in enumerate(stats.finish_reasons):
        if reason == "error":
            raise UserError(f"row {row}: the grammar rejected the output")
        if constrained and reason == "length":
            raise UserError(f"row {row}: --max_new_tokens ran out before the output completed the "
                            "grammar (the output above is incomplete)")


def run_interactive(engine, tok: Tokenizer, args, sampling: Sampling, options) -> list:
    chat = Chat(engine, tok, system=args.system)
    log("interactive chat: type a message, an empty line or Ctrl-D ends")
    all_metrics = []
    while True:
        sys.stderr.write("> ")
        sys.stderr.flush()
        line = sys.stdin.readline()
        if not line.strip():
            break
        stream = TextRows(tok, 1, tok.eos_ids, args.stop, print_row=True)
        turn = options(1)
        _, stats = chat.reply(line.rstrip("\n"), args.max_new_tokens, sampling, on_tokens=stream, **turn)
        stream.finish()
        report(tok, stats, turn["constraints"] is not None)
        metrics = engine.metrics(stats)
        metrics["conversation_tokens"], metrics["prefilled_tokens"] = chat.last_prompt_tokens, chat.last_prefill_tokens
        print_metrics(metrics)
        all_metrics.append(metrics)
    return all_metrics


def memory_needs(args, prompts, max_seq_length: int, dtype, draft_dtype) -> Callable:
    """For load_model's memory check, what the run allocates beside the target's weights, given the
    target as it is built (a rank's shard): a KV cache for one sequence at least (more sequences
    than memory holds run in turns), the batch's logits, a prompt's activations, and a draft's
    weights and KV cache (every rank holds the whole draft)."""
    batch = len(prompts) if prompts else 1
    prompt_tokens = max(len(p) for p in prompts) if prompts else max_seq_length  # a chat turn: the conversation
    length = "--max_seq_length" if args.max_seq_length is not None or args.interactive else "--max_new_tokens"
    several = "--batch_size" if args.batch_size > 1 else "--prompt" if batch > 1 else None
    lower_rows = {"--batch_size": "lower --batch_size", "--prompt": "give fewer --prompt", None: None}[several]
    lower_cache = f"lower --batch_size or {length}" if several == "--batch_size" else \
        f"give fewer --prompt or lower {length}" if several else f"lower {length}"
    rows = f"{batch} sequences" if batch > 1 else "1 sequence"
    draft = meta_model(checkpoint.read_config(args.draft_checkpoint)) if args.draft_checkpoint else None

    def needs(model) -> list:
        out = [Need("the KV cache", kv_cache_bytes(model, 1, max_seq_length, dtype), f"lower {length}",
                    f" for one sequence of {max_seq_length} tokens"),
               Need("the logits", logits_bytes(model.args.vocab_size, batch), lower_rows or lower_cache, f" of {rows}"),
               Need("the prefill", activation_bytes(model.args, prompt_tokens, prompt_tokens, dtype),
                    "lower --max_seq_length" if args.interactive else "shorten the prompt",
                    f" of {prompt_tokens} tokens")]
        if draft is not None:
            out += [Need("the draft's weights", weight_bytes(draft, draft_dtype),
                         "pass a smaller --draft_dtype or a smaller --draft_checkpoint", f" in {dtype_name(draft_dtype)}"),
                    Need("the draft's KV cache", kv_cache_bytes(draft, 1, max_seq_length, draft_dtype),
                         f"lower {length}", f" of {max_seq_length} tokens")]
        return out
    return needs


def cache_tokens(args, tp, device, dtype, rows: int, max_seq_length: int) -> int:
    """The KV cache's tokens: every row's if the memory left beside the weights (of this rank's
    shard) and a step's logits and activations holds it, else fewer (at least one sequence's): the
    rows then run in turns."""
    config = shapes.shape_args(args.shape) if args.shape else checkpoint.read_config(args.checkpoint)
    if args.shape and args.quantize:
        return rows * max_seq_length  # (a shape's quantized size: its preflight checks one sequence)
    meta = meta_model(config, tp)
    reserve = weight_bytes(meta, dtype) + logits_bytes(config.vocab_size, rows) + \
        activation_bytes(config, max_seq_length, max_seq_length, dtype)
    ranks = ranks_on_this_machine() if tp is not None and device.type == "cpu" else 1
    tokens = tokens_that_fit(meta, dtype, rows * max_seq_length, max_seq_length, device, reserve, ranks)
    if tokens < rows * max_seq_length:
        log(f"the KV cache holds {tokens} tokens, not {rows} x {max_seq_length}: the sequences run in turns")
    return tokens


def load(tp, checkpoint_dir, device, dtype, shard: bool = True, needs=None):
    """Under torchrun every rank loads its shard (or, shard=False, the whole model); if one
    fails, all stop with its message."""
    if tp is not None:
        return tp.all_ranks_ok(load_model, checkpoint_dir, device, dtype, tp=tp if shard else None, needs=needs)
    return load_model(checkpoint_dir, device, dtype, needs=needs)


def build_engine(args, tp, device, dtype, draft_dtype, rows: int, max_seq_length: int, needs=None):
    """The target's Engine for rows sequences of max_seq_length tokens, wrapped in a
    SpeculativeEngine when a proposer is asked for; needs: the run's other buffers, checked with
    the target's weights before they load (memory_needs)."""
    start = time.perf_counter()
    kv_tokens = cache_tokens(args, tp, device, dtype, rows, max_seq_length)
    if args.shape:
        model = shapes.random_model(args.shape, device, dtype, args.quantize, needs=needs)
    else:
        model = load(tp, args.checkpoint, device, dtype, needs=needs)
    made = f"made {args.shape} with random weights" if args.shape else f"loaded {args.checkpoint}"
    log(f"{made} ({model.args.architecture}, {describe_weights(model, args.dtype, device, args.checkpoint)}) "
        f"in {time.perf_counter() - start:.1f} s")
    # every prompt in one chunk (as a request's first forward), each step attending over the whole
    # length: one compiled graph; the rows' tokens sampled inside it where they can be
    engine = Engine(model, rows, max_seq_length, kv_tokens, compile=args.compile, compile_prefill=args.compile_prefill,
                    compile_mode=args.compile_mode, prefill_chunk=max_seq_length, kv_buckets=False)
    if args.prompt_cache is not None and not args.shape:
        open_store(args.prompt_cache, args.checkpoint, model, engine, tp.rank if tp is not None else 0,
                   int(args.prompt_cache_gb * 2 ** 30))
    if args.ngram is not None:
        proposer = proposers.NgramProposer(args.ngram)
    elif args.suffix:
        proposer = proposers.SuffixProposer()
    elif args.lookahead is not None:
        proposer = lookahead.LookaheadProposer(*generate_args.lookahead_sizes(args.lookahead))
    elif args.draft_checkpoint:  # under torchrun every rank holds the whole (small) draft
        draft = load(tp, args.draft_checkpoint, device, draft_dtype, shard=False)
        log(f"loaded draft {args.draft_checkpoint} "
            f"({describe_weights(draft, args.draft_dtype or args.dtype, device, args.draft_checkpoint)})")
        drafting = staged.StagedProposer if args.staged else proposers.DraftProposer
        proposer = drafting(draft, compile=args.compile, compile_mode=args.compile_mode)
    else:
        return engine
    k = proposer.N - 1 if args.lookahead is not None else args.speculate_k  # (lookahead: its longest path)
    tree_nodes = args.speculate_tree or (2 * args.speculate_k if args.staged else 0)
    return speculative.SpeculativeEngine(engine, proposer, k, compile=args.compile,
                                         compile_mode=args.compile_mode, adaptive=args.adaptive_k,
                                         tree_nodes=tree_nodes)


def main(argv=None):
    args = parse_args(argv)
    # under torchrun: this rank's shard (tp.py), of its stage's layers with --pp (pipeline.py), and device
    tp, args.device = init_from_env(args.device, args.tp_mode, args.pp, args.microbatches, args.pp_groups)
    if tp is not None and args.interactive:
        raise UserError("--interactive is not supported with tensor parallelism (torchrun)")
    device, dtype = parse_device(args.device), parse_dtype(args.dtype)
    draft_dtype = parse_dtype(args.draft_dtype) if args.draft_dtype else dtype
    if tp is not None and args.shape:
        raise UserError("--shape runs in one process, not under torchrun")
    seed = tp.same_seed(args.seed) if tp is not None else args.seed  # ranks must sample the same tokens
    if seed is not None:
        torch.manual_seed(seed)
    if args.shape:  # no tokenizer: token ids in and out
        tok, config = shapes.TokenIds(), shapes.shape_args(args.shape)
        prompts = [shapes.random_prompt(args.shape, args.prompt_length)] * args.batch_size
        grammars = grammar = None
    else:
        checkpoint.require_dir(args.checkpoint)
        tok = Tokenizer(args.checkpoint)
        config = checkpoint.read_config(args.checkpoint)
        check_vocabulary(tok, config, args.checkpoint)
        grammars, grammar = read_constraint(args, tok, config.vocab_size)  # a bad schema fails before the weights load
        prompts = None if args.interactive else encode_prompts(tok, args, config)  # lengths checked before loading
    sampling = parse_sampling(args)
    check_sampling(sampling, config.vocab_size)
    max_seq_length = cache_length(args, config, prompts)
    if args.draft_checkpoint:
        proposers.check_same_tokenizer(args.checkpoint, args.draft_checkpoint)
    engine = build_engine(args, tp, device, dtype, draft_dtype, len(prompts) if prompts else 1, max_seq_length,
                          memory_needs(args, prompts, max_seq_length, dtype, draft_dtype))
    engine.jump_forward = args.jump_forward
    stop_ids = [] if args.ignore_eos else sorted(set(engine.model.args.eos_token_ids) | set(tok.eos_ids))

    def options(rows: int) -> dict:
        """Engine.generate's per-call options: a fresh constraint per row, logprobs."""
        return {"constraints": [grammars.constraint(grammar) for _ in range(rows)] if grammar else None,
                "logprobs": args.logprobs}

    host = sampling.adjusts or args.logprobs is not None  # the compiled step returns logits
    if args.profile is not None and device.type == "cuda":  # before any capture: kernels inside CUDA graphs show
        torch.profiler._utils._init_for_cuda_graphs()
    compiling = engine.warm_up(prompts, sampling, host=host, constrained=bool(grammar), aside=not waits(args, tp, device))
    if args.interactive:
        all_metrics = run_interactive(engine, tok, args, sampling, options)
    else:
        all_metrics = []
        with timing_turn():
            for i in range(args.num_samples):
                all_metrics.append(run_sample(engine, tok, args, prompts, sampling, stop_ids, options, tp,
                                              profiling=i == args.num_samples - 1, constrained=grammar is not None))
    if compiling is not None and compiling.is_alive():
        log("the run ended before the compiled step was ready: it stepped eagerly throughout "
            "(--wait_for_compile compiles first, and caches the graphs on disk for later runs)")
    if args.metrics_json and leads():
        write_json(args.metrics_json, all_metrics)


def waits(args, tp, device) -> bool:
    """Whether the run compiles before its first token: where it times samples, where CUDA graphs
    record with the device to themselves, and where tensor-parallel ranks would draft apart."""
    return (args.wait_for_compile or args.num_samples > 1 or args.profile is not None or args.compare_plain
            or device.type != "cpu" or (tp is not None and args.draft_checkpoint is not None))


def timing_turn():
    """With MINILLM_TIMING_LOCK=FILE (scripts/bench.py --shape), processes that built and compiled
    side by side time their samples one at a time: each says it is ready (FILE.ready.PID), then
    takes FILE's lock, which it holds until it exits (so that its exit overlaps no other's samples)."""
    path = os.environ.get("MINILLM_TIMING_LOCK")
    if path:
        Path(f"{path}.ready.{os.getpid()}").touch()
        held = open(path, "a")  # noqa: SIM115 - closed, and the lock released, when the process exits
        fcntl.flock(held, fcntl.LOCK_EX)
        TIMING_LOCK.append(held)
    return contextlib.nullcontext()


TIMING_LOCK = []  # the lock file timing_turn holds


def run_sample(engine, tok, args, prompts: list, sampling: Sampling, stop_ids, options, tp,
               profiling: bool, constrained: bool) -> dict:
    """One generate call over the prompts: the text printed, its metrics returned; profiling (the last
    sample, with --profile) writes its trace, and the table of its operators beside it (.txt)."""
    profiling = profiling and args.profile is not None and (tp is None or tp.rank == 0)
    profiler = torch.profiler.profile() if profiling else contextlib.nullcontext()
    engine.forget_prefixes()  # every sample computes its prompt: its time to first token is a cold one
    text = TextRows(tok, len(prompts), stop_ids, args.stop, print_row=len(prompts) == 1)
    with profiler:
        outputs, stats = engine.generate(prompts, args.max_new_tokens, sampling, stop_ids, on_tokens=text,
                                         **options(len(prompts)))
    text.finish()
    report(tok, stats, constrained)
    if profiling:
        profiler.export_chrome_trace(str(args.profile))
        sort = "self_cuda_time_total" if engine.device.type == "cuda" else "self_cpu_time_total"
        args.profile.with_suffix(".txt").write_text(profiler.key_averages().table(sort_by=sort, row_limit=40))
        log(f"wrote profiler trace to {args.profile} and its table to {args.profile.with_suffix('.txt')}")
    metrics = engine.metrics(stats)
    if args.compare_plain and isinstance(engine, speculative.SpeculativeEngine):
        metrics.update(compare_with_plain(engine, prompts, args.max_new_tokens, sampling, stop_ids,
                                          metrics, outputs, options(len(prompts))))
    if tp is not None:
        metrics.update(tp.rank_metrics(metrics, engine.model))
    print_metrics(metrics)
    return metrics


if __name__ == "__main__":
    run_cli(main)
