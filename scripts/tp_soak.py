"""Run many tensor-parallel jobs in a row and count the ones that fail: a crash that happens once
in a hundred jobs (a rank killed by a signal at exit, a hang) shows here, not in a test.

    python -m scripts.tp_soak --jobs 200 --ranks 2,3

Each job is `torchrun --standalone --nproc_per_node=R generate.py --checkpoint C --prompt P
--no-compile --max_new_tokens N` with R taken in turn from --ranks; a job passes when it exits 0
and prints the same text as the first job with as many ranks. Failures keep the tail of their
stderr. Writes a JSON summary with --out.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_job(ranks: int, args) -> tuple[subprocess.CompletedProcess, float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
           "generate.py", "--checkpoint", str(args.checkpoint), "--prompt", args.prompt, "--no-compile",
           "--max_new_tokens", str(args.max_new_tokens), "--tp_mode", args.tp_mode]
    env = dict(os.environ, OMP_NUM_THREADS="1", MINILLM_TP_TIMEOUT_S="120", MINILLM_TP_STACKS="1")
    t0 = time.monotonic()
    try:
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired as e:
        r = subprocess.CompletedProcess(cmd, -1, e.stdout or "", f"timed out after {args.timeout} s")
    return r, time.monotonic() - t0


def cause(r: subprocess.CompletedProcess) -> str:
    """A short name for why a job failed, from its stderr."""
    for needle, name in [("timed out", "timeout"), ("terminate called", "abort at exit"), ("Aborted", "abort"),
                         ("Segmentation fault", "segfault"), ("SIGSEGV", "segfault"), ("Signal 6", "abort"),
                         ("error: ", "error")]:
        if needle in (r.stderr or ""):
            return name
    return f"exit {r.returncode}"


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m scripts.tp_soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=ROOT / "checkpoints" / "smollm2-135m")
    p.add_argument("--jobs", type=int, default=200)
    p.add_argument("--ranks", default="2,3", help="ranks per job, taken in turn (default: 2,3)")
    p.add_argument("--prompt", default="The history of the Roman Empire")
    p.add_argument("--max_new_tokens", type=int, default=8)
    p.add_argument("--tp_mode", default="exact")
    p.add_argument("--timeout", type=float, default=300, help="seconds before a job counts as hung")
    p.add_argument("--out", type=Path, default=None, help="write the summary as JSON here")
    p.add_argument("--stop_on_failure", action="store_true", help="stop at the first failed job")
    args = p.parse_args(argv)
    ranks = [int(r) for r in args.ranks.split(",")]
    first, failures, seconds = {}, [], []
    for i in range(args.jobs):
        n = ranks[i % len(ranks)]
        r, dt = run_job(n, args)
        seconds.append(dt)
        ok = r.returncode == 0 and first.setdefault(n, r.stdout) == r.stdout
        if not ok:
            why = cause(r) if r.returncode != 0 else "different text"
            # the whole stderr: faulthandler's stacks of a crashed rank come before torchrun's report
            failures.append({"job": i, "ranks": n, "cause": why, "returncode": r.returncode,
                             "stdout": r.stdout or "", "stderr": r.stderr or ""})
            print(f"job {i} ({n} ranks): FAILED, {why}", file=sys.stderr)
        if not ok and args.stop_on_failure:
            break
        if (i + 1) % 10 == 0 or not ok:
            print(f"{i + 1}/{args.jobs} jobs, {len(failures)} failed, {dt:.1f} s for the last", file=sys.stderr)
    summary = {"jobs": len(seconds), "ranks": ranks, "failed": len(failures),
               "causes": dict(Counter(f["cause"] for f in failures)), "failures": failures,
               "median_job_s": sorted(seconds)[len(seconds) // 2], "machine": platform.node(),
               "date": time.strftime("%Y-%m-%d"), "command": " ".join(["python -m scripts.tp_soak", *(argv or sys.argv[1:])])}
    print(f"{len(seconds)} jobs over {ranks} ranks: {len(failures)} failed {summary['causes'] or ''}")
    if args.out:
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(summary, indent=1) + "\n")
        tmp.replace(args.out)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
