// What the GGUF kernels (gguf_gemm.cpp: 32-value block types; gguf_kquants.cpp: K-quants) share:
// the instruction-set path chosen at compile time, f16 scales, the u8 x s8 integer dot product.
#pragma once

#include <pagoda/simd.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define GGUF_AVX2 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define GGUF_VNNI 1
#endif
#endif

namespace pagoda_gguf {

#if defined(GGUF_VNNI)
constexpr const char* kIsa = "avx512_vnni";
#elif defined(GGUF_AVX2)
constexpr const char* kIsa = "avx2";
#else
constexpr const char* kIsa = "scalar";
#endif

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline float half_to_float(const uint8_t* p) {
#if defined(GGUF_AVX2)
  return _cvtsh_ss(load_u16(p));
#else
  return pagoda::half_to_float(load_u16(p));
#endif
}

#if defined(GGUF_AVX2)
inline __m256i loadu256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// u8 x s8 -> s32, each lane the sum of 4 products (VNNI's vpdpbusd, else vpmaddubsw + vpmaddwd).
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(GGUF_VNNI)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// y [M, N] = x [M, K] W^T for the K-quant types (Q2_K..Q6_K); -1 for another type or K not whole super-blocks.
int kquant_matmul(int type, const uint8_t* w, int64_t N, int64_t K, const float* x, int64_t M, float* y, int threads);
bool is_kquant(int type);

}  // namespace pagoda_gguf
