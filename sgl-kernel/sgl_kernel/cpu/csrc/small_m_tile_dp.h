// The AVX512-BF16 inner tile of small_m_linear (bf16 x times bf16 W on VDPBF16PS), compiled
// where -march has the instructions (SGL_CPU_DP). See small_m_linear.cpp for the sweep.
#pragma once

#include <torch/extension.h>

#include <immintrin.h>

#include <cstdint>

namespace sgl_cpu {
namespace small_m {

using bf16 = at::BFloat16;

// Compiled for a CPU with AVX512-BF16 (-march=native there): the VDPBF16PS kernel exists.
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define SGL_CPU_DP 1
#endif

#ifdef SGL_CPU_DP

inline __m512bh load_bh(const bf16* p) {
  return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p));
}

inline __m512bh load_bh(const bf16* p, __mmask32 mask) {  // masked-off lanes read as 0
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, reinterpret_cast<const void*>(p));
}

// The AVX512-BF16 tile: bf16 x rows (no packing: VDPBF16PS pairs k and k+1 in both operands
// alike) times NT bf16 W rows, 32 k per step; lane j of an accumulator sums the products of
// k = 32s + 2j and 32s + 2j + 1 (the odd one first, then the even one, each rounded to
// fp32, as the instruction defines), then one fixed reduction of the 16 lanes. A row's sums
// depend only on its x row, W and kc: never on MT, NT or the other rows.
template <int MT, int NT>
void tile_dp(const bf16* __restrict x, int64_t ldx, const bf16* __restrict w, int64_t ldw,
             int64_t kc, float* __restrict y, int64_t ldy, int64_t ldyn, bool accumulate,
             const bf16* pf, int64_t red) {
  __m512 acc[MT][NT];
#pragma GCC unroll 16
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 16
    for (int n = 0; n < NT; ++n) acc[m][n] = _mm512_setzero_ps();
  auto step = [&](int64_t k, auto load) {
    __m512bh xv[MT];
#pragma GCC unroll 16
    for (int m = 0; m < MT; ++m) {
      xv[m] = load(x + m * ldx + k);
      asm("" : "+v"(xv[m]));  // in a register: folded into each VDPBF16PS it loads NT times
    }
#pragma GCC unroll 16
    for (int n = 0; n < NT; ++n) {
      __m512bh wv = load(w + n * ldw + k);
#pragma GCC unroll 16
      for (int m = 0; m < MT; ++m) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], xv[m], wv);
    }
  };
  // red > 0: each output is summed as the k-blocked sweep sums it (a float per red-wide
  // block, added in order), so one row streaming whole W rows gets a verify row's bits
  float part[MT][NT];
  bool parted = false;
  int64_t k = 0;
  for (; k + 32 <= kc; k += 32) {
    if (red > 0 && k > 0 && k % red == 0) {
#pragma GCC unroll 16
      for (int m = 0; m < MT; ++m)
#pragma GCC unroll 16
        for (int n = 0; n < NT; ++n) {
          const float r = _mm512_reduce_add_ps(acc[m][n]);
          part[m][n] = parted ? part[m][n] + r : r;
          acc[m][n] = _mm512_setzero_ps();
        }
      parted = true;
    }
    if (pf != nullptr) {  // 32 bf16 = one 64-byte line per W row and step, into L2
#pragma GCC unroll 16
      for (int n = 0; n < NT; ++n)
        _mm_prefetch(reinterpret_cast<const char*>(pf + n * ldw + k), _MM_HINT_T1);
    }
    step(k, [](const bf16* p) { return load_bh(p); });
  }
  if (k < kc) {
    const __mmask32 mask = (__mmask32(1) << (kc - k)) - 1;
    step(k, [mask](const bf16* p) { return load_bh(p, mask); });
  }
  for (int m = 0; m < MT; ++m) {
    for (int n = 0; n < NT; ++n) {
      const float r = _mm512_reduce_add_ps(acc[m][n]);
      const float s = parted ? part[m][n] + r : r;
      float& out = y[m * ldy + n * ldyn];
      out = accumulate ? out + s : s;
    }
  }
}
#endif  // SGL_CPU_DP

}  // namespace small_m
}  // namespace sgl_cpu
