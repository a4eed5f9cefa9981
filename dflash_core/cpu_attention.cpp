// Row-invariant bf16 attention for the CPU.
//
// A row's output depends only on its query and the keys/values it sees, reduced in their
// position order by the same instructions whatever the pass: a plain step, a verify chain or a
// tree row gets the same bits for the same context (cpu_kernels.py says why that matters).
// The query heads of one KV group and a few rows are computed together so that each key and value
// is read once for all of them, but every query's sums run alone, in the same order, so neither
// the grouping nor the thread split changes a bit.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "cpu_bf16.h"

#ifndef __AVX512F__
#error "needs AVX-512: the batch-invariant path runs only on CPUs with AMX or AVX512-BF16"
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kLanes = 16;  // floats in one AVX-512 register

// Lane u of the result: the sum of a[u]'s 16 lanes, added in the same order for every u (so a
// score's bits do not depend on where its key falls among the 16).
inline __m512 sum_lanes(__m512 a[kLanes]) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]));
    c[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  }
  const __m512 e0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
  const __m512 e1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, 0x88), _mm512_shuffle_f32x4(e0, e1, 0xdd));
}

struct Inputs {
  const uint16_t *q, *keys, *values;
  at::BFloat16* out;
  const int64_t *before, *after, *after_count;
  int64_t heads, n, group, max_after, key_head, key_row, value_head, value_row;
  float scale;
};

// One query: its row, head, and the buffer rows of the keys it sees (context, then its own).
struct Query {
  int64_t head, row, before, count;
  const int64_t* after;
  const uint16_t* q;
  float* w;  // its scores, then its softmax weights
  int64_t key_row(int64_t j) const { return j < before ? j : after[j - before]; }
};

#ifdef __AVX512BF16__
// A query's dot products with 16 keys (rows[u], `keys` of them) as bf16 pairs (vdpbf16ps).
template <int NV>
inline __m512 scores16(const uint16_t* q, const uint16_t* kh, int64_t stride, const int64_t* rows, int64_t keys) {
  constexpr int kPairs = (NV + 1) / 2;  // 32 bf16 per register
  __m512bh qv[kPairs];
  for (int c = 0; c < kPairs; ++c)
    qv[c] = (NV % 2 && c == kPairs - 1) ? (__m512bh)_mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i*)(q + 32 * c)))
                                         : (__m512bh)_mm512_loadu_si512(q + 32 * c);
  __m512 a[kLanes];
  for (int64_t u = 0; u < kLanes; ++u) {
    a[u] = _mm512_setzero_ps();
    if (u >= keys) continue;
    const uint16_t* k = kh + rows[u] * stride;
    for (int c = 0; c < kPairs; ++c) {
      const __m512i kc = (NV % 2 && c == kPairs - 1) ? _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i*)(k + 32 * c)))
                                                     : _mm512_loadu_si512(k + 32 * c);
      a[u] = _mm512_dpbf16_ps(a[u], qv[c], (__m512bh)kc);
    }
  }
  return sum_lanes(a);
}
#else
// CPUs without AVX512-BF16 never run the bf16 target; this keeps the extension building there.
template <int NV>
inline __m512 scores16(const uint16_t* q, const uint16_t* kh, int64_t stride, const int64_t* rows, int64_t keys) {
  __m512 a[kLanes];
  for (int64_t u = 0; u < kLanes; ++u) {
    a[u] = _mm512_setzero_ps();
    if (u >= keys) continue;
    const uint16_t* k = kh + rows[u] * stride;
    for (int v = 0; v < NV; ++v) a[u] = _mm512_fmadd_ps(load_bf16(q + v * kLanes), load_bf16(k + v * kLanes), a[u]);
  }
  return sum_lanes(a);
}
#endif

// Scores of keys [j0, j0 + 16) in the query's order, scaled, stored; returns them for the maximum.
template <int NV>
inline __m512 score_block(const Inputs& in, const Query& qr, const uint16_t* kh, int64_t j0) {
  const int64_t keys = std::min<int64_t>(kLanes, qr.count - j0);
  int64_t rows[kLanes];
  for (int64_t u = 0; u < keys; ++u) rows[u] = qr.key_row(j0 + u);
  const __m512 s = _mm512_mul_ps(scores16<NV>(qr.q, kh, in.key_row, rows, keys), _mm512_set1_ps(in.scale));
  _mm512_storeu_ps(qr.w + j0, s);
  return s;
}

// Weights = exp(score - max) in place; returns their sum (the same order for every query).
inline float softmax_weights(float* w, int64_t count, float top) {
  for (int64_t j = 0; j < count; ++j) w[j] = exp_nonpositive(w[j] - top);
  __m512 total = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + kLanes <= count; j += kLanes) total = _mm512_add_ps(total, _mm512_loadu_ps(w + j));
  total = _mm512_add_ps(total, _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << (count - j)) - 1u), w + j));
  return _mm512_reduce_add_ps(total);
}

// The weighted values of M queries: each accumulates over its keys in its own order, one key at
// a time; the keys all of them see in place ([0, shared)) are loaded once for the M.
template <int NV, int M>
void weighted_values(const Inputs& in, const Query* qs, const float* sums, const uint16_t* vh, int64_t shared) {
  __m512 acc[M][NV];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_setzero_ps();
  for (int64_t j = 0; j < shared; ++j) {
    const uint16_t* val = vh + j * in.value_row;
    __m512 x[NV];
    for (int v = 0; v < NV; ++v) x[v] = load_bf16(val + v * kLanes);
    for (int m = 0; m < M; ++m) {
      const __m512 wj = _mm512_set1_ps(qs[m].w[j]);
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_fmadd_ps(wj, x[v], acc[m][v]);
    }
  }
  for (int m = 0; m < M; ++m) {
    const Query& qr = qs[m];
    for (int64_t j = shared; j < qr.count; ++j) {
      const uint16_t* val = vh + qr.key_row(j) * in.value_row;
      const __m512 wj = _mm512_set1_ps(qr.w[j]);
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_fmadd_ps(wj, load_bf16(val + v * kLanes), acc[m][v]);
    }
    constexpr int64_t dim = NV * kLanes;
    const __m512 inv = _mm512_set1_ps(1.0f / sums[m]);
    alignas(64) float result[dim];
    for (int v = 0; v < NV; ++v) _mm512_store_ps(result + v * kLanes, _mm512_mul_ps(acc[m][v], inv));
    at::BFloat16* orow = in.out + (qr.head * in.n + qr.row) * dim;
    for (int64_t d = 0; d < dim; ++d) orow[d] = at::BFloat16(result[d]);
  }
}

// Queries held in registers at once: M * NV accumulators, at most 24 of the 32 registers.
template <int NV>
constexpr int kTile = NV >= 16 ? 1 : std::min(8, 24 / NV);

template <int NV, int M = kTile<NV>>
void weighted_values_of(int m, const Inputs& in, const Query* qs, const float* sums, const uint16_t* vh,
                        int64_t shared) {
  if constexpr (M >= 1) {
    if (m == M) return weighted_values<NV, M>(in, qs, sums, vh, shared);
    weighted_values_of<NV, M - 1>(m, in, qs, sums, vh, shared);
  }
}

// Queries [first, first + count) of KV group kv, numbered row-major (the group's heads of row 0,
// then of row 1, ...), so that a tile's queries mostly see the same keys.
template <int NV>
void attend_tile(const Inputs& in, int64_t kv, int64_t first, int64_t count, std::vector<float>& scratch) {
  Query qs[kTile<NV>];
  int64_t most = 0, shared = INT64_MAX;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t r = (first + i) / in.group, h = kv * in.group + (first + i) % in.group;
    qs[i] = Query{h, r, in.before[r], in.before[r] + in.after_count[r], in.after + r * in.max_after,
                  in.q + (h * in.n + r) * NV * kLanes, nullptr};
    most = std::max(most, qs[i].count);
    shared = std::min(shared, qs[i].before);
  }
  const int64_t width = most + kLanes;
  scratch.resize(count * width);
  for (int64_t i = 0; i < count; ++i) qs[i].w = scratch.data() + i * width;
  const uint16_t* kh = in.keys + kv * in.key_head;
  __m512 best[kTile<NV>];
  for (int64_t i = 0; i < count; ++i) best[i] = _mm512_set1_ps(-INFINITY);
  // Whole blocks of in-place keys, each read once for the tile; then each query's own keys.
  const int64_t whole = shared / kLanes * kLanes;
  for (int64_t j0 = 0; j0 < whole; j0 += kLanes)
    for (int64_t i = 0; i < count; ++i) best[i] = _mm512_max_ps(best[i], score_block<NV>(in, qs[i], kh, j0));
  float sums[kTile<NV>];
  for (int64_t i = 0; i < count; ++i) {
    for (int64_t j0 = whole; j0 < qs[i].count; j0 += kLanes) {
      const int64_t keys = std::min<int64_t>(kLanes, qs[i].count - j0);
      best[i] = _mm512_mask_max_ps(best[i], static_cast<__mmask16>((1u << keys) - 1u), best[i],
                                   score_block<NV>(in, qs[i], kh, j0));
    }
    sums[i] = softmax_weights(qs[i].w, qs[i].count, _mm512_reduce_max_ps(best[i]));
  }
  weighted_values_of<NV>(static_cast<int>(count), in, qs, sums, in.values + kv * in.value_head, shared);
}

template <int NV>
void attend(const Inputs& in, int64_t kv_heads) {
  // Tiles of up to kTile queries, but at least two per thread when the pass is small (a plain
  // step has 3 queries per group) so both cores work.
  const int64_t per_group = in.group * in.n, threads = at::get_num_threads();
  const int64_t tile = std::max<int64_t>(1, std::min<int64_t>(kTile<NV>, per_group * kv_heads / (2 * threads)));
  const int64_t tiles = (per_group + tile - 1) / tile;
  at::parallel_for(0, kv_heads * tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t kv = item / tiles, first = item % tiles * tile;
      attend_tile<NV>(in, kv, first, std::min(tile, per_group - first), scratch);
    }
  });
}

}  // namespace

// q [heads, n, dim] bf16, dim 16, 32, 64, 128 or 256; keys [kv_heads, S, dim] and values
// [kv_heads, S, >= dim] bf16 (any row strides, the last dim contiguous). Row r sees buffer rows
// [0, before[r]) and then after[r, :after_count[r]], in that order. Returns [heads, n, dim] bf16.
torch::Tensor attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor before,
                        torch::Tensor after, torch::Tensor after_count, double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 && keys.scalar_type() == torch::kBFloat16 &&
                  values.scalar_type() == torch::kBFloat16, "bf16 queries, keys and values");
  TORCH_CHECK(keys.stride(2) == 1 && values.stride(2) == 1, "keys and values contiguous in their last dim");
  q = q.contiguous();
  before = before.to(torch::kLong).contiguous();
  after = after.to(torch::kLong).contiguous();
  after_count = after_count.to(torch::kLong).contiguous();
  const int64_t heads = q.size(0), n = q.size(1), dim = q.size(2), kv_heads = keys.size(0);
  TORCH_CHECK(keys.size(2) == dim && values.size(2) >= dim && heads % kv_heads == 0, "shapes disagree");
  auto out = torch::empty({heads, n, dim}, q.options());
  const Inputs in{reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()),
                  reinterpret_cast<const uint16_t*>(keys.data_ptr<at::BFloat16>()),
                  reinterpret_cast<const uint16_t*>(values.data_ptr<at::BFloat16>()),
                  out.data_ptr<at::BFloat16>(),
                  before.data_ptr<int64_t>(), after.data_ptr<int64_t>(), after_count.data_ptr<int64_t>(),
                  heads, n, heads / kv_heads, after.size(1), keys.stride(0), keys.stride(1),
                  values.stride(0), values.stride(1), static_cast<float>(scale)};
  switch (dim) {
    case 16: attend<1>(in, kv_heads); break;
    case 32: attend<2>(in, kv_heads); break;
    case 64: attend<4>(in, kv_heads); break;
    case 128: attend<8>(in, kv_heads); break;
    case 256: attend<16>(in, kv_heads); break;
    default: TORCH_CHECK(false, "head_dim ", dim, " is not one of 16, 32, 64, 128, 256");
  }
  return out;
}
