"""Load generator for OpenAI-compatible servers, in the style of `vllm bench serve`: streamed
/v1/completions requests of random token-id prompts, `ignore_eos`, at a fixed concurrency (or
Poisson arrivals); output tokens/s, requests/s, and TTFT, time per output token (TPOT) and
inter-token latency (ITL), median and p99.

    python -m scripts.bench_serve --engines ours,llama-server,transformers --concurrency 1,4,8,16
    python -m scripts.bench_serve --workload long-prompt     # a 2,000-token prompt joins 8 streams
    python -m scripts.bench_serve --workload shared-prefix   # ours with prefix reuse on and off
    python -m scripts.bench_serve --workload system-prompt --engines ours,before --before /tmp/main
        # 16 requests, one 1,024-token system prompt: peak KV blocks, TTFT with the prefix cache and without
    python -m scripts.bench_serve --workload mixed-lengths --engines ours,before --before /tmp/main
        # prompts of 64 to 4,000 tokens at the same KV memory: how many requests run at once
    python -m scripts.bench_serve --workload grounded --engines ours,ours-suffix --concurrency 1
        # chat prompts that quote what the answer repeats (data/speculative_prompts.json), greedy, to EOS
    python -m scripts.bench_serve --engines ours,ours-suffix --concurrency 16   # speculation's cost under load

Each engine is started here on the same weights (ours: serve.py on checkpoints/MODEL; llama-server:
the F32 or Q8_0 GGUF of the same weights, built by scripts/build_llama_server.sh), or --url points
at a running server. Every request gets the same prompt ids on every engine.
"""
import argparse
import contextlib
import http.client
import json
import math
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import download
from scripts.bench_peers import THREADS, gguf_variant, quantized_activations

ROOT = Path(__file__).resolve().parents[1]
BLOCK_TOKENS = 16  # serve.py's KV cache blocks
CACHE = Path(os.environ.get("MINILLM_CACHE") or Path.home() / ".cache" / "minillm")


def log(*args):
    print("[bench_serve]", *args, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def compiling(url: str) -> bool:
    """Whether a server serves with its eager step while the compiled one compiles (measured after)."""
    try:
        text = urllib.request.urlopen(url + "/metrics", timeout=2).read().decode()
        return re.search(r"^minillm_step_compiling 1", text, re.M) is not None
    except OSError:  # llama-server without --metrics
        return False


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 900):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
        except OSError:
            time.sleep(0.5)
            continue
        if not compiling(url):
            return
        time.sleep(0.5)
    raise RuntimeError("the server did not start")


def start_ours(args, slots: int, ctx: int, logfile, extra=(), root: Path = ROOT) -> tuple:
    """serve.py of this tree (or of root: --before's) on a free port."""
    port = free_port()
    checkpoint = args.checkpoint
    if args.precision == "int8":
        checkpoint = Path(f"{checkpoint}-int8")
        if not (checkpoint / "config.json").exists():
            subprocess.run([sys.executable, "quantize.py", "--checkpoint", str(args.checkpoint), "--mode", "int8",
                            "--out", str(checkpoint)], cwd=ROOT, check=True)
    cmd = [sys.executable, "serve.py", "--checkpoint", str(checkpoint), "--port", str(port),
           "--max_batch_size", str(slots), "--max_seq_length", str(ctx), "--device", args.device,
           "--dtype", quantized_activations(args.device) if args.precision == "int8" else args.precision,
           "--model_name", "bench", *extra]
    proc = subprocess.Popen(cmd, cwd=root, stdout=logfile, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc)
    return proc, url


def speculation_counts(url: str) -> dict:
    """A serve.py --speculative server's verifies, proposed and accepted tokens so far (/metrics)."""
    try:
        text = urllib.request.urlopen(url + "/metrics", timeout=2).read().decode()
    except OSError:
        return {}
    return {m[0]: float(m[1]) for m in re.findall(r"^minillm_speculative_(\w+)_total (\S+)$", text, re.M)}


class MetricsPoller:
    """Reads a server's /metrics every `every` seconds while a load runs: the peak of each gauge
    named, and each one's mean over the polls."""

    def __init__(self, url: str, names: tuple, every: float = 0.05):
        self.url, self.names, self.every = url, names, every
        self.samples = {n: [] for n in names}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        while not self.done.is_set():
            try:
                text = urllib.request.urlopen(self.url + "/metrics", timeout=2).read().decode()
            except OSError:
                text = ""
            for line in text.splitlines():
                name, _, value = line.partition(" ")
                if name in self.samples:
                    self.samples[name].append(float(value))
            self.done.wait(self.every)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()

    def peak(self, name: str) -> float:
        return max(self.samples[name], default=float("nan"))

    def mean(self, name: str) -> float:
        xs = self.samples[name]
        return sum(xs) / len(xs) if xs else float("nan")


def start_llama(args, slots: int, ctx: int, logfile) -> tuple:
    binary = Path(args.llama_server or CACHE / "llama.cpp" / "build" / "bin" / "llama-server")
    if not binary.exists():
        raise RuntimeError(f"{binary} not found: run scripts/build_llama_server.sh")
    f32 = gguf_variant(download.fetch_gguf(args.model), "F32", CACHE / "bench")
    gguf = f32
    if args.precision == "int8":
        gguf = f32.with_name(f32.name.replace(".F32.", ".Q8_0."))
        if not gguf.exists():
            subprocess.run([str(binary.with_name("llama-quantize")), str(f32), str(gguf) + ".tmp", "Q8_0"],
                           check=True, capture_output=True)
            os.rename(str(gguf) + ".tmp", gguf)
    port = free_port()
    cmd = [str(binary), "-m", str(gguf), "--port", str(port), "-np", str(slots), "-c", str(slots * ctx),
           "-t", str(THREADS), "-tb", str(THREADS), "--no-warmup", "-a", "bench"]
    proc = subprocess.Popen(cmd, stdout=logfile, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc)
    return proc, url


def stop(proc: subprocess.Popen):
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def one_request(url: str, prompt: list, max_tokens: int, result: dict, to_eos: bool = False):
    """A streamed completion (to_eos: ending at EOS, else at max_tokens); records when it was sent,
    each chunk's arrival and the token count."""
    host, port = url.rsplit("/", 1)[-1].rsplit(":", 1)
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": not to_eos, "stream_options": {"include_usage": True}}
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    result["start"] = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json",
                                                               "Authorization": "Bearer bench"})
    resp = conn.getresponse()
    if resp.status != 200:
        result["error"] = f"HTTP {resp.status}: {resp.read()[:200]!r}"
        return
    times, tokens = [], None
    for line in resp:
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        if line == b"data: [DONE]":
            break
        event = json.loads(line[6:])
        if event.get("choices") and event["choices"][0].get("text"):
            times.append(time.perf_counter())
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
    conn.close()
    result.update(times=times, tokens=tokens if tokens is not None else len(times), end=time.perf_counter())


def run_load(url: str, prompts: list, max_tokens: int, concurrency: int, rate: float = 0.0,
             delays: list = None, to_eos: bool = False) -> list:
    """Send every prompt, at most `concurrency` at a time (and, rate > 0, Poisson arrivals at that
    many per second, or at the given delays); returns one result dict per request."""
    results = [dict() for _ in prompts]
    gate = threading.Semaphore(concurrency)
    rng = random.Random(0)

    def worker(i):
        try:
            one_request(url, prompts[i], max_tokens if isinstance(max_tokens, int) else max_tokens[i], results[i],
                        to_eos)
        except Exception as e:  # reported in the results
            results[i]["error"] = f"{type(e).__name__}: {e}"
        finally:
            gate.release()

    threads, t0 = [], time.perf_counter()
    for i in range(len(prompts)):
        if delays is not None:
            time.sleep(max(0.0, t0 + delays[i] - time.perf_counter()))
        elif rate > 0:
            time.sleep(rng.expovariate(rate))
        gate.acquire()
        t = threading.Thread(target=worker, args=(i,))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    return results


def pct(xs: list, q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def summarize(results: list) -> dict:
    ok = [r for r in results if "error" not in r and r.get("times")]
    if len(ok) < len(results):
        errors = [r.get("error", "no tokens") for r in results if r not in ok]
        raise RuntimeError(f"{len(results) - len(ok)} requests failed: {errors[0]}")
    start, end = min(r["start"] for r in ok), max(r["end"] for r in ok)
    ttft = [r["times"][0] - r["start"] for r in ok]
    tpot = [(r["times"][-1] - r["times"][0]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    itl = [b - a for r in ok for a, b in zip(r["times"], r["times"][1:])]
    tokens = sum(r["tokens"] for r in ok)
    return {"requests": len(ok), "duration_s": end - start, "output_tokens": tokens,
            "output_tokens_per_s": tokens / (end - start), "requests_per_s": len(ok) / (end - start),
            "ttft_median_ms": 1e3 * statistics.median(ttft), "ttft_p99_ms": 1e3 * pct(ttft, 99),
            "tpot_median_ms": 1e3 * statistics.median(tpot) if tpot else float("nan"),
            "itl_median_ms": 1e3 * statistics.median(itl) if itl else float("nan"),
            "itl_p99_ms": 1e3 * pct(itl, 99)}


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list:
    rng = random.Random(seed)
    return [[rng.randrange(1000, vocab - 1000) for _ in range(length)] for _ in range(n)]


def print_row(label: str, s: dict):
    print(f"{label:<34} {s['output_tokens_per_s']:8.1f} {s['requests_per_s']:6.2f} {s['ttft_median_ms']:8.0f} "
          f"{s['ttft_p99_ms']:8.0f} {s['tpot_median_ms']:7.1f} {s['itl_median_ms']:7.1f} {s['itl_p99_ms']:7.1f}",
          flush=True)


HEADER = (f"{'engine / setting':<34} {'out t/s':>8} {'req/s':>6} {'TTFT p50':>8} {'TTFT p99':>8} {'TPOT':>7} "
          f"{'ITL p50':>7} {'ITL p99':>7}   (ms)")


def worker_transformers(args) -> None:
    """In its own process: transformers' continuous batching (`generate_batch`) on the F32 GGUF
    (in the run's precision, on its device), the prompts of --worker_io, at most `concurrency`
    requests per batch; writes one result per request in run_load's form (every request is queued
    at the start, so its TTFT includes the wait)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation import ContinuousBatchingConfig, GenerationConfig
    torch.set_num_threads(THREADS)
    job = json.loads(Path(args.worker_io).read_text())
    gguf = Path(job["gguf"])
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=getattr(torch, job["precision"]),
                                                 attn_implementation="paged|sdpa").eval().to(job["device"])
    cb = ContinuousBatchingConfig(max_requests_per_batch=job["concurrency"])

    def batch(prompts, n):
        config = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=-1)
        return model.generate_batch(inputs=prompts, generation_config=config, continuous_batching_config=cb,
                                    progress_bar=False, record_timestamps=True)

    batch(job["warmup"], 4)
    start = time.perf_counter()
    out = batch(job["prompts"], job["output_len"])
    end = time.perf_counter()
    results = [{"start": start, "times": list(o.timestamps or []), "tokens": len(o.generated_tokens), "end": end}
               for o in out.values()]
    Path(args.worker_io).write_text(json.dumps(results))


def run_transformers(args, prompts: list, warmup: list, concurrency: int) -> list:
    gguf = gguf_variant(download.fetch_gguf(args.model), "F32", CACHE / "bench")
    io = args.logdir / "transformers.json"
    io.write_text(json.dumps({"gguf": str(gguf), "prompts": prompts, "warmup": warmup, "concurrency": concurrency,
                              "device": args.device, "precision": args.precision,
                              "output_len": args.output_len}))
    with open(args.logdir / "transformers.log", "a") as logfile:
        subprocess.run([sys.executable, "-m", "scripts.bench_serve", "--worker_io", str(io)], cwd=ROOT, check=True,
                       stdout=logfile, stderr=subprocess.STDOUT)
    return json.loads(io.read_text())


@contextlib.contextmanager
def warmed_up(started: tuple, vocab: int, seed: int):
    """A started server (proc, url) after two short requests of other prompts (first-use costs out
    of the figures, nothing of the measured prompts cached); stopped on the way out."""
    proc, url = started
    try:
        run_load(url, random_prompts(2, 32, vocab, seed=seed), 4, 2)
        yield url
    finally:
        stop(proc)


def workload_throughput(args, starters: dict) -> list:
    """Random prompts at each concurrency, every engine; the engines alternate within each level."""
    rows = []
    levels = [int(c) for c in args.concurrency.split(",")]
    servers = {name: start(args, max(levels), args.input_len + args.output_len + 8)
               for name, start in starters.items() if name != "transformers"}
    try:
        print(HEADER)
        for c in levels:
            n = max(args.min_prompts, args.prompts_per_slot * c)
            prompts = random_prompts(n, args.input_len, args.vocab, seed=c)
            # warm-up, first-use costs out of the figures; other prompts, so no prefix cache has them
            warmup = random_prompts(min(c, 2), args.input_len, args.vocab, seed=1000 + c)
            for name in starters:
                if name == "transformers":
                    s = summarize(run_transformers(args, prompts, warmup, c))
                else:
                    url = servers[name][1]
                    run_load(url, warmup, 4, c)
                    before = speculation_counts(url)
                    s = summarize(run_load(url, prompts, args.output_len, c))
                    s.update({f"speculative_{k}": v - before[k] for k, v in speculation_counts(url).items()})
                s.update(engine=name, concurrency=c, workload="throughput", precision=args.precision)
                rows.append(s)
                print_row(f"{name} c={c}", s)
    finally:
        for proc, _ in servers.values():
            stop(proc)
    return rows


def workload_long_prompt(args, starters: dict) -> list:
    """8 streams decode while one 2,000-token prompt arrives: their inter-token latency, p99 over
    median, for the streams' whole lives."""
    rows = []
    for name, start in starters.items():
        proc, url = start(args, 9, 2200)
        try:
            streams = random_prompts(8, 32, args.vocab, seed=1)
            long = random_prompts(1, 2000, args.vocab, seed=2)
            run_load(url, random_prompts(2, 32, args.vocab, seed=1001), 4, 2)  # warm-up
            prompts = streams + long
            delays = [0.0] * 8 + [2.0]  # the long prompt comes while the streams run
            results = run_load(url, prompts, [192] * 8 + [16], 9, delays=delays)
            s = summarize(results[:8])
            s["long_prompt_ttft_ms"] = 1e3 * (results[8]["times"][0] - results[8]["start"])
            s.update(engine=name, workload="long-prompt", precision=args.precision,
                     itl_p99_over_median=s["itl_p99_ms"] / s["itl_median_ms"])
            print(HEADER)
            print_row(f"{name}, 8 streams + 2000-token prompt", s)
            print(f"  ITL p99 / median {s['itl_p99_over_median']:.2f}; the long prompt's TTFT "
                  f"{s['long_prompt_ttft_ms']:.0f} ms", flush=True)
            rows.append(s)
        finally:
            stop(proc)
    return rows


def workload_shared_prefix(args, starters: dict) -> list:
    """vLLM's prefix_repetition: prompts share one of two prefixes (256 tokens), each with its own
    suffix (256), or other lengths (--prefix_len, --suffix_len: a long shared system prompt);
    ours with prefix reuse on and off."""
    rows = []
    variants = {"ours, prefix reuse": (), "ours, no prefix reuse": ("--no-prefix_reuse",)}
    rng = random.Random(3)
    prefixes = random_prompts(2, args.prefix_len, args.vocab, seed=4)
    prompts = [prefixes[i % 2] + [rng.randrange(1000, args.vocab - 1000) for _ in range(args.suffix_len)]
               for i in range(16)]
    print(HEADER)
    for label, extra in variants.items():
        with open(args.logdir / f"{label.replace(' ', '_').replace(',', '')}.log", "w") as logfile:
            started = start_ours(args, 4, args.prefix_len + args.suffix_len + 40, logfile, extra)
        with warmed_up(started, args.vocab, 1002) as url:
            s = summarize(run_load(url, prompts, 32, 4))
            s.update(engine=label, workload="shared-prefix", precision=args.precision, prefix_len=args.prefix_len,
                     suffix_len=args.suffix_len)
            print_row(label, s)
            rows.append(s)
    on, off = rows
    print(f"  median TTFT with reuse / without: {on['ttft_median_ms'] / off['ttft_median_ms']:.2f}", flush=True)
    return rows


def workload_system_prompt(args, starters: dict) -> list:
    """16 concurrent requests that share one system prompt (--prefix_len, 1,024 by default) and each
    ask their own question (--suffix_len tokens): the KV blocks in use at the peak (from /metrics;
    the slot design of --before reserves every slot whole) against one prefix plus every request's
    own tokens, and the median TTFT with the prefix cache and without."""
    n, out = 16, 32
    prefix = random_prompts(1, args.prefix_len, args.vocab, seed=4)[0]
    prompts = [prefix + q for q in random_prompts(n, args.suffix_len, args.vocab, seed=5)]
    ctx = args.prefix_len + args.suffix_len + out + 8
    own = args.prefix_len + n * (args.suffix_len + out)  # tokens: the prefix once, and each request's own
    variants = [(name, label, extra) for name in starters
                for label, extra in (("prefix cache", ()), ("no prefix cache", ("--no-prefix_reuse",)))]
    rows = []
    print(HEADER)
    for name, label, extra in variants:
        with warmed_up(starters[name](args, n, ctx, extra), args.vocab, 1002) as url:
            with MetricsPoller(url, ("minillm_kv_cache_usage", "minillm_kv_cache_blocks_total")) as metrics:
                s = summarize(run_load(url, prompts, out, n))
            blocks = metrics.peak("minillm_kv_cache_usage") * metrics.peak("minillm_kv_cache_blocks_total")
            s.update(engine=f"{name}, {label}", workload="system-prompt", precision=args.precision,
                     prefix_len=args.prefix_len, suffix_len=args.suffix_len, output_len=out,
                     # no block gauges (--before's slots): every slot is reserved whole
                     peak_kv_tokens=n * (ctx + 1) if math.isnan(blocks) else BLOCK_TOKENS * blocks,
                     own_tokens=own)
            s["peak_kv_over_own"] = s["peak_kv_tokens"] / own
            print_row(f"{name}, {label}", s)
            print(f"  peak KV tokens {s['peak_kv_tokens']:.0f} = {s['peak_kv_over_own']:.2f}x the prefix once "
                  f"plus each request's own ({own})", flush=True)
            rows.append(s)
    for name in starters:
        on, off = [r for r in rows if r["engine"].startswith(name + ",")]
        print(f"  {name}: median TTFT with the prefix cache / without: "
              f"{on['ttft_median_ms'] / off['ttft_median_ms']:.2f}", flush=True)
    return rows


def workload_mixed_lengths(args, starters: dict) -> list:
    """Prompts of 64 to 4,000 tokens (log-uniform: many short, a few long), all sent at once, on
    the same KV memory: --before's --slots slots of the longest request, ours a pool of as many
    tokens with up to 32 rows. How many requests run at once (mean and peak, from /metrics), how
    long the whole load takes, and that no request is refused."""
    n, out, longest = 32, 64, 4000
    rng = random.Random(7)
    lengths = [int(round(64 * (longest / 64) ** rng.random())) for _ in range(n)]
    prompts = [random_prompts(1, k, args.vocab, seed=100 + i)[0] for i, k in enumerate(lengths)]
    ctx = longest + out + 8
    rows = []
    print(HEADER)
    for name, start in starters.items():
        with warmed_up(start(args, args.slots, ctx, (), paged=True), args.vocab, 1003) as url:
            with MetricsPoller(url, ("minillm_requests_running",), every=0.1) as metrics:
                s = summarize(run_load(url, prompts, out, n))
            s.update(engine=name, workload="mixed-lengths", precision=args.precision, kv_tokens=args.slots * ctx,
                     prompt_lengths=lengths, running_mean=metrics.mean("minillm_requests_running"),
                     running_peak=metrics.peak("minillm_requests_running"))
            print_row(name, s)
            print(f"  running at once: mean {s['running_mean']:.1f}, peak {s['running_peak']:.0f}; "
                  f"{s['requests']} of {n} served in {s['duration_s']:.0f} s", flush=True)
            rows.append(s)
    return rows


def grounded_prompts(checkpoint: Path, per_category: int) -> list:
    """(category, token ids) of data/speculative_prompts.json's grounded kinds, through the chat template."""
    from tokenizer import Tokenizer
    tokenizer = Tokenizer(checkpoint)
    categories = json.loads((ROOT / "data" / "speculative_prompts.json").read_text())["categories"]
    out = []
    for kind in ("summarise", "edit_code", "document_qa", "multi_turn"):
        for chat in categories[kind]["prompts"][:per_category]:
            messages = [{"role": "user", "content": chat}] if isinstance(chat, str) else chat
            out.append((kind, tokenizer.encode(tokenizer.apply_chat_template(messages), add_bos=False)))
    return out


def workload_grounded(args, starters: dict) -> list:
    """Chat prompts whose answers repeat what they quote (summarise, edit code, answer from a
    document, a conversation's repeat), greedy to EOS or --output_len: where speculation pays.
    Every engine's server runs at once and each batch of `concurrency` prompts goes to one after
    the other, so that another job on the machine slows them alike; a figure counts its engine's
    batches' time only. Every prompt is new to the server (the suffix store holds the earlier
    prompts' text and answers, not its own)."""
    prompts = grounded_prompts(args.checkpoint, args.per_category)
    ids, kinds = [p for _, p in prompts], [k for k, _ in prompts]
    levels = [int(c) for c in args.concurrency.split(",")]
    ctx = max(map(len, ids)) + args.output_len + 8
    servers = {name: start(args, max(levels), ctx) for name, start in starters.items()}
    rows = []
    try:
        for _, url in servers.values():
            run_load(url, random_prompts(2, 32, args.vocab, seed=1004), 4, 2)  # first-use costs out of the figures
        print(HEADER)
        for c in levels:
            results, seconds = {name: [] for name in servers}, {name: [0.0] * len(ids) for name in servers}
            before = {name: speculation_counts(url) for name, (_, url) in servers.items()}
            for i in range(0, len(ids), c):
                for name, (_, url) in servers.items():
                    batch = run_load(url, ids[i:i + c], args.output_len, c, to_eos=True)
                    results[name] += batch
                    took = max(r["end"] for r in batch) - min(r["start"] for r in batch)
                    seconds[name][i:i + c] = [took / len(batch)] * len(batch)  # shared out over its prompts
            for name in servers:
                s = summarize(results[name])
                s.update(duration_s=sum(seconds[name]), output_tokens_per_s=s["output_tokens"] / sum(seconds[name]),
                         requests_per_s=len(ids) / sum(seconds[name]), engine=name, concurrency=c,
                         workload="grounded", precision=args.precision, output_len=args.output_len,
                         per_category={kind: sum(r["tokens"] for r, k in zip(results[name], kinds) if k == kind) /
                                       sum(t for t, k in zip(seconds[name], kinds) if k == kind)
                                       for kind in dict.fromkeys(kinds)})
                s.update({f"speculative_{k}": v - before[name][k]
                          for k, v in speculation_counts(servers[name][1]).items()})
                print_row(f"{name} c={c}", s)
                print("  out tok/s by kind: " + ", ".join(f"{k} {v:.1f}" for k, v in s["per_category"].items()),
                      flush=True)
                rows.append(s)
    finally:
        for proc, _ in servers.values():
            stop(proc)
    return rows


def device_name(device: str) -> str:
    if device == "cpu":
        return "cpu"
    import torch
    return torch.cuda.get_device_name(torch.device(device))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python -m scripts.bench_serve")
    p.add_argument("--model", default="smollm2-135m", help="a model name known to download.py")
    p.add_argument("--checkpoint", type=Path, default=None, help="our checkpoint (default: checkpoints/MODEL)")
    p.add_argument("--engines", default="ours,llama-server",
                   help="comma-separated: ours, ours-no-prepack (serve.py --no-prepack), ours-regional "
                        "(--compile_mode regional), ours-ngram, ours-suffix (--speculative), llama-server, "
                        "transformers (generate_batch, throughput workload only)")
    p.add_argument("--precision", choices=["float32", "bfloat16", "int8"], default="float32",
                   help="float32: ours float32 against llama.cpp F32; int8: ours int8 against Q8_0 "
                        "(bfloat16 activations on a GPU); bfloat16: ours and transformers")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (ours and transformers)")
    p.add_argument("--workload", choices=["throughput", "long-prompt", "shared-prefix", "system-prompt", "mixed-lengths",
                                          "grounded"], default="throughput")
    p.add_argument("--per_category", type=int, default=5, help="grounded: prompts of each kind (at most 5)")
    p.add_argument("--before", type=Path, default=None,
                   help="the engine `before`: serve.py of this tree (a worktree of an earlier commit)")
    p.add_argument("--slots", type=int, default=4,
                   help="mixed-lengths: the KV memory, in requests of the longest length (before's slots)")
    p.add_argument("--concurrency", default="1,4,8,16")
    p.add_argument("--input_len", type=int, default=256)
    p.add_argument("--output_len", type=int, default=128)
    p.add_argument("--prefix_len", type=int, default=None,
                   help="shared-prefix, system-prompt: the shared part's tokens (default 256, 1024)")
    p.add_argument("--suffix_len", type=int, default=None,
                   help="shared-prefix, system-prompt: each prompt's own part (default 256, 48)")
    p.add_argument("--prompts_per_slot", type=int, default=2, help="requests per concurrency level: this x level")
    p.add_argument("--min_prompts", type=int, default=4)
    p.add_argument("--llama_server", default=None, help="llama-server binary (default: the build script's)")
    p.add_argument("--json", type=Path, default=None, help="write every figure here")
    p.add_argument("--worker_io", default=None, help=argparse.SUPPRESS)  # the transformers worker's job file
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.worker_io:
        return worker_transformers(args)
    args.checkpoint = args.checkpoint or ROOT / "checkpoints" / args.model
    args.vocab = json.loads((args.checkpoint / "config.json").read_text())["vocab_size"]
    args.logdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"minillm-bench-serve-{os.getpid()}"
    args.logdir.mkdir(parents=True, exist_ok=True)
    log(f"server logs in {args.logdir}")

    def ours(args, slots, ctx, extra=(), paged=False):
        # paged: the KV memory of `slots` requests of ctx tokens, shared by up to 32 rows
        rows = ("--max_batch_size", "32", "--kv_cache_tokens", str(slots * ctx)) if paged else ()
        with open(args.logdir / "ours.log", "a") as f:
            return start_ours(args, slots, ctx, f, (*extra, *rows))

    def before(args, slots, ctx, extra=(), paged=False):
        if args.before is None:
            sys.exit("error: the engine `before` needs --before DIR")
        with open(args.logdir / "before.log", "a") as f:
            return start_ours(args, slots, ctx, f, extra, root=args.before)

    def llama(args, slots, ctx):
        with open(args.logdir / "llama-server.log", "a") as f:
            return start_llama(args, slots, ctx, f)

    def ours_unpacked(args, slots, ctx):  # the A/B of serve.py's --prepack
        with open(args.logdir / "ours-no-prepack.log", "a") as f:
            return start_ours(args, slots, ctx, f, ("--no-prepack",))

    def ours_regional(args, slots, ctx):  # the A/B of serve.py's --compile_mode regional
        with open(args.logdir / "ours-regional.log", "a") as f:
            return start_ours(args, slots, ctx, f, ("--compile_mode", "regional"))

    def ours_speculating(kind):  # serve.py --speculative kind
        def start(args, slots, ctx):
            with open(args.logdir / f"ours-{kind}.log", "a") as f:
                return start_ours(args, slots, ctx, f, ("--speculative", kind))
        return start

    known = {"ours": ours, "before": before, "ours-no-prepack": ours_unpacked, "ours-regional": ours_regional,
             "ours-ngram": ours_speculating("ngram"), "ours-suffix": ours_speculating("suffix"), "llama-server": llama,
             "transformers": None}
    names = args.engines.split(",")
    if unknown := [n for n in names if n not in known]:
        sys.exit(f"error: unknown engine(s) {', '.join(unknown)} (choose from {', '.join(known)})")
    if args.workload in ("system-prompt", "mixed-lengths") and set(names) - {"ours", "before"}:
        sys.exit(f"error: the {args.workload} workload runs the engines ours and before only")
    if "transformers" in names and args.workload != "throughput":
        sys.exit("error: the transformers engine (generate_batch, not a server) runs the throughput workload only")
    if (args.device != "cpu" or args.precision == "bfloat16") and "llama-server" in names:
        sys.exit("error: llama-server runs on --device cpu at float32 or int8 only")
    if args.precision == "int8" and "transformers" in names:
        sys.exit("error: the transformers engine runs float32 or bfloat16")
    starters = {n: known[n] for n in names}
    defaults = {"system-prompt": (1024, 48)}.get(args.workload, (256, 256))
    args.prefix_len = args.prefix_len or defaults[0]
    args.suffix_len = args.suffix_len or defaults[1]
    run = {"throughput": workload_throughput, "long-prompt": workload_long_prompt,
           "shared-prefix": workload_shared_prefix, "system-prompt": workload_system_prompt,
           "mixed-lengths": workload_mixed_lengths, "grounded": workload_grounded}[args.workload]
    rows = run(args, starters)
    if args.json:
        meta = {"machine_threads": THREADS, "device": device_name(args.device), "date": time.strftime("%Y-%m-%d"),
                "argv": sys.argv[1:],
                # MINILLM_COMMIT first: a copy of the tree (a GPU machine's) may carry a stale git history
                "commit": os.environ.get("MINILLM_COMMIT") or subprocess.run(
                    ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()}
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        tmp.rename(args.json)
        log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
