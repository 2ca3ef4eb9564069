// y[M, N] = x[M, K] W[N, K]^T with W in GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; the K-quants are in
// gguf_kquants.cpp, behind the same entry point), as llama.cpp's
// CPU backend computes it: x is quantized per 32-value block to int8 (scale d_x, and s_x = d_x * sum(q_x)),
// each weight block is unpacked in registers to 32 bytes, and the block's dot product is an integer
// one (u8 x s8 -> s32: AVX-512 VNNI's vpdpbusd on 256-bit vectors, else AVX2's vpmaddubsw + vpmaddwd),
// scaled by d_w * d_x into a float accumulator. The block offsets (Q4_0's -8, Q5_0's -16) and minimums
// (Q4_1 / Q5_1's m) act on the sum of the x block: they cost one scalar multiply-add a block.
// Q8_0 weights are signed: |w| x sign(x, w) keeps the u8 x s8 form (llama.cpp's trick).
//
// One entry point serves decode (M = 1: a read of W, one thread per contiguous range of rows) and
// prefill (each weight block is unpacked once and applied to up to 4 rows of x; a row of W stays in L1
// while all of x's rows pass it). Threads split W's rows (pagoda::parallel_for).
//
// Paths, chosen at compile time (-march=native): AVX-512 VNNI (+VL), AVX2 (+FMA, F16C), portable scalar.
// Tests also build the file with -mno-avx512f to check the AVX2 path on a CPU that has AVX-512.

#include <pagoda/parallel.h>
#include <pagoda/python.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gguf_common.h"

namespace pagoda_gguf {

enum : int { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8 };
constexpr int kBlock = 32;

template <int T> struct Layout;
template <> struct Layout<kQ4_0> { static constexpr int bytes = 18, qs = 2; };
template <> struct Layout<kQ4_1> { static constexpr int bytes = 20, qs = 4; };
template <> struct Layout<kQ5_0> { static constexpr int bytes = 22, qs = 6; };
template <> struct Layout<kQ5_1> { static constexpr int bytes = 24, qs = 8; };
template <> struct Layout<kQ8_0> { static constexpr int bytes = 34, qs = 2; };

// x [M, K] -> int8 per 32-block (round to nearest), its scale d and d * sum(q).
void quantize_x(const float* x, int64_t M, int64_t K, int8_t* q, float* d, float* s) {
  const int64_t nb = K / kBlock;
  for (int64_t i = 0; i < M * nb; ++i) {
    const float* xb = x + i * kBlock;
    float amax = 0.f;
    for (int j = 0; j < kBlock; ++j) amax = std::fmax(amax, std::fabs(xb[j]));
    const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    int sum = 0;
    for (int j = 0; j < kBlock; ++j) {
      const int v = static_cast<int>(std::nearbyint(xb[j] * inv));
      q[i * kBlock + j] = static_cast<int8_t>(v);
      sum += v;
    }
    d[i] = scale;
    s[i] = scale * static_cast<float>(sum);
  }
}

// What a weight block adds beside d_w * d_x * dot(q_w, q_x): c * s_x.
template <int T>
inline float offset_coef(const uint8_t* blk, float dw) {
  if constexpr (T == kQ4_0) return -8.f * dw;
  else if constexpr (T == kQ5_0) return -16.f * dw;
  else if constexpr (T == kQ4_1 || T == kQ5_1) return half_to_float(blk + 2);
  else return 0.f;
}

#if defined(GGUF_AVX2)
// 32 bits -> 32 bytes of 0xFF / 0x00 (llama.cpp's bytes_from_bits_32).
inline __m256i bytes_from_bits(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000);
  __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), shuf);
  bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

// A block's 32 values as unsigned bytes, in ggml's order (low nibbles are values 0..15).
template <int T>
inline __m256i unpack(const uint8_t* blk) {
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + Layout<T>::qs));
  __m256i v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0F));
  if constexpr (T == kQ5_0 || T == kQ5_1) {
    const __m256i hi = _mm256_and_si256(bytes_from_bits(blk + Layout<T>::qs - 4), _mm256_set1_epi8(0x10));
    v = _mm256_or_si256(v, hi);
  }
  return v;
}

// out[r] = row . x[r] for MB rows of quantized x.
template <int T, int MB>
inline void dot_rows(const uint8_t* w, int64_t nb, const int8_t* xq, const float* xd, const float* xs, int64_t x_stride,
                     float* out) {
  __m256 acc[MB];
  float corr[MB];
  for (int r = 0; r < MB; ++r) acc[r] = _mm256_setzero_ps(), corr[r] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * Layout<T>::bytes;
    const float dw = half_to_float(blk);
    if constexpr (T == kQ8_0) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
      const __m256i wa = _mm256_sign_epi8(wv, wv);
      for (int r = 0; r < MB; ++r) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * x_stride * kBlock + b * kBlock));
        const __m256i p = dot_u8s8(wa, _mm256_sign_epi8(xv, wv));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * xd[r * x_stride + b]), acc[r]);
      }
    } else {
      const __m256i wv = unpack<T>(blk);
      const float c = offset_coef<T>(blk, dw);
      for (int r = 0; r < MB; ++r) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * x_stride * kBlock + b * kBlock));
        const __m256i p = dot_u8s8(wv, xv);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * xd[r * x_stride + b]), acc[r]);
        corr[r] += c * xs[r * x_stride + b];
      }
    }
  }
  for (int r = 0; r < MB; ++r) out[r] = hsum(acc[r]) + corr[r];
}

// Decode (one row of x): 4 weight rows at a time. The rows' scales (and minimums) convert in one
// vcvtph2ps, the x block loads once, and the 4 independent accumulators hide the FMA latency that a
// single row's chain of blocks waits on (measured 1.2x over one row at a time on the loaded 2-vCPU Zen 4).
template <int T>
inline void dot_4rows(const uint8_t* w, int64_t row_bytes, int64_t nb, const int8_t* xq, const float* xd,
                      const float* xs, float* out) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  __m256 corr = _mm256_setzero_ps();
  alignas(32) float scale[8];
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk[4];
    for (int r = 0; r < 4; ++r) blk[r] = w + r * row_bytes + b * Layout<T>::bytes;
    // lanes 0-3: the rows' d; 4-7: their m (Q4_1 / Q5_1), else zero: the bytes after d are quants,
    // and as f16 they may be denormals, whose float arithmetic takes microcode assists (measured 25x slower)
    constexpr bool has_min = T == kQ4_1 || T == kQ5_1;
    const __m256 dm = _mm256_cvtph_ps(_mm_setr_epi16(
        static_cast<short>(load_u16(blk[0])), static_cast<short>(load_u16(blk[1])), static_cast<short>(load_u16(blk[2])),
        static_cast<short>(load_u16(blk[3])), has_min ? static_cast<short>(load_u16(blk[0] + 2)) : short(0),
        has_min ? static_cast<short>(load_u16(blk[1] + 2)) : short(0),
        has_min ? static_cast<short>(load_u16(blk[2] + 2)) : short(0),
        has_min ? static_cast<short>(load_u16(blk[3] + 2)) : short(0)));
    _mm256_store_ps(scale, _mm256_mul_ps(dm, _mm256_set1_ps(xd[b])));
    if constexpr (T == kQ4_0) corr = _mm256_fmadd_ps(dm, _mm256_set1_ps(-8.f * xs[b]), corr);
    else if constexpr (T == kQ5_0) corr = _mm256_fmadd_ps(dm, _mm256_set1_ps(-16.f * xs[b]), corr);
    else if constexpr (T == kQ4_1 || T == kQ5_1) corr = _mm256_fmadd_ps(dm, _mm256_set1_ps(xs[b]), corr);
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kBlock));
    for (int r = 0; r < 4; ++r) {
      __m256i p;
      if constexpr (T == kQ8_0) {
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk[r] + 2));
        p = dot_u8s8(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
      } else {
        p = dot_u8s8(unpack<T>(blk[r]), xv);
      }
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(scale + r), acc[r]);
    }
  }
  alignas(32) float c[8];
  _mm256_store_ps(c, corr);
  const int offset = (T == kQ4_1 || T == kQ5_1) ? 4 : 0;
  for (int r = 0; r < 4; ++r) out[r] = hsum(acc[r]) + (T == kQ8_0 ? 0.f : c[offset + r]);
}
#else
template <int T>
inline int value(const uint8_t* blk, int j) {
  if constexpr (T == kQ8_0) {
    return static_cast<int8_t>(blk[2 + j]);
  } else {
    const uint8_t byte = blk[Layout<T>::qs + (j & 15)];
    int v = j < 16 ? (byte & 0x0F) : (byte >> 4);
    if constexpr (T == kQ5_0 || T == kQ5_1) {
      uint32_t bits;
      std::memcpy(&bits, blk + Layout<T>::qs - 4, 4);
      v |= ((bits >> j) & 1u) << 4;
    }
    return v;
  }
}

template <int T, int MB>
inline void dot_rows(const uint8_t* w, int64_t nb, const int8_t* xq, const float* xd, const float* xs, int64_t x_stride,
                     float* out) {
  for (int r = 0; r < MB; ++r) {
    float acc = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = w + b * Layout<T>::bytes;
      const float dw = half_to_float(blk);
      int dot = 0;
      for (int j = 0; j < kBlock; ++j) dot += value<T>(blk, j) * xq[r * x_stride * kBlock + b * kBlock + j];
      acc += dw * xd[r * x_stride + b] * static_cast<float>(dot) + offset_coef<T>(blk, dw) * xs[r * x_stride + b];
    }
    out[r] = acc;
  }
}
#endif

template <int T>
void matmul(const uint8_t* w, int64_t N, int64_t K, const int8_t* xq, const float* xd, const float* xs, int64_t M,
            float* y, int threads) {
  const int64_t nb = K / kBlock;
  const int64_t row_bytes = nb * Layout<T>::bytes;
  // Decode: a few dozen rows a thread keep the split even; prefill rows cost M times more.
  const int64_t grain = M >= 4 ? 4 : 32;
  pagoda::parallel_for(0, N, grain, threads, [&](int64_t lo, int64_t hi) {
    float out[4];
    int64_t n = lo;
#if defined(GGUF_AVX2)
    if (M == 1 && T != kQ8_0) {
      for (; n + 4 <= hi; n += 4) {
        dot_4rows<T>(w + n * row_bytes, row_bytes, nb, xq, xd, xs, out);
        for (int r = 0; r < 4; ++r) y[n + r] = out[r];
      }
    }
#endif
    for (; n < hi; ++n) {
      const uint8_t* row = w + n * row_bytes;
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) {
        dot_rows<T, 4>(row, nb, xq + m * K, xd + m * nb, xs + m * nb, nb, out);
        for (int r = 0; r < 4; ++r) y[(m + r) * N + n] = out[r];
      }
      for (; m < M; ++m) {
        dot_rows<T, 1>(row, nb, xq + m * K, xd + m * nb, xs + m * nb, nb, out);
        y[m * N + n] = out[0];
      }
    }
  });
}

}  // namespace pagoda_gguf

PAGODA_EXPORT const char* pagoda_gguf_isa() { return pagoda_gguf::kIsa; }

// y [M, N] (float32) = x [M, K] (float32, contiguous) times W [N, K] in GGML type `type` (row-major
// rows of blocks), transposed. Returns 0, or -1 for a type this library does not handle or K not a
// multiple of the type's block (32 values; 256 for the K-quants).
PAGODA_EXPORT int pagoda_gguf_matmul(int type, const uint8_t* w, int64_t N, int64_t K, const float* x, int64_t M,
                                     float* y, int threads) {
  using namespace pagoda_gguf;
  if (is_kquant(type)) return kquant_matmul(type, w, N, K, x, M, y, threads);
  if (K % kBlock) return -1;
  const int64_t nb = K / kBlock;
  std::vector<int8_t> xq(static_cast<size_t>(M * K));
  std::vector<float> xd(static_cast<size_t>(M * nb)), xs(static_cast<size_t>(M * nb));
  quantize_x(x, M, K, xq.data(), xd.data(), xs.data());
  switch (type) {
    case kQ4_0: matmul<kQ4_0>(w, N, K, xq.data(), xd.data(), xs.data(), M, y, threads); return 0;
    case kQ4_1: matmul<kQ4_1>(w, N, K, xq.data(), xd.data(), xs.data(), M, y, threads); return 0;
    case kQ5_0: matmul<kQ5_0>(w, N, K, xq.data(), xd.data(), xs.data(), M, y, threads); return 0;
    case kQ5_1: matmul<kQ5_1>(w, N, K, xq.data(), xd.data(), xs.data(), M, y, threads); return 0;
    case kQ8_0: matmul<kQ8_0>(w, N, K, xq.data(), xd.data(), xs.data(), M, y, threads); return 0;
    default: return -1;
  }
}

PAGODA_PYTHON_MODULE(PAGODA_FUNCTION(pagoda_gguf_isa), PAGODA_FUNCTION(pagoda_gguf_matmul))
