// bf16 as float32 for the compiled CPU kernels (cpu_kernels.py builds them as one extension).
#pragma once

#include <immintrin.h>

#include <cstdint>

// 16 bf16 values as floats: bf16 is the top half of a float's bits.
inline __m512 load_bf16(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
