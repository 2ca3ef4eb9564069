// 8-bit GPTQ weight x float activation matmuls on x86 CPUs, with runtime dispatch.
//
// The weight is w[k, n] = scale[g, n] * (q[k, n] - zero[g, n]), q in [0, 255], zero an integer (GPTQ v1
// stores zero - 1, so zero reaches 256), g the group of input channel k. The Python side unpacks the
// checkpoint once and repacks it here:
//  - K in the kernel's order: act-order (desc_act) checkpoints have their input channels sorted by group
//    (the caller permutes the activations the same way), so group g is k in gstart[g] .. gstart[g + 1];
//  - each group padded to a multiple of 4 k (gpad[g] .. gpad[g + 1], pad bytes 0): the weight is stored in
//    blocks of 4 k, so a group must start on a block;
//  - q in 16-column panels of 4-k blocks, [N/16][Kp/4][16][4] bytes: one 64-byte load holds the 16 columns
//    of 4 k, byte 4 c + j being column c at k 4 b + j (the layout VNNI's dot product of 4 bytes reads);
//  - per panel and group, scale [N/16][G][16] float32 and zero [N/16][G][16] int32.
// The zero is subtracted from q in integers before anything meets a float, so a group's partial sum is
// sum_k x[k] (q - zero) exactly as the dequantized reference forms it (no large sum_k x q minus zero times
// sum_k x, whose cancellation an 8-bit zero near 128 would make cost bits).
//
// Entry points: pagoda_gptq8_gemm (up to 8 rows (AVX-512; 4 otherwise) share each widened weight vector),
// pagoda_gptq8_dequantize (a slab of columns widened to float32 [K, n1 - n0] for the caller's float GEMM
// when many rows share the weights). Paths: AVX-512F/BW, AVX2 + FMA, portable C++, picked at run time
// from the CPU's flags (or forced by the caller), and two AVX512-VNNI paths with the activations quantized
// per block of 32 k: to int16 (kVnni16, word dot products; auto's pick where VNNI runs) and, only when the
// caller asks for it, to int8 (kVnni512, byte dot products: faster, not the checkpoint's numbers).
#include <omp.h>
#include <pagoda/python.h>
#include <pagoda/simd.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kPanel = 16;  // output columns per panel
constexpr int64_t kBlock = 4;   // k per block
constexpr int64_t kActBlock = 32;  // k per activation scale (int8 activations)
constexpr int kRows = 8;        // activation rows per register tile: AVX-512 (AVX2 and scalar: 4)

enum Path : int { kAuto = 0, kAvx512 = 1, kAvx2 = 2, kScalar = 3, kVnni512 = 4, kVnni16 = 5 };

bool has_avx512() { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"); }
bool has_vnni512() { return has_avx512() && __builtin_cpu_supports("avx512vnni"); }
bool has_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

int resolve(int path) {
  // auto: int16 activations where VNNI runs (about 2x the float tiles' speed, 2e-5 relative error); never the
  // int8 ones (kVnni512: faster still, but 0.5% off, which moved a tiny model's greedy tokens; docs/quantization.md)
  if (path == kAuto) return has_vnni512() ? kVnni16 : has_avx512() ? kAvx512 : has_avx2() ? kAvx2 : kScalar;
  return path;
}

bool supported(int path) {
  switch (path) {
    case kAvx512: return has_avx512();
    case kAvx2: return has_avx2();
    case kScalar: return true;
    case kVnni512: return has_vnni512();
    case kVnni16: return has_vnni512();
    default: return false;
  }
}

// -- y tiles: R rows x one panel, every group ---------------------------------------------------------
// x: float32 rows in the padded k order (pad columns 0), row stride ldx.

// Byte j of every 32-bit lane, minus the zero, as float: the weights of one k for 16 columns.
template <int J>
__attribute__((target("avx512f,avx512bw"))) inline __m512 widen_avx512(__m512i block, __m512i zero) {
  __m512i v = J == 0 ? block : _mm512_srli_epi32(block, 8 * J);
  if (J != 3) v = _mm512_and_si512(v, _mm512_set1_epi32(0xFF));
  return _mm512_cvtepi32_ps(_mm512_sub_epi32(v, zero));
}

// Two sets of partial sums (k even / odd within a block): each FMA chain waits on every other k only.
template <int R>
__attribute__((target("avx512f,avx512bw"))) void tile_avx512(const float* x, int64_t ldx, int64_t G,
                                                             const uint8_t* w, const float* s, const int32_t* z,
                                                             const int64_t* gpad, float* out) {
  constexpr int C = R <= 4 ? 2 : 1;  // FMA chains per row: 2 hide the FMA's latency for few rows
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const __m512i zv = _mm512_loadu_si512(z + g * kPanel);
    __m512 p[C][R];
    for (int c = 0; c < C; ++c)
      for (int r = 0; r < R; ++r) p[c][r] = _mm512_setzero_ps();
    for (int64_t k = gpad[g]; k < gpad[g + 1]; k += kBlock) {
      const __m512i block = _mm512_loadu_si512(w + k * kPanel);
      const __m512 w0 = widen_avx512<0>(block, zv), w1 = widen_avx512<1>(block, zv);
      for (int r = 0; r < R; ++r) {
        p[0][r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k]), w0, p[0][r]);
        p[C - 1][r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k + 1]), w1, p[C - 1][r]);
      }
      const __m512 w2 = widen_avx512<2>(block, zv), w3 = widen_avx512<3>(block, zv);
      for (int r = 0; r < R; ++r) {
        p[0][r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k + 2]), w2, p[0][r]);
        p[C - 1][r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k + 3]), w3, p[C - 1][r]);
      }
    }
    const __m512 sv = _mm512_loadu_ps(s + g * kPanel);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_fmadd_ps(C == 1 ? p[0][r] : _mm512_add_ps(p[0][r], p[C - 1][r]), sv, acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kPanel, acc[r]);
}

template <int J>
__attribute__((target("avx2,fma"))) inline __m256 widen_avx2(__m256i block, __m256i zero) {
  __m256i v = J == 0 ? block : _mm256_srli_epi32(block, 8 * J);
  if (J != 3) v = _mm256_and_si256(v, _mm256_set1_epi32(0xFF));
  return _mm256_cvtepi32_ps(_mm256_sub_epi32(v, zero));
}

template <int R>
__attribute__((target("avx2,fma"))) void tile_avx2(const float* x, int64_t ldx, int64_t G, const uint8_t* w,
                                                   const float* s, const int32_t* z, const int64_t* gpad,
                                                   float* out) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    for (int h = 0; h < 2; ++h) {  // columns 8 h .. 8 h + 7: one 32-byte half of each block
      const __m256i zv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(z + g * kPanel + 8 * h));
      __m256 p0[R], p1[R];
      for (int r = 0; r < R; ++r) p0[r] = p1[r] = _mm256_setzero_ps();
      for (int64_t k = gpad[g]; k < gpad[g + 1]; k += kBlock) {
        const __m256i block = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * kPanel + 32 * h));
        const __m256 w0 = widen_avx2<0>(block, zv), w1 = widen_avx2<1>(block, zv);
        for (int r = 0; r < R; ++r) {
          p0[r] = _mm256_fmadd_ps(_mm256_set1_ps(x[r * ldx + k]), w0, p0[r]);
          p1[r] = _mm256_fmadd_ps(_mm256_set1_ps(x[r * ldx + k + 1]), w1, p1[r]);
        }
        const __m256 w2 = widen_avx2<2>(block, zv), w3 = widen_avx2<3>(block, zv);
        for (int r = 0; r < R; ++r) {
          p0[r] = _mm256_fmadd_ps(_mm256_set1_ps(x[r * ldx + k + 2]), w2, p0[r]);
          p1[r] = _mm256_fmadd_ps(_mm256_set1_ps(x[r * ldx + k + 3]), w3, p1[r]);
        }
      }
      const __m256 sv = _mm256_loadu_ps(s + g * kPanel + 8 * h);
      for (int r = 0; r < R; ++r) acc[r][h] = _mm256_fmadd_ps(_mm256_add_ps(p0[r], p1[r]), sv, acc[r][h]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * kPanel, acc[r][0]);
    _mm256_storeu_ps(out + r * kPanel + 8, acc[r][1]);
  }
}

// Column c of a panel at padded k: byte 4 c + k % 4 of block k / 4.
inline int byte_at(const uint8_t* w, int64_t k, int c) { return w[(k / kBlock) * kBlock * kPanel + kBlock * c + k % kBlock]; }

void tile_scalar(const float* x, int64_t ldx, int64_t G, const uint8_t* w, const float* s, const int32_t* z,
                 const int64_t* gpad, float* out, int rows) {
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < kPanel; ++c) {
      float acc = 0.0f;
      for (int64_t g = 0; g < G; ++g) {
        float part = 0.0f;
        const int zero = z[g * kPanel + c];
        for (int64_t k = gpad[g]; k < gpad[g + 1]; ++k)
          part += x[r * ldx + k] * static_cast<float>(byte_at(w, k, c) - zero);
        acc += part * s[g * kPanel + c];
      }
      out[r * kPanel + c] = acc;
    }
  }
}

void run_tile(int path, int rows, const float* x, int64_t ldx, int64_t G, const uint8_t* w, const float* s,
              const int32_t* z, const int64_t* gpad, float* out) {
  if (path == kAvx512) {
    switch (rows) {
      case 1: tile_avx512<1>(x, ldx, G, w, s, z, gpad, out); return;
      case 2: tile_avx512<2>(x, ldx, G, w, s, z, gpad, out); return;
      case 3: tile_avx512<3>(x, ldx, G, w, s, z, gpad, out); return;
      case 4: tile_avx512<4>(x, ldx, G, w, s, z, gpad, out); return;
      case 5: tile_avx512<5>(x, ldx, G, w, s, z, gpad, out); return;
      case 6: tile_avx512<6>(x, ldx, G, w, s, z, gpad, out); return;
      case 7: tile_avx512<7>(x, ldx, G, w, s, z, gpad, out); return;
      default: tile_avx512<8>(x, ldx, G, w, s, z, gpad, out); return;
    }
  }
  if (path == kAvx2) {
    switch (rows) {
      case 1: tile_avx2<1>(x, ldx, G, w, s, z, gpad, out); return;
      case 2: tile_avx2<2>(x, ldx, G, w, s, z, gpad, out); return;
      case 3: tile_avx2<3>(x, ldx, G, w, s, z, gpad, out); return;
      default: tile_avx2<4>(x, ldx, G, w, s, z, gpad, out); return;
    }
  }
  tile_scalar(x, ldx, G, w, s, z, gpad, out, rows);
}

// int8 activations against the u8 weights, 4 k per VNNI byte dot product. Each block of kActBlock k (blocks
// restart at every group) has its own activation scale, x ~ xs[b] * xq with xq in [-127, 127], so one large
// activation costs precision only within its block. Integer sums per block, float from there:
//   y = sum_g scale_g (sum_{b in g} xs[b] sum_{k in b} xq q  -  zero_g xz[g]),  xz[g] = sum_{b in g} xs[b] sum_{k in b} xq.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void tile_vnni512(const int8_t* xq, int64_t ldq, const float* xs,
                                                                          int64_t ldb, const float* xz, int64_t G,
                                                                          const uint8_t* w, const float* s,
                                                                          const int32_t* z, const int64_t* gpad,
                                                                          const int64_t* bstart, float* out) {
  constexpr int C = R <= 4 ? 2 : 1;  // integer chains per row: 2 hide the dot product's latency for few rows
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 part[R];
    for (int r = 0; r < R; ++r) part[r] = _mm512_setzero_ps();
    int64_t b = bstart[g];
    for (int64_t kb = gpad[g]; kb < gpad[g + 1]; kb += kActBlock, ++b) {
      const int64_t end = std::min<int64_t>(kb + kActBlock, gpad[g + 1]);
      __m512i dot[C][R];
      for (int c = 0; c < C; ++c)
        for (int r = 0; r < R; ++r) dot[c][r] = _mm512_setzero_si512();
      int64_t k = kb;
      if constexpr (C == 2) {
        for (; k + kBlock < end; k += 2 * kBlock) {
          const __m512i b0 = _mm512_loadu_si512(w + k * kPanel), b1 = _mm512_loadu_si512(w + (k + kBlock) * kPanel);
          for (int r = 0; r < R; ++r) {
            int32_t a0, a1;
            std::memcpy(&a0, xq + r * ldq + k, 4);
            std::memcpy(&a1, xq + r * ldq + k + kBlock, 4);
            dot[0][r] = _mm512_dpbusd_epi32(dot[0][r], b0, _mm512_set1_epi32(a0));
            dot[C - 1][r] = _mm512_dpbusd_epi32(dot[C - 1][r], b1, _mm512_set1_epi32(a1));
          }
        }
      }
      for (; k < end; k += kBlock) {
        const __m512i block = _mm512_loadu_si512(w + k * kPanel);
        for (int r = 0; r < R; ++r) {
          int32_t a;
          std::memcpy(&a, xq + r * ldq + k, 4);
          dot[0][r] = _mm512_dpbusd_epi32(dot[0][r], block, _mm512_set1_epi32(a));
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m512i sum = C == 1 ? dot[0][r] : _mm512_add_epi32(dot[0][r], dot[C - 1][r]);
        part[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(xs[r * ldb + b]), part[r]);
      }
    }
    const __m512 sv = _mm512_loadu_ps(s + g * kPanel);
    const __m512 szv = _mm512_mul_ps(sv, _mm512_cvtepi32_ps(_mm512_loadu_si512(z + g * kPanel)));
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(part[r], sv, acc[r]);
      acc[r] = _mm512_fnmadd_ps(_mm512_set1_ps(xz[r * G + g]), szv, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kPanel, acc[r]);
}

void run_vnni_tile(int rows, const int8_t* xq, int64_t ldq, const float* xs, int64_t ldb, const float* xz, int64_t G,
                   const uint8_t* w, const float* s, const int32_t* z, const int64_t* gpad, const int64_t* bstart,
                   float* out) {
  switch (rows) {
    case 1: tile_vnni512<1>(xq, ldq, xs, ldb, xz, G, w, s, z, gpad, bstart, out); return;
    case 2: tile_vnni512<2>(xq, ldq, xs, ldb, xz, G, w, s, z, gpad, bstart, out); return;
    case 3: tile_vnni512<3>(xq, ldq, xs, ldb, xz, G, w, s, z, gpad, bstart, out); return;
    case 4: tile_vnni512<4>(xq, ldq, xs, ldb, xz, G, w, s, z, gpad, bstart, out); return;
    case 5: tile_vnni512<5>(xq, ldq, xs, ldb, xz, G, w, s, z, gpad, bstart, out); return;
    case 6: tile_vnni512<6>(xq, ldq, xs, ldb, xz, G, w, s, z, gpad, bstart, out); return;
    case 7: tile_vnni512<7>(xq, ldq, xs, ldb, xz, G, w, s, z, gpad, bstart, out); return;
    default: tile_vnni512<8>(xq, ldq, xs, ldb, xz, G, w, s, z, gpad, bstart, out); return;
  }
}

// int16 activations against the weights minus their zero as int16 (exact: [-256, 255]), 2 k per VNNI word dot
// product. A 4-k block's 64 bytes give two vectors of int16 pairs per column, (q[k], q[k+2]) and
// (q[k+1], q[k+3]); the activations are stored per block in the same pairing, x[k], x[k+2], x[k+1], x[k+3].
// One activation scale per kActBlock k (x ~ xs[b] * x16, x16 in [-32767, 32767]): 2^-16 of the block's
// largest value, finer than a float16 activation.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void tile_vnni16(const int16_t* xq, int64_t ldq, const float* xs,
                                                                         int64_t ldb, int64_t G, const uint8_t* w,
                                                                         const float* s, const int32_t* z,
                                                                         const int64_t* gpad, const int64_t* bstart,
                                                                         float* out) {
  constexpr int C = R <= 4 ? 2 : 1;
  const __m512i low = _mm512_set1_epi32(0x00FF00FF);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const __m512i z32 = _mm512_loadu_si512(z + g * kPanel);
    const __m512i zz = _mm512_or_si512(z32, _mm512_slli_epi32(z32, 16));  // the zero in both int16 halves
    __m512 part[R];
    for (int r = 0; r < R; ++r) part[r] = _mm512_setzero_ps();
    int64_t b = bstart[g];
    for (int64_t kb = gpad[g]; kb < gpad[g + 1]; kb += kActBlock, ++b) {
      const int64_t end = std::min<int64_t>(kb + kActBlock, gpad[g + 1]);
      __m512i dot[C][R];
      for (int c = 0; c < C; ++c)
        for (int r = 0; r < R; ++r) dot[c][r] = _mm512_setzero_si512();
      for (int64_t k = kb; k < end; k += kBlock) {
        const __m512i block = _mm512_loadu_si512(w + k * kPanel);
        const __m512i even = _mm512_sub_epi16(_mm512_and_si512(block, low), zz);
        const __m512i odd = _mm512_sub_epi16(_mm512_and_si512(_mm512_srli_epi32(block, 8), low), zz);
        for (int r = 0; r < R; ++r) {
          int32_t a0, a1;
          std::memcpy(&a0, xq + r * ldq + k, 4);
          std::memcpy(&a1, xq + r * ldq + k + 2, 4);
          dot[0][r] = _mm512_dpwssd_epi32(dot[0][r], even, _mm512_set1_epi32(a0));
          dot[C - 1][r] = _mm512_dpwssd_epi32(dot[C - 1][r], odd, _mm512_set1_epi32(a1));
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m512i sum = C == 1 ? dot[0][r] : _mm512_add_epi32(dot[0][r], dot[C - 1][r]);
        part[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(xs[r * ldb + b]), part[r]);
      }
    }
    const __m512 sv = _mm512_loadu_ps(s + g * kPanel);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(part[r], sv, acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kPanel, acc[r]);
}

void run_vnni16_tile(int rows, const int16_t* xq, int64_t ldq, const float* xs, int64_t ldb, int64_t G,
                     const uint8_t* w, const float* s, const int32_t* z, const int64_t* gpad, const int64_t* bstart,
                     float* out) {
  switch (rows) {
    case 1: tile_vnni16<1>(xq, ldq, xs, ldb, G, w, s, z, gpad, bstart, out); return;
    case 2: tile_vnni16<2>(xq, ldq, xs, ldb, G, w, s, z, gpad, bstart, out); return;
    case 3: tile_vnni16<3>(xq, ldq, xs, ldb, G, w, s, z, gpad, bstart, out); return;
    case 4: tile_vnni16<4>(xq, ldq, xs, ldb, G, w, s, z, gpad, bstart, out); return;
    case 5: tile_vnni16<5>(xq, ldq, xs, ldb, G, w, s, z, gpad, bstart, out); return;
    case 6: tile_vnni16<6>(xq, ldq, xs, ldb, G, w, s, z, gpad, bstart, out); return;
    case 7: tile_vnni16<7>(xq, ldq, xs, ldb, G, w, s, z, gpad, bstart, out); return;
    default: tile_vnni16<8>(xq, ldq, xs, ldb, G, w, s, z, gpad, bstart, out); return;
  }
}

// -- one panel widened to float: out[k * ldo + c] = s * (q - zero), k unpadded -----------------------

__attribute__((target("avx512f,avx512bw"))) void dequant_avx512(const uint8_t* w, const float* s, const int32_t* z,
                                                                const int64_t* gstart, const int64_t* gpad,
                                                                int64_t G, float* out, int64_t ldo) {
  for (int64_t g = 0; g < G; ++g) {
    const __m512 sv = _mm512_loadu_ps(s + g * kPanel);
    const __m512i zv = _mm512_loadu_si512(z + g * kPanel);
    const int64_t len = gstart[g + 1] - gstart[g];
    for (int64_t i = 0; i < len; i += kBlock) {
      const __m512i block = _mm512_loadu_si512(w + (gpad[g] + i) * kPanel);
      float* o = out + (gstart[g] + i) * ldo;
      const int64_t n = std::min<int64_t>(kBlock, len - i);
      _mm512_storeu_ps(o, _mm512_mul_ps(widen_avx512<0>(block, zv), sv));
      if (n > 1) _mm512_storeu_ps(o + ldo, _mm512_mul_ps(widen_avx512<1>(block, zv), sv));
      if (n > 2) _mm512_storeu_ps(o + 2 * ldo, _mm512_mul_ps(widen_avx512<2>(block, zv), sv));
      if (n > 3) _mm512_storeu_ps(o + 3 * ldo, _mm512_mul_ps(widen_avx512<3>(block, zv), sv));
    }
  }
}

void dequant_scalar(const uint8_t* w, const float* s, const int32_t* z, const int64_t* gstart, const int64_t* gpad,
                    int64_t G, float* out, int64_t ldo) {
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < gstart[g + 1] - gstart[g]; ++i)
      for (int c = 0; c < kPanel; ++c)
        out[(gstart[g] + i) * ldo + c] =
            static_cast<float>(byte_at(w, gpad[g] + i, c) - z[g * kPanel + c]) * s[g * kPanel + c];
}

__attribute__((target("avx2,fma"))) void dequant_avx2(const uint8_t* w, const float* s, const int32_t* z,
                                                      const int64_t* gstart, const int64_t* gpad, int64_t G,
                                                      float* out, int64_t ldo) {
  for (int64_t g = 0; g < G; ++g) {
    const int64_t len = gstart[g + 1] - gstart[g];
    for (int h = 0; h < 2; ++h) {
      const __m256 sv = _mm256_loadu_ps(s + g * kPanel + 8 * h);
      const __m256i zv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(z + g * kPanel + 8 * h));
      for (int64_t i = 0; i < len; i += kBlock) {
        const __m256i block = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (gpad[g] + i) * kPanel + 32 * h));
        float* o = out + (gstart[g] + i) * ldo + 8 * h;
        const int64_t n = std::min<int64_t>(kBlock, len - i);
        _mm256_storeu_ps(o, _mm256_mul_ps(widen_avx2<0>(block, zv), sv));
        if (n > 1) _mm256_storeu_ps(o + ldo, _mm256_mul_ps(widen_avx2<1>(block, zv), sv));
        if (n > 2) _mm256_storeu_ps(o + 2 * ldo, _mm256_mul_ps(widen_avx2<2>(block, zv), sv));
        if (n > 3) _mm256_storeu_ps(o + 3 * ldo, _mm256_mul_ps(widen_avx2<3>(block, zv), sv));
      }
    }
  }
}

}  // namespace

// Bit i set: path i runs on this CPU (1 AVX-512, 2 AVX2, 3 scalar, 4 VNNI int8, 5 VNNI int16); bits 8..15: the
// path auto picks.
PAGODA_EXPORT int64_t pagoda_gptq8_paths() {
  int64_t bits = 0;
  for (int p = kAvx512; p <= kVnni16; ++p)
    if (supported(p)) bits |= int64_t{1} << p;
  return bits | (int64_t{resolve(kAuto)} << 8);
}

// q [K, N] uint8 (row k in the kernel's order), scales [G, N] float32, zeros [G, N] int32, gstart / gpad
// [G + 1] (group g: k in gstart[g] .. gstart[g + 1], stored at gpad[g] ..) -> packed [ceil(N/16)][Kp/4][16][4],
// packed_scales [ceil(N/16)][G][16], packed_zeros [ceil(N/16)][G][16] (padding zero).
PAGODA_EXPORT void pagoda_gptq8_pack(const uint8_t* q, const float* scales, const int32_t* zeros,
                                     const int64_t* gstart, const int64_t* gpad, int64_t K, int64_t N, int64_t G,
                                     uint8_t* packed, float* packed_scales, int32_t* packed_zeros) {
  const int64_t panels = (N + kPanel - 1) / kPanel, Kp = gpad[G];
  std::memset(packed, 0, static_cast<size_t>(panels * Kp * kPanel));
  std::memset(packed_scales, 0, static_cast<size_t>(panels * G * kPanel) * sizeof(float));
  std::memset(packed_zeros, 0, static_cast<size_t>(panels * G * kPanel) * sizeof(int32_t));
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t i = 0; i < gstart[g + 1] - gstart[g]; ++i) {
      const int64_t k = gstart[g] + i, kp = gpad[g] + i;
      for (int64_t n = 0; n < N; ++n) {
        const int64_t p = n / kPanel, c = n % kPanel;
        packed[p * Kp * kPanel + (kp / kBlock) * kBlock * kPanel + kBlock * c + kp % kBlock] = q[k * N + n];
      }
    }
    for (int64_t n = 0; n < N; ++n) {
      const int64_t p = n / kPanel, c = n % kPanel;
      packed_scales[(p * G + g) * kPanel + c] = scales[g * N + n];
      packed_zeros[(p * G + g) * kPanel + c] = zeros[g * N + n];
    }
  }
}

// y [M, N] float32 = x [M, K] (row stride ldx, columns in the kernel's order, unpadded) . w^T (+ bias).
// Returns the path it ran, or -1 when the asked path does not run on this CPU.
PAGODA_EXPORT int pagoda_gptq8_gemm(int path, const float* x, int64_t M, int64_t ldx, const uint8_t* packed,
                                    const float* packed_scales, const int32_t* packed_zeros, const int64_t* gstart,
                                    const int64_t* gpad, int64_t G, const float* bias, int64_t N, int64_t K,
                                    float* y, int threads) {
  path = resolve(path);
  if (!supported(path)) return -1;
  const int64_t Kp = gpad[G];
  std::vector<int8_t> xq;
  std::vector<float> xs, xz;
  std::vector<int64_t> bstart;
  int64_t blocks = 0;
  if (path == kVnni512) {  // the rows quantized to int8 in the padded order (pad columns 0), a scale per block
    bstart.resize(static_cast<size_t>(G + 1));
    for (int64_t g = 0; g < G; ++g) {
      bstart[g] = blocks;
      blocks += (gpad[g + 1] - gpad[g] + kActBlock - 1) / kActBlock;
    }
    bstart[G] = blocks;
    xq.assign(static_cast<size_t>(M * Kp), 0);
    xs.assign(static_cast<size_t>(M * blocks), 0.0f);
    xz.assign(static_cast<size_t>(M * G), 0.0f);
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t len = gstart[g + 1] - gstart[g];
        float zsum = 0.0f;
        for (int64_t i0 = 0, b = bstart[g]; i0 < len; i0 += kActBlock, ++b) {
          const int64_t i1 = std::min<int64_t>(len, i0 + kActBlock);
          const float* xr = x + m * ldx + gstart[g];
          float amax = 0.0f;
          for (int64_t i = i0; i < i1; ++i) amax = std::max(amax, std::abs(xr[i]));
          const float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
          int32_t sum = 0;
          for (int64_t i = i0; i < i1; ++i) {
            const int32_t v = static_cast<int32_t>(std::nearbyint(xr[i] * inv));
            xq[m * Kp + gpad[g] + i] = static_cast<int8_t>(v);
            sum += v;
          }
          xs[m * blocks + b] = scale;
          zsum += scale * static_cast<float>(sum);
        }
        xz[m * G + g] = zsum;
      }
    }
  }
  std::vector<int16_t> xq16;
  if (path == kVnni16) {  // the rows as int16 in the padded order, each 4-k block paired (k, k+2), (k+1, k+3)
    bstart.resize(static_cast<size_t>(G + 1));
    for (int64_t g = 0; g < G; ++g) {
      bstart[g] = blocks;
      blocks += (gpad[g + 1] - gpad[g] + kActBlock - 1) / kActBlock;
    }
    bstart[G] = blocks;
    xq16.assign(static_cast<size_t>(M * Kp), 0);
    xs.assign(static_cast<size_t>(M * blocks), 0.0f);
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t len = gstart[g + 1] - gstart[g];
        const float* xr = x + m * ldx + gstart[g];
        for (int64_t i0 = 0, b = bstart[g]; i0 < len; i0 += kActBlock, ++b) {
          const int64_t i1 = std::min<int64_t>(len, i0 + kActBlock);
          float amax = 0.0f;
          for (int64_t i = i0; i < i1; ++i) amax = std::max(amax, std::abs(xr[i]));
          const float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
          for (int64_t i = i0; i < i1; ++i) {
            const int64_t kp = gpad[g] + i, j = kp % kBlock;
            // position in the block: x[k] x[k+2] x[k+1] x[k+3]
            xq16[m * Kp + kp - j + (j == 1 ? 2 : j == 2 ? 1 : j)] =
                static_cast<int16_t>(std::nearbyint(xr[i] * inv));
          }
          xs[m * blocks + b] = amax / 32767.0f;
        }
      }
    }
  }
  // groups whose length is not a multiple of 4 (act order): x copied into the padded order, zeros between
  std::vector<float> padded;
  const float* xp = x;
  int64_t ldp = ldx;
  if (Kp != K && path != kVnni512 && path != kVnni16) {
    padded.assign(static_cast<size_t>(M * Kp), 0.0f);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < G; ++g)
        std::memcpy(padded.data() + m * Kp + gpad[g], x + m * ldx + gstart[g],
                    static_cast<size_t>(gstart[g + 1] - gstart[g]) * sizeof(float));
    xp = padded.data();
    ldp = Kp;
  }
  const int64_t tile_rows = path == kAvx512 || path == kVnni512 || path == kVnni16 ? kRows : 4;
  const int64_t panels = (N + kPanel - 1) / kPanel, row_tiles = (M + tile_rows - 1) / tile_rows;
  const int64_t items = panels * row_tiles;
  const bool parallel = threads > 1 && items > 1 && M * N * K >= 131072;
#pragma omp parallel for num_threads(threads) if (parallel) schedule(static)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t p = item % panels, tile = item / panels;
    const int64_t m0 = tile * tile_rows, rows = std::min<int64_t>(tile_rows, M - m0);
    alignas(64) float out[kRows * kPanel];
    if (path == kVnni16)
      run_vnni16_tile(static_cast<int>(rows), xq16.data() + m0 * Kp, Kp, xs.data() + m0 * blocks, blocks, G,
                      packed + p * Kp * kPanel, packed_scales + p * G * kPanel, packed_zeros + p * G * kPanel, gpad,
                      bstart.data(), out);
    else if (path == kVnni512)
      run_vnni_tile(static_cast<int>(rows), xq.data() + m0 * Kp, Kp, xs.data() + m0 * blocks, blocks,
                    xz.data() + m0 * G, G, packed + p * Kp * kPanel, packed_scales + p * G * kPanel,
                    packed_zeros + p * G * kPanel, gpad, bstart.data(), out);
    else
      run_tile(path, static_cast<int>(rows), xp + m0 * ldp, ldp, G, packed + p * Kp * kPanel,
               packed_scales + p * G * kPanel, packed_zeros + p * G * kPanel, gpad, out);
    const int64_t n0 = p * kPanel, cols = std::min<int64_t>(kPanel, N - n0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) y[(m0 + r) * N + n0 + c] = out[r * kPanel + c] + (bias ? bias[n0 + c] : 0.0f);
  }
  return path;
}

// Columns [n0, n1) of w widened to float32: out [K, n1 - n0] (row k in the kernel's order, unpadded), for a
// float GEMM x . out. n0 a multiple of 16; n1 - n0 a multiple of 16 or n1 = N. Returns the path, or -1.
PAGODA_EXPORT int pagoda_gptq8_dequantize(int path, const uint8_t* packed, const float* packed_scales,
                                          const int32_t* packed_zeros, const int64_t* gstart, const int64_t* gpad,
                                          int64_t G, int64_t N, int64_t K, int64_t n0, int64_t n1, float* out,
                                          int threads) {
  path = resolve(path);
  if (!supported(path) || n0 % kPanel != 0) return -1;
  const int64_t Kp = gpad[G];
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
      const uint8_t* w = packed + p * Kp * kPanel;
      const float* s = packed_scales + p * G * kPanel;
      const int32_t* z = packed_zeros + p * G * kPanel;
      if (path == kAvx512 || path == kVnni512 || path == kVnni16) dequant_avx512(w, s, z, gstart, gpad, G, dst, ldo);
      else if (path == kAvx2) dequant_avx2(w, s, z, gstart, gpad, G, dst, ldo);
      else dequant_scalar(w, s, z, gstart, gpad, G, dst, ldo);
      if (partial) {
        const int64_t cols = width - i * kPanel;
        for (int64_t k = 0; k < K; ++k)
          std::memcpy(out + k * width + i * kPanel, scratch.data() + k * kPanel, static_cast<size_t>(cols) * sizeof(float));
      }
    }
  }
  return path;
}

PAGODA_PYTHON_MODULE(PAGODA_FUNCTION(pagoda_gptq8_paths), PAGODA_FUNCTION(pagoda_gptq8_pack),
                     PAGODA_FUNCTION(pagoda_gptq8_gemm), PAGODA_FUNCTION(pagoda_gptq8_dequantize))
