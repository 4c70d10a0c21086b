"""Where a decode step's time goes on the host: generate.py run in this process with a timer around
the engine's parts (Engine.step and what it calls, the scheduler's, the feeder's), each part's
median microseconds over the last sample's steps. The compiled forward is `Engine.call_rides`; the
rest of `Engine.step` is host work between two forwards.

    python -m scripts.step_host --checkpoint checkpoints/smollm2-135m-int8 --json benchmarks/step-host.json"""
import argparse
import json
import runpy
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PARTS = {"engine": ("Engine", ("step", "run", "run_rides", "call_rides", "postprocess", "sampling_for")),
         "scheduler": ("Scheduler", ("schedule", "postprocess", "hand_out")),
         "forwards": ("Feeder", ("next_rides", "rides"))}


def timed(times: dict, cls, name: str):
    """cls.name, each call's seconds appended to times[Class.name]."""
    inner, key = getattr(cls, name), f"{cls.__name__}.{name}"

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            times.setdefault(key, []).append(time.perf_counter() - start)
    setattr(cls, name, wrapper)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m scripts.step_host", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path, default=REPO_ROOT / "checkpoints" / "smollm2-135m-int8")
    p.add_argument("--prompt", default="Once upon a time")
    p.add_argument("--max_new_tokens", type=int, default=300)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    times: dict = {}
    for module, (cls, names) in PARTS.items():
        owner = getattr(__import__(module), cls)
        for name in names:
            timed(times, owner, name)
    sys.argv = ["generate.py", "--checkpoint", str(args.checkpoint), "--prompt", args.prompt, "--max_new_tokens",
                str(args.max_new_tokens), "--temperature", "0", "--compile", "--ignore_eos", "--num_samples", "3",
                "--wait_for_compile"]
    runpy.run_path(str(REPO_ROOT / "generate.py"), run_name="__main__")
    last = args.max_new_tokens - 20  # the last sample's steady steps
    medians = {key: 1e6 * statistics.median(v[-last:]) for key, v in times.items() if len(v) >= last}
    for key, us in sorted(medians.items(), key=lambda kv: -kv[1]):
        print(f"{key:24s} {us:8.1f} us")
    host = medians["Engine.step"] - medians["Engine.call_rides"]
    print(f"host work a step (Engine.step - Engine.call_rides): {host:.0f} us of {medians['Engine.step']:.0f}")
    if args.json:
        args.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "checkpoint": args.checkpoint.name,
                                         "median_us": medians, "host_us": host}, indent=1))


if __name__ == "__main__":
    main()
