// The AVX2 + FMA inner tiles of small_m_linear (x packed to fp32, W fp32 or bf16): an MT x NT
// register tile for <= 4 rows, a one-W-row wide tile for 5-6 rows. See small_m_linear.cpp for
// how run() sweeps W with them.
#pragma once

#include <torch/extension.h>

#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include "vec.h"

namespace sgl_cpu {
namespace small_m {

using bf16 = at::BFloat16;
using sgl_cpu::vec::hsum;
using sgl_cpu::vec::to_f32;

// y[m * ldy + n * ldyn] (+)= sum_{k < kc} x[m * ldx + k] * w[n * ldw + k] for an MT x NT
// tile; x rows are in registers (MT), W vectors are widened one at a time, MT * NT
// accumulators: <= 16 ymm registers.
//
// bf16 W: one 256-bit load holds 16 weights; lane j has w[2j] in its low half and w[2j+1]
// in its high half, so `<< 16` gives the even weights and `& 0xffff0000` the odd ones as
// fp32. x is packed to match (per 16-block: 8 even k, then 8 odd k; see pack_x), so no
// shuffle is needed. fp32 W: 8-wide steps, x packed plainly.
//
// pf (may be null): NT rows laid out like w, to prefetch into cache while this tile computes,
// so that DRAM streaming overlaps the FMAs of the tile before it is needed.
template <int MT, int NT, typename WT>
void tile_reg(const float* __restrict x, int64_t ldx, const WT* __restrict w, int64_t ldw,
          int64_t kc, float* __restrict y, int64_t ldy, int64_t ldyn, bool accumulate,
          const WT* pf) {
  constexpr bool kBf16 = std::is_same<WT, bf16>::value;
  constexpr int kStep = kBf16 ? 16 : 8;
  __m256 acc[MT][NT];
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 8
    for (int n = 0; n < NT; ++n) acc[m][n] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + kStep <= kc; k += kStep) {
    if (pf != nullptr && (k * sizeof(WT)) % 64 == 0) {
#pragma GCC unroll 8
      for (int n = 0; n < NT; ++n)
        _mm_prefetch(reinterpret_cast<const char*>(pf + n * ldw + k), _MM_HINT_T0);
    }
#pragma GCC unroll 2
    for (int half = 0; half < kStep / 8; ++half) {
      __m256 xv[MT];
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
        xv[m] = _mm256_loadu_ps(x + m * ldx + k + 8 * half);
        // Keep x in a register: folded into each FMA it would be loaded NT times, and the
        // two load ports, not the FMA units, would bound the loop.
        asm("" : "+x"(xv[m]));
      }
#pragma GCC unroll 8
      for (int n = 0; n < NT; ++n) {
        __m256 wv;
        if constexpr (kBf16) {
          __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + n * ldw + k));
          wv = half == 0 ? _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16))
                         : _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(-65536)));
        } else {
          wv = _mm256_loadu_ps(w + n * ldw + k);
          asm("" : "+x"(wv));  // load once, not once per FMA (as for x above)
        }
#pragma GCC unroll 8
        for (int m = 0; m < MT; ++m) acc[m][n] = _mm256_fmadd_ps(xv[m], wv, acc[m][n]);
      }
    }
  }
  for (int m = 0; m < MT; ++m) {
    for (int n = 0; n < NT; ++n) {
      float s = hsum(acc[m][n]);
      for (int64_t kk = k; kk < kc; ++kk) s += x[m * ldx + kk] * to_f32(w[n * ldw + kk]);
      float& out = y[m * ldy + n * ldyn];
      out = accumulate ? out + s : s;
    }
  }
}

// Tiles of 5-6 x rows (one W row, NT = 1): x comes from L1 as an FMA memory operand, so the
// accumulators fit the 16 ymm registers, with separate even/odd accumulators (2 * MT
// independent FMA chains). 5-6 rows used to take two passes (a 4-row tile, then the rest) at
// ~2x a 4-row call; one pass of these: 1536 x 17920 bf16 at 5 rows 5.8 -> 3.9 ms (a verify of
// a 4-step chain). From 7 rows the FMA units bound both schemes and 4-row passes win.
template <int MT, typename WT>
void tile_wide(const float* __restrict x, int64_t ldx, const WT* __restrict w, int64_t kc,
               float* __restrict y, int64_t ldy, bool accumulate, const WT* pf) {
  constexpr bool kBf16 = std::is_same<WT, bf16>::value;
  constexpr int kStep = kBf16 ? 16 : 8;
  constexpr int kHalves = (kBf16 && MT <= 6) ? 2 : 1;  // accumulator sets
  __m256 acc[kHalves][MT];
#pragma GCC unroll 8
  for (int h = 0; h < kHalves; ++h)
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) acc[h][m] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + kStep <= kc; k += kStep) {
    if (pf != nullptr && (k * sizeof(WT)) % 64 == 0)
      _mm_prefetch(reinterpret_cast<const char*>(pf + k), _MM_HINT_T0);
    if constexpr (kBf16) {
      __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k));
      __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
      __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(-65536)));
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
        acc[0][m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * ldx + k), we, acc[0][m]);
        acc[kHalves - 1][m] =
            _mm256_fmadd_ps(_mm256_loadu_ps(x + m * ldx + k + 8), wo, acc[kHalves - 1][m]);
      }
    } else {
      __m256 wv = _mm256_loadu_ps(w + k);
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m)
        acc[0][m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * ldx + k), wv, acc[0][m]);
    }
  }
  for (int m = 0; m < MT; ++m) {
    __m256 a = acc[0][m];
    if constexpr (kHalves == 2) a = _mm256_add_ps(a, acc[1][m]);
    float s = hsum(a);
    for (int64_t kk = k; kk < kc; ++kk) s += x[m * ldx + kk] * to_f32(w[kk]);
    float& out = y[m * ldy];
    out = accumulate ? out + s : s;
  }
}

template <int MT, int NT, typename WT>
void tile(const float* __restrict x, int64_t ldx, const WT* __restrict w, int64_t ldw,
          int64_t kc, float* __restrict y, int64_t ldy, int64_t ldyn, bool accumulate,
          const WT* pf, int64_t /*red: the AVX2 kind never k-blocks one sweep*/) {
  if constexpr (MT <= 4) {
    tile_reg<MT, NT, WT>(x, ldx, w, ldw, kc, y, ldy, ldyn, accumulate, pf);
  } else {
    static_assert(NT == 1, "tiles of more than 4 rows take one W row");
    tile_wide<MT, WT>(x, ldx, w, kc, y, ldy, accumulate, pf);
  }
}

}  // namespace small_m
}  // namespace sgl_cpu
