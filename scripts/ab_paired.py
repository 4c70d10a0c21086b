"""Two checkouts' generate.py decoding at the same time, taking turns on the CPU: both processes
build and compile, then this driver lets one run while it stops the other (SIGSTOP / SIGCONT),
switching every --slice seconds, so that both meet the same moments of a machine whose speed
drifts by more than the difference being measured (scripts/ab_decode.py alternates whole
processes, a minute apart).

Each sample is one generate call of --max_new_tokens tokens (EOS ignored); its figures are its
inter-token latency median (a pause is one long gap among the sample's tokens: the median skips it)
and its time to first token. Samples are kept while both processes run; the first of each
(compilation) is dropped. A round is one such pair of processes; --rounds pairs, the one that
starts first and runs first alternating, since two processes of the same checkout can differ by
several percent for their whole life (this VM pages out a process's memory left untouched
for a minute, as the first one's is while the second compiles). Reported per weight setting:
after/before decode speed (the ratio of the median latencies, inverted) and TTFT, the geometric
mean over the rounds, each with a 95% interval from resampling the rounds and each round's samples.

    git worktree add /tmp/before HEAD~1
    python -m scripts.ab_paired --before /tmp/before --weights float32,int8 --json benchmarks/paged-ab-paired.json"""
import argparse
import json
import math
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from scripts.ab_decode import add_checkout_options, generate_command, weight_settings
from scripts.bench import LONG_PROMPT, REPO_ROOT, SHORT_PROMPT, subprocess_env


class Run:
    """One checkout's generate.py with many samples; the times at which its samples ended."""

    def __init__(self, tree: Path, checkpoint: Path, weights: str, prompt: str, args, out: Path):
        self.out, self.ended = out, []
        self.proc = subprocess.Popen(generate_command(tree, checkpoint, weights, prompt, args, out), cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env=subprocess_env())
        threading.Thread(target=self.read, daemon=True).start()

    def read(self):
        for line in self.proc.stderr:
            if line.startswith("decode "):  # print_metrics' line: a sample has ended
                self.ended.append(time.monotonic())

    def signal(self, sig):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait_warm(self, timeout: float = 900):
        """Until its first sample (after compiling) has ended."""
        deadline = time.monotonic() + timeout
        while not self.ended:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"error: {self.proc.args[1]} ended or hung before its first sample")
            time.sleep(0.05)


def pair(trees: dict, checkpoint: Path, weights: str, prompt: str, args, work: Path) -> dict:
    """Both checkouts taking turns (in trees' order) until one has run its samples (or args.seconds):
    each one's samples (ITL median s, TTFT s) that ended meanwhile; the other then finishes alone,
    unmeasured."""
    runs = {}
    for name, tree in trees.items():  # one compiles at a time: compiling would skew nothing, but it is slow
        runs[name] = Run(tree, checkpoint, weights, prompt, args, work / f"{weights}-{name}.json")
        runs[name].wait_warm()
        runs[name].signal(signal.SIGSTOP)
    start = time.monotonic()
    while time.monotonic() - start < args.seconds and all(r.proc.poll() is None for r in runs.values()):
        for r in runs.values():
            r.signal(signal.SIGCONT)
            time.sleep(args.slice)
            r.signal(signal.SIGSTOP)
    end = time.monotonic()
    for r in runs.values():  # the metrics file is written at exit
        r.signal(signal.SIGCONT)
    got = {}
    for name, r in runs.items():
        if r.proc.wait(timeout=3600) != 0:
            sys.exit(f"error: {trees[name]}/generate.py failed on {weights}")
        kept = sum(start < t <= end for t in r.ended)
        first = sum(t <= start for t in r.ended)
        metrics = json.loads(r.out.read_text())[first:first + kept]
        got[name] = [(m["inter_token_latency_median_s"], m["ttft_s"]) for m in metrics]
    return got


def rounds_ratio(rounds: list, draws: int = 2000) -> tuple:
    """rounds: (after, before) sample lists. The geometric mean over rounds of median(before) /
    median(after), and a 95% interval: rounds resampled, then each one's samples."""
    def mean_ratio(pairs) -> float:
        return math.exp(statistics.fmean(math.log(statistics.median(b) / statistics.median(a)) for a, b in pairs))
    rng = random.Random(0)
    ratios = sorted(mean_ratio([(rng.choices(a, k=len(a)), rng.choices(b, k=len(b)))
                                for a, b in rng.choices(rounds, k=len(rounds))]) for _ in range(draws))
    return mean_ratio(rounds), (ratios[int(0.025 * draws)], ratios[int(0.975 * draws) - 1])


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m scripts.ab_paired", description=__doc__.split("\n\n")[0])
    add_checkout_options(p)
    p.add_argument("--seconds", type=float, default=600, help="of taking turns at most, per weight setting")
    p.add_argument("--slice", type=float, default=0.25, help="seconds a process runs before the other's turn")
    p.add_argument("--samples", type=int, default=60,
                   help="per process: the turns go on until one process has run them all (or --seconds)")
    p.add_argument("--rounds", type=int, default=1, help="pairs of processes, the first one alternating")
    args = p.parse_args(argv)
    work, table = Path(tempfile.mkdtemp(prefix="minillm-paired-")), []
    for w, checkpoint in weight_settings(args).items():
        rounds = []
        for r in range(args.rounds):
            order = [("after", REPO_ROOT), ("before", args.before)][::1 if r % 2 == 0 else -1]
            got = pair(dict(order), checkpoint, w, LONG_PROMPT if args.long else SHORT_PROMPT, args, work)
            if min(len(got["after"]), len(got["before"])) < 5:
                sys.exit(f"error: {w}: too few samples while both ran ({len(got['after'])}, {len(got['before'])}): "
                         "raise --seconds")
            rounds.append((got["after"], got["before"]))
        decode, decode_ci = rounds_ratio([([a for a, _ in af], [b for b, _ in bf]) for af, bf in rounds])
        ttft, ttft_ci = rounds_ratio([([b for _, b in bf], [a for _, a in af]) for af, bf in rounds])  # after / before
        after, before = [s for af, _ in rounds for s in af], [s for _, bf in rounds for s in bf]
        row = {"weights": w, "decode_ratio": decode, "decode_ci95": decode_ci, "ttft_ratio": ttft, "ttft_ci95": ttft_ci,
               "round_decode_ratios": [statistics.median(b for b, _ in bf) / statistics.median(a for a, _ in af)
                                       for af, bf in rounds],
               "samples": [len(after), len(before)],
               "itl_ms": [1000 * statistics.median(a for a, _ in after), 1000 * statistics.median(b for b, _ in before)],
               "ttft_ms": [1000 * statistics.median(a for _, a in after), 1000 * statistics.median(b for _, b in before)]}
        table.append(row)
        print(f"{w:9s} decode after/before {decode:.3f} ({decode_ci[0]:.3f}-{decode_ci[1]:.3f}), TTFT {ttft:.3f} "
              f"({ttft_ci[0]:.3f}-{ttft_ci[1]:.3f}); samples {len(after)} / {len(before)}; ITL "
              f"{row['itl_ms'][0]:.2f} / {row['itl_ms'][1]:.2f} ms", flush=True)
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                                text=True).stdout.strip()
        args.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "commit": commit, "argv": sys.argv[1:], "rows": table}, indent=1))


if __name__ == "__main__":
    main()
