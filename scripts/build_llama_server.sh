#!/usr/bin/env bash
# Build llama.cpp's llama-server (its continuously batching server), llama-batched-bench and
# llama-quantize from the llama.cpp sources vendored in llama-cpp-python's source distribution
# (PyPI is reachable where GitHub is not): the serving peer of scripts/bench_serve.py.
#   scripts/build_llama_server.sh            # -> $MINILLM_CACHE/llama.cpp/build/bin/llama-server
# LLAMA_CMAKE_FLAGS replaces the CPU flags below (AMX and AVX-VNNI off: they crash on these CPUs).
set -euo pipefail
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
CACHE=${MINILLM_CACHE:-$HOME/.cache/minillm}
SRC=$CACHE/llama.cpp
PY=${PYTHON:-.venv/bin/python}
FLAGS=${LLAMA_CMAKE_FLAGS:-"-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
 -DGGML_AVX_VNNI=OFF -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
 -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"}
if [ -x "$SRC/build/bin/llama-server" ]; then echo "$SRC/build/bin/llama-server"; exit 0; fi
mkdir -p "$CACHE"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  tmp=$(mktemp -d)
  "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$tmp"
  tar -xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
  rm -rf "$SRC.tmp" && mv "$tmp"/llama_cpp_python-*/vendor/llama.cpp "$SRC.tmp" && mv "$SRC.tmp" "$SRC"
  rm -rf "$tmp"
fi
# shellcheck disable=SC2086
cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release $FLAGS -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >/dev/null
cmake --build "$SRC/build" -j"$(nproc)" --target llama-server llama-batched-bench llama-quantize >/dev/null
echo "$SRC/build/bin/llama-server"
