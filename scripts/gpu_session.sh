#!/bin/bash
# A GPU machine without network access, reached through a tool that copies this working tree plus a
# few ignored folders (at most ~64 MiB a call): the CUDA tests and figures in a few calls.
#
# Here, on the CPU machine (needs network for PyPI and the SmolLM2 GGUF in the download cache):
#   scripts/gpu_session.sh prepare      # .gpu/whl (wheels for Python 3.12), .gpu/a and .gpu/b (GGUF halves)
# There, from the repository root, stages in order (a stage:SECONDS caps its time). The 7B figures
# (random weights made there, shapes.py) and the whole suite, in two calls of at most 8 minutes:
#   call 1, carrying .gpu/whl .gpu/a:  bash scripts/gpu_session.sh info parta quick shapes:330
#   call 2, carrying .gpu/whl .gpu/b:  bash scripts/gpu_session.sh model tests:420
# rehearsed here on the CPU with a tiny shape (tests/test_bench.py runs this):
#   PYTHON=.venv/bin/python DEVICE=cpu SHAPES=tiny DTYPE=float32 BATCHES=1,2 NEW=16 \
#     bash scripts/gpu_session.sh quick shapes
# Or the suite in halves and the SmolLM2 figures:
#   call 1, carrying .gpu/whl .gpu/a:  bash scripts/gpu_session.sh info parta kernels tests1:400
#   call 2, carrying .gpu/b, while the machine is still warm (files under /tmp persist until it goes back):
#                                      bash scripts/gpu_session.sh model tests2:420
#   then (each decode row is a compiling process):
#                                      bash scripts/gpu_session.sh serve:240 serve-prefix:120 serve-long:120
#                                      DTYPES=bfloat16 QUANT= bash scripts/gpu_session.sh decode:500
#   or, short of time: call 1 "info parta batching:120", call 2 "model warmup:200 serve:200" (serve.py's
#   warm-up took 147 s on an H100 with empty caches, 93 s with warm ones: the `warmup` stage says where).
# What fits in 15 minutes of device time (H200, 2026-11-28, 8 workers): the start ~30 s, tests1:250 ran
# 317 of its tests, tests2:300 ran 463 of its; a serve stage after them did not finish the warm-up in
# 200 s. Run the half that matters first, with the tests named (pytest -k) when only some matter.
# The paged engine's warm-up on an H200: the step's compile 172 s cold, its 23 graph recordings 2 s,
# the chunk graphs' compile more than 125 s even with the step cached (four graphs then; one now):
# run `warmup` first and give serve stages what is left.
# `attend` (scripts/cuda_attend.py) takes under a minute.
# Results (logs, JSON) go to $OUT (default /tmp/out).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}  # the GPU image's python3 holds torch; here, the virtualenv's
DEVICE=${DEVICE:-cuda}
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
HALF=48000000  # bytes in .gpu/a: the wheels and half the model fit under one call's limit

if [ "${1:-}" = prepare ]; then
  py=${PYTHON:-.venv/bin/python}
  mkdir -p .gpu/whl .gpu/a .gpu/b
  # what the GPU image lacks (its torch, transformers, numpy, tokenizers, safetensors, pytest... are there),
  # at the versions this virtualenv has (pydantic and pydantic-core, openai and httpx2 must agree)
  want="gguf starlette uvicorn openai httpx2 httpcore2 truststore idna anyio h11 distro jiter pydantic pydantic-core
    annotated-types typing-inspection sniffio llguidance jsonschema jsonschema-specifications referencing rpds-py"
  pins=$($py -m pip freeze 2>/dev/null | tr A-Z_ a-z- | grep -E "^($(echo $want | tr ' ' '|'))==")
  $py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_31_x86_64 -d .gpu/whl $pins || exit 1
  src=${MINILLM_CACHE:-$HOME/.cache/minillm}/gguf/$GGUF_NAME
  [ -f "$src" ] || $py download.py smollm2-135m || exit 1
  head -c $HALF "$src" > .gpu/a/part && tail -c +$((HALF + 1)) "$src" > .gpu/b/part
  du -sh .gpu/*
  exit 0
fi

export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ "$DEVICE" != cpu ]; then  # the GPU machine: caches under /tmp, the carried wheels installed there
  export MINILLM_CACHE=/tmp/mc TORCH_EXTENSIONS_DIR=/tmp/ext TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/triton
  if [ ! -f /tmp/site/.ok ] && [ -d .gpu/whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl \
      && touch /tmp/site/.ok || echo "installing the wheels failed"
  fi
  export PYTHONPATH=/tmp/site
fi
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# the tests that need no real model, and those that need SmolLM2 (the Gemma 3 270M ones are left out)
T1="tests/test_architectures.py tests/test_batching.py tests/test_device.py tests/test_hf_parity.py
 tests/test_kernels.py tests/test_gguf_families.py tests/test_structure.py tests/test_fuzz.py tests/test_bench.py
 tests/test_gemma.py"
T2="tests/test_convert.py tests/test_generate.py tests/test_memory.py tests/test_quantize.py tests/test_serve.py
 tests/test_serve_structured.py tests/test_speculative.py tests/test_speculative_grammar.py tests/test_structured.py
 tests/test_tokenizer.py tests/test_tp.py tests/test_validation.py"
NOGEMMA="not (gemma3_sentencepiece or gemma3_tokenizer_matches or gemma3_270m_logits or golden_greedy_output_gemma3)"

pytest_run() {  # name seconds pytest-args...
  local name=$1 secs=$2 t0=$SECONDS
  shift 2
  # SIGINT at the cap: pytest still prints the failures' tracebacks and its summary
  # a failure's traceback as it happens (MINILLM_EARLY_TRACEBACKS): a run cut at its cap prints no summary
  MINILLM_EARLY_TRACEBACKS=1 MINILLM_TEST_DEVICE=$DEVICE timeout -s INT -k 20 "$secs" $PY -m pytest -v \
    -n "${WORKERS:-$(( $(nproc) > 4 ? $(nproc) - 2 : 2 ))}" --dist loadfile \
    -p no:cacheprovider "$@" > "$OUT/$name.log" 2>&1
  echo "== $name rc=$? in $((SECONDS - t0)) s: $(grep -c ' PASSED' "$OUT/$name.log") passed so far"
  grep -E "^(FAILED|ERROR)| (FAILED|ERROR) |[0-9]+ (passed|failed)" "$OUT/$name.log" | cut -c1-300 | tail -40
}

keep_server_logs() {  # bench_serve's server logs (in /tmp/minillm-bench-serve-PID) come back too
  for f in /tmp/minillm-bench-serve-*/*.log; do
    [ -f "$f" ] && cp "$f" "$OUT/$(basename "$(dirname "$f")")-$(basename "$f")"
  done
}

for arg in "$@"; do
  stage=${arg%%:*}; secs=${arg#*:}; [ "$secs" = "$arg" ] && secs=300
  t0=$SECONDS
  echo "=== $stage"
  case $stage in
    info)
      nvidia-smi -L; nproc; grep -m1 "model name" /proc/cpuinfo
      $PY -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())" ;;
    parta) mkdir -p /tmp/parts && cp .gpu/a/part /tmp/parts/a ;;
    kernels) timeout "$secs" python3 -c "import kernels; print('CPU kernels built:', kernels.available())" ;;
    model)
      mkdir -p /tmp/mc/gguf
      if [ ! -f /tmp/parts/a ]; then echo "no first half: the machine went back between the calls"; else
        cat /tmp/parts/a .gpu/b/part > /tmp/mc/gguf/$GGUF_NAME && timeout "$secs" python3 download.py smollm2-135m; fi ;;
    tests1) pytest_run tests1 "$secs" -k "$NOGEMMA" $T1 ;;
    tests2) pytest_run tests2 "$secs" $T2 ;;
    tests) pytest_run tests "$secs" -k "$NOGEMMA" $T1 $T2 ;;
    quick)  # the quantized layers the 7B figures run, against their dequantized weights, on the device
      WORKERS=2 pytest_run quick "$secs" tests/test_quantize.py tests/test_shapes.py -k "tinygemm or int8_rows or shape" ;;
    shapes)
      # 7B shapes with random weights: every precision at batch 1, the first dtype at more rows; the
      # processes compile side by side, then time one at a time (scripts/bench_shapes.py)
      rm -rf /tmp/profiles
      timeout -k 10 "$secs" $PY -m scripts.bench --shape "${SHAPES:-llama-2-7b,llama-3.1-8b}" --device "$DEVICE" \
        --dtypes "${DTYPE:-bfloat16}" --quantized "${QUANT-int8,int4-g32,int4-g64}" --batch_sizes "${BATCHES:-1,8,32,64}" \
        --max_new_tokens "${NEW:-256}" --num_samples 4 --timeout "$((secs - 20))" --profile_dir /tmp/profiles \
        --json "$OUT/shapes.json"
      for f in /tmp/profiles/*.txt; do [ -f "$f" ] && { echo "=== $(basename "$f" .trace.txt)"; cat "$f"; }; done \
        > "$OUT/profiles.txt" ;;
    serve)  # ours at each concurrency; SERVE_ENGINES=ours,transformers adds generate_batch (~1 min a level)
      timeout -k 10 "$secs" python3 -m scripts.bench_serve --device cuda --precision "${PREC:-bfloat16}" \
        --engines "${SERVE_ENGINES:-ours}" --concurrency 1,4,8,16 --json "$OUT/serve-cuda.json"
      keep_server_logs ;;
    serve-prefix|serve-long)
      w=shared-prefix; [ "$stage" = serve-long ] && w=long-prompt
      timeout -k 10 "$secs" python3 -m scripts.bench_serve --device cuda --precision "${PREC:-bfloat16}" \
        --engines ours --workload $w --json "$OUT/$stage-cuda.json"
      keep_server_logs ;;
    warmup)  # where serve.py's warm-up time goes on CUDA: compile_times covers tracing and inductor, the
             # rest of the warm-up is running (Triton's first launches and autotuning, graph recording)
      timeout -k 10 "$secs" python3 - <<'PY'
import time, torch, serve
from engine import Engine
from loading import load_model
from torch._dynamo.utils import compile_times
model = load_model("checkpoints/smollm2-135m", torch.device("cuda"), torch.bfloat16)
engine = Engine.for_serving(model, 16, 392, compile=True)
run = engine.run
def timed(plan):  # each warm-up step as it ends: a run cut at its cap still says where the time went
    t = time.perf_counter()
    out = run(plan)
    torch.cuda.synchronize()
    print(f"  {len(plan.rides)} rows, {len(plan.chunks)} chunks: {time.perf_counter() - t:.1f} s", flush=True)
    return out
engine.run = timed
t = time.perf_counter()
serve.warm_up(engine)
print(f"warm-up {time.perf_counter() - t:.1f} s")
print(compile_times(repr="str", aggregate=True))
PY
      ;;
    attend) timeout -k 10 "$secs" python3 -m scripts.cuda_attend --json "$OUT/cuda-attend.json" ;;
    batching) pytest_run batching "$secs" --dist load tests/test_batching.py tests/test_device.py ;;
    decode)
      # each engine and precision is a process that compiles (40-70 s on an H200 with empty caches), twice
      # (both prompts): name fewer with ENGINES, DTYPES and QUANT (empty for none) to fit a call
      timeout -k 10 "$secs" python3 -m scripts.bench --device cuda --engines "${ENGINES:-ours,hf}" \
        --dtypes "${DTYPES:-bfloat16,float32}" --quantized "${QUANT-int8,int4-g32}" --rounds 1 \
        --json "$OUT/decode-cuda.json" 2>&1 | tail -30 ;;
    *) echo "unknown stage $stage" ;;
  esac
  echo "=== $stage done in $((SECONDS - t0)) s"
done
