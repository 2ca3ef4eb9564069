// int8 matmuls for compressed-tensors checkpoints on x86 CPUs, with runtime dispatch.
//
// W8A8: y[m, n] = (sum_k q[m, k] * w[n, k]) * x_scale[m] * w_scale[n] (+ bias[n]), q the activations
// quantized per row (symmetric, dynamic: scale = max|x| / 127, q in [-127, 127]) and w the
// checkpoint's int8 weight. The integer dot products are exact (int32), on one of three paths:
//  - AVX512_VNNI: vpdpbusd multiplies unsigned by signed bytes, so activations go in as q + 128
//    (a byte xor) and 128 * colsum(w[n]) is subtracted at the end;
//  - AVX512BW: vpmaddubsw on |w| (unsigned) and q with w's sign, then vpmaddwd by ones: the byte
//    pairs' sums stay below 2 * 128 * 127 < 2^15, so nothing saturates (q never is -128);
//  - AVX2: the same on 256-bit halves (vpsignb gives q with w's sign).
// Weights are packed once into 16-column panels of 4-k groups, [N/16][K/4][16][4] bytes: one
// 64-byte load holds 4 k values of 16 columns, which vpdpbusd reduces into 16 int32 lanes.
//
// W8A16: y[m, n] = sum_g scale[n, g] * sum_{k in g} x[m, k] * w[n, k] in float32, the int8 weight
// widened in registers; packed [N/16][K][16] with scales [N/16][G][16] (G = 1: per channel).
//
// Entry points are extern "C" (pagoda/python.h wraps them for Python); shapes are checked by the caller.
#include <omp.h>
#include <pagoda/python.h>
#include <pagoda/simd.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kPanel = 16;  // output columns per packed panel
constexpr int kRows = 4;        // activation rows per register tile

enum Path : int { kAuto = 0, kVnni512 = 1, kAvx512bw = 2, kAvx2 = 3, kScalar = 4 };

bool has_vnni512() { return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw"); }
bool has_avx512bw() { return __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512f"); }
bool has_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// The int32 results of one tile, finished: y = (acc - correction) * xs * ws + bias, N tail masked.
inline void finish(const int32_t* acc, int64_t rows, int64_t n0, int64_t cols, const float* xs, const float* ws,
                   const int32_t* correction, const float* bias, float* y, int64_t ldy) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t n = n0 + c;
      const int32_t dot = acc[r * 2 * kPanel + c] - (correction ? correction[n] : 0);
      float v = static_cast<float>(dot) * xs[r] * ws[n];
      if (bias) v += bias[n];
      y[r * ldy + n] = v;
    }
  }
}

// ---- W8A8 tiles: `rows` activation rows x `panels` (1 or 2) panels, accumulated into acc[rows][32] ----

template <int R, int P>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void tile_vnni(const int8_t* q, int64_t ldq,
                                                                      const int8_t* w, int64_t kg_count,
                                                                      int32_t* acc) {
  __m512i a[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) a[r][p] = _mm512_setzero_si512();
  const int64_t panel_bytes = kg_count * 64;
  for (int64_t kg = 0; kg < kg_count; ++kg) {
    __m512i wv[P];
    for (int p = 0; p < P; ++p) wv[p] = _mm512_loadu_si512(w + p * panel_bytes + kg * 64);
    for (int r = 0; r < R; ++r) {
      int32_t x4;
      std::memcpy(&x4, q + r * ldq + kg * 4, 4);
      const __m512i xb = _mm512_set1_epi32(x4 ^ static_cast<int32_t>(0x80808080u));  // q + 128, unsigned
      for (int p = 0; p < P; ++p) a[r][p] = _mm512_dpbusd_epi32(a[r][p], xb, wv[p]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) _mm512_storeu_si512(acc + r * 2 * kPanel + p * kPanel, a[r][p]);
}

template <int R, int P>
__attribute__((target("avx512f,avx512bw"))) void tile_avx512bw(const int8_t* q, int64_t ldq, const int8_t* w,
                                                              int64_t kg_count, int32_t* acc) {
  __m512i a[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) a[r][p] = _mm512_setzero_si512();
  const __m512i ones = _mm512_set1_epi16(1);
  const __m512i zero = _mm512_setzero_si512();
  const int64_t panel_bytes = kg_count * 64;
  for (int64_t kg = 0; kg < kg_count; ++kg) {
    __m512i wabs[P];
    __mmask64 neg[P];
    for (int p = 0; p < P; ++p) {
      const __m512i wv = _mm512_loadu_si512(w + p * panel_bytes + kg * 64);
      wabs[p] = _mm512_abs_epi8(wv);
      neg[p] = _mm512_movepi8_mask(wv);
    }
    for (int r = 0; r < R; ++r) {
      int32_t x4;
      std::memcpy(&x4, q + r * ldq + kg * 4, 4);
      const __m512i xb = _mm512_set1_epi32(x4);
      for (int p = 0; p < P; ++p) {
        const __m512i sx = _mm512_mask_sub_epi8(xb, neg[p], zero, xb);  // q with w's sign
        a[r][p] = _mm512_add_epi32(a[r][p], _mm512_madd_epi16(_mm512_maddubs_epi16(wabs[p], sx), ones));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) _mm512_storeu_si512(acc + r * 2 * kPanel + p * kPanel, a[r][p]);
}

template <int R, int P>
__attribute__((target("avx2,fma"))) void tile_avx2(const int8_t* q, int64_t ldq, const int8_t* w, int64_t kg_count,
                                                  int32_t* acc) {
  __m256i a[R][2 * P];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2 * P; ++h) a[r][h] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t panel_bytes = kg_count * 64;
  for (int64_t kg = 0; kg < kg_count; ++kg) {
    __m256i wv[2 * P], wabs[2 * P];
    for (int h = 0; h < 2 * P; ++h) {
      wv[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (h / 2) * panel_bytes + kg * 64 + (h % 2) * 32));
      wabs[h] = _mm256_abs_epi8(wv[h]);
    }
    for (int r = 0; r < R; ++r) {
      int32_t x4;
      std::memcpy(&x4, q + r * ldq + kg * 4, 4);
      const __m256i xb = _mm256_set1_epi32(x4);
      for (int h = 0; h < 2 * P; ++h) {
        const __m256i sx = _mm256_sign_epi8(xb, wv[h]);
        a[r][h] = _mm256_add_epi32(a[r][h], _mm256_madd_epi16(_mm256_maddubs_epi16(wabs[h], sx), ones));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2 * P; ++h)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + r * 2 * kPanel + h * 8), a[r][h]);
}

void tile_scalar(const int8_t* q, int64_t ldq, const int8_t* w, int64_t kg_count, int32_t* acc, int rows,
                 int panels) {
  const int64_t panel_bytes = kg_count * 64;
  for (int r = 0; r < rows; ++r) {
    for (int p = 0; p < panels; ++p) {
      for (int c = 0; c < kPanel; ++c) {
        int32_t s = 0;
        for (int64_t kg = 0; kg < kg_count; ++kg)
          for (int j = 0; j < 4; ++j)
            s += static_cast<int32_t>(q[r * ldq + kg * 4 + j]) * w[p * panel_bytes + kg * 64 + c * 4 + j];
        acc[r * 2 * kPanel + p * kPanel + c] = s;
      }
    }
  }
}

using TileFn = void (*)(const int8_t*, int64_t, const int8_t*, int64_t, int32_t*);


#define PAGODA_TILE_TABLE(NAME)                                                                            \
  TileFn NAME##_table(int rows, int panels) {                                                              \
    static const TileFn table[kRows][2] = {{NAME<1, 1>, NAME<1, 2>}, {NAME<2, 1>, NAME<2, 2>},             \
                                           {NAME<3, 1>, NAME<3, 2>}, {NAME<4, 1>, NAME<4, 2>}};            \
    return table[rows - 1][panels - 1];                                                                    \
  }
PAGODA_TILE_TABLE(tile_vnni)
PAGODA_TILE_TABLE(tile_avx512bw)
PAGODA_TILE_TABLE(tile_avx2)
#undef PAGODA_TILE_TABLE

int resolve(int path) {
  if (path == kAuto) return has_vnni512() ? kVnni512 : has_avx512bw() ? kAvx512bw : has_avx2() ? kAvx2 : kScalar;
  return path;
}

bool supported(int path) {
  switch (path) {
    case kVnni512: return has_vnni512();
    case kAvx512bw: return has_avx512bw();
    case kAvx2: return has_avx2();
    case kScalar: return true;
    default: return false;
  }
}

// ---- W8A16: float rows x int8 panels [N/16][K][16], scales [N/16][G][16] ----

template <int R>
__attribute__((target("avx512f"))) void wtile_avx512(const float* x, int64_t ldx, const int8_t* w, const float* s,
                                                    int64_t K, int64_t group, float* out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g0 = 0, gi = 0; g0 < K; g0 += group, ++gi) {
    __m512 part[R];
    for (int r = 0; r < R; ++r) part[r] = _mm512_setzero_ps();
    const int64_t g1 = std::min(K, g0 + group);
    for (int64_t k = g0; k < g1; ++k) {
      const __m512 wv = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * kPanel))));
      for (int r = 0; r < R; ++r) part[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k]), wv, part[r]);
    }
    const __m512 sv = _mm512_loadu_ps(s + gi * kPanel);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(part[r], sv, acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kPanel, acc[r]);
}

template <int R>
__attribute__((target("avx2,fma"))) void wtile_avx2(const float* x, int64_t ldx, const int8_t* w, const float* s,
                                                   int64_t K, int64_t group, float* out) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g0 = 0, gi = 0; g0 < K; g0 += group, ++gi) {
    __m256 part[R][2];
    for (int r = 0; r < R; ++r) part[r][0] = part[r][1] = _mm256_setzero_ps();
    const int64_t g1 = std::min(K, g0 + group);
    for (int64_t k = g0; k < g1; ++k) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * kPanel));
      const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
      const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_set1_ps(x[r * ldx + k]);
        part[r][0] = _mm256_fmadd_ps(xv, lo, part[r][0]);
        part[r][1] = _mm256_fmadd_ps(xv, hi, part[r][1]);
      }
    }
    const __m256 s0 = _mm256_loadu_ps(s + gi * kPanel), s1 = _mm256_loadu_ps(s + gi * kPanel + 8);
    for (int r = 0; r < R; ++r) {
      acc[r][0] = _mm256_fmadd_ps(part[r][0], s0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(part[r][1], s1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * kPanel, acc[r][0]);
    _mm256_storeu_ps(out + r * kPanel + 8, acc[r][1]);
  }
}

void wtile_scalar(const float* x, int64_t ldx, const int8_t* w, const float* s, int64_t K, int64_t group, float* out,
                  int rows) {
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < kPanel; ++c) {
      float acc = 0.0f;
      for (int64_t g0 = 0, gi = 0; g0 < K; g0 += group, ++gi) {
        float part = 0.0f;
        for (int64_t k = g0; k < std::min(K, g0 + group); ++k) part += x[r * ldx + k] * w[k * kPanel + c];
        acc += part * s[gi * kPanel + c];
      }
      out[r * kPanel + c] = acc;
    }
  }
}

}  // namespace

// Bit i set: path i runs on this CPU (1 VNNI-512, 2 AVX512BW, 3 AVX2, 4 scalar); bit 0: what auto picks.
PAGODA_EXPORT int64_t pagoda_int8_paths() {
  int64_t bits = 0;
  for (int p = kVnni512; p <= kScalar; ++p)
    if (supported(p)) bits |= int64_t{1} << p;
  return bits | (int64_t{resolve(kAuto)} << 8);
}

// w [N, K] int8 -> packed [ceil(N/16)][ceil(K/4)][16][4] (zero padded); colsum [ceil(N/16)*16] = 128 * sum_k w[n, k]
// (what the VNNI path's q + 128 adds to each dot product).
PAGODA_EXPORT void pagoda_int8_pack_w8a8(const int8_t* w, int64_t N, int64_t K, int8_t* packed, int32_t* colsum) {
  const int64_t kg_count = round_up(K, 4) / 4, panels = round_up(N, kPanel) / kPanel;
  std::memset(packed, 0, static_cast<size_t>(panels * kg_count * 64));
  for (int64_t n = 0; n < panels * kPanel; ++n) colsum[n] = 0;
  for (int64_t n = 0; n < N; ++n) {
    const int64_t p = n / kPanel, c = n % kPanel;
    int32_t sum = 0;
    for (int64_t k = 0; k < K; ++k) {
      packed[(p * kg_count + k / 4) * 64 + c * 4 + k % 4] = w[n * K + k];
      sum += w[n * K + k];
    }
    colsum[n] = 128 * sum;
  }
}

// x [M, K] float32 (row stride ldx) -> q [M, Kp] int8 (Kp = round_up(K, 4), zero padded), scales [M]:
// scale = max|x| / 127, q = round_half_even(x / scale) (a zero row: scale 0, q 0).
PAGODA_EXPORT void pagoda_int8_quantize_rows(const float* x, int64_t M, int64_t K, int64_t ldx, int8_t* q,
                                             float* scales, int threads) {
  const int64_t Kp = round_up(K, 4);
#pragma omp parallel for num_threads(threads) if (threads > 1 && M * K >= 65536) schedule(static)
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * ldx;
    float amax = 0.0f;
#pragma omp simd reduction(max : amax)
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(row[k]));
    const float scale = amax / 127.0f;
    scales[m] = scale;
    int8_t* out = q + m * Kp;
    if (amax == 0.0f) {
      std::memset(out, 0, static_cast<size_t>(Kp));
      continue;
    }
#pragma omp simd
    for (int64_t k = 0; k < K; ++k) {
      const float v = std::nearbyint(row[k] / scale);
      out[k] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, v)));
    }
    for (int64_t k = K; k < Kp; ++k) out[k] = 0;
  }
}

// y [M, N] float32 = (q . w^T) * xs[m] * ws[n] (+ bias): q from pagoda_int8_quantize_rows, w from
// pagoda_int8_pack_w8a8. Returns the path it ran (or -1: the path does not run on this CPU).
PAGODA_EXPORT int pagoda_int8_gemm_w8a8(int path, const int8_t* q, const float* xs, int64_t M, const int8_t* packed,
                                        const int32_t* colsum, const float* ws, const float* bias, int64_t N,
                                        int64_t K, float* y, int threads) {
  path = resolve(path);
  if (!supported(path)) return -1;
  const int64_t Kp = round_up(K, 4), kg_count = Kp / 4, panels = round_up(N, kPanel) / kPanel;
  const int64_t pairs = (panels + 1) / 2, row_tiles = (M + kRows - 1) / kRows;
  const int64_t items = pairs * row_tiles;
  const bool parallel = threads > 1 && items > 1 && M * N * K >= 262144;
#pragma omp parallel for num_threads(threads) if (parallel) schedule(static)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t pair = item % pairs, tile = item / pairs;
    const int64_t m0 = tile * kRows, rows = std::min<int64_t>(kRows, M - m0);
    const int64_t p0 = pair * 2, np = std::min<int64_t>(2, panels - p0);
    alignas(64) int32_t acc[kRows * 2 * kPanel];
    const int8_t* qt = q + m0 * Kp;
    const int8_t* wt = packed + p0 * kg_count * 64;
    const int r = static_cast<int>(rows), p = static_cast<int>(np);
    switch (path) {
      case kVnni512: tile_vnni_table(r, p)(qt, Kp, wt, kg_count, acc); break;
      case kAvx512bw: tile_avx512bw_table(r, p)(qt, Kp, wt, kg_count, acc); break;
      case kAvx2: tile_avx2_table(r, p)(qt, Kp, wt, kg_count, acc); break;
      default: tile_scalar(qt, Kp, wt, kg_count, acc, r, p);
    }
    const int64_t n0 = p0 * kPanel, cols = std::min<int64_t>(np * kPanel, N - n0);
    finish(acc, rows, n0, cols, xs + m0, ws, path == kVnni512 ? colsum : nullptr, bias, y + m0 * N, N);
  }
  // finish() indexes columns from n0 in acc's row: acc holds [rows][32] with panel p at p * 16
  return path;
}

// w [N, K] int8 -> [ceil(N/16)][K][16]; scales [N, G] float32 -> [ceil(N/16)][G][16] (zero padded).
PAGODA_EXPORT void pagoda_int8_pack_w8a16(const int8_t* w, const float* scales, int64_t N, int64_t K, int64_t G,
                                          int8_t* packed, float* packed_scales) {
  const int64_t panels = round_up(N, kPanel) / kPanel;
  std::memset(packed, 0, static_cast<size_t>(panels * K * kPanel));
  std::memset(packed_scales, 0, static_cast<size_t>(panels * G * kPanel) * sizeof(float));
  for (int64_t n = 0; n < N; ++n) {
    const int64_t p = n / kPanel, c = n % kPanel;
    for (int64_t k = 0; k < K; ++k) packed[(p * K + k) * kPanel + c] = w[n * K + k];
    for (int64_t g = 0; g < G; ++g) packed_scales[(p * G + g) * kPanel + c] = scales[n * G + g];
  }
}

// y [M, N] float32 = per group g: scale[n, g] * (x[:, g] . w[n, g]) (+ bias), x float32 [M, K] (stride ldx).
PAGODA_EXPORT int pagoda_int8_gemm_w8a16(int path, const float* x, int64_t M, int64_t ldx, const int8_t* packed,
                                         const float* packed_scales, const float* bias, int64_t N, int64_t K,
                                         int64_t group, float* y, int threads) {
  path = resolve(path);
  if (path == kVnni512) path = kAvx512bw;  // the float path needs AVX-512F only
  if (!supported(path)) return -1;
  const int64_t panels = round_up(N, kPanel) / kPanel, G = (K + group - 1) / group;
  const int64_t row_tiles = (M + kRows - 1) / kRows, items = panels * row_tiles;
  const bool parallel = threads > 1 && items > 1 && M * N * K >= 262144;
#pragma omp parallel for num_threads(threads) if (parallel) schedule(static)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t p = item % panels, tile = item / panels;
    const int64_t m0 = tile * kRows, rows = std::min<int64_t>(kRows, M - m0);
    alignas(64) float out[kRows * kPanel];
    const float* xt = x + m0 * ldx;
    const int8_t* wt = packed + p * K * kPanel;
    const float* st = packed_scales + p * G * kPanel;
    if (path == kAvx512bw) {
      switch (rows) {
        case 1: wtile_avx512<1>(xt, ldx, wt, st, K, group, out); break;
        case 2: wtile_avx512<2>(xt, ldx, wt, st, K, group, out); break;
        case 3: wtile_avx512<3>(xt, ldx, wt, st, K, group, out); break;
        default: wtile_avx512<4>(xt, ldx, wt, st, K, group, out);
      }
    } else if (path == kAvx2) {
      switch (rows) {
        case 1: wtile_avx2<1>(xt, ldx, wt, st, K, group, out); break;
        case 2: wtile_avx2<2>(xt, ldx, wt, st, K, group, out); break;
        case 3: wtile_avx2<3>(xt, ldx, wt, st, K, group, out); break;
        default: wtile_avx2<4>(xt, ldx, wt, st, K, group, out);
      }
    } else {
      wtile_scalar(xt, ldx, wt, st, K, group, out, static_cast<int>(rows));
    }
    const int64_t n0 = p * kPanel, cols = std::min<int64_t>(kPanel, N - n0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) y[(m0 + r) * N + n0 + c] = out[r * kPanel + c] + (bias ? bias[n0 + c] : 0.0f);
  }
  return path;
}

PAGODA_PYTHON_MODULE(PAGODA_FUNCTION(pagoda_int8_paths), PAGODA_FUNCTION(pagoda_int8_pack_w8a8),
                     PAGODA_FUNCTION(pagoda_int8_quantize_rows), PAGODA_FUNCTION(pagoda_int8_gemm_w8a8),
                     PAGODA_FUNCTION(pagoda_int8_pack_w8a16), PAGODA_FUNCTION(pagoda_int8_gemm_w8a16))
