// Paged attention for the CPU, reading K/V straight from the block cache.
//
// Work item = (sequence, tile of query tokens, range of KV heads). A decode batch
// gets one item per sequence covering every KV head, so each cache block is read
// once, front to back; items are handed out biggest first to whichever thread is
// free. With too few items to keep the cores busy, tiles split per KV head and a
// long decode splits its keys into one part per thread (flash-decoding style), the
// parts' partial results merged at the end. Every query head of a KV head's group
// and every token of the tile reuse the block's K/V from L1 (GQA). Softmax is
// online (running max and sum per query row) in float32; V accumulates in float32;
// the output is written in the model dtype.
//
// The arithmetic uses GCC vector extensions of the machine's widest float vector
// (16 lanes with AVX-512, else 8). A decode: one query row against W keys is W dot
// products done lane-parallel over head_dim, then summed across lanes all at once by a
// shuffle tree, so the W scores land in one vector for a vectorized exp. The query
// heads of a group go through a block together (up to four rows), each K/V vector
// loaded once for all of them. bf16 decodes read the cache in place with the
// AVX512_BF16 dot-product instruction where the CPU has it. A tile of query tokens
// (prefill, chunks) at a register-resident head_dim puts W query rows in a vector
// instead (attend_tile_t): scores are broadcast multiply-adds with no lane sums, and
// the online softmax is lane-wise; bf16 scores use the dot-product instruction too.
//
// Decode is memory-bound: each thread runs a read-ahead cursor over the cache lines
// it will read (across its next items too), a fixed distance ahead, and the inner
// loops prefetch each key's lines into L2 as they read a key. Blocks sit at random
// places in the cache, which defeats the hardware prefetchers at every block edge.
//
// Entry point: pagoda_paged_attention (extern "C", called through ctypes by pagoda_attn_cpu.kernel,
// which checks shapes and dtypes and allocates the output); the metadata is checked here.
//
// A library serves one element type and is specialized for one head_dim: the register-resident
// paths are templates over the head's vector count, and compiling every one of them for every
// dtype took ~15 s of CPU (one dtype, one head_dim: 2-4 s), which a server's first start waits
// for. PAGODA_ATTN_DTYPE: 0 float32, 1 bfloat16, 2 float16. PAGODA_ATTN_HEAD_DIM: the one head_dim
// the library serves, on its register-resident path where it has one; 0: any head_dim, on the
// generic path (head_dims without a fast path share that library).
//
// fp8 KV cache (PAGODA_ATTN_CACHE 3: float8_e4m3fn, 4: float8_e5m2; else the cache holds the model
// dtype): queries and the output stay in the model dtype; new K/V are stored as saturate(x / scale)
// rounded to nearest even (torch's float -> float8 rounding), and cached rows are converted to
// float32 in registers as they are read: an fp8 byte becomes a binary16 bit pattern (e5m2 is the
// top byte of a binary16; e4m3 shifted into one reads its value / 256) and one vcvtph2ps widens
// W of them. k_scale (and the 256) fold into the query scale, v_scale into the output's 1 / sum.
#include <omp.h>
#include <pagoda/python.h>
#include <pagoda/simd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#if !defined(PAGODA_ATTN_DTYPE) || PAGODA_ATTN_DTYPE < 0 || PAGODA_ATTN_DTYPE > 2
#error "build with -DPAGODA_ATTN_DTYPE=0, 1 or 2 (float32, bfloat16, float16)"
#endif
#if !defined(PAGODA_ATTN_HEAD_DIM)
#define PAGODA_ATTN_HEAD_DIM 0
#endif
#if !defined(PAGODA_ATTN_CACHE)
#define PAGODA_ATTN_CACHE PAGODA_ATTN_DTYPE
#endif
#if PAGODA_ATTN_CACHE != PAGODA_ATTN_DTYPE && PAGODA_ATTN_CACHE != 3 && PAGODA_ATTN_CACHE != 4
#error "PAGODA_ATTN_CACHE is the model dtype's code, or 3 / 4 (fp8 e4m3 / e5m2)"
#endif

namespace {

using namespace pagoda::simd;
using pagoda::bf16;
using pagoda::half;

#if PAGODA_W16
#define PAGODA_IOTA 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15
#define PAGODA_EVEN 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30
#define PAGODA_ODD 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31
#else
#define PAGODA_IOTA 0, 1, 2, 3, 4, 5, 6, 7
#define PAGODA_EVEN 0, 2, 4, 6, 8, 10, 12, 14
#define PAGODA_ODD 1, 3, 5, 7, 9, 11, 13, 15
#endif

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Adjacent lanes summed pairwise: x's pairs fill the low half, y's the high half.
PAGODA_INLINE vfloat merge_pairs(vfloat x, vfloat y) {
  const vint even = {PAGODA_EVEN}, odd = {PAGODA_ODD};
  return __builtin_shuffle(x, y, even) + __builtin_shuffle(x, y, odd);
}

// W vectors in, one out: lane j holds the sum of a[j]'s lanes. Each merge level halves the
// partial sums per key and keeps the keys in order, so log2(W) levels leave one sum per lane.
PAGODA_INLINE vfloat transpose_sum(vfloat* a) {
#pragma GCC unroll 16
  for (int n = W; n > 1; n /= 2) {
#pragma GCC unroll 16
    for (int i = 0; i < n / 2; ++i) a[i] = merge_pairs(a[2 * i], a[2 * i + 1]);
  }
  return a[0];
}

// exp for x <= 0 (scores minus their running max); below -87 (or -inf) it is 0.
PAGODA_INLINE float exp_nonpositive(float x) {
  const float clamped = std::max(x, -87.0f);
  const float n = std::nearbyint(clamped * pagoda::kLog2e);
  const float r = clamped - n * pagoda::kLn2Hi - n * pagoda::kLn2Lo;
  const float p = pagoda::exp_poly(r);
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? 0.0f : p * scale;
}

// The same on W lanes; adding and subtracting 1.5 * 2^23 rounds to the nearest integer.
PAGODA_INLINE vfloat exp_nonpositive(vfloat x) {
  const vfloat clamped = x < -87.0f ? splat(-87.0f) : x;
  const vfloat shifter = splat(12582912.0f);
  const vfloat n = (clamped * pagoda::kLog2e + shifter) - shifter;
  const vfloat r = clamped - n * pagoda::kLn2Hi - n * pagoda::kLn2Lo;
  const vfloat p = pagoda::exp_poly(r);
  const vint bits = (__builtin_convertvector(n, vint) + 127) << 23;
  vfloat scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? splat(0.0f) : p * scale;
}

// soft_cap * tanh(s / soft_cap) on every lane; out of line, as the tanh calls would spill the caller's registers.
__attribute__((noinline)) void soft_cap_lanes_slow(float* lanes, float soft_cap) {
  for (int j = 0; j < W; ++j) lanes[j] = soft_cap * std::tanh(lanes[j] / soft_cap);
}
PAGODA_INLINE void soft_cap_lanes(vfloat& s, float soft_cap) {
  float lanes[W];
  storev(lanes, s);
  soft_cap_lanes_slow(lanes, soft_cap);
  s = loadv(lanes);
}

// A head row as float32, zero-padded to `padded` (a multiple of W) so the vector loops need no tails.
inline void widen_row(const float* src, float* dst, int64_t dim, int64_t padded) {
  std::memcpy(dst, src, static_cast<size_t>(dim) * sizeof(float));
  std::fill(dst + dim, dst + padded, 0.0f);
}
// bf16 rows widen in chunks of 2W elements, each chunk's even elements first, then its odd ones:
// a chunk is one load, a shift and a mask. Queries, keys and values share the order, so the dot
// products never see it, and store_row puts the output back in order.
inline void widen_row(const bf16* src, float* dst, int64_t dim, int64_t padded) {
  const auto* bits = reinterpret_cast<const uint16_t*>(src);
  int64_t d = 0;
  for (; d + 2 * W <= dim; d += 2 * W) {
    vuint pairs;  // lane i: element 2i in the low half, 2i + 1 in the high half
    std::memcpy(&pairs, bits + d, sizeof(pairs));
    const vuint even = pairs << 16, odd = pairs & 0xFFFF0000u;  // bf16 is the top half of a float32
    std::memcpy(dst + d, &even, sizeof(even));
    std::memcpy(dst + d + W, &odd, sizeof(odd));
  }
  for (; d < dim; ++d) {
    const uint32_t wide = static_cast<uint32_t>(bits[d]) << 16;
    std::memcpy(dst + d, &wide, sizeof(wide));
  }
  std::fill(dst + dim, dst + padded, 0.0f);
}
inline void widen_row(const half* src, float* dst, int64_t dim, int64_t padded) {
  for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<float>(src[d]);
  std::fill(dst + dim, dst + padded, 0.0f);
}

// An output row, scaled by `inv`, in the model dtype and the natural element order.
template <typename T>
inline void store_row(T* dst, const float* acc, int64_t dim, float inv) {
  for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(acc[d] * inv);
}
inline void store_row(bf16* dst, const float* acc, int64_t dim, float inv) {
  int64_t d = 0;
  for (; d + 2 * W <= dim; d += 2 * W) {  // undo widen_row's even/odd order
    const vfloat even = loadv(acc + d) * inv, odd = loadv(acc + d + W) * inv;
#if PAGODA_W16
    const vint low = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
    const vint high = {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
#else
    const vint low = {0, 8, 1, 9, 2, 10, 3, 11};
    const vint high = {4, 12, 5, 13, 6, 14, 7, 15};
#endif
    auto* bits = reinterpret_cast<uint16_t*>(dst + d);
    store_bf16(bits, __builtin_shuffle(even, odd, low));  // rounds as static_cast<bf16> does
    store_bf16(bits + W, __builtin_shuffle(even, odd, high));
  }
  for (; d < dim; ++d) dst[d] = static_cast<bf16>(acc[d] * inv);
}

// Where widen_row puts element d of a row of T (bf16: the even/odd order of each 2W chunk).
template <typename T>
inline int64_t widened_index(int64_t d, int64_t dim) {
  if constexpr (std::is_same_v<T, bf16>) {
    const int64_t chunk = d - d % (2 * W), e = d % (2 * W);
    if (chunk + 2 * W <= dim) return chunk + (e % 2 == 0 ? e / 2 : W + e / 2);
  }
  return d;
}

// -- fp8 cache elements ---------------------------------------------------------------------------

struct fp8_e4m3 {
  uint8_t bits;
};
struct fp8_e5m2 {
  uint8_t bits;
};
template <typename C>
constexpr bool kIsFp8 = std::is_same_v<C, fp8_e4m3> || std::is_same_v<C, fp8_e5m2>;
// Decoded values (the binary16 reading of the byte) are the fp8 value divided by this.
template <typename C>
constexpr float kFp8Factor = std::is_same_v<C, fp8_e4m3> ? 256.0f : 1.0f;

// The binary16 bit pattern whose value is the fp8 value / kFp8Factor: e4m3's exponent (bias 7) and
// 3 mantissa bits land in binary16's (bias 15) fields, so the value is 2^-8 of the true one,
// subnormals included; e5m2 has binary16's exponent and is its top byte.
template <typename C>
PAGODA_INLINE uint16_t fp8_half_bits(uint8_t b) {
  if constexpr (std::is_same_v<C, fp8_e4m3>) {
    return static_cast<uint16_t>(((b & 0x80u) << 8) | ((b & 0x7Fu) << 7));
  } else {
    return static_cast<uint16_t>(b << 8);
  }
}

// W fp8 bytes as W floats (each the fp8 value / kFp8Factor), converted in registers.
template <typename C>
PAGODA_INLINE vfloat load_fp8(const uint8_t* p) {
#if PAGODA_W16
  const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  __m256i h;
  if constexpr (std::is_same_v<C, fp8_e4m3>) {
    h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8),
                        _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7));
  } else {
    h = _mm256_slli_epi16(w, 8);
  }
  return reinterpret_cast<vfloat>(_mm512_cvtph_ps(h));
#elif defined(__AVX2__) && defined(__F16C__)
  const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  __m128i h;
  if constexpr (std::is_same_v<C, fp8_e4m3>) {
    h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8),
                     _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7F)), 7));
  } else {
    h = _mm_slli_epi16(w, 8);
  }
  return reinterpret_cast<vfloat>(_mm256_cvtph_ps(h));
#else
  float lanes[W];
  for (int j = 0; j < W; ++j) lanes[j] = pagoda::half_to_float(fp8_half_bits<C>(p[j]));
  return loadv(lanes);
#endif
}

typedef uint8_t vu8 __attribute__((vector_size(W)));

// W floats (already divided by the scale) stored as fp8: saturated to the largest finite value,
// rounded to nearest even, as torch rounds float32 to float8 (which gives NaN past the range instead).
template <typename C>
PAGODA_INLINE void store_fp8(uint8_t* dst, vfloat x) {
  constexpr bool e4m3 = std::is_same_v<C, fp8_e4m3>;
  constexpr float kMax = e4m3 ? 448.0f : 57344.0f;
  constexpr int kDropped = e4m3 ? 20 : 21;  // float32 mantissa bits the format drops
  constexpr uint32_t kRebias = e4m3 ? (120u << 3) : (112u << 2);  // exponent bias 127 -> 7 (15)
  constexpr float kMinNormal = e4m3 ? 0x1p-6f : 0x1p-14f;
  // Below the smallest normal a value rounds to a multiple of the subnormal step, which is the ulp of kMagic.
  constexpr float kMagic = e4m3 ? 0x1p14f : 0x1p7f;
  const vuint bits = reinterpret_cast<vuint>(x);
  const vuint sign = (bits >> 24) & 0x80u;
  vfloat a = reinterpret_cast<vfloat>(bits & 0x7FFFFFFFu);
  a = a > kMax ? splat(kMax) : a;
  const vuint u = reinterpret_cast<vuint>(a);
  const vuint normal = ((u + ((1u << (kDropped - 1)) - 1u) + ((u >> kDropped) & 1u)) >> kDropped) - kRebias;
  const vuint subnormal = reinterpret_cast<vuint>(a + kMagic) - pagoda::float_to_bits(kMagic);
  const vuint code = (a < kMinNormal ? subnormal : normal) | sign;
  const vu8 bytes = __builtin_convertvector(code, vu8);
  std::memcpy(dst, &bytes, sizeof(bytes));
}

// W elements of a model-dtype row as floats, in their natural order.
PAGODA_INLINE vfloat load_elems(const float* p) { return loadv(p); }
PAGODA_INLINE vfloat load_elems(const bf16* p) { return load_bf16(reinterpret_cast<const uint16_t*>(p)); }
PAGODA_INLINE vfloat load_elems(const half* p) {
#if PAGODA_W16
  return reinterpret_cast<vfloat>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(__F16C__)
  return reinterpret_cast<vfloat>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  float lanes[W];
  for (int j = 0; j < W; ++j) lanes[j] = static_cast<float>(p[j]);
  return loadv(lanes);
#endif
}

// A new K or V row of the model dtype into the fp8 cache: saturate(x / scale).
template <typename C, typename T>
inline void store_fp8_row(uint8_t* dst, const T* src, int64_t n, float scale) {
  const vfloat s = splat(scale);
  int64_t d = 0;
  for (; d + W <= n; d += W) store_fp8<C>(dst + d, load_elems(src + d) / s);
  if (d < n) {
    float lanes[W] = {};
    uint8_t bytes[W];
    for (int64_t i = d; i < n; ++i) lanes[i - d] = static_cast<float>(src[i]);
    store_fp8<C>(bytes, loadv(lanes) / s);
    std::memcpy(dst + d, bytes, static_cast<size_t>(n - d));
  }
}

// An fp8 cache row widened to float32 (the fp8 value / kFp8Factor), zero-padded (the generic path).
template <typename C>
inline void widen_fp8_row(const C* src, float* dst, int64_t dim, int64_t padded) {
  const auto* bytes = reinterpret_cast<const uint8_t*>(src);
  int64_t d = 0;
  for (; d + W <= dim; d += W) storev(dst + d, load_fp8<C>(bytes + d));
  for (; d < dim; ++d) dst[d] = pagoda::half_to_float(fp8_half_bits<C>(bytes[d]));
  std::fill(dst + dim, dst + padded, 0.0f);
}
inline void widen_row(const fp8_e4m3* src, float* dst, int64_t dim, int64_t padded) {
  widen_fp8_row(src, dst, dim, padded);
}
inline void widen_row(const fp8_e5m2* src, float* dst, int64_t dim, int64_t padded) {
  widen_fp8_row(src, dst, dim, padded);
}
// A model-dtype row as float32 in natural element order (queries meeting an fp8 cache).
template <typename T>
inline void widen_row_natural(const T* src, float* dst, int64_t dim, int64_t padded) {
  for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<float>(src[d]);
  std::fill(dst + dim, dst + padded, 0.0f);
}

#if defined(__AVX512BF16__) && PAGODA_W16
#define PAGODA_BF16_DOT 1
// A bf16 dot product instruction (vdpbf16ps): products of bf16 pairs are exact in float32, so
// scores from it match widening both rows first. The float32 probabilities meet V as two bf16
// parts (the rounded value and what rounding left), 16 bits of mantissa: rounding them once
// would add an error as large as the output's own bf16 rounding (measured), for ~5% speed.
typedef __m512bh vbf16;
PAGODA_INLINE vbf16 load_bf16(const uint16_t* p) {
  vbf16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
PAGODA_INLINE vfloat dot_bf16(vfloat acc, vbf16 a, vbf16 b) {
  return reinterpret_cast<vfloat>(_mm512_dpbf16_ps(reinterpret_cast<__m512>(acc), a, b));
}
#else
#define PAGODA_BF16_DOT 0
#endif

// Prefetch into L2 (prefetcht2): on the EPYC this was tuned on, a decode read from DRAM runs about
// twice as fast with it; prefetcht0 and prefetchnta did no better than no prefetch at all.
constexpr int kPrefetchLocality = 1;
// How far a thread's read-ahead runs in front of its reads, in (K line, V line) pairs: about two
// blocks of a small model's decode, enough to cover DRAM latency at the rate a core reads.
constexpr int64_t kReadAheadPairs = 256;

struct WorkItem {
  int32_t seq;
  int32_t token_begin;  // flat-batch rows of this tile
  int32_t token_end;
  int32_t kv_begin;  // KV heads of this item
  int32_t kv_end;
  int32_t key_begin;  // key positions [key_begin, key_end) of a decode split over the threads
  int32_t key_end;
  int32_t part;  // -1: the item writes the output; else its partial result's slot, merged afterwards
  int64_t cost;  // rows x keys: bigger items are handed out first
};

struct Layout {
  int64_t num_heads, num_kv_heads, head_dim, block_size, group;
  int64_t q_token_stride, q_head_stride;
  int64_t out_token_stride;  // out is contiguous [tokens, heads, head_dim]
  int64_t cache_block_stride, cache_token_stride;  // for kv_cache[0] and kv_cache[1] alike
  int64_t block_table_stride;
  float scale;
  int64_t window;  // 0: none
  float soft_cap;  // 0: none
  float v_mult;    // the output's factor: v_scale x kFp8Factor for an fp8 cache, else 1
};

// Everything an item reads and writes: queries and output in the model dtype T, the cache in C.
template <typename T, typename C = T>
struct Inputs {
  using Elem = T;
  using CacheElem = C;
  const T* query;
  const C* key_cache;
  const C* value_cache;
  const int32_t* block_tables;
  const int32_t* query_start;
  const int32_t* seq_lens;
  T* out;
  // Split decodes: per part, [num_heads][head_dim + 2] floats (the unnormalized output in natural
  // element order, then the running max and sum).
  float* partials;
  Layout L;
};

// Writes one finished row: normalized into the output, or as a part's partial result.
// `index(d)` is where the accumulator holds element d.
template <class In, typename Index>
inline void finish_row(const WorkItem& item, const In& in, int64_t token, int64_t head, const float* acc,
                       float row_max, float row_sum, Index index) {
  using T = typename In::Elem;
  const int64_t dim = in.L.head_dim;
  const float v_mult = in.L.v_mult;
  if (item.part >= 0) {
    float* dst = in.partials + (item.part * in.L.num_heads + head) * (dim + 2);
    for (int64_t d = 0; d < dim; ++d) dst[d] = acc[index(d)] * v_mult;
    dst[dim] = row_max;
    dst[dim + 1] = row_sum;
    return;
  }
  T* dst = in.out + token * in.L.out_token_stride + head * dim;
  const float inv = v_mult / row_sum;  // row_sum > 0: every query sees at least its own key
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t d = 0; d < dim; ++d) dst[d] = acc[index(d)] * inv;
  } else {
    for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(acc[index(d)] * inv);
  }
}

// Key positions [lo, hi] that some query row of the item sees.
struct KeySpan {
  int64_t lo, hi;
};
inline KeySpan key_span(const WorkItem& item, const int32_t* query_start, const int32_t* seq_lens,
                        const Layout& L) {
  const int64_t first_token = query_start[item.seq];
  const int64_t context_len = seq_lens[item.seq] - (query_start[item.seq + 1] - first_token);
  const int64_t first_pos = context_len + (item.token_begin - first_token);
  const int64_t last_pos = context_len + (item.token_end - 1 - first_token);
  const int64_t lowest = L.window > 0 ? std::max<int64_t>(0, first_pos - L.window + 1) : 0;
  return {std::max<int64_t>(lowest, item.key_begin), std::min<int64_t>(last_pos, item.key_end - 1)};
}

// Block b of an item's key span: its first key position, where the item's KV heads start in the
// cache, and which of its keys (block-relative, [lo, hi]) some row of the item may read.
struct BlockSpan {
  int64_t start, base, lo, hi;
};
inline BlockSpan block_span(const WorkItem& item, const KeySpan& span, const int32_t* table, const Layout& L,
                            int64_t b) {
  const int64_t start = b * L.block_size;
  return {start, static_cast<int64_t>(table[b]) * L.cache_block_stride + item.kv_begin * L.head_dim,
          std::max(start, span.lo) - start, std::min(start + L.block_size - 1, span.hi) - start};
}

// The items of one thread, claimed from the shared counter in order (biggest first), up to a
// window ahead of the one it works on, so its read-ahead knows which blocks come next.
class ItemQueue {
 public:
  ItemQueue(const WorkItem* items, int64_t n, std::atomic<int64_t>& next) : items_(items), n_(n), next_(next) {}

  // The item at queue position `pos` (0: the thread's first), claiming more as needed; nullptr
  // when the batch has no more, or for now when `pos` is a whole window ahead of the work.
  const WorkItem* at(int64_t pos) {
    while (pos >= tail_) {
      if (exhausted_ || tail_ - head_ == kWindow) return nullptr;
      const int64_t i = next_.fetch_add(1, std::memory_order_relaxed);
      if (i >= n_) {
        exhausted_ = true;
        return nullptr;
      }
      claimed_[tail_ % kWindow] = i;
      ++tail_;
    }
    return &items_[claimed_[pos % kWindow]];
  }
  void pop() { ++head_; }

 private:
  static constexpr int64_t kWindow = 32;
  const WorkItem* items_;
  int64_t n_;
  std::atomic<int64_t>& next_;
  int64_t claimed_[kWindow];
  int64_t head_ = 0, tail_ = 0;
  bool exhausted_ = false;
};

// A cursor over the K/V cache lines a thread reads, in the order it reads them, running a fixed
// number of lines in front of the reads: the kernels issue as many prefetches per key as the key
// has lines, so the distance holds, the prefetches spread evenly over the work, and the next
// block (or the next item's first block) is in L2 before the loads reach it. Random block
// placement defeats the hardware prefetchers at every block boundary; this does not care.
class ReadAhead {
 public:
  ReadAhead(ItemQueue& queue, const void* key_cache, const void* value_cache, const int32_t* block_tables,
            const int32_t* query_start, const int32_t* seq_lens, const Layout& L, int64_t element_size)
      : queue_(queue),
        k_cache_(static_cast<const char*>(key_cache)),
        v_cache_(static_cast<const char*>(value_cache)),
        block_tables_(block_tables),
        query_start_(query_start),
        seq_lens_(seq_lens),
        L_(L),
        es_(element_size) {}

  // Called as the thread starts on queue position `pos`: a cursor behind it (at the start, or
  // after reads outran it) jumps there and runs `distance` pairs ahead at once.
  void catch_up(int64_t pos, int64_t distance) {
    if (started_ && pos_ >= pos) return;
    started_ = true;
    pos_ = pos;
    enter_item(*queue_.at(pos));
    issue(distance);
  }

  // The K lines of the next `pairs` pairs into `dst` (their V lines lie value_offset() further),
  // for the kernels to prefetch from their inner loops; past the last item, a harmless address.
  __attribute__((noinline)) void fill(const char** dst, int64_t pairs) {
    for (int64_t i = 0; i < pairs;) {
      if (line_ == lines_ && !next_run()) {
        for (; i < pairs; ++i) dst[i] = k_cache_;
        return;
      }
      const int64_t m = std::min(pairs - i, lines_ - line_);
      for (int64_t e = i + m; i < e; ++i, ++line_) dst[i] = k_ + line_ * 64;
    }
  }
  int64_t value_offset() const { return v_cache_ - k_cache_; }

  // Prefetch the next `pairs` (K line, V line) pairs.
  __attribute__((noinline)) void issue(int64_t pairs) {
    while (pairs > 0) {
      if (line_ == lines_ && !next_run()) return;
      const int64_t m = std::min(pairs, lines_ - line_);
      for (int64_t i = line_; i < line_ + m; ++i) {
        __builtin_prefetch(k_ + i * 64, 0, kPrefetchLocality);
        __builtin_prefetch(k_ + i * 64 + value_offset(), 0, kPrefetchLocality);
      }
      line_ += m;
      pairs -= m;
    }
  }

 private:
  bool next_run() {
    if (run_ + 1 < runs_) {
      ++run_;
      set_run();
      return true;
    }
    if (block_ + 1 < block_end_) {
      ++block_;
      enter_block();
      return true;
    }
    const WorkItem* item = queue_.at(pos_ + 1);
    if (item == nullptr) return false;  // the batch is done, or the window is full for now
    ++pos_;
    enter_item(*item);
    return true;
  }

  void enter_item(const WorkItem& item) {
    const KeySpan span = key_span(item, query_start_, seq_lens_, L_);
    first_key_ = span.lo;
    last_key_ = span.hi;
    block_ = span.lo / L_.block_size;
    block_end_ = span.hi / L_.block_size + 1;
    table_ = block_tables_ + item.seq * L_.block_table_stride;
    head_offset_ = item.kv_begin * L_.head_dim;
    head_bytes_ = (item.kv_end - item.kv_begin) * L_.head_dim * es_;
    enter_block();
  }

  void enter_block() {
    const int64_t start = block_ * L_.block_size;
    const int64_t row_lo = std::max<int64_t>(first_key_ - start, 0);
    const int64_t row_hi = std::min<int64_t>(L_.block_size - 1, last_key_ - start);
    const int64_t token_bytes = L_.cache_token_stride * es_;
    base_ = (static_cast<int64_t>(table_[block_]) * L_.cache_block_stride + head_offset_) * es_ + row_lo * token_bytes;
    if (head_bytes_ == token_bytes) {  // every KV head of the block: one contiguous run
      runs_ = 1;
      run_bytes_ = (row_hi - row_lo + 1) * head_bytes_;
    } else {
      runs_ = row_hi - row_lo + 1;
      run_bytes_ = head_bytes_;
    }
    run_ = 0;
    set_run();
  }

  void set_run() {
    const int64_t offset = base_ + run_ * L_.cache_token_stride * es_;
    const auto k = reinterpret_cast<uintptr_t>(k_cache_ + offset);
    k_ = reinterpret_cast<const char*>(k & ~uintptr_t{63});
    lines_ = static_cast<int64_t>(((k + run_bytes_ - 1) >> 6) - (k >> 6) + 1);
    line_ = 0;
  }

  ItemQueue& queue_;
  const char* k_cache_;
  const char* v_cache_;
  const int32_t* block_tables_;
  const int32_t* query_start_;
  const int32_t* seq_lens_;
  const Layout& L_;
  int64_t es_;
  bool started_ = false;
  int64_t pos_ = 0;  // queue position of the cursor's item
  const int32_t* table_ = nullptr;
  int64_t first_key_ = 0, last_key_ = 0, head_offset_ = 0, head_bytes_ = 0;
  int64_t block_ = 0, block_end_ = 0;
  int64_t base_ = 0, runs_ = 0, run_ = 0, run_bytes_ = 0;
  const char* k_ = nullptr;
  int64_t lines_ = 0, line_ = 0;
};

// The online-softmax step for one query row and the W keys of the chunk at c0, of which
// [jlo, jhi] are visible: caps and masks the scores, updates the running max and sum, and
// returns the weights (0 for the masked keys) and, in `correction`, the factor for the row's
// accumulator (0 on its first keys). Branch-free: a mispredicted branch here would also throw
// away the loads running ahead, the memory-level parallelism a decode lives on.
template <bool SoftCap>
PAGODA_INLINE vfloat softmax_step(vfloat s, int64_t c0, int64_t jlo, int64_t jhi, float soft_cap, float& row_max,
                                  float& row_sum, float& correction) {
  if constexpr (SoftCap) soft_cap_lanes(s, soft_cap);
  if (jhi - jlo != W - 1) {  // a partial chunk: the lanes of hidden keys get no weight
    const vint iota = {PAGODA_IOTA};
    const vint key = iota + static_cast<int32_t>(c0);
    s = (key >= static_cast<int32_t>(jlo)) & (key <= static_cast<int32_t>(jhi)) ? s : splat(kNegInf);
  }
  const float new_max = std::max(row_max, hmax(s));
  correction = exp_nonpositive(row_max - new_max);
  row_max = new_max;
  const vfloat p = exp_nonpositive(s - new_max);
  row_sum = row_sum * correction + hsum(p);
  return p;
}

template <int RB>
struct RowVectors {
  vfloat v[RB];
};

// The K/V lines a block's keys prefetch, a pointer per (K line, V line) pair: the read-ahead
// fills them as the block starts (the cursor's bookkeeping stays out of the vector loops, where
// a call would spill every register). The score loop prefetches a key's K lines as it reads the
// key, the V loop its V lines: spread over both halves of the work, measured faster than both
// at once.
struct KeyPrefetch {
  const char* const* lines;  // key j's: lines[j * Rate .. j * Rate + Rate); nullptr: none
  int64_t value_offset;      // a V line lies this many bytes past its K line
};
template <int Rate, bool Value>
PAGODA_INLINE void prefetch_key(const KeyPrefetch& pf, int64_t j) {
  if (pf.lines == nullptr) return;
#pragma GCC unroll 8
  for (int r = 0; r < Rate; ++r) {
    const char* line = pf.lines[j * Rate + r];
    __builtin_prefetch(Value ? line + pf.value_offset : line, 0, kPrefetchLocality);
  }
}

// How a score tree reads keys: float32 rows (W lanes a vector, multiply-adds), or bf16 rows
// read in place (32 elements a vector, vdpbf16ps).
struct Float32Keys {
  using Elem = float;
  using Vec = vfloat;
  static constexpr int kElems = W;
  static PAGODA_INLINE Vec load(const float* p) { return loadv(p); }
  static PAGODA_INLINE vfloat first(Vec q, Vec k) { return q * k; }
  static PAGODA_INLINE vfloat dot(vfloat acc, Vec q, Vec k) { return acc + q * k; }
};
// fp8 rows read in place, W elements a vector converted in registers (values / kFp8Factor).
template <typename C>
struct Fp8Keys {
  using Elem = uint8_t;
  using Vec = vfloat;
  static constexpr int kElems = W;
  static PAGODA_INLINE Vec load(const uint8_t* p) { return load_fp8<C>(p); }
  static PAGODA_INLINE vfloat first(Vec q, Vec k) { return q * k; }
  static PAGODA_INLINE vfloat dot(vfloat acc, Vec q, Vec k) { return acc + q * k; }
};
#if PAGODA_BF16_DOT
struct Bf16Keys {
  using Elem = uint16_t;
  using Vec = vbf16;
  static constexpr int kElems = 32;
  static PAGODA_INLINE Vec load(const uint16_t* p) { return load_bf16(p); }
  static PAGODA_INLINE vfloat first(Vec q, Vec k) { return dot_bf16(vfloat{}, q, k); }
  static PAGODA_INLINE vfloat dot(vfloat acc, Vec q, Vec k) { return dot_bf16(acc, q, k); }
};
#endif

// Scores of RB query rows (q, in registers) against keys [j, j + N): one vector per row with
// a lane per key once N == W. Keys outside [jlo, jhi] are never read (a block's tail may be
// unwritten): their lanes hold a visible key's score, for the caller to mask. Depth first, so
// only one partial vector per tree level and row is live.
template <class Keys, int NV, int RB, int N>
PAGODA_INLINE RowVectors<RB> score_tree(const typename Keys::Vec (&q)[RB][NV], const typename Keys::Elem* keys,
                                        int64_t stride, int64_t j, int64_t jlo, int64_t jhi, const KeyPrefetch& pf) {
  RowVectors<RB> r;
  if constexpr (N == 1) {
    const int64_t readable = std::min(std::max(j, jlo), jhi);  // a stand-in for a hidden key, masked later
    constexpr int kRate = (NV * Keys::kElems * static_cast<int>(sizeof(typename Keys::Elem)) + 63) / 64;
    if (j == readable) prefetch_key<kRate, false>(pf, j);
    typename Keys::Vec k[NV];
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) k[v] = Keys::load(keys + readable * stride + v * Keys::kElems);
#pragma GCC unroll 4
    for (int i = 0; i < RB; ++i) {
      vfloat s = Keys::first(q[i][0], k[0]);
#pragma GCC unroll 16
      for (int v = 1; v < NV; ++v) s = Keys::dot(s, q[i][v], k[v]);
      r.v[i] = s;
    }
  } else {
    const RowVectors<RB> a = score_tree<Keys, NV, RB, N / 2>(q, keys, stride, j, jlo, jhi, pf);
    const RowVectors<RB> b = score_tree<Keys, NV, RB, N / 2>(q, keys, stride, j + N / 2, jlo, jhi, pf);
#pragma GCC unroll 4
    for (int i = 0; i < RB; ++i) r.v[i] = merge_pairs(a.v[i], b.v[i]);
  }
  return r;
}

// RB query rows that see the same keys [lo, hi] of one block (the query heads of a GQA group
// at one position), `dp` floats apart in q and acc: online-softmax update of their max, sum and
// accumulator, W keys at a time, each K/V vector loaded once for all RB rows. `keys` and
// `values` are float32 rows `stride` floats apart; NV vectors per row.
template <class Keys, int NV, int RB, bool SoftCap>
inline void attend_rows(const float* q, float* acc, int64_t dp, float* row_max, float* row_sum,
                        const typename Keys::Elem* keys, const typename Keys::Elem* values, int64_t stride,
                        int64_t lo, int64_t hi, float soft_cap, const KeyPrefetch& pf) {
  vfloat qv[RB][NV];
#pragma GCC unroll 4
  for (int i = 0; i < RB; ++i) {
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) qv[i][v] = loadv(q + i * dp + v * W);
  }
  for (int64_t c0 = lo - lo % W; c0 <= hi; c0 += W) {
    const int64_t jlo = std::max(lo, c0), jhi = std::min(hi, c0 + W - 1);
    const RowVectors<RB> scores = score_tree<Keys, NV, RB, W>(qv, keys, stride, c0, jlo, jhi, pf);
    float weights[RB][W];
    vfloat a[RB][NV];
#pragma GCC unroll 4
    for (int i = 0; i < RB; ++i) {
      float correction;
      storev(weights[i],
             softmax_step<SoftCap>(scores.v[i], c0, jlo, jhi, soft_cap, row_max[i], row_sum[i], correction));
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) a[i][v] = loadv(acc + i * dp + v * W) * correction;
    }
    for (int64_t j = jlo; j <= jhi; ++j) {
      prefetch_key<(NV * W * static_cast<int>(sizeof(typename Keys::Elem)) + 63) / 64, true>(pf, j);
      vfloat value[NV];
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) value[v] = Keys::load(values + j * stride + v * W);
#pragma GCC unroll 4
      for (int i = 0; i < RB; ++i) {
        const vfloat w = splat(weights[i][j - c0]);
#pragma GCC unroll 16
        for (int v = 0; v < NV; ++v) a[i][v] += w * value[v];
      }
    }
#pragma GCC unroll 4
    for (int i = 0; i < RB; ++i) {
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) storev(acc + i * dp + v * W, a[i][v]);
    }
  }
}

// attend_rows for RB = min(4, rows) rows, with or without a soft cap: each variant a
// straight-line kernel without calls in its loops (a call would spill the vector registers).
template <int NV, class Keys = Float32Keys>
inline void attend_group(int64_t rows, const float* q, float* acc, int64_t dp, float* row_max, float* row_sum,
                         const typename Keys::Elem* keys, const typename Keys::Elem* values, int64_t stride,
                         int64_t lo, int64_t hi, float soft_cap, const KeyPrefetch& pf) {
#define PAGODA_ROWS(RB, CAP) \
  attend_rows<Keys, NV, RB, CAP>(q, acc, dp, row_max, row_sum, keys, values, stride, lo, hi, soft_cap, pf)
  if (soft_cap > 0.0f) {
    switch (rows) {
      case 1: PAGODA_ROWS(1, true); break;
      case 2: PAGODA_ROWS(2, true); break;
      case 3: PAGODA_ROWS(3, true); break;
      default: PAGODA_ROWS(4, true);
    }
  } else {
    switch (rows) {
      case 1: PAGODA_ROWS(1, false); break;
      case 2: PAGODA_ROWS(2, false); break;
      case 3: PAGODA_ROWS(3, false); break;
      default: PAGODA_ROWS(4, false);
    }
  }
#undef PAGODA_ROWS
}

// One row, nv vectors (any head_dim): the same steps with runtime loops.
inline void attend_row_any(const float* q, float* acc, float& row_max, float& row_sum, const float* keys,
                           const float* values, int64_t stride, int64_t lo, int64_t hi, int64_t nv, float soft_cap) {
  for (int64_t c0 = lo - lo % W; c0 <= hi; c0 += W) {
    const int64_t jlo = std::max(lo, c0), jhi = std::min(hi, c0 + W - 1);
    vfloat part[W];
    for (int jj = 0; jj < W; ++jj) {
      const int64_t j = c0 + jj;
      vfloat s = vfloat{};
      if (j >= jlo && j <= jhi) {
        for (int64_t v = 0; v < nv; ++v) s += loadv(q + v * W) * loadv(keys + j * stride + v * W);
      }
      part[jj] = s;
    }
    float correction;
    float weights[W];
    const vfloat scores = transpose_sum(part);
    storev(weights, soft_cap > 0.0f ? softmax_step<true>(scores, c0, jlo, jhi, soft_cap, row_max, row_sum, correction)
                                    : softmax_step<false>(scores, c0, jlo, jhi, soft_cap, row_max, row_sum, correction));
    for (int64_t v = 0; v < nv; ++v) {
      vfloat a = loadv(acc + v * W) * correction;
      for (int64_t j = jlo; j <= jhi; ++j) a += splat(weights[j - c0]) * loadv(values + j * stride + v * W);
      storev(acc + v * W, a);
    }
  }
}

// -- Tiles of query tokens: lanes are query rows --------------------------------------------------
//
// A tile of query tokens reads each key once per query row, so it is compute-bound. The per-row
// path above puts keys in lanes and spends much of its time summing lanes (the shuffle tree) and
// in each row's serial softmax chain. Here a vector holds W query rows instead: the tile's queries
// are transposed once per item (q_t: per W rows, head_dim vectors), a key's score for W rows is
// head_dim multiply-adds of q_t by the key's broadcast elements, the online softmax's max, exp and
// sum are plain lane-wise operations (no lane sums at all), and the output accumulates transposed
// (o_t: per W rows, head_dim vectors), V's elements broadcast against the W rows' probabilities.
// K and V are read as rows, in place for float32, so no block is ever transposed; the output is
// transposed back once per item.

// Row vectors x keys of the score pass and row vectors x head elements of the P x V pass, each an
// accumulator register: AVX-512's 32 registers take 2 x 8 (plus two query vectors), AVX2's 16 take 1 x 8.
constexpr int kTileRowVectors = PAGODA_W16 ? 2 : 1;
constexpr int kTileKeys = 8;
constexpr int kTileElems = 8;

// How a score pass reads queries and keys. Float32: q_t holds, per row vector, dp vectors (lane i:
// row i's element), each meeting one broadcast key element. Bf16 (vdpbf16ps): dp / 2 vectors whose
// lane i is row i's element pair (2e, 2e + 1), each meeting the key's pair broadcast from the cache
// in place: half the instructions, and products of bf16 pairs are exact in float32.
struct TileFloat32 {
  using Q = float;
  using K = float;
  using QVec = vfloat;
  using KVec = vfloat;
  static constexpr int kElems = 1;  // head elements a step
  static PAGODA_INLINE QVec query(const float* q_t, int64_t dp, int r, int64_t step) {
    return loadv(q_t + (r * dp + step) * W);
  }
  static PAGODA_INLINE KVec key(const float* row, int64_t step) { return splat(row[step]); }
  static PAGODA_INLINE vfloat dot(vfloat acc, QVec q, KVec k) { return acc + q * k; }
};
#if PAGODA_BF16_DOT
struct TileBf16 {
  using Q = uint32_t;
  using K = uint16_t;
  using QVec = vbf16;
  using KVec = vbf16;
  static constexpr int kElems = 2;
  static PAGODA_INLINE QVec query(const uint32_t* q_t, int64_t dp, int r, int64_t step) {
    QVec v;
    std::memcpy(&v, q_t + (r * dp / 2 + step) * W, sizeof(v));
    return v;
  }
  static PAGODA_INLINE KVec key(const uint16_t* row, int64_t step) {
    int32_t pair;
    std::memcpy(&pair, row + 2 * step, sizeof(pair));
    return reinterpret_cast<vbf16>(_mm512_set1_epi32(pair));
  }
  static PAGODA_INLINE vfloat dot(vfloat acc, QVec q, KVec k) { return dot_bf16(acc, q, k); }
};
#endif

// Scores of RV row vectors (q_t) against keys k0 .. k0 + KT - 1 (rows of `keys`, `stride`
// elements apart): s[r * kTileKeys + k].
template <class Tile, int NV, int RV, int KT>
PAGODA_INLINE void scores_t(const typename Tile::Q* q_t, int64_t dp, const typename Tile::K* keys, int64_t stride,
                            int64_t k0, vfloat* s) {
  vfloat acc[RV][KT];
#pragma GCC unroll 4
  for (int r = 0; r < RV; ++r) {
#pragma GCC unroll 8
    for (int k = 0; k < KT; ++k) acc[r][k] = vfloat{};
  }
  const typename Tile::K* key = keys + k0 * stride;
#pragma GCC unroll 2
  for (int64_t step = 0; step < NV * W / Tile::kElems; ++step) {
    typename Tile::QVec qv[RV];
#pragma GCC unroll 4
    for (int r = 0; r < RV; ++r) qv[r] = Tile::query(q_t, dp, r, step);
#pragma GCC unroll 8
    for (int k = 0; k < KT; ++k) {
      const typename Tile::KVec kb = Tile::key(key + k * stride, step);
#pragma GCC unroll 4
      for (int r = 0; r < RV; ++r) acc[r][k] = Tile::dot(acc[r][k], qv[r], kb);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < RV; ++r) {
#pragma GCC unroll 8
    for (int k = 0; k < KT; ++k) s[r * kTileKeys + k] = acc[r][k];
  }
}

// o_t (RV row vectors, dp vectors apart) = o_t * correction + P x V over keys [jlo, jhi] (p: a
// vector per key, p_stride vectors from one row vector's keys to the next's), for head elements
// [e0, e0 + kTileElems).
template <int RV>
PAGODA_INLINE void values_t(float* o_t, int64_t dp, const vfloat* correction, const vfloat* p, int64_t p_stride,
                            const float* values, int64_t stride, int64_t jlo, int64_t jhi, int64_t e0) {
  vfloat acc[RV][kTileElems];
#pragma GCC unroll 4
  for (int r = 0; r < RV; ++r) {
#pragma GCC unroll 8
    for (int e = 0; e < kTileElems; ++e) acc[r][e] = loadv(o_t + (r * dp + e0 + e) * W) * correction[r];
  }
  for (int64_t j = jlo; j <= jhi; ++j) {
    const float* value = values + j * stride + e0;
    vfloat pv[RV];
#pragma GCC unroll 4
    for (int r = 0; r < RV; ++r) pv[r] = p[r * p_stride + j];
#pragma GCC unroll 8
    for (int e = 0; e < kTileElems; ++e) {
      const vfloat vb = splat(value[e]);
#pragma GCC unroll 4
      for (int r = 0; r < RV; ++r) acc[r][e] += pv[r] * vb;
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < RV; ++r) {
#pragma GCC unroll 8
    for (int e = 0; e < kTileElems; ++e) storev(o_t + (r * dp + e0 + e) * W, acc[r][e]);
  }
}

// RV row vectors of one KV head against the keys [jlo, jhi] of one block (rows of `keys` and
// `values`, `stride` floats apart; block-relative, all readable): scores, online softmax (max and
// sum per lane), and accumulation into o_t. pos: each lane's query position; a lane sees the key
// at position block_start + j when pos - window < block_start + j <= pos. p: scratch of RV * bs vectors.
template <class Tile, int NV, int RV>
inline void attend_rows_t(const typename Tile::Q* q_t, float* o_t, vfloat* row_max, vfloat* row_sum, const vint* pos,
                          int64_t dp, const typename Tile::K* keys, int64_t key_stride, float score_scale,
                          const float* values, int64_t stride, int64_t bs, int64_t jlo, int64_t jhi,
                          int64_t block_start, int64_t window, float soft_cap, vfloat* p) {
  // scores into p, kTileKeys keys at a time (a chunk may start before jlo or end past jhi: it
  // stays inside the block, and the mask below drops those keys)
  for (int64_t k0 = jlo - jlo % kTileKeys; k0 <= jhi; k0 += kTileKeys) {
    vfloat s[RV * kTileKeys];
    if (k0 + kTileKeys <= bs) {
      scores_t<Tile, NV, RV, kTileKeys>(q_t, dp, keys, key_stride, k0, s);
    } else {
      for (int64_t k = k0; k < bs; ++k) scores_t<Tile, NV, RV, 1>(q_t, dp, keys, key_stride, k, s + (k - k0));
    }
    for (int r = 0; r < RV; ++r) {
      for (int64_t k = 0; k < kTileKeys && k0 + k < bs; ++k) p[r * bs + k0 + k] = s[r * kTileKeys + k];
    }
  }
  vfloat correction[RV];
  for (int r = 0; r < RV; ++r) {
    vfloat* pr = p + r * bs;
    vfloat m = row_max[r];
    for (int64_t j = jlo; j <= jhi; ++j) {
      vfloat x = pr[j] * score_scale;
      if (soft_cap > 0.0f) soft_cap_lanes(x, soft_cap);
      const vint key = vint{} + static_cast<int32_t>(block_start + j);
      const vint visible = window > 0 ? (key <= pos[r]) & (key > pos[r] - static_cast<int32_t>(window)) : key <= pos[r];
      x = visible ? x : splat(kNegInf);
      pr[j] = x;
      m = vmax(m, x);
    }
    // Lanes that have seen no key yet keep max -inf: their correction is 1 and their weights 0.
    const vint seen = m > splat(kNegInf);
    const vfloat c = exp_nonpositive(row_max[r] - m);
    correction[r] = seen ? c : splat(1.0f);
    vfloat sum = vfloat{};
    for (int64_t j = jlo; j <= jhi; ++j) {
      const vfloat x = pr[j];
      const vfloat e = x > splat(kNegInf) ? exp_nonpositive(x - m) : vfloat{};
      pr[j] = e;
      sum += e;
    }
    row_max[r] = m;
    row_sum[r] = row_sum[r] * correction[r] + sum;
  }
  for (int64_t e0 = 0; e0 < NV * W; e0 += kTileElems)
    values_t<RV>(o_t, dp, correction, p, bs, values, stride, jlo, jhi, e0);
}

// Line pairs to prefetch per key read: the lines of one head's K row.
inline int64_t lines_per_key(int64_t head_dim, int64_t element_size) { return (head_dim * element_size + 63) / 64; }

// One decode (a single query token) over the item's KV heads, or a tile of query tokens at a head_dim
// without a register-resident path (attend_tile_t takes the others), reading float32 rows in place
// or widening each block's rows into a float32 buffer first.
template <typename T, typename C, int NV>
void attend_item(const WorkItem& item, const Inputs<T, C>& in, ReadAhead& ahead, std::vector<float>& scratch,
                 std::vector<const char*>& lines) {
  const Layout& L = in.L;
  const int64_t dim = L.head_dim;
  const int64_t nv = NV > 0 ? NV : (dim + W - 1) / W;
  const int64_t dp = nv * W;  // padded head_dim
  // float32 and fp8 rows of a head_dim that fills whole vectors are read in place (fp8 converted in
  // registers); others are widened per block.
  constexpr bool kFp8Cache = kIsFp8<C>;
  // fp8 rows are converted in registers for a decode (each key read once; with NV > 0 this function
  // only sees decodes); a tile of the generic path widens each block once instead.
  const bool in_place = (std::is_same_v<C, float> || (kFp8Cache && NV > 0)) && dp == dim;
  const int64_t G = L.group, BS = L.block_size;
  const int64_t num_tokens = item.token_end - item.token_begin;
  const int64_t heads = item.kv_end - item.kv_begin;
  const int64_t head_rows = num_tokens * G;  // row = head * head_rows + token * G + member
  const int64_t rows = heads * head_rows;
  const int64_t first_token = in.query_start[item.seq];
  const int64_t context_len = in.seq_lens[item.seq] - (in.query_start[item.seq + 1] - first_token);

  // scratch: q [rows, dp] | acc [rows, dp] | max [rows] | sum [rows] | keys [BS, dp] | values [BS, dp]
  const size_t need = static_cast<size_t>(2 * rows * dp + 2 * rows + 2 * BS * dp);
  if (scratch.size() < need) scratch.resize(need);
  float* q = scratch.data();
  float* acc = q + rows * dp;
  float* row_max = acc + rows * dp;
  float* row_sum = row_max + rows;
  float* key_buf = row_sum + rows;
  float* value_buf = key_buf + BS * dp;

  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t t = 0; t < num_tokens; ++t) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t head = (item.kv_begin + h) * G + g;
        float* dst = q + (h * head_rows + t * G + g) * dp;
        const T* src = in.query + (item.token_begin + t) * L.q_token_stride + head * L.q_head_stride;
        if constexpr (kFp8Cache) {
          widen_row_natural(src, dst, dim, dp);  // the fp8 rows are read in natural order
        } else {
          widen_row(src, dst, dim, dp);
        }
        for (int64_t d = 0; d < dim; ++d) dst[d] *= L.scale;
      }
    }
  }
  std::fill(acc, acc + rows * dp, 0.0f);
  std::fill(row_max, row_max + rows, kNegInf);
  std::fill(row_sum, row_sum + rows, 0.0f);

  const int64_t first_pos = context_len + (item.token_begin - first_token);
  const KeySpan span = key_span(item, in.query_start, in.seq_lens, L);
  const int32_t* table = in.block_tables + item.seq * L.block_table_stride;
  const int64_t stride = in_place ? L.cache_token_stride : dp;
  const int64_t rate = lines_per_key(dim, sizeof(C));
  if (lines.size() < static_cast<size_t>(BS * rate)) lines.resize(static_cast<size_t>(BS * rate));

  for (int64_t b = span.lo / BS; b * BS <= span.hi; ++b) {
    const BlockSpan block = block_span(item, span, table, L, b);
    const int64_t block_start = block.start, block_base = block.base, union_lo = block.lo, union_hi = block.hi;
    for (int64_t h = 0; h < heads; ++h) {
      const C* key_src = in.key_cache + block_base + h * dim;
      const C* value_src = in.value_cache + block_base + h * dim;
      const float* keys = key_buf;
      const float* values = value_buf;
      if constexpr (std::is_same_v<C, float>) {
        if (in_place) {
          keys = key_src;
          values = value_src;
        }
      }
      // The read-ahead moves on by the lines of the keys read here: key by key in the inner
      // loop of a decode (memory-bound), all at once for a tile (compute-bound, each key reused).
      KeyPrefetch pf{nullptr, ahead.value_offset()};
      if (!in_place) {
        for (int64_t j = union_lo; j <= union_hi; ++j) {
          ahead.issue(rate);
          widen_row(key_src + j * L.cache_token_stride, key_buf + j * dp, dim, dp);
          widen_row(value_src + j * L.cache_token_stride, value_buf + j * dp, dim, dp);
        }
      } else if (num_tokens == 1) {
        ahead.fill(lines.data() + union_lo * rate, (union_hi - union_lo + 1) * rate);
        pf.lines = lines.data();
      } else {
        ahead.issue((union_hi - union_lo + 1) * rate);
      }
      for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t pos = first_pos + t;
        const int64_t lo = std::max({block_start, span.lo, L.window > 0 ? pos - L.window + 1 : int64_t{0}}) - block_start;
        const int64_t hi = std::min({block_start + BS - 1, span.hi, pos}) - block_start;
        if (lo > hi) continue;
        const int64_t first_row = h * head_rows + t * G;
        if constexpr (NV > 0) {
          // The group's query heads together, up to four at a time: one K/V load feeds them all.
          for (int64_t g = 0; g < G; g += 4) {
            const int64_t row = first_row + g;
            float* const qr = q + row * dp;
            float* const ar = acc + row * dp;
            if (kFp8Cache && in_place) {
              attend_group<NV, Fp8Keys<C>>(std::min<int64_t>(4, G - g), qr, ar, dp, row_max + row, row_sum + row,
                                           reinterpret_cast<const uint8_t*>(key_src),
                                           reinterpret_cast<const uint8_t*>(value_src), stride, lo, hi, L.soft_cap,
                                           pf);
            } else {
              attend_group<NV>(std::min<int64_t>(4, G - g), qr, ar, dp, row_max + row, row_sum + row, keys, values,
                               stride, lo, hi, L.soft_cap, pf);
            }
            pf.lines = nullptr;  // the group's first rows prefetched the block
          }
        } else {
          for (int64_t row = first_row; row < first_row + G; ++row) {
            attend_row_any(q + row * dp, acc + row * dp, row_max[row], row_sum[row], keys, values, stride, lo, hi,
                           nv, L.soft_cap);
          }
        }
      }
    }
  }

  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t t = 0; t < num_tokens; ++t) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t row = h * head_rows + t * G + g;
        const int64_t head = (item.kv_begin + h) * G + g;
        if (item.part < 0) {
          T* dst = in.out + (item.token_begin + t) * L.out_token_stride + head * dim;
          if constexpr (kFp8Cache) {
            store_row<T>(dst, acc + row * dp, dim, L.v_mult / row_sum[row]);  // natural order (the generic template)
          } else {
            store_row(dst, acc + row * dp, dim, 1.0f / row_sum[row]);
          }
        } else {
          finish_row(item, in, item.token_begin + t, head, acc + row * dp, row_max[row], row_sum[row],
                     [dim](int64_t d) { return kFp8Cache ? d : widened_index<T>(d, dim); });
        }
      }
    }
  }
}


// A tile of query tokens (item.token_end - item.token_begin > 1) over the item's KV heads, W query
// rows a vector (see attend_rows_t).
template <typename T, typename C, int NV>
void attend_tile_t(const WorkItem& item, const Inputs<T, C>& in, ReadAhead& ahead, std::vector<float>& scratch) {
  static_assert(NV > 0, "the tile path keeps a head's vectors in registers");
  const Layout& L = in.L;
  constexpr int64_t dp = NV * W;
  const int64_t dim = L.head_dim;  // == dp: the library serves one head_dim
  constexpr bool kFp8Cache = kIsFp8<C>;
  constexpr bool kInPlace = std::is_same_v<C, float>;
  // bf16 queries and keys meet in vdpbf16ps, keys read in place (TileBf16); V is widened.
  constexpr bool kBf16Dot = PAGODA_BF16_DOT && std::is_same_v<T, bf16> && std::is_same_v<C, bf16>;
  const int64_t G = L.group, BS = L.block_size;
  const int64_t num_tokens = item.token_end - item.token_begin;
  const int64_t heads = item.kv_end - item.kv_begin;
  const int64_t head_rows = num_tokens * G;  // row = token * G + member, W rows a vector
  const int64_t rvh = (head_rows + W - 1) / W;
  const int64_t first_token = in.query_start[item.seq];
  const int64_t context_len = in.seq_lens[item.seq] - (in.query_start[item.seq + 1] - first_token);
  const int64_t first_pos = context_len + (item.token_begin - first_token);

  // scratch, in vectors: q_t, o_t [heads * rvh * dp] | max, sum [heads * rvh] | pos [rvh] |
  // p [kTileRowVectors * BS] | keys, values [BS * dp / W] | a row [dp / W]; aligned to a vector.
  const int64_t vectors = 2 * heads * rvh * dp + 2 * heads * rvh + rvh + kTileRowVectors * BS + 2 * BS * NV + NV;
  constexpr uintptr_t kAlign = sizeof(vfloat);
  const size_t need = static_cast<size_t>(vectors * W) + kAlign / sizeof(float);  // room to align the start
  if (scratch.size() < need) scratch.resize(need);
  auto* base = reinterpret_cast<vfloat*>((reinterpret_cast<uintptr_t>(scratch.data()) + kAlign - 1) & ~(kAlign - 1));
  vfloat* q_t = base;
  vfloat* o_t = q_t + heads * rvh * dp;
  vfloat* row_max = o_t + heads * rvh * dp;
  vfloat* row_sum = row_max + heads * rvh;
  vint* pos = reinterpret_cast<vint*>(row_sum + heads * rvh);
  vfloat* p = reinterpret_cast<vfloat*>(pos + rvh);
  float* key_buf = reinterpret_cast<float*>(p + kTileRowVectors * BS);
  float* value_buf = key_buf + BS * dp;
  float* row = value_buf + BS * dp;

  for (int64_t r = 0; r < rvh * W; ++r) {
    // padding lanes past the last row copy its position: they compute like it, and are never stored
    const int64_t t = std::min(r, head_rows - 1) / G;
    reinterpret_cast<int32_t*>(pos)[r] = static_cast<int32_t>(first_pos + t);
  }
  if constexpr (kBf16Dot) {
    for (int64_t h = 0; h < heads; ++h) {
      auto* qh = reinterpret_cast<uint32_t*>(q_t + h * rvh * dp);  // dp / 2 vectors a row vector
      for (int64_t r = 0; r < rvh * W; ++r) {
        const int64_t rv = r / W, lane = r % W;
        uint32_t* dst = qh + rv * (dp / 2) * W + lane;
        if (r >= head_rows) {
          for (int64_t e = 0; e < dp / 2; ++e) dst[e * W] = 0;
          continue;
        }
        const int64_t t = r / G, head = (item.kv_begin + h) * G + r % G;
        const T* src = in.query + (item.token_begin + t) * L.q_token_stride + head * L.q_head_stride;
        for (int64_t e = 0; e < dp / 2; ++e) std::memcpy(dst + e * W, src + 2 * e, sizeof(uint32_t));
      }
    }
  } else {
    for (int64_t h = 0; h < heads; ++h) {
      float* qh = reinterpret_cast<float*>(q_t + h * rvh * dp);
      for (int64_t r = 0; r < rvh * W; ++r) {
        const int64_t rv = r / W, lane = r % W;
        if (r < head_rows) {
          const int64_t t = r / G, head = (item.kv_begin + h) * G + r % G;
          const T* src = in.query + (item.token_begin + t) * L.q_token_stride + head * L.q_head_stride;
          if constexpr (kFp8Cache) {
            widen_row_natural(src, row, dim, dp);  // the fp8 rows are read in natural order
          } else {
            widen_row(src, row, dim, dp);
          }
          for (int64_t d = 0; d < dp; ++d) qh[(rv * dp + d) * W + lane] = row[d] * L.scale;
        } else {
          for (int64_t d = 0; d < dp; ++d) qh[(rv * dp + d) * W + lane] = 0.0f;
        }
      }
    }
  }
  std::fill(o_t, o_t + heads * rvh * dp, vfloat{});
  std::fill(row_max, row_max + heads * rvh, splat(kNegInf));
  std::fill(row_sum, row_sum + heads * rvh, vfloat{});

  const KeySpan span = key_span(item, in.query_start, in.seq_lens, L);
  const int32_t* table = in.block_tables + item.seq * L.block_table_stride;
  const int64_t rate = lines_per_key(dim, sizeof(C));
  for (int64_t b = span.lo / BS; b * BS <= span.hi; ++b) {
    const BlockSpan block = block_span(item, span, table, L, b);
    const int64_t block_start = block.start;
    for (int64_t h = 0; h < heads; ++h) {
      ahead.issue((block.hi - block.lo + 1) * rate);  // compute-bound: the block's lines at once
      const C* key_src = in.key_cache + block.base + h * dim;
      const C* value_src = in.value_cache + block.base + h * dim;
      const float* keys = key_buf;
      const float* values = value_buf;
      int64_t stride = dp;
      if constexpr (kInPlace) {
        keys = key_src;
        values = value_src;
        stride = L.cache_token_stride;
      } else {
        for (int64_t j = block.lo; j <= block.hi; ++j) {
          if constexpr (!kBf16Dot) widen_row(key_src + j * L.cache_token_stride, key_buf + j * dp, dim, dp);
          widen_row(value_src + j * L.cache_token_stride, value_buf + j * dp, dim, dp);
        }
      }
      for (int64_t rv = 0; rv < rvh; rv += kTileRowVectors) {
        const int64_t n = std::min<int64_t>(kTileRowVectors, rvh - rv);
        const int64_t pos_min = first_pos + (rv * W) / G;
        const int64_t pos_max = first_pos + (std::min(head_rows, (rv + n) * W) - 1) / G;
        const int64_t jlo = std::max(block.lo, L.window > 0 ? pos_min - L.window + 1 - block_start : int64_t{0});
        const int64_t jhi = std::min(block.hi, pos_max - block_start);
        if (jlo > jhi) continue;
        const int64_t v = h * rvh + rv;
        float* const ov = reinterpret_cast<float*>(o_t + v * dp);
#define PAGODA_ROWS(TILE, RV, QV, KEYS, KEY_STRIDE, SCALE)                                                    \
  attend_rows_t<TILE, NV, RV>(QV, ov, row_max + v, row_sum + v, pos + rv, dp, KEYS, KEY_STRIDE, SCALE, values, \
                              stride, BS, jlo, jhi, block_start, L.window, L.soft_cap, p)
#define PAGODA_PATH(TILE, QV, KEYS, KEY_STRIDE, SCALE)                    \
  if (n == kTileRowVectors) {                                             \
    PAGODA_ROWS(TILE, kTileRowVectors, QV, KEYS, KEY_STRIDE, SCALE);      \
  } else {                                                                \
    PAGODA_ROWS(TILE, 1, QV, KEYS, KEY_STRIDE, SCALE);                    \
  }
#if PAGODA_BF16_DOT
        if constexpr (kBf16Dot) {  // keys in place, the scale applied to the scores
          const auto* qv = reinterpret_cast<const uint32_t*>(q_t + h * rvh * dp) + rv * (dp / 2) * W;
          PAGODA_PATH(TileBf16, qv, reinterpret_cast<const uint16_t*>(key_src), L.cache_token_stride, L.scale)
          continue;
        }
#endif
        PAGODA_PATH(TileFloat32, reinterpret_cast<const float*>(q_t + v * dp), keys, stride, 1.0f)  // q_t pre-scaled
#undef PAGODA_PATH
#undef PAGODA_ROWS
      }
    }
  }

  for (int64_t h = 0; h < heads; ++h) {
    const float* oh = reinterpret_cast<const float*>(o_t + h * rvh * dp);
    const float* sums = reinterpret_cast<const float*>(row_sum + h * rvh);
    for (int64_t r = 0; r < head_rows; ++r) {
      const int64_t rv = r / W, lane = r % W;
      for (int64_t d = 0; d < dp; ++d) row[d] = oh[(rv * dp + d) * W + lane];
      const int64_t t = r / G, head = (item.kv_begin + h) * G + r % G;
      T* dst = in.out + (item.token_begin + t) * L.out_token_stride + head * dim;
      if constexpr (kFp8Cache) {
        store_row<T>(dst, row, dim, L.v_mult / sums[r]);  // natural order (the generic template)
      } else {
        store_row(dst, row, dim, 1.0f / sums[r]);
      }
    }
  }
}

#if PAGODA_BF16_DOT
// bf16 decodes read K/V in place: scores by bf16 dot products (NVB vectors of 32 elements per
// row), and V multiplied by the probabilities two keys at a time: their rows interleaved
// element by element meet a (p[j], p[j + 1]) pair in each lane. The interleave leaves the
// accumulator in the order pair_order_index gives, undone when the row is stored. Compared
// with widening K and V to float32, this halves the vector work of a bf16 decode
// (its scores: score_tree<Bf16Keys>).

// Where element d of a head row sits in a bf16 decode accumulator: per 32 elements, the
// interleave's low half (elements 8l..8l+3 of each 128-bit lane l) fills vector 2v, its high
// half (8l+4..8l+7) vector 2v + 1.
inline int64_t pair_order_index(int64_t d) {
  const int64_t v = d / 32, e = d % 32, l = e / 8, k = e % 8;
  return 32 * v + (k < 4 ? 0 : 16) + 4 * l + k % 4;
}

template <int NVB, int RB, bool SoftCap>
inline void attend_rows_bf16(const uint16_t* q, int64_t q_stride, float* acc, int64_t dp, float* row_max,
                             float* row_sum, const uint16_t* keys, const uint16_t* values, int64_t stride, int64_t lo,
                             int64_t hi, float scale, float soft_cap, const KeyPrefetch& pf) {
  vbf16 qv[RB][NVB];
#pragma GCC unroll 4
  for (int i = 0; i < RB; ++i) {
#pragma GCC unroll 8
    for (int v = 0; v < NVB; ++v) qv[i][v] = load_bf16(q + i * q_stride + v * 32);
  }
  for (int64_t c0 = lo - lo % W; c0 <= hi; c0 += W) {
    const int64_t jlo = std::max(lo, c0), jhi = std::min(hi, c0 + W - 1);
    const RowVectors<RB> scores = score_tree<Bf16Keys, NVB, RB, W>(qv, keys, stride, c0, jlo, jhi, pf);
    uint32_t weights[RB][W / 2];  // bf16 pairs (p[2m], p[2m + 1])
    uint32_t residues[RB][W / 2];  // what bf16 left of each p, also in bf16
    vfloat a[RB][2 * NVB];
#pragma GCC unroll 4
    for (int i = 0; i < RB; ++i) {
      float correction;
      const vfloat p =
          softmax_step<SoftCap>(scores.v[i] * scale, c0, jlo, jhi, soft_cap, row_max[i], row_sum[i], correction);
      const __m256bh packed = _mm512_cvtneps_pbh(reinterpret_cast<__m512>(p));
      std::memcpy(weights[i], &packed, sizeof(packed));
      const vfloat rounded = reinterpret_cast<vfloat>(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(packed)), 16));
      const __m256bh rest = _mm512_cvtneps_pbh(reinterpret_cast<__m512>(p - rounded));
      std::memcpy(residues[i], &rest, sizeof(rest));
#pragma GCC unroll 8
      for (int v = 0; v < 2 * NVB; ++v) a[i][v] = loadv(acc + i * dp + v * W) * correction;
    }
    for (int64_t j = jlo - (jlo - c0) % 2; j <= jhi; j += 2) {
      // Hidden keys of the pair read a visible row instead; their weight is 0.
      const uint16_t* row0 = values + std::max(j, jlo) * stride;
      const uint16_t* row1 = values + std::min(j + 1, jhi) * stride;
      if (j >= jlo) prefetch_key<NVB, true>(pf, j);
      if (j + 1 <= jhi) prefetch_key<NVB, true>(pf, j + 1);
#pragma GCC unroll 8
      for (int v = 0; v < NVB; ++v) {
        __m512i x, y;
        std::memcpy(&x, row0 + v * 32, sizeof(x));
        std::memcpy(&y, row1 + v * 32, sizeof(y));
        const vbf16 low = reinterpret_cast<vbf16>(_mm512_unpacklo_epi16(x, y));
        const vbf16 high = reinterpret_cast<vbf16>(_mm512_unpackhi_epi16(x, y));
#pragma GCC unroll 4
        for (int i = 0; i < RB; ++i) {
          const vbf16 w = reinterpret_cast<vbf16>(_mm512_set1_epi32(static_cast<int>(weights[i][(j - c0) / 2])));
          const vbf16 r = reinterpret_cast<vbf16>(_mm512_set1_epi32(static_cast<int>(residues[i][(j - c0) / 2])));
          a[i][2 * v] = dot_bf16(dot_bf16(a[i][2 * v], low, w), low, r);
          a[i][2 * v + 1] = dot_bf16(dot_bf16(a[i][2 * v + 1], high, w), high, r);
        }
      }
    }
#pragma GCC unroll 4
    for (int i = 0; i < RB; ++i) {
#pragma GCC unroll 8
      for (int v = 0; v < 2 * NVB; ++v) storev(acc + i * dp + v * W, a[i][v]);
    }
  }
}

template <int NVB>
void attend_decode_bf16(const WorkItem& item, const Inputs<bf16>& in, ReadAhead& ahead,
                        std::vector<float>& scratch, std::vector<const char*>& lines) {
  const Layout& L = in.L;
  const int64_t dim = L.head_dim, G = L.group, BS = L.block_size;
  constexpr int64_t dp = NVB * 32;
  const int64_t heads = item.kv_end - item.kv_begin;
  const int64_t rows = heads * G;  // row = head * G + member
  // scratch: acc [rows, dp] | max [rows] | sum [rows]
  const size_t need = static_cast<size_t>(rows * (dp + 2));
  if (scratch.size() < need) scratch.resize(need);
  float* acc = scratch.data();
  float* row_max = acc + rows * dp;
  float* row_sum = row_max + rows;
  std::fill(acc, acc + rows * dp, 0.0f);
  std::fill(row_max, row_max + rows, kNegInf);
  std::fill(row_sum, row_sum + rows, 0.0f);

  const auto* query = reinterpret_cast<const uint16_t*>(in.query) + item.token_begin * L.q_token_stride;
  const auto* key_cache = reinterpret_cast<const uint16_t*>(in.key_cache);
  const auto* value_cache = reinterpret_cast<const uint16_t*>(in.value_cache);
  const KeySpan span = key_span(item, in.query_start, in.seq_lens, L);
  const int32_t* table = in.block_tables + item.seq * L.block_table_stride;
  constexpr int64_t rate = NVB;  // lines per key row: 32 bf16 elements are half a line
  if (lines.size() < static_cast<size_t>(BS * rate)) lines.resize(static_cast<size_t>(BS * rate));
  for (int64_t b = span.lo / BS; b * BS <= span.hi; ++b) {
    const int64_t block_start = b * BS;
    const int64_t lo = std::max(block_start, span.lo) - block_start;
    const int64_t hi = std::min(block_start + BS - 1, span.hi) - block_start;
    const int64_t block_base = static_cast<int64_t>(table[b]) * L.cache_block_stride + item.kv_begin * dim;
    if (lo > hi) continue;
    for (int64_t h = 0; h < heads; ++h) {
      const uint16_t* keys = key_cache + block_base + h * dim;
      const uint16_t* values = value_cache + block_base + h * dim;
      ahead.fill(lines.data() + lo * rate, (hi - lo + 1) * rate);
      KeyPrefetch pf{lines.data(), ahead.value_offset()};
      for (int64_t g = 0; g < G; g += 4) {
        const int64_t row = h * G + g;
        const uint16_t* qr = query + ((item.kv_begin + h) * G + g) * L.q_head_stride;
        float* const ar = acc + row * dp;
        const int64_t qs = L.q_head_stride, ts = L.cache_token_stride;
#define PAGODA_ROWS(RB, CAP) \
  attend_rows_bf16<NVB, RB, CAP>(qr, qs, ar, dp, row_max + row, row_sum + row, keys, values, ts, lo, hi, L.scale, \
                                 L.soft_cap, pf)
        if (L.soft_cap > 0.0f) {
          switch (std::min<int64_t>(4, G - g)) {
            case 1: PAGODA_ROWS(1, true); break;
            case 2: PAGODA_ROWS(2, true); break;
            case 3: PAGODA_ROWS(3, true); break;
            default: PAGODA_ROWS(4, true);
          }
        } else {
          switch (std::min<int64_t>(4, G - g)) {
            case 1: PAGODA_ROWS(1, false); break;
            case 2: PAGODA_ROWS(2, false); break;
            case 3: PAGODA_ROWS(3, false); break;
            default: PAGODA_ROWS(4, false);
          }
        }
#undef PAGODA_ROWS
        pf.lines = nullptr;  // the group's first rows prefetched the block
      }
    }
  }
  for (int64_t row = 0; row < rows; ++row) {
    finish_row(item, in, item.token_begin, item.kv_begin * G + row, acc + row * dp, row_max[row], row_sum[row],
               pair_order_index);
  }
}
#endif

// A decode split over the threads: its parts' partial results, merged after the parallel region.
struct Split {
  int32_t seq;
  int32_t token;
  int32_t first_part;
  int32_t parts;
};

struct Plan {
  std::vector<WorkItem> items;
  std::vector<Split> splits;
  int64_t parts = 0;
  int threads = 1;  // to run the items on
};

// A part of a split decode covers at least this many blocks: less is not worth a merge.
constexpr int64_t kMinPartBlocks = 2;
// Batches of less work (query rows x keys, over the KV heads) run on the calling thread: waking
// the other threads would cost more than they save.
constexpr int64_t kSerialCost = 192;
constexpr int32_t kAllKeys = std::numeric_limits<int32_t>::max();

// One item per (sequence, tile) spanning every KV head. When that leaves fewer than a few items
// per thread (a lone decode, a short prefill), tiles split per KV head and decodes with enough
// context split their keys (block-aligned) into one part per thread, merged afterwards.
Plan plan_items(const int32_t* query_start, const int32_t* seq_lens, const int32_t* seq_ids, int64_t num_ids,
                const Layout& L, int64_t tile_tokens, int64_t threads) {
  int64_t tiles = 0, total_cost = 0;
  for (int64_t i = 0; i < num_ids; ++i) {
    const int64_t s = seq_ids[i], rows = query_start[s + 1] - query_start[s];
    tiles += (rows + tile_tokens - 1) / tile_tokens;
    total_cost += rows * seq_lens[s] * L.num_kv_heads;
  }
  if (total_cost < kSerialCost) threads = 1;
  const bool few = threads > 1 && tiles < 4 * threads;
  const int64_t heads_per_item = few ? 1 : L.num_kv_heads;
  Plan plan;
  plan.items.reserve(static_cast<size_t>(tiles * (L.num_kv_heads / heads_per_item)));
  for (int64_t i = 0; i < num_ids; ++i) {
    const int64_t s = seq_ids[i];
    const int32_t begin = query_start[s], end = query_start[s + 1];
    const int64_t context_len = seq_lens[s] - (end - begin);
    if (few && end - begin == 1) {
      const int64_t hi = seq_lens[s] - 1;
      const int64_t lo = L.window > 0 ? std::max<int64_t>(0, hi - L.window + 1) : 0;
      const int64_t first_block = lo / L.block_size, blocks = hi / L.block_size - first_block + 1;
      const int64_t parts = std::min<int64_t>(threads, blocks / kMinPartBlocks);
      if (parts >= 2) {
        plan.splits.push_back({static_cast<int32_t>(s), begin, static_cast<int32_t>(plan.parts),
                               static_cast<int32_t>(parts)});
        for (int64_t p = 0; p < parts; ++p) {
          const int64_t key_begin = std::max(lo, (first_block + p * blocks / parts) * L.block_size);
          const int64_t key_end = std::min(hi + 1, (first_block + (p + 1) * blocks / parts) * L.block_size);
          plan.items.push_back({static_cast<int32_t>(s), begin, end, 0, static_cast<int32_t>(L.num_kv_heads),
                                static_cast<int32_t>(key_begin), static_cast<int32_t>(key_end),
                                static_cast<int32_t>(plan.parts++), (key_end - key_begin) * L.num_kv_heads});
        }
        continue;
      }
    }
    for (int32_t t = begin; t < end; t += static_cast<int32_t>(tile_tokens)) {
      const int32_t t_end = std::min<int32_t>(end, t + static_cast<int32_t>(tile_tokens));
      const int64_t keys = context_len + (t_end - begin);
      for (int64_t h = 0; h < L.num_kv_heads; h += heads_per_item)
        plan.items.push_back({static_cast<int32_t>(s), t, t_end, static_cast<int32_t>(h),
                              static_cast<int32_t>(h + heads_per_item), 0, kAllKeys, -1,
                              keys * (t_end - t) * heads_per_item});
    }
  }
  std::stable_sort(plan.items.begin(), plan.items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  plan.threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, plan.items.size())));
  return plan;
}

// The output rows of the split decodes from their parts' partial results.
template <class In>
void merge_splits(const Plan& plan, const In& in) {
  using T = typename In::Elem;
  const int64_t dim = in.L.head_dim, row_floats = dim + 2;
  std::vector<float> acc(static_cast<size_t>(dim));
  for (const Split& split : plan.splits) {
    for (int64_t head = 0; head < in.L.num_heads; ++head) {
      const float* first = in.partials + (split.first_part * in.L.num_heads + head) * row_floats;
      const int64_t part_floats = in.L.num_heads * row_floats;
      float max = kNegInf;
      for (int64_t p = 0; p < split.parts; ++p) max = std::max(max, first[p * part_floats + dim]);
      float sum = 0.0f;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t p = 0; p < split.parts; ++p) {
        const float* part = first + p * part_floats;
        const float weight = exp_nonpositive(part[dim] - max);
        sum += part[dim + 1] * weight;
        for (int64_t d = 0; d < dim; ++d) acc[d] += part[d] * weight;
      }
      T* dst = in.out + split.token * in.L.out_token_stride + head * dim;
      const float inv = 1.0f / sum;
      for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(acc[d] * inv);
    }
  }
}

constexpr int64_t kHeadDim = PAGODA_ATTN_HEAD_DIM;
// The head's whole vectors per row for the compiled head_dim; 0: the generic path only.
constexpr int kHeadVectors = kHeadDim % W == 0 && (kHeadDim / W == 4 || kHeadDim / W == 8 || kHeadDim / W == 16)
                                 ? static_cast<int>(kHeadDim / W)
                                 : 0;

template <typename T, typename C, int NV>
void run_items(const std::vector<WorkItem>& items, int threads, const Inputs<T, C>& in) {
  const int64_t n = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next_item{0};
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    // Kept per thread between calls: no allocation once the first batches have grown it.
    static thread_local std::vector<float> scratch;
    static thread_local std::vector<const char*> lines;
    ItemQueue queue(items.data(), n, next_item);
    ReadAhead ahead(queue, in.key_cache, in.value_cache, in.block_tables, in.query_start, in.seq_lens, in.L, sizeof(C));
    for (int64_t pos = 0;; ++pos) {
      const WorkItem* item = queue.at(pos);
      if (item == nullptr) break;
      ahead.catch_up(pos, kReadAheadPairs);
#if PAGODA_BF16_DOT
      if constexpr (std::is_same_v<T, bf16> && std::is_same_v<C, bf16>) {
        if constexpr (kHeadDim == 64 || kHeadDim == 128) {
          if (item->token_end - item->token_begin == 1 && in.L.head_dim == kHeadDim) {
            attend_decode_bf16<kHeadDim / 32>(*item, in, ahead, scratch, lines);
            queue.pop();
            continue;
          }
        }
      }
#endif
      if constexpr (NV > 0) {
        if (item->token_end - item->token_begin > 1) {
          attend_tile_t<T, C, NV>(*item, in, ahead, scratch);
          queue.pop();
          continue;
        }
      }
      attend_item<T, C, NV>(*item, in, ahead, scratch, lines);
      queue.pop();
    }
  }
}

template <typename T, typename C>
void run_attention(const void* query, const void* kv_cache, int64_t cache_half_stride, const int32_t* block_tables,
                   const int32_t* query_start, const int32_t* seq_lens, const int32_t* seq_ids, int64_t num_ids,
                   void* out, const Layout& L, int64_t tile_tokens, int threads) {
  const Plan plan = plan_items(query_start, seq_lens, seq_ids, num_ids, L, tile_tokens, threads);
  std::vector<float> partials(static_cast<size_t>(plan.parts * L.num_heads * (L.head_dim + 2)));
  const C* k = static_cast<const C*>(kv_cache);
  const Inputs<T, C> in{static_cast<const T*>(query), k, k + cache_half_stride, block_tables, query_start, seq_lens,
                     static_cast<T*>(out), partials.data(), L};
  // Whole vectors per head row known at compile time keep a row's accumulators in registers.
  if constexpr (kHeadVectors != 0) {
    run_items<T, C, kHeadVectors>(plan.items, plan.threads, in);
  } else {
    run_items<T, C, 0>(plan.items, plan.threads, in);
  }
  merge_splits(plan, in);
}

// A refused call: the message for the caller's exception, nothing written.
class Refusal {
 public:
  Refusal(char* buffer, int64_t size) : buffer_(buffer), size_(size) {}
  template <typename... Args>
  int operator()(const char* format, Args... args) const {
    if (buffer_ != nullptr && size_ > 0) std::snprintf(buffer_, static_cast<size_t>(size_), format, args...);
    return 1;
  }

 private:
  char* buffer_;
  int64_t size_;
};

// Every sequence the kernel attends must fit the batch and the cache. Checked on every call,
// before anything is written: a few integer compares per block, next to the attention itself.
int check_metadata(const int32_t* qs, const int32_t* sl, int64_t num_seqs, const int32_t* bt, int64_t table_rows,
                   int64_t columns, const int32_t* ids, int64_t num_ids, int64_t num_tokens, int64_t block_size,
                   int64_t num_blocks, const Refusal& refuse) {
  if (num_seqs > 0 && table_rows < num_seqs) return refuse("attention metadata: block_tables needs a row per sequence");
  for (int64_t i = 0; i < num_ids; ++i) {
    const int64_t s = ids[i];
    if (s < 0 || s >= num_seqs) return refuse("seq_ids[%lld]=%lld is not a sequence of this batch", (long long)i, (long long)s);
    const int64_t begin = qs[s], end = qs[s + 1], len = sl[s];
    if (!(begin >= 0 && begin <= end && end <= num_tokens && len >= end - begin)) {
      return refuse("attention metadata: sequence %lld has rows [%lld, %lld) of %lld and seq_len %lld", (long long)s,
                    (long long)begin, (long long)end, (long long)num_tokens, (long long)len);
    }
    const int64_t blocks = (len + block_size - 1) / block_size;
    if (blocks > columns) {
      return refuse("attention metadata: a sequence needs %lld blocks but block_tables has %lld columns",
                    (long long)blocks, (long long)columns);
    }
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t id = bt[s * columns + b];
      if (id < 0) return refuse("attention metadata: block_tables holds a negative block id for a used block");
      if (id >= num_blocks) {
        return refuse("attention metadata: block id %lld is past the cache's %lld blocks", (long long)id,
                      (long long)num_blocks);
      }
    }
  }
  return 0;
}

}  // namespace

// Writes the new K/V rows (slot -1: skipped), then attends the sequences listed in seq_ids (the
// others' output rows are left for the caller); rows past the last sequence are zeroed.
//   query [num_tokens, num_heads, head_dim] (strides q_token, q_head; head_dim contiguous);
//   key / value [>= num_tokens, num_kv_heads, head_dim] (their strides; head_dim contiguous);
//   kv_cache contiguous [2, num_blocks, block_size, num_kv_heads, head_dim];
//   slot_mapping int64 [num_slots]; query_start int32 [num_seqs + 1]; seq_lens int32 [num_seqs];
//   block_tables contiguous int32 [table_rows, table_columns]; seq_ids int32 [num_ids];
//   out contiguous [num_tokens, num_heads, head_dim]. dtype: 0 float32, 1 bfloat16, 2 float16.
//   cache_dtype: the same code, or 3 fp8 e4m3 / 4 fp8 e5m2 with k_scale / v_scale (else ignored: 1).
// Returns 0, or 1 with the reason in `error` (nothing written) when the metadata does not fit.
PAGODA_EXPORT int pagoda_paged_attention(
    int dtype, int cache_dtype, float k_scale, float v_scale, const void* query, int64_t num_tokens, int64_t num_heads, int64_t head_dim, int64_t q_token,
    int64_t q_head, const void* key, int64_t k_token, int64_t k_head, const void* value, int64_t v_token,
    int64_t v_head, void* kv_cache, int64_t num_blocks, int64_t block_size, int64_t num_kv_heads,
    const int64_t* slot_mapping, int64_t num_slots, const int32_t* query_start, const int32_t* seq_lens,
    int64_t num_seqs, const int32_t* block_tables, int64_t table_rows, int64_t table_columns, const int32_t* seq_ids,
    int64_t num_ids, float scale, int64_t window, float soft_cap, int64_t tile_tokens, void* out, int threads,
    char* error, int64_t error_size) {
  const Refusal refuse(error, error_size);
  if (dtype != PAGODA_ATTN_DTYPE) return refuse("this library serves dtype code %d, not %d", PAGODA_ATTN_DTYPE, dtype);
  if (cache_dtype != PAGODA_ATTN_CACHE) {
    return refuse("this library serves cache dtype code %d, not %d", PAGODA_ATTN_CACHE, cache_dtype);
  }
  constexpr bool kFp8 = PAGODA_ATTN_CACHE >= 3;
  if (kFp8 && !(k_scale > 0.0f && v_scale > 0.0f && std::isfinite(k_scale) && std::isfinite(v_scale))) {
    return refuse("fp8 KV cache scales must be finite and positive (k_scale %g, v_scale %g)", (double)k_scale,
                  (double)v_scale);
  }
  if (tile_tokens <= 0) return refuse("tile_tokens must be positive");
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return refuse("query and kv_cache heads do not fit");
  if (kHeadDim != 0 && head_dim != kHeadDim) {
    return refuse("this library serves head_dim %lld, not %lld", (long long)kHeadDim, (long long)head_dim);
  }
  const int64_t es = dtype == 0 ? 4 : 2;  // query, key, value and out
  const int64_t ces = kFp8 ? 1 : es;       // the cache
  const int64_t cache_slots = num_blocks * block_size;
  const int64_t writes = std::min<int64_t>(num_slots, num_tokens);
  for (int64_t t = 0; t < writes; ++t) {
    if (slot_mapping[t] >= cache_slots) {
      return refuse("slot_mapping[%lld]=%lld is past the cache's %lld slots", (long long)t, (long long)slot_mapping[t],
                    (long long)cache_slots);
    }
  }
  if (check_metadata(query_start, seq_lens, num_seqs, block_tables, table_rows, table_columns, seq_ids, num_ids,
                     num_tokens, block_size, num_blocks, refuse) != 0) {
    return 1;
  }

#if PAGODA_ATTN_DTYPE == 0
  using Elem = float;
#elif PAGODA_ATTN_DTYPE == 1
  using Elem = bf16;
#else
  using Elem = half;
#endif
#if PAGODA_ATTN_CACHE == 3
  using CacheElem = fp8_e4m3;
#elif PAGODA_ATTN_CACHE == 4
  using CacheElem = fp8_e5m2;
#else
  using CacheElem = Elem;
#endif

  // New K/V first: a query attends to its own token and the new ones before it.
  const int64_t row_bytes = num_kv_heads * head_dim * ces;
  char* k_dst = static_cast<char*>(kv_cache);
  char* v_dst = k_dst + num_blocks * block_size * num_kv_heads * head_dim * ces;
  const struct {
    const void* base;
    int64_t token, head;
    char* dst;
    float scale;
  } sources[2] = {{key, k_token, k_head, k_dst, k_scale}, {value, v_token, v_head, v_dst, v_scale}};
  for (const auto& src : sources) {
    if constexpr (kFp8) {
      const auto* base = static_cast<const Elem*>(src.base);
      for (int64_t t = 0; t < writes; ++t) {
        if (slot_mapping[t] < 0) continue;
        auto* d = reinterpret_cast<uint8_t*>(src.dst + slot_mapping[t] * row_bytes);
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          store_fp8_row<CacheElem>(d + h * head_dim, base + t * src.token + h * src.head, head_dim, src.scale);
        }
      }
      continue;
    }
    const auto* base = static_cast<const char*>(src.base);
    const int64_t token_bytes = src.token * es, head_bytes = src.head * es;
    const bool dense_row = num_kv_heads == 1 || head_bytes == head_dim * es;
    for (int64_t t = 0; t < writes; ++t) {
      if (slot_mapping[t] < 0) continue;
      char* d = src.dst + slot_mapping[t] * row_bytes;
      const char* s = base + t * token_bytes;
      if (dense_row) {
        std::memcpy(d, s, row_bytes);
      } else {
        for (int64_t h = 0; h < num_kv_heads; ++h) std::memcpy(d + h * head_dim * es, s + h * head_bytes, head_dim * es);
      }
    }
  }

  const int64_t real_tokens = num_seqs ? query_start[num_seqs] : 0;
  if (real_tokens < num_tokens) {
    std::memset(static_cast<char*>(out) + real_tokens * num_heads * head_dim * es, 0,
                (num_tokens - real_tokens) * num_heads * head_dim * es);
  }
  // fp8: k_scale (and the decoding factor) scale the queries, v_scale the output.
  const float k_mult = kFp8 ? k_scale * kFp8Factor<CacheElem> : 1.0f;
  const float v_mult = kFp8 ? v_scale * kFp8Factor<CacheElem> : 1.0f;
  const Layout L{num_heads, num_kv_heads, head_dim, block_size, num_heads / num_kv_heads,
                 q_token, q_head, num_heads * head_dim,
                 block_size * num_kv_heads * head_dim, num_kv_heads * head_dim, table_columns,
                 scale * k_mult, window, soft_cap, v_mult};
  const int64_t cache_half = num_blocks * block_size * num_kv_heads * head_dim;
  run_attention<Elem, CacheElem>(query, kv_cache, cache_half, block_tables, query_start, seq_lens, seq_ids, num_ids, out, L,
                      tile_tokens, threads);
  return 0;
}

// The entry points as a Python module (pagoda/python.h): one cheap call each from the wrappers.
PAGODA_PYTHON_MODULE(PAGODA_FUNCTION(pagoda_paged_attention))
