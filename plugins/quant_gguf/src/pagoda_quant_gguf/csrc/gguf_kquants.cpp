// y[M, N] = x[M, K] W[N, K]^T with W in GGUF K-quant super-blocks (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K):
// 256 values a super-block, in 16 sub-blocks of 16 values (Q2_K, Q3_K, Q6_K) or 8 of 32 (Q4_K, Q5_K),
// each with an integer scale (and, for Q2_K / Q4_K / Q5_K, an integer minimum) under the super-block's
// f16 scale(s).
//
// Every type is written in one form: w = d * s[j] * u - d_off * o[j] for value u (an unsigned integer,
// 2 to 6 bits) of 16-value sub-block j, where s[j] and o[j] are small integers:
//   Q4_K, Q5_K, Q2_K: s = the sub-scale, o = the sub-minimum, d_off = dmin;
//   Q6_K: u = q + 32, o = s, d_off = 32 d;  Q3_K: u = q + 4, o = s, d_off = 4 d.
// x is quantized per super-block to int8 (one scale d_x) with the sums of its 16-value sub-blocks
// (b[j], int16), as llama.cpp's Q8_K does, so a super-block's dot product is
//   d_x * (d * sum_j s[j] * dot(u_j, x_j) - d_off * sum_j o[j] * b[j]),
// all integer inside: u8 x s8 pairs (vpmaddubsw) times the sub-scales as int16 (vpdpwssd with AVX-512
// VNNI, else vpmaddwd + vpaddd), converted to float once a super-block. The weights' bits are unpacked
// in registers, 32 values at a time.
//
// Decode (M = 1) takes 4 weight rows at a time against the one x row (4 independent accumulator
// chains, x's loads shared); prefill unpacks each weight super-block once for up to 4 rows of x.
// Threads split W's rows. Paths as in gguf_gemm.cpp: AVX-512 VNNI, AVX2, portable scalar.

#include <pagoda/parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "gguf_common.h"

namespace pagoda_gguf {

enum : int { kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };
constexpr int kQK = 256;

template <int T> struct KLayout;
template <> struct KLayout<kQ2_K> { static constexpr int bytes = 84; };
template <> struct KLayout<kQ3_K> { static constexpr int bytes = 110; };
template <> struct KLayout<kQ4_K> { static constexpr int bytes = 144; };
template <> struct KLayout<kQ5_K> { static constexpr int bytes = 176; };
template <> struct KLayout<kQ6_K> { static constexpr int bytes = 210; };

bool is_kquant(int type) { return type >= kQ2_K && type <= kQ6_K; }

// x [M, K] -> int8 per 256 values (round to nearest), its scale d, and its 16-value sums.
void quantize_x_k(const float* x, int64_t M, int64_t K, int8_t* q, float* d, int16_t* bsums) {
  for (int64_t i = 0; i < M * K / kQK; ++i) {
    const float* xb = x + i * kQK;
    float amax = 0.f;
    for (int j = 0; j < kQK; ++j) amax = std::fmax(amax, std::fabs(xb[j]));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    d[i] = amax / 127.f;
    for (int s = 0; s < 16; ++s) {
      int sum = 0;
      for (int j = 16 * s; j < 16 * s + 16; ++j) {
        const int v = static_cast<int>(std::nearbyint(xb[j] * inv));
        q[i * kQK + j] = static_cast<int8_t>(v);
        sum += v;
      }
      bsums[i * 16 + s] = static_cast<int16_t>(sum);
    }
  }
}

// The f16 scales: d and d_off of the form above.
template <int T>
inline void super_scales(const uint8_t* b, float& d, float& d_off) {
  if constexpr (T == kQ4_K || T == kQ5_K) d = half_to_float(b), d_off = half_to_float(b + 2);
  else if constexpr (T == kQ2_K) d = half_to_float(b + 80), d_off = half_to_float(b + 82);
  else if constexpr (T == kQ3_K) d = half_to_float(b + 108), d_off = 4.f * d;
  else d = half_to_float(b + 208), d_off = 32.f * d;
}

// Q4_K / Q5_K: 12 bytes hold 8 6-bit scales and 8 6-bit minimums (ggml's get_scale_min_k4), four per
// 32-bit word: sc[0..3], sc[4..7], m[0..3], m[4..7].
inline void k4_scale_words(const uint8_t* p, uint32_t out[4]) {
  const uint32_t a0 = load_u32(p), a1 = load_u32(p + 4), a2 = load_u32(p + 8);
  out[0] = a0 & 0x3f3f3f3fu;
  out[1] = (a2 & 0x0f0f0f0fu) | ((a0 >> 2) & 0x30303030u);
  out[2] = a1 & 0x3f3f3f3fu;
  out[3] = ((a2 >> 4) & 0x0f0f0f0fu) | ((a1 >> 2) & 0x30303030u);
}

// Q3_K: 12 bytes hold 16 6-bit scales (low 4 bits in bytes 0-7, high 2 in bytes 8-11), biased by 32;
// four per word, still biased.
inline void k3_scale_words(const uint8_t* p, uint32_t out[4]) {
  const uint32_t a0 = load_u32(p), a1 = load_u32(p + 4), a2 = load_u32(p + 8);
  out[0] = (a0 & 0x0f0f0f0fu) | ((a2 & 0x03030303u) << 4);
  out[1] = (a1 & 0x0f0f0f0fu) | (((a2 >> 2) & 0x03030303u) << 4);
  out[2] = ((a0 >> 4) & 0x0f0f0f0fu) | (((a2 >> 4) & 0x03030303u) << 4);
  out[3] = ((a1 >> 4) & 0x0f0f0f0fu) | (((a2 >> 6) & 0x03030303u) << 4);
}

#if defined(GGUF_AVX2)

// Bits From.. of every byte moved to To.. (16-bit shifts: the bits moved stay inside their byte as
// long as From and To leave room for the field, which the callers' masks then isolate).
template <int From, int To>
inline __m256i move_bits(__m256i v) {
  if constexpr (From > To) return _mm256_srli_epi16(v, From - To);
  else if constexpr (From < To) return _mm256_slli_epi16(v, To - From);
  else return v;
}

// Values 32C .. 32C+31 of a super-block as unsigned bytes u (ggml's bit layouts, ggml-common.h).
template <int T, int C>
inline __m256i chunk(const uint8_t* b) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  if constexpr (T == kQ4_K || T == kQ5_K) {
    // 32 bytes of qs hold values 64j .. 64j+31 (low nibbles) and 64j+32 .. 64j+63 (high nibbles)
    constexpr int qs = T == kQ4_K ? 16 : 48;
    const __m256i v = loadu256(b + qs + 32 * (C / 2));
    __m256i u = _mm256_and_si256(C % 2 ? _mm256_srli_epi16(v, 4) : v, m4);
    if constexpr (T == kQ5_K) {  // qh byte l, bit C: the fifth bit of value 32C + l
      u = _mm256_or_si256(u, _mm256_and_si256(move_bits<C, 4>(loadu256(b + 16)), _mm256_set1_epi8(0x10)));
    }
    return u;
  } else if constexpr (T == kQ6_K) {
    // per 128 values (h): ql bytes 64h.. hold 4 low bits, qh bytes 32h.. the 2 high bits of 4 values
    constexpr int h = C / 4, s = C % 4;
    const __m256i lo = loadu256(b + 64 * h + 32 * (s % 2));
    const __m256i low = _mm256_and_si256(s < 2 ? lo : _mm256_srli_epi16(lo, 4), m4);
    const __m256i high = _mm256_and_si256(move_bits<2 * s, 4>(loadu256(b + 128 + 32 * h)), _mm256_set1_epi8(0x30));
    return _mm256_or_si256(low, high);
  } else {
    // Q2_K / Q3_K: per 128 values (h) 32 bytes of qs, 2 bits of 4 values each
    constexpr int h = C / 4, s = C % 4, qs = T == kQ2_K ? 16 : 32;
    const __m256i u = _mm256_and_si256(move_bits<2 * s, 0>(loadu256(b + qs + 32 * h)), _mm256_set1_epi8(3));
    if constexpr (T == kQ2_K) return u;
    // Q3_K: hmask byte l, bit C: the third bit (set: +4 over the stored value's -4 bias)
    return _mm256_or_si256(u, _mm256_and_si256(move_bits<C, 2>(loadu256(b)), _mm256_set1_epi8(4)));
  }
}

// A row's sub-block integers for one super-block, as int16 x 16 (lane j: 16-value sub-block j).
struct KInts {
  __m256i s, o;
};

template <int T>
inline KInts sub_ints(const uint8_t* b) {
  if constexpr (T == kQ4_K || T == kQ5_K) {
    uint32_t w[4];
    k4_scale_words(b + 4, w);
    const __m128i sc = _mm_setr_epi32(static_cast<int>(w[0]), static_cast<int>(w[1]), 0, 0);
    const __m128i mn = _mm_setr_epi32(static_cast<int>(w[2]), static_cast<int>(w[3]), 0, 0);
    // each 32-value sub-block's integer serves both of its 16-value halves
    return {_mm256_cvtepu8_epi16(_mm_unpacklo_epi8(sc, sc)), _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mn, mn))};
  } else if constexpr (T == kQ2_K) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
    const __m128i m4 = _mm_set1_epi8(0x0F);
    return {_mm256_cvtepu8_epi16(_mm_and_si128(v, m4)), _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), m4))};
  } else if constexpr (T == kQ3_K) {
    uint32_t w[4];
    k3_scale_words(b + 96, w);
    const __m128i v = _mm_sub_epi8(_mm_setr_epi32(static_cast<int>(w[0]), static_cast<int>(w[1]), static_cast<int>(w[2]),
                                                  static_cast<int>(w[3])),
                                   _mm_set1_epi8(32));
    const __m256i s = _mm256_cvtepi8_epi16(v);
    return {s, s};
  } else {
    const __m256i s = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
    return {s, s};
  }
}

// Chunk C's sub-scales: lanes 0-7 (its first 16 values' pairs) s[2C], lanes 8-15 s[2C + 1].
template <int C>
inline __m256i chunk_scales(__m256i lo, __m256i hi) {
  constexpr int j = (2 * C) % 8;
  const __m256i pick = _mm256_setr_epi8(2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j,
                                        2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j + 2,
                                        2 * j + 3, 2 * j + 2, 2 * j + 3, 2 * j + 2, 2 * j + 3, 2 * j + 2, 2 * j + 3,
                                        2 * j + 2, 2 * j + 3, 2 * j + 2, 2 * j + 3, 2 * j + 2, 2 * j + 3, 2 * j + 2,
                                        2 * j + 3);
  return _mm256_shuffle_epi8(C < 4 ? lo : hi, pick);
}

inline __m256i madd_acc(__m256i acc, __m256i a, __m256i b) {
#if defined(GGUF_VNNI)
  return _mm256_dpwssd_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

template <int... C, typename F>
inline void for_chunks(std::integer_sequence<int, C...>, F&& f) {
  (f(std::integral_constant<int, C>{}), ...);
}

// out[r * MB + m] = W row r . x row m, for MR rows of W (row_bytes apart) and MB rows of x (K apart).
template <int T, int MR, int MB>
inline void kdot(const uint8_t* w, int64_t row_bytes, int64_t nsb, const int8_t* xq, const float* xd,
                 const int16_t* xb, int64_t K, float* out) {
  __m256 acc[MR][MB], corr[MR][MB];
  for (int r = 0; r < MR; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_setzero_ps(), corr[r][m] = _mm256_setzero_ps();
  const int64_t nsbx = K / kQK;
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* blk[MR];
    __m256i lo[MR], hi[MR], isum[MR][MB];
    float d[MR];
    for (int r = 0; r < MR; ++r) {
      blk[r] = w + r * row_bytes + sb * KLayout<T>::bytes;
      const KInts ints = sub_ints<T>(blk[r]);
      lo[r] = _mm256_permute2x128_si256(ints.s, ints.s, 0x00);
      hi[r] = _mm256_permute2x128_si256(ints.s, ints.s, 0x11);
      float d_off;
      super_scales<T>(blk[r], d[r], d_off);
      for (int m = 0; m < MB; ++m) {
        // the minimums' term: o[j] * b[j] over the 16 sub-blocks, in int32 pairs
        const __m256i bs = loadu256(xb + m * (K / 16) + sb * 16);
        corr[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(ints.o, bs)),
                                     _mm256_set1_ps(-d_off * xd[m * nsbx + sb]), corr[r][m]);
        isum[r][m] = _mm256_setzero_si256();
      }
    }
    for_chunks(std::make_integer_sequence<int, 8>{}, [&](auto c) {
      constexpr int C = decltype(c)::value;
      __m256i xv[MB];
      for (int m = 0; m < MB; ++m) xv[m] = loadu256(xq + m * K + sb * kQK + 32 * C);
      for (int r = 0; r < MR; ++r) {
        const __m256i u = chunk<T, C>(blk[r]);
        const __m256i s = chunk_scales<C>(lo[r], hi[r]);
        for (int m = 0; m < MB; ++m) isum[r][m] = madd_acc(isum[r][m], _mm256_maddubs_epi16(u, xv[m]), s);
      }
    });
    for (int r = 0; r < MR; ++r)
      for (int m = 0; m < MB; ++m)
        acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][m]), _mm256_set1_ps(d[r] * xd[m * nsbx + sb]), acc[r][m]);
  }
  for (int r = 0; r < MR; ++r)
    for (int m = 0; m < MB; ++m) out[r * MB + m] = hsum(_mm256_add_ps(acc[r][m], corr[r][m]));
}

#else

// Value i (0..255) of a super-block as its unsigned integer u.
template <int T>
inline int value(const uint8_t* b, int i) {
  const int c = i / 32, l = i % 32, h = i / 128, s = c % 4;
  if constexpr (T == kQ4_K || T == kQ5_K) {
    const uint8_t byte = b[(T == kQ4_K ? 16 : 48) + 32 * (c / 2) + l];
    int u = c % 2 ? byte >> 4 : byte & 0x0F;
    if constexpr (T == kQ5_K) u |= ((b[16 + l] >> c) & 1) << 4;
    return u;
  } else if constexpr (T == kQ6_K) {
    const uint8_t byte = b[64 * h + 32 * (s % 2) + l];
    return (s < 2 ? byte & 0x0F : byte >> 4) | (((b[128 + 32 * h + l] >> (2 * s)) & 3) << 4);
  } else if constexpr (T == kQ2_K) {
    return (b[16 + 32 * h + l] >> (2 * s)) & 3;
  } else {
    return ((b[32 + 32 * h + l] >> (2 * s)) & 3) | (((b[l] >> c) & 1) << 2);
  }
}

// Sub-block j's integers s[j] and o[j].
template <int T>
inline void sub_ints(const uint8_t* b, int s[16], int o[16]) {
  uint8_t bytes[16];
  if constexpr (T == kQ4_K || T == kQ5_K) {
    uint32_t w[4];
    k4_scale_words(b + 4, w);
    std::memcpy(bytes, w, 16);  // sc[0..7], m[0..7]
    for (int j = 0; j < 16; ++j) s[j] = bytes[j / 2], o[j] = bytes[8 + j / 2];
  } else if constexpr (T == kQ2_K) {
    for (int j = 0; j < 16; ++j) s[j] = b[j] & 0x0F, o[j] = b[j] >> 4;
  } else if constexpr (T == kQ3_K) {
    uint32_t w[4];
    k3_scale_words(b + 96, w);
    std::memcpy(bytes, w, 16);
    for (int j = 0; j < 16; ++j) s[j] = o[j] = static_cast<int>(bytes[j]) - 32;
  } else {
    for (int j = 0; j < 16; ++j) s[j] = o[j] = static_cast<int8_t>(b[192 + j]);
  }
}

template <int T, int MR, int MB>
inline void kdot(const uint8_t* w, int64_t row_bytes, int64_t nsb, const int8_t* xq, const float* xd,
                 const int16_t* xb, int64_t K, float* out) {
  const int64_t nsbx = K / kQK;
  for (int r = 0; r < MR; ++r) {
    for (int m = 0; m < MB; ++m) {
      float acc = 0.f;
      for (int64_t sb = 0; sb < nsb; ++sb) {
        const uint8_t* b = w + r * row_bytes + sb * KLayout<T>::bytes;
        const int8_t* x = xq + m * K + sb * kQK;
        int s[16], o[16];
        sub_ints<T>(b, s, o);
        int main = 0, offset = 0;
        for (int j = 0; j < 16; ++j) {
          int dot = 0;
          for (int i = 16 * j; i < 16 * j + 16; ++i) dot += value<T>(b, i) * x[i];
          main += s[j] * dot;
          offset += o[j] * xb[m * (K / 16) + sb * 16 + j];
        }
        float d, d_off;
        super_scales<T>(b, d, d_off);
        acc += xd[m * nsbx + sb] * (d * static_cast<float>(main) - d_off * static_cast<float>(offset));
      }
      out[r * MB + m] = acc;
    }
  }
}

#endif

template <int T>
void kmatmul(const uint8_t* w, int64_t N, int64_t K, const int8_t* xq, const float* xd, const int16_t* xb, int64_t M,
             float* y, int threads) {
  const int64_t nsb = K / kQK;
  const int64_t row_bytes = nsb * KLayout<T>::bytes;
  const int64_t grain = M >= 4 ? 4 : 32;
  pagoda::parallel_for(0, N, grain, threads, [&](int64_t lo, int64_t hi) {
    float out[4];
    int64_t n = lo;
    if (M == 1) {
      for (; n + 4 <= hi; n += 4) {
        kdot<T, 4, 1>(w + n * row_bytes, row_bytes, nsb, xq, xd, xb, K, out);
        for (int r = 0; r < 4; ++r) y[n + r] = out[r];
      }
    }
    for (; n < hi; ++n) {
      const uint8_t* row = w + n * row_bytes;
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) {
        kdot<T, 1, 4>(row, row_bytes, nsb, xq + m * K, xd + m * nsb, xb + m * (K / 16), K, out);
        for (int r = 0; r < 4; ++r) y[(m + r) * N + n] = out[r];
      }
      for (; m < M; ++m) {
        kdot<T, 1, 1>(row, row_bytes, nsb, xq + m * K, xd + m * nsb, xb + m * (K / 16), K, out);
        y[m * N + n] = out[0];
      }
    }
  });
}

int kquant_matmul(int type, const uint8_t* w, int64_t N, int64_t K, const float* x, int64_t M, float* y, int threads) {
  if (!is_kquant(type) || K % kQK) return -1;
  std::vector<int8_t> xq(static_cast<size_t>(M * K));
  std::vector<float> xd(static_cast<size_t>(M * K / kQK));
  std::vector<int16_t> xb(static_cast<size_t>(M * K / 16));
  quantize_x_k(x, M, K, xq.data(), xd.data(), xb.data());
  switch (type) {
    case kQ2_K: kmatmul<kQ2_K>(w, N, K, xq.data(), xd.data(), xb.data(), M, y, threads); return 0;
    case kQ3_K: kmatmul<kQ3_K>(w, N, K, xq.data(), xd.data(), xb.data(), M, y, threads); return 0;
    case kQ4_K: kmatmul<kQ4_K>(w, N, K, xq.data(), xd.data(), xb.data(), M, y, threads); return 0;
    case kQ5_K: kmatmul<kQ5_K>(w, N, K, xq.data(), xd.data(), xb.data(), M, y, threads); return 0;
    case kQ6_K: kmatmul<kQ6_K>(w, N, K, xq.data(), xd.data(), xb.data(), M, y, threads); return 0;
    default: return -1;
  }
}

}  // namespace pagoda_gguf
