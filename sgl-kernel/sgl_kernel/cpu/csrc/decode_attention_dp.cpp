// decode_attention for bf16 q, K and V on AVX512-BF16 (compiled where -march has it).
//
// Why: the AVX2 path widens every K element and runs 8 fp32 lanes, so a verify of 7 tokens
// (42 query rows for a 6:1 GQA head) is bound by multiply-adds, not by reading the KV: 13 ms
// a layer at 16K keys for Qwen2.5-1.5B, 5x its decode row. VDPBF16PS multiplies 16 lanes of
// bf16 pairs per instruction (4x the AVX2 FMA's work), reading K as stored.
//
// Layout: as in the AVX2 path, query rows sit in the lanes (16 per zmm here), so a score is
// one chain per lane over the head dim and softmax runs on 16 rows at once. A lane holds the
// pair (q[2p], q[2p+1]) and each key contributes its pair (k[2p], k[2p+1]) broadcast from the
// pool (a 32-bit load folded into the instruction): no K copy, no widening. The score is
// scaled after the dot (q is used as stored, so no extra rounding of q * scale). The
// exp-weighted V sum runs on VDPBF16PS too, two keys per instruction (P rounded to bf16, V in
// key pairs) where vd % 32 == 0, else in fp32 FMAs over V widened once per 16 columns.
//
// Invariants (as the AVX2 path's): a row's result depends only on its query, its mask row and
// the keys (per-lane sums in key / pair order; chunks fixed), so a verify row equals the
// decode row at the same position bitwise; masked keys contribute exactly 0.
#include "decode_attention_bf16.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

namespace sgl_cpu {
namespace attn {

#ifndef SGL_ATTN_DP

bool has_dp() { return false; }

const char* isa() { return "avx2"; }

void partials_bf16_dp(const Shapes&, const at::BFloat16*, const at::BFloat16*,
                      const at::BFloat16*, const int64_t*, const bool*, float*, float*, float*) {
  TORCH_CHECK(false, "decode_attention: built without AVX512-BF16");
}

#else

bool has_dp() { return true; }

namespace {

using namespace dp;
constexpr int64_t kBlock = 8;   // keys scored together (one accumulator each)

inline __m512bh pair_bcast(const bf16* p) {  // (p[0], p[1]) in every lane
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return (__m512bh)_mm512_set1_epi32(v);
}

inline __m512 widen16(const bf16* p, __mmask16 mask) {  // bf16 is the top half of an fp32
  const __m256i h = _mm256_maskz_loadu_epi16(mask, reinterpret_cast<const void*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// The query pairs of every KV head with rows in the lanes: qP[((h * RV + v) * P + p) * 16 + i]
// = (q[t, h * G + g, 2p], q[t, h * G + g, 2p + 1]) for row r = 16 v + i = t * G + g; lanes
// past the last row are 0.
std::vector<int32_t> pair_queries(const Shapes& s, const bf16* q, int64_t RV) {
  const int64_t P = s.hd / 2;
  std::vector<int32_t> qP(s.KVH * RV * P * kLanes, 0);
  for (int64_t h = 0; h < s.KVH; ++h)
    for (int64_t r = 0; r < s.R; ++r) {
      const int64_t t = r / s.G, g = r % s.G, v = r / kLanes, i = r % kLanes;
      const bf16* src = q + t * s.q_st + (h * s.G + g) * s.q_sh;
      int32_t* dst = qP.data() + (h * RV + v) * P * kLanes + i;
      for (int64_t p = 0; p < P; ++p) std::memcpy(dst + p * kLanes, src + 2 * p, 4);
    }
  return qP;
}

// Scores (unscaled) of NV row vectors (16 query rows each, lanes of qv + v * qs) against 8
// keys (rows kr[u]): dst[v * ds + u * 16 + i] = row i of vector v . key u, one VDPBF16PS chain
// per (key, lane) in pair order. Each key pair broadcast serves the NV vectors (a verify's 5
// vectors reloaded it 5 times: as many loads as multiply-adds).
template <int NV, int HD>
inline void score_block(const int32_t* __restrict qv, int64_t qs, const bf16* const* kr,
                        int64_t hd, float* __restrict dst, int64_t ds) {
  const int64_t D = HD > 0 ? HD : hd;
  __m512 a[NV][kBlock];
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v)
#pragma GCC unroll 8
    for (int u = 0; u < kBlock; ++u) a[v][u] = _mm512_setzero_ps();
#pragma GCC unroll 2
  for (int64_t d = 0; d < D; d += 2) {
    __m512bh qd[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v)
      qd[v] = (__m512bh)_mm512_loadu_si512(qv + v * qs + d / 2 * kLanes);
#pragma GCC unroll 8
    for (int u = 0; u < kBlock; ++u) {
      const __m512bh kp = pair_bcast(kr[u] + d);
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) a[v][u] = _mm512_dpbf16_ps(a[v][u], qd[v], kp);
    }
  }
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v)
#pragma GCC unroll 8
    for (int u = 0; u < kBlock; ++u) _mm512_storeu_ps(dst + v * ds + u * kLanes, a[v][u]);
}

template <int NV>
inline void score_block_hd(const int32_t* qv, int64_t qs, const bf16* const* kr, int64_t hd,
                           float* dst, int64_t ds) {
  switch (hd) {
    case 64: return score_block<NV, 64>(qv, qs, kr, hd, dst, ds);
    case 128: return score_block<NV, 128>(qv, qs, kr, hd, dst, ds);
    default: return score_block<NV, 0>(qv, qs, kr, hd, dst, ds);
  }
}

// The scores of all RV row vectors against 8 keys, up to 3 vectors at a time (24 accumulators,
// 3 query pairs and a key pair in the 32 zmm registers).
inline void score_rows(const int32_t* qh, int64_t RV, int64_t P, const bf16* const* kr,
                       int64_t hd, float* dst) {
  const int64_t qs = P * kLanes, ds = kChunk * kLanes;
  int64_t v = 0;
  for (; v + 3 <= RV; v += 3) score_block_hd<3>(qh + v * qs, qs, kr, hd, dst + v * ds, ds);
  if (RV - v == 2) score_block_hd<2>(qh + v * qs, qs, kr, hd, dst + v * ds, ds);
  if (RV - v == 1) score_block_hd<1>(qh + v * qs, qs, kr, hd, dst + v * ds, ds);
}

// acc[i * vd + d] = sum_j p[j * 16 + i] * v_j[d] for the first NL lanes (rows), keys in order,
// in fp32. Few rows take two 16-column groups per sweep (2 * NL independent FMA chains hide
// the FMA latency); each V load serves all NL rows. Masked keys have p = 0 and add nothing.
template <int NL>
void weighted_v(const float* p, const bf16* const* v, int64_t n, int64_t vd, float* acc) {
  constexpr int NC = NL <= 8 ? 2 : 1;
  for (int64_t d0 = 0; d0 < vd; d0 += 16 * NC) {
    __mmask16 mk[NC];
    for (int c = 0; c < NC; ++c) {
      const int64_t cols = std::clamp<int64_t>(vd - d0 - 16 * c, 0, 16);
      mk[c] = static_cast<__mmask16>((uint32_t(1) << cols) - 1);
    }
    __m512 a[NC][NL];
    for (int c = 0; c < NC; ++c)
      for (int i = 0; i < NL; ++i) a[c][i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      __m512 vv[NC];
      for (int c = 0; c < NC; ++c) vv[c] = widen16(v[j] + d0 + 16 * c, mk[c]);
      const float* pj = p + j * kLanes;
      for (int i = 0; i < NL; ++i) {
        const __m512 b = _mm512_set1_ps(pj[i]);
        for (int c = 0; c < NC; ++c) a[c][i] = _mm512_fmadd_ps(b, vv[c], a[c][i]);
      }
    }
    for (int c = 0; c < NC; ++c)
      for (int i = 0; i < NL; ++i) _mm512_mask_storeu_ps(acc + i * vd + d0 + 16 * c, mk[c], a[c][i]);
  }
}

// V of one head's chunk in key pairs: vn[jp * vd + d] = (V[2jp][d], V[2jp + 1][d]); the key
// past an odd n reads as 0. vd % 32 == 0.
inline void pair_values(const bf16* const* v, int64_t n, int64_t vd, int32_t* vn) {
  const __m512i lo_i = pair_index(0), hi_i = pair_index(1);
  for (int64_t jp = 0; 2 * jp < n; ++jp) {
    const bf16* a = v[2 * jp];
    const bf16* b = 2 * jp + 1 < n ? v[2 * jp + 1] : nullptr;
    for (int64_t d0 = 0; d0 < vd; d0 += 32) {
      const __m512i x = _mm512_loadu_si512(a + d0);
      const __m512i y = b != nullptr ? _mm512_loadu_si512(b + d0) : _mm512_setzero_si512();
      _mm512_storeu_si512(vn + jp * vd + d0, _mm512_permutex2var_epi16(x, lo_i, y));
      _mm512_storeu_si512(vn + jp * vd + d0 + 16, _mm512_permutex2var_epi16(x, hi_i, y));
    }
  }
}

// The probabilities sv[j * 16 + i] of one row vector in key pairs, rounded to bf16 (as the AMX
// path and flash attention on GPUs round P; l keeps the fp32 sum): pp[jp * 16 + i] =
// (p[2jp][i], p[2jp + 1][i]); the key past an odd n weighs 0.
inline void pair_probs(const float* sv, int64_t n, int32_t* pp) {
  for (int64_t jp = 0; 2 * jp < n; ++jp) {
    const __m512 lo = _mm512_loadu_ps(sv + 2 * jp * kLanes);
    const __m512 hi = 2 * jp + 1 < n ? _mm512_loadu_ps(sv + (2 * jp + 1) * kLanes) : _mm512_setzero_ps();
    const __m512i l = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(lo));
    const __m512i h = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(hi));
    _mm512_storeu_si512(pp + jp * kLanes, _mm512_or_si512(l, _mm512_slli_epi32(h, 16)));
  }
}

// weighted_v on VDPBF16PS: acc[i * vd + d] = sum over key pairs of (p, p') . (v[d], v'[d]),
// two keys per instruction (half the FMAs of weighted_v, whose scalar-times-row FMAs were
// most of a 10-row verify's attention). Per lane in key-pair order: a row's sums depend only
// on its own probabilities; a masked key (p = 0) adds exactly nothing. vd % 32 == 0.
//
// One call: rows [i0, i0 + RB) x CG 16-column groups from d0, RB * CG <= 24 accumulators, so
// each V load serves RB rows and each probability broadcast CG groups (the previous one-group
// sweeps loaded as often as they multiplied).
template <int RB, int CG>
inline void pv_block(const int32_t* __restrict pp, const int32_t* __restrict vn, int64_t np,
                     int64_t vd, int64_t d0, int i0, float* __restrict acc) {
  __m512 a[RB][CG];
#pragma GCC unroll 12
  for (int i = 0; i < RB; ++i)
#pragma GCC unroll 4
    for (int c = 0; c < CG; ++c) a[i][c] = _mm512_setzero_ps();
  for (int64_t jp = 0; jp < np; ++jp) {
    __m512bh vv[CG];
#pragma GCC unroll 4
    for (int c = 0; c < CG; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vn + jp * vd + d0 + 16 * c);
    const int32_t* pj = pp + jp * kLanes + i0;
#pragma GCC unroll 12
    for (int i = 0; i < RB; ++i) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(pj[i]);
#pragma GCC unroll 4
      for (int c = 0; c < CG; ++c) a[i][c] = _mm512_dpbf16_ps(a[i][c], b, vv[c]);
    }
  }
#pragma GCC unroll 12
  for (int i = 0; i < RB; ++i)
#pragma GCC unroll 4
    for (int c = 0; c < CG; ++c) _mm512_storeu_ps(acc + (i0 + i) * vd + d0 + 16 * c, a[i][c]);
}

template <int CG, int... Rs>
void pv_rows(int rb, const int32_t* pp, const int32_t* vn, int64_t np, int64_t vd, int64_t d0,
             int i0, float* acc, std::integer_sequence<int, Rs...>) {
  ((rb == Rs + 1 ? (pv_block<Rs + 1, CG>(pp, vn, np, vd, d0, i0, acc), true) : false) || ...);
}

// The first nl rows: 64-column groups (CG 4) in blocks of 6 rows where vd % 64 == 0, else
// 32-column groups in blocks of 12.
inline void weighted_v_dp(int nl, const int32_t* pp, const int32_t* vn, int64_t np, int64_t vd,
                          float* acc) {
  if (vd % 64 == 0) {
    for (int64_t d0 = 0; d0 < vd; d0 += 64)
      for (int i0 = 0; i0 < nl; i0 += 6)
        pv_rows<4>(std::min(6, nl - i0), pp, vn, np, vd, d0, i0, acc,
                   std::make_integer_sequence<int, 6>{});
  } else {
    for (int64_t d0 = 0; d0 < vd; d0 += 32)
      for (int i0 = 0; i0 < nl; i0 += 12)
        pv_rows<2>(std::min(12, nl - i0), pp, vn, np, vd, d0, i0, acc,
                   std::make_integer_sequence<int, 12>{});
  }
}

template <int... Ns>
void weighted_v_lanes(int nl, const float* p, const bf16* const* v, int64_t n, int64_t vd,
                      float* acc, std::integer_sequence<int, Ns...>) {
  ((nl == Ns + 1 ? (weighted_v<Ns + 1>(p, v, n, vd, acc), true) : false) || ...);
}

struct Scratch {
  Buffer<float> sT;            // scores / probabilities [RV][kChunk][16]
  std::vector<bf16> zero_row;  // the keys past a chunk's end in a block (scores unused)
  Buffer<int32_t> vn;          // V in key pairs [kChunk / 2][vd] (pair_values)
  Buffer<int32_t> pp;          // P in key pairs [kChunk / 2][16] (pair_probs)
  Scratch(int64_t hd, int64_t vd, int64_t RV)
      : sT(new float[RV * kChunk * kLanes]), zero_row(hd, bf16(0.0f)),
        vn(new int32_t[kChunk / 2 * vd]), pp(new int32_t[kChunk / 2 * kLanes]) {}
};

// One work item: keys [c0, c1) of every KV head; partials at [h * R + r] of m/l/acc.
void chunk_partials(const Shapes& s, int64_t RV, const int32_t* qP, const bf16* kb,
                    const bf16* vb, const int64_t* idx, const bool* mask, int64_t c0, int64_t c1,
                    const int64_t* next_idx, int64_t next_n, Scratch& w, float* m_out,
                    float* l_out, float* acc_out) {
  const int64_t n = c1 - c0, hd = s.hd, vd = s.vd, P = hd / 2;
  const bool masked = chunk_masked(s, mask, c0, n);
  const bf16* kp[kChunk];
  const bf16* vp[kChunk];
  for (int64_t h = 0; h < s.KVH; ++h) {
    for (int64_t j = 0; j < n; ++j) {
      kp[j] = kb + idx[c0 + j] * s.k_ss + h * s.k_sh;
      vp[j] = vb + idx[c0 + j] * s.v_ss + h * s.v_sh;
    }
    const int32_t* qh = qP + h * RV * P * kLanes;
    for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
      prefetch_next(s, kb, vb, next_idx, next_n, j0, j0 + kBlock, h);
      const bf16* kr[kBlock];
      for (int64_t u = 0; u < kBlock; ++u) kr[u] = j0 + u < n ? kp[j0 + u] : w.zero_row.data();
      score_rows(qh, RV, P, kr, hd, w.sT.get() + j0 * kLanes);
    }
    const bool pairs = vd % 32 == 0;
    if (pairs) pair_values(vp, n, vd, w.vn.get());
    for (int64_t v = 0; v < RV; ++v) {
      const int nl = static_cast<int>(std::min<int64_t>(kLanes, s.R - v * kLanes));
      float* sv = w.sT.get() + v * kChunk * kLanes;
      const int64_t base = h * s.R + v * kLanes;
      softmax_lanes(s, sv, n, nl, v, masked ? mask + c0 : nullptr, m_out + base, l_out + base);
      if (pairs) {
        pair_probs(sv, n, w.pp.get());
        weighted_v_dp(nl, w.pp.get(), w.vn.get(), (n + 1) / 2, vd, acc_out + base * vd);
      } else {
        weighted_v_lanes(nl, sv, vp, n, vd, acc_out + base * vd,
                         std::make_integer_sequence<int, kLanes>{});
      }
    }
  }
}



}  // namespace

const char* isa() {
#ifdef SGL_ATTN_AMX
  if (dp::amx_ready()) return "amx-bf16";
#endif
  return "avx512bf16";
}

void partials_bf16_dp(const Shapes& s, const bf16* q, const bf16* kb, const bf16* vb,
                      const int64_t* idx, const bool* mask, float* m, float* l, float* acc) {
  TORCH_CHECK(s.hd % 2 == 0, "decode_attention: odd head dim");
  const int64_t RV = (s.R + kLanes - 1) / kLanes, per = s.KVH * s.R;
  const std::vector<int32_t> qP = pair_queries(s, q, RV);
#ifdef SGL_ATTN_AMX
  if (dp::amx_ready() && s.hd % 32 == 0 && s.hd <= 128 && s.vd % 32 == 0) {
    dp::partials_amx(s, RV, qP.data(), kb, vb, idx, mask, m, l, acc);
    return;
  }
#endif
  for_each_chunk(
      s, [&] { return Scratch(s.hd, s.vd, RV); },
      [&](Scratch& w, int64_t c, int64_t c0, int64_t c1, int64_t next_n) {
        chunk_partials(s, RV, qP.data(), kb, vb, idx, mask, c0, c1, idx + c1, next_n, w,
                       m + c * per, l + c * per, acc + c * per * s.vd);
      });
}

#endif  // SGL_ATTN_DP

}  // namespace attn
}  // namespace sgl_cpu
