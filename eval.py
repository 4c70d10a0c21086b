"""Perplexity of any checkpoint (float or quantized) over a text, with a sliding window.

    python eval.py --checkpoint checkpoints/smollm2-135m
    python eval.py --checkpoint checkpoints/smollm2-135m-int4-g32 --text data/hamlet.txt

Windows of --window tokens start every --stride tokens; each window scores only the tokens that
the previous one did not, so every token after the first is scored exactly once and, past the
first window, with at least window - stride tokens of context. Perplexity = exp(mean negative
log-likelihood). Progress goes to stderr; the last line of stdout is `perplexity 12.345`.
The default text is Shakespeare's Hamlet (public domain, from Project Gutenberg; about 53k
SmolLM2 tokens), see data/README.md.
"""
import math

import errors
import script_args

if __name__ == "__main__":
    errors.run_cli(script_args.parse_eval_args)  # a wrong flag fails now, not after torch's seconds of importing
    errors.quiet_ctrl_c()  # Ctrl-C while torch imports exits 130 as it does later

import torch
import torch.nn.functional as F
from torch import Tensor

import checkpoint
from engine import Engine, log
from errors import UserError, run_cli
from loading import check_vocabulary, load_model, parse_device, parse_dtype
from memory import Need, activation_bytes, kv_cache_bytes, logits_bytes
from progress import Lines, progress as progress_bar
from rope import trained_context
from scheduler import Request
from tokenizer import Tokenizer


@torch.inference_mode()
def perplexity(model, ids: list, window: int, stride: int, chunk: int = 0,
               progress: bool = False) -> tuple[float, int]:
    """(perplexity, tokens scored) of the token ids under the model. Each window is a request of
    the engine's, fed through its steps (Engine.feed: every token's logits); chunk > 0: `chunk`
    tokens at a time, through the KV cache, as decoding does. progress: a bar over the windows on
    stderr, when it is a terminal."""
    engine = Engine(model, 1, window, prefix_caching=False)
    device = model.norm.weight.device
    nll, scored, next_target = 0.0, 0, 1  # token 0 has no context and is never predicted
    starts = list(range(0, max(len(ids) - 1, 1), stride))
    with (progress_bar(starts, "perplexity", unit="window") if progress else Lines(starts, every=math.inf)) as bar:
        for begin in bar:
            end = min(begin + window, len(ids))
            logits = window_logits(engine, ids[begin:end], chunk)  # (T, vocab), float32
            first = max(next_target, begin + 1)  # first position this window scores
            targets = torch.tensor(ids[first:end], device=device)
            nll += F.cross_entropy(logits[first - 1 - begin:end - 1 - begin], targets, reduction="sum").item()
            scored += end - first
            next_target = end
            bar.set_postfix(perplexity=f"{math.exp(nll / scored):.3f}", refresh=False)
            if end == len(ids):
                break
    return math.exp(nll / scored), scored


def window_logits(engine: Engine, tokens: list, chunk: int) -> Tensor:
    """Every token's logits (T, V) of one window, a request fed `chunk` tokens a step (0: at once)."""
    request = Request(tokens, 0)
    engine.start(request)
    step, logits = chunk or len(tokens), []
    try:
        for c in range(0, len(tokens), step):
            logits.append(engine.feed(request, tokens[c:c + step], every=True))
            engine.keep(request, len(tokens[c:c + step]))
    finally:
        engine.scheduler.finish(request, "stop")
    return torch.cat(logits)


def memory_needs(model, args, window: int, dtype) -> list:
    """What perplexity() allocates beside the weights: the cache (the whole --window, as asked), and
    a window's logits and activations (window: --window, cut to the text)."""
    step = args.chunk or window
    return [Need("the KV cache", kv_cache_bytes(model, 1, args.window, dtype), "lower --window",
                 f" of {args.window} tokens"),
            Need("the logits", logits_bytes(model.args.vocab_size, window), "lower --window", f" of {window} tokens"),
            Need("the activations", activation_bytes(model.args, step, window, dtype),
                 "lower --window or pass --chunk", f" of {step} tokens")]


def main(argv=None):
    args = script_args.parse_eval_args(argv)
    device = parse_device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = parse_dtype(args.dtype)
    tokenizer = Tokenizer(args.checkpoint)
    config = checkpoint.read_config(args.checkpoint)
    check_vocabulary(tokenizer, config, args.checkpoint)
    try:
        text = args.text.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{args.text} is not UTF-8 text") from None
    ids = tokenizer.encode(text)[:args.max_tokens]
    if len(ids) < 2:
        raise UserError(f"{args.text} has fewer than 2 tokens")
    past = next((t for t in ids if t >= config.vocab_size), None)
    if past is not None:  # a special token written in the text, past the embedding
        raise UserError(f"{args.text} holds token {past} ({tokenizer.decode([past])!r}), past the model's "
                        f"vocabulary of {config.vocab_size}")
    context, window = trained_context(config), min(args.window, len(ids))
    if window > context:
        where = f"--window {args.window} is past the model's trained context of {context} tokens"
        if not args.extend_context:
            raise UserError(f"{where}: lower it, or pass --extend_context to score past it anyway")
        log(f"warning: {where}; the perplexity there says little about the model")
    model = load_model(args.checkpoint, device, dtype, needs=lambda model: memory_needs(model, args, window, dtype))
    scheme = model.args.quantization
    log(f"{args.checkpoint} ({scheme['mode'] if scheme else args.dtype}): {len(ids)} tokens of {args.text}, "
        f"window {args.window}, stride {args.stride}" + (f", {args.chunk} tokens a forward" if args.chunk else ""))
    ppl, scored = perplexity(model, ids, args.window, args.stride, args.chunk, progress=True)
    log(f"{scored} tokens scored")
    print(f"perplexity {ppl:.3f}")


if __name__ == "__main__":
    run_cli(main)
