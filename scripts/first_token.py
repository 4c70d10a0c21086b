"""How soon generate.py prints its first token with empty compile caches (a fresh
TORCHINDUCTOR_CACHE_DIR each run), in every mode: seconds from the "loaded" line to the first
byte of text, and the whole run's wall time; and one long run that reaches the compiled step in the
same process (when the compile ended, how many steps ran eagerly, tokens/s before and after).

    python -m scripts.first_token --json benchmarks/first-token.json"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
SCHEMA = json.dumps({"type": "object", "required": ["name", "age"], "additionalProperties": False,
                     "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}}})


def modes(ckpt: str, int4: str, schema: Path) -> dict:
    chat = ["--checkpoint", ckpt, "--chat", "--prompt", "What is a KV cache?"]
    return {
        "plain": ["--checkpoint", ckpt, "--prompt", "Once upon a time"],
        "chat": chat,
        "two prompts": ["--checkpoint", ckpt, "--prompt", "Once upon a time", "--prompt", "The capital of France"],
        "interactive": ["--checkpoint", ckpt, "--interactive"],
        "logprobs": chat + ["--logprobs", "3"],
        "json": ["--checkpoint", ckpt, "--chat", "--prompt", "A person as JSON.", "--json_schema", str(schema)],
        "sampling": chat + ["--temperature", "0.8", "--top_p", "0.9", "--seed", "1"],
        "int4": ["--checkpoint", int4, "--chat", "--prompt", "What is a KV cache?"],
        "ngram": chat + ["--ngram", "3"],
        "draft": chat + ["--draft_checkpoint", ckpt],
        "torchrun 2 ranks": TORCHRUN + chat,
    }


def run(flags: list, max_new_tokens: int, metrics: Path, timeout: float, cache: str = None) -> dict:
    """One generate.py process (its compile cache: `cache`, or a fresh one): when its stderr said
    "loaded" and "compiled in", when stdout's first byte came, when it ended, and its metrics."""
    with tempfile.TemporaryDirectory() as fresh:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache or fresh)
        launch = flags[:len(TORCHRUN)] == TORCHRUN
        cmd = [sys.executable, *(TORCHRUN if launch else []), "generate.py", *flags[len(TORCHRUN) if launch else 0:],
               "--max_new_tokens", str(max_new_tokens),
               "--metrics_json", str(metrics)]
        start, seen = time.time(), {}
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)

        def read_stderr():
            for line in proc.stderr:
                for word in (b"loaded", b"compiled in", b"prompt tokens"):
                    if word in line and word not in seen:
                        seen[word] = time.time()
        reader = threading.Thread(target=read_stderr, daemon=True)
        reader.start()
        if "--interactive" in flags:
            proc.stdin.write(b"What is a KV cache?\n\n")
        proc.stdin.close()
        first = proc.stdout.read(1) and time.time()
        proc.stdout.read()
        proc.wait(timeout)
        reader.join()
    if proc.returncode != 0 or not first:
        sys.exit(f"generate.py {' '.join(flags)} failed ({proc.returncode})")
    end = seen.get(b"prompt tokens", time.time())
    return dict(first_token_s=round(first - seen[b"loaded"], 1), wall_s=round(time.time() - start, 1),
                compiled_s=round(seen[b"compiled in"] - seen[b"loaded"], 1) if b"compiled in" in seen else None,
                end_s=end - seen[b"loaded"], metrics=json.loads(metrics.read_text())[-1])


def sharing(args, schema: Path, tmp: Path) -> list:
    rows, cache = [], str(tmp / "shared-cache")
    for name, flags in modes(args.checkpoint, args.int4, schema).items():
        if name == "torchrun 2 ranks" or (args.only is not None and name not in args.only):
            continue
        r = run(flags + ["--wait_for_compile"], args.max_new_tokens, tmp / "m.json", 1800, cache)
        rows.append(dict(mode=name, shared_cache=True, first_token_s=r["first_token_s"],
                         compile_cache_misses=r["metrics"]["compile_cache_misses"]))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python -m scripts.first_token")
    p.add_argument("--checkpoint", default="checkpoints/smollm2-135m")
    p.add_argument("--int4", default="checkpoints/smollm2-135m-int4-g32")
    p.add_argument("--max_new_tokens", type=int, default=32)
    p.add_argument("--long", type=int, default=3000, help="new tokens of the run that reaches the compiled step")
    p.add_argument("--only", nargs="*", default=None, help="these modes only (--json: the file's other rows stay)")
    p.add_argument("--sharing", action="store_true",
                   help="also: the modes one after another with --wait_for_compile in one compile cache, "
                        "the graphs each compiles that the earlier ones did not")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        schema = Path(tmp) / "schema.json"
        schema.write_text(SCHEMA)
        for name, flags in modes(args.checkpoint, args.int4, schema).items():
            if args.only is not None and name not in args.only:
                continue
            r = run(flags, args.max_new_tokens, Path(tmp) / "m.json", 900)
            rows.append(dict(mode=name, first_token_s=r["first_token_s"], wall_s=r["wall_s"],
                             new_tokens=r["metrics"]["new_tokens"], eager_steps=r["metrics"]["eager_steps"]))
            print(json.dumps(rows[-1]), flush=True)
        if args.long:
            r = run(["--checkpoint", args.checkpoint, "--prompt", "Once upon a time", "--ignore_eos"], args.long,
                    Path(tmp) / "m.json", 1800)
            m, eager = r["metrics"], r["metrics"]["eager_steps"]
            done = r["compiled_s"]
            long = dict(mode="plain, long", new_tokens=m["new_tokens"], first_token_s=r["first_token_s"],
                        compiled_s=done, eager_steps=eager,
                        eager_tokens_per_s=round(eager / (done - r["first_token_s"]), 1) if done else None,
                        compiled_tokens_per_s=round((m["new_tokens"] - eager) / (r["end_s"] - done), 1)
                        if done else None)
            print(json.dumps(long), flush=True)
            rows.append(long)
        if args.sharing:
            rows += sharing(args, schema, Path(tmp))
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        meta = dict(date=time.strftime("%Y-%m-%d"), commit=commit.stdout.strip(), cpus=os.cpu_count(),
                    command="python -m scripts.first_token " + " ".join(sys.argv[1:]))
        for row in rows:
            row.update(date=meta["date"], commit=meta["commit"])
        path = Path(args.json)
        if args.only is not None and path.exists():  # the other modes' rows stay, each with its date and commit
            old = json.loads(path.read_text())
            kept = [dict(r, **{k: old["meta"][k] for k in ("date", "commit") if k not in r}) for r in old["rows"]]
            ran = {(r["mode"], r.get("shared_cache", False)) for r in rows}
            rows = [r for r in kept if (r["mode"], r.get("shared_cache", False)) not in ran] + rows
        path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
