"""An OpenAI-compatible HTTP server over engine.Engine: continuous batching over a paged KV cache,
a prefix cache shared by the requests.

    python serve.py --checkpoint checkpoints/smollm2-135m [--port 8000]
    curl localhost:8000/v1/chat/completions --json '{"messages": [{"role": "user", "content": "Hi"}]}'

The official `openai` client works against it (base_url="http://127.0.0.1:8000/v1"):
/v1/completions and /v1/chat/completions, streamed (server-sent events) or not, /v1/models,
/health, and /metrics in Prometheus text. Sampling takes OpenAI's and vLLM's controls (penalties,
logit_bias, min_p, top_k, seed) and returns logprobs; /v1/completions' `echo` returns the prompt
too, and with `logprobs` its tokens' log-probabilities (`max_tokens` 0: the prompt alone), as
evaluation harnesses (lm-evaluation-harness's local-completions) score likelihoods.

Structured output (grammar.py, llguidance): `response_format` json_object or json_schema (so
`client.chat.completions.parse(response_format=PydanticModel)` works), or the extra body fields
`regex` or `grammar` (llguidance's Lark; vLLM's `guided_regex`, `guided_grammar`, `guided_json` too).
Tools: the chat template is given `tools` (a template that describes tools puts them in the prompt);
with `tool_choice` "required" or naming a function, the output is constrained to a call (its
`parameters` schema) and comes back as `tool_calls`; with "auto" or "none" the reply is plain text
(no tool call is detected in free text). A conversation may carry an assistant's `tool_calls` and
the `tool` messages that answer them.

The main thread owns the model and calls Engine.step() while there is work. The HTTP side
(openai_api.py: Starlette on uvicorn's asyncio loop, in a thread of its own) checks each request,
submits it, and receives its text through an asyncio.Queue that the engine feeds with
loop.call_soon_threadsafe. Under torchrun, rank 0 serves HTTP and sends every step's plan to the
other ranks, which run the same forward passes on their shards; send SIGTERM to rank 0's process
for a graceful stop (torchrun treats a SIGTERM of its own as a failure and ends every rank at once).
A rank or host lost mid-way (liveness.py) ends the server: its open requests get an error naming
the lost rank, and it exits with status 1.

Speculative decoding (--speculative ngram|suffix|draft|lookahead, speculation.py): a request's
proposals ride in the batched step beside the other rows and each accepts its own count; the greedy
text is the same as without. A request opts out with the extra field `"speculative": false`; one
with a grammar, logprobs, penalties, logit_bias or a seed runs without proposals.
    --speculative draft --draft_checkpoint D: a smaller model with the same tokenizer drafts for every
    speculating request in batched forwards, each in a row of its own KV cache (draft_rows.py).
    --speculative lookahead [--lookahead W,N,G]: lookahead decoding's rounds, chunks of the step,
    while one request decodes (speculation.LookaheadRounds).
"""
import collections
import gc
import queue
import signal
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Callable, Optional

import errors
import script_args

if __name__ == "__main__":
    errors.run_cli(script_args.parse_serve_args)  # a wrong flag fails now, not after torch's seconds of importing
    errors.quiet_ctrl_c()  # Ctrl-C while torch imports exits 130 as it does later

import torch

import checkpoint
import kernels
import liveness
import proposers
import warmup
from draft_rows import DraftRows
from engine import BLOCK_SIZE, Engine, log
from forwards import landed
from loading import check_vocabulary, describe_weights, load_model, meta_model, parse_device, parse_dtype, preflight
from errors import UserError, run_cli
from memory import Need, activation_bytes, kv_cache_bytes, logits_bytes
from openai_api import Server, build_app
from prompt_store import open_store
from rope import recompute_position, trained_context
from scheduler import StepPlan
from generate_args import lookahead_sizes
from speculation import Speculation
from speculative import tree_plans
from tokenizer import Tokenizer
from tp import TIMEOUT_S
from pipeline import init_from_env, leads


# ---------------------------------------------------------------- start-up

def memory_needs(model, args, dtype) -> list:
    """What the engine allocates beside the weights, given the model as load_model builds it (a
    rank's shard): the KV cache's blocks and a scratch block, a step's logits (a row per running
    request), and a step's activations (a prefill chunk, or a row per request) with one layer's keys
    and values that its rows gather."""
    rows, length = args.max_batch_size + 1, args.max_seq_length
    cache = kv_cache_bytes(model, 1, kv_tokens(args) + BLOCK_SIZE, dtype)
    step = max(min(args.prefill_chunk, length), rows)  # tokens in one forward
    return [Need("the KV cache", cache, "lower --kv_cache_tokens (or --max_batch_size, --max_seq_length)",
                 f" for {kv_tokens(args)} tokens"),
            Need("the logits", logits_bytes(model.args.vocab_size, rows), "lower --max_batch_size", f" of {rows} rows"),
            Need("a step's activations", activation_bytes(model.args, step, length, dtype) + cache // len(model.layers),
                 "lower --prefill_chunk, --max_batch_size or --max_seq_length"),
            Need("oneDNN's copy of the float weights", kernels.prepack_bytes(model, parse_device(args.device), dtype)
                 if args.prepack else 0, "pass --no-prepack")]


def check_context(args, config):
    """--max_seq_length within the model's trained context, unless --extend_context (with a warning)."""
    context = trained_context(config)
    if args.max_seq_length > context:
        where = f"--max_seq_length {args.max_seq_length} is past the model's trained context of {context} tokens"
        if not args.extend_context:
            raise UserError(f"{where}: lower it, or pass --extend_context to go past it anyway")
        log(f"warning: {where}; the output usually degrades there")


def kv_tokens(args) -> int:
    return args.kv_cache_tokens or args.max_batch_size * args.max_seq_length


def warm_up(engine: Engine, aside: bool = False) -> Optional[threading.Thread]:
    """Compile the step before serving, or (aside) on a thread of its own while the eager step
    serves: the server answers within seconds and reaches the compiled speed when the graphs are
    ready (or found in the on-disk cache)."""
    if not engine.compiled:
        return
    plans = warmup.serve_plans(engine)
    rounds = engine.speculation.rounds if engine.speculation is not None else None
    if rounds is not None:  # a lookahead round's forward: a mask, a graph of its own
        plans += tree_plans(engine, rounds.size - 1)
    return warmup.compile_aside(engine, plans) if aside else warmup.compile_now(engine, plans)


def load_engine(args, tp) -> tuple[Tokenizer, Engine]:
    """The checkpoint's tokenizer and an Engine over its model, after the checks that can fail
    before the weights load (under torchrun: this rank's shard)."""
    device, dtype = parse_device(args.device), parse_dtype(args.dtype)
    checkpoint.require_dir(args.checkpoint)
    if args.speculative in ("draft", "lookahead") and tp is not None:  # (rank 0 drafts, and compacts paths)
        raise UserError(f"--speculative {args.speculative} runs in one process, not under torchrun")
    if args.speculative == "draft":
        proposers.check_same_tokenizer(args.checkpoint, args.draft_checkpoint)
    config = checkpoint.read_config(args.checkpoint)
    switch = recompute_position(config)
    args.max_seq_length = args.max_seq_length or min(4096, trained_context(config), switch or 4096)
    if switch is not None and args.max_seq_length > switch:  # before the model loads
        raise UserError(f"max_seq_length {args.max_seq_length} is past this LongRoPE model's original context "
                        f"({switch} tokens), where every cached key would be computed again: use at most {switch}")
    needs = lambda model: memory_needs(model, args, dtype)  # noqa: E731
    # before the context check, as the memory error names both flags that lower it; under torchrun
    # each rank checks its own shard as it loads
    if tp is None:
        preflight(meta_model(config), args.checkpoint, device, dtype, needs)
    check_context(args, config)
    tokenizer = Tokenizer(args.checkpoint)
    check_vocabulary(tokenizer, config, args.checkpoint)
    start = time.perf_counter()
    model = (tp.all_ranks_ok(load_model, args.checkpoint, device, dtype, tp=tp, needs=needs) if tp is not None
             else load_model(args.checkpoint, device, dtype))
    weights = describe_weights(model, args.dtype, device, args.checkpoint)
    log(f"loaded {args.checkpoint} ({model.args.architecture}, {weights}) in {time.perf_counter() - start:.1f} s")
    draft = load_draft(args, model, device, dtype) if args.speculative == "draft" else None
    engine = Engine.for_serving(model, args.max_batch_size, args.max_seq_length, kv_tokens=kv_tokens(args),
                                compile=args.compile, compile_mode=args.compile_mode, prefill_chunk=args.prefill_chunk,
                                max_waiting=args.max_waiting, prefix_caching=args.prefix_reuse, prepack=args.prepack,
                                speculation=Speculation(args.speculative, args.speculate_k, draft,
                                                        lookahead_sizes(args.lookahead)) if args.speculative else None)
    if args.prompt_cache is not None and engine.blocks.prefix_caching:
        open_store(args.prompt_cache, args.checkpoint, model, engine, tp.rank if tp is not None else 0,
                   int(args.prompt_cache_gb * 2 ** 30))
    return tokenizer, engine


def load_draft(args, target, device, dtype) -> DraftRows:
    """--draft_checkpoint's model (float or quantized), in rows of a cache of its own: one per request."""
    rows, length = args.max_batch_size, args.max_seq_length
    cache = lambda draft: [Need("the draft's KV cache", kv_cache_bytes(draft, rows, length, dtype),  # noqa: E731
                                "lower --max_batch_size or --max_seq_length", f" for {rows} x {length} tokens")]
    start = time.perf_counter()
    draft = load_model(args.draft_checkpoint, device, dtype, needs=cache)
    if draft.args.vocab_size != target.args.vocab_size:
        raise UserError(f"the draft's vocabulary ({draft.args.vocab_size}) differs from the target's "
                        f"({target.args.vocab_size})")
    weights = describe_weights(draft, args.dtype, device, args.draft_checkpoint)
    log(f"loaded draft {args.draft_checkpoint} ({weights}) in {time.perf_counter() - start:.1f} s")
    return DraftRows(draft, rows, length)


def lead_or_follow(engine: Engine) -> bool:
    """Under torchrun: rank 0 sends every step's plan to the other ranks (True: it serves); the
    others run each plan it sends until it stops (False). The plans go in a group of their own,
    which a thread of each other rank receives as they come."""
    import torch.distributed as dist
    # on the CPU (gloo) whatever the device: its collectives on a thread never interleave with the step's
    plans = dist.new_group(list(range(dist.get_world_size())), timeout=timedelta(seconds=TIMEOUT_S), backend="gloo")

    def broadcast(plan):
        dist.broadcast_object_list([plan], src=0, group=plans)

    def receive():
        box = [None]
        dist.broadcast_object_list(box, src=0, group=plans)
        return box[0]

    if not leads():
        follow(engine, receive)  # the warm-up's steps first, then every step rank 0 plans
        return False
    engine.broadcast = broadcast
    return True


def follow(engine: Engine, receive: Callable):
    """Run every plan receive() returns, until None. A thread receives them as rank 0 sends them, so
    that rank 0 does not wait for this rank to finish a step before it sends the next (with decoding
    groups it runs one group's step while this rank runs another's); a step's result is waited for
    `groups` steps later, as rank 0 collects it."""
    received = queue.Queue()

    def receiving():
        try:
            while (plan := receive()) is not None:
                received.put(plan)
        except BaseException as e:  # noqa: BLE001: raised on the stepping thread
            received.put(e)
        received.put(None)

    threading.Thread(target=receiving, name="plans", daemon=True).start()
    flights = collections.deque()
    with torch.inference_mode():
        while (plan := received.get()) is not None:
            if isinstance(plan, BaseException):
                raise plan
            flights.append(engine.run(plan, fly=engine.groups > 1)[0])
            if len(flights) >= engine.groups:
                landed(flights.popleft())
        for out in flights:
            landed(out)


# ---------------------------------------------------------------- serving

# on the main thread: PyTorch's OpenMP compute runs about 1.5x slower when started from another
# thread on this CPU; the HTTP server runs on its own thread
def engine_loop(engine: Engine, serving: Callable[[], bool]):
    """Step the engine while `serving()` says so; then end what is left."""
    idle = 0.0
    while serving():
        engine.wakeup.clear()
        if not engine.has_work():
            if engine.wakeup.wait(timeout=0.5):
                idle = 0.0
            elif engine.broadcast is not None and (idle := idle + 0.5) >= 10:
                idle = 0.0
                engine.broadcast(StepPlan())  # idle: keep the other ranks' collective from timing out
            continue
        try:
            engine.step()
        except Exception:  # a bug in scheduling: end what runs, keep serving
            log("engine: " + traceback.format_exc())
            engine.abort_all("error", "internal error in the engine")
    engine.abort_all("cancelled")  # shutting down: end what is left


def serve(args, engine: Engine, tokenizer: Tokenizer):
    """Serve HTTP on a thread of its own and step the engine on this one, until a signal stops both."""
    import uvicorn

    name = args.model_name or Path(args.checkpoint).resolve().name
    server = Server(engine, tokenizer, name, args.api_key, args.checkpoint)
    try:
        server.grammars()  # now rather than in the first constrained request
    except UserError as e:
        log(f"constrained output is off: {e}")
    # loading and compiling leave ~700,000 objects that live as long as the server; frozen, the
    # cyclic collector stops walking them (a full collection over them pauses every stream ~0.5 s)
    gc.collect()
    gc.freeze()
    log(f"serving {name} on http://{args.host}:{args.port}/v1 ({args.max_batch_size} requests at once, "
        f"{args.max_seq_length} tokens each at most, {kv_tokens(args)} tokens of KV cache)")
    app = build_app(server)
    if args.cors_origins:  # Starlette's own: answers the preflight OPTIONS and adds the Access-Control headers
        from starlette.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=[o.strip() for o in args.cors_origins.split(",")],
                           allow_methods=["GET", "POST"], allow_headers=["*"])
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=args.shutdown_timeout)
    http = uvicorn.Server(config)
    http_thread = threading.Thread(target=http.run, name="http")
    http_thread.start()

    def on_signal(sig, frame):  # stop accepting; running requests finish (for --shutdown_timeout at most)
        http.should_exit = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        engine_loop(engine, http_thread.is_alive)
    finally:
        http.should_exit = True
        http_thread.join(timeout=args.shutdown_timeout + 5)
        if engine.broadcast is not None:
            engine.broadcast(None)  # the other ranks stop following
    log("serve: stopped")


def main(argv=None):
    args = script_args.parse_serve_args(argv)
    cuda = torch.cuda.is_available()  # the defaults that depend on CUDA
    args.device = args.device or ("cuda" if cuda else "cpu")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    tp, args.device = init_from_env(args.device, args.tp_mode, args.pp, args.microbatches, args.pp_groups)
    tokenizer, engine = load_engine(args, tp)
    aside = args.compile and not args.wait_for_compile and engine.device.type == "cpu"
    if aside:  # under torchrun on every rank, which take the graphs up at the same step
        warm_up(engine, aside=True)
    if tp is not None and not lead_or_follow(engine):
        return
    liveness.on_lost(lambda why: engine.abort_all("error", why))  # a lost rank: the open requests get its error
    if args.compile and not aside:  # CUDA graphs are recorded with the device to themselves
        warm_up(engine)
    serve(args, engine, tokenizer)


if __name__ == "__main__":
    run_cli(main)
