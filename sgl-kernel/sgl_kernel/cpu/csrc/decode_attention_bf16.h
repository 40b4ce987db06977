// What decode_attention's two bf16 paths (VDPBF16PS in decode_attention_dp.cpp, AMX tiles in
// decode_attention_amx.cpp) share: which are compiled in, the 16-lane row layout and its
// softmax.
#pragma once

#include "decode_attention.h"
#include "vec.h"

#include <immintrin.h>

#include <cstdint>
#include <memory>

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define SGL_ATTN_DP 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define SGL_ATTN_AMX 1  // Intel AMX (Sapphire Rapids and later): both products on tiles
#endif
#endif

#ifdef SGL_ATTN_DP
namespace sgl_cpu {
namespace attn {
namespace dp {

using bf16 = at::BFloat16;
namespace vec = sgl_cpu::vec;
constexpr int64_t kLanes = 16;  // query rows per zmm

// e^x for 16 lanes, x <= 0; lanes below kExpFloor give exactly 0.
inline __m512 exp16(__m512 x) {
  const __m512 floor_v = _mm512_set1_ps(kExpFloor);
  const __mmask16 keep = _mm512_cmp_ps_mask(x, floor_v, _CMP_NLT_UQ);
  return _mm512_maskz_mov_ps(keep, vec::exp_in_range<vec::Lanes16>(_mm512_max_ps(x, floor_v)));
}

// Interleave indices for _mm512_permutex2var_epi16(a, ix, b): 32-bit lane c holds (a[c + 16
// half], b[c + 16 half]), the bf16 pair layout VDPBF16PS multiplies.
inline __m512i pair_index(int half) {
  alignas(64) int16_t ix[32];
  for (int c = 0; c < 16; ++c)
    for (int e = 0; e < 2; ++e) ix[2 * c + e] = static_cast<int16_t>(16 * half + c + 32 * e);
  return _mm512_load_si512(ix);
}

// Scores sv[j * 16 + i] (key j < n, row lane i < nl of row vector v; unscaled) become
// exp(scale * s - m) with m the lane's max of scale * s over the chunk, written in place; m
// and l (the sum) of each lane go to m_out[i], l_out[i]. The max is taken before scaling
// (scale > 0, so fl(scale * max) is the max of the scaled scores) and the scaling rides in
// the exponent's FMA: two passes over the scores, not three. mask (offset to the chunk's
// first key, or null when every row sees every key of the chunk): masked keys score -inf, so
// their exp is exactly 0.
inline void softmax_lanes(const Shapes& s, float* sv, int64_t n, int nl, int64_t v,
                          const bool* mask, float* m_out, float* l_out) {
  const __m512 scale = _mm512_set1_ps(s.scale);
  if (mask != nullptr) {
    for (int i = 0; i < nl; ++i) {
      const bool* mrow = mask + ((v * kLanes + i) / s.G) * s.L;
      for (int64_t j = 0; j < n; ++j)
        if (!mrow[j]) sv[j * kLanes + i] = kNegInf;
    }
  }
  __m512 m16 = _mm512_set1_ps(kNegInf);
  for (int64_t j = 0; j < n; ++j) m16 = _mm512_max_ps(m16, _mm512_loadu_ps(sv + j * kLanes));
  m16 = _mm512_mul_ps(m16, scale);
  // a lane that sees no key of this chunk subtracts 0, so its exps are 0 (not NaN)
  const __mmask16 none = _mm512_cmp_ps_mask(m16, _mm512_set1_ps(kNegInf), _CMP_EQ_OQ);
  const __m512 msub = _mm512_maskz_mov_ps(static_cast<__mmask16>(~none), m16);
  __m512 l16 = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const __m512 p = exp16(_mm512_fmsub_ps(_mm512_loadu_ps(sv + j * kLanes), scale, msub));
    _mm512_storeu_ps(sv + j * kLanes, p);
    l16 = _mm512_add_ps(l16, p);
  }
  alignas(64) float mx[kLanes], ls[kLanes];
  _mm512_store_ps(mx, m16);
  _mm512_store_ps(ls, l16);
  for (int i = 0; i < nl; ++i) m_out[i] = mx[i], l_out[i] = ls[i];
}

// Uninitialized (every element read is written first): value-initializing bf16 vectors runs
// an element loop that cost 7% of a verify call.
template <typename T>
using Buffer = std::unique_ptr<T[]>;

#ifdef SGL_ATTN_AMX
// True when this process may use the AMX tiles (asked of Linux once; SGL_KERNEL_NO_AMX=1 says
// no).
bool amx_ready();

// partials_bf16_dp on AMX tiles, for hd % 32 == 0, hd <= 128, vd % 32 == 0; qP as
// pair_queries lays it out for RV row vectors.
void partials_amx(const Shapes& s, int64_t RV, const int32_t* qP, const bf16* kb,
                  const bf16* vb, const int64_t* idx, const bool* mask, float* m, float* l,
                  float* acc);
#endif

}  // namespace dp
}  // namespace attn
}  // namespace sgl_cpu
#endif  // SGL_ATTN_DP
