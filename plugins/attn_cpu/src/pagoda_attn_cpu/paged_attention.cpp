// Paged attention for the CPU, reading K/V straight from the block cache.
//
// Work item = (sequence, KV head, tile of query tokens). Every query head of the
// KV head's group and every token of the tile share one pass over the
// sequence's blocks (GQA: the K/V block is read once for all of them). Softmax
// is online (running max and sum per query row) in float32; V accumulates in
// float32; the output is written in the model dtype.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Loads as float: half types are widened with bit operations the compiler vectorizes.
inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const at::BFloat16* p, int64_t i) {
  uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float load(const at::Half* p, int64_t i) { return static_cast<float>(p[i]); }

template <typename T>
inline void store(T* p, int64_t i, float v) { p[i] = static_cast<T>(v); }

// exp for x <= 0 (scores minus their running max); below -87 (or -inf) it is 0.
// Branch-free so the loops that call it vectorize.
inline float exp_nonpositive(float x) {
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

// Dot product in 16 independent lanes: vectorizes without letting the compiler reassociate floats.
template <int D>
inline float dot(const float* a, const float* b, int64_t n) {
  constexpr int64_t kLanes = 16;
  const int64_t len = D > 0 ? D : n;
  float lanes[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= len; d += kLanes) {
#pragma GCC unroll 16
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += a[d + l] * b[d + l];
  }
  for (int64_t l = 0; d < len; ++d, ++l) lanes[l] += a[d] * b[d];
  // Pairwise halving: four vector adds of shrinking width, not sixteen dependent scalar adds.
#pragma GCC unroll 8
  for (int64_t l = 0; l < 8; ++l) lanes[l] += lanes[l + 8];
#pragma GCC unroll 4
  for (int64_t l = 0; l < 4; ++l) lanes[l] += lanes[l + 4];
  lanes[0] += lanes[2];
  lanes[1] += lanes[3];
  return lanes[0] + lanes[1];
}

// A cache row as float: read in place for float, widened into ``buffer`` otherwise.
inline const float* widen(const float* row, float*, int64_t) { return row; }
template <typename T>
inline const float* widen(const T* row, float* buffer, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) buffer[d] = load(row, d);
  return buffer;
}

struct WorkItem {
  int32_t seq;
  int32_t kv_head;
  int32_t token_begin;  // flat-batch rows of this tile
  int32_t token_end;
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

// Query rows handled together per pass over a block: their accumulators stay in registers.
template <int D>
constexpr int64_t kRowBlock = D <= 64 ? 4 : 2;

// Runtime head_dim (D == 0) or a compile-time one (64, 128: unrolled, accumulators in registers).
template <typename T, int D>
void attend_item(const WorkItem& item, const T* query, const T* key_cache, const T* value_cache,
                 const int32_t* block_tables, const int32_t* query_start, const int32_t* seq_lens,
                 T* out, const Layout& L, std::vector<float>& scratch) {
  constexpr int64_t RB = D > 0 ? kRowBlock<D> : 1;
  const int64_t dim = D > 0 ? D : L.head_dim;
  const int64_t G = L.group, BS = L.block_size;
  const int64_t num_tokens = item.token_end - item.token_begin;
  const int64_t rows = num_tokens * G;
  const int64_t padded_rows = (rows + RB - 1) / RB * RB;
  const int64_t seq_len = seq_lens[item.seq];
  const int64_t first_token = query_start[item.seq];
  const int64_t context_len = seq_len - (query_start[item.seq + 1] - first_token);

  // scratch: q [padded_rows, dim] | acc [padded_rows, dim] | max | sum | scores [RB, BS] | key row | value row
  scratch.resize(static_cast<size_t>(2 * padded_rows * dim + 2 * padded_rows + RB * BS + 2 * dim));
  float* q = scratch.data();
  float* acc = q + padded_rows * dim;
  float* row_max = acc + padded_rows * dim;
  float* row_sum = row_max + padded_rows;
  float* scores = row_sum + padded_rows;
  float* key_row = scores + RB * BS;
  float* value_row = key_row + dim;

  // Row r = (token r / G, head kv_head * G + r % G); queries pre-scaled; padding rows are 0.
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = item.token_begin + r / G;
    const int64_t head = item.kv_head * G + r % G;
    const T* src = query + token * L.q_token_stride + head * L.q_head_stride;
    float* dst = q + r * dim;
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) dst[d] = load(src, d) * L.scale;
  }
  std::fill(q + rows * dim, q + padded_rows * dim, 0.0f);
  std::fill(acc, acc + padded_rows * dim, 0.0f);
  std::fill(row_max, row_max + padded_rows, kNegInf);
  std::fill(row_sum, row_sum + padded_rows, 0.0f);

  const int64_t first_pos = context_len + (item.token_begin - first_token);
  const int64_t last_pos = context_len + (item.token_end - 1 - first_token);
  const int64_t lowest_key = L.window > 0 ? std::max<int64_t>(0, first_pos - L.window + 1) : 0;
  const int32_t* table = block_tables + item.seq * L.block_table_stride;
  const int64_t head_offset = item.kv_head * dim;

  for (int64_t b = lowest_key / BS; b * BS <= last_pos; ++b) {
    const int64_t block_start = b * BS;
    const int64_t block_base = static_cast<int64_t>(table[b]) * L.cache_block_stride + head_offset;
    const T* keys = key_cache + block_base;
    const T* values = value_cache + block_base;
    if ((b + 1) * BS <= last_pos) {
      const int64_t next_base = static_cast<int64_t>(table[b + 1]) * L.cache_block_stride + head_offset;
      for (int64_t j = 0; j < BS; ++j) {
        for (int64_t byte = 0; byte < dim * static_cast<int64_t>(sizeof(T)); byte += 64) {
          __builtin_prefetch(reinterpret_cast<const char*>(key_cache + next_base + j * L.cache_token_stride) + byte);
          __builtin_prefetch(reinterpret_cast<const char*>(value_cache + next_base + j * L.cache_token_stride) + byte);
        }
      }
    }
    for (int64_t r0 = 0; r0 < rows; r0 += RB) {
      // Keys [lo[i], hi[i]] of this block are visible to row r0 + i (padding rows: none).
      int64_t lo[RB], hi[RB];
      int64_t union_lo = BS, union_hi = -1;
      for (int64_t i = 0; i < RB; ++i) {
        if (r0 + i >= rows) { lo[i] = BS; hi[i] = -1; continue; }
        const int64_t pos = first_pos + (r0 + i) / G;
        lo[i] = std::max(block_start, L.window > 0 ? pos - L.window + 1 : int64_t{0}) - block_start;
        hi[i] = std::min(block_start + BS - 1, pos) - block_start;
        if (lo[i] <= hi[i]) { union_lo = std::min(union_lo, lo[i]); union_hi = std::max(union_hi, hi[i]); }
      }
      if (union_lo > union_hi) continue;
      const float* qr = q + r0 * dim;

      for (int64_t j = union_lo; j <= union_hi; ++j) {
        const T* k = keys + j * L.cache_token_stride;
        const float* kf = widen(k, key_row, dim);
#pragma GCC unroll 4
        for (int64_t i = 0; i < RB; ++i) {
          scores[i * BS + j] = dot<D>(qr + i * dim, kf, dim);
        }
      }

      float correction[RB];
      for (int64_t i = 0; i < RB; ++i) {
        float* s = scores + i * BS;
        const int64_t row = r0 + i;
        if (lo[i] > hi[i]) {
          for (int64_t j = union_lo; j <= union_hi; ++j) s[j] = 0.0f;
          correction[i] = 1.0f;
          continue;
        }
        float block_max = kNegInf;
        for (int64_t j = union_lo; j <= union_hi; ++j) {
          float x = s[j];
          if (L.soft_cap > 0.0f) x = L.soft_cap * std::tanh(x / L.soft_cap);
          x = (j < lo[i] || j > hi[i]) ? kNegInf : x;
          s[j] = x;
          block_max = std::max(block_max, x);
        }
        const float new_max = std::max(row_max[row], block_max);
        correction[i] = exp_nonpositive(row_max[row] - new_max);  // 0 on the row's first block
        float block_sum = 0.0f;
#pragma omp simd reduction(+ : block_sum)
        for (int64_t j = union_lo; j <= union_hi; ++j) {
          const float p = exp_nonpositive(s[j] - new_max);
          s[j] = p;
          block_sum += p;
        }
        row_max[row] = new_max;
        row_sum[row] = row_sum[row] * correction[i] + block_sum;
      }

      float* ar = acc + r0 * dim;
      for (int64_t i = 0; i < RB; ++i) {
        if (correction[i] == 1.0f) continue;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) ar[i * dim + d] *= correction[i];
      }
      for (int64_t j = union_lo; j <= union_hi; ++j) {
        const T* v = values + j * L.cache_token_stride;
        const float* vf = widen(v, value_row, dim);
#pragma GCC unroll 4
        for (int64_t i = 0; i < RB; ++i) {
          const float p = scores[i * BS + j];
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) ar[i * dim + d] += p * vf[d];
        }
      }
    }
  }

  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = item.token_begin + r / G;
    const int64_t head = item.kv_head * G + r % G;
    T* dst = out + token * L.out_token_stride + head * dim;
    const float inv = 1.0f / row_sum[r];  // > 0: every query sees at least its own key
    const float* ar = acc + r * dim;
    for (int64_t d = 0; d < dim; ++d) store(dst, d, ar[d] * inv);
  }
}

std::vector<WorkItem> plan_items(const int32_t* query_start, const int32_t* seq_lens, const int32_t* seq_ids,
                                 int64_t num_ids, int64_t num_kv_heads, int64_t tile_tokens) {
  std::vector<WorkItem> items;
  items.reserve(static_cast<size_t>(num_ids * num_kv_heads));
  for (int64_t i = 0; i < num_ids; ++i) {
    const int64_t s = seq_ids[i];
    const int32_t begin = query_start[s], end = query_start[s + 1];
    const int64_t context_len = seq_lens[s] - (end - begin);
    for (int32_t t = begin; t < end; t += static_cast<int32_t>(tile_tokens)) {
      const int32_t t_end = std::min<int32_t>(end, t + static_cast<int32_t>(tile_tokens));
      const int64_t keys = context_len + (t_end - begin);
      for (int64_t h = 0; h < num_kv_heads; ++h)
        items.push_back({static_cast<int32_t>(s), static_cast<int32_t>(h), t, t_end, keys * (t_end - t)});
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  return items;
}

template <typename T>
void run_attention(const torch::Tensor& query, const torch::Tensor& kv_cache, const torch::Tensor& block_tables,
                   const torch::Tensor& query_start, const torch::Tensor& seq_lens, const torch::Tensor& seq_ids,
                   torch::Tensor& out, const Layout& L, int64_t tile_tokens) {
  const int32_t* qs = query_start.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  const std::vector<WorkItem> items = plan_items(qs, sl, seq_ids.data_ptr<int32_t>(), seq_ids.numel(), L.num_kv_heads, tile_tokens);
  const T* q = query.data_ptr<T>();
  const T* k = kv_cache.data_ptr<T>();
  const T* v = k + kv_cache.stride(0);
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  T* o = out.data_ptr<T>();
  const int64_t n = static_cast<int64_t>(items.size());
  const int threads = std::max<int>(1, std::min<int64_t>(at::get_num_threads(), n));
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) {
      switch (L.head_dim) {
        case 64: attend_item<T, 64>(items[i], q, k, v, bt, qs, sl, o, L, scratch); break;
        case 128: attend_item<T, 128>(items[i], q, k, v, bt, qs, sl, o, L, scratch); break;
        default: attend_item<T, 0>(items[i], q, k, v, bt, qs, sl, o, L, scratch);
      }
    }
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
