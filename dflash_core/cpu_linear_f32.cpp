// Row-invariant float32 linear layers for x86 CPUs with AVX2 and FMA (cpu_kernels.py says why).
//
// Each output is one float32 sum over its inputs in order, one fused multiply-add each, then the
// bias added: one fixed order whatever the rows, the register tile, the panel or the thread split,
// so a row's bits cannot depend on the pass.
// The weights are float32, or bf16 widened exactly to float32 (half the bytes to stream: a
// one-token pass reads every weight once, so it is bound by memory).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int kBlock = 16;       // outputs per weight block: two registers of sums a row
constexpr int kRows = 6;         // rows per register tile (6 rows x 16 outputs: 12 registers of sums)
constexpr int64_t kPanel = 128;  // input pairs per panel when rows come in several tiles: the
                                 // panel's weights stay in L1 while every row tile reads them
constexpr int64_t kAhead = 8;    // pairs to prefetch ahead (further measured no faster)

// A pair of inputs' weights for 16 outputs as float32 registers: the even input's for outputs 0-7
// and 8-15 (`even`), then the odd input's (`odd`). Float32 weights are laid out
// [blocks][pairs][2][16]; bf16 weights [blocks][pairs][16][2] (cpu_linear.cpp's layout), each
// 32-bit lane one output's even input (low half) and odd input (high half): bf16 is the top half of
// a float's bits, so both widen exactly.
struct F32Weights {
  using T = float;
  static constexpr int64_t kPairElems = 2 * kBlock;
  static inline void even(const float* w, __m256& lo, __m256& hi) {
    lo = _mm256_loadu_ps(w);
    hi = _mm256_loadu_ps(w + 8);
  }
  static inline void odd(const float* w, __m256& lo, __m256& hi) {
    lo = _mm256_loadu_ps(w + 16);
    hi = _mm256_loadu_ps(w + 24);
  }
};

struct Bf16Weights {
  using T = uint16_t;
  static constexpr int64_t kPairElems = 2 * kBlock;
  static inline __m256i lanes(const uint16_t* w) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)); }
  static inline void even(const uint16_t* w, __m256& lo, __m256& hi) {
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(lanes(w), 16));
    hi = _mm256_castsi256_ps(_mm256_slli_epi32(lanes(w + 16), 16));
  }
  static inline void odd(const uint16_t* w, __m256& lo, __m256& hi) {
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    lo = _mm256_castsi256_ps(_mm256_and_si256(lanes(w), high));
    hi = _mm256_castsi256_ps(_mm256_and_si256(lanes(w + 16), high));
  }
};

template <class W>
struct Args {
  const float* x;
  const typename W::T* w;
  const float* bias;
  float* out;
  int64_t pairs, x_stride, out_stride;
};

// Rows [m0, m0 + MB) times weight blocks [b0, b0 + NB) over pairs [p0, p1); `sums` [MB][NB][16]
// carries the sums from one panel to the next. Each output's sum takes its inputs in order, one
// fused multiply-add each, whatever MB and NB.
template <class W, int MB, int NB>
inline void tile(const Args<W>& a, int64_t m0, int64_t b0, int64_t p0, int64_t p1, float* sums) {
  __m256 acc[MB][NB][2];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j)
      for (int h = 0; h < 2; ++h)
        acc[i][j][h] = p0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(sums + ((i * NB + j) * 2 + h) * 8);
  const typename W::T* w[NB];
  for (int j = 0; j < NB; ++j) w[j] = a.w + (b0 + j) * a.pairs * W::kPairElems;
  const float* x = a.x + m0 * a.x_stride;
  for (int64_t p = p0; p < p1; ++p) {
    for (int j = 0; j < NB; ++j) {
      const typename W::T* wp = w[j] + p * W::kPairElems;
      _mm_prefetch(reinterpret_cast<const char*>(wp + kAhead * W::kPairElems), _MM_HINT_T0);
      __m256 lo, hi;
      W::even(wp, lo, hi);
      for (int i = 0; i < MB; ++i) {
        const __m256 xv = _mm256_broadcast_ss(x + i * a.x_stride + 2 * p);
        acc[i][j][0] = _mm256_fmadd_ps(xv, lo, acc[i][j][0]);
        acc[i][j][1] = _mm256_fmadd_ps(xv, hi, acc[i][j][1]);
      }
      W::odd(wp, lo, hi);
      for (int i = 0; i < MB; ++i) {
        const __m256 xv = _mm256_broadcast_ss(x + i * a.x_stride + 2 * p + 1);
        acc[i][j][0] = _mm256_fmadd_ps(xv, lo, acc[i][j][0]);
        acc[i][j][1] = _mm256_fmadd_ps(xv, hi, acc[i][j][1]);
      }
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) {
      if (p1 < a.pairs) {
        for (int h = 0; h < 2; ++h) _mm256_storeu_ps(sums + ((i * NB + j) * 2 + h) * 8, acc[i][j][h]);
        continue;
      }
      float* o = a.out + (m0 + i) * a.out_stride + (b0 + j) * kBlock;
      for (int h = 0; h < 2; ++h) {
        __m256 s = acc[i][j][h];
        if (a.bias) s = _mm256_add_ps(s, _mm256_loadu_ps(a.bias + (b0 + j) * kBlock + 8 * h));
        _mm256_storeu_ps(o + 8 * h, s);
      }
    }
}

// A tile of R rows where R x NB fits the registers (the switch below instantiates every R for
// every NB; only the fitting ones run).
template <class W, int R, int NB>
inline void fitting_tile(const Args<W>& a, int64_t m0, int64_t b0, int64_t p0, int64_t p1, float* sums) {
  if constexpr (R > 0 && R * NB <= 6) tile<W, R, NB>(a, m0, b0, p0, p1, sums);
}

// All m rows times weight blocks [b0, b0 + NB), panel by panel, in row tiles of nearly equal size
// (at most kRows): 8 rows as 4 + 4, not 6 + 2, whose second tile has too few sums to keep the FMA
// units busy.
template <class W, int NB>
void columns(const Args<W>& a, int64_t m, int64_t b0, float* sums) {
  constexpr int64_t most = kRows / NB;
  const int64_t panel = m <= most ? a.pairs : kPanel;
  const int64_t tiles = (m + most - 1) / most;
  for (int64_t p0 = 0; p0 < a.pairs; p0 += panel) {
    const int64_t p1 = std::min(a.pairs, p0 + panel);
    for (int64_t t = 0, m0 = 0; t < tiles; ++t) {
      const int64_t rows = (m - m0) / (tiles - t);
      float* s = sums + m0 * NB * kBlock;
      switch (rows) {
        case 1: fitting_tile<W, 1, NB>(a, m0, b0, p0, p1, s); break;
        case 2: fitting_tile<W, 2, NB>(a, m0, b0, p0, p1, s); break;
        case 3: fitting_tile<W, 3, NB>(a, m0, b0, p0, p1, s); break;
        case 4: fitting_tile<W, 4, NB>(a, m0, b0, p0, p1, s); break;
        case 5: fitting_tile<W, 5, NB>(a, m0, b0, p0, p1, s); break;
        default: fitting_tile<W, 6, NB>(a, m0, b0, p0, p1, s); break;
      }
      m0 += rows;
    }
  }
}

// Weight blocks [0, blocks) in groups of NB, the groups split between the threads.
template <class W, int NB>
void run_blocks(const Args<W>& a, int64_t m, int64_t blocks) {
  const int64_t groups = (blocks + NB - 1) / NB;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    std::vector<float> sums(std::max<int64_t>(m, kRows) * NB * kBlock);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t b0 = g * NB;
      if (b0 + NB <= blocks) {
        columns<W, NB>(a, m, b0, sums.data());
      } else {
        for (int64_t b = b0; b < blocks; ++b) columns<W, 1>(a, m, b, sums.data());
      }
    }
  });
}

template <class W>
torch::Tensor run(torch::Tensor x, torch::Tensor packed, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2, "2-d float32 input");
  const int64_t m = x.size(0), blocks = packed.size(0), pairs = packed.size(1);
  TORCH_CHECK(pairs * 2 == x.size(1), "a weight laid out for ", pairs * 2, " inputs, not ", x.size(1));
  x = x.contiguous();
  auto out = torch::empty({m, blocks * kBlock}, x.options());
  torch::Tensor b;
  if (bias) {
    TORCH_CHECK(bias->numel() == blocks * kBlock, "a bias of ", blocks * kBlock, " outputs");
    b = bias->to(torch::kFloat).contiguous();
  }
  const Args<W> a{x.data_ptr<float>(), reinterpret_cast<const typename W::T*>(packed.data_ptr()),
                  bias ? b.data_ptr<float>() : nullptr, out.data_ptr<float>(), pairs, x.size(1), blocks * kBlock};
  // Blocks per register tile: enough independent sums for the FMA units (8 or more) in at most 12
  // registers, so the weights and a broadcast input fit beside them.
  if (m == 1) {
    run_blocks<W, 4>(a, m, blocks);
  } else if (m <= 3) {
    run_blocks<W, 2>(a, m, blocks);
  } else {
    run_blocks<W, 1>(a, m, blocks);
  }
  return out;
}

}  // namespace

// A [out, in] float32 or bf16 weight (out a multiple of 16, in even) laid out for `linear_f32`:
// float32 as [out / 16][in / 2][2][16] (a pair of inputs' weights for 16 outputs, even input
// first), bf16 as [out / 16][in / 2][16][2].
torch::Tensor pack_linear_f32(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2, "a 2-d weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % kBlock == 0 && k % 2 == 0, "out features a multiple of 16 and even in features, not ", n, " x ", k);
  if (weight.scalar_type() == torch::kBFloat16)
    return weight.contiguous().view({n / kBlock, kBlock, k / 2, 2}).permute({0, 2, 1, 3}).contiguous();
  TORCH_CHECK(weight.scalar_type() == torch::kFloat, "a float32 or bf16 weight");
  return weight.contiguous().view({n / kBlock, kBlock, k / 2, 2}).permute({0, 2, 3, 1}).contiguous();
}

// x [rows, in] float32 times a weight laid out by `pack_linear_f32`, plus `bias`; [rows, out] float32.
torch::Tensor linear_f32(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(packed.dim() == 4, "a weight laid out by pack_linear_f32");
  if (packed.scalar_type() == torch::kBFloat16) {
    TORCH_CHECK(packed.size(2) == kBlock && packed.size(3) == 2, "a bf16 weight laid out by pack_linear_f32");
    return run<Bf16Weights>(x, packed, bias);
  }
  TORCH_CHECK(packed.scalar_type() == torch::kFloat && packed.size(2) == 2 && packed.size(3) == kBlock,
              "a float32 weight laid out by pack_linear_f32");
  return run<F32Weights>(x, packed, bias);
}
