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
// Rows go to OpenMP threads (pagoda::parallel_for, up to the caller's thread count) only when a
// call has enough elements to pay for waking them; a decode step's few rows run on the calling thread.
//
// Entry points (extern "C", called through ctypes by pagoda_platform_cpu.layer_ops): tensors come
// as a data pointer, a dtype code (0 float32, 1 bfloat16) and a [n0, n1, d] view (sizes and element
// strides; a [T, D] tensor is [T, 1, D]). Python checks device, dtype and autograd and allocates
// the outputs; every entry point checks the layout first and returns 0, before writing anything,
// when it cannot take it: the caller falls back to torch.
#include <pagoda/parallel.h>
#include <pagoda/python.h>
#include <pagoda/simd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

using namespace pagoda::simd;
using pagoda::bf16;

// Elements a call must have before its rows are split over threads (at::parallel_for). Waking
// the OpenMP pool costs ~1.5 us on the 2-core reference VM: measured there, 2 threads beat 1
// from ~18K elements for add + RMSNorm and RoPE and from ~24K (gate + up) for SiLU-and-mul
// (SmolLM2 at 32 tokens: add+norm 5.3 -> 4.3 us, RoPE 5.4 -> 4.7, SiLU 21 -> 12). 32K, torch's
// own grain size, keeps a margin for busier machines; a decode step of a few rows stays on the
// calling thread.
constexpr int64_t kNormParallelElements = 1 << 15;
constexpr int64_t kRotaryParallelElements = 1 << 15;
constexpr int64_t kSiluParallelElements = 1 << 15;  // counts gate and up

// -- loads and stores: float32 as is, bf16 widened (the top half of a float32) --
PAGODA_INLINE vfloat load(const float* p) { return loadv(p); }
PAGODA_INLINE vfloat load(const bf16* p) { return load_bf16(reinterpret_cast<const uint16_t*>(p)); }

PAGODA_INLINE void store(float* p, vfloat v) { storev(p, v); }
// Stores round: a value already rounded to T stores unchanged.
PAGODA_INLINE void store(bf16* p, vfloat v) { store_bf16(reinterpret_cast<uint16_t*>(p), v); }

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

// Rows of a [A, B, D] tensor whose last dim is contiguous (a [T, D] tensor is [T, 1, D]).
template <typename T>
struct Rows {
  T* base;
  int64_t inner;  // B
  int64_t outer_stride, inner_stride;
  PAGODA_INLINE T* row(int64_t r) const { return base + (r / inner) * outer_stride + (r % inner) * inner_stride; }
};

// A tensor viewed as [n0, n1, d] rows (element strides s0, s1; the last dim contiguous).
struct View {
  void* data;
  int64_t n0, n1, d, s0, s1;
};

template <typename T>
Rows<T> rows_of(const View& v) {
  return {static_cast<T*>(v.data), v.n1, v.s0, v.s1};
}

// Runs fn(begin, end) over rows, on the pool only when the call has min_parallel elements or more
// (and then with at least half that many per thread).
template <typename F>
void for_rows(int64_t rows, int64_t row_elements, int64_t min_parallel, int threads, const F& fn) {
  if (rows * row_elements < min_parallel) {
    fn(0, rows);
    return;
  }
  const int64_t grain = std::max<int64_t>(1, min_parallel / (2 * std::max<int64_t>(row_elements, 1)));
  pagoda::parallel_for(0, rows, grain, threads, fn);
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
void norm_rows_impl(const View& x, const View* residual, const T* w, T* o, float eps, int threads) {
  const Rows<T> in = rows_of<T>(x);
  const Rows<T> res = residual != nullptr ? rows_of<T>(*residual) : in;
  const int64_t d = x.d;
  const int64_t rows = x.n0 * x.n1;
  for_rows(rows, d, kNormParallelElements, threads, [&](int64_t begin, int64_t end) {
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

template <typename T>
void silu_and_mul_impl(const T* in, int64_t rows, int64_t half, int64_t stride, T* o, int threads) {
  for_rows(rows, 2 * half, kSiluParallelElements, threads, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = in + r * stride;
      const T* u = g + half;
      T* orow = o + r * half;
      int64_t i = 0;
      // Four vectors a step: one vector's exp, divide and roundings form a long dependent chain;
      // four independent ones side by side measured 8% faster ([512, 2 x 1536] bf16: 203 -> 187 us).
      for (; i + 4 * W <= half; i += 4 * W) {
        vfloat r[4];
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) r[k] = silu_mul<T>(load(g + i + k * W), load(u + i + k * W));
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) store(orow + i + k * W, r[k]);
      }
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
void rotary_impl(const View& qk, const T* cos_base, int64_t cos_stride, const T* sin_base, int64_t sin_stride,
                 int64_t half, int threads) {
  const int64_t tokens = qk.n0, heads = qk.n1;
  const int64_t tok_stride = qk.s0, head_stride = qk.s1;
  T* base = static_cast<T*>(qk.data);
  for_rows(tokens, heads * 2 * half, kRotaryParallelElements, threads, [&](int64_t begin, int64_t end) {
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

// -- argument checks (device, dtype and autograd are checked in Python) ---------------------------------

constexpr int kFloat32 = 0, kBFloat16 = 1;

// Non-negative sizes and strides, the last dim contiguous.
bool row_layout(const View& v) {
  return v.n0 >= 0 && v.n1 >= 0 && v.d >= 0 && v.s0 >= 0 && v.s1 >= 0;
}

// No two rows of a row_layout view share memory (a tensor written in place must not overlap
// itself, e.g. an expanded view): rows are laid out one after the other along each dim.
bool rows_disjoint(const View& v) {
  int64_t extent = v.d;
  if (v.n1 > 1) {
    if (v.s1 < extent) return false;
    extent = v.s1 * (v.n1 - 1) + v.d;
  }
  return v.n0 <= 1 || v.s0 >= extent;
}

template <typename T>
void add_rms_norm_typed(const View& x, const View* residual, const void* weight, void* out, float eps, int threads) {
  norm_rows_impl<T>(x, residual, static_cast<const T*>(weight), static_cast<T*>(out), eps, threads);
}

}  // namespace

// out (contiguous [n0 * n1, d]) = rms_norm(x) over the last dim; with a residual (same sizes), first
// residual <- x + residual in place, and out = rms_norm(residual). weight: contiguous [d].
// Returns 0 (nothing written) when the layout is not covered.
PAGODA_EXPORT int pagoda_add_rms_norm(int dtype, void* x, int64_t n0, int64_t n1, int64_t d, int64_t s0, int64_t s1,
                                      void* residual, int64_t r0, int64_t r1, const void* weight, void* out, float eps,
                                      int threads) {
  const View xv{x, n0, n1, d, s0, s1};
  const View rv{residual, n0, n1, d, r0, r1};
  if (!row_layout(xv) || (dtype != kFloat32 && dtype != kBFloat16)) return 0;
  if (residual != nullptr && (!row_layout(rv) || !rows_disjoint(rv))) return 0;
  const View* res = residual != nullptr ? &rv : nullptr;
  if (dtype == kFloat32) {
    add_rms_norm_typed<float>(xv, res, weight, out, eps, threads);
  } else {
    add_rms_norm_typed<bf16>(xv, res, weight, out, eps, threads);
  }
  return 1;
}

// out [rows, half] = silu(gate) * up for gate_up [rows, 2 * half] (rows `stride` elements apart). Returns 0 when not covered.
PAGODA_EXPORT int pagoda_silu_and_mul(int dtype, const void* gate_up, int64_t rows, int64_t half, int64_t stride,
                                      void* out, int threads) {
  if (rows < 0 || half < 0 || stride < 0) return 0;
  if (dtype == kFloat32) {
    silu_and_mul_impl(static_cast<const float*>(gate_up), rows, half, stride, static_cast<float*>(out), threads);
  } else if (dtype == kBFloat16) {
    silu_and_mul_impl(static_cast<const bf16*>(gate_up), rows, half, stride, static_cast<bf16*>(out), threads);
  } else {
    return 0;
  }
  return 1;
}

// Rotates qk [tokens, heads, head_dim] (strides s0, s1; head_dim contiguous) in place with cos/sin rows
// of `half` contiguous elements, one row per token (cos_stride / sin_stride apart). Returns 0 (nothing
// written) when not covered.
PAGODA_EXPORT int pagoda_rotary_neox(int dtype, void* qk, int64_t tokens, int64_t heads, int64_t head_dim, int64_t s0,
                                     int64_t s1, const void* cos, int64_t cos_stride, const void* sin,
                                     int64_t sin_stride, int64_t half, int threads) {
  const View v{qk, tokens, heads, head_dim, s0, s1};
  if (!row_layout(v) || !rows_disjoint(v) || half < 0 || 2 * half > head_dim) return 0;
  if (cos_stride < 0 || sin_stride < 0) return 0;
  if (dtype == kFloat32) {
    rotary_impl(v, static_cast<const float*>(cos), cos_stride, static_cast<const float*>(sin), sin_stride, half,
                threads);
  } else if (dtype == kBFloat16) {
    rotary_impl(v, static_cast<const bf16*>(cos), cos_stride, static_cast<const bf16*>(sin), sin_stride, half,
                threads);
  } else {
    return 0;
  }
  return 1;
}

// The entry points as a Python module (pagoda/python.h): one cheap call each from the wrappers.
PAGODA_PYTHON_MODULE(PAGODA_FUNCTION(pagoda_add_rms_norm),
                     PAGODA_FUNCTION(pagoda_silu_and_mul),
                     PAGODA_FUNCTION(pagoda_rotary_neox))
