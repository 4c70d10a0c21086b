r"""Decode speed of a model shape with random weights (shapes.py), by precision and batch size:
`python -m scripts.bench --shape NAME` runs this.

    python -m scripts.bench --shape llama-2-7b,llama-3.1-8b --device cuda --dtypes bfloat16 \
        --quantized int8,int4-g32,int4-g64 --batch_sizes 1,8,32,64 --json bench-out/shapes.json

Each (shape, precision, batch size) is a `generate.py --shape` process: greedy, --max_new_tokens
tokens after a 16-token prompt, EOS ignored, the decode step compiled (a CUDA graph on a GPU).
Batch 1 runs every shape and precision; larger batches the first shape in the first --dtypes. The processes
start together, as many as the device's free memory holds (weights and KV caches, from the
shapes), because compiling is a minute of CPU work each; then they time their samples one at a
time (generate.py's MINILLM_TIMING_LOCK), so that no timing shares the device. Of --num_samples
samples the first (warm-up) is dropped and the last is profiled (the profiler's table of the
step goes to --profile_dir); the figure is the median of the rest.

Bandwidth: the weights a step reads (generate.py's bandwidth_gb_s) over the device's read
bandwidth measured in the same run (torch's sum over 4 GiB); the KV cache a step reads is
reported beside it. TORCH_LOGS=perf_hints is on, and a process whose log says it skipped CUDA
graphs is flagged.
"""
import fcntl
import json
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from scripts.bench_peers import quantized_activations

REPO_ROOT = Path(__file__).resolve().parent.parent
PROMPT_LENGTH = 16
# a process's own device memory beyond weights and cache (context, graphs, workspaces): 0.1-1.6 GiB
# over the rest were seen on an H200 (a bfloat16 7B process the most), allocator segments included
PROCESS_OVERHEAD = 1280 << 20
SPARE = 0.93  # of the free memory, what the processes of one group may plan to take


def jobs(args) -> list:
    """(shape, precision, batch size) of every process: precision a dtype or a quantization label."""
    out = [(shape, p, 1) for shape in args.shape for p in args.dtypes + args.quantized]
    return out + [(args.shape[0], args.dtypes[0], b) for b in args.batch_sizes if b != 1]


def device_bytes(job, args) -> int:
    """What one process holds on the device: its weights, KV cache and logits, and PROCESS_OVERHEAD."""
    import qlayers
    import quantize
    import shapes
    from loading import parse_dtype
    from memory import kv_cache_bytes, logits_bytes, weight_bytes
    shape, precision, batch = job
    model_args = shapes.shape_args(shape)
    model = qlayers.meta_model(model_args)
    dtype = parse_dtype(dtype_of(precision, args.device))
    transient = 0
    if precision not in args.dtypes:
        mode, groupsize = shapes.parse_quantization(precision)
        model = qlayers.meta_model(replace(model_args, quantization=quantize.scheme_record(mode, groupsize, model)))
        # the prompt's int8 head, converted to dtype for its one product
        transient = model_args.vocab_size * model_args.dim * dtype.itemsize
    return (weight_bytes(model, dtype) + kv_cache_bytes(model, batch, seq_length(args), dtype) + transient
            + logits_bytes(model_args.vocab_size, batch) + PROCESS_OVERHEAD)


def dtype_of(precision: str, device: str) -> str:
    return precision if precision in ("float32", "bfloat16", "float16") else quantized_activations(device)


def seq_length(args) -> int:
    return PROMPT_LENGTH + args.max_new_tokens  # the cache holds exactly the run


def groups(all_jobs: list, args, free: int) -> list:
    """The jobs in groups that fit the device's free memory together, largest first."""
    out = []
    for job in sorted(all_jobs, key=lambda j: -device_bytes(j, args)):
        need = device_bytes(job, args)
        home = next((g for g in out if sum(device_bytes(j, args) for j in g) + need <= SPARE * free), None)
        if home is None:
            out.append(home := [])
        home.append(job)
    return out


def tag(job) -> str:
    return "-".join(map(str, job))


def command(job, args, workdir: Path) -> list:
    shape, precision, batch = job
    cmd = [sys.executable, str(REPO_ROOT / "generate.py"), "--shape", shape, "--dtype", dtype_of(precision, args.device),
           "--device", args.device, "--batch_size", str(batch), "--prompt_length", str(PROMPT_LENGTH),
           "--max_new_tokens", str(args.max_new_tokens), "--max_seq_length", str(seq_length(args)),
           "--ignore_eos", "--num_samples", str(args.num_samples), "--metrics_json", str(workdir / f"{tag(job)}.json")]
    if precision not in args.dtypes:
        cmd += ["--quantize", precision]
    if args.profile_dir:
        cmd += ["--profile", str(Path(args.profile_dir).resolve() / f"{tag(job)}.trace.json")]
    return cmd


def run_group(group: list, args, workdir: Path, env: dict) -> dict:
    """Start every job of the group, hold the timing lock until each has compiled (or died), then
    let them time in turn. Returns tag -> (return code, wall s)."""
    lock = workdir / "timing.lock"
    lock.touch()
    env = dict(env, MINILLM_TIMING_LOCK=str(lock))
    start, procs = time.perf_counter(), {}
    with open(lock) as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        for job in group:
            with open(workdir / f"{tag(job)}.log", "w") as log_file:
                procs[tag(job)] = subprocess.Popen(command(job, args, workdir), stdout=log_file, stderr=subprocess.STDOUT,
                                                   cwd=REPO_ROOT, env=env)
        while not all(p.poll() is not None or Path(f"{lock}.ready.{p.pid}").exists() for p in procs.values()):
            if time.perf_counter() - start > args.timeout:
                break
            time.sleep(0.5)
        log(f"  compiled in {time.perf_counter() - start:.0f} s; timing one at a time")
        fcntl.flock(held, fcntl.LOCK_UN)
    out = {}
    for name, p in procs.items():
        try:
            p.wait(timeout=max(1.0, args.timeout - (time.perf_counter() - start)))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        out[name] = (p.returncode, time.perf_counter() - start)
    return out


def summarize(job, args, workdir: Path, rc, membw: dict) -> dict:
    shape, precision, batch = job
    row = {"shape": shape, "precision": precision, "batch_size": batch, "returncode": rc}
    log_text = (workdir / f"{tag(job)}.log").read_text(errors="replace")
    row["skipped_cudagraphs"] = "skipping cudagraphs" in log_text
    metrics_file = workdir / f"{tag(job)}.json"
    if rc != 0 or not metrics_file.exists():
        row["error"] = "\n".join(log_text.splitlines()[-12:])
        return row
    samples = json.loads(metrics_file.read_text())
    timed = samples[1:-1] if args.profile_dir and len(samples) > 2 else samples[1:] or samples
    tps = statistics.median(s["decode_tokens_per_s"] for s in timed)
    weights_gb_s = statistics.median(s["bandwidth_gb_s"] for s in timed)
    import qlayers
    import shapes
    from loading import parse_dtype
    from memory import kv_cache_bytes
    kv = kv_cache_bytes(qlayers.meta_model(shapes.shape_args(shape)), batch, seq_length(args),
                        parse_dtype(dtype_of(precision, args.device)))
    row.update(decode_tokens_per_s=tps, ms_per_step=1000 * batch / tps, weights_gb_s=weights_gb_s,
               kv_cache_gb_s=kv * tps / batch / 1e9, ttft_s=statistics.median(s["ttft_s"] for s in timed),
               peak_memory_bytes=samples[-1]["peak_memory_bytes"], samples=samples,
               bandwidth_fraction=weights_gb_s / membw["gb_s"] if membw.get("gb_s") else None)
    return row


def run(args) -> int:
    """scripts.bench's entry for --shape: args as its parser leaves them (lists split)."""
    import tempfile

    from scripts.bench import run_membw, subprocess_env
    workdir = Path(tempfile.mkdtemp(prefix="minillm-bench-shapes-"))
    if args.profile_dir:
        Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
    membw = run_membw(args, workdir, "membw")
    from memory import available_memory
    free = membw.get("free_bytes") or available_memory("cpu") or 1 << 40
    all_jobs = jobs(args)
    planned = groups(all_jobs, args, free)
    log(f"{len(all_jobs)} processes in {len(planned)} group(s) for {free / 1e9:.0f} GB free; "
        f"read bandwidth {membw.get('gb_s', 0):.0f} GB/s; logs in {workdir}")
    env = subprocess_env(TORCH_LOGS="perf_hints")
    if args.device != "cpu":
        env.pop("OMP_NUM_THREADS"), env.pop("MKL_NUM_THREADS")  # the CPU bench's 2-thread protocol
        # a dozen processes compiling at once: a few Triton compile workers each, not one per core each
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "4")
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # no memory stranded in half-used segments
    rows, t0 = [], time.perf_counter()
    for i, group in enumerate(planned):
        log(f"group {i + 1}/{len(planned)}: {', '.join(map(tag, group))}")
        done = run_group(group, args, workdir, env)
        rows += [summarize(job, args, workdir, done[tag(job)][0], membw) for job in group]
    if args.profile_dir:  # the tables stay; the traces are tens of MB each
        for trace in Path(args.profile_dir).glob("*.trace.json"):
            trace.unlink()
    rows.sort(key=lambda r: all_jobs.index((r["shape"], r["precision"], r["batch_size"])))
    print_table(rows, membw, args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        args.json.write_text(json.dumps({"config": config, "memory_bandwidth": membw, "wall_s": time.perf_counter() - t0,
                                         "prompt_length": PROMPT_LENGTH, "rows": rows}, indent=1))
        log(f"wrote {args.json}")
    return 0 if all(r.get("decode_tokens_per_s") for r in rows) else 1


def print_table(rows: list, membw: dict, args):
    print(f"\n{membw.get('device', args.device)}: read bandwidth {membw.get('gb_s', 0):.0f} GB/s (torch sum); "
          f"greedy, {args.max_new_tokens} new tokens after {PROMPT_LENGTH}, median of the timed samples")
    head = ["shape", "precision", "batch", "tok/s", "ms/step", "weights GB/s", "% bw", "KV GB/s", "x first", "note"]
    base = {}
    cells = []
    for r in rows:
        tps = r.get("decode_tokens_per_s")
        if tps and r["batch_size"] == 1:
            base.setdefault(r["shape"], tps)
        first = base.get(r["shape"])
        note = ("SKIPPED CUDA GRAPHS " if r["skipped_cudagraphs"] else "") + \
            (f"FAILED (exit {r['returncode']})" if r.get("error") else "")
        cells.append([r["shape"], r["precision"], r["batch_size"], fmt(tps, ".1f"), fmt(r.get("ms_per_step"), ".2f"),
                      fmt(r.get("weights_gb_s"), ".0f"), fmt(r.get("bandwidth_fraction"), ".0f", 100),
                      fmt(r.get("kv_cache_gb_s"), ".0f"), fmt(tps / first if tps and first else None, ".2f"), note])
    widths = [max(len(str(c[i])) for c in [head] + cells) for i in range(len(head))]
    for c in [head, ["-" * w for w in widths]] + cells:
        print("  ".join(str(x).rjust(w) if 2 <= i < 9 else str(x).ljust(w) for i, (x, w) in enumerate(zip(c, widths))))
    for r in rows:
        if r.get("error"):
            print(f"ERROR {tag((r['shape'], r['precision'], r['batch_size']))}:\n{r['error']}")
    print("x first: tokens/s over the shape's first batch-1 row; % bw: weights read a step over the read bandwidth")


def fmt(x, spec, scale=1.0):
    return "-" if x is None else format(x * scale, spec)


def log(*args):
    print("[bench --shape]", *args, file=sys.stderr, flush=True)


if __name__ == "__main__":  # scripts.bench with --shape
    from scripts.bench import main
    if not {"--shape", "-h", "--help"} & {a.split("=")[0] for a in sys.argv[1:]}:
        sys.exit("error: give --shape (python -m scripts.bench runs the benchmarks against the peers)")
    sys.exit(main(prog="python -m scripts.bench_shapes"))
