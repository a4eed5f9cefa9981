// bf16 as float32, and an exp, for the compiled CPU kernels (cpu_kernels.py builds them as one extension).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>

// The tile registers' shapes, as ldtilecfg reads them (palette 1: eight tiles of up to 16 rows of
// 64 bytes).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Loads `c` into the tile registers' configuration. GCC 12's _tile_loadconfig tells the compiler
// it reads only the first 8 bytes, so the rest of the stores could be dropped as dead without
// the barrier.
inline void load_tile_config(const TileConfig& c) {
  __asm__ volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

// Linux hands out the tile registers' state only to a process that asks (ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); oneDNN asks too, asking twice is harmless.
inline bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}
#endif

// 16 bf16 values as floats: bf16 is the top half of a float's bits.
inline __m512 load_bf16(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// e^x for x <= 0 (attention scores minus their maximum; SiLU's e^-|x|), Cephes' single-precision
// polynomial in plain arithmetic so the loop that calls it is vectorised (libm's expf runs one
// value at a time).
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

// The same polynomial on 16 lanes (for SwiGLU; the attention's loop over exp_nonpositive is
// vectorised by the compiler).
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                   _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
