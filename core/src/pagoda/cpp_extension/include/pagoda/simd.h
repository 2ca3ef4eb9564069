// pagoda/simd.h: the helpers pagoda's C++ kernels share (header only, no torch).
//
// Every library pagoda.cpp_extension builds gets -I to this folder. What is here:
//  - PAGODA_INLINE, PAGODA_EXPORT (an extern "C" entry point Python loads with ctypes);
//  - bfloat16 and float16 as 16-bit values: scalar conversions rounding as torch rounds
//    (to nearest even, NaN to a quiet NaN), and the types bf16 / half that convert like
//    c10::BFloat16 / c10::Half (static_cast to and from float);
//  - float vectors of the machine's widest width (GCC vector extensions: 16 lanes with
//    AVX-512F, else 8), with unaligned loads and stores, horizontal sums and maxima, and
//    bf16 <-> float32 conversions of a whole vector;
//  - the exp() polynomial of the attention and SiLU kernels, a vector exp() and SiLU-and-mul.
// The vector part is compiled for the build's -march; nothing here checks the CPU at run time.
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// Small helpers must inline into the kernels for their operands to stay in registers.
#define PAGODA_INLINE inline __attribute__((always_inline))
// An entry point of a kernel library: C linkage, visible from the shared object.
#define PAGODA_EXPORT extern "C" __attribute__((visibility("default")))

namespace pagoda {

// -- scalar bfloat16 / float16 ----------------------------------------------------------------------

PAGODA_INLINE float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
PAGODA_INLINE uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// bfloat16 is the upper half of a float32.
PAGODA_INLINE float bf16_to_float(uint16_t v) { return bits_to_float(static_cast<uint32_t>(v) << 16); }

// Round to nearest even; NaN becomes the quiet NaN 0x7FC0, as torch's conversion does.
PAGODA_INLINE uint16_t float_to_bf16(float f) {
  const uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// IEEE binary16 -> float32, exact (subnormals, infinities and NaN included).
PAGODA_INLINE float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1fu) return bits_to_float(sign | 0x7f800000u | (mantissa << 13));  // inf, NaN
  if (exponent != 0) return bits_to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  // zero or subnormal: mantissa * 2^-24, exact in float32
  const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-08f;
  return bits_to_float(sign | float_to_bits(magnitude));
}

// float32 -> IEEE binary16, rounded to nearest even; overflow to infinity, NaN stays NaN (quiet).
PAGODA_INLINE uint16_t float_to_half(float f) {
  const uint32_t u = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u | static_cast<uint16_t>((abs >> 13) & 0x3ffu);  // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds past 65504: infinity
  if (abs < 0x38800000u) {
    // Below 2^-14 the result is subnormal: adding 0.5 (2^-1) lines the float's mantissa up so that its
    // low bits are the half's, and the float addition rounds to nearest even exactly where binary16 would.
    const float shifted = bits_to_float(abs) + 0.5f;
    return sign | static_cast<uint16_t>(float_to_bits(shifted) - float_to_bits(0.5f));
  }
  // Normal: rebias the exponent (127 -> 15) and round the 13 dropped mantissa bits to nearest even.
  const uint32_t rebased = abs - (112u << 23);
  return sign | static_cast<uint16_t>((rebased + 0xfffu + ((rebased >> 13) & 1u)) >> 13);
}

// 16-bit floats as kernel element types: static_cast<float>(x) and static_cast<bf16>(f) convert.
struct bf16 {
  uint16_t bits;
  bf16() = default;
  explicit bf16(float f) : bits(float_to_bf16(f)) {}
  explicit operator float() const { return bf16_to_float(bits); }
};
struct half {
  uint16_t bits;
  half() = default;
  explicit half(float f) : bits(float_to_half(f)) {}
  explicit operator float() const { return half_to_float(bits); }
};
static_assert(sizeof(bf16) == 2 && sizeof(half) == 2, "16-bit element types must be 2 bytes");

// -- float vectors of the machine's width --------------------------------------------------------------

namespace simd {

#if defined(__AVX512F__)
constexpr int W = 16;
#define PAGODA_W16 1
#else
constexpr int W = 8;
#define PAGODA_W16 0
#endif

typedef float vfloat __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(W * sizeof(int32_t))));
typedef uint32_t vuint __attribute__((vector_size(W * sizeof(uint32_t))));
typedef uint16_t vu16 __attribute__((vector_size(W * sizeof(uint16_t))));

// memcpy: unaligned vector loads and stores (tensor rows are only element-aligned).
PAGODA_INLINE vfloat loadv(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
PAGODA_INLINE void storev(float* p, vfloat v) { std::memcpy(p, &v, sizeof(v)); }
// x - 0 is x for every x (x + 0 is not, for -0), so this folds to a plain broadcast.
PAGODA_INLINE vfloat splat(float x) { return x - vfloat{}; }
PAGODA_INLINE vfloat vmax(vfloat a, vfloat b) { return a > b ? a : b; }

// Lanes rotated down by N (lane i takes lane i + N): log2(W) rotate-and-combine steps reduce a vector.
template <int N>
PAGODA_INLINE vfloat rotate_lanes(vfloat v) {
#if PAGODA_W16
  const vint mask = {(0 + N) % 16, (1 + N) % 16, (2 + N) % 16, (3 + N) % 16, (4 + N) % 16, (5 + N) % 16,
                     (6 + N) % 16, (7 + N) % 16, (8 + N) % 16, (9 + N) % 16, (10 + N) % 16, (11 + N) % 16,
                     (12 + N) % 16, (13 + N) % 16, (14 + N) % 16, (15 + N) % 16};
#else
  const vint mask = {(0 + N) % 8, (1 + N) % 8, (2 + N) % 8, (3 + N) % 8,
                     (4 + N) % 8, (5 + N) % 8, (6 + N) % 8, (7 + N) % 8};
#endif
  return __builtin_shuffle(v, mask);
}
PAGODA_INLINE float hsum(vfloat v) {
#if PAGODA_W16
  v += rotate_lanes<8>(v);
#endif
  v += rotate_lanes<4>(v);
  v += rotate_lanes<2>(v);
  v += rotate_lanes<1>(v);
  return v[0];
}
PAGODA_INLINE float hmax(vfloat v) {
#if PAGODA_W16
  v = vmax(v, rotate_lanes<8>(v));
#endif
  v = vmax(v, rotate_lanes<4>(v));
  v = vmax(v, rotate_lanes<2>(v));
  v = vmax(v, rotate_lanes<1>(v));
  return v[0];
}

// W bf16 values (raw bits) widened to float32.
PAGODA_INLINE vfloat load_bf16(const uint16_t* p) {
#if defined(__AVX512F__)
  // One widening load; GCC's generic conversion takes five instructions here.
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return (vfloat)_mm512_slli_epi32(wide, 16);
#else
  vu16 h;
  std::memcpy(&h, p, sizeof(h));
  return (vfloat)(__builtin_convertvector(h, vuint) << 16);
#endif
}

// float32 -> bf16 bits in the low half of each lane: round to nearest even, NaN -> 0x7FC0 (float_to_bf16 on W lanes).
PAGODA_INLINE vuint bf16_bits(vfloat v) {
  const vuint u = (vuint)v;
  const vuint rounded = (u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16;
  const vuint nan = vuint{} + 0x7FC0u;
  return (v != v) ? nan : rounded;
}

#if defined(__AVX512F__)
// W floats rounded to bf16 bits, packed. vcvtneps2bf16 (AVX512_BF16) rounds to nearest even as
// bf16_bits does, in one instruction where bf16_bits takes seven, but it flushes denormal inputs to
// zero and keeps a NaN's sign and payload: a vector holding either (rare) takes the integer path, so
// the result is bf16_bits' in every case (checked against it on 3.2e8 random bit patterns).
PAGODA_INLINE __m256i bf16_pack(vfloat v) {
#if defined(__AVX512BF16__)
  const __m512i magnitude = _mm512_and_si512((__m512i)v, _mm512_set1_epi32(0x7fffffff));
  // magnitude - 1 below 0x7fffff: a denormal (zero wraps around to the top); above 0x7f800000: a NaN
  const __mmask16 odd =
      _mm512_cmplt_epu32_mask(_mm512_sub_epi32(magnitude, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7fffff)) |
      _mm512_cmpgt_epu32_mask(magnitude, _mm512_set1_epi32(0x7f800000));
  if (__builtin_expect(odd == 0, 1)) return (__m256i)_mm512_cvtneps_pbh((__m512)v);
#endif
  return _mm512_cvtepi32_epi16((__m512i)bf16_bits(v));
}
#endif

// W floats rounded to bf16 and widened back: the value storing them as bf16 keeps.
PAGODA_INLINE vfloat round_bf16(vfloat v) {
#if defined(__AVX512F__)
  return (vfloat)_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_pack(v)), 16);
#else
  return (vfloat)(bf16_bits(v) << 16);
#endif
}

// Rounds W floats to bf16 and stores them.
PAGODA_INLINE void store_bf16(uint16_t* p, vfloat v) {
#if defined(__AVX512F__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_pack(v));
#else
  const vu16 h = __builtin_convertvector(bf16_bits(v), vu16);
  std::memcpy(p, &h, sizeof(h));
#endif
}

}  // namespace simd

// -- exp ---------------------------------------------------------------------------------------------

// Cody-Waite range reduction: x = n ln2 + r, ln2 split so that n * kLn2Hi is exact for |n| < 2^8.
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693145751953125f;
constexpr float kLn2Lo = 1.428606765330187045e-06f;

// exp(r) for |r| <= ln2 / 2: a degree-6 minimax polynomial, ~1-2 ulp (float or a float vector).
template <typename V>
PAGODA_INLINE V exp_poly(V r) {
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

// -- vector exp and SiLU (the layer ops and the matmul's SiLU-and-mul epilogue share these) -----------

namespace simd {

// A float32 result rounded to what storing it as T keeps (torch rounds every bf16 op's result).
template <typename T>
PAGODA_INLINE vfloat round_to(vfloat v);
template <>
PAGODA_INLINE vfloat round_to<float>(vfloat v) {
  return v;
}
template <>
PAGODA_INLINE vfloat round_to<bf16>(vfloat v) {
  return round_bf16(v);
}

#if defined(__AVX512F__)
// exp(x) on W lanes: Cody-Waite range reduction and exp_poly, ~1-2 ulp. vscalefps scales by 2^n with IEEE overflow to inf and gradual underflow, so no range
// selects are needed; the clamp only keeps infinities out of the reduction.
PAGODA_INLINE vfloat vexp(vfloat x) {
  const __m512 clamped = _mm512_max_ps(_mm512_min_ps((__m512)x, _mm512_set1_ps(150.0f)), _mm512_set1_ps(-150.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(clamped, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const vfloat vn = (vfloat)n;
  const vfloat r = (vfloat)clamped - vn * kLn2Hi - vn * kLn2Lo;
  return (vfloat)_mm512_scalef_ps((__m512)exp_poly(r), n);
}
#else
// exp(x) = 0 below -87 (the smallest normal float is e^-87.3) and +inf above 88.
PAGODA_INLINE vfloat vexp(vfloat x) {
  const vfloat clamped = x < -87.0f ? splat(-87.0f) : (x > 88.0f ? splat(88.0f) : x);
  const vfloat shifter = splat(12582912.0f);  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const vfloat n = (clamped * kLog2e + shifter) - shifter;
  const vfloat r = clamped - n * kLn2Hi - n * kLn2Lo;
  const vint bits = (__builtin_convertvector(n, vint) + 127) << 23;
  const vfloat scaled = exp_poly(r) * (vfloat)bits;
  const vfloat inf = splat(std::numeric_limits<float>::infinity());
  return x < -87.0f ? splat(0.0f) : (x > 88.0f ? inf : scaled);
}
#endif

// round(silu(gate)) * up, rounded by the store; silu(g) = g / (1 + exp(-g)) as torch computes it.
template <typename T>
PAGODA_INLINE vfloat silu_mul(vfloat g, vfloat u) {
  return round_to<T>(g / (splat(1.0f) + vexp(-g))) * u;
}

}  // namespace simd

}  // namespace pagoda
