// Row-invariant bf16 linear layers for CPUs with AVX512-BF16 (cpu_kernels.py says why).
//
// Each output is one float32 sum over the input's pairs in their order, by the same
// instruction (vdpbf16ps), rounded to bf16 once: a row's bits cannot depend on how many rows
// the pass has, on the register blocking, the panel or the thread split.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "cpu_bf16.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#ifdef __AVX512BF16__

namespace {

constexpr int kBlock = 16;  // outputs per weight block: one register of float32 sums
constexpr int kRows = 8;    // rows per register tile (8 x kCols sums + kCols weights in 32 registers)
constexpr int kCols = 3;    // weight blocks per register tile
constexpr int64_t kPanel = 128;  // pairs per panel when rows come in several tiles: the panel's
                                 // weights stay in L1 while every row tile reads them

struct Args {
  const uint16_t* x;
  const uint16_t* w;  // [blocks][pairs][kBlock][2]
  const float* bias;
  uint16_t* out;
  int64_t pairs, x_stride, out_stride;
  int64_t ahead;  // pairs to prefetch ahead (`prefetch_distance`)
};

// How far ahead to fetch the weights into L2, in pairs (one cache line per weight block): far
// enough that a core keeps enough reads in flight for the memory's bandwidth while its sums take
// longer with more rows (distances measured on a Zen 4: bench/HISTORY.md).
inline int64_t prefetch_distance(int64_t rows) { return rows <= 4 ? 24 : 40; }

// Row `row`'s float32 sums for weight block `block`, plus the bias, rounded once into the output.
inline void write_out(const Args& a, int64_t row, int64_t block, __m512 s) {
  if (a.bias) s = _mm512_add_ps(s, _mm512_loadu_ps(a.bias + block * kBlock));
  uint16_t* o = a.out + row * a.out_stride + block * kBlock;
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), (__m256i)_mm512_cvtneps_pbh(s));
}

// Rows [m0, m0 + MB) times weight blocks [b0, b0 + NB) over pairs [p0, p1); `sums` carries the
// float32 sums from one panel to the next.
template <int MB, int NB>
inline void tile(const Args& a, int64_t m0, int64_t b0, int64_t p0, int64_t p1, float* sums) {
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j)
      acc[i][j] = p0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + (i * NB + j) * kBlock);
  const uint16_t* w[NB];
  for (int j = 0; j < NB; ++j) w[j] = a.w + (b0 + j) * a.pairs * 2 * kBlock;
  const uint16_t* x[MB];
  for (int i = 0; i < MB; ++i) x[i] = a.x + (m0 + i) * a.x_stride;
  for (int64_t p = p0; p < p1; ++p) {
    __m512bh wv[NB];
    for (int j = 0; j < NB; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(w[j] + (p + a.ahead) * 2 * kBlock), _MM_HINT_T1);
      wv[j] = (__m512bh)_mm512_loadu_si512(w[j] + p * 2 * kBlock);
    }
    for (int i = 0; i < MB; ++i) {
      int32_t pair;
      std::memcpy(&pair, x[i] + 2 * p, sizeof pair);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
  if (p1 < a.pairs) {
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) _mm512_storeu_ps(sums + (i * NB + j) * kBlock, acc[i][j]);
    return;
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) write_out(a, m0 + i, b0 + j, acc[i][j]);
}

template <int R, int NB>
inline void rest_tile(const Args& a, int64_t m0, int64_t b0, int64_t p0, int64_t p1, float* sums) {
  if constexpr (R > 0) tile<R, NB>(a, m0, b0, p0, p1, sums);
}

// All m rows times weight blocks [b0, b0 + NB), panel by panel.
template <int NB>
void columns(const Args& a, int64_t m, int64_t b0, float* sums) {
  const int64_t panel = m <= kRows ? a.pairs : kPanel;
  for (int64_t p0 = 0; p0 < a.pairs; p0 += panel) {
    const int64_t p1 = std::min(a.pairs, p0 + panel);
    int64_t m0 = 0;
    for (; m0 + kRows <= m; m0 += kRows) tile<kRows, NB>(a, m0, b0, p0, p1, sums + m0 * NB * kBlock);
    float* s = sums + m0 * NB * kBlock;
    switch (m - m0) {
      case 1: rest_tile<1, NB>(a, m0, b0, p0, p1, s); break;
      case 2: rest_tile<2, NB>(a, m0, b0, p0, p1, s); break;
      case 3: rest_tile<3, NB>(a, m0, b0, p0, p1, s); break;
      case 4: rest_tile<4, NB>(a, m0, b0, p0, p1, s); break;
      case 5: rest_tile<5, NB>(a, m0, b0, p0, p1, s); break;
      case 6: rest_tile<6, NB>(a, m0, b0, p0, p1, s); break;
      case 7: rest_tile<7, NB>(a, m0, b0, p0, p1, s); break;
      default: break;
    }
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// AMX tiles where the CPU has them: a tile multiply (tdpbf16ps) does 16 rows x 16 outputs x 32
// inputs at once, so 16 rows cost little more than one, where vdpbf16ps runs out of arithmetic past
// ~4 rows (SmolLM2's linears on a 2-core Xeon: 8 rows 12 ms, 16 rows 22 ms against ~8 for one).
// Each output is still one float32 sum over its row's inputs in the same order, by the same
// instruction, whatever the rows: row-invariant as the path above, with other bits than it.

constexpr int kTilePairs = 16;  // input pairs per tile multiply: 32 inputs, 64 bytes a row

// Tiles 0-3 sum four weight blocks, tile 4 holds the rows' inputs, tiles 5-7 the weights.
void configure_tiles(int rows) {
  TileConfig c;
  for (int t = 0; t < 4; ++t) c.rows[t] = rows, c.colsb[t] = kBlock * 4;
  c.rows[4] = rows, c.colsb[4] = kTilePairs * 4;
  for (int t = 5; t < 8; ++t) c.rows[t] = kTilePairs, c.colsb[t] = kBlock * 4;
  load_tile_config(c);
}

// The float32 sums in `sums` [NB][rows][kBlock] plus the bias, rounded once, into the output.
template <int NB>
inline void store_rows(const Args& a, int64_t m0, int rows, int64_t b0, const float* sums) {
  for (int j = 0; j < NB; ++j)
    for (int i = 0; i < rows; ++i) write_out(a, m0 + i, b0 + j, _mm512_loadu_ps(sums + (j * 16 + i) * kBlock));
}

// Rows [m0, m0 + rows) (the tiles configured for `rows`) times four weight blocks from b0.
inline void amx_four(const Args& a, int64_t m0, int rows, int64_t b0, float* sums) {
  const int64_t block = a.pairs * 2 * kBlock, x_bytes = a.x_stride * 2;
  const uint16_t* w = a.w + b0 * block;
  const uint16_t* x = a.x + m0 * a.x_stride;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t p = 0; p < a.pairs; p += kTilePairs) {
    const uint16_t* wp = w + p * 2 * kBlock;
    _tile_loadd(4, x + 2 * p, x_bytes);
    _tile_loadd(5, wp, kBlock * 4);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, wp + block, kBlock * 4);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(7, wp + 2 * block, kBlock * 4);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, wp + 3 * block, kBlock * 4);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, sums, kBlock * 4);
  _tile_stored(1, sums + 16 * kBlock, kBlock * 4);
  _tile_stored(2, sums + 32 * kBlock, kBlock * 4);
  _tile_stored(3, sums + 48 * kBlock, kBlock * 4);
  store_rows<4>(a, m0, rows, b0, sums);
}

// The same for one weight block (a layer whose blocks are not a multiple of four).
inline void amx_one(const Args& a, int64_t m0, int rows, int64_t b0, float* sums) {
  const uint16_t* w = a.w + b0 * a.pairs * 2 * kBlock;
  const uint16_t* x = a.x + m0 * a.x_stride;
  _tile_zero(0);
  for (int64_t p = 0; p < a.pairs; p += kTilePairs) {
    _tile_loadd(4, x + 2 * p, a.x_stride * 2);
    _tile_loadd(5, w + p * 2 * kBlock, kBlock * 4);
    _tile_dpbf16ps(0, 4, 5);
  }
  _tile_stored(0, sums, kBlock * 4);
  store_rows<1>(a, m0, rows, b0, sums);
}

// Tile multiplies run here: built for a CPU with AMX, and Linux granted the tiles.
bool amx_ready() { return amx_permitted(); }
bool amx_applies(const Args& a) { return a.pairs % kTilePairs == 0 && amx_ready(); }

void amx_linear(const Args& a, int64_t m, int64_t blocks) {
  const int64_t groups = (blocks + 3) / 4;
  // Every row tile of a group in turn, so the group's weights come from memory once and from the
  // caches for the next row tiles (a pass of 17-32 rows had read all the weights twice).
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    alignas(64) float sums[4 * 16 * kBlock];
    int configured = 0;
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t m0 = 0; m0 < m; m0 += 16) {
        const int rows = static_cast<int>(std::min<int64_t>(16, m - m0));
        if (rows != configured) configure_tiles(configured = rows);
        if (4 * g + 4 <= blocks) {
          amx_four(a, m0, rows, 4 * g, sums);
        } else {
          for (int64_t b = 4 * g; b < blocks; ++b) amx_one(a, m0, rows, b, sums);
        }
      }
    }
    _tile_release();
  });
}
#else
bool amx_ready() { return false; }
bool amx_applies(const Args&) { return false; }
void amx_linear(const Args&, int64_t, int64_t) {}
#endif

}  // namespace

// Which instruction multiplies `linear`'s rows here, for reports: "AMX" (tile multiplies, for
// layers whose inputs are a multiple of 32) or "AVX512-BF16" (vdpbf16ps, for every layer).
std::string linear_units() { return amx_ready() ? "AMX" : "AVX512-BF16"; }

// A [out, in] bf16 weight (out a multiple of 16, in even) laid out for `linear`:
// [out / 16][in / 2][16][2], so one 64-byte load holds a pair of inputs for 16 outputs.
torch::Tensor pack_linear(torch::Tensor weight) {
  TORCH_CHECK(weight.scalar_type() == torch::kBFloat16 && weight.dim() == 2, "a 2-d bf16 weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % kBlock == 0 && k % 2 == 0, "out features a multiple of 16 and even in features, not ", n, " x ", k);
  return weight.contiguous().view({n / kBlock, kBlock, k / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// x [rows, in] bf16 times a weight laid out by `pack_linear`, plus `bias` (any float dtype).
// Returns [rows, out] bf16.
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.dim() == 2, "2-d bf16 input");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kBlock && packed.size(1) * 2 == x.size(1),
              "a weight laid out by pack_linear for ", x.size(1), " inputs");
  const int64_t m = x.size(0), blocks = packed.size(0);
  x = x.contiguous();
  auto out = torch::empty({m, blocks * kBlock}, x.options());
  TORCH_CHECK(!bias || bias->numel() == blocks * kBlock, "a bias of ", blocks * kBlock, " outputs");
  torch::Tensor b;
  if (bias) b = bias->to(torch::kFloat).contiguous();
  const Args a{reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()),
               reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()),
               bias ? b.data_ptr<float>() : nullptr,
               reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), packed.size(1), x.size(1), blocks * kBlock,
               prefetch_distance(m)};
  if (m == 0) return out;
  if (amx_applies(a)) {
    amx_linear(a, m, blocks);
    return out;
  }
  const int64_t tiles = (blocks + kCols - 1) / kCols;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> sums(m * kCols * kBlock);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b0 = t * kCols;
      if (b0 + kCols <= blocks) {
        columns<kCols>(a, m, b0, sums.data());
      } else {
        for (int64_t b = b0; b < blocks; ++b) columns<1>(a, m, b, sums.data());
      }
    }
  });
  return out;
}

#else  // no AVX512-BF16: cpu_kernels.py uses oneDNN's GEMM instead

std::string linear_units() { return "none"; }
torch::Tensor pack_linear(torch::Tensor) { TORCH_CHECK(false, "built without AVX512-BF16"); }
torch::Tensor linear(torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>) {
  TORCH_CHECK(false, "built without AVX512-BF16");
}

#endif
