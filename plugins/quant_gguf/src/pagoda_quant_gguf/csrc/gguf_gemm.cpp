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
// while all of x's rows pass it). Threads split W's rows (pagoda::parallel_for). Q4_0, Q4_1, Q5_0 and
// Q5_1 matrices are repacked at load for a faster kernel with the same results (pagoda_gguf_repack, and
// pagoda_gguf_linear with packed = 1, below).
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

#ifndef GGUF_PREFETCH
#define GGUF_PREFETCH 4096
#endif
// Decode streams each weight byte from memory once. The hardware prefetchers do not cross a 4 KiB page
// and restart on each, so the kernels ask GGUF_PREFETCH bytes ahead of what they read (tuned in
// benchmarks/gguf_gemv.py, weights from memory).
constexpr int64_t kPrefetch = GGUF_PREFETCH;

template <int T> struct Layout;
template <> struct Layout<kQ4_0> { static constexpr int bytes = 18, qs = 2; };
template <> struct Layout<kQ4_1> { static constexpr int bytes = 20, qs = 4; };
template <> struct Layout<kQ5_0> { static constexpr int bytes = 22, qs = 6; };
template <> struct Layout<kQ5_1> { static constexpr int bytes = 24, qs = 8; };
template <> struct Layout<kQ8_0> { static constexpr int bytes = 34, qs = 2; };

// x [M, K] -> int8 per 32-block (round to nearest), its scale d and d * sum(q). The AVX2 form computes
// exactly the scalar one's values (the same float product rounded to nearest even, the same integer sum):
// the scalar loop's nearbyint calls were ~2 ns a value, 3 us of a 1536-column GEMV.
void quantize_x(const float* x, int64_t M, int64_t K, int8_t* q, float* d, float* s) {
  const int64_t nb = K / kBlock;
  for (int64_t i = 0; i < M * nb; ++i) {
    const float* xb = x + i * kBlock;
#if defined(GGUF_AVX2)
    __m256 v[4];
    for (int j = 0; j < 4; ++j) v[j] = _mm256_loadu_ps(xb + 8 * j);
    const __m256 sign = _mm256_set1_ps(-0.f);
    const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                   _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    __m256i qi[4];
    for (int j = 0; j < 4; ++j)
      qi[j] = _mm256_cvtps_epi32(
          _mm256_round_ps(_mm256_mul_ps(v[j], _mm256_set1_ps(inv)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256i sum8 = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
    __m128i sum4 = _mm_add_epi32(_mm256_castsi256_si128(sum8), _mm256_extracti128_si256(sum8, 1));
    sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0x4E));
    sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0xB1));
    const int sum = _mm_cvtsi128_si32(sum4);
    // packs interleave the 128-bit lanes: dwords come out as rows 0, 4, 1, 5, ... of 4 values each
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i * kBlock),
                        _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
    float amax = 0.f;
    for (int j = 0; j < kBlock; ++j) amax = std::fmax(amax, std::fabs(xb[j]));
    const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    int sum = 0;
    for (int j = 0; j < kBlock; ++j) {
      const int v = static_cast<int>(std::nearbyint(xb[j] * inv));
      q[i * kBlock + j] = static_cast<int8_t>(v);
      sum += v;
    }
#endif
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

// Value j (0..31) of a block as its integer (Q8_0: signed; the 4- and 5-bit types: unsigned, before
// their offset): the scalar kernel's reader and the dequantizer's (pagoda_gguf_dequantize).
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

#if defined(GGUF_AVX2)
// 32 bits -> 32 bytes of 0xFF / 0x00 (llama.cpp's bytes_from_bits_32).
inline __m256i bytes_from_bits(uint32_t bits) {
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000);
  __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), shuf);
  bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

// v (bytes 0..15) with 16 added where `bits` has a bit: a Q5 block's fifth bits. One masked add with
// AVX-512 BW + VL (the repacked Q5 GEMV went from 0.59 to 0.71 of a plain read, 1 thread, weights from
// memory, load ~8); four instructions and an and/or on AVX2.
inline __m256i add_fifth_bits(__m256i v, uint32_t bits) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return _mm256_mask_add_epi8(v, static_cast<__mmask32>(bits), v, _mm256_set1_epi8(0x10));
#else
  return _mm256_or_si256(v, _mm256_and_si256(bytes_from_bits(bits), _mm256_set1_epi8(0x10)));
#endif
}

// A block's 32 values as unsigned bytes, in ggml's order (low nibbles are values 0..15).
template <int T>
inline __m256i unpack(const uint8_t* blk) {
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + Layout<T>::qs));
  __m256i v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0F));
  if constexpr (T == kQ5_0 || T == kQ5_1) v = add_fifth_bits(v, load_u32(blk + Layout<T>::qs - 4));
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
    // the next rows follow this one: a line a block (every type's block is under 64 bytes)
    if constexpr (MB == 1) _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetch), _MM_HINT_T0);
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
    for (int r = 0; r < 4; ++r) {
      blk[r] = w + r * row_bytes + b * Layout<T>::bytes;
      _mm_prefetch(reinterpret_cast<const char*>(blk[r] + kPrefetch), _MM_HINT_T0);
    }
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

// y[m * ldy + n] for the N rows of w.
template <int T>
void matmul(const uint8_t* w, int64_t N, int64_t K, const int8_t* xq, const float* xd, const float* xs, int64_t M,
            float* y, int64_t ldy, int threads) {
  const int64_t nb = K / kBlock;
  const int64_t row_bytes = nb * Layout<T>::bytes;
  // Decode: a few dozen rows a thread keep the split even; prefill rows cost M times more.
  const int64_t grain = M >= 4 ? 4 : 32;
  pagoda::parallel_for(0, N, grain, threads, [&](int64_t lo, int64_t hi) {
    float out[4];
    int64_t n = lo;
#if defined(GGUF_AVX2)
    if (M == 1 && T != kQ8_0 && ldy == N) {
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
        for (int r = 0; r < 4; ++r) y[(m + r) * ldy + n] = out[r];
      }
      for (; m < M; ++m) {
        dot_rows<T, 1>(row, nb, xq + m * K, xd + m * nb, xs + m * nb, nb, out);
        y[m * ldy + n] = out[0];
      }
    }
  });
}


// -- Repacked layout ------------------------------------------------------------------------------------
// Q4_0, Q4_1, Q5_0 and Q5_1 matrices are repacked once after loading (``pagoda_gguf_repack``): every
// group of 4 rows becomes, for its blocks b = 0 .. K/32-1, first all the blocks' scales -- d of the 4
// rows (f16 x 4), then Q4_1's / Q5_1's m x 4 -- and after them all the blocks' quants: for Q5_0 / Q5_1
// the 4 rows' 32 fifth bits (4 bytes each), then for every type the 4 rows' 16 bytes of nibbles of
// block b side by side. A group holds exactly its 4 rows' bytes; rows past the last whole group stay
// as they were. One block of 4 rows is then one vcvtph2ps for the scales and 2 32-byte loads, and its
// dot products take each x half-block (16 values, broadcast to both 128-bit lanes) against 2 rows at
// once: 1.2-1.7x the stored layout's decode GEMV on SmolLM2's Q4_1 shapes (1 thread, weights from
// memory; docs/benchmarks.md). Q8_0 was repacked the same way (4 rows x 32 bytes a block) and measured
// 0.8-0.9x at one thread: its GEMV streams at memory speed already, so it stays as stored.
constexpr int kGroup = 4;

template <int T> struct Packed;
// per block of 4 rows: scale bytes, fifth-bit bytes (in the quants region), quant bytes in all
template <> struct Packed<kQ4_0> { static constexpr int scales = 8, high = 0, quants = 64; };
template <> struct Packed<kQ4_1> { static constexpr int scales = 16, high = 0, quants = 64; };
template <> struct Packed<kQ5_0> { static constexpr int scales = 8, high = 16, quants = 80; };
template <> struct Packed<kQ5_1> { static constexpr int scales = 16, high = 16, quants = 80; };
template <int T> constexpr bool kHasMin = T == kQ4_1 || T == kQ5_1;

inline bool packs(int type) { return type == kQ4_0 || type == kQ4_1 || type == kQ5_0 || type == kQ5_1; }

template <int T>
void repack(const uint8_t* src, int64_t N, int64_t K, uint8_t* dst) {
  const int64_t nb = K / kBlock, row_bytes = nb * Layout<T>::bytes;
  constexpr int qbytes = 16, hi = Packed<T>::high;
  for (int64_t g = 0; g < N / kGroup; ++g) {
    uint8_t* scales = dst + g * kGroup * row_bytes;
    uint8_t* quants = scales + nb * Packed<T>::scales;
    for (int64_t b = 0; b < nb; ++b) {
      for (int r = 0; r < kGroup; ++r) {
        const uint8_t* blk = src + (g * kGroup + r) * row_bytes + b * Layout<T>::bytes;
        std::memcpy(scales + b * Packed<T>::scales + 2 * r, blk, 2);
        if constexpr (kHasMin<T>) std::memcpy(scales + b * Packed<T>::scales + 8 + 2 * r, blk + 2, 2);
        if constexpr (hi > 0) std::memcpy(quants + b * Packed<T>::quants + 4 * r, blk + Layout<T>::qs - 4, 4);
        std::memcpy(quants + b * Packed<T>::quants + hi + r * qbytes, blk + Layout<T>::qs, qbytes);
      }
    }
  }
  const int64_t done = N / kGroup * kGroup;
  std::memcpy(dst + done * row_bytes, src + done * row_bytes, static_cast<size_t>((N - done) * row_bytes));
}

// Row n of a repacked matrix back in the stored layout (embedding lookups on a tied head's table).
template <int T>
void unpack_row(const uint8_t* w, int64_t N, int64_t K, int64_t n, uint8_t* dst) {
  const int64_t nb = K / kBlock, row_bytes = nb * Layout<T>::bytes;
  if (n >= N / kGroup * kGroup) {
    std::memcpy(dst, w + n * row_bytes, static_cast<size_t>(row_bytes));
    return;
  }
  constexpr int qbytes = 16, hi = Packed<T>::high;
  const int64_t r = n % kGroup;
  const uint8_t* scales = w + (n / kGroup) * kGroup * row_bytes;
  const uint8_t* quants = scales + nb * Packed<T>::scales;
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* blk = dst + b * Layout<T>::bytes;
    std::memcpy(blk, scales + b * Packed<T>::scales + 2 * r, 2);
    if constexpr (kHasMin<T>) std::memcpy(blk + 2, scales + b * Packed<T>::scales + 8 + 2 * r, 2);
    if constexpr (hi > 0) std::memcpy(blk + Layout<T>::qs - 4, quants + b * Packed<T>::quants + 4 * r, 4);
    std::memcpy(blk + Layout<T>::qs, quants + b * Packed<T>::quants + hi + r * qbytes, qbytes);
  }
}

// One row (nb blocks, stored layout) as float32 values: what ``dequant.dequantize_blocks`` computes
// (value - offset) * d, or value * d + m. Loops of 16 with no branch on j, so the compiler vectorizes them.
template <int T>
void dequantize_row(const uint8_t* row, int64_t nb, float* dst) {
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * Layout<T>::bytes;
    float* out = dst + b * kBlock;
    const float d = half_to_float(blk);
    if constexpr (T == kQ8_0) {
      for (int j = 0; j < kBlock; ++j) out[j] = static_cast<float>(static_cast<int8_t>(blk[2 + j])) * d;
    } else {
      const uint8_t* qs = blk + Layout<T>::qs;
      uint32_t bits = 0;
      if constexpr (T == kQ5_0 || T == kQ5_1) std::memcpy(&bits, blk + Layout<T>::qs - 4, 4);
      constexpr int offset = T == kQ4_0 ? 8 : T == kQ5_0 ? 16 : 0;
      const float m = kHasMin<T> ? half_to_float(blk + 2) : 0.f;
      for (int j = 0; j < 16; ++j) {
        int lo = qs[j] & 0x0F, hi = qs[j] >> 4;
        if constexpr (T == kQ5_0 || T == kQ5_1) {
          lo |= static_cast<int>((bits >> j) & 1u) << 4;
          hi |= static_cast<int>((bits >> (j + 16)) & 1u) << 4;
        }
        out[j] = static_cast<float>(lo - offset) * d + m;
        out[j + 16] = static_cast<float>(hi - offset) * d + m;
      }
    }
  }
}

// Rows [row0, row0 + rows) of W (stored, or repacked when `packed`) into dst [rows, K] float32; threads
// split the rows. A repacked row is first rewritten in the stored layout (unpack_row: a row's bytes, in L1).
template <int T>
void dequantize(const uint8_t* w, bool packed, int64_t N, int64_t K, int64_t row0, int64_t rows, float* dst,
                int threads) {
  const int64_t nb = K / kBlock, row_bytes = nb * Layout<T>::bytes;
  pagoda::parallel_for(0, rows, 4, threads, [&](int64_t lo, int64_t hi) {
    std::vector<uint8_t> stored(packed ? static_cast<size_t>(row_bytes) : 0);
    for (int64_t i = lo; i < hi; ++i) {
      const uint8_t* row = w + (row0 + i) * row_bytes;
      if (packed) {
        if constexpr (T != kQ8_0) unpack_row<T>(w, N, K, row0 + i, stored.data());
        row = stored.data();
      }
      dequantize_row<T>(row, nb, dst + i * K);
    }
  });
}

#if defined(GGUF_AVX2)
// out[m * 4 + r] = group row r . x row m, for MB rows of x (x_stride blocks apart).
//
// Bit for bit the stored layout's result (dot_4rows, dot_rows): every float lane adds the same integer
// sums in the same order, so repacking changes no output. The 4-bit types keep a row's first and last
// 16 values in separate accumulators (lanes 0-3 and 4-7 of the stored kernel's one), which the end
// joins before the same horizontal sum. (Summing the two halves'
// integers first saves 2 conversions and 2 FMAs a block and measured ~1.1x faster, but it rounds
// differently, which flipped a near-tie greedy token of the SmolLM2 agreement test.)
template <int T, int MB>
inline void packed_dot(const uint8_t* g, int64_t nb, const int8_t* xq, const float* xd, const float* xs,
                       int64_t x_stride, float* out) {
  const uint8_t* quants = g + nb * Packed<T>::scales;
  // [pair of rows][first / last 16 values]
  constexpr int kAcc = 4;
  __m256 acc[MB][kAcc], corr[MB];
  for (int m = 0; m < MB; ++m) {
    for (int a = 0; a < kAcc; ++a) acc[m][a] = _mm256_setzero_ps();
    corr[m] = _mm256_setzero_ps();
  }
  const __m256i rows01 = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), rows23 = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
  for (int64_t b = 0; b < nb; ++b) {
    // lanes 0-3: the 4 rows' d; 4-7: Q4_1's m, else zero
    const __m256 dm = kHasMin<T>
        ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g + b * 16)))
        : _mm256_castps128_ps256(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(g + b * 8))));
    const uint8_t* q = quants + b * Packed<T>::quants;
    // a group's bytes (scales, then quants) and the next group's follow on: a block's worth of them
    // (72 / 80 bytes, so two lines) kPrefetch ahead
    const uint8_t* ahead = g + b * (Packed<T>::scales + Packed<T>::quants) + kPrefetch;
    _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(ahead + Packed<T>::scales + Packed<T>::quants - 1), _MM_HINT_T0);
    // rows 0 and 1 in one vector (a 128-bit lane each), rows 2 and 3 in the other
    const __m256i v01 = loadu256(q + Packed<T>::high), v23 = loadu256(q + Packed<T>::high + 32);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256i lo01 = _mm256_and_si256(v01, m4), hi01 = _mm256_and_si256(_mm256_srli_epi16(v01, 4), m4);
    __m256i lo23 = _mm256_and_si256(v23, m4), hi23 = _mm256_and_si256(_mm256_srli_epi16(v23, 4), m4);
    if constexpr (Packed<T>::high > 0) {
      // the fifth bits: values 0-15 of rows 0 and 1 are bits 0-15 of their words, values 16-31 bits 16-31
      const uint32_t h0 = load_u32(q), h1 = load_u32(q + 4), h2 = load_u32(q + 8), h3 = load_u32(q + 12);
      lo01 = add_fifth_bits(lo01, (h0 & 0xFFFFu) | (h1 << 16));
      hi01 = add_fifth_bits(hi01, (h0 >> 16) | (h1 & 0xFFFF0000u));
      lo23 = add_fifth_bits(lo23, (h2 & 0xFFFFu) | (h3 << 16));
      hi23 = add_fifth_bits(hi23, (h2 >> 16) | (h3 & 0xFFFF0000u));
    }
    for (int m = 0; m < MB; ++m) {
      const int8_t* x = xq + (m * x_stride + b) * kBlock;
      const __m256i xlo = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
      const __m256i xhi = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 16)));
      const __m256 s = _mm256_mul_ps(dm, _mm256_set1_ps(xd[m * x_stride + b]));
      const __m256 s01 = _mm256_permutevar8x32_ps(s, rows01), s23 = _mm256_permutevar8x32_ps(s, rows23);
      acc[m][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(lo01, xlo)), s01, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(hi01, xhi)), s01, acc[m][1]);
      acc[m][2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(lo23, xlo)), s23, acc[m][2]);
      acc[m][3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(hi23, xhi)), s23, acc[m][3]);
      // Q4_0's -8 / Q5_0's -16 offset (lanes 0-3: d), Q4_1's / Q5_1's minimum (lanes 4-7: m) times d_x * sum(q_x)
      const float xsum = xs[m * x_stride + b];
      corr[m] = _mm256_fmadd_ps(dm, _mm256_set1_ps(T == kQ4_0 ? -8.f * xsum : T == kQ5_0 ? -16.f * xsum : xsum),
                                corr[m]);
    }
  }
  for (int m = 0; m < MB; ++m) {
    alignas(32) float c[8];
    _mm256_store_ps(c, corr[m]);
    const int offset = kHasMin<T> ? 4 : 0;
    for (int r = 0; r < kGroup; ++r) {
      const __m256 first = acc[m][2 * (r / 2)], last = acc[m][2 * (r / 2) + 1];
      const __m256 row = r % 2 ? _mm256_permute2f128_ps(first, last, 0x31) : _mm256_permute2f128_ps(first, last, 0x20);
      out[m * kGroup + r] = hsum(row) + c[offset + r];
    }
  }
}

template <int T>
void packed_matmul(const uint8_t* w, int64_t N, int64_t K, const int8_t* xq, const float* xd, const float* xs,
                   int64_t M, float* y, int threads) {
  const int64_t nb = K / kBlock, row_bytes = nb * Layout<T>::bytes, groups = N / kGroup;
  // Decode: 8 groups (32 rows) at least a thread; prefill groups cost M times more.
  pagoda::parallel_for(0, groups, M >= 4 ? 1 : 8, threads, [&](int64_t lo, int64_t hi) {
    float out[4 * kGroup];
    for (int64_t g = lo; g < hi; ++g) {
      const uint8_t* grp = w + g * kGroup * row_bytes;
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) {
        packed_dot<T, 4>(grp, nb, xq + m * K, xd + m * nb, xs + m * nb, nb, out);
        for (int i = 0; i < 4; ++i)
          for (int r = 0; r < kGroup; ++r) y[(m + i) * N + g * kGroup + r] = out[i * kGroup + r];
      }
      for (; m < M; ++m) {
        packed_dot<T, 1>(grp, nb, xq + m * K, xd + m * nb, xs + m * nb, nb, out);
        for (int r = 0; r < kGroup; ++r) y[m * N + g * kGroup + r] = out[r];
      }
    }
  });
  if (N > groups * kGroup)  // the rows past the last group, as stored
    matmul<T>(w + groups * kGroup * row_bytes, N - groups * kGroup, K, xq, xd, xs, M, y + groups * kGroup, N, 1);
}
#endif

}  // namespace pagoda_gguf

PAGODA_EXPORT const char* pagoda_gguf_isa() { return pagoda_gguf::kIsa; }

// 1 where this build has a repacked kernel for the type (pagoda_gguf_repack rewrites it), else 0.
PAGODA_EXPORT int pagoda_gguf_repacks(int type) {
#if defined(GGUF_AVX2)
  return pagoda_gguf::packs(type) ? 1 : 0;
#else
  (void)type;
  return 0;
#endif
}

// Rewrites W [N, K] (GGML type `type`, as stored) into `dst` (as many bytes) in the repacked layout
// above. Returns 0, or -1 where this build has no repacked kernel for the type (the caller keeps the
// stored layout and calls pagoda_gguf_matmul).
PAGODA_EXPORT int pagoda_gguf_repack(int type, const uint8_t* w, int64_t N, int64_t K, uint8_t* dst) {
  using namespace pagoda_gguf;
#if defined(GGUF_AVX2)
  if (K % kBlock || !packs(type)) return -1;
  switch (type) {
    case kQ4_0: repack<kQ4_0>(w, N, K, dst); return 0;
    case kQ4_1: repack<kQ4_1>(w, N, K, dst); return 0;
    case kQ5_0: repack<kQ5_0>(w, N, K, dst); return 0;
    case kQ5_1: repack<kQ5_1>(w, N, K, dst); return 0;
    default: return -1;
  }
#else
  (void)type, (void)w, (void)N, (void)K, (void)dst;
  return -1;
#endif
}

// Rows `ids` (count of them) of a matrix pagoda_gguf_repack rewrote, in the stored layout, into
// dst [count, bytes per row]. Returns 0; -1 for a type without a repacked layout; -2 when an id is
// outside [0, N) (checked here, so the caller reads no token id on the host).
PAGODA_EXPORT int pagoda_gguf_unpack_rows(int type, const uint8_t* w, int64_t N, int64_t K, const int64_t* ids,
                                          int64_t count, uint8_t* dst) {
  using namespace pagoda_gguf;
  if (K % kBlock || !packs(type)) return -1;
  for (int64_t i = 0; i < count; ++i)
    if (ids[i] < 0 || ids[i] >= N) return -2;
  for (int64_t i = 0; i < count; ++i) {
    switch (type) {
      case kQ4_0: unpack_row<kQ4_0>(w, N, K, ids[i], dst + i * (K / kBlock) * Layout<kQ4_0>::bytes); break;
      case kQ4_1: unpack_row<kQ4_1>(w, N, K, ids[i], dst + i * (K / kBlock) * Layout<kQ4_1>::bytes); break;
      case kQ5_0: unpack_row<kQ5_0>(w, N, K, ids[i], dst + i * (K / kBlock) * Layout<kQ5_0>::bytes); break;
      default: unpack_row<kQ5_1>(w, N, K, ids[i], dst + i * (K / kBlock) * Layout<kQ5_1>::bytes); break;
    }
  }
  return 0;
}

// Rows [row0, row0 + rows) of W [N, K] (GGML type `type`; repacked by pagoda_gguf_repack when `packed`)
// dequantized into dst [rows, K] float32: the batched path's weight panels (config.DenseForward). Returns 0;
// -1 for a type this function does not handle (the K-quants: the caller dequantizes them in torch) or K
// not whole blocks; -2 for rows outside [0, N).
PAGODA_EXPORT int pagoda_gguf_dequantize(int type, int packed, const uint8_t* w, int64_t N, int64_t K, int64_t row0,
                                         int64_t rows, float* dst, int threads) {
  using namespace pagoda_gguf;
  if (K % kBlock || (packed && !packs(type))) return -1;
  if (row0 < 0 || rows < 0 || row0 + rows > N) return -2;
  switch (type) {
    case kQ4_0: dequantize<kQ4_0>(w, packed, N, K, row0, rows, dst, threads); return 0;
    case kQ4_1: dequantize<kQ4_1>(w, packed, N, K, row0, rows, dst, threads); return 0;
    case kQ5_0: dequantize<kQ5_0>(w, packed, N, K, row0, rows, dst, threads); return 0;
    case kQ5_1: dequantize<kQ5_1>(w, packed, N, K, row0, rows, dst, threads); return 0;
    case kQ8_0: dequantize<kQ8_0>(w, false, N, K, row0, rows, dst, threads); return 0;
    default: return -1;
  }
}

namespace pagoda_gguf {

enum : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

template <typename T>
void widen(const T* src, int64_t count, float* dst) {
  for (int64_t i = 0; i < count; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename T>
void narrow(const float* src, int64_t count, T* dst) {
  for (int64_t i = 0; i < count; ++i) dst[i] = T(src[i]);
}

// The call's scratch, kept per thread between calls (decode makes hundreds of calls a step, each of which
// allocated these). A kernel graph's replay runs the calls on one thread, in order, as the capture did.
struct Scratch {
  std::vector<float> x, y, xd, xs;
  std::vector<int8_t> xq;
};

int linear(int type, int packed, const uint8_t* w, int64_t N, int64_t K, const void* x, int x_dtype, int64_t M,
           void* y, int y_dtype, int threads) {
  if (x_dtype < kFloat32 || x_dtype > kFloat16 || y_dtype < kFloat32 || y_dtype > kFloat16) return -2;
  if (packed && (K % kBlock || !packs(type))) return -1;
#if !defined(GGUF_AVX2)
  if (packed) return -1;
#endif
  if (!is_kquant(type) && (K % kBlock || !(type == kQ4_0 || type == kQ4_1 || type == kQ5_0 || type == kQ5_1 ||
                                           type == kQ8_0)))
    return -1;
  thread_local Scratch scratch;
  // x and y in float32: the tensors themselves, or the scratch (16-bit values convert exactly to float32;
  // y rounds to nearest even, as torch's .to() did on the float32 result)
  const float* xf = static_cast<const float*>(x);
  if (x_dtype != kFloat32) {
    scratch.x.resize(static_cast<size_t>(M * K));
    if (x_dtype == kBFloat16) widen(static_cast<const pagoda::bf16*>(x), M * K, scratch.x.data());
    else widen(static_cast<const pagoda::half*>(x), M * K, scratch.x.data());
    xf = scratch.x.data();
  }
  float* yf = static_cast<float*>(y);
  if (y_dtype != kFloat32) {
    scratch.y.resize(static_cast<size_t>(M * N));
    yf = scratch.y.data();
  }
  int status = 0;
  if (is_kquant(type)) {
    status = kquant_matmul(type, w, N, K, xf, M, yf, threads);
  } else {
    const int64_t nb = K / kBlock;
    scratch.xq.resize(static_cast<size_t>(M * K));
    scratch.xd.resize(static_cast<size_t>(M * nb));
    scratch.xs.resize(static_cast<size_t>(M * nb));
    int8_t* xq = scratch.xq.data();
    float *xd = scratch.xd.data(), *xs = scratch.xs.data();
    quantize_x(xf, M, K, xq, xd, xs);
#if defined(GGUF_AVX2)
    if (packed) {
      switch (type) {
        case kQ4_0: packed_matmul<kQ4_0>(w, N, K, xq, xd, xs, M, yf, threads); break;
        case kQ4_1: packed_matmul<kQ4_1>(w, N, K, xq, xd, xs, M, yf, threads); break;
        case kQ5_0: packed_matmul<kQ5_0>(w, N, K, xq, xd, xs, M, yf, threads); break;
        default: packed_matmul<kQ5_1>(w, N, K, xq, xd, xs, M, yf, threads); break;
      }
    } else
#endif
    {
      switch (type) {
        case kQ4_0: matmul<kQ4_0>(w, N, K, xq, xd, xs, M, yf, N, threads); break;
        case kQ4_1: matmul<kQ4_1>(w, N, K, xq, xd, xs, M, yf, N, threads); break;
        case kQ5_0: matmul<kQ5_0>(w, N, K, xq, xd, xs, M, yf, N, threads); break;
        case kQ5_1: matmul<kQ5_1>(w, N, K, xq, xd, xs, M, yf, N, threads); break;
        default: matmul<kQ8_0>(w, N, K, xq, xd, xs, M, yf, N, threads); break;
      }
    }
  }
  if (status == 0 && y_dtype == kBFloat16) narrow(yf, M * N, static_cast<pagoda::bf16*>(y));
  if (status == 0 && y_dtype == kFloat16) narrow(yf, M * N, static_cast<pagoda::half*>(y));
  return status;
}

}  // namespace pagoda_gguf

// y [M, N] = x [M, K] (contiguous) times W [N, K] in GGML type `type`, transposed. W is row-major rows of
// blocks as stored (`packed` 0) or a matrix pagoda_gguf_repack rewrote (`packed` 1). x and y are float32,
// bfloat16 or float16 (dtype 0, 1, 2; y may differ from x): a layer's activations go in and out in the
// model's dtype without torch conversions around the call. Returns 0; -1 for a type (or a packed type)
// this build does not handle or K not a multiple of the type's block (32 values; 256 for the K-quants);
// -2 for another dtype code.
PAGODA_EXPORT int pagoda_gguf_linear(int type, int packed, const uint8_t* w, int64_t N, int64_t K, const void* x,
                                     int x_dtype, int64_t M, void* y, int y_dtype, int threads) {
  return pagoda_gguf::linear(type, packed, w, N, K, x, x_dtype, M, y, y_dtype, threads);
}

PAGODA_PYTHON_MODULE(PAGODA_FUNCTION(pagoda_gguf_isa), PAGODA_FUNCTION(pagoda_gguf_linear),
                     PAGODA_FUNCTION(pagoda_gguf_repacks), PAGODA_FUNCTION(pagoda_gguf_repack),
                     PAGODA_FUNCTION(pagoda_gguf_unpack_rows), PAGODA_FUNCTION(pagoda_gguf_dequantize))
