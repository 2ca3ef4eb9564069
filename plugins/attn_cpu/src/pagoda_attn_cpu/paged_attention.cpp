// Paged attention for the CPU, reading K/V straight from the block cache.
//
// Work item = (sequence, tile of query tokens, range of KV heads). A decode batch
// gets one item per sequence covering every KV head, so each cache block is read
// once, front to back, while the next one is prefetched; the heads are split into
// separate items only when there are too few items to keep the cores busy. Every
// query head of a KV head's group and every token of the tile reuse the block's
// K/V from L1 (GQA). Softmax is online (running max and sum per query row) in
// float32; V accumulates in float32; the output is written in the model dtype.
//
// The arithmetic uses GCC vector extensions of the machine's widest float vector
// (16 lanes with AVX-512, else 8): one query row against W keys is W dot products
// done lane-parallel over head_dim, then summed across lanes all at once by a
// shuffle tree, so the W scores land in one vector for a vectorized exp. The query
// heads of a group go through a block together (up to four rows), each K/V vector
// loaded once for all of them. The next block is prefetched into L2 a few lines at
// a time while the current one is worked on. The block loop is memory-bound for
// float32 decode (it reads the whole cache at close to DRAM bandwidth).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

#if defined(__AVX512F__)
constexpr int W = 16;
#define PAGODA_W16 1
#define PAGODA_IOTA 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15
#define PAGODA_EVEN 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30
#define PAGODA_ODD 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31
#else
constexpr int W = 8;
#define PAGODA_W16 0
#define PAGODA_IOTA 0, 1, 2, 3, 4, 5, 6, 7
#define PAGODA_EVEN 0, 2, 4, 6, 8, 10, 12, 14
#define PAGODA_ODD 1, 3, 5, 7, 9, 11, 13, 15
#endif

typedef float vfloat __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(W * sizeof(int32_t))));
typedef uint32_t vuint __attribute__((vector_size(W * sizeof(uint32_t))));
typedef uint16_t vbits16 __attribute__((vector_size(W * sizeof(uint16_t))));

// The small vector helpers must inline into the kernels for their operands to stay in registers.
#define PAGODA_INLINE inline __attribute__((always_inline))

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// memcpy: unaligned vector loads and stores (cache rows are only element-aligned).
PAGODA_INLINE vfloat loadv(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
PAGODA_INLINE void storev(float* p, vfloat v) { std::memcpy(p, &v, sizeof(v)); }
PAGODA_INLINE vfloat splat(float x) { return vfloat{} + x; }

// Lanes rotated down by N (lane i takes lane i + N): log2(W) rotate-and-combine steps reduce a vector.
template <int N>
PAGODA_INLINE vfloat rotate(vfloat v) {
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
  v += rotate<8>(v);
#endif
  v += rotate<4>(v);
  v += rotate<2>(v);
  v += rotate<1>(v);
  return v[0];
}
PAGODA_INLINE vfloat vmax(vfloat a, vfloat b) { return a > b ? a : b; }
PAGODA_INLINE float hmax(vfloat v) {
#if PAGODA_W16
  v = vmax(v, rotate<8>(v));
#endif
  v = vmax(v, rotate<4>(v));
  v = vmax(v, rotate<2>(v));
  v = vmax(v, rotate<1>(v));
  return v[0];
}

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
  const float n = std::nearbyint(clamped * 1.44269504088896341f);
  const float r = clamped - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
  // Minimax polynomial for exp(r), |r| <= ln2/2.
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? 0.0f : p * scale;
}

// The same on W lanes; adding and subtracting 1.5 * 2^23 rounds to the nearest integer.
PAGODA_INLINE vfloat exp_nonpositive(vfloat x) {
  const vfloat clamped = x < -87.0f ? splat(-87.0f) : x;
  const vfloat shifter = splat(12582912.0f);
  const vfloat n = (clamped * 1.44269504088896341f + shifter) - shifter;
  const vfloat r = clamped - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
  vfloat p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vint bits = (__builtin_convertvector(n, vint) + 127) << 23;
  vfloat scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? splat(0.0f) : p * scale;
}

// A head row as float32, zero-padded to `padded` (a multiple of W) so the vector loops need no tails.
inline void widen_row(const float* src, float* dst, int64_t dim, int64_t padded) {
  std::memcpy(dst, src, static_cast<size_t>(dim) * sizeof(float));
  std::fill(dst + dim, dst + padded, 0.0f);
}
// bf16 rows widen in chunks of 2W elements, each chunk's even elements first, then its odd ones:
// a chunk is one load, a shift and a mask. Queries, keys and values share the order, so the dot
// products never see it, and store_row puts the output back in order.
inline void widen_row(const at::BFloat16* src, float* dst, int64_t dim, int64_t padded) {
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
inline void widen_row(const at::Half* src, float* dst, int64_t dim, int64_t padded) {
  for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<float>(src[d]);
  std::fill(dst + dim, dst + padded, 0.0f);
}

// An output row, scaled by `inv`, in the model dtype and the natural element order.
template <typename T>
inline void store_row(T* dst, const float* acc, int64_t dim, float inv) {
  for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(acc[d] * inv);
}
inline void store_row(at::BFloat16* dst, const float* acc, int64_t dim, float inv) {
  int64_t d = 0;
  for (; d + 2 * W <= dim; d += 2 * W) {  // undo widen_row's even/odd order
    for (int64_t i = 0; i < W; ++i) {
      dst[d + 2 * i] = static_cast<at::BFloat16>(acc[d + i] * inv);
      dst[d + 2 * i + 1] = static_cast<at::BFloat16>(acc[d + W + i] * inv);
    }
  }
  for (; d < dim; ++d) dst[d] = static_cast<at::BFloat16>(acc[d] * inv);
}

// Prefetch into L2 (prefetcht2): measured faster here than into L1, which has fewer miss buffers.
constexpr int kPrefetchLocality = 1;

// Prefetches the K and V rows of a block a few cache lines per step, spread over the work on
// the block before it: a burst of hundreds of prefetches would stall on full miss buffers.
class Prefetcher {
 public:
  // rows of row_bytes each, row_stride_bytes apart, in both k and v; over about `steps` steps.
  void start(const void* k, const void* v, int64_t rows, int64_t row_stride_bytes, int64_t row_bytes,
             int64_t steps) {
    if (row_stride_bytes == row_bytes) {  // every KV head of the block: one contiguous run
      row_bytes *= rows;
      rows = 1;
    }
    k_ = static_cast<const char*>(k);
    v_ = static_cast<const char*>(v);
    rows_ = rows;
    stride_ = row_stride_bytes;
    row_bytes_ = row_bytes;
    row_ = 0;
    byte_ = 0;
    const int64_t lines = rows * ((row_bytes + 63) / 64);
    per_step_ = (lines + steps - 1) / std::max<int64_t>(steps, 1);
  }
  void step() { issue(per_step_); }
  void finish() { issue(std::numeric_limits<int64_t>::max()); }

 private:
  void issue(int64_t lines) {
    for (; lines > 0 && row_ < rows_; --lines) {
      __builtin_prefetch(k_ + row_ * stride_ + byte_, 0, kPrefetchLocality);
      __builtin_prefetch(v_ + row_ * stride_ + byte_, 0, kPrefetchLocality);
      byte_ += 64;
      if (byte_ >= row_bytes_) {
        byte_ = 0;
        ++row_;
      }
    }
  }
  const char* k_ = nullptr;
  const char* v_ = nullptr;
  int64_t rows_ = 0, stride_ = 0, row_bytes_ = 0, row_ = 0, byte_ = 0, per_step_ = 0;
};

struct WorkItem {
  int32_t seq;
  int32_t token_begin;  // flat-batch rows of this tile
  int32_t token_end;
  int32_t kv_begin;  // KV heads of this item
  int32_t kv_end;
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
};

// The online-softmax step for one query row and the W keys of the chunk at c0, of which
// [jlo, jhi] are visible: caps and masks the scores, updates the running max and sum, and
// returns the weights (0 for the masked keys) and, in `correction`, the factor for the row's
// accumulator (0 on its first keys).
PAGODA_INLINE vfloat softmax_step(vfloat s, int64_t c0, int64_t jlo, int64_t jhi, float soft_cap, float& row_max,
                           float& row_sum, float& correction) {
  if (soft_cap > 0.0f) {
    float lanes[W];
    storev(lanes, s);
    for (int64_t j = jlo; j <= jhi; ++j) lanes[j - c0] = soft_cap * std::tanh(lanes[j - c0] / soft_cap);
    s = loadv(lanes);
  }
  const vint iota = {PAGODA_IOTA};
  const vint key = iota + static_cast<int32_t>(c0);
  s = (key >= static_cast<int32_t>(jlo)) & (key <= static_cast<int32_t>(jhi)) ? s : splat(kNegInf);
  const float new_max = std::max(row_max, hmax(s));
  correction = exp_nonpositive(row_max - new_max);
  const vfloat p = exp_nonpositive(s - new_max);
  row_sum = row_sum * correction + hsum(p);
  row_max = new_max;
  return p;
}

template <int RB>
struct RowVectors {
  vfloat v[RB];
};

// Scores of RB query rows (q, in registers) against keys [j, j + N): one vector per row with
// a lane per key once N == W. Keys outside [jlo, jhi] are never read (a block's tail may be
// unwritten): their lanes hold a visible key's score, for the caller to mask. Depth first, so
// only one partial vector per tree level and row is live.
template <int NV, int RB, int N>
PAGODA_INLINE RowVectors<RB> score_tree(const vfloat (&q)[RB][NV], const float* keys, int64_t stride, int64_t j,
                                 int64_t jlo, int64_t jhi) {
  RowVectors<RB> r;
  if constexpr (N == 1) {
    const int64_t readable = std::min(std::max(j, jlo), jhi);  // a stand-in for a hidden key, masked later
    vfloat k[NV];
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) k[v] = loadv(keys + readable * stride + v * W);
#pragma GCC unroll 4
    for (int i = 0; i < RB; ++i) {
      vfloat s = q[i][0] * k[0];
#pragma GCC unroll 16
      for (int v = 1; v < NV; ++v) s += q[i][v] * k[v];
      r.v[i] = s;
    }
  } else {
    const RowVectors<RB> a = score_tree<NV, RB, N / 2>(q, keys, stride, j, jlo, jhi);
    const RowVectors<RB> b = score_tree<NV, RB, N / 2>(q, keys, stride, j + N / 2, jlo, jhi);
#pragma GCC unroll 4
    for (int i = 0; i < RB; ++i) r.v[i] = merge_pairs(a.v[i], b.v[i]);
  }
  return r;
}

// RB query rows that see the same keys [lo, hi] of one block (the query heads of a GQA group
// at one position), `dp` floats apart in q and acc: online-softmax update of their max, sum and
// accumulator, W keys at a time, each K/V vector loaded once for all RB rows. `keys` and
// `values` are float32 rows `stride` floats apart; NV vectors per row.
template <int NV, int RB>
inline void attend_rows(const float* q, float* acc, int64_t dp, float* row_max, float* row_sum, const float* keys,
                        const float* values, int64_t stride, int64_t lo, int64_t hi, float soft_cap) {
  vfloat qv[RB][NV];
#pragma GCC unroll 4
  for (int i = 0; i < RB; ++i) {
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) qv[i][v] = loadv(q + i * dp + v * W);
  }
  for (int64_t c0 = lo - lo % W; c0 <= hi; c0 += W) {
    const int64_t jlo = std::max(lo, c0), jhi = std::min(hi, c0 + W - 1);
    const RowVectors<RB> scores = score_tree<NV, RB, W>(qv, keys, stride, c0, jlo, jhi);
    float weights[RB][W];
    vfloat a[RB][NV];
#pragma GCC unroll 4
    for (int i = 0; i < RB; ++i) {
      float correction;
      storev(weights[i], softmax_step(scores.v[i], c0, jlo, jhi, soft_cap, row_max[i], row_sum[i], correction));
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) a[i][v] = loadv(acc + i * dp + v * W) * correction;
    }
    for (int64_t j = jlo; j <= jhi; ++j) {
      vfloat value[NV];
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) value[v] = loadv(values + j * stride + v * W);
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
    storev(weights, softmax_step(transpose_sum(part), c0, jlo, jhi, soft_cap, row_max, row_sum, correction));
    for (int64_t v = 0; v < nv; ++v) {
      vfloat a = loadv(acc + v * W) * correction;
      for (int64_t j = jlo; j <= jhi; ++j) a += splat(weights[j - c0]) * loadv(values + j * stride + v * W);
      storev(acc + v * W, a);
    }
  }
}

// The position of the first key any query of the item sees.
int64_t first_key(const WorkItem& item, const int32_t* query_start, const int32_t* seq_lens, const Layout& L) {
  if (L.window <= 0) return 0;
  const int64_t first_token = query_start[item.seq];
  const int64_t context_len = seq_lens[item.seq] - (query_start[item.seq + 1] - first_token);
  return std::max<int64_t>(0, context_len + (item.token_begin - first_token) - L.window + 1);
}

template <typename T, int NV>
void attend_item(const WorkItem& item, const WorkItem* next, const T* query, const T* key_cache,
                 const T* value_cache, const int32_t* block_tables, const int32_t* query_start,
                 const int32_t* seq_lens, T* out, const Layout& L, std::vector<float>& scratch) {
  const int64_t dim = L.head_dim;
  const int64_t nv = NV > 0 ? NV : (dim + W - 1) / W;
  const int64_t dp = nv * W;  // padded head_dim
  // float32 rows of a head_dim that fills whole vectors are read in place; others are widened per block.
  const bool in_place = std::is_same_v<T, float> && dp == dim;
  const int64_t G = L.group, BS = L.block_size;
  const int64_t num_tokens = item.token_end - item.token_begin;
  const int64_t heads = item.kv_end - item.kv_begin;
  const int64_t head_rows = num_tokens * G;  // row = head * head_rows + token * G + member
  const int64_t rows = heads * head_rows;
  const int64_t seq_len = seq_lens[item.seq];
  const int64_t first_token = query_start[item.seq];
  const int64_t context_len = seq_len - (query_start[item.seq + 1] - first_token);

  // scratch: q [rows, dp] | acc [rows, dp] | max [rows] | sum [rows] | keys [BS, dp] | values [BS, dp]
  scratch.resize(static_cast<size_t>(2 * rows * dp + 2 * rows + 2 * BS * dp));
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
        widen_row(query + (item.token_begin + t) * L.q_token_stride + head * L.q_head_stride, dst, dim, dp);
        for (int64_t d = 0; d < dim; ++d) dst[d] *= L.scale;
      }
    }
  }
  std::fill(acc, acc + rows * dp, 0.0f);
  std::fill(row_max, row_max + rows, kNegInf);
  std::fill(row_sum, row_sum + rows, 0.0f);

  const int64_t first_pos = context_len + (item.token_begin - first_token);
  const int64_t last_pos = context_len + (item.token_end - 1 - first_token);
  const int64_t lowest_key = first_key(item, query_start, seq_lens, L);
  const int32_t* table = block_tables + item.seq * L.block_table_stride;
  const int64_t token_bytes = L.cache_token_stride * static_cast<int64_t>(sizeof(T));
  const int64_t stride = in_place ? L.cache_token_stride : dp;

  const int64_t first_block = lowest_key / BS;
  Prefetcher prefetcher;
  const int64_t steps_per_block = heads * (num_tokens * (NV > 0 ? (G + 3) / 4 : G) + 1);
  // The next block's K/V stream in while this one is worked on; the last block's successor is
  // the first block of the thread's next item.
  auto prefetch_block = [&](const WorkItem& owner, int64_t b, int64_t steps) {
    const int64_t base = static_cast<int64_t>(block_tables[owner.seq * L.block_table_stride + b]) * L.cache_block_stride +
                         owner.kv_begin * dim;
    const int64_t bytes = (owner.kv_end - owner.kv_begin) * dim * static_cast<int64_t>(sizeof(T));
    prefetcher.start(key_cache + base, value_cache + base, BS, token_bytes, bytes, steps);
  };
  prefetch_block(item, first_block, 1);
  prefetcher.finish();
  for (int64_t b = first_block; b * BS <= last_pos; ++b) {
    const int64_t block_start = b * BS;
    const int64_t block_base = static_cast<int64_t>(table[b]) * L.cache_block_stride + item.kv_begin * dim;
    if ((b + 1) * BS <= last_pos) {
      prefetch_block(item, b + 1, steps_per_block);
    } else if (next != nullptr) {
      prefetch_block(*next, first_key(*next, query_start, seq_lens, L) / BS, steps_per_block);
    }
    // Keys of this block that any row of the item may read.
    const int64_t union_lo = std::max(block_start, lowest_key) - block_start;
    const int64_t union_hi = std::min(block_start + BS - 1, last_pos) - block_start;
    for (int64_t h = 0; h < heads; ++h) {
      const T* key_src = key_cache + block_base + h * dim;
      const T* value_src = value_cache + block_base + h * dim;
      const float* keys = key_buf;
      const float* values = value_buf;
      if constexpr (std::is_same_v<T, float>) {
        if (in_place) {
          keys = key_src;
          values = value_src;
        }
      }
      prefetcher.step();
      if (!in_place) {
        for (int64_t j = union_lo; j <= union_hi; ++j) {
          widen_row(key_src + j * L.cache_token_stride, key_buf + j * dp, dim, dp);
          widen_row(value_src + j * L.cache_token_stride, value_buf + j * dp, dim, dp);
        }
      }
      for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t pos = first_pos + t;
        const int64_t lo = std::max(block_start, L.window > 0 ? pos - L.window + 1 : int64_t{0}) - block_start;
        const int64_t hi = std::min(block_start + BS - 1, pos) - block_start;
        if (lo > hi) continue;
        const int64_t first_row = h * head_rows + t * G;
        if constexpr (NV > 0) {
          // The group's query heads together, up to four at a time: one K/V load feeds them all.
          for (int64_t g = 0; g < G; g += 4) {
            const int64_t row = first_row + g;
            float* const qr = q + row * dp;
            float* const ar = acc + row * dp;
            prefetcher.step();
            switch (std::min<int64_t>(4, G - g)) {
              case 1: attend_rows<NV, 1>(qr, ar, dp, row_max + row, row_sum + row, keys, values, stride, lo, hi, L.soft_cap); break;
              case 2: attend_rows<NV, 2>(qr, ar, dp, row_max + row, row_sum + row, keys, values, stride, lo, hi, L.soft_cap); break;
              case 3: attend_rows<NV, 3>(qr, ar, dp, row_max + row, row_sum + row, keys, values, stride, lo, hi, L.soft_cap); break;
              default: attend_rows<NV, 4>(qr, ar, dp, row_max + row, row_sum + row, keys, values, stride, lo, hi, L.soft_cap);
            }
          }
        } else {
          for (int64_t row = first_row; row < first_row + G; ++row) {
            prefetcher.step();
            attend_row_any(q + row * dp, acc + row * dp, row_max[row], row_sum[row], keys, values, stride, lo, hi,
                           nv, L.soft_cap);
          }
        }
      }
    }
    prefetcher.finish();
  }

  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t t = 0; t < num_tokens; ++t) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t row = h * head_rows + t * G + g;
        T* dst = out + (item.token_begin + t) * L.out_token_stride + ((item.kv_begin + h) * G + g) * dim;
        const float inv = 1.0f / row_sum[row];  // > 0: every query sees at least its own key
        store_row(dst, acc + row * dp, dim, inv);
      }
    }
  }
}

// One item per (sequence, tile) spanning every KV head; split per KV head when that leaves
// fewer than a few items per thread (a lone decode or a short prefill).
std::vector<WorkItem> plan_items(const int32_t* query_start, const int32_t* seq_lens, const int32_t* seq_ids,
                                 int64_t num_ids, int64_t num_kv_heads, int64_t tile_tokens, int64_t threads) {
  int64_t tiles = 0;
  for (int64_t i = 0; i < num_ids; ++i) {
    const int64_t s = seq_ids[i];
    tiles += (query_start[s + 1] - query_start[s] + tile_tokens - 1) / tile_tokens;
  }
  const int64_t heads_per_item = tiles >= 4 * threads ? num_kv_heads : 1;
  std::vector<WorkItem> items;
  items.reserve(static_cast<size_t>(tiles * (num_kv_heads / heads_per_item)));
  for (int64_t i = 0; i < num_ids; ++i) {
    const int64_t s = seq_ids[i];
    const int32_t begin = query_start[s], end = query_start[s + 1];
    const int64_t context_len = seq_lens[s] - (end - begin);
    for (int32_t t = begin; t < end; t += static_cast<int32_t>(tile_tokens)) {
      const int32_t t_end = std::min<int32_t>(end, t + static_cast<int32_t>(tile_tokens));
      const int64_t keys = context_len + (t_end - begin);
      for (int64_t h = 0; h < num_kv_heads; h += heads_per_item)
        items.push_back({static_cast<int32_t>(s), t, t_end, static_cast<int32_t>(h),
                         static_cast<int32_t>(h + heads_per_item), keys * (t_end - t) * heads_per_item});
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  return items;
}

template <typename T, int NV>
void run_items(const std::vector<WorkItem>& items, const T* q, const T* k, const T* v, const int32_t* bt,
               const int32_t* qs, const int32_t* sl, T* o, const Layout& L) {
  const int64_t n = static_cast<int64_t>(items.size());
  const int threads = std::max<int>(1, std::min<int64_t>(at::get_num_threads(), n));
  // Dynamic scheduling that claims one item ahead, so a thread knows which blocks it reads next.
  std::atomic<int64_t> next_item{0};
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scratch;
    int64_t i = next_item.fetch_add(1);
    while (i < n) {
      const int64_t following = next_item.fetch_add(1);
      attend_item<T, NV>(items[i], following < n ? &items[following] : nullptr, q, k, v, bt, qs, sl, o, L, scratch);
      i = following;
    }
  }
}

template <typename T>
void run_attention(const torch::Tensor& query, const torch::Tensor& kv_cache, const torch::Tensor& block_tables,
                   const torch::Tensor& query_start, const torch::Tensor& seq_lens, const torch::Tensor& seq_ids,
                   torch::Tensor& out, const Layout& L, int64_t tile_tokens) {
  const int32_t* qs = query_start.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  const std::vector<WorkItem> items = plan_items(qs, sl, seq_ids.data_ptr<int32_t>(), seq_ids.numel(),
                                                 L.num_kv_heads, tile_tokens, at::get_num_threads());
  const T* q = query.data_ptr<T>();
  const T* k = kv_cache.data_ptr<T>();
  const T* v = k + kv_cache.stride(0);
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  T* o = out.data_ptr<T>();
  // Whole vectors per head row known at compile time keep a row's accumulators in registers.
  switch (L.head_dim % W == 0 ? L.head_dim / W : 0) {
    case 4: run_items<T, 4>(items, q, k, v, bt, qs, sl, o, L); break;
    case 8: run_items<T, 8>(items, q, k, v, bt, qs, sl, o, L); break;
    case 16: run_items<T, 16>(items, q, k, v, bt, qs, sl, o, L); break;
    default: run_items<T, 0>(items, q, k, v, bt, qs, sl, o, L);
  }
}

}  // namespace
// Writes the new K/V (rows with slot -1 are skipped), then attends every sequence.
// query [tokens, heads, head_dim] (head_dim contiguous); key/value [tokens, kv_heads, head_dim];
// kv_cache [2, blocks, block_size, kv_heads, head_dim] contiguous; int32 host-side metadata.
// Attends the sequences listed in seq_ids (the others' output rows are left for the caller).
// Returns [tokens, heads, head_dim]; rows past the last sequence are zero.
torch::Tensor paged_attention(torch::Tensor query, torch::Tensor key, torch::Tensor value, torch::Tensor kv_cache,
                              torch::Tensor slot_mapping, torch::Tensor query_start, torch::Tensor seq_lens,
                              torch::Tensor block_tables, torch::Tensor seq_ids, double scale, int64_t window,
                              double soft_cap, int64_t tile_tokens) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [tokens, heads, head_dim] with contiguous head_dim");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous(), "kv_cache must be a contiguous 5-d tensor");
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() && value.scalar_type() == kv_cache.scalar_type() &&
                  query.scalar_type() == kv_cache.scalar_type(),
              "query, key, value and kv_cache must share one dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && query_start.scalar_type() == torch::kInt32 &&
                  seq_lens.scalar_type() == torch::kInt32 && block_tables.scalar_type() == torch::kInt32,
              "slot_mapping must be int64; query_start, seq_lens, block_tables int32");
  TORCH_CHECK(block_tables.is_contiguous() && query_start.is_contiguous() && seq_lens.is_contiguous() &&
                  slot_mapping.is_contiguous(),
              "metadata tensors must be contiguous");
  TORCH_CHECK(tile_tokens > 0, "tile_tokens must be positive");
  TORCH_CHECK(seq_ids.scalar_type() == torch::kInt32 && seq_ids.is_contiguous(), "seq_ids must be contiguous int32");
  for (int64_t i = 0; i < seq_ids.numel(); ++i) {
    const int32_t id = seq_ids.data_ptr<int32_t>()[i];
    TORCH_CHECK(id >= 0 && id < seq_lens.size(0), "seq_ids[", i, "]=", id, " is not a sequence of this batch");
  }

  const int64_t num_tokens = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = kv_cache.size(3), block_size = kv_cache.size(2);
  TORCH_CHECK(kv_cache.size(4) == head_dim && num_heads % num_kv_heads == 0, "query and kv_cache heads do not fit");

  // New K/V first: a query attends to its own token and the new ones before it.
  if (slot_mapping.numel() > 0) {
    auto key_slots = kv_cache[0].view({-1, num_kv_heads * head_dim});
    auto value_slots = kv_cache[1].view({-1, num_kv_heads * head_dim});
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    const int64_t writes = std::min<int64_t>(slot_mapping.numel(), num_tokens);
    const int64_t num_slots = key_slots.size(0);
    auto key_rows = key.reshape({num_tokens, num_kv_heads * head_dim});
    auto value_rows = value.reshape({num_tokens, num_kv_heads * head_dim});
    for (int64_t t = 0; t < writes; ++t) {
      TORCH_CHECK(slots[t] < num_slots, "slot_mapping[", t, "]=", slots[t], " is past the cache's ", num_slots, " slots");
    }
    const int64_t row_bytes = num_kv_heads * head_dim * kv_cache.element_size();
    auto* k_dst = static_cast<char*>(key_slots.data_ptr());
    auto* v_dst = static_cast<char*>(value_slots.data_ptr());
    const bool dense = key_rows.is_contiguous() && value_rows.is_contiguous();
    auto key_src = dense ? key_rows : key_rows.contiguous();
    auto value_src = dense ? value_rows : value_rows.contiguous();
    const auto* k_src = static_cast<const char*>(key_src.data_ptr());
    const auto* v_src = static_cast<const char*>(value_src.data_ptr());
    for (int64_t t = 0; t < writes; ++t) {
      if (slots[t] < 0) continue;
      std::memcpy(k_dst + slots[t] * row_bytes, k_src + t * row_bytes, row_bytes);
      std::memcpy(v_dst + slots[t] * row_bytes, v_src + t * row_bytes, row_bytes);
    }
  }

  auto out = torch::empty({num_tokens, num_heads, head_dim}, query.options());
  const int64_t num_seqs = seq_lens.size(0);
  const int64_t real_tokens = num_seqs ? query_start.data_ptr<int32_t>()[num_seqs] : 0;
  if (real_tokens < num_tokens) out.narrow(0, real_tokens, num_tokens - real_tokens).zero_();

  Layout L{num_heads, num_kv_heads, head_dim, block_size, num_heads / num_kv_heads,
           query.stride(0), query.stride(1), num_heads * head_dim,
           kv_cache.stride(1), kv_cache.stride(2), block_tables.stride(0),
           static_cast<float>(scale), window, static_cast<float>(soft_cap)};
  switch (query.scalar_type()) {
    case torch::kFloat32: run_attention<float>(query, kv_cache, block_tables, query_start, seq_lens, seq_ids, out, L, tile_tokens); break;
    case torch::kBFloat16: run_attention<at::BFloat16>(query, kv_cache, block_tables, query_start, seq_lens, seq_ids, out, L, tile_tokens); break;
    case torch::kFloat16: run_attention<at::Half>(query, kv_cache, block_tables, query_start, seq_lens, seq_ids, out, L, tile_tokens); break;
    default: TORCH_CHECK(false, "unsupported dtype ", query.scalar_type());
  }
  return out;
}
