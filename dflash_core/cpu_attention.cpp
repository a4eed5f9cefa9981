// Row-invariant bf16 attention for the CPU.
//
// A row's output depends only on its query and the keys/values it sees, reduced in their
// position order by the same instructions whatever the pass: a plain step, a verify chain or a
// tree row gets the same bits for the same context (cpu_kernels.py says why that matters).
// The query heads of one KV group and a few rows are computed together so that each key and value
// is read once for all of them, but every query's sums run alone, in the same order, so neither
// the grouping nor the thread split changes a bit.
//
// On AVX512-BF16 (below; AMX tiles further down): a score is its query's and key's bf16 pair
// products (vdpbf16ps) over 16-pair chunks, its lanes summed in one fixed tree; a weight is
// exp(score - max) rounded to bf16 and the total sums the rounded weights in key order; a query's
// values are summed two keys at a time in key order (vdpbf16ps on the pair's values interleaved,
// its two weights broadcast), so a key costs half the instructions fp32 sums did.
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

// e^x for x <= 0 to ~3e-6 relative (2^f by a degree-4 polynomial on [-0.5, 0.5], its exponent
// added to the bits), enough for weights that are rounded to bf16 next: exp_nonpositive's
// degree-7 polynomial and scalef cost ~20 cycles a vector on a core with one 512-bit FMA unit,
// most of a 16-row pass's attention once AMX tiles do the sums. Below -80 (weights under 2e-35
// of the largest) it returns e^-80.
inline __m512 exp_weight(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-80.0f)), _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(0.009560510516166687f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.05591703951358795f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24024981260299683f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931219696998596f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.9999991655349731f));
  return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23)));
}

// acc + a.hi * b.hi + a.lo * b.lo in each 32-bit lane of bf16 pairs.
inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
#ifdef __AVX512BF16__
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
#else  // CPUs without AVX512-BF16 never run the bf16 target; this keeps the extension building there.
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(a, hi)), _mm512_castsi512_ps(_mm512_and_si512(b, hi)), acc);
  return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)), _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)), acc);
#endif
}

// acc + (the pair at p, in every lane) . b: one instruction with the pair as a broadcast memory
// operand, which GCC does not fold from _mm512_set1_epi32.
inline __m512 dot_pair_at(__m512 acc, const void* p, __m512i b) {
#ifdef __AVX512BF16__
  __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(b), "m"(*static_cast<const uint32_t*>(p)));
  return acc;
#else
  return dot_pairs(acc, _mm512_set1_epi32(*static_cast<const int*>(p)), b);
#endif
}

struct Inputs {
  const uint16_t *q, *keys, *values;
  at::BFloat16* out;
  const int64_t *before, *after, *after_count;
  int64_t heads, n, group, max_after, key_head, key_row, value_head, value_row, key_rows;
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

// A query's dot products with 16 keys as bf16 pairs, key u at key(u) (`keys` of them, the rest
// zeros; kFull: all 16).
template <int NV, bool kFull, typename Key>
inline __m512 scores16(const uint16_t* q, Key key, int64_t keys) {
  constexpr int kRegs = (NV + 1) / 2;  // 32 bf16 per register
  auto load = [](const uint16_t* p, int c) {
    return (NV % 2 && c == kRegs - 1) ? _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * c)))
                                      : _mm512_loadu_si512(p + 32 * c);
  };
  __m512i qv[kRegs];
  for (int c = 0; c < kRegs; ++c) qv[c] = load(q, c);
  __m512 a[kLanes];
#pragma GCC unroll 16
  for (int u = 0; u < kLanes; ++u) {
    a[u] = _mm512_setzero_ps();
    if (!kFull && u >= keys) continue;
    const uint16_t* k = key(u);
    for (int c = 0; c < kRegs; ++c) a[u] = dot_pairs(a[u], qv[c], load(k, c));
  }
  return sum_lanes(a);
}

// Scores of keys [j0, j0 + 16) in the query's order, scaled, stored: in place (kFull, keys j0 +
// u at buffer row j0 + u) or any.
template <int NV, bool kFull>
inline void score_block(const Inputs& in, const Query& qr, const uint16_t* kh, int64_t j0) {
  __m512 s;
  if constexpr (kFull) {
    const uint16_t* first = kh + j0 * in.key_row;
    s = scores16<NV, true>(qr.q, [&](int u) { return first + u * in.key_row; }, kLanes);
  } else {
    const int64_t keys = std::min<int64_t>(kLanes, qr.count - j0);
    s = scores16<NV, false>(qr.q, [&](int u) { return kh + qr.key_row(j0 + u) * in.key_row; }, keys);
  }
  _mm512_storeu_ps(qr.w + j0, _mm512_mul_ps(s, _mm512_set1_ps(in.scale)));
}

inline __mmask16 first_lanes(int64_t k) {
  return static_cast<__mmask16>(k >= kLanes ? 0xffffu : k <= 0 ? 0u : (1u << k) - 1u);
}

// A query's scores (w) become bf16 weights (wb, zeros from its last key to the next pair of
// blocks); returns their total.
inline float softmax_weights(const Query& qr, uint16_t* wb) {
  __m512 best = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < qr.count; j += kLanes) {
    const __mmask16 m = first_lanes(qr.count - j);
    best = _mm512_mask_max_ps(best, m, best, _mm512_maskz_loadu_ps(m, qr.w + j));
  }
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best));
  __m512 total = _mm512_setzero_ps();
  for (int64_t j = 0; j < qr.count + kLanes; j += kLanes) {
    const __mmask16 m = first_lanes(qr.count - j);
    const __m256i w = _mm256_maskz_mov_epi16(m, float_to_bf16(exp_weight(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, qr.w + j), top))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(wb + j), w);
    total = _mm512_add_ps(total, bf16_to_float(w));
  }
  return _mm512_reduce_add_ps(total);
}

// Values a (key j) and b (key j + 1, nullptr: zeros) as pairs, sum v of a query's NV: for NV >= 2
// the words of 32 dimensions [32h, 32h + 32) unpacked (h = v / 2; v odd: the high words of each
// 128-bit lane), so sum v's lanes hold the dimensions `store_values` puts back in order (unpacking
// is cheaper than permuting words); NV = 1: the 16 dimensions in order.
template <int NV>
inline __m512i value_pairs(const uint16_t* a, const uint16_t* b, int v) {
  if constexpr (NV == 1) {
    alignas(64) static const uint16_t idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                 8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i va = _mm512_maskz_loadu_epi16(0xffff, a), vb = b ? _mm512_maskz_loadu_epi16(0xffff, b) : _mm512_setzero_si512();
    return _mm512_permutex2var_epi16(va, _mm512_load_si512(idx), vb);
  } else {
    const __m512i va = _mm512_loadu_si512(a + v / 2 * 32), vb = b ? _mm512_loadu_si512(b + v / 2 * 32) : _mm512_setzero_si512();
    return v % 2 ? _mm512_unpackhi_epi16(va, vb) : _mm512_unpacklo_epi16(va, vb);
  }
}

// A query's sums (value_pairs' lane order) scaled by inv, in dimension order, as bf16 at out.
template <int NV>
inline void store_values(const __m512 acc[NV], __m512 inv, uint16_t* out) {
  if constexpr (NV == 1) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), float_to_bf16(_mm512_mul_ps(acc[0], inv)));
  } else {
    const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int h = 0; h < NV / 2; ++h) {
      const __m512 x = _mm512_mul_ps(acc[2 * h], inv), y = _mm512_mul_ps(acc[2 * h + 1], inv);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * h), float_to_bf16(_mm512_permutex2var_ps(x, lo, y)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * h + 16), float_to_bf16(_mm512_permutex2var_ps(x, hi, y)));
    }
  }
}

// The weighted values of M queries over keys [0, even), each key read once for all of them,
// into sums[m] (NV * 16 floats each).
template <int NV, int M>
void shared_values(const Inputs& in, const uint16_t* const wb[], const uint16_t* vh, int64_t even, float* sums) {
  // Fully unrolled, so that the sums stay in registers.
  __m512 acc[M][NV];
  const int* w[M];
#pragma GCC unroll 32
  for (int m = 0; m < M; ++m) {
    w[m] = reinterpret_cast<const int*>(wb[m]);
#pragma GCC unroll 32
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_setzero_ps();
  }
  for (int64_t j = 0; j < even; j += 2) {
    const uint16_t *a = vh + j * in.value_row, *b = a + in.value_row;
#pragma GCC unroll 32
    for (int v = 0; v < NV; ++v) {
      const __m512i x = value_pairs<NV>(a, b, v);
#pragma GCC unroll 32
      for (int m = 0; m < M; ++m) acc[m][v] = dot_pair_at(acc[m][v], w[m] + j / 2, x);
    }
  }
#pragma GCC unroll 32
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 32
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(sums + (m * NV + v) * kLanes, acc[m][v]);
}

// A query's values from key `even` on, added to its sums, then its output row.
template <int NV>
void own_values(const Inputs& in, const Query& qr, const uint16_t* wb, float total, const uint16_t* vh, int64_t even,
                const float* sums) {
  __m512 acc[NV];
  for (int v = 0; v < NV; ++v) acc[v] = _mm512_loadu_ps(sums + v * kLanes);
  for (int64_t j = even; j < qr.count; j += 2) {
    const uint16_t* a = vh + qr.key_row(j) * in.value_row;
    const uint16_t* b = j + 1 < qr.count ? vh + qr.key_row(j + 1) * in.value_row : nullptr;
    for (int v = 0; v < NV; ++v) acc[v] = dot_pair_at(acc[v], wb + j, value_pairs<NV>(a, b, v));
  }
  store_values<NV>(acc, _mm512_set1_ps(1.0f / total),
                   reinterpret_cast<uint16_t*>(in.out + (qr.head * in.n + qr.row) * NV * kLanes));
}

// Queries held in registers at once: M * NV accumulators, at most 24 of the 32 registers.
template <int NV>
constexpr int kTile = NV >= 16 ? 1 : std::min(8, 24 / NV);

template <int NV, int M = kTile<NV>>
void shared_values_of(int m, const Inputs& in, const uint16_t* const wb[], const uint16_t* vh, int64_t even,
                      float* sums) {
  if constexpr (M >= 1) {
    if (m == M) return shared_values<NV, M>(in, wb, vh, even, sums);
    shared_values_of<NV, M - 1>(m, in, wb, vh, even, sums);
  }
}

// One thread's buffers: scores, weights and the value sums shared by a tile's queries.
struct Scratch {
  std::vector<float> scores, sums;
  std::vector<uint16_t> weights;
};

// Queries [first, first + count) of KV group kv, numbered row-major (the group's heads of row 0,
// then of row 1, ...), so that a tile's queries mostly see the same keys.
template <int NV>
void attend_tile(const Inputs& in, int64_t kv, int64_t first, int64_t count, Scratch& s) {
  Query qs[kTile<NV>];
  int64_t most = 0, shared = INT64_MAX;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t r = (first + i) / in.group, h = kv * in.group + (first + i) % in.group;
    qs[i] = Query{h, r, in.before[r], in.before[r] + in.after_count[r], in.after + r * in.max_after,
                  in.q + (h * in.n + r) * NV * kLanes, nullptr};
    most = std::max(most, qs[i].count);
    shared = std::min(shared, qs[i].before);
  }
  const int64_t width = (most + 2 * kLanes - 1) / kLanes * kLanes;  // room for a block of zero weights past the last key
  s.scores.resize(count * width);
  s.weights.resize(count * width);
  for (int64_t i = 0; i < count; ++i) qs[i].w = s.scores.data() + i * width;
  const uint16_t* kh = in.keys + kv * in.key_head;
  // Whole blocks of in-place keys, each read once for the tile; then each query's own keys.
  const int64_t whole = shared / kLanes * kLanes;
  for (int64_t j0 = 0; j0 < whole; j0 += kLanes)
    for (int64_t i = 0; i < count; ++i) score_block<NV, true>(in, qs[i], kh, j0);
  const uint16_t* wb[kTile<NV>];
  float totals[kTile<NV>];
  for (int64_t i = 0; i < count; ++i) {
    for (int64_t j0 = whole; j0 < qs[i].count; j0 += kLanes) score_block<NV, false>(in, qs[i], kh, j0);
    uint16_t* w = s.weights.data() + i * width;
    totals[i] = softmax_weights(qs[i], w);
    wb[i] = w;
  }
  const uint16_t* vh = in.values + kv * in.value_head;
  const int64_t even = shared & ~int64_t{1};
  s.sums.resize(count * NV * kLanes);
  shared_values_of<NV>(static_cast<int>(count), in, wb, vh, even, s.sums.data());
  for (int64_t i = 0; i < count; ++i) own_values<NV>(in, qs[i], wb[i], totals[i], vh, even, s.sums.data() + i * NV * kLanes);
}

template <int NV>
void attend(const Inputs& in, int64_t kv_heads) {
  // Tiles of up to kTile queries, but at least two per thread when the pass is small (a plain
  // step has 3 queries per group) so both cores work.
  const int64_t per_group = in.group * in.n, threads = at::get_num_threads();
  const int64_t tile = std::max<int64_t>(1, std::min<int64_t>(kTile<NV>, per_group * kv_heads / (2 * threads)));
  const int64_t tiles = (per_group + tile - 1) / tile;
  at::parallel_for(0, kv_heads * tiles, 1, [&](int64_t begin, int64_t end) {
    static thread_local Scratch scratch;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t kv = item / tiles, first = item % tiles * tile;
      attend_tile<NV>(in, kv, first, std::min(tile, per_group - first), scratch);
    }
  });
}


#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// AMX tiles, where the CPU has them, for head sizes that are a multiple of 32. A tile multiply
// takes 16 queries against 16 keys (scores) or 16 queries' weights against 32 keys' values, so a
// tree pass's rows cost little more than a plain step's, where the path above spends ~0.5 µs per
// query and layer at 300 keys. Each result is still computed alone, by the same instructions in the same order
// whatever shares its tile: a score is its query's and key's pair products summed by the tile
// multiply, 32 dimensions at a time in dimension order; a weight is exp(score - max) rounded to
// bf16 (the tile multiply's operand), the total sums those rounded weights; a query's values are
// summed by tile multiplies over its keys in position order, 32 at a time, zeros past its last
// key. So a row's bits do not depend on the pass, as above, but they are not that path's bits.

constexpr int kT = 16;  // a tile's rows: queries, keys or pairs of keys

inline void configure_attention_tiles() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.rows[t] = kT, c.colsb[t] = 64;
  load_tile_config(c);
}

// A 16 x 16 matrix of 32-bit elements (row i at r[i]) transposed in registers.
inline void transpose16(__m512 r[kT]) {
  __m512 t[kT];
  for (int i = 0; i < kT; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < kT; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xee);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 x0 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88), x1 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xdd);
    const __m512 y0 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88), y1 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xdd);
    t[c] = _mm512_shuffle_f32x4(x0, y0, 0x88);
    t[8 + c] = _mm512_shuffle_f32x4(x0, y0, 0xdd);
    t[4 + c] = _mm512_shuffle_f32x4(x1, y1, 0x88);
    t[12 + c] = _mm512_shuffle_f32x4(x1, y1, 0xdd);
  }
  for (int i = 0; i < kT; ++i) r[i] = t[i];
}

// 16 rows of 16 32-bit elements, `stride` floats apart, transposed into `out` (rows `out_stride` apart).
inline void transpose16(const float* in, int64_t stride, float* out, int64_t out_stride) {
  __m512 r[kT];
  for (int i = 0; i < kT; ++i) r[i] = _mm512_loadu_ps(in + i * stride);
  transpose16(r);
  for (int i = 0; i < kT; ++i) _mm512_storeu_ps(out + i * out_stride, r[i]);
}

// The values of 32 keys (row j at rows[j], nullptr: zeros) as right operands, one per 16
// dimensions: out[d][p] = dimensions [16d, 16d + 16) of keys 2p and 2p + 1, interleaved; only
// the 32-dimension halves [h0, h1).
inline void values_by_pairs(const uint16_t* const rows[2 * kT], int h0, int h1, uint16_t* out) {
  alignas(64) static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                  8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t hi_idx[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                  24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  for (int p = 0; p < kT; ++p) {
    const uint16_t *a = rows[2 * p], *b = rows[2 * p + 1];
    for (int h = h0; h < h1; ++h) {
      const __m512i va = a ? _mm512_loadu_si512(a + 32 * h) : _mm512_setzero_si512();
      const __m512i vb = b ? _mm512_loadu_si512(b + 32 * h) : _mm512_setzero_si512();
      _mm512_storeu_si512(out + ((2 * h) * kT + p) * 32, _mm512_permutex2var_epi16(va, lo, vb));
      _mm512_storeu_si512(out + ((2 * h + 1) * kT + p) * 32, _mm512_permutex2var_epi16(va, hi, vb));
    }
  }
}

// Weights [j0, j0 + 32) of a query (zeros from `count` on) as one bf16 row of a left operand.
inline void weight_row(const float* w, int64_t count, int64_t j0, uint16_t* out) {
  auto mask = [&](int64_t from) {
    const int64_t k = std::clamp<int64_t>(count - from, 0, kLanes);
    return static_cast<__mmask16>(k == kLanes ? 0xffffu : (1u << k) - 1u);
  };
  const __m512 a = _mm512_maskz_loadu_ps(mask(j0), w + j0), b = _mm512_maskz_loadu_ps(mask(j0 + kLanes), w + j0 + kLanes);
  _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

// dst[0..3] += the left operand in tile 4 times right operands (NB of them, `stride` bf16
// apart from b); tiles 0..NB-1 hold the sums.
template <int NB>
inline void multiply_values(const uint16_t* b, int64_t stride) {
  _tile_loadd(5, b, 64);
  _tile_dpbf16ps(0, 4, 5);
  if constexpr (NB > 1) {
    _tile_loadd(6, b + stride, 64);
    _tile_dpbf16ps(1, 4, 6);
  }
  if constexpr (NB > 2) {
    _tile_loadd(7, b + 2 * stride, 64);
    _tile_dpbf16ps(2, 4, 7);
  }
  if constexpr (NB > 3) {
    _tile_loadd(5, b + 3 * stride, 64);
    _tile_dpbf16ps(3, 4, 5);
  }
}

template <int NB>
inline void load_sums(const float* src, int64_t stride) {
  _tile_loadd(0, src, stride);
  if constexpr (NB > 1) _tile_loadd(1, src + kLanes, stride);
  if constexpr (NB > 2) _tile_loadd(2, src + 2 * kLanes, stride);
  if constexpr (NB > 3) _tile_loadd(3, src + 3 * kLanes, stride);
}

template <int NB>
inline void store_sums(float* dst, int64_t stride) {
  _tile_stored(0, dst, stride);
  if constexpr (NB > 1) _tile_stored(1, dst + kLanes, stride);
  if constexpr (NB > 2) _tile_stored(2, dst + 2 * kLanes, stride);
  if constexpr (NB > 3) _tile_stored(3, dst + 3 * kLanes, stride);
}

struct TileScratch {
  std::vector<float> scores, weights, sums, part;
  std::vector<uint16_t> queries, values, left, keys;
  std::vector<float> paired;  // the queries as right operands, 32-bit pairs
};

// Queries [first, first + count) (count <= 16) of KV group kv, numbered as attend_tile's.
template <int NV>
void attend_tile_amx(const Inputs& in, int64_t kv, int64_t first, int64_t count, TileScratch& s) {
  constexpr int64_t dim = NV * kLanes;
  // The value sums' tiles hold 64 dimensions (4 blocks of 16) at a time; NV is 2, 4, 8 or 16.
  constexpr int kBlocks = std::min(4, NV), kGroups = NV / kBlocks;
  Query qs[kT];
  int64_t most = 0, shared = INT64_MAX, rows = 0;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t r = (first + i) / in.group, h = kv * in.group + (first + i) % in.group;
    qs[i] = Query{h, r, in.before[r], in.before[r] + in.after_count[r], in.after + r * in.max_after,
                  in.q + (h * in.n + r) * dim, nullptr};
    most = std::max(most, qs[i].count);
    shared = std::min(shared, qs[i].before);
    rows = std::max(rows, qs[i].before);
    for (int64_t a = 0; a < in.after_count[r]; ++a) rows = std::max(rows, qs[i].after[a] + 1);
  }
  const int64_t width = (rows + kT - 1) / kT * kT, wide = (most + 2 * kT - 1) / (2 * kT) * (2 * kT);
  s.queries.resize(kT * dim);
  for (int64_t i = 0; i < count; ++i) std::memcpy(s.queries.data() + i * dim, qs[i].q, dim * 2);
  std::fill(s.queries.begin() + count * dim, s.queries.end(), 0);
  // The queries as right operands, 32 dimensions at a time: [pair][query].
  s.paired.resize(NV / 2 * kT * kT);
  for (int h = 0; h < NV / 2; ++h)
    transpose16(reinterpret_cast<const float*>(s.queries.data()) + 16 * h, dim / 2, s.paired.data() + h * kT * kT, kT);
  // Scores of every query against buffer rows [0, rows), the keys any of them sees: the keys are
  // the left operand as the cache holds them, the sums [key][query] are turned to [query][key].
  s.scores.resize(kT * width);
  s.keys.resize(kT * dim);
  const uint16_t* kh = in.keys + kv * in.key_head;
  alignas(64) float sums16[kT * kT];
  for (int64_t k0 = 0; k0 < rows; k0 += kT) {
    const uint16_t* left = kh + k0 * in.key_row;
    int64_t left_stride = in.key_row;
    if (k0 + kT > in.key_rows) {  // the buffer ends inside this tile: copy its rows, zeros after
      std::fill(s.keys.begin(), s.keys.end(), 0);
      for (int64_t j = 0; k0 + j < in.key_rows && j < kT; ++j) std::memcpy(s.keys.data() + j * dim, left + j * in.key_row, dim * 2);
      left = s.keys.data(), left_stride = dim;
    }
    _tile_zero(0);
    for (int h = 0; h < NV / 2; ++h) {
      _tile_loadd(4, left + 32 * h, left_stride * 2);
      _tile_loadd(5, s.paired.data() + h * kT * kT, 64);
      _tile_dpbf16ps(0, 4, 5);
    }
    _tile_stored(0, sums16, 64);
    transpose16(sums16, kT, s.scores.data() + k0, width);
  }
  // Each query's weights in its keys' order, rounded to bf16, and their total.
  s.weights.resize(kT * wide);  // read through masks: nothing past a query's keys is read
  float totals[kT];
  for (int64_t i = 0; i < count; ++i) {
    Query& qr = qs[i];
    qr.w = s.weights.data() + i * wide;
    const float* sc = s.scores.data() + i * width;
    const __m512 scale = _mm512_set1_ps(in.scale);
    int64_t j = 0;
    for (; j + kLanes <= qr.before; j += kLanes) _mm512_storeu_ps(qr.w + j, _mm512_mul_ps(_mm512_loadu_ps(sc + j), scale));
    for (; j < qr.count; ++j) qr.w[j] = sc[qr.key_row(j)] * in.scale;
    __m512 best = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < qr.count; j += kLanes) {
      const __mmask16 m = static_cast<__mmask16>(qr.count - j >= kLanes ? 0xffffu : (1u << (qr.count - j)) - 1u);
      best = _mm512_mask_max_ps(best, m, best, _mm512_maskz_loadu_ps(m, qr.w + j));
    }
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best));
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < qr.count; j += kLanes) {
      const __mmask16 m = static_cast<__mmask16>(qr.count - j >= kLanes ? 0xffffu : (1u << (qr.count - j)) - 1u);
      const __m512 e = exp_weight(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, qr.w + j), top));
      const __m512 w = _mm512_maskz_mov_ps(m, _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(e)));
      _mm512_mask_storeu_ps(qr.w + j, m, w);
      total = _mm512_add_ps(total, w);
    }
    totals[i] = _mm512_reduce_add_ps(total);
  }
  // Values: the keys every query sees in place, 32 at a time, with all queries as the left operand.
  const int64_t whole = shared / (2 * kT);
  s.sums.resize(kT * dim);  // every row is stored from the tiles below
  s.left.assign(kT * 2 * kT, 0);  // rows past the queries stay zero
  s.values.resize(NV * kT * 2 * kT);
  s.part.assign(kT * dim, 0.0f);
  const uint16_t* vh = in.values + kv * in.value_head;
  const uint16_t* value_rows[2 * kT];
  constexpr int64_t operand = kT * 2 * kT;  // one right operand: 16 pairs of keys x 16 dimensions
  for (int g = 0; g < kGroups; ++g) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < whole; ++c) {
      for (int j = 0; j < 2 * kT; ++j) value_rows[j] = vh + (c * 2 * kT + j) * in.value_row;
      values_by_pairs(value_rows, g * kBlocks / 2, (g + 1) * kBlocks / 2, s.values.data());
      for (int64_t i = 0; i < count; ++i) weight_row(qs[i].w, qs[i].count, c * 2 * kT, s.left.data() + i * 2 * kT);
      _tile_loadd(4, s.left.data(), 64);
      multiply_values<kBlocks>(s.values.data() + g * kBlocks * operand, operand);
    }
    store_sums<kBlocks>(s.sums.data() + g * kBlocks * kLanes, dim * 4);
  }
  // The rest of each row's keys (its queries see the same ones), one chunk of 32 at a time.
  for (int64_t i0 = 0; i0 < count;) {
    int64_t i1 = i0 + 1;
    while (i1 < count && qs[i1].row == qs[i0].row) ++i1;
    const Query& qr = qs[i0];
    for (int64_t c = whole; c * 2 * kT < qr.count; ++c) {
      for (int j = 0; j < 2 * kT; ++j) {
        const int64_t at = c * 2 * kT + j;
        value_rows[j] = at < qr.count ? vh + qr.key_row(at) * in.value_row : nullptr;
      }
      values_by_pairs(value_rows, 0, NV / 2, s.values.data());
      std::fill(s.left.begin() + (i1 - i0) * 2 * kT, s.left.end(), 0);
      for (int64_t i = i0; i < i1; ++i) {
        weight_row(qs[i].w, qs[i].count, c * 2 * kT, s.left.data() + (i - i0) * 2 * kT);
        std::memcpy(s.part.data() + (i - i0) * dim, s.sums.data() + i * dim, dim * 4);
      }
      _tile_loadd(4, s.left.data(), 64);
      for (int g = 0; g < kGroups; ++g) {
        float* part = s.part.data() + g * kBlocks * kLanes;
        load_sums<kBlocks>(part, dim * 4);
        multiply_values<kBlocks>(s.values.data() + g * kBlocks * operand, operand);
        store_sums<kBlocks>(part, dim * 4);
      }
      for (int64_t i = i0; i < i1; ++i)
        std::memcpy(s.sums.data() + i * dim, s.part.data() + (i - i0) * dim, dim * 4);
    }
    i0 = i1;
  }
  for (int64_t i = 0; i < count; ++i) {
    const __m512 inv = _mm512_set1_ps(1.0f / totals[i]);
    uint16_t* orow = reinterpret_cast<uint16_t*>(in.out + (qs[i].head * in.n + qs[i].row) * dim);
    for (int v = 0; v < NV; ++v) {
      const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(s.sums.data() + i * dim + v * kLanes), inv);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(orow + v * kLanes), (__m256i)_mm512_cvtneps_pbh(x));
    }
  }
}

template <int NV>
void attend_amx(const Inputs& in, int64_t kv_heads) {
  // A KV group's queries in tiles of 16: splitting a small pass's group across threads would
  // repeat its keys' and values' work (a plain step's 3 groups ran 10.4 µs a layer whole, 13.4 split).
  const int64_t per_group = in.group * in.n;
  const int64_t tile = std::min<int64_t>(kT, per_group);
  const int64_t tiles = (per_group + tile - 1) / tile;
  at::parallel_for(0, kv_heads * tiles, 1, [&](int64_t begin, int64_t end) {
    configure_attention_tiles();
    static thread_local TileScratch scratch;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t kv = item / tiles, first = item % tiles * tile;
      attend_tile_amx<NV>(in, kv, first, std::min(tile, per_group - first), scratch);
    }
    _tile_release();
  });
}

bool attention_amx(const Inputs& in, int64_t dim, int64_t kv_heads) {
  if (dim % 32 || !amx_permitted()) return false;
  switch (dim) {
    case 32: attend_amx<2>(in, kv_heads); return true;
    case 64: attend_amx<4>(in, kv_heads); return true;
    case 128: attend_amx<8>(in, kv_heads); return true;
    case 256: attend_amx<16>(in, kv_heads); return true;
    default: return false;
  }
}
#else
bool attention_amx(const Inputs&, int64_t, int64_t) { return false; }
#endif

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
                  values.stride(0), values.stride(1), keys.size(1), static_cast<float>(scale)};
  if (attention_amx(in, dim, kv_heads)) return out;
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
