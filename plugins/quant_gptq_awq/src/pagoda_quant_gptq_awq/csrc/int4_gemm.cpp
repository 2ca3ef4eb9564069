// 4-bit weight x float activation matmuls for GPTQ and AWQ checkpoints on x86 CPUs, with runtime dispatch.
//
// Both formats describe the same weight: w[k, n] = scale[g, n] * (q[k, n] - zero[g, n]), q and zero in
// [0, 15], g the group of input channel k. The Python side unpacks either checkpoint layout once and
// repacks it here into one form:
//  - q in 16-column panels, [N/16][K][8] bytes, byte i of a k holding columns 2i (low nibble) and 2i+1
//    (high nibble): one 8-byte load is the 16 values a 512-bit register of floats needs;
//  - K in the kernel's order: GPTQ's act-order (desc_act) checkpoints have their input channels sorted
//    by group first (the caller permutes the activations the same way), so a group is a contiguous
//    range of k, gstart[g] .. gstart[g + 1];
//  - per panel and group, scale [N/16][G][16] and scale * zero [N/16][G][16] as float32.
// Then y[m, n] = sum_g scale[g, n] * (sum_{k in g} x[m, k] q[k, n]) - (scale * zero)[g, n] * sum_{k in g} x[m, k]:
// the nibbles are widened to float in registers and only the group sums of x see the zero point.
//
// Two entry points: pagoda_int4_gemm (decode and batches: up to 8 rows (AVX-512; 4 otherwise) share each
// widened weight vector) and pagoda_int4_dequantize (a slab of columns widened to float32 [K, n1 - n0], for the caller's
// float GEMM when many rows share the weights). Paths: AVX-512F, AVX2 + FMA, portable C++, picked at run
// time from the CPU's flags (or forced by the caller).
#include <omp.h>
#include <pagoda/python.h>
#include <pagoda/simd.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kPanel = 16;  // output columns per panel
constexpr int kRows = 8;        // activation rows per register tile: AVX-512 (AVX2 and scalar: 4)

enum Path : int { kAuto = 0, kAvx512 = 1, kAvx2 = 2, kScalar = 3 };

bool has_avx512() { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"); }
bool has_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

int resolve(int path) {
  if (path == kAuto) return has_avx512() ? kAvx512 : has_avx2() ? kAvx2 : kScalar;
  return path;
}

bool supported(int path) {
  switch (path) {
    case kAvx512: return has_avx512();
    case kAvx2: return has_avx2();
    case kScalar: return true;
    default: return false;
  }
}

// -- widening one k of a panel: 8 bytes -> 16 bytes, one value per byte, in column order --------------

__attribute__((target("avx2"))) inline __m128i nibbles_to_bytes(const uint8_t* p) {
  const __m128i packed = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(packed, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
  return _mm_unpacklo_epi8(lo, hi);  // column 2i from byte i's low nibble, 2i + 1 from its high one
}

// -- y tiles: R rows x one panel, every group ---------------------------------------------------------

// Two k at a time (one 16-byte load), into two sets of partial sums: each FMA chain then waits on every
// other k only, and the 8-row tile keeps 24 of the 32 zmm registers busy.
template <int R>
__attribute__((target("avx512f,avx512bw,avx2"))) void tile_avx512(const float* x, int64_t ldx, const float* xg,
                                                                   int64_t G, const uint8_t* w, const float* s,
                                                                   const float* sz, const int64_t* gstart,
                                                                   float* out) {
  const __m128i mask = _mm_set1_epi8(0x0F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 p0[R], p1[R];
    for (int r = 0; r < R; ++r) p0[r] = p1[r] = _mm512_setzero_ps();
    int64_t k = gstart[g];
    const int64_t end = gstart[g + 1];
    for (; k + 1 < end; k += 2) {
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * 8));
      const __m128i lo = _mm_and_si128(packed, mask), hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
      const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)));  // k
      const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi)));  // k + 1
      for (int r = 0; r < R; ++r) {
        p0[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k]), w0, p0[r]);
        p1[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k + 1]), w1, p1[r]);
      }
    }
    if (k < end) {  // a group of odd length (act order)
      const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(nibbles_to_bytes(w + k * 8)));
      for (int r = 0; r < R; ++r) p0[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k]), wv, p0[r]);
    }
    const __m512 sv = _mm512_loadu_ps(s + g * kPanel), szv = _mm512_loadu_ps(sz + g * kPanel);
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_add_ps(p0[r], p1[r]), sv, acc[r]);
      acc[r] = _mm512_fnmadd_ps(_mm512_set1_ps(xg[r * G + g]), szv, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kPanel, acc[r]);
}

template <int R>
__attribute__((target("avx2,fma"))) void tile_avx2(const float* x, int64_t ldx, const float* xg, int64_t G,
                                                   const uint8_t* w, const float* s, const float* sz,
                                                   const int64_t* gstart, float* out) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256 part[R][2];
    for (int r = 0; r < R; ++r) part[r][0] = part[r][1] = _mm256_setzero_ps();
    for (int64_t k = gstart[g]; k < gstart[g + 1]; ++k) {
      const __m128i bytes = nibbles_to_bytes(w + k * 8);
      const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
      const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)));
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_set1_ps(x[r * ldx + k]);
        part[r][0] = _mm256_fmadd_ps(xv, lo, part[r][0]);
        part[r][1] = _mm256_fmadd_ps(xv, hi, part[r][1]);
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 sv = _mm256_loadu_ps(s + g * kPanel + 8 * h), szv = _mm256_loadu_ps(sz + g * kPanel + 8 * h);
      for (int r = 0; r < R; ++r) {
        acc[r][h] = _mm256_fmadd_ps(part[r][h], sv, acc[r][h]);
        acc[r][h] = _mm256_fnmadd_ps(_mm256_set1_ps(xg[r * G + g]), szv, acc[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * kPanel, acc[r][0]);
    _mm256_storeu_ps(out + r * kPanel + 8, acc[r][1]);
  }
}

inline int nibble(const uint8_t* w, int64_t k, int c) { return (w[k * 8 + c / 2] >> (4 * (c % 2))) & 0x0F; }

void tile_scalar(const float* x, int64_t ldx, const float* xg, int64_t G, const uint8_t* w, const float* s,
                 const float* sz, const int64_t* gstart, float* out, int rows) {
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < kPanel; ++c) {
      float acc = 0.0f;
      for (int64_t g = 0; g < G; ++g) {
        float part = 0.0f;
        for (int64_t k = gstart[g]; k < gstart[g + 1]; ++k) part += x[r * ldx + k] * static_cast<float>(nibble(w, k, c));
        acc += part * s[g * kPanel + c] - xg[r * G + g] * sz[g * kPanel + c];
      }
      out[r * kPanel + c] = acc;
    }
  }
}

void run_tile(int path, int rows, const float* x, int64_t ldx, const float* xg, int64_t G, const uint8_t* w,
              const float* s, const float* sz, const int64_t* gstart, float* out) {
  if (path == kAvx512) {
    switch (rows) {
      case 1: tile_avx512<1>(x, ldx, xg, G, w, s, sz, gstart, out); return;
      case 2: tile_avx512<2>(x, ldx, xg, G, w, s, sz, gstart, out); return;
      case 3: tile_avx512<3>(x, ldx, xg, G, w, s, sz, gstart, out); return;
      case 4: tile_avx512<4>(x, ldx, xg, G, w, s, sz, gstart, out); return;
      case 5: tile_avx512<5>(x, ldx, xg, G, w, s, sz, gstart, out); return;
      case 6: tile_avx512<6>(x, ldx, xg, G, w, s, sz, gstart, out); return;
      case 7: tile_avx512<7>(x, ldx, xg, G, w, s, sz, gstart, out); return;
      default: tile_avx512<8>(x, ldx, xg, G, w, s, sz, gstart, out); return;
    }
  }
  if (path == kAvx2) {
    switch (rows) {
      case 1: tile_avx2<1>(x, ldx, xg, G, w, s, sz, gstart, out); return;
      case 2: tile_avx2<2>(x, ldx, xg, G, w, s, sz, gstart, out); return;
      case 3: tile_avx2<3>(x, ldx, xg, G, w, s, sz, gstart, out); return;
      default: tile_avx2<4>(x, ldx, xg, G, w, s, sz, gstart, out); return;
    }
  }
  tile_scalar(x, ldx, xg, G, w, s, sz, gstart, out, rows);
}

// -- one panel widened to float: out[k * ldo + c] = s * q - s * zero ----------------------------------

__attribute__((target("avx512f,avx512bw,avx2"))) void dequant_avx512(const uint8_t* w, const float* s, const float* sz,
                                                                     const int64_t* gstart, int64_t G, float* out,
                                                                     int64_t ldo) {
  for (int64_t g = 0; g < G; ++g) {
    const __m512 sv = _mm512_loadu_ps(s + g * kPanel), szv = _mm512_loadu_ps(sz + g * kPanel);
    for (int64_t k = gstart[g]; k < gstart[g + 1]; ++k) {
      const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(nibbles_to_bytes(w + k * 8)));
      _mm512_storeu_ps(out + k * ldo, _mm512_fmsub_ps(q, sv, szv));
    }
  }
}

__attribute__((target("avx2,fma"))) void dequant_avx2(const uint8_t* w, const float* s, const float* sz,
                                                      const int64_t* gstart, int64_t G, float* out, int64_t ldo) {
  for (int64_t g = 0; g < G; ++g) {
    const __m256 s0 = _mm256_loadu_ps(s + g * kPanel), s1 = _mm256_loadu_ps(s + g * kPanel + 8);
    const __m256 z0 = _mm256_loadu_ps(sz + g * kPanel), z1 = _mm256_loadu_ps(sz + g * kPanel + 8);
    for (int64_t k = gstart[g]; k < gstart[g + 1]; ++k) {
      const __m128i bytes = nibbles_to_bytes(w + k * 8);
      const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
      const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)));
      _mm256_storeu_ps(out + k * ldo, _mm256_fmsub_ps(lo, s0, z0));
      _mm256_storeu_ps(out + k * ldo + 8, _mm256_fmsub_ps(hi, s1, z1));
    }
  }
}

void dequant_scalar(const uint8_t* w, const float* s, const float* sz, const int64_t* gstart, int64_t G, float* out,
                    int64_t ldo) {
  for (int64_t g = 0; g < G; ++g)
    for (int64_t k = gstart[g]; k < gstart[g + 1]; ++k)
      for (int c = 0; c < kPanel; ++c)
        out[k * ldo + c] = static_cast<float>(nibble(w, k, c)) * s[g * kPanel + c] - sz[g * kPanel + c];
}

}  // namespace

// Bit i set: path i runs on this CPU (1 AVX-512, 2 AVX2, 3 scalar); bits 8..15: the path auto picks.
PAGODA_EXPORT int64_t pagoda_int4_paths() {
  int64_t bits = 0;
  for (int p = kAvx512; p <= kScalar; ++p)
    if (supported(p)) bits |= int64_t{1} << p;
  return bits | (int64_t{resolve(kAuto)} << 8);
}

// q [K, N] uint8 (values 0..15, row k in the kernel's order) -> packed [ceil(N/16)][K][8] (zero padded);
// scales, zeros [G, N] float32 -> [ceil(N/16)][G][16] scale and scale * zero (zero padded).
PAGODA_EXPORT void pagoda_int4_pack(const uint8_t* q, const float* scales, const float* zeros, int64_t K, int64_t N,
                                    int64_t G, uint8_t* packed, float* packed_scales, float* packed_szeros) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  std::memset(packed, 0, static_cast<size_t>(panels * K * 8));
  std::memset(packed_scales, 0, static_cast<size_t>(panels * G * kPanel) * sizeof(float));
  std::memset(packed_szeros, 0, static_cast<size_t>(panels * G * kPanel) * sizeof(float));
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t n = 0; n < N; ++n) {
      const int64_t p = n / kPanel, c = n % kPanel;
      packed[(p * K + k) * 8 + c / 2] |= static_cast<uint8_t>((q[k * N + n] & 0x0F) << (4 * (c % 2)));
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t n = 0; n < N; ++n) {
      const int64_t p = n / kPanel, c = n % kPanel;
      packed_scales[(p * G + g) * kPanel + c] = scales[g * N + n];
      packed_szeros[(p * G + g) * kPanel + c] = scales[g * N + n] * zeros[g * N + n];
    }
  }
}

// y [M, N] float32 = x [M, K] (row stride ldx, columns in the kernel's order) . w^T (+ bias).
// Returns the path it ran, or -1 when the asked path does not run on this CPU.
PAGODA_EXPORT int pagoda_int4_gemm(int path, const float* x, int64_t M, int64_t ldx, const uint8_t* packed,
                                   const float* packed_scales, const float* packed_szeros, const int64_t* gstart,
                                   int64_t G, const float* bias, int64_t N, int64_t K, float* y, int threads) {
  path = resolve(path);
  if (!supported(path)) return -1;
  // the group sums of x, which the zero points multiply
  std::vector<float> xg(static_cast<size_t>(M * G));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      float sum = 0.0f;
      for (int64_t k = gstart[g]; k < gstart[g + 1]; ++k) sum += x[m * ldx + k];
      xg[m * G + g] = sum;
    }
  const int64_t tile_rows = path == kAvx512 ? kRows : 4;
  const int64_t panels = (N + kPanel - 1) / kPanel, row_tiles = (M + tile_rows - 1) / tile_rows;
  const int64_t items = panels * row_tiles;
  const bool parallel = threads > 1 && items > 1 && M * N * K >= 131072;
#pragma omp parallel for num_threads(threads) if (parallel) schedule(static)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t p = item % panels, tile = item / panels;
    const int64_t m0 = tile * tile_rows, rows = std::min<int64_t>(tile_rows, M - m0);
    alignas(64) float out[kRows * kPanel];
    run_tile(path, static_cast<int>(rows), x + m0 * ldx, ldx, xg.data() + m0 * G, G, packed + p * K * 8,
             packed_scales + p * G * kPanel, packed_szeros + p * G * kPanel, gstart, out);
    const int64_t n0 = p * kPanel, cols = std::min<int64_t>(kPanel, N - n0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) y[(m0 + r) * N + n0 + c] = out[r * kPanel + c] + (bias ? bias[n0 + c] : 0.0f);
  }
  return path;
}

// Columns [n0, n1) of w widened to float32: out [K, n1 - n0] (row k in the kernel's order), for a float GEMM
// x . out. n0 a multiple of 16; n1 - n0 a multiple of 16 or n1 = N. Returns the path, or -1.
PAGODA_EXPORT int pagoda_int4_dequantize(int path, const uint8_t* packed, const float* packed_scales,
                                         const float* packed_szeros, const int64_t* gstart, int64_t G, int64_t N,
                                         int64_t K, int64_t n0, int64_t n1, float* out, int threads) {
  path = resolve(path);
  if (!supported(path) || n0 % kPanel != 0) return -1;
  const int64_t width = n1 - n0, p0 = n0 / kPanel, panels = (width + kPanel - 1) / kPanel;
  const bool tail = width % kPanel != 0;
  const bool parallel = threads > 1 && panels > 1 && width * K >= 65536;
#pragma omp parallel num_threads(threads) if (parallel)
  {
    // a tail panel narrower than 16 columns is widened into a scratch panel, then copied
    std::vector<float> scratch;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < panels; ++i) {
      const int64_t p = p0 + i;
      const bool partial = tail && i == panels - 1;
      if (partial) scratch.assign(static_cast<size_t>(K * kPanel), 0.0f);
      float* dst = partial ? scratch.data() : out + i * kPanel;
      const int64_t ldo = partial ? kPanel : width;
      const uint8_t* w = packed + p * K * 8;
      const float* s = packed_scales + p * G * kPanel;
      const float* sz = packed_szeros + p * G * kPanel;
      if (path == kAvx512) dequant_avx512(w, s, sz, gstart, G, dst, ldo);
      else if (path == kAvx2) dequant_avx2(w, s, sz, gstart, G, dst, ldo);
      else dequant_scalar(w, s, sz, gstart, G, dst, ldo);
      if (partial) {
        const int64_t cols = width - i * kPanel;
        for (int64_t k = 0; k < K; ++k)
          std::memcpy(out + k * width + i * kPanel, scratch.data() + k * kPanel, static_cast<size_t>(cols) * sizeof(float));
      }
    }
  }
  return path;
}

PAGODA_PYTHON_MODULE(PAGODA_FUNCTION(pagoda_int4_paths), PAGODA_FUNCTION(pagoda_int4_pack),
                     PAGODA_FUNCTION(pagoda_int4_gemm), PAGODA_FUNCTION(pagoda_int4_dequantize))
