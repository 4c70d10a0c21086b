// Hand-written CPU kernels for kernels.py, registered as the operators minillm::small_linear,
// q8_linear, q4_linear, q8_dequantize, q4_dequantize, attend, prompt_attend, gated, rms_norm and stream_sum,
// which compiled graphs
// call like aten ops. AVX2 and FMA; with AVX-512 and VNNI (kernels.py builds so where the CPU has
// them) the integer loops work on 512-bit tiles of rows x tokens with vpdpbusd, and the float
// products on 16-lane loops (one token) and tiles (more).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <vector>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

namespace {

constexpr int PREFETCH_ROWS = 16;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

// Float weight formats: `fetch` loads 8 columns of a row as float32 (from the address `at`),
// `scalar` one column (the tail of a K that is not a multiple of 8); `rows(n)` moves to row n.
struct F32 {
  const float* w; int64_t ld;
  F32 rows(int64_t n) const { return {w + n * ld, ld}; }
  const float* at(int64_t r, int64_t k) const { return w + r * ld + k; }
  __m256 fetch(int r, int64_t k) const { return _mm256_loadu_ps(at(r, k)); }
  float scalar(int r, int64_t k) const { return w[r * ld + k]; }
};

struct BF16 {  // bfloat16 is the top half of a float32
  const at::BFloat16* w; int64_t ld;
  BF16 rows(int64_t n) const { return {w + n * ld, ld}; }
  const at::BFloat16* at(int64_t r, int64_t k) const { return w + r * ld + k; }
  __m256 fetch(int r, int64_t k) const {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(at(r, k)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  float scalar(int r, int64_t k) const { return static_cast<float>(w[r * ld + k]); }
};

// y[t][r] = sum_k w[r][k] * x[t][k] for R weight rows and TB tokens: R * TB accumulators in
// registers, each weight vector loaded once and used TB times.
template <int R, int TB, typename L>
void block(const float* x, int64_t K, const L& w, float* y, int64_t N) {
  __m256 acc[R][TB];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TB; ++t) acc[r][t] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 raw[R];
    for (int r = 0; r < R; ++r) raw[r] = w.fetch(r, k);
    // the hardware prefetcher does not follow R interleaved rows that are short: ask for the
    // same columns PREFETCH_ROWS rows ahead. Into L2 only (T1): 16 rows ahead are more weights
    // than L1 holds, and bringing them there would evict the tokens' activations that every row
    // reuses. Prefetches never fault.
    for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(w.at(r + PREFETCH_ROWS, k)), _MM_HINT_T1);
    // token outer, row inner, so each x vector is loaded once for the R rows (in the other
    // order GCC folds the load into every multiply-add, R loads per vector, and the loop is
    // bound by the load ports)
    for (int t = 0; t < TB; ++t) {
      __m256 xv = _mm256_loadu_ps(x + t * K + k);
      asm("" : "+x"(xv));  // keep it in a register: GCC would fold the load into each FMA again
      for (int r = 0; r < R; ++r) acc[r][t] = _mm256_fmadd_ps(raw[r], xv, acc[r][t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TB; ++t) {
      float s = hsum(acc[r][t]);
      for (int64_t kk = k; kk < K; ++kk) s += w.scalar(r, kk) * x[t * K + kk];
      y[t * N + r] = s;
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

#ifdef __AVX512F__
// One token (the decode step), with AVX-512: each thread walks its rows front to back, one row
// at a time, a single sequential stream, with four accumulators per row so that the loads, not
// the multiply-add latency, set the pace. Inductor's multiply-and-sum reaches ~30 GB/s on a
// 4864-wide row where this reaches ~50 (docs/benchmarks.md).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const at::BFloat16* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

inline float dot_row(const float* x, const float* w, int64_t K) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    a0 = _mm512_fmadd_ps(load16(w + k), _mm512_loadu_ps(x + k), a0);
    a1 = _mm512_fmadd_ps(load16(w + k + 16), _mm512_loadu_ps(x + k + 16), a1);
    a2 = _mm512_fmadd_ps(load16(w + k + 32), _mm512_loadu_ps(x + k + 32), a2);
    a3 = _mm512_fmadd_ps(load16(w + k + 48), _mm512_loadu_ps(x + k + 48), a3);
  }
  for (; k + 16 <= K; k += 16) a0 = _mm512_fmadd_ps(load16(w + k), _mm512_loadu_ps(x + k), a0);
  if (k < K) {
    __mmask16 m = static_cast<__mmask16>((1u << (K - k)) - 1);
    a0 = _mm512_fmadd_ps(load16(w + k, m), _mm512_maskz_loadu_ps(m, x + k), a0);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

// bfloat16: 32 weights are one 64-byte load, and as 16 32-bit lanes each lane holds two weights,
// the even one in its low half. `<< 16` turns the even weights into float32 and
// `& 0xffff0000` the odd ones: two instructions where widening 16 at a time takes four (1.06-1.23x
// on the products alone, docs/benchmarks.md). xs holds x split to match: each 32 columns as their
// 16 even then 16 odd values (split_x). The products are exact, as in the float32 loop.
inline float dot_row(const float* xs, const float* x, const at::BFloat16* w, int64_t K) {
  const __m512i odd = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  auto even_w = [](__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); };
  auto odd_w = [&](__m512i v) { return _mm512_castsi512_ps(_mm512_and_si512(v, odd)); };
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    __m512i w0 = _mm512_loadu_si512(w + k), w1 = _mm512_loadu_si512(w + k + 32);
    a0 = _mm512_fmadd_ps(even_w(w0), _mm512_loadu_ps(xs + k), a0);
    a1 = _mm512_fmadd_ps(odd_w(w0), _mm512_loadu_ps(xs + k + 16), a1);
    a2 = _mm512_fmadd_ps(even_w(w1), _mm512_loadu_ps(xs + k + 32), a2);
    a3 = _mm512_fmadd_ps(odd_w(w1), _mm512_loadu_ps(xs + k + 48), a3);
  }
  if (k + 32 <= K) {
    __m512i w0 = _mm512_loadu_si512(w + k);
    a0 = _mm512_fmadd_ps(even_w(w0), _mm512_loadu_ps(xs + k), a0);
    a1 = _mm512_fmadd_ps(odd_w(w0), _mm512_loadu_ps(xs + k + 16), a1);
    k += 32;
  }
  for (; k + 16 <= K; k += 16) a2 = _mm512_fmadd_ps(load16(w + k), _mm512_loadu_ps(x + k), a2);
  if (k < K) {
    __mmask16 m = static_cast<__mmask16>((1u << (K - k)) - 1);
    a3 = _mm512_fmadd_ps(load16(w + k, m), _mm512_maskz_loadu_ps(m, x + k), a3);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

// x's whole 32-column blocks as dot_row(xs, ...) reads them: 16 even values, then 16 odd
std::vector<float> split_x(const float* x, int64_t K) {
  std::vector<float> xs(K / 32 * 32);
  for (int64_t b = 0; b + 32 <= K; b += 32)
    for (int64_t i = 0; i < 16; ++i) {
      xs[b + i] = x[b + 2 * i];
      xs[b + 16 + i] = x[b + 2 * i + 1];
    }
  return xs;
}

// (1, N) float32: row(n) for every row, each thread a contiguous range of rows front to back
template <typename Row>
at::Tensor gemv_rows(int64_t N, const at::TensorOptions& options, const Row& row) {
  auto y = at::empty({1, N}, options.dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) yp[n] = row(n);
  });
  return y;
}

at::Tensor gemv(const float* x, const float* w, int64_t K, int64_t N, const at::TensorOptions& options) {
  return gemv_rows(N, options, [&](int64_t n) { return dot_row(x, w + n * K, K); });
}

at::Tensor gemv(const float* x, const at::BFloat16* w, int64_t K, int64_t N, const at::TensorOptions& options) {
  const std::vector<float> xs = split_x(x, K);
  return gemv_rows(N, options, [&](int64_t n) { return dot_row(xs.data(), x, w + n * K, K); });
}

#ifdef __AVX512BF16__
// One token of a bfloat16 model, with AVX-512 BF16: x's values are bfloat16 already, so x stays
// bfloat16 (half the cache footprint of a float32 copy: the 4864-wide down projection streamed
// ~1.17x faster) and vdpbf16ps multiplies 32 pairs per instruction, each product exact (8-bit
// significands) and added in float32, as the float32 loop's products are.
inline __m512bh bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }

inline float dot_row(const at::BFloat16* x, const at::BFloat16* w, int64_t K) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t k = 0;
  for (; k + 128 <= K; k += 128) {
    a0 = _mm512_dpbf16_ps(a0, bh(_mm512_loadu_si512(x + k)), bh(_mm512_loadu_si512(w + k)));
    a1 = _mm512_dpbf16_ps(a1, bh(_mm512_loadu_si512(x + k + 32)), bh(_mm512_loadu_si512(w + k + 32)));
    a2 = _mm512_dpbf16_ps(a2, bh(_mm512_loadu_si512(x + k + 64)), bh(_mm512_loadu_si512(w + k + 64)));
    a3 = _mm512_dpbf16_ps(a3, bh(_mm512_loadu_si512(x + k + 96)), bh(_mm512_loadu_si512(w + k + 96)));
  }
  for (; k + 32 <= K; k += 32) a0 = _mm512_dpbf16_ps(a0, bh(_mm512_loadu_si512(x + k)), bh(_mm512_loadu_si512(w + k)));
  if (k < K) {  // the masked tail: zeros beyond K add nothing
    __mmask32 m = static_cast<__mmask32>((1ull << (K - k)) - 1);
    a1 = _mm512_dpbf16_ps(a1, bh(_mm512_maskz_loadu_epi16(m, x + k)), bh(_mm512_maskz_loadu_epi16(m, w + k)));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

at::Tensor gemv(const at::BFloat16* x, const at::BFloat16* w, int64_t K, int64_t N, const at::TensorOptions& options) {
  return gemv_rows(N, options, [&](int64_t n) { return dot_row(x, w + n * K, K); });
}
#endif

// Several tokens, with AVX-512: R rows x TB tokens in 16 lanes, R * TB accumulators in registers,
// each weight vector loaded once for the TB tokens and each x vector once for the R rows. Every
// (row, token) has one chain of multiply-adds over K in 16-column steps (a masked last step) and
// one final reduction, whatever R and TB are: a token's bits do not depend on the token count.
template <int R, int TB, typename W>
void tile16(const float* x, int64_t K, const W* w, float* y, int64_t N) {
  __m512 acc[R][TB];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TB; ++t) acc[r][t] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 raw[R];
    for (int r = 0; r < R; ++r) raw[r] = load16(w + r * K + k);
    for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + (r + PREFETCH_ROWS) * K + k), _MM_HINT_T1);
    for (int t = 0; t < TB; ++t) {
      __m512 xv = _mm512_loadu_ps(x + t * K + k);
      asm("" : "+v"(xv));  // one load for the R rows (see block)
      for (int r = 0; r < R; ++r) acc[r][t] = _mm512_fmadd_ps(raw[r], xv, acc[r][t]);
    }
  }
  if (k < K) {
    __mmask16 m = static_cast<__mmask16>((1u << (K - k)) - 1);
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < TB; ++t)
        acc[r][t] = _mm512_fmadd_ps(load16(w + r * K + k, m), _mm512_maskz_loadu_ps(m, x + t * K + k), acc[r][t]);
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TB; ++t) y[t * N + r] = _mm512_reduce_add_ps(acc[r][t]);
}

// R rows for every token, in near-equal blocks of at most 6 tokens (R = 4: 24 accumulators, 4
// weights and one x vector in the 32 registers)
template <int R, typename W>
void rows16(const float* x, int64_t T, int64_t K, const W* w, float* y, int64_t N) {
  constexpr int MAXTB = 6;
  int64_t blocks = (T + MAXTB - 1) / MAXTB;
  for (int64_t t0 = 0; t0 < T;) {
    int64_t tb = std::min<int64_t>((T - t0 + blocks - 1) / blocks, MAXTB);
    const float* xb = x + t0 * K;
    float* yb = y + t0 * N;
    switch (tb) {
      case 1: tile16<R, 1>(xb, K, w, yb, N); break;
      case 2: tile16<R, 2>(xb, K, w, yb, N); break;
      case 3: tile16<R, 3>(xb, K, w, yb, N); break;
      case 4: tile16<R, 4>(xb, K, w, yb, N); break;
      case 5: tile16<R, 5>(xb, K, w, yb, N); break;
      case 6: tile16<R, 6>(xb, K, w, yb, N); break;
    }
    t0 += tb;
    --blocks;
  }
}

template <typename W>
at::Tensor tokens16(const at::Tensor& x, const W* w, int64_t N) {
  auto xc = x.contiguous();
  int64_t T = x.size(0), K = x.size(1);
  auto y = at::empty({T, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // up to 4 tokens the weights' read sets the pace: one row at a time, a single sequential stream
  // per thread (4 interleaved rows read ~5% slower); more tokens, 4 rows share each x vector
  const int64_t R = T <= 4 ? 1 : 4;
  at::parallel_for(0, N / R, 16, [&](int64_t b, int64_t e) {
    for (int64_t n = b * R; n < e * R; n += R) {
      if (R == 1) rows16<1>(xp, T, K, w + n * K, yp + n, N);
      else rows16<4>(xp, T, K, w + n * K, yp + n, N);
    }
  });
  for (int64_t n = N / R * R; n < N; ++n) rows16<1>(xp, T, K, w + n * K, yp + n, N);
  return y;
}
#endif

template <typename L>
at::Tensor run(const at::Tensor& x, const L& w, int64_t N) {
  auto xc = x.contiguous();
  int64_t T = x.size(0), K = x.size(1);
  auto y = at::empty({T, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // one token: 4 rows at a time, so 4 independent chains hide the multiply-add latency.
  // 2 or more: two rows, each x vector loaded once for both. Which rows share a loop does not
  // change any sum's order, so a token's results do not depend on the token count.
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
  auto wc = w.contiguous();
#ifdef __AVX512BF16__
  if (x.scalar_type() == at::kBFloat16) {  // one token of a bfloat16 model
    TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.size(1) == w.size(1) && wc.scalar_type() == at::kBFloat16,
                "small_linear: a bfloat16 x must be one token (1, ", w.size(1), ") times bfloat16 weights");
    auto xc = x.contiguous();
    return gemv(xc.data_ptr<at::BFloat16>(), wc.data_ptr<at::BFloat16>(), wc.size(1), wc.size(0), x.options());
  }
#endif
  check_x(x, w.size(1));
#ifdef __AVX512F__
  if (x.size(0) == 1) {
    auto xc = x.contiguous();
    if (wc.scalar_type() == at::kFloat) return gemv(xc.data_ptr<float>(), wc.data_ptr<float>(), wc.size(1), wc.size(0), x.options());
    if (wc.scalar_type() == at::kBFloat16)
      return gemv(xc.data_ptr<float>(), wc.data_ptr<at::BFloat16>(), wc.size(1), wc.size(0), x.options());
  }
  if (wc.scalar_type() == at::kFloat) return tokens16(x, wc.data_ptr<float>(), wc.size(0));
  if (wc.scalar_type() == at::kBFloat16) return tokens16(x, wc.data_ptr<at::BFloat16>(), wc.size(0));
#endif
  if (wc.scalar_type() == at::kFloat) return run(x, F32{wc.data_ptr<float>(), wc.size(1)}, w.size(0));
  TORCH_CHECK(wc.scalar_type() == at::kBFloat16, "small_linear: weight must be float32 or bfloat16");
  return run(x, BF16{wc.data_ptr<at::BFloat16>(), wc.size(1)}, w.size(0));
}

// ---------------------------------------------------------------- int8 and int4 weights
// As llama.cpp does on AVX2: the activations are quantized too, to int8 per block of 32 columns
// (x ~ d * xq), so a block of 32 products is two integer instructions (maddubs: 32 byte products
// summed in pairs; madd: pairs of pairs) and one float multiply-add for the block's scales.
// Unpacking each weight to float and multiplying in float (what inductor's code does) is
// compute-bound, well below memory bandwidth.

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define VNNI512 1
#else
#define VNNI512 0
#endif

// x (T, K) float32, K a multiple of 32 -> per token and block of 32: the scale d = absmax / 127,
// xq = round(x / d) in -127..127, an unsigned form of it for the int8 loop (a: |xq|, or with
// VNNI512 xq + 128), and d * sum(xq) (for int4's zeros).
struct QuantizedX {
  int64_t T, K, KB;
  std::vector<int8_t> q;
  std::vector<uint8_t> a;
  std::vector<float> d, sum;
  QuantizedX(const float* x, int64_t T_, int64_t K_) : T(T_), K(K_), KB(K_ / 32), q(T_ * K_), a(T_ * K_),
                                                        d(T_ * KB), sum(T_ * KB) {
    const __m256 signbit = _mm256_set1_ps(-0.f);
    for (int64_t i = 0; i < T * KB; ++i) {
      const float* xb = x + 32 * i;
      __m256 v[4], m = _mm256_setzero_ps();
      for (int j = 0; j < 4; ++j) {
        v[j] = _mm256_loadu_ps(xb + 8 * j);
        m = _mm256_max_ps(m, _mm256_andnot_ps(signbit, v[j]));
      }
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
      float inv = amax > 0 ? 127.f / amax : 0.f;
      __m256i n[4];
      for (int j = 0; j < 4; ++j) n[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(inv)));  // to nearest, ties to even
      __m256i total = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
      // int32 -> int8 packs within 128-bit halves; the permute puts the 32 bytes back in order
      __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
      b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.data() + 32 * i), b);
#if VNNI512  // xq + 128, dpbusd's unsigned operand in q8_tile
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.data() + 32 * i), _mm256_xor_si256(b, _mm256_set1_epi8(-128)));
#else
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.data() + 32 * i), _mm256_abs_epi8(b));
#endif
      __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
      t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4e));
      t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xb1));
      d[i] = amax / 127.f;
      sum[i] = d[i] * static_cast<float>(_mm_cvtsi128_si32(t4));
    }
  }
};

inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// sum over 32 columns of xq * w as 8 int32 partial sums, as floats; u unsigned bytes, s signed.
// With AVX-512 VNNI (built so where the CPU has it) one vpdpbusd does what takes two
// instructions in AVX2: maddubs (32 byte products summed in pairs; |products| summed in pairs
// stay below 2 * 127 * 127, so it never saturates) and madd (pairs of pairs).
inline __m256 dot32(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s));
#else
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// R accumulators of 8 floats (R = 1 or 4) -> each one's sum, times scale[r], to y[0..R)
template <int R>
inline void store_sums(const __m256* acc, const float* scale, float* y) {
  if constexpr (R == 4) {  // the four horizontal sums at once: [r0, r1, r2, r3] in one vector
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    _mm_storeu_ps(y, scale ? _mm_mul_ps(s4, _mm_loadu_ps(scale)) : s4);
  } else {  // the same additions in the same order as above: a row's bits do not depend on its neighbours
    __m256 h = _mm256_hadd_ps(acc[0], acc[0]);
    h = _mm256_hadd_ps(h, h);
    float s = _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    y[0] = s * (scale ? scale[0] : 1.f);
  }
}

// The AVX2 loops (VNNI512 has its own below). Both take R = 4 rows at a time (the rest one by
// one) and read each row front to back, one after another: a sequential stream that the
// hardware prefetcher follows, which matters more than loading each activation block once for
// all four rows (weights come from memory). What the four rows share is the horizontal
// reduction at the end.

// int8: w (N, K) row-major, one scale per row. y = scale * sum_b d_b * (xq_b . w_b). maddubs
// wants one unsigned operand: |xq| times w with xq's signs moved onto it.
template <int R>
void q8_group(const int8_t* w, const float* scale, const QuantizedX& x, int64_t n, float* y, int64_t N) {
  int64_t K = x.K, KB = x.KB;
  for (int64_t t = 0; t < x.T; ++t) {
    const int8_t* xq = x.q.data() + t * K;
    const uint8_t* xa = x.a.data() + t * K;
    const float* d = x.d.data() + t * KB;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) {
      const int8_t* wr = w + (n + r) * K;
      auto step = [&](int64_t b, __m256 a) {
        __m256i ws = _mm256_sign_epi8(load32(wr + 32 * b), load32(xq + 32 * b));
        return _mm256_fmadd_ps(dot32(load32(xa + 32 * b), ws), _mm256_set1_ps(d[b]), a);
      };
      // four chains of multiply-adds, in named variables: as an indexed array they would live on the stack
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      int64_t b = 0;
      for (; b + 4 <= KB; b += 4) {
        a0 = step(b, a0); a1 = step(b + 1, a1); a2 = step(b + 2, a2); a3 = step(b + 3, a3);
      }
      for (; b < KB; ++b) a0 = step(b, a0);
      acc[r] = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    }
    store_sums<R>(acc, scale + n, y + t * N + n);
  }
}

// int4: w (N, K / 2) bytes, per 64 columns 32 bytes whose low nibbles are columns 0-31 and high
// nibbles 32-63, q in 0..15; scales, zeros float16 (N, groups padded to a multiple of 8), group
// size 32 << gshift. w = q * scale + zero, so y = sum_g scale_g sum_{b in g} d_b (xq_b . q_b)
// + sum_g zero_g xsum_g with xsum_g the group's sum of the quantized x.
template <int R>
void q4_group(const uint8_t* w, const at::Half* scales, const at::Half* zeros, int64_t G8, int gshift,
              const QuantizedX& x, const float* xsum, int64_t n, float* y, int64_t N, float* sc) {
  int64_t K = x.K, KB = x.KB;
  const __m256i low = _mm256_set1_epi8(0x0f);
  for (int64_t t = 0; t < x.T; ++t) {
    const int8_t* xq = x.q.data() + t * K;
    const float* d = x.d.data() + t * KB;
    __m256 acc[R];  // each row's zero term, then its products added
    for (int r = 0; r < R; ++r) {
      // sc[r * KB + b]: row r's scale for block b times the block's activation scale
      const uint16_t* s16 = reinterpret_cast<const uint16_t*>(scales + (n + r) * G8);
      float* scr = sc + r * KB;
      if (gshift == 0) {
        for (int64_t b = 0; b + 8 <= KB; b += 8) {
          __m256 s8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s16 + b)));
          _mm256_storeu_ps(scr + b, _mm256_mul_ps(s8, _mm256_loadu_ps(d + b)));
        }
        for (int64_t b = KB / 8 * 8; b < KB; ++b) scr[b] = _cvtsh_ss(s16[b]) * d[b];
      } else {
        for (int64_t b = 0; b < KB; ++b) scr[b] = _cvtsh_ss(s16[b >> gshift]) * d[b];
      }
      acc[r] = _mm256_setzero_ps();
      const uint16_t* z16 = reinterpret_cast<const uint16_t*>(zeros + (n + r) * G8);
      const float* xs = xsum + t * G8;
      for (int64_t g = 0; g < G8; g += 8)
        acc[r] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(z16 + g))),
                                 _mm256_loadu_ps(xs + g), acc[r]);
    }
    for (int r = 0; r < R; ++r) {
      const uint8_t* wr = w + (n + r) * (K / 2);
      const float* scr = sc + r * KB;
      auto step = [&](int64_t b, __m256& lo_acc, __m256& hi_acc) {  // 64 columns from 32 bytes
        __m256i v = load32(wr + 16 * b);
        __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        lo_acc = _mm256_fmadd_ps(dot32(lo, load32(xq + 32 * b)), _mm256_set1_ps(scr[b]), lo_acc);
        hi_acc = _mm256_fmadd_ps(dot32(hi, load32(xq + 32 * b + 32)), _mm256_set1_ps(scr[b + 1]), hi_acc);
      };
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;  // named, as in q8_group
      int64_t b = 0;
      for (; b + 4 <= KB; b += 4) {
        step(b, a0, a1); step(b + 2, a2, a3);
      }
      if (b < KB) step(b, a0, a1);
      acc[r] = _mm256_add_ps(acc[r], _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    }
    store_sums<R>(acc, nullptr, y + t * N + n);
  }
}

#if VNNI512
// tile(t0, tb) over tokens 0..T in near-equal blocks of tb <= 4 tokens, tb a compile-time constant
template <typename F>
void token_blocks(int64_t T, const F& tile) {
  int64_t blocks = (T + 3) / 4;
  for (int64_t t0 = 0; t0 < T; --blocks) {
    int64_t tb = std::min<int64_t>((T - t0 + blocks - 1) / blocks, 4);
    switch (tb) {
      case 1: tile(t0, std::integral_constant<int, 1>{}); break;
      case 2: tile(t0, std::integral_constant<int, 2>{}); break;
      case 3: tile(t0, std::integral_constant<int, 3>{}); break;
      default: tile(t0, std::integral_constant<int, 4>{}); break;
    }
    t0 += tb;
  }
}

// int8 with AVX-512 VNNI: R rows x TB tokens at once, 64 columns (two blocks) per step in 16
// lanes: lanes 0-7 sum block 2c's products and 8-15 block 2c+1's, each weight vector loaded once
// for the TB tokens and each activation vector once for the R rows. vpdpbusd wants one unsigned
// operand: it multiplies xq + 128 by w, starting from -128 * (w's sums), so the integer sums are
// exactly xq . w. Every (row, token) has one chain of multiply-adds and one final reduction
// whatever R and TB are: a token's bits do not depend on the others.
template <int R, int TB>
void q8_tile(const int8_t* w, const int32_t* starts, const float* scale, const QuantizedX& x, int64_t n, int64_t t0,
             float* y, int64_t N) {
  const int64_t K = x.K, KB = x.KB, C = (KB + 1) / 2;
  const __m512i halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  __m512 acc[R][TB];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TB; ++t) acc[r][t] = _mm512_setzero_ps();
  auto chunk = [&](int64_t c, bool whole) {  // columns 64c.. (whole: both blocks; else the first only)
    const __mmask64 m = whole ? ~0ULL : 0xffffffffULL;
    __m512i wv[R], start[R];
    for (int r = 0; r < R; ++r) {
      const int8_t* wr = w + (n + r) * K + 64 * c;
      wv[r] = _mm512_maskz_loadu_epi8(m, wr);
      start[r] = _mm512_loadu_si512(starts + (r * C + c) * 16);
      _mm_prefetch(reinterpret_cast<const char*>(wr + PREFETCH_ROWS * K), _MM_HINT_T1);
    }
    for (int t = 0; t < TB; ++t) {
      const uint8_t* xa = x.a.data() + (t0 + t) * K + 64 * c;
      const float* d = x.d.data() + (t0 + t) * KB + 2 * c;
      __m512i u = _mm512_maskz_loadu_epi8(m, xa);
      __m128 d2 = whole ? _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(d))) : _mm_load_ss(d);
      __m512 dv = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(d2));
      for (int r = 0; r < R; ++r)
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start[r], u, wv[r])), dv, acc[r][t]);
    }
  };
  int64_t c = 0;
  for (; 2 * c + 2 <= KB; ++c) chunk(c, true);
  if (2 * c < KB) chunk(c, false);
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TB; ++t) y[(t0 + t) * N + n + r] = _mm512_reduce_add_ps(acc[r][t]) * scale[n + r];
}

// rows n..n+R for every token, in blocks of at most 4 tokens; starts: scratch for
// R * 16 * ceil(KB / 2) int32, the rows' -128 * (w's sums) per chunk, made once for all blocks
template <int R>
void q8_rows(const int8_t* w, const float* scale, const QuantizedX& x, int64_t n, float* y, int64_t N,
             int32_t* starts) {
  const int64_t K = x.K, KB = x.KB, C = (KB + 1) / 2;
  const __m512i bias = _mm512_set1_epi8(-128), zero = _mm512_setzero_si512();
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) {
      __m512i wv = _mm512_maskz_loadu_epi8(2 * c + 2 <= KB ? ~0ULL : 0xffffffffULL, w + (n + r) * K + 64 * c);
      _mm512_storeu_si512(starts + (r * C + c) * 16, _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, bias, wv)));
    }
  token_blocks(x.T, [&](int64_t t0, auto tb) { q8_tile<R, decltype(tb)::value>(w, starts, scale, x, n, t0, y, N); });
}
#endif

// w: int8 (N, K), K a multiple of 32; scale: float32 (N,)
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous() && w.size(1) % 32 == 0,
              "q8_linear: w must be contiguous int8 (N, K) with K a multiple of 32");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == w.size(0),
              "q8_linear: scale must be float32 (N,)");
  check_x(x, w.size(1));
  int64_t T = x.size(0), K = w.size(1), N = w.size(0);
  auto xc = x.contiguous();
  QuantizedX xq(xc.data_ptr<float>(), T, K);
  auto y = at::empty({T, N}, x.options());
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // groups of four rows (about 64 KiB of weights per task at least), then the last N % 4 rows
#if VNNI512
  const int64_t chunks = (xq.KB + 1) / 2;
  at::parallel_for(0, N / 4, std::max<int64_t>(1, 16384 / K), [&](int64_t b, int64_t e) {
    std::vector<int32_t> starts(4 * 16 * chunks);
    for (int64_t g = b; g < e; ++g) q8_rows<4>(wp, sp, xq, 4 * g, yp, N, starts.data());
  });
  std::vector<int32_t> starts(16 * chunks);
  for (int64_t n = N / 4 * 4; n < N; ++n) q8_rows<1>(wp, sp, xq, n, yp, N, starts.data());
#else
  at::parallel_for(0, N / 4, std::max<int64_t>(1, 16384 / K), [&](int64_t b, int64_t e) {
    for (int64_t g = b; g < e; ++g) q8_group<4>(wp, sp, xq, 4 * g, yp, N);
  });
  for (int64_t n = N / 4 * 4; n < N; ++n) q8_group<1>(wp, sp, xq, n, yp, N);
#endif
  return y;
}

#if VNNI512
// int4 with AVX-512 VNNI: as q8_tile, R rows x TB tokens at once. 64 bytes of a row are 128
// columns, four blocks: their low nibbles are blocks 4c and 4c+2 (lanes 0-7 and 8-15 of `lo`),
// the high ones 4c+1 and 4c+3 (`hi`). Each half's integer sums are multiplied by the row's
// group scale times the token's block scale; the zeros' term (zero_g times the group's sum of
// xq) is one more chain, added at the end.
template <int R, int TB>
void q4_tile(const uint8_t* w, const at::Half* scales, const at::Half* zeros, int64_t G8, int gshift,
             const QuantizedX& x, const float* xsum, int64_t n, int64_t t0, float* y, int64_t N) {
  const int64_t K = x.K, KB = x.KB;
  const __m512i low = _mm512_set1_epi8(0x0f);
  const __m512i lanes02 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
  const __m512i lanes13 = _mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3);
  // the group of block 4c + i is group (4c >> gshift) + off[i]; a row's scales for the chunk are
  // its `span` groups from there
  const __m512i lanes01 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m512i slo = gshift == 0 ? lanes02 : gshift == 1 ? lanes01 : _mm512_setzero_si512();
  const __m512i shi = gshift == 0 ? lanes13 : slo;
  const int span = gshift == 0 ? 4 : gshift == 1 ? 2 : 1;
  __m512 acc[R][TB];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TB; ++t) acc[r][t] = _mm512_setzero_ps();
  auto chunk = [&](int64_t c, bool whole) {  // columns 128c.. (whole: 4 blocks; else 4c and 4c+1)
    __m512i wlo[R], whi[R];
    __m512 sl[R], sh[R];
    const int64_t g0 = (4 * c) >> gshift;
    const __mmask8 smask = static_cast<__mmask8>((1u << std::min<int64_t>(span, G8 - g0)) - 1);
    for (int r = 0; r < R; ++r) {
      const uint8_t* wr = w + (n + r) * (K / 2) + 64 * c;
      __m512i v = _mm512_maskz_loadu_epi8(whole ? ~0ULL : 0xffffffffULL, wr);
      wlo[r] = _mm512_and_si512(v, low);
      whi[r] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      __m512 s4 = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_maskz_loadu_epi16(smask, scales + (n + r) * G8 + g0)));
      sl[r] = _mm512_permutexvar_ps(slo, s4);
      sh[r] = _mm512_permutexvar_ps(shi, s4);
      _mm_prefetch(reinterpret_cast<const char*>(wr + PREFETCH_ROWS * (K / 2)), _MM_HINT_T1);
    }
    for (int t = 0; t < TB; ++t) {
      const int8_t* xq = x.q.data() + (t0 + t) * K + 128 * c;
      __m256i x0 = load32(xq), x1 = load32(xq + 32);
      __m512i xl = _mm512_zextsi256_si512(x0), xh = _mm512_zextsi256_si512(x1);
      if (whole) {
        xl = _mm512_inserti64x4(xl, load32(xq + 64), 1);
        xh = _mm512_inserti64x4(xh, load32(xq + 96), 1);
      }
      __m512 d4 = _mm512_castps128_ps512(_mm_maskz_loadu_ps(whole ? 0xf : 0x3, x.d.data() + (t0 + t) * KB + 4 * c));
      __m512 dl = _mm512_permutexvar_ps(lanes02, d4), dh = _mm512_permutexvar_ps(lanes13, d4);
      for (int r = 0; r < R; ++r) {
        __m512i pl = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wlo[r], xl);
        __m512i ph = _mm512_dpbusd_epi32(_mm512_setzero_si512(), whi[r], xh);
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pl), _mm512_mul_ps(sl[r], dl), acc[r][t]);
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ph), _mm512_mul_ps(sh[r], dh), acc[r][t]);
      }
    }
  };
  int64_t c = 0;
  for (; 4 * c + 4 <= KB; ++c) chunk(c, true);
  if (4 * c < KB) chunk(c, false);
  for (int r = 0; r < R; ++r) {
    const uint16_t* z16 = reinterpret_cast<const uint16_t*>(zeros + (n + r) * G8);
    for (int t = 0; t < TB; ++t) {
      const float* xs = xsum + (t0 + t) * G8;
      __m256 z = _mm256_setzero_ps();
      for (int64_t g = 0; g < G8; g += 8)
        z = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(z16 + g))),
                            _mm256_loadu_ps(xs + g), z);
      y[(t0 + t) * N + n + r] = _mm512_reduce_add_ps(acc[r][t]) + hsum(z);
    }
  }
}

template <int R>
void q4_rows(const uint8_t* w, const at::Half* scales, const at::Half* zeros, int64_t G8, int gshift,
             const QuantizedX& x, const float* xsum, int64_t n, float* y, int64_t N) {
  token_blocks(x.T, [&](int64_t t0, auto tb) {
    q4_tile<R, decltype(tb)::value>(w, scales, zeros, G8, gshift, x, xsum, n, t0, y, N);
  });
}
#endif

// w: uint8 (N, K / 2) as q4_group reads it, K a multiple of 64; scales, zeros: float16 (N, G8) with
// G8 >= K / groupsize a multiple of 8 (the padding is zeros)
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, const at::Tensor& zeros,
                     int64_t groupsize) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(1) % 32 == 0,
              "q4_linear: w must be contiguous uint8 (N, K / 2) with K a multiple of 64");
  int64_t N = w.size(0), K = w.size(1) * 2, G8 = scales.size(1);
  TORCH_CHECK(groupsize >= 32 && (groupsize & (groupsize - 1)) == 0 && K % groupsize == 0, "q4_linear: group size");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && zeros.scalar_type() == at::kHalf && scales.is_contiguous() &&
              zeros.is_contiguous() && scales.sizes() == zeros.sizes() && scales.size(0) == N && G8 % 8 == 0 &&
              G8 * groupsize >= K, "q4_linear: scales/zeros must be float16 (N, groups padded to a multiple of 8)");
  check_x(x, K);
  int64_t T = x.size(0);
  auto xc = x.contiguous();
  QuantizedX xq(xc.data_ptr<float>(), T, K);
  int gshift = __builtin_ctzll(groupsize / 32);
  std::vector<float> xsum(T * G8, 0.f);  // per token and group: the sum of the quantized x
  for (int64_t t = 0; t < T; ++t)
    for (int64_t b = 0; b < xq.KB; ++b) xsum[t * G8 + (b >> gshift)] += xq.sum[t * xq.KB + b];
  auto y = at::empty({T, N}, x.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const at::Half* sp = scales.data_ptr<at::Half>();
  const at::Half* zp = zeros.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
#if VNNI512
  at::parallel_for(0, N / 4, std::max<int64_t>(1, 32768 / K), [&](int64_t b, int64_t e) {
    for (int64_t g = b; g < e; ++g) q4_rows<4>(wp, sp, zp, G8, gshift, xq, xsum.data(), 4 * g, yp, N);
  });
  for (int64_t n = N / 4 * 4; n < N; ++n) q4_rows<1>(wp, sp, zp, G8, gshift, xq, xsum.data(), n, yp, N);
#else
  at::parallel_for(0, N / 4, std::max<int64_t>(1, 32768 / K), [&](int64_t b, int64_t e) {
    std::vector<float> sc(4 * xq.KB);
    for (int64_t g = b; g < e; ++g) q4_group<4>(wp, sp, zp, G8, gshift, xq, xsum.data(), 4 * g, yp, N, sc.data());
  });
  std::vector<float> sc(xq.KB);
  for (int64_t n = N / 4 * 4; n < N; ++n) q4_group<1>(wp, sp, zp, G8, gshift, xq, xsum.data(), n, yp, N, sc.data());
#endif
  return y;
}

// ---------------------------------------------------------------- a quantized weight as floats
// A long prompt multiplies a quantized layer through oneDNN's GEMM on its weight dequantized to
// bfloat16 (float32 without bf16 instructions). These write it in one pass, with the values of
// quantize.py's expression (q * scale, + zero for int4, in float32, then rounded to nearest
// even), which took three to six passes over float32 temporaries: a third of an int8 Qwen 1.5B
// prompt's time.
inline uint16_t bf16_bits(float f) {  // c10's rounding: to nearest even, NaN to the quiet NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return f != f ? uint16_t(0x7FC0) : uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

template <typename Row>  // row(n, out): row n's first K values, float32 or bfloat16 bits
at::Tensor dequantized(int64_t N, int64_t K, bool bf16, const at::TensorOptions& options, Row row) {
  auto out = at::empty({N, K}, options.dtype(bf16 ? at::kBFloat16 : at::kFloat));
  char* op = static_cast<char*>(out.data_ptr());
  int64_t row_bytes = K * (bf16 ? 2 : 4);
  at::parallel_for(0, N, std::max<int64_t>(1, 65536 / std::max<int64_t>(K, 1)), [&](int64_t b, int64_t e) {
    std::vector<float> f(K);
    for (int64_t n = b; n < e; ++n) {
      float* dst = bf16 ? f.data() : reinterpret_cast<float*>(op + n * row_bytes);
      row(n, dst);
      if (bf16) {
        uint16_t* o = reinterpret_cast<uint16_t*>(op + n * row_bytes);
        for (int64_t k = 0; k < K; ++k) o[k] = bf16_bits(f[k]);
      }
    }
  });
  return out;
}

// w: int8 (N, Kp) as q8_linear reads it, Kp >= K; scale: float32 (N,)
at::Tensor q8_dequantize(const at::Tensor& w, const at::Tensor& scale, int64_t K, bool bf16) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous() && K >= 0 && K <= w.size(1),
              "q8_dequantize: w must be contiguous int8 (N, Kp) with K <= Kp");
  int64_t N = w.size(0), Kp = w.size(1);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == N,
              "q8_dequantize: scale must be float32 (N,)");
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  return dequantized(N, K, bf16, w.options(), [&](int64_t n, float* dst) {
    const int8_t* q = wp + n * Kp;
    float s = sp[n];
    for (int64_t k = 0; k < K; ++k) dst[k] = static_cast<float>(q[k]) * s;
  });
}

// w, scales, zeros as q4_linear reads them; the first K of its columns
at::Tensor q4_dequantize(const at::Tensor& w, const at::Tensor& scales, const at::Tensor& zeros, int64_t groupsize,
                         int64_t K, bool bf16) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(1) % 32 == 0 &&
              K >= 0 && K <= w.size(1) * 2, "q4_dequantize: w must be contiguous uint8 (N, Kp / 2), Kp a multiple of 64, K <= Kp");
  int64_t N = w.size(0), Kp = w.size(1) * 2, G = scales.size(1);
  TORCH_CHECK(groupsize >= 32 && (groupsize & (groupsize - 1)) == 0 && Kp % groupsize == 0, "q4_dequantize: group size");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && zeros.scalar_type() == at::kHalf && scales.is_contiguous() &&
              zeros.is_contiguous() && scales.sizes() == zeros.sizes() && scales.size(0) == N && G * groupsize >= Kp,
              "q4_dequantize: scales/zeros must be float16 (N, groups)");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const at::Half* sp = scales.data_ptr<at::Half>();
  const at::Half* zp = zeros.data_ptr<at::Half>();
  return dequantized(N, K, bf16, w.options(), [&](int64_t n, float* dst) {
    const uint8_t* q = wp + n * (Kp / 2);
    for (int64_t c0 = 0; c0 < K; c0 += 32) {  // 32 columns: one nibble of 32 bytes, one group
      int64_t block = c0 / 64, high = (c0 / 32) % 2, g = c0 / groupsize, m = std::min<int64_t>(32, K - c0);
      float s = static_cast<float>(sp[n * G + g]), z = static_cast<float>(zp[n * G + g]);
      const uint8_t* bytes = q + block * 32;
      // q * s is exact (4 bits times float16's 11), so a fused multiply-add rounds as the two steps
      if (high) for (int64_t j = 0; j < m; ++j) dst[c0 + j] = static_cast<float>(bytes[j] >> 4) * s + z;
      else for (int64_t j = 0; j < m; ++j) dst[c0 + j] = static_cast<float>(bytes[j] & 15) * s + z;
    }
  });
}

// ---------------------------------------------------------------- attention for a few queries
// Decode and verify attention: each query row reads only the keys its mask allows (the cache
// before its position), where the compiled broadcast-multiply-sum and CPU SDPA both go over
// the whole preallocated cache, most of it empty.

// e^x for x <= 0, to about 2 ulp: 2^n * e^r with n = round(x / ln 2), r in [-ln2/2, ln2/2], and
// e^r from Cephes expf's polynomial; below -87 (and for -inf, masked keys) exactly 0
inline __m256 exp_neg(__m256 x) {
  __m256 zero_below = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_GE_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln 2 in two parts
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), zero_below);
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// lane i of the result: the sum of a[i]'s lanes
inline __m256 reduce8(const __m256* a) {
  __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}

// A paged cache's keys and values are reached through a block table, which the hardware
// prefetcher cannot follow: `attend` asks for a row PREFETCH_AHEAD keys ahead itself.
constexpr int64_t PREFETCH_AHEAD = 16;
template <typename KV>
inline void prefetch_row(const KV* p, int64_t D) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(KV)); b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
}

// q . k as 8 partial sums, one multiply-add chain over D (so a key's score never depends on its
// neighbours'); with AVX-512, 16 lanes folded to 8.
template <typename KV>
inline __m256 key_dot(const float* q, const KV* k, int64_t D) {
#ifdef __AVX512F__
  if (D % 16 == 0) {
    __m512 s = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) s = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(k + d), s);
    return _mm256_add_ps(_mm512_castps512_ps256(s), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
  }
#endif
  __m256 s = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), s);
  return s;
}

// Where a row's keys and values sit: key j at k + off[j], value j at v + off[j]; ks, the step
// between two keys of one block (8 keys in one block are addressed as a row's, without a load
// each); fetch: whether this row asks for them PREFETCH_AHEAD keys ahead (the first query row of
// a head brings them in, the others find them cached).
struct KeyPlaces {
  const int64_t* off;
  int64_t ks;
  bool fetch;
};

// f(p_j, value j) for each key j < n of nonzero weight, in order, 8 keys at a time; values
// prefetched `width` elements wide
template <typename KV, typename F>
inline void each_value(const float* p, int64_t n, const KV* v, const KeyPlaces& at, int64_t width, F f) {
  for (int64_t j = 0; j < n; j += 8) {
    const int64_t c = std::min<int64_t>(8, n - j);
    for (int64_t i = j + PREFETCH_AHEAD; at.fetch && i < std::min(j + PREFETCH_AHEAD + 8, n); ++i)
      prefetch_row(v + at.off[i], width);
    if (c == 8 && at.off[j + 7] == at.off[j] + 7 * at.ks) {
      const KV* vj = v + at.off[j];
      for (int i = 0; i < 8; ++i)
        if (p[j + i] != 0.f) f(p[j + i], vj + i * at.ks);
    } else {
      for (int i = 0; i < c; ++i)
        if (p[j + i] != 0.f) f(p[j + i], v + at.off[j + i]);
    }
  }
}

// out[0, 8W) = inv * sum_j p_j v_j[0, 8W): W accumulators in registers, keys of weight 0 skipped
template <int W, typename KV>
inline void weigh_values(const float* p, int64_t n, const KV* v, const KeyPlaces& at, float inv, float* out) {
  __m256 acc[W];
  for (int i = 0; i < W; ++i) acc[i] = _mm256_setzero_ps();
  each_value(p, n, v, at, 8 * W, [&](float w, const KV* vj) {
    const __m256 pj = _mm256_set1_ps(w);
    for (int i = 0; i < W; ++i) acc[i] = _mm256_fmadd_ps(pj, load8(vj + 8 * i), acc[i]);
  });
  for (int i = 0; i < W; ++i) _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(acc[i], _mm256_set1_ps(inv)));
}

#ifdef __AVX512F__
template <int W, typename KV>  // as above, 16 lanes: a 256-wide head in one pass over the weights
inline void weigh_values16(const float* p, int64_t n, const KV* v, const KeyPlaces& at, float inv, float* out) {
  __m512 acc[W];
  for (int i = 0; i < W; ++i) acc[i] = _mm512_setzero_ps();
  each_value(p, n, v, at, 16 * W, [&](float w, const KV* vj) {
    const __m512 pj = _mm512_set1_ps(w);
    for (int i = 0; i < W; ++i) acc[i] = _mm512_fmadd_ps(pj, load16(vj + 16 * i), acc[i]);
  });
  for (int i = 0; i < W; ++i) _mm512_storeu_ps(out + 16 * i, _mm512_mul_ps(acc[i], _mm512_set1_ps(inv)));
}
#endif

template <typename KV>
void weigh_all_values(const float* p, int64_t n, const KV* v, const KeyPlaces& at, int64_t D, float inv, float* out) {
#ifdef __AVX512F__
  if (D % 16 == 0 && D <= 256) {
    switch (D / 16) {  // the accumulators' count fixed at compile time, so they stay in registers
      case 16: return weigh_values16<16>(p, n, v, at, inv, out);
      case 8: return weigh_values16<8>(p, n, v, at, inv, out);
      case 4: return weigh_values16<4>(p, n, v, at, inv, out);
      default: break;
    }
  }
#endif
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    switch (std::min<int64_t>(64, D - d0) / 8) {
      case 8: weigh_values<8>(p, n, v + d0, at, inv, out + d0); break;
      case 7: weigh_values<7>(p, n, v + d0, at, inv, out + d0); break;
      case 6: weigh_values<6>(p, n, v + d0, at, inv, out + d0); break;
      case 5: weigh_values<5>(p, n, v + d0, at, inv, out + d0); break;
      case 4: weigh_values<4>(p, n, v + d0, at, inv, out + d0); break;
      case 3: weigh_values<3>(p, n, v + d0, at, inv, out + d0); break;
      case 2: weigh_values<2>(p, n, v + d0, at, inv, out + d0); break;
      default: weigh_values<1>(p, n, v + d0, at, inv, out + d0); break;
    }
  }
}

// One query row: out = softmax(scale * q.k_j (soft-capped) + m_j) . v_j over keys j, D % 8 == 0,
// key j at k + off[j] and value j at v + off[j] (a row's positions, wherever the cache keeps them).
// Scores go 8 keys at a time, each key's dot product read front to back (so the hardware
// prefetcher sees one sequential stream) and the 8 sums reduced together; p holds S + 8 floats.
template <typename KV>
void attend_row(const float* q, const KV* k, const KV* v, KeyPlaces at, const float* m, int64_t S,
                int64_t D, float scale, float softcap, float* out, float* p) {
  const float NEG = -std::numeric_limits<float>::infinity();
  const __m256 neg = _mm256_set1_ps(NEG);
  auto masked8 = [&](int64_t j) {
    return _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(m + j), neg, _CMP_EQ_OQ)) == 0xff;
  };
  int64_t lo = 0, hi = S;  // the keys the mask allows lie in [lo, hi): a server's mask is mostly -inf
  while (hi - lo >= 8 && masked8(hi - 8)) hi -= 8;
  while (hi > lo && m[hi - 1] == NEG) --hi;
  while (hi - lo >= 8 && masked8(lo)) lo += 8;
  while (lo < hi && m[lo] == NEG) ++lo;
  const int64_t n = hi - lo;
  at.off += lo, m += lo;
  const int64_t* off = at.off;
  __m256 vmax = neg;
  for (int64_t j = 0; j < n; j += 8) {
    const int64_t c = std::min<int64_t>(8, n - j);
    for (int64_t i = j + PREFETCH_AHEAD; at.fetch && i < std::min(j + PREFETCH_AHEAD + 8, n); ++i) prefetch_row(k + off[i], D);
    __m256 a[8];
    if (c == 8 && off[j + 7] == off[j] + 7 * at.ks) {
      const KV* kj = k + off[j];
      for (int i = 0; i < 8; ++i) a[i] = key_dot(q, kj + i * at.ks, D);
    } else {
      for (int i = 0; i < 8; ++i) a[i] = i < c ? key_dot(q, k + off[j + i], D) : _mm256_setzero_ps();
    }
    alignas(32) float t[8];
    __m256 s = _mm256_mul_ps(reduce8(a), _mm256_set1_ps(scale));
    if (softcap > 0) {
      _mm256_store_ps(t, s);
      for (int i = 0; i < 8; ++i) t[i] = std::tanh(t[i] / softcap) * softcap;
      s = _mm256_load_ps(t);
    }
    __m256 mj;
    if (c == 8) {
      mj = _mm256_loadu_ps(m + j);
    } else {  // the last block: the lanes past n are masked
      for (int i = 0; i < 8; ++i) t[i] = i < c ? m[j + i] : NEG;
      mj = _mm256_load_ps(t);
    }
    // a masked key scores -inf whatever its cache slot holds (an unwritten slot may hold NaN)
    s = _mm256_blendv_ps(_mm256_add_ps(s, mj), neg, _mm256_cmp_ps(mj, neg, _CMP_EQ_OQ));
    vmax = _mm256_max_ps(vmax, s);
    _mm256_storeu_ps(p + j, s);
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const __m256 mx = _mm256_set1_ps(std::max(_mm_cvtss_f32(m4), _mm_cvtss_f32(_mm_shuffle_ps(m4, m4, 1))));
  __m256 total = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; j += 8) {  // the last block's lanes past n were -inf: weight 0
    __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(p + j), mx));
    _mm256_storeu_ps(p + j, e);
    total = _mm256_add_ps(total, e);
  }
  weigh_all_values(p, n, v, at, D, n > 0 ? 1.f / hsum(total) : 0.f, out);
}

// q (B, H, R, D) float32 with R = group * T query rows per KV head (row g * T + t is query t);
// k, v (B, H, S, D) float32 or bfloat16, any strides with unit stride along D; mask (B, 1, T, S)
// float32, additive. With `slots` (B, S) int64, k and v are a cache's pools of blocks
// (N, H, block_size, D), and row b's key s is in slot slots[b, s]: row slot % block_size of block
// slot / block_size (nothing gathered). Returns (B, H, R, D) float32.
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                  double scale, double softcap, const c10::optional<at::Tensor>& slots) {
  const bool paged = slots.has_value();
  TORCH_CHECK(q.dim() == 4 && mask.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes(),
              "attend: q, mask, k and v 4-d");
  TORCH_CHECK(q.scalar_type() == at::kFloat && mask.scalar_type() == at::kFloat, "attend: q and mask float32");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16),
              "attend: k and v float32 or bfloat16");
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), D = q.size(3), T = mask.size(2);
  const int64_t S = paged ? slots->size(1) : k.size(2);
  TORCH_CHECK(k.size(1) == H && k.size(-1) == D && D % 8 == 0 && k.stride(-1) == 1 && v.stride(-1) == 1 &&
              mask.size(0) == B && mask.size(3) == S && R % T == 0 && (paged || k.size(0) == B) &&
              (!paged || (slots->scalar_type() == at::kLong && slots->dim() == 2 && slots->size(0) == B)),
              "attend: shapes");
  const int64_t key_stride = k.stride(2), block_size = k.size(2);
  auto same_stride = [&](int64_t d) { return k.size(d) == 1 || k.stride(d) == v.stride(d); };  // (a size-1 dim's is moot)
  TORCH_CHECK(same_stride(0) && same_stride(1) && same_stride(2), "attend: k and v strides");
  at::Tensor sc = paged ? slots->contiguous() : at::Tensor();
  // offsets(b, off): where row b's key s starts, in elements from the pool (or the row), for k and v
  // alike, filled by the thread that takes the row; false if a slot is outside the pool
  auto offsets = [&](int64_t b, int64_t* off) {
    if (!paged) {
      for (int64_t s = 0; s < S; ++s) off[s] = b * k.stride(0) + s * key_stride;
      return true;
    }
    const int64_t* sp = sc.data_ptr<int64_t>() + b * S;
    const int64_t pool = k.size(0) * block_size, block_stride = k.stride(0);
    bool inside = true;
    if ((block_size & (block_size - 1)) == 0) {  // a power of two: shifts, not a division a key
      const int shift = __builtin_ctzll(block_size);
      for (int64_t s = 0; s < S; ++s) {
        inside &= sp[s] >= 0 && sp[s] < pool;
        off[s] = (sp[s] >> shift) * block_stride + (sp[s] & (block_size - 1)) * key_stride;
      }
      return inside;
    }
    for (int64_t s = 0; s < S; ++s) {
      inside &= sp[s] >= 0 && sp[s] < pool;
      off[s] = sp[s] / block_size * block_stride + sp[s] % block_size * key_stride;
    }
    return inside;
  };
  std::atomic<bool> outside{false};
  auto qc = q.contiguous();
  auto mc = mask.contiguous();
  auto out = at::empty({B, H, R, D}, q.options());
  const float* qp = qc.data_ptr<float>();
  const float* mp = mc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t head_stride = k.stride(1);
  auto run = [&](auto* kp, auto* vp, int64_t r0, int64_t r1) {
    std::vector<float> p(S + 8);
    std::vector<int64_t> off(S);
    bool inside = true;
    for (int64_t i = r0, filled = -1; i < r1; ++i) {
      int64_t b = i / (H * R), h = (i / R) % H, r = i % R;
      if (b != filled) inside = offsets(b, off.data()), filled = b;
      if (!inside) {  // nothing read; refused below
        outside = true;
        continue;
      }
      const KeyPlaces at{off.data(), key_stride, r == 0 || i == r0};  // a head's first row here fetches
      attend_row(qp + i * D, kp + h * head_stride, vp + h * head_stride, at, mp + (b * T + r % T) * S, S, D,
                 static_cast<float>(scale), static_cast<float>(softcap), op + i * D, p.data());
    }
  };
  at::parallel_for(0, B * H * R, 1, [&](int64_t r0, int64_t r1) {
    if (k.scalar_type() == at::kFloat) run(k.data_ptr<float>(), v.data_ptr<float>(), r0, r1);
    else run(k.data_ptr<at::BFloat16>(), v.data_ptr<at::BFloat16>(), r0, r1);
  });
  TORCH_CHECK(!outside, "attend: slot out of range");
  return out;
}

// ---------------------------------------------------------------- a prompt's gated activation
// act(gate) * up for an eager prompt's feed-forward in one pass: computed in float32 and rounded
// once to the dtype, as inductor's fused code does in the compiled step, where eager torch makes
// a pass for the activation and one for the product, rounding after each. kind 0: SiLU; 1: GELU
// with tanh (gelu_pytorch_tanh). Both from e = exp(-|.|), which exp_neg takes.
inline void store8(float* p, __m256 x) { _mm256_storeu_ps(p, x); }
inline void store8(at::BFloat16* p, __m256 x) {  // to nearest even, NaN to the quiet NaN (bf16_bits)
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), (__m128i)_mm256_cvtneps_pbh(x));
  return;
#endif
  __m256i u = _mm256_castps_si256(x);
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(
      _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)), _mm256_set1_epi32(0x7FFF))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

inline __m256 gated8(__m256 g, __m256 u, int64_t kind) {
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  if (kind == 0) {  // g * sigmoid(g): 1 / (1 + e) for g >= 0, e / (1 + e) below
    __m256 e = exp_neg(_mm256_or_ps(g, sign));  // exp(-|g|)
    __m256 inv = _mm256_div_ps(one, _mm256_add_ps(one, e));
    __m256 sig = _mm256_blendv_ps(inv, _mm256_mul_ps(e, inv), g);  // g's sign bit picks e / (1 + e)
    return _mm256_mul_ps(_mm256_mul_ps(g, sig), u);
  }
  // 0.5 g (1 + tanh(y)), y = sqrt(2 / pi) (g + 0.044715 g^3); tanh(|y|) = (1 - e) / (1 + e), e = exp(-2|y|)
  __m256 y = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                           _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), g), _mm256_mul_ps(g, g), g));
  __m256 e = exp_neg(_mm256_mul_ps(_mm256_set1_ps(2.f), _mm256_or_ps(y, sign)));
  __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
  t = _mm256_or_ps(t, _mm256_and_ps(y, sign));  // tanh(y) = sign(y) tanh(|y|)
  return _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g), _mm256_add_ps(one, t)), u);
}

template <typename T>
void gated_range(const T* g, const T* u, T* out, int64_t b, int64_t e, int64_t kind) {
  int64_t i = b;
  for (; i + 8 <= e; i += 8) store8(out + i, gated8(load8(g + i), load8(u + i), kind));
  if (i < e) {  // the last few through a padded block
    float gb[8] = {0}, ub[8] = {0}, ob[8];
    for (int64_t j = i; j < e; ++j) { gb[j - i] = static_cast<float>(g[j]); ub[j - i] = static_cast<float>(u[j]); }
    _mm256_storeu_ps(ob, gated8(_mm256_loadu_ps(gb), _mm256_loadu_ps(ub), kind));
    for (int64_t j = i; j < e; ++j) out[j] = static_cast<T>(ob[j - i]);
  }
}

// gate and up of one shape, float32 or bfloat16 (contiguous copies taken); returns act(gate) * up
at::Tensor gated(const at::Tensor& gate, const at::Tensor& up, int64_t kind) {
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.scalar_type() == up.scalar_type() &&
              (gate.scalar_type() == at::kFloat || gate.scalar_type() == at::kBFloat16) && (kind == 0 || kind == 1),
              "gated: gate and up of one shape and dtype, float32 or bfloat16; kind 0 (silu) or 1 (gelu_tanh)");
  auto gc = gate.contiguous(), uc = up.contiguous();
  auto out = at::empty_like(gc);
  int64_t n = gc.numel();
  at::parallel_for(0, (n + 7) / 8, 2048, [&](int64_t b, int64_t e) {
    int64_t lo = b * 8, hi = std::min(n, e * 8);
    if (gc.scalar_type() == at::kFloat)
      gated_range(gc.data_ptr<float>(), uc.data_ptr<float>(), out.data_ptr<float>(), lo, hi, kind);
    else
      gated_range(gc.data_ptr<at::BFloat16>(), uc.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), lo, hi, kind);
  });
  return out;
}

// ---------------------------------------------------------------- a prompt's RMS normalization
// model.RMSNorm for an eager prompt in two passes over each row (its sum of squares, then the
// output), where eager torch makes one per operation: x * rsqrt(mean(x^2) + eps) in float32, then
// with an offset (Gemma) times (offset + w) and rounded once; without, rounded to x's dtype, times
// w and rounded again, as the reference does. x (rows, D) and w (D) of one dtype, D % 8 == 0.
template <typename T>
void rms_rows(const T* x, const T* w, T* out, int64_t b, int64_t e, int64_t D, float eps, float offset) {
  for (int64_t i = b; i < e; ++i) {
    const T* xr = x + i * D;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      __m256 v = load8(xr + d);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    float sum[8];
    _mm256_storeu_ps(sum, acc);
    float ss = 0;
    for (float v : sum) ss += v;
    const __m256 r = _mm256_set1_ps(1.f / std::sqrt(ss / static_cast<float>(D) + eps));
    for (int64_t d = 0; d < D; d += 8) {
      __m256 n = _mm256_mul_ps(load8(xr + d), r);
      if (offset != 0.f) {
        store8(out + i * D + d, _mm256_mul_ps(n, _mm256_add_ps(_mm256_set1_ps(offset), load8(w + d))));
      } else {
        T rounded[8];
        store8(rounded, n);
        store8(out + i * D + d, _mm256_mul_ps(load8(rounded), load8(w + d)));
      }
    }
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, double offset) {
  TORCH_CHECK(x.scalar_type() == w.scalar_type() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
              w.dim() == 1 && x.size(-1) == w.size(0) && w.size(0) % 8 == 0,
              "rms_norm: x (..., D) and w (D) of one dtype, float32 or bfloat16, D a multiple of 8");
  auto xc = x.contiguous(), wc = w.contiguous();
  auto out = at::empty_like(xc);
  int64_t D = w.size(0), rows = xc.numel() / std::max<int64_t>(D, 1);
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / D), [&](int64_t b, int64_t e) {
    if (xc.scalar_type() == at::kFloat)
      rms_rows(xc.data_ptr<float>(), wc.data_ptr<float>(), out.data_ptr<float>(), b, e, D, float(eps), float(offset));
    else
      rms_rows(xc.data_ptr<at::BFloat16>(), wc.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), b, e, D,
               float(eps), float(offset));
  });
  return out;
}

// ---------------------------------------------------------------- a bfloat16 prompt's attention
// A chunk of a long bfloat16 prompt's queries (CPUs with AVX-512 BF16): q k^T with vdpbf16ps
// into float32 scores (exact products of the bfloat16 values), softmax in float32, and the
// probabilities rounded to bfloat16 for p v, as SDPA and transformers do in bfloat16. A block of
// PA_ROWS query rows shares every load of keys and values, where `attend` reads them per query;
// oneDNN's float32 GEMMs and torch's softmax took twice as long in a prompt (docs/benchmarks.md).
#ifdef __AVX512BF16__
constexpr int PA_ROWS = 4;

// (S, D) rows -> pairs along D for 16 keys at a time, keys zero past S up to a multiple of 32:
// out[(kb * D/2 + dp) * 32 + 2 * j + e] = k[kb*16 + j][2 dp + e]
void pack_keys(const at::BFloat16* k, int64_t ks, int64_t S, int64_t D, uint16_t* out) {
  std::memset(out, 0, (S + 31) / 32 * 32 * D * 2);
  for (int64_t s = 0; s < S; ++s) {
    const uint16_t* row = reinterpret_cast<const uint16_t*>(k + s * ks);
    uint16_t* o = out + (s / 16) * 16 * D + 2 * (s % 16);
    for (int64_t dp = 0; dp < D / 2; ++dp) { o[dp * 32] = row[2 * dp]; o[dp * 32 + 1] = row[2 * dp + 1]; }
  }
}

// (S, D) rows -> pairs of keys: out[(sp * D + d) * 2 + e] = v[2 sp + e][d], S padded to even with zeros
void pack_values(const at::BFloat16* v, int64_t vs, int64_t S, int64_t D, uint16_t* out) {
  int64_t pairs = (S + 1) / 2;
  for (int64_t sp = 0; sp < pairs; ++sp) {
    const uint16_t* r0 = reinterpret_cast<const uint16_t*>(v + 2 * sp * vs);
    const uint16_t* r1 = 2 * sp + 1 < S ? reinterpret_cast<const uint16_t*>(v + (2 * sp + 1) * vs) : nullptr;
    uint16_t* o = out + sp * D * 2;
    for (int64_t d = 0; d < D; ++d) { o[2 * d] = r0[d]; o[2 * d + 1] = r1 ? r1[d] : 0; }
  }
}

inline __m512bh bcast_pair(const uint16_t* p) {  // two bfloat16 as one 32-bit lane, everywhere
  uint32_t x;
  std::memcpy(&x, p, 4);
  return (__m512bh)_mm512_set1_epi32(static_cast<int>(x));
}

// N query rows (N fixed, so the accumulators stay in registers) of one KV head: scores over the
// keys below S into sc (rows Sp floats apart), 32 keys at a time
template <int N>
void pa_scores(const uint16_t* q, const uint16_t* kp, int64_t S, int64_t D, float* sc, int64_t Sp) {
  for (int64_t k0 = 0; k0 < S; k0 += 32) {
    __m512 acc[N][2];
    for (int r = 0; r < N; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const uint16_t* ka = kp + k0 * D;
    const uint16_t* kb = ka + 16 * D;
    for (int64_t dp = 0; dp < D / 2; ++dp) {
      __m512bh a = (__m512bh)_mm512_loadu_si512(ka + dp * 32), b = (__m512bh)_mm512_loadu_si512(kb + dp * 32);
      for (int r = 0; r < N; ++r) {
        __m512bh qq = bcast_pair(q + r * D + 2 * dp);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qq, a);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qq, b);
      }
    }
    for (int r = 0; r < N; ++r) {
      _mm512_storeu_ps(sc + r * Sp + k0, acc[r][0]);
      _mm512_storeu_ps(sc + r * Sp + k0 + 16, acc[r][1]);
    }
  }
}

// p v for N rows of bfloat16 probabilities pb (rows Sp apart, zero past S): columns d0 to d0 + 64
// of the output rows (D floats apart)
template <int N>
void pa_values(const uint16_t* pb, int64_t Sp, const uint16_t* vp, int64_t S, int64_t D, int64_t d0, float* out) {
  __m512 acc[N][4];
  for (int r = 0; r < N; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t sp = 0; sp < (S + 1) / 2; ++sp) {
    __m512bh vv[4];
    for (int c = 0; c < 4; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vp + (sp * D + d0 + 16 * c) * 2);
    for (int r = 0; r < N; ++r) {
      __m512bh pp = bcast_pair(pb + r * Sp + 2 * sp);
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pp, vv[c]);
    }
  }
  for (int r = 0; r < N; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(out + r * D + d0 + 16 * c, acc[r][c]);
}

template <int N>
void pa_block(const uint16_t* q, const uint16_t* kp, const uint16_t* vp, int64_t S, int64_t D, float* sc,
              const uint16_t* pb, int64_t Sp, float* out, bool scores) {
  if (scores) return pa_scores<N>(q, kp, S, D, sc, Sp);
  for (int64_t d0 = 0; d0 < D; d0 += 64) pa_values<N>(pb, Sp, vp, S, D, d0, out);
}

// the n (<= PA_ROWS) rows' scores, or their values
inline void pa_rows(int64_t n, const uint16_t* q, const uint16_t* kp, const uint16_t* vp, int64_t S, int64_t D,
                    float* sc, const uint16_t* pb, int64_t Sp, float* out, bool scores) {
  switch (n) {
    case 4: return pa_block<4>(q, kp, vp, S, D, sc, pb, Sp, out, scores);
    case 3: return pa_block<3>(q, kp, vp, S, D, sc, pb, Sp, out, scores);
    case 2: return pa_block<2>(q, kp, vp, S, D, sc, pb, Sp, out, scores);
    default: return pa_block<1>(q, kp, vp, S, D, sc, pb, Sp, out, scores);
  }
}

// q (B, H, R, D) bfloat16 with R = group * T (row g * T + t is query t); k, v (B, H, S, D)
// bfloat16, unit stride along D; mask (B, 1, T, S) float32, additive. Returns (B, H, R, D) float32.
at::Tensor prompt_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && mask.dim() == 4, "prompt_attend: 4-d tensors");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16 &&
              mask.scalar_type() == at::kFloat, "prompt_attend: q, k, v bfloat16, mask float32");
  int64_t B = q.size(0), H = q.size(1), R = q.size(2), D = q.size(3), S = k.size(2), T = mask.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(1) == H && k.size(3) == D && v.sizes() == k.sizes() && D % 64 == 0 &&
              k.stride(3) == 1 && v.stride(3) == 1 && mask.size(0) == B && mask.size(3) == S && R % T == 0,
              "prompt_attend: shapes");
  auto qc = q.contiguous();
  auto mc = mask.contiguous();
  auto out = at::empty({B, H, R, D}, q.options().dtype(at::kFloat));
  int64_t Sp = (S + 31) / 32 * 32;  // a row of scores, whole blocks of 32 keys
  int64_t kblock = Sp * D, vblock = (S + 1) / 2 * 2 * D;
  std::vector<uint16_t> kp(B * H * kblock), vp(B * H * vblock);
  at::parallel_for(0, B * H, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      int64_t b = i / H, h = i % H;
      pack_keys(k.data_ptr<at::BFloat16>() + b * k.stride(0) + h * k.stride(1), k.stride(2), S, D, kp.data() + i * kblock);
      pack_values(v.data_ptr<at::BFloat16>() + b * v.stride(0) + h * v.stride(1), v.stride(2), S, D, vp.data() + i * vblock);
    }
  });
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(qc.data_ptr<at::BFloat16>());
  const float* mp = mc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  int64_t row_blocks = (R + PA_ROWS - 1) / PA_ROWS;
  const float sc_scale = static_cast<float>(scale);
  at::parallel_for(0, B * H * row_blocks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> sc(PA_ROWS * Sp);
    std::vector<uint16_t> pb(PA_ROWS * Sp);
    for (int64_t task = t0; task < t1; ++task) {
      int64_t bh = task / row_blocks, r0 = (task % row_blocks) * PA_ROWS, b = bh / H;
      int64_t n = std::min<int64_t>(PA_ROWS, R - r0);
      int64_t Sr = 0;  // the keys these rows see end before Sr: a causal chunk's later keys are skipped
      for (int64_t r = 0; r < n; ++r) {
        const float* m = mp + (b * T + (r0 + r) % T) * S;
        int64_t j = S;
        while (j > Sr && m[j - 1] == -std::numeric_limits<float>::infinity()) --j;
        Sr = std::max(Sr, j);
      }
      Sr = std::max<int64_t>(Sr, 1);
      const int64_t Srp = (Sr + 31) / 32 * 32;
      const uint16_t *kb = kp.data() + bh * kblock, *vb = vp.data() + bh * vblock;
      pa_rows(n, qp + (bh * R + r0) * D, kb, vb, Sr, D, sc.data(), pb.data(), Sp, nullptr, true);
      for (int64_t r = 0; r < n; ++r) {  // softmax of scale * scores + mask, float32
        float* s = sc.data() + r * Sp;
        const float* m = mp + (b * T + (r0 + r) % T) * S;
        const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), vscale = _mm512_set1_ps(sc_scale);
        __m512 vmax = ninf;
        for (int64_t j = 0; j < Srp; j += 16) {  // past S: -inf
          __mmask16 in = j + 16 <= Sr ? 0xffff : j < Sr ? static_cast<__mmask16>((1u << (Sr - j)) - 1) : 0;
          __m512 x = _mm512_mask_blend_ps(in, ninf, _mm512_fmadd_ps(_mm512_loadu_ps(s + j), vscale, _mm512_maskz_loadu_ps(in, m + j)));
          _mm512_storeu_ps(s + j, x);
          vmax = _mm512_max_ps(vmax, x);
        }
        float mx = _mm512_reduce_max_ps(vmax);
        if (mx == -std::numeric_limits<float>::infinity()) {  // a row that sees no key: weights 0
          std::memset(pb.data() + r * Sp, 0, Srp * 2);
          continue;
        }
        __m256 vmx = _mm256_set1_ps(mx), total = _mm256_setzero_ps();
        for (int64_t j = 0; j < Srp; j += 8) {
          __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(s + j), vmx));
          _mm256_storeu_ps(s + j, e);
          total = _mm256_add_ps(total, e);
        }
        float tot[8]; _mm256_storeu_ps(tot, total);
        float sum = 0; for (float x : tot) sum += x;
        __m512 inv = _mm512_set1_ps(1.f / sum);
        uint16_t* p = pb.data() + r * Sp;
        for (int64_t j = 0; j < Srp; j += 32) {  // rounded to bfloat16, nearest even
          __m512bh h = _mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(s + j + 16), inv), _mm512_mul_ps(_mm512_loadu_ps(s + j), inv));
          _mm512_storeu_si512(p + j, (__m512i)h);
        }
      }
      float* o = op + (bh * R + r0) * D;
      pa_rows(n, nullptr, kb, vb, Sr, D, nullptr, pb.data(), Sp, o, false);
    }
  });
  return out;
}
#else
at::Tensor prompt_attend(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double) {
  TORCH_CHECK(false, "prompt_attend: built without AVX-512 BF16");
}
#endif

// ---------------------------------------------------------------- the machine's read bandwidth
// The sum of a float32 tensor, read as `streams` interleaved sequential streams per thread, each
// 64-byte line with two independent adds: no reduction chain in the way, so that
// scripts/bench.py measures what the memory delivers, not what a reduction kernel does with it.
double stream_sum(const at::Tensor& t, int64_t streams) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() % 16 == 0 && streams >= 1 && streams <= 8,
              "stream_sum: contiguous float32, a multiple of 16 elements, 1 to 8 streams");
  const float* p = t.data_ptr<float>();
  int64_t lines = t.numel() / 16;
  std::vector<double> parts(at::get_num_threads() * 8, 0.0);  // a cache line apart per thread
  at::parallel_for(0, lines, 4096, [&](int64_t b, int64_t e) {
    int64_t per = (e - b) / streams;
    __m256 acc[16];
    for (auto& a : acc) a = _mm256_setzero_ps();
    for (int64_t i = 0; i < per; ++i)
      for (int s = 0; s < streams; ++s) {
        const float* q = p + (b + s * per + i) * 16;
        acc[2 * s] = _mm256_add_ps(acc[2 * s], _mm256_loadu_ps(q));
        acc[2 * s + 1] = _mm256_add_ps(acc[2 * s + 1], _mm256_loadu_ps(q + 8));
      }
    for (int64_t l = b + streams * per; l < e; ++l) {  // the lines left over
      acc[0] = _mm256_add_ps(acc[0], _mm256_loadu_ps(p + l * 16));
      acc[1] = _mm256_add_ps(acc[1], _mm256_loadu_ps(p + l * 16 + 8));
    }
    __m256 total = _mm256_setzero_ps();
    for (auto& a : acc) total = _mm256_add_ps(total, a);
    parts[at::get_thread_num() * 8] += hsum(total);
  });
  double sum = 0;
  for (double v : parts) sum += v;
  return sum;
}

}  // namespace

TORCH_LIBRARY(minillm, m) {
  m.def("small_linear(Tensor x, Tensor w) -> Tensor");
  m.def("q8_linear(Tensor x, Tensor w, Tensor scale) -> Tensor");
  m.def("q4_linear(Tensor x, Tensor w, Tensor scales, Tensor zeros, int groupsize) -> Tensor");
  m.def("attend(Tensor q, Tensor k, Tensor v, Tensor mask, float scale, float softcap, Tensor? slots=None) -> Tensor");
  m.def("stream_sum(Tensor t, int streams) -> float");
  m.def("prompt_attend(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> Tensor");
  m.def("gated(Tensor gate, Tensor up, int kind) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps, float offset) -> Tensor");
  m.def("q8_dequantize(Tensor w, Tensor scale, int K, bool bf16) -> Tensor");
  m.def("q4_dequantize(Tensor w, Tensor scales, Tensor zeros, int groupsize, int K, bool bf16) -> Tensor");
}
TORCH_LIBRARY_IMPL(minillm, CPU, m) {
  m.impl("small_linear", &small_linear);
  m.impl("q8_linear", &q8_linear);
  m.impl("q4_linear", &q4_linear);
  m.impl("attend", &attend);
  m.impl("stream_sum", &stream_sum);
  m.impl("prompt_attend", &prompt_attend);
  m.impl("gated", &gated);
  m.impl("rms_norm", &rms_norm);
  m.impl("q8_dequantize", &q8_dequantize);
  m.impl("q4_dequantize", &q4_dequantize);
}
