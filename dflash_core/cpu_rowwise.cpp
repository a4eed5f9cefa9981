// RMSNorm, RoPE and SwiGLU's SiLU-times-up for the batch-invariant bf16 path as one call each
// (cpu_kernels.py says why): torch spends 2-6 small calls on each, and a pass makes 30-60 of each.
// Each row is computed alone, in one fixed order, so its bits never depend on the pass.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "cpu_bf16.h"

#include <cmath>
#include <cstdint>

namespace {

}  // namespace

// x [..., dim] bf16 (dim a multiple of 16, rows contiguous), weight [dim] bf16: transformers'
// RMSNorm, statistics in float32, the scale applied in bf16 (x * rsqrt(mean(x^2) + eps),
// rounded, times the weight, rounded).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && weight.scalar_type() == torch::kBFloat16, "bf16 x and weight");
  const int64_t dim = x.size(-1);
  TORCH_CHECK(dim % 16 == 0 && weight.numel() == dim, "dim a multiple of 16 and the weight's size");
  x = x.contiguous();
  weight = weight.contiguous();
  auto out = torch::empty_like(x);
  const int64_t rows = x.numel() / dim;
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* ws = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  auto* os = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint16_t* xr = xs + r * dim;
      __m512 sq = _mm512_setzero_ps();
      for (int64_t d = 0; d < dim; d += 16) {
        const __m512 v = load_bf16(xr + d);
        sq = _mm512_fmadd_ps(v, v, sq);
      }
      const float scale = 1.0f / std::sqrt(_mm512_reduce_add_ps(sq) / static_cast<float>(dim) + e);
      const __m512 s = _mm512_set1_ps(scale);
      for (int64_t d = 0; d < dim; d += 16) {
        const __m512 h = round_bf16(_mm512_mul_ps(load_bf16(xr + d), s));
        const __m512 o = _mm512_mul_ps(load_bf16(ws + d), h);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(os + r * dim + d), float_to_bf16(o));
      }
    }
  });
  return out;
}

// x [heads, n, head_dim] bf16 (any strides, the last dim contiguous), cos/sin [n, head_dim]
// bf16: x * cos + rotate_half(x) * sin, each product and the sum rounded to bf16 as torch's
// bf16 arithmetic rounds them. Returns a contiguous [heads, n, head_dim].
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && cos.scalar_type() == torch::kBFloat16 &&
                  sin.scalar_type() == torch::kBFloat16, "bf16 x, cos and sin");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x [heads, n, head_dim], the last dim contiguous");
  const int64_t heads = x.size(0), n = x.size(1), hd = x.size(2), half = hd / 2;
  TORCH_CHECK(half % 16 == 0 && cos.size(0) == n && cos.size(1) == hd && sin.sizes() == cos.sizes(),
              "head_dim a multiple of 32; cos/sin [n, head_dim]");
  cos = cos.contiguous();
  sin = sin.contiguous();
  auto out = torch::empty({heads, n, hd}, x.options());
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* cs = reinterpret_cast<const uint16_t*>(cos.data_ptr<at::BFloat16>());
  const auto* ss = reinterpret_cast<const uint16_t*>(sin.data_ptr<at::BFloat16>());
  auto* os = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t sh = x.stride(0), sn = x.stride(1);
  const __m512 sign = _mm512_set1_ps(-0.0f);
  at::parallel_for(0, heads * n, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t h = i / n, t = i % n;
      const uint16_t* xr = xs + h * sh + t * sn;
      const uint16_t *cr = cs + t * hd, *sr = ss + t * hd;
      uint16_t* o = os + i * hd;
      for (int64_t d = 0; d < half; d += 16) {
        const __m512 lo = load_bf16(xr + d), hi = load_bf16(xr + half + d);
        // first half: x * cos + (-x[half:]) * sin; second half: x * cos + x[:half] * sin
        const __m512 a = round_bf16(_mm512_mul_ps(lo, load_bf16(cr + d)));
        const __m512 b = round_bf16(_mm512_mul_ps(_mm512_xor_ps(hi, sign), load_bf16(sr + d)));
        const __m512 c = round_bf16(_mm512_mul_ps(hi, load_bf16(cr + half + d)));
        const __m512 e = round_bf16(_mm512_mul_ps(lo, load_bf16(sr + half + d)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + d), float_to_bf16(_mm512_add_ps(a, b)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + half + d), float_to_bf16(_mm512_add_ps(c, e)));
      }
    }
  });
  return out;
}

// gate_up [rows, 2 * inner] bf16 (gate, then up; rows contiguous), inner a multiple of 16:
// silu(gate) rounded to bf16, times up, rounded to bf16 (torch's two bf16 calls' roundings).
// Returns [rows, inner].
torch::Tensor swiglu(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == torch::kBFloat16 && gate_up.dim() == 2, "2-d bf16 gate_up");
  const int64_t rows = gate_up.size(0), inner = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) == 2 * inner && inner % 16 == 0, "gate and up, each a multiple of 16 wide");
  gate_up = gate_up.contiguous();
  auto out = torch::empty({rows, inner}, gate_up.options());
  const auto* xs = reinterpret_cast<const uint16_t*>(gate_up.data_ptr<at::BFloat16>());
  auto* os = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, rows, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint16_t* gate = xs + r * 2 * inner;
      for (int64_t d = 0; d < inner; d += 16) {
        const __m512 g = load_bf16(gate + d);
        // x / (1 + e^-x), from t = e^-|x| so the exp never overflows: x / (1 + t) for x >= 0,
        // x t / (1 + t) below; under -87, x e^x is far below bf16's normal range: 0.
        const __m512 t = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
        const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
        const __m512 num = _mm512_mask_mul_ps(g, negative, g, t);
        __m512 silu = _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), t));
        silu = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(g, _mm512_set1_ps(-87.0f), _CMP_GE_OQ), silu);
        const __m512 o = _mm512_mul_ps(round_bf16(silu), load_bf16(gate + inner + d));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(os + r * inner + d), float_to_bf16(o));
      }
    }
  });
  return out;
}

// x [rows, n] float32: each row's index of its largest value, the first among equal ones, a NaN
// counting as largest (the first NaN wins): what torch's max(-1).indices gives on a CPU, without
// its scalar pass (~45 µs per 49k-token row, a tree pass's 8 rows ~0.23 ms; this, ~7 µs a row).
torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2 && x.size(1) > 0, "2-d float32 logits");
  x = x.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(n < (int64_t{1} << 31), "rows under 2^31 values");
  auto out = torch::empty({rows}, x.options().dtype(torch::kLong));
  const float* xs = x.data_ptr<float>();
  int64_t* os = out.data_ptr<int64_t>();
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 lowest = _mm512_set1_ps(-INFINITY);
  at::parallel_for(0, rows, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = xs + r * n;
      // Per lane: its largest value so far and where it first was (strictly greater replaces),
      // so each lane holds its first maximum; lanes past n start at -inf with no index.
      const __mmask16 head = n >= 16 ? 0xffff : static_cast<__mmask16>((1u << n) - 1);
      __m512 best = _mm512_mask_loadu_ps(lowest, head, row);
      __m512i where = _mm512_mask_mov_epi32(_mm512_set1_epi32(INT32_MAX), head, lanes);
      __mmask16 nan = _mm512_mask_cmp_ps_mask(head, best, best, _CMP_UNORD_Q);
      for (int64_t i = 16; i < n; i += 16) {
        const __mmask16 live = n - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - i)) - 1);
        const __m512 v = _mm512_mask_loadu_ps(lowest, live, row + i);
        const __mmask16 up = _mm512_mask_cmp_ps_mask(live, v, best, _CMP_GT_OQ);
        best = _mm512_mask_mov_ps(best, up, v);
        where = _mm512_mask_mov_epi32(where, up, _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int>(i))));
        nan |= _mm512_mask_cmp_ps_mask(live, v, v, _CMP_UNORD_Q);
      }
      if (nan) {  // rare: the first NaN, found in order
        int64_t k = 0;
        while (!std::isnan(row[k])) ++k;
        os[r] = k;
        continue;
      }
      const float top = _mm512_reduce_max_ps(best);
      const __mmask16 at_top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
      os[r] = _mm512_mask_reduce_min_epi32(at_top, where);
    }
  });
  return out;
}
