"""How fast the eager step runs beside the compile thread (warmup.compile_aside), at a given GIL
switch interval: SmolLM2-135M, one row, empty compile caches; the median step time per 20 s window
after the compile starts. compile_aside sets the interval itself; this measures what each costs.

    python -m scripts.aside_steps --interval 0.005   # Python's default
    python -m scripts.aside_steps --interval 0.0001  # what compile_aside uses"""
import argparse
import json
import os
import statistics
import tempfile
import time


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python -m scripts.aside_steps")
    p.add_argument("--checkpoint", default="checkpoints/smollm2-135m")
    p.add_argument("--interval", type=float, required=True, help="sys.setswitchinterval, seconds")
    p.add_argument("--tokens", type=int, default=900)
    args = p.parse_args()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp()  # empty caches: set before torch imports
    import torch
    import warmup
    from engine import Engine
    from loading import load_model
    from sampling import Sampling
    engine = Engine(load_model(args.checkpoint, torch.device("cpu"), torch.float32), 1, 4096, 4096,
                    compile=True, prefill_chunk=4096)
    original, warmup.sys.setswitchinterval = warmup.sys.setswitchinterval, lambda s: None
    original(args.interval)  # this interval, not compile_aside's
    start = time.perf_counter()
    engine.warm_up([[1, 2, 3, 4]], Sampling(), aside=True)
    _, stats = engine.generate([[1, 2, 3, 4]], args.tokens, Sampling())
    times = [t - start for t in stats.token_times]
    windows = {}
    for t, gap in zip(times[1:], [b - a for a, b in zip(times, times[1:])]):
        windows.setdefault(int(t // 20) * 20, []).append(gap)
    print(json.dumps(dict(interval_s=args.interval, eager_steps=stats.eager_steps,
                          median_step_ms={f"{k}-{k + 20} s": round(statistics.median(v) * 1000, 1)
                                          for k, v in sorted(windows.items())})), flush=True)
    os._exit(0)  # the compile thread may still run


if __name__ == "__main__":
    main()
