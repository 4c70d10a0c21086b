"""Hand-written CPU kernels, for the products that neither inductor nor BLAS does well here.

A speculative verify multiplies every weight by a few tokens at once (2 to 16). BLAS's small-M
GEMM is compute-bound at about a fifth of the machine's peak for such shapes, and inductor's
multiply-and-sum keeps one accumulator per output, a serial chain of multiply-adds; a 9-token
verify cost four decode steps either way. The kernel below is the textbook register-blocked
micro-kernel: two weight rows times up to six tokens, twelve AVX2 accumulators that stay in
registers, so each weight is read from memory once per call and reused for every token.
The same loop serves quantize.py's int8 and int4 layers for a few tokens, unpacking each block
of integers in registers, where they used to dequantize the whole weight for BLAS. (One compiled
token stays with inductor's fused code: this loop streamed int8 no faster, and leaving the
graph for every product cost more.)

It is C++ compiled once per machine with torch.utils.cpp_extension (g++ is needed anyway: it is
what inductor compiles to on CPU) and registered as the operators `minillm::small_linear`,
`minillm::int8_linear` and `minillm::int4_linear`, which compiled graphs call like aten ops.
Where it cannot be built (no AVX2, no compiler) or when MINILLM_KERNELS=0, `available()` is
False and callers use F.linear and inductor.
"""
import os
import sys
from contextlib import contextmanager

import torch
from torch import Tensor

MAX_TOKENS = 16  # above this BLAS's packed GEMM is the better kernel (prefill)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <type_traits>

namespace {

constexpr int PREFETCH_ROWS = 16;

// The integer formats' loops over a step's vectors (4 for int8, 8 for int4) are unrolled, so
// that each shift count is a constant: GCC left them as loops with shifts by a register.
// int4 products of 60 1536x576 weights, two threads: 4 tokens 14.0 -> 8.0 ms, 9 tokens 22.4 ->
// 17.0 ms; int8 within the noise. (Unrolling every loop of the float path as well spilled
// accumulators for 6-token blocks and made them slower, so it keeps its plain loops.)
#define UNROLL _Pragma("GCC unroll 8")

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

// Weight formats. Each step reads STEP columns of a row (fetch, from the address `at`) and
// yields them as STEP / 8 vectors of 8 float32 (part); `rows(n)` moves to row n. K is a multiple of STEP for the packed
// integer formats (quantize.py pads them), so only the float ones need `scalar` for a tail.
struct F32 {
  const float* w; int64_t ld;
  static constexpr int STEP = 8;
  using Raw = __m256;
  F32 rows(int64_t n) const { return {w + n * ld, ld}; }
  const float* at(int64_t r, int64_t k) const { return w + r * ld + k; }
  Raw fetch(int r, int64_t k) const { return _mm256_loadu_ps(at(r, k)); }
  __m256 part(Raw v, int, int64_t, int) const { return v; }
  float scalar(int r, int64_t k) const { return w[r * ld + k]; }
  float out_scale(int) const { return 1.f; }
};

struct BF16 {  // bfloat16 is the top half of a float32
  const at::BFloat16* w; int64_t ld;
  static constexpr int STEP = 8;
  using Raw = __m256;
  BF16 rows(int64_t n) const { return {w + n * ld, ld}; }
  const at::BFloat16* at(int64_t r, int64_t k) const { return w + r * ld + k; }
  Raw fetch(int r, int64_t k) const {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(at(r, k)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  __m256 part(Raw v, int, int64_t, int) const { return v; }
  float scalar(int r, int64_t k) const { return static_cast<float>(w[r * ld + k]); }
  float out_scale(int) const { return 1.f; }
};

// quantize.py's int8 layout: per row, blocks of 8 int32 lanes; byte j of lane l is column
// 32 * block + 8 * j + l. One scale per row, applied to the finished dot product.
struct Int8 {
  const int32_t* w; int64_t ld; const float* scale;
  static constexpr int STEP = 32;
  using Raw = __m256i;
  Int8 rows(int64_t n) const { return {w + n * ld, ld, scale + n}; }
  const int32_t* at(int64_t r, int64_t k) const { return w + r * ld + k / 4; }
  Raw fetch(int r, int64_t k) const { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at(r, k))); }
  __m256 part(Raw v, int, int64_t, int j) const {  // sign-extend byte j of each lane
    __m256i b = j == 3 ? v : _mm256_slli_epi32(v, 24 - 8 * j);
    return _mm256_cvtepi32_ps(_mm256_srai_epi32(b, 24));
  }
  float scalar(int, int64_t) const { return 0.f; }
  float out_scale(int r) const { return scale[r]; }
};

// quantize.py's int4 layout: blocks of 8 int32 lanes; nibble j of lane l is column
// 64 * block + 8 * j + l, holding q - 8; weight = (q - 8) * scale + zero per group of G columns
// (zero already includes 8 * scale). G is a power of two: column k is in group k >> gshift.
struct Int4 {
  const int32_t* w; int64_t ld; const float* scale; const float* zero; int64_t groups; int gshift;
  static constexpr int STEP = 64;
  using Raw = __m256i;
  Int4 rows(int64_t n) const { return {w + n * ld, ld, scale + n * groups, zero + n * groups, groups, gshift}; }
  const int32_t* at(int64_t r, int64_t k) const { return w + r * ld + k / 8; }
  Raw fetch(int r, int64_t k) const { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at(r, k))); }
  __m256 part(Raw v, int r, int64_t k, int j) const {
    __m256i b = j == 7 ? v : _mm256_slli_epi32(v, 28 - 4 * j);
    int64_t g = r * groups + ((k + 8 * j) >> gshift);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srai_epi32(b, 28)), _mm256_set1_ps(scale[g]),
                           _mm256_set1_ps(zero[g]));
  }
  float scalar(int, int64_t) const { return 0.f; }
  float out_scale(int) const { return 1.f; }
};

// y[t][r] = sum_k w[r][k] * x[t][k] for R weight rows and TB tokens: R * TB accumulators in
// registers, each weight vector loaded (and unpacked) once and used TB times.
template <int R, int TB, typename L>
void block(const float* x, int64_t K, const L& w, float* y, int64_t N) {
  __m256 acc[R][TB];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TB; ++t) acc[r][t] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + L::STEP <= K; k += L::STEP) {
    typename L::Raw raw[R];
    for (int r = 0; r < R; ++r) raw[r] = w.fetch(r, k);
    // the hardware prefetcher does not follow R interleaved rows that are short (a 576-column
    // int8 row is 9 cache lines): ask for the same columns PREFETCH_ROWS rows ahead.
    // 3 ms -> 1.1 ms for SmolLM2's int8 head (49152 x 576). Prefetches never fault.
    for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(w.at(r + PREFETCH_ROWS, k)), _MM_HINT_T0);
    UNROLL for (int j = 0; j < L::STEP / 8; ++j) {
      if constexpr (std::is_same_v<typename L::Raw, __m256>) {
        // float weights: token outer, row inner, so each x vector is loaded once for the R rows
        // (in the other order GCC folds the load into every multiply-add, R loads per vector,
        // and the loop is bound by the load ports; 9 tokens over SmolLM2: 36.5 -> 31.4 ms)
        for (int t = 0; t < TB; ++t) {
          __m256 xv = _mm256_loadu_ps(x + t * K + k + 8 * j);
          asm("" : "+x"(xv));  // keep it in a register: GCC would fold the load into each FMA again
          for (int r = 0; r < R; ++r) acc[r][t] = _mm256_fmadd_ps(raw[r], xv, acc[r][t]);
        }
      } else {
        // integer weights: one unpacked row at a time. Keeping R unpacked rows and an x vector
        // live as well needs more than the 16 registers (spills: int4, 9 tokens, 56 -> 71 ms)
        UNROLL for (int r = 0; r < R; ++r) {
          __m256 wv = w.part(raw[r], r, k, j);
          UNROLL for (int t = 0; t < TB; ++t)
            acc[r][t] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + t * K + k + 8 * j), acc[r][t]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TB; ++t) {
      float s = hsum(acc[r][t]);
      for (int64_t kk = k; kk < K; ++kk) s += w.scalar(r, kk) * x[t * K + kk];
      y[t * N + r] = s * w.out_scale(r);
    }
}

template <int R, typename L>
void rows(const float* x, int64_t T, int64_t K, const L& w, float* y, int64_t N) {
  // tokens in near-equal blocks of at most 12 / R (12 accumulators + R weights + 1 x <= 16 ymm)
  constexpr int MAXTB = 12 / R < 6 ? 12 / R : 6;
  int64_t blocks = (T + MAXTB - 1) / MAXTB;
  for (int64_t t0 = 0; t0 < T;) {
    int64_t tb = std::min<int64_t>((T - t0 + blocks - 1) / blocks, MAXTB);
    const float* xb = x + t0 * K;
    float* yb = y + t0 * N;
    switch (tb) {
      case 1: block<R, 1>(xb, K, w, yb, N); break;
      case 2: if constexpr (MAXTB >= 2) { block<R, 2>(xb, K, w, yb, N); } break;
      case 3: if constexpr (MAXTB >= 3) { block<R, 3>(xb, K, w, yb, N); } break;
      case 4: if constexpr (MAXTB >= 4) { block<R, 4>(xb, K, w, yb, N); } break;
      case 5: if constexpr (MAXTB >= 5) { block<R, 5>(xb, K, w, yb, N); } break;
      case 6: if constexpr (MAXTB >= 6) { block<R, 6>(xb, K, w, yb, N); } break;
    }
    t0 += tb;
    --blocks;
  }
}

template <typename L>
at::Tensor run(const at::Tensor& x, const L& w, int64_t N) {
  auto xc = x.contiguous();
  int64_t T = x.size(0), K = x.size(1);
  auto y = at::empty({T, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // one token: 4 rows at a time, so 4 independent chains hide the multiply-add latency
  constexpr int R1 = 4;
  int R = T == 1 ? R1 : 2;
  at::parallel_for(0, N / R, 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      if (T == 1) block<R1, 1>(xp, K, w.rows(i * R1), yp + i * R1, N);
      else rows<2>(xp, T, K, w.rows(i * 2), yp + i * 2, N);
    }
  });
  for (int64_t n = N / R * R; n < N; ++n) rows<1>(xp, T, K, w.rows(n), yp + n, N);
  return y;
}

void check_x(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "minillm kernels: x must be (tokens, ", K, ")");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "minillm kernels: x must be float32");
}

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2, "small_linear: w must be 2-d");
  check_x(x, w.size(1));
  auto wc = w.contiguous();
  if (wc.scalar_type() == at::kFloat) return run(x, F32{wc.data_ptr<float>(), wc.size(1)}, w.size(0));
  TORCH_CHECK(wc.scalar_type() == at::kBFloat16, "small_linear: weight must be float32 or bfloat16");
  return run(x, BF16{wc.data_ptr<at::BFloat16>(), wc.size(1)}, w.size(0));
}

// lanes: int32 (N, K / 4); scale: float32 (N,)
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& lanes, const at::Tensor& scale) {
  TORCH_CHECK(lanes.dim() == 2 && lanes.scalar_type() == at::kInt && lanes.is_contiguous(), "int8_linear: lanes");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == lanes.size(0),
              "int8_linear: scale");
  check_x(x, lanes.size(1) * 4);
  return run(x, Int8{lanes.data_ptr<int32_t>(), lanes.size(1), scale.data_ptr<float>()}, lanes.size(0));
}

// lanes: int32 (N, K / 8); scale, zero: float32 (N, groups)
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& lanes, const at::Tensor& scale,
                       const at::Tensor& zero) {
  TORCH_CHECK(lanes.dim() == 2 && lanes.scalar_type() == at::kInt && lanes.is_contiguous(), "int4_linear: lanes");
  int64_t K = lanes.size(1) * 8, groups = scale.size(1), G = K / groups;
  TORCH_CHECK(scale.scalar_type() == at::kFloat && zero.scalar_type() == at::kFloat && scale.is_contiguous() &&
              zero.is_contiguous() && scale.sizes() == zero.sizes() && scale.size(0) == lanes.size(0) &&
              G * groups == K && G >= 8 && (G & (G - 1)) == 0, "int4_linear: scale/zero");
  check_x(x, K);
  return run(x, Int4{lanes.data_ptr<int32_t>(), lanes.size(1), scale.data_ptr<float>(), zero.data_ptr<float>(),
                     groups, __builtin_ctzll(G)}, lanes.size(0));
}

}  // namespace

TORCH_LIBRARY(minillm, m) {
  m.def("small_linear(Tensor x, Tensor w) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor lanes, Tensor scale) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor lanes, Tensor scale, Tensor zero) -> Tensor");
}
TORCH_LIBRARY_IMPL(minillm, CPU, m) {
  m.impl("small_linear", &small_linear);
  m.impl("int8_linear", &int8_linear);
  m.impl("int4_linear", &int4_linear);
}
"""

_state = {"built": None}


@torch.compiler.assume_constant_result  # a compiled graph asks once, at trace time
def available() -> bool:
    """Build (once per machine, ~1 min; cached by torch under ~/.cache/torch_extensions) and load
    the kernel; False where it cannot run."""
    if _state["built"] is None:
        _state["built"] = _build()
    return _state["built"]


def _build() -> bool:
    if os.environ.get("MINILLM_KERNELS", "1") == "0":
        return False
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return False
    # the ninja that requirements.txt installs sits next to this Python, maybe not on PATH
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    try:
        from torch.utils.cpp_extension import load_inline
        print("kernels.py: loading the CPU kernels (built once per machine, ~1 min)", file=sys.stderr)
        load_inline(name="minillm_kernels", cpp_sources=[_SOURCE], is_python_module=False,
                    extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"], extra_ldflags=["-fopenmp"])
    except Exception as e:  # no compiler, no headers: fall back to BLAS, say why once
        print(f"kernels.py: CPU kernels not built ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
              "falling back to F.linear and inductor", file=sys.stderr)
        return False

    for op in ("small_linear", "int8_linear", "int4_linear"):  # the output shape, for tracing
        torch.library.register_fake(f"minillm::{op}")(lambda x, w, *scales: x.new_empty(x.shape[0], w.shape[0]))
    return True


@contextmanager
def switched_off():
    """Callers take their other paths inside (eager calls; a graph traced inside keeps them)."""
    built = available()
    _state["built"] = False
    try:
        yield
    finally:
        _state["built"] = built


def small_linear(x: Tensor, w: Tensor) -> Tensor:
    """x (..., K) float32 times w (N, K) float32 or bfloat16, transposed: (..., N) float32."""
    y = torch.ops.minillm.small_linear(x.reshape(-1, x.shape[-1]), w)
    return y.view(*x.shape[:-1], w.shape[0])


def int8_linear(x: Tensor, lanes: Tensor, scale: Tensor) -> Tensor:
    """x (T, K) float32 times quantize.py's int8 weight: lanes int32 (N, K / 4), scale (N,)."""
    return torch.ops.minillm.int8_linear(x, lanes, scale)


def int4_linear(x: Tensor, lanes: Tensor, scale: Tensor, zero: Tensor) -> Tensor:
    """x (T, K) float32 times quantize.py's int4 weight: lanes int32 (N, K / 8), scale and zero
    float32 (N, groups) with zero including 8 * scale."""
    return torch.ops.minillm.int4_linear(x, lanes, scale, zero)
