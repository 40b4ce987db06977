// Small AVX2 / AVX-512 helpers shared by the CPU kernels: bf16 widening, horizontal sum, e^x.
#pragma once

#include <torch/extension.h>

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace sgl_cpu {
namespace vec {

inline float to_f32(float v) { return v; }

inline float to_f32(at::BFloat16 v) {  // bf16 is the top half of an fp32
  uint32_t bits = uint32_t(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The vector operations exp_in_range needs, for 8 (AVX2) and 16 (AVX-512) fp32 lanes.
struct Lanes8 {
  using V = __m256;
  static V set1(float a) { return _mm256_set1_ps(a); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V fnmadd(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V floor(V a) { return _mm256_floor_ps(a); }
  static V pow2(V n) {  // 2^n for integral n in the exponent range
    const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
  }
};

#ifdef __AVX512F__
struct Lanes16 {
  using V = __m512;
  static V set1(float a) { return _mm512_set1_ps(a); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V fnmadd(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V floor(V a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  static V pow2(V n) {
    const __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
    return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
  }
};
#endif

// e^x per lane with x already in [-87, 88] (callers clamp as their use needs): range
// reduction to r in [-ln2/2, ln2/2] and Cephes' degree-5 polynomial (relative error ~1e-7,
// like expf).
template <typename L>
inline typename L::V exp_in_range(typename L::V x) {
  const typename L::V fx = L::floor(L::fmadd(x, L::set1(1.44269504088896341f), L::set1(0.5f)));
  typename L::V r = L::fnmadd(fx, L::set1(0.693359375f), x);
  r = L::fnmadd(fx, L::set1(-2.12194440e-4f), r);
  typename L::V y = L::set1(1.9875691500e-4f);
  y = L::fmadd(y, r, L::set1(1.3981999507e-3f));
  y = L::fmadd(y, r, L::set1(8.3334519073e-3f));
  y = L::fmadd(y, r, L::set1(4.1665795894e-2f));
  y = L::fmadd(y, r, L::set1(1.6666665459e-1f));
  y = L::fmadd(y, r, L::set1(5.0000001201e-1f));
  y = L::fmadd(y, L::mul(r, r), L::add(r, L::set1(1.0f)));
  return L::mul(y, L::pow2(fx));
}

inline __m256 exp8_in_range(__m256 x) { return exp_in_range<Lanes8>(x); }

}  // namespace vec
}  // namespace sgl_cpu
