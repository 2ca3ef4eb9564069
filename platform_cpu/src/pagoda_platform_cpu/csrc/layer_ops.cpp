// Fused elementwise decoder-layer ops for the CPU: RMSNorm (alone and after the residual add),
// SiLU-and-mul, and rotate-half RoPE in place on a strided q/k view.
//
// Each op is one pass (two for the norms, three after a residual add) over rows that stay in
// L1, in float32 vectors of the machine's width (GCC vector extensions: 16 lanes with AVX-512,
// else 8). The point is fewer calls, not faster arithmetic: at decode sizes torch spends a few
// microseconds of dispatch per op on a few hundred elements, and a layer needed ~25 of them.
//
// Numerics follow pagoda.layers.TorchLayerOps operation by operation, including where torch
// rounds bfloat16 intermediates (every bf16 op rounds its result): bf16 RMSNorm normalises in
// float32, rounds, then multiplies by the bf16 weight and rounds; SiLU rounds silu(gate) before
// the multiply by up; RoPE rounds each product and each sum. The sum of squares is added up in
// torch's order (see sum_squares). The library is built with -ffp-contract=off so no
// multiply-add is fused where torch rounds in between. Results are bit-identical to torch's
// except exp() inside SiLU (a polynomial here, Sleef in torch): float32 SiLU may differ by an
// ulp or two (< 3e-7 relative), which rarely flips a bf16 rounding.
//
// Rows go to OpenMP threads (at::parallel_for) only when a call has enough elements to pay for
// waking them; a decode step's few rows run on the calling thread.
//
// Every entry point checks its inputs first and returns an undefined tensor (None in Python)
// or false when it cannot take them, before writing anything: the caller falls back to torch.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

#if defined(__AVX512F__)
constexpr int W = 16;
#else
constexpr int W = 8;
#endif

typedef float vfloat __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(W * sizeof(int32_t))));
typedef uint32_t vuint __attribute__((vector_size(W * sizeof(uint32_t))));
typedef uint16_t vu16 __attribute__((vector_size(W * sizeof(uint16_t))));

#define PAGODA_INLINE inline __attribute__((always_inline))

using bf16 = at::BFloat16;

// Elements a call must have before its rows are split over threads (at::parallel_for). Waking
// the OpenMP pool costs ~1.5 us on the 2-core reference VM: measured there, 2 threads beat 1
// from ~18K elements for add + RMSNorm and RoPE and from ~24K (gate + up) for SiLU-and-mul
// (SmolLM2 at 32 tokens: add+norm 5.3 -> 4.3 us, RoPE 5.4 -> 4.7, SiLU 21 -> 12). 32K, torch's
// own grain size, keeps a margin for busier machines; a decode step of a few rows stays on the
// calling thread.
constexpr int64_t kNormParallelElements = 1 << 15;
constexpr int64_t kRotaryParallelElements = 1 << 15;
constexpr int64_t kSiluParallelElements = 1 << 15;  // counts gate and up

PAGODA_INLINE vfloat splat(float x) { return vfloat{} + x; }

// -- loads and stores: memcpy is an unaligned vector move; bf16 is the top half of a float32 --
PAGODA_INLINE vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
PAGODA_INLINE vfloat load(const bf16* p) {
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

// float32 -> bf16 bits, round to nearest even, NaN -> quiet NaN: c10::BFloat16's conversion.
PAGODA_INLINE vuint bf16_bits(vfloat v) {
  const vuint u = (vuint)v;
  const vuint rounded = (u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16;
  const vuint nan = vuint{} + 0x7FC0u;
  return (v != v) ? nan : rounded;
}

PAGODA_INLINE void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof(v)); }
// Stores round: a value already rounded to T stores unchanged.
PAGODA_INLINE void store(bf16* p, vfloat v) {
#if defined(__AVX512F__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16((__m512i)bf16_bits(v)));
#else
  const vu16 h = __builtin_convertvector(bf16_bits(v), vu16);
  std::memcpy(p, &h, sizeof(h));
#endif
}

// The first n < W elements; the rest of the vector is zero.
template <typename T>
PAGODA_INLINE vfloat load_n(const T* p, int64_t n) {
  T buf[W];
  std::memset(static_cast<void*>(buf), 0, sizeof(buf));
  std::memcpy(static_cast<void*>(buf), p, n * sizeof(T));
  return load(buf);
}
template <typename T>
PAGODA_INLINE void store_n(T* p, vfloat v, int64_t n) {
  T buf[W];
  store(buf, v);
  std::memcpy(static_cast<void*>(p), buf, n * sizeof(T));
}

// A float32 result rounded to what storing it as T keeps (torch rounds every bf16 op's result).
template <typename T>
PAGODA_INLINE vfloat round_to(vfloat v);
template <>
PAGODA_INLINE vfloat round_to<float>(vfloat v) {
  return v;
}
template <>
PAGODA_INLINE vfloat round_to<bf16>(vfloat v) {
  return (vfloat)(bf16_bits(v) << 16);
}

// exp(x) on W lanes: Cody-Waite range reduction and a degree-6 polynomial, ~1-2 ulp.
PAGODA_INLINE vfloat exp_poly(vfloat r) {
  vfloat p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

#if defined(__AVX512F__)
// vscalefps scales by 2^n with IEEE overflow to inf and gradual underflow, so no range
// selects are needed; the clamp only keeps infinities out of the reduction.
PAGODA_INLINE vfloat vexp(vfloat x) {
  const __m512 clamped = _mm512_max_ps(_mm512_min_ps((__m512)x, _mm512_set1_ps(150.0f)), _mm512_set1_ps(-150.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(clamped, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const vfloat vn = (vfloat)n;
  const vfloat r = (vfloat)clamped - vn * 0.693145751953125f - vn * 1.428606765330187045e-06f;
  return (vfloat)_mm512_scalef_ps((__m512)exp_poly(r), n);
}
#else
// exp(x) = 0 below -87 (the smallest normal float is e^-87.3) and +inf above 88.
PAGODA_INLINE vfloat vexp(vfloat x) {
  const vfloat clamped = x < -87.0f ? splat(-87.0f) : (x > 88.0f ? splat(88.0f) : x);
  const vfloat shifter = splat(12582912.0f);  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const vfloat n = (clamped * 1.44269504088896341f + shifter) - shifter;
  const vfloat r = clamped - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
  const vint bits = (__builtin_convertvector(n, vint) + 127) << 23;
  const vfloat scaled = exp_poly(r) * (vfloat)bits;
  const vfloat inf = splat(std::numeric_limits<float>::infinity());
  return x < -87.0f ? splat(0.0f) : (x > 88.0f ? inf : scaled);
}
#endif

// Rows of a [A, B, D] tensor whose last dim is contiguous (a [T, D] tensor is [T, 1, D]).
template <typename T>
struct Rows {
  T* base;
  int64_t inner;  // B
  int64_t outer_stride, inner_stride;
  PAGODA_INLINE T* row(int64_t r) const { return base + (r / inner) * outer_stride + (r % inner) * inner_stride; }
};

template <typename T>
Rows<T> rows_of(const at::Tensor& t) {
  if (t.dim() == 2) return {t.data_ptr<T>(), 1, t.stride(0), 0};
  return {t.data_ptr<T>(), t.size(1), t.stride(0), t.stride(1)};
}

// Runs fn(begin, end) over rows, on the pool only when the call has min_parallel elements or more
// (and then with at least half that many per thread).
template <typename F>
void for_rows(int64_t rows, int64_t row_elements, int64_t min_parallel, const F& fn) {
  if (rows * row_elements < min_parallel) {
    fn(0, rows);
    return;
  }
  const int64_t grain = std::max<int64_t>(1, min_parallel / (2 * std::max<int64_t>(row_elements, 1)));
  at::parallel_for(0, rows, grain, fn);
}

// -- RMSNorm ------------------------------------------------------------------------------------

// out = w * round(x * rsqrt(mean(x^2) + eps)), given the row's sum of squares.
// torch.rsqrt(v) on the CPU is exactly 1.0f / sqrtf(v).
template <typename T>
PAGODA_INLINE void scale_row(const T* x, const T* w, T* out, int64_t d, float sum_sq, float eps) {
  const vfloat inv = splat(1.0f / std::sqrt(sum_sq / static_cast<float>(d) + eps));
  int64_t i = 0;
  for (; i + W <= d; i += W) store(out + i, load(w + i) * round_to<T>(load(x + i) * inv));
  if (i < d) store_n(out + i, load_n(w + i, d - i) * round_to<T>(load_n(x + i, d - i) * inv), d - i);
}

PAGODA_INLINE int64_t ceil_log2(int64_t x) {
  return x <= 2 ? 1 : 64 - __builtin_clzll(static_cast<uint64_t>(x - 1));
}

// torch's float sum reduces in 8-lane vectors even on AVX-512 hosts (measured: torch 2.13 on the
// AVX-512 reference VM matches this order with 8 lanes, not 16), so the sum is 8 lanes wide
// whatever W is. Should another torch build differ, only the last bit of the norm does.
constexpr int kSumLanes = 8;
typedef float vsum __attribute__((vector_size(kSumLanes * sizeof(float))));
typedef uint16_t vsum16 __attribute__((vector_size(kSumLanes * sizeof(uint16_t))));
typedef uint32_t vsum32 __attribute__((vector_size(kSumLanes * sizeof(uint32_t))));

PAGODA_INLINE vsum load_sum(const float* p) {
  vsum v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
PAGODA_INLINE vsum load_sum(const bf16* p) {
  vsum16 h;
  std::memcpy(&h, p, sizeof(h));
  return (vsum)(__builtin_convertvector(h, vsum32) << 16);
}

// The float32 sum of x[i]^2 added up in the order torch's CPU sum reduces a contiguous row
// (SumKernel.cpp: vectorized_inner_sum -> row_sum -> multi_row_sum): four vector accumulators
// over groups of four vectors, cascaded every 16 groups, then the leftover vectors, the scalar
// tail and the lanes in order. The same order makes float32 RMSNorm bit-identical to torch's.
template <typename T>
float sum_squares(const T* x, int64_t d) {
  constexpr int kLevels = 4;
  const int64_t nvec = d / kSumLanes;
  const int64_t groups = nvec / 4;
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(groups) / kLevels);
  const int64_t level_step = int64_t{1} << level_power;
  const int64_t level_mask = level_step - 1;
  vsum acc[kLevels][4] = {};
  auto add_group = [&](int64_t g) {
    for (int k = 0; k < 4; ++k) {
      const vsum a = load_sum(x + (g * 4 + k) * kSumLanes);
      acc[0][k] += a * a;
    }
  };
  int64_t g = 0;
  while (g + level_step <= groups) {
    for (int64_t j = 0; j < level_step; ++j, ++g) add_group(g);
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < 4; ++k) {
        acc[j][k] += acc[j - 1][k];
        acc[j - 1][k] = vsum{};
      }
      if ((g & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; g < groups; ++g) add_group(g);
  for (int j = 1; j < kLevels; ++j) {
    for (int k = 0; k < 4; ++k) acc[0][k] += acc[j][k];
  }
  vsum total = acc[0][0];
  for (int64_t v = groups * 4; v < nvec; ++v) {
    const vsum a = load_sum(x + v * kSumLanes);
    total += a * a;
  }
  for (int k = 1; k < 4; ++k) total += acc[0][k];
  float sum = 0.0f;
  for (int64_t e = nvec * kSumLanes; e < d; ++e) {
    const float v = static_cast<float>(x[e]);
    sum += v * v;
  }
  for (int i = 0; i < kSumLanes; ++i) sum += total[i];
  return sum;
}

// out = rms_norm(x); with a residual, first residual <- round(x + residual) and out = rms_norm(residual).
template <typename T>
void norm_rows_impl(const at::Tensor& x, at::Tensor* residual, const at::Tensor& weight, at::Tensor& out,
                    float eps) {
  const Rows<T> in = rows_of<T>(x);
  const Rows<T> res = residual != nullptr ? rows_of<T>(*residual) : in;
  const int64_t d = x.size(-1);
  const int64_t rows = x.numel() / std::max<int64_t>(d, 1);
  const T* w = weight.data_ptr<T>();
  T* o = out.data_ptr<T>();
  for_rows(rows, d, kNormParallelElements, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = in.row(r);
      if (residual != nullptr) {
        T* rr = res.row(r);
        int64_t i = 0;
        for (; i + W <= d; i += W) store(rr + i, load(row + i) + load(rr + i));
        if (i < d) store_n(rr + i, load_n(row + i, d - i) + load_n(rr + i, d - i), d - i);
        row = rr;
      }
      scale_row(row, w, o + r * d, d, sum_squares(row, d), eps);
    }
  });
}

// -- SiLU-and-mul ---------------------------------------------------------------------------------

// round(silu(gate)) * up, rounded by the store; silu(g) = g / (1 + exp(-g)) as torch computes it.
template <typename T>
PAGODA_INLINE vfloat silu_mul(vfloat g, vfloat u) {
  return round_to<T>(g / (splat(1.0f) + vexp(-g))) * u;
}

template <typename T>
void silu_and_mul_impl(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t half = gate_up.size(1) / 2;
  const int64_t rows = gate_up.size(0);
  const int64_t stride = gate_up.stride(0);
  const T* in = gate_up.data_ptr<T>();
  T* o = out.data_ptr<T>();
  for_rows(rows, 2 * half, kSiluParallelElements, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = in + r * stride;
      const T* u = g + half;
      T* orow = o + r * half;
      int64_t i = 0;
      for (; i + W <= half; i += W) store(orow + i, silu_mul<T>(load(g + i), load(u + i)));
      if (i < half) store_n(orow + i, silu_mul<T>(load_n(g + i, half - i), load_n(u + i, half - i)), half - i);
    }
  });
}

// -- rotary ---------------------------------------------------------------------------------------

// x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, each product rounded as torch rounds it (the
// sums are rounded by the store).
template <typename T>
PAGODA_INLINE void rotate(vfloat a, vfloat b, vfloat c, vfloat s, vfloat& first, vfloat& second) {
  first = round_to<T>(a * c) - round_to<T>(b * s);
  second = round_to<T>(b * c) + round_to<T>(a * s);
}

template <typename T>
void rotary_impl(at::Tensor& qk, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = qk.size(0), heads = qk.size(1), half = cos.size(-1);
  const int64_t tok_stride = qk.stride(0), head_stride = qk.stride(1);
  const int64_t cos_stride = cos.stride(0), sin_stride = sin.stride(0);
  T* base = qk.data_ptr<T>();
  const T* cos_base = cos.data_ptr<T>();
  const T* sin_base = sin.data_ptr<T>();
  for_rows(tokens, heads * 2 * half, kRotaryParallelElements, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos_base + t * cos_stride;
      const T* s = sin_base + t * sin_stride;
      for (int64_t h = 0; h < heads; ++h) {
        T* x1 = base + t * tok_stride + h * head_stride;
        T* x2 = x1 + half;
        vfloat first, second;
        int64_t i = 0;
        for (; i + W <= half; i += W) {
          rotate<T>(load(x1 + i), load(x2 + i), load(c + i), load(s + i), first, second);
          store(x1 + i, first);
          store(x2 + i, second);
        }
        if (i < half) {
          const int64_t n = half - i;
          rotate<T>(load_n(x1 + i, n), load_n(x2 + i, n), load_n(c + i, n), load_n(s + i, n), first, second);
          store_n(x1 + i, first, n);
          store_n(x2 + i, second, n);
        }
      }
    }
  });
}

// -- argument checks --------------------------------------------------------------------------------

bool kernel_dtype(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

// On the CPU, float32 or bf16, no autograd to record.
bool plain(const at::Tensor& t) {
  return t.defined() && t.device().is_cpu() && t.layout() == at::kStrided && kernel_dtype(t) &&
         !(t.requires_grad() && at::GradMode::is_enabled());
}

// [T, D] or [T, B, D] with a contiguous last dim and non-negative strides.
bool row_layout(const at::Tensor& t) {
  if (t.dim() != 2 && t.dim() != 3) return false;
  if (t.size(-1) > 1 && t.stride(-1) != 1) return false;
  for (int64_t i = 0; i < t.dim(); ++i) {
    if (t.stride(i) < 0) return false;
  }
  return true;
}

// No two rows of a row_layout tensor share memory (a tensor written in place must not overlap
// itself, e.g. an expanded view): rows are laid out one after the other along each dim.
bool rows_disjoint(const at::Tensor& t) {
  const int64_t inner = t.dim() == 3 ? t.size(1) : 1;
  int64_t extent = t.size(-1);
  if (t.dim() == 3 && inner > 1) {
    if (t.stride(1) < extent) return false;
    extent = t.stride(1) * (inner - 1) + t.size(-1);
  }
  return t.size(0) <= 1 || t.stride(0) >= extent;
}

bool norm_weight(const at::Tensor& w, const at::Tensor& x) {
  return plain(w) && w.scalar_type() == x.scalar_type() && w.dim() == 1 && w.size(0) == x.size(-1) &&
         w.is_contiguous();
}

}  // namespace

// rms_norm(x) over the last dim as a new contiguous tensor; None when the inputs are not covered.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  if (!plain(x) || !row_layout(x) || !norm_weight(weight, x)) return {};
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (x.scalar_type() == at::kFloat) {
    norm_rows_impl<float>(x, nullptr, weight, out, static_cast<float>(eps));
  } else {
    norm_rows_impl<bf16>(x, nullptr, weight, out, static_cast<float>(eps));
  }
  return out;
}

// residual <- x + residual (in place); returns rms_norm(residual). None (nothing written) when not covered.
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  if (!plain(x) || !row_layout(x) || !plain(residual) || !row_layout(residual) || !rows_disjoint(residual) ||
      residual.scalar_type() != x.scalar_type() || residual.sizes() != x.sizes() || !norm_weight(weight, x)) {
    return {};
  }
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (x.scalar_type() == at::kFloat) {
    norm_rows_impl<float>(x, &residual, weight, out, static_cast<float>(eps));
  } else {
    norm_rows_impl<bf16>(x, &residual, weight, out, static_cast<float>(eps));
  }
  return out;
}

// [T, 2I] -> [T, I]; None when not covered.
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  if (!plain(gate_up) || gate_up.dim() != 2 || gate_up.size(1) % 2 != 0 || gate_up.stride(1) != 1 ||
      gate_up.stride(0) < 0) {
    return {};
  }
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) {
    silu_and_mul_impl<float>(gate_up, out);
  } else {
    silu_and_mul_impl<bf16>(gate_up, out);
  }
  return out;
}

// Rotates qk [T, heads, head_dim] in place with cos/sin [T, 1, rot / 2]; false (nothing written) when not covered.
bool rotary_neox(torch::Tensor qk, torch::Tensor cos, torch::Tensor sin) {
  if (!plain(qk) || qk.dim() != 3 || !row_layout(qk) || !rows_disjoint(qk)) return false;
  if (!plain(cos) || !plain(sin)) return false;
  if (cos.scalar_type() != qk.scalar_type() || sin.scalar_type() != qk.scalar_type()) return false;
  if (cos.dim() != 3 || sin.dim() != 3 || cos.size(1) != 1 || sin.size(1) != 1) return false;
  const int64_t half = cos.size(2);
  if (cos.size(0) != qk.size(0) || sin.size(0) != qk.size(0) || sin.size(2) != half) return false;
  if (2 * half > qk.size(2)) return false;
  if (half > 1 && (cos.stride(2) != 1 || sin.stride(2) != 1)) return false;
  if (cos.stride(0) < 0 || sin.stride(0) < 0) return false;
  if (qk.scalar_type() == at::kFloat) {
    rotary_impl<float>(qk, cos, sin);
  } else {
    rotary_impl<bf16>(qk, cos, sin);
  }
  return true;
}
