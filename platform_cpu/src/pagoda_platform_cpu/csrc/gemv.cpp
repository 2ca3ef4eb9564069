// y[M, N] = x[M, K] W[N, K]^T (+ bias) for the few rows of a decode step, on plain row-major weights.
//
// At decode sizes a linear layer is a read of its weight: the kernel's job is to stream W at
// the memory's speed and do the arithmetic under that read. Each thread takes one contiguous
// range of W's rows and walks it front to back, one row at a time, applying every x row to
// each loaded weight vector. Measured on the 2-core Zen 4 reference VM (all 120 matrices of
// SmolLM2-135M in sequence, M = 1), one row at a time reads W as fast as a bare read loop
// (27-40 GB/s, depending on the neighbours), where blocks of 2 or 4 rows read at 18-25 GB/s
// with or without software prefetch: a single forward stream per core is what the hardware
// prefetcher follows best.
//
// Paths, chosen at compile time (-march=native): AVX-512 (fp32 FMA; bf16 with AVX512_BF16's
// vdpbf16ps, else widened to fp32), or portable loops the compiler vectorises (AVX2 and others).
// Accumulation is fp32 throughout; a bf16 result is rounded once, to nearest even, here.
//
// Entry points (extern "C", called through ctypes by pagoda_platform_cpu.gemv, which checks the
// arguments and allocates the outputs): pagoda_gemv_isa, pagoda_gemv_f32, pagoda_gemv_bf16.
// Tests also compile the file with other -m flags (no AVX-512) to check the paths this CPU does not take.

#include <omp.h>
#include <pagoda/python.h>
#include <pagoda/simd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pagoda_gemv {

typedef uint16_t bf16_bits;
using pagoda::bf16_to_float;
using pagoda::float_to_bf16;

PAGODA_INLINE float to_float(float v) { return v; }
PAGODA_INLINE float to_float(bf16_bits v) { return bf16_to_float(v); }
PAGODA_INLINE void store(float* p, float v) { *p = v; }
PAGODA_INLINE void store(bf16_bits* p, float v) { *p = float_to_bf16(v); }

// The K % vector-width elements left after the vector loop.
template <int MB, typename T>
PAGODA_INLINE void dot_tail(const T* x, int64_t K, const T* w, int64_t k, float* out) {
  for (; k < K; ++k) {
    const float wk = to_float(w[k]);
    for (int m = 0; m < MB; ++m) out[m] += wk * to_float(x[m * K + k]);
  }
}

#if defined(__AVX512F__)
constexpr const char* kIsa =
#if defined(__AVX512BF16__)
    "avx512_bf16";
#else
    "avx512";
#endif

// out[m] = x[m, :] . w for MB rows of x, with U accumulators per x row along k.
//
// A row's multiply-adds form U dependent chains of K / (width * U) links; short chains let a
// row's arithmetic finish under the read of the next ones. Measured in situ (decode of 1-8
// streams, SmolLM2-135M): fp32 2-4 rows 10-20% faster with 4 accumulators than with 1 or 2,
// 1 row best with 2; bf16 with one accumulator per x row took 4 rows 30% longer than 3 or 5
// (21.9 vs 15.0 / 18.0 ms a step), with 2 the cost grows smoothly (13.8, 14.2, 14.5, 17.0 ms
// for 1-4 rows), and 3 or 4 were no better.
// How one element type is read and multiplied: N elements per vector, madd(acc, w, x) adds
// their products into 16 fp32 lanes, U accumulators per x row (see above).
template <typename T>
struct Lanes;

template <>
struct Lanes<float> {
  static constexpr int N = 16;
  template <int MB>
  static constexpr int U = MB == 1 ? 2 : 4;
  using vec = __m512;
  static PAGODA_INLINE vec load(const float* p) { return _mm512_loadu_ps(p); }
  static PAGODA_INLINE __m512 madd(__m512 acc, vec w, vec x) { return _mm512_fmadd_ps(w, x, acc); }
};

#if defined(__AVX512BF16__)
// vdpbf16ps: 32 bf16 products per instruction, summed in pairs into 16 fp32 lanes.
template <>
struct Lanes<bf16_bits> {
  static constexpr int N = 32;
  template <int MB>
  static constexpr int U = 2;
  using vec = __m512bh;
  static PAGODA_INLINE vec load(const bf16_bits* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static PAGODA_INLINE __m512 madd(__m512 acc, vec w, vec x) { return _mm512_dpbf16_ps(acc, w, x); }
};
#else
// No bf16 arithmetic: widen 16 values at a time (bf16 is fp32's upper half) and use fp32 FMAs.
template <>
struct Lanes<bf16_bits> {
  static constexpr int N = 16;
  template <int MB>
  static constexpr int U = 2;  // as for vdpbf16ps; not measured (no such CPU at hand)
  using vec = __m512;
  static PAGODA_INLINE vec load(const bf16_bits* p) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
  }
  static PAGODA_INLINE __m512 madd(__m512 acc, vec w, vec x) { return _mm512_fmadd_ps(w, x, acc); }
};
#endif

template <int MB, typename T>
PAGODA_INLINE void dot_rows(const T* x, int64_t K, const T* w, float* out) {
  using L = Lanes<T>;
  constexpr int N = L::N, U = L::template U<MB>;
  __m512 acc[MB][U];
  for (int m = 0; m < MB; ++m)
    for (int u = 0; u < U; ++u) acc[m][u] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + N * U <= K; k += N * U)
    for (int u = 0; u < U; ++u) {
      const typename L::vec wv = L::load(w + k + N * u);
      for (int m = 0; m < MB; ++m) acc[m][u] = L::madd(acc[m][u], wv, L::load(x + m * K + k + N * u));
    }
  for (; k + N <= K; k += N) {
    const typename L::vec wv = L::load(w + k);
    for (int m = 0; m < MB; ++m) acc[m][0] = L::madd(acc[m][0], wv, L::load(x + m * K + k));
  }
  for (int m = 0; m < MB; ++m) {
    __m512 s = acc[m][0];
    for (int u = 1; u < U; ++u) s = _mm512_add_ps(s, acc[m][u]);
    out[m] = _mm512_reduce_add_ps(s);
  }
  dot_tail<MB>(x, K, w, k, out);
}

#else  // no AVX-512: fixed-width loops that -O3 turns into the host's vectors (AVX2: two ymm per lane group)
constexpr const char* kIsa = "portable";

// float32: two vectors of the host's width per k-step, written with GCC's vector types. The plain
// loop below was left scalar by GCC for float32 with MB = 2 (AVX2 build, one thread, 120 matrices:
// 2 rows took 2.7x the time of 3 rows, 0.40x oneDNN's speed; now 1.81x). bfloat16 keeps the loop,
// which GCC vectorises well there (the vector form measured 0.8-1.0x of it).
template <int MB, typename T>
PAGODA_INLINE void dot_rows(const T* x, int64_t K, const T* w, float* out) {
  int64_t k = 0;
  if constexpr (sizeof(T) == sizeof(float)) {
    using pagoda::simd::vfloat;
    constexpr int W = pagoda::simd::W;
    vfloat acc[MB][2];
    for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = vfloat{};
    for (; k + 2 * W <= K; k += 2 * W) {
      const vfloat w0 = pagoda::simd::loadv(w + k), w1 = pagoda::simd::loadv(w + k + W);
      for (int m = 0; m < MB; ++m) {
        acc[m][0] += w0 * pagoda::simd::loadv(x + m * K + k);
        acc[m][1] += w1 * pagoda::simd::loadv(x + m * K + k + W);
      }
    }
    for (int m = 0; m < MB; ++m) out[m] = pagoda::simd::hsum(acc[m][0] + acc[m][1]);
  } else {
    constexpr int L = 16;
    float acc[MB][L] = {};
    for (; k + L <= K; k += L) {
      float wv[L];
      for (int l = 0; l < L; ++l) wv[l] = to_float(w[k + l]);
      for (int m = 0; m < MB; ++m)
        for (int l = 0; l < L; ++l) acc[m][l] += wv[l] * to_float(x[m * K + k + l]);
    }
    for (int m = 0; m < MB; ++m) {
      float s = 0.0f;
      for (int l = 0; l < L; ++l) s += acc[m][l];
      out[m] = s;
    }
  }
  dot_tail<MB>(x, K, w, k, out);
}
#endif

// x rows in groups of up to 4: the weight row is read from memory once, then from L1 for
// the later groups; 4 rows x up to 4 accumulators still fit the 32 vector registers.
constexpr int kGroup = 4;

template <int MB, typename T>
PAGODA_INLINE void emit(const T* x, int64_t K, const T* w_row, const T* bias, T* y, int64_t N, int64_t n) {
  float s[MB];
  dot_rows<MB>(x, K, w_row, s);
  const float b = bias != nullptr ? to_float(bias[n]) : 0.0f;
  for (int m = 0; m < MB; ++m) store(y + m * N + n, s[m] + b);
}

template <typename T>
void gemv_rows(const T* x, const T* w, const T* bias, T* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const T* w_row = w + n * K;
    int64_t m = 0;
    for (; m + kGroup <= M; m += kGroup) emit<kGroup>(x + m * K, K, w_row, bias, y + m * N, N, n);
    switch (M - m) {
      case 3: emit<3>(x + m * K, K, w_row, bias, y + m * N, N, n); break;
      case 2: emit<2>(x + m * K, K, w_row, bias, y + m * N, N, n); break;
      case 1: emit<1>(x + m * K, K, w_row, bias, y + m * N, N, n); break;
      default: break;
    }
  }
}

// Below this much weight per thread, waking another thread costs more than its share of the read.
constexpr int64_t kMinBytesPerThread = 64 * 1024;

template <typename T>
void gemv(const T* x, const T* w, const T* bias, T* y, int64_t M, int64_t N, int64_t K, int max_threads) {
  if (M <= 0 || N <= 0) return;
  const int64_t bytes = N * K * static_cast<int64_t>(sizeof(T));
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({max_threads, N, bytes / kMinBytesPerThread})));
  if (threads == 1) {
    gemv_rows(x, w, bias, y, M, N, K, 0, N);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    // One contiguous range of rows per thread: a forward stream through W (see the top).
    const int t = omp_get_thread_num();
    const int nt = omp_get_num_threads();
    gemv_rows(x, w, bias, y, M, N, K, N * t / nt, N * (t + 1) / nt);
  }
}

}  // namespace pagoda_gemv

PAGODA_EXPORT const char* pagoda_gemv_isa() { return pagoda_gemv::kIsa; }

// y [M, N] = x [M, K] (contiguous) times the contiguous weight [N, K], transposed, plus bias [N] (may be null).
PAGODA_EXPORT void pagoda_gemv_f32(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t N,
                                   int64_t K, int threads) {
  pagoda_gemv::gemv(x, w, bias, y, M, N, K, threads);
}
PAGODA_EXPORT void pagoda_gemv_bf16(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y, int64_t M,
                                    int64_t N, int64_t K, int threads) {
  pagoda_gemv::gemv(x, w, bias, y, M, N, K, threads);
}

// The entry points as a Python module (pagoda/python.h): one cheap call each from the wrappers.
PAGODA_PYTHON_MODULE(PAGODA_FUNCTION(pagoda_gemv_isa),
                     PAGODA_FUNCTION(pagoda_gemv_f32),
                     PAGODA_FUNCTION(pagoda_gemv_bf16))
