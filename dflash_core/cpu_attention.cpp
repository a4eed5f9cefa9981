// Row-invariant bf16 attention for the CPU, one (query head, row) at a time.
//
// A row's output depends only on its query and the keys/values it sees, reduced in their
// position order by the same instructions whatever the pass: a plain step, a verify chain or a
// tree row gets the same bits for the same context (cpu_kernels.py says why that matters).
// Each (head, row) is computed whole by one thread, so the thread split never changes a sum.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "cpu_bf16.h"

#ifndef __AVX512F__
#error "needs AVX-512: the batch-invariant path runs only on CPUs with AMX or AVX512-BF16"
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kLanes = 16;  // floats in one AVX-512 register

// e^x for x <= 0 (scores minus their maximum), Cephes' single-precision polynomial in plain
// arithmetic so the loop that calls it is vectorised (libm's expf runs one value at a time).
// About 2 ulp; the output is rounded to bf16 in the end anyway.
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  // n = round(x / ln 2) by the 1.5 * 2^23 trick: floor() would keep the loop scalar.
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

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
  int64_t heads, n, kv_heads, max_after, key_head, key_row, value_head, value_row;
  float scale;
};

// One (query head, row): NV registers of head_dim, keys in the order the row sees them.
template <int NV>
void attend_one(const Inputs& in, int64_t h, int64_t r, std::vector<float>& w) {
  constexpr int64_t dim = NV * kLanes;
  const int64_t kv = h / (in.heads / in.kv_heads);
  const uint16_t* qrow = in.q + (h * in.n + r) * dim;
  const __m512 scale = _mm512_set1_ps(in.scale);
  __m512 q[NV];
  for (int v = 0; v < NV; ++v) q[v] = _mm512_mul_ps(load_bf16(qrow + v * kLanes), scale);
  const int64_t before = in.before[r], count = before + in.after_count[r];
  const int64_t* after = in.after + r * in.max_after;
  const uint16_t* kh = in.keys + kv * in.key_head;
  const uint16_t* vh = in.values + kv * in.value_head;
  auto key_row = [&](int64_t j) { return j < before ? j : after[j - before]; };
  w.resize(count + kLanes);
  float* wp = w.data();
  __m512 best = _mm512_set1_ps(-INFINITY);
  for (int64_t j0 = 0; j0 < count; j0 += kLanes) {
    const int64_t keys = count - j0 < kLanes ? count - j0 : kLanes;
    __m512 a[kLanes];
    for (int64_t u = 0; u < kLanes; ++u) {
      if (u >= keys) {
        a[u] = _mm512_setzero_ps();
        continue;
      }
      const uint16_t* k = kh + key_row(j0 + u) * in.key_row;
      a[u] = _mm512_mul_ps(q[0], load_bf16(k));
      for (int v = 1; v < NV; ++v) a[u] = _mm512_fmadd_ps(q[v], load_bf16(k + v * kLanes), a[u]);
    }
    const __m512 scores = sum_lanes(a);
    _mm512_storeu_ps(wp + j0, scores);
    best = _mm512_mask_max_ps(best, static_cast<__mmask16>((1u << keys) - 1u), best, scores);
  }
  const float top = _mm512_reduce_max_ps(best);
  for (int64_t j = 0; j < count; ++j) wp[j] = exp_nonpositive(wp[j] - top);
  __m512 total = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + kLanes <= count; j += kLanes) total = _mm512_add_ps(total, _mm512_loadu_ps(wp + j));
  total = _mm512_add_ps(total, _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << (count - j)) - 1u), wp + j));
  const float sum = _mm512_reduce_add_ps(total);
  __m512 acc[NV];
  for (int v = 0; v < NV; ++v) acc[v] = _mm512_setzero_ps();
  for (int64_t jj = 0; jj < count; ++jj) {
    const uint16_t* val = vh + key_row(jj) * in.value_row;
    const __m512 wj = _mm512_set1_ps(wp[jj]);
    for (int v = 0; v < NV; ++v) acc[v] = _mm512_fmadd_ps(wj, load_bf16(val + v * kLanes), acc[v]);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / sum);
  at::BFloat16* orow = in.out + (h * in.n + r) * dim;
  alignas(64) float result[dim];
  for (int v = 0; v < NV; ++v) _mm512_store_ps(result + v * kLanes, _mm512_mul_ps(acc[v], inv));
  for (int64_t d = 0; d < dim; ++d) orow[d] = at::BFloat16(result[d]);
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
  const int64_t heads = q.size(0), n = q.size(1), dim = q.size(2);
  TORCH_CHECK(keys.size(2) == dim && values.size(2) >= dim && heads % keys.size(0) == 0, "shapes disagree");
  auto out = torch::empty({heads, n, dim}, q.options());
  const Inputs in{reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()),
                  reinterpret_cast<const uint16_t*>(keys.data_ptr<at::BFloat16>()),
                  reinterpret_cast<const uint16_t*>(values.data_ptr<at::BFloat16>()),
                  out.data_ptr<at::BFloat16>(),
                  before.data_ptr<int64_t>(), after.data_ptr<int64_t>(), after_count.data_ptr<int64_t>(),
                  heads, n, keys.size(0), after.size(1), keys.stride(0), keys.stride(1),
                  values.stride(0), values.stride(1), static_cast<float>(scale)};
  void (*one)(const Inputs&, int64_t, int64_t, std::vector<float>&) = nullptr;
  switch (dim) {
    case 16: one = attend_one<1>; break;
    case 32: one = attend_one<2>; break;
    case 64: one = attend_one<4>; break;
    case 128: one = attend_one<8>; break;
    case 256: one = attend_one<16>; break;
    default: TORCH_CHECK(false, "head_dim ", dim, " is not one of 16, 32, 64, 128, 256");
  }
  at::parallel_for(0, heads * n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w;
    for (int64_t item = begin; item < end; ++item) one(in, item / n, item % n, w);
  });
  return out;
}
