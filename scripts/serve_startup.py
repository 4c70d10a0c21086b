"""How soon serve.py answers: seconds from its start to /health, to the answer of a first 16-token
request (served by the eager step while the compiled one compiles), and to the compiled step
taking over, with empty compile caches (a fresh TORCHINDUCTOR_CACHE_DIR).

    python -m scripts.serve_startup --json benchmarks/serve-startup.json"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from scripts.bench_serve import ROOT, compiling


def get(url: str) -> str:
    return urllib.request.urlopen(url, timeout=5).read().decode()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python -m scripts.serve_startup")
    p.add_argument("--checkpoint", default="checkpoints/smollm2-135m")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--json", default=None)
    args, extra = p.parse_known_args()  # the rest go to serve.py
    url = f"http://127.0.0.1:{args.port}"
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
        start = time.time()
        proc = subprocess.Popen([sys.executable, "serve.py", "--checkpoint", args.checkpoint, "--port", str(args.port),
                                 *extra], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            while True:
                try:
                    get(url + "/health")
                    break
                except OSError:
                    if proc.poll() is not None:
                        sys.exit(f"serve.py exited with {proc.returncode}")
                    time.sleep(0.2)
            healthy = time.time() - start
            body = json.dumps({"model": Path(args.checkpoint).name, "prompt": "The capital of France is",
                               "max_tokens": 16, "temperature": 0}).encode()
            t = time.time()
            urllib.request.urlopen(urllib.request.Request(url + "/v1/completions", body,
                                                          {"Content-Type": "application/json"}), timeout=900).read()
            first = time.time() - t
            while compiling(url):
                time.sleep(1)
            compiled = time.time() - start
        finally:
            proc.terminate()
            proc.wait()
    row = dict(flags=extra, healthy_s=round(healthy, 1), first_request_s=round(first, 1),
               compiled_s=round(compiled, 1))
    print(json.dumps(row))
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        meta = dict(date=time.strftime("%Y-%m-%d"), commit=commit.stdout.strip(), cpus=os.cpu_count())
        Path(args.json).write_text(json.dumps(dict(meta=meta, rows=[row]), indent=1) + "\n")


if __name__ == "__main__":
    main()
