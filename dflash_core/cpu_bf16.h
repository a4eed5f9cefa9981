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

// 16 bf16 values (their bits) as floats: bf16 is the top half of a float's bits.
inline __m512 bf16_to_float(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

inline __m512 load_bf16(const uint16_t* p) {
  return bf16_to_float(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 16 floats as bf16 bits, rounded to nearest even as torch's float -> bf16 conversion does
// (inputs here are finite).
inline __m256i float_to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// 16 floats rounded to bf16, kept as floats.
inline __m512 round_bf16(__m512 v) { return bf16_to_float(float_to_bf16(v)); }

// e^x for x <= 0 (SiLU's e^-|x|) on 16 lanes, Cephes' single-precision polynomial: about 2 ulp
// (libm's expf runs one value at a time).
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
