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
// exp-weighted V sum runs in fp32 FMAs, V widened once per 16 columns for all rows.
//
// Invariants (as the AVX2 path's): a row's result depends only on its query, its mask row and
// the keys (per-lane sums in key / pair order; chunks fixed), so a verify row equals the
// decode row at the same position bitwise; masked keys contribute exactly 0.
#include "decode_attention.h"
#include "vec.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define SGL_ATTN_DP 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define SGL_ATTN_AMX 1  // Intel AMX (Sapphire Rapids and later): both products on tiles
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#endif
#endif

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

using bf16 = at::BFloat16;
namespace vec = sgl_cpu::vec;
constexpr int64_t kLanes = 16;  // query rows per zmm
constexpr int64_t kBlock = 8;   // keys scored together (one accumulator each)

// e^x for 16 lanes, x <= 0; lanes below kExpFloor give exactly 0.
inline __m512 exp16(__m512 x) {
  const __m512 floor_v = _mm512_set1_ps(kExpFloor);
  const __mmask16 keep = _mm512_cmp_ps_mask(x, floor_v, _CMP_NLT_UQ);
  return _mm512_maskz_mov_ps(keep, vec::exp_in_range<vec::Lanes16>(_mm512_max_ps(x, floor_v)));
}

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

// Scores (unscaled) of 16 query rows (lanes of qv) against 8 keys (rows kr[u]):
// dst[u * 16 + i] = row i . key u, one VDPBF16PS chain per (key, lane) in pair order.
template <int HD>
inline void score_block(const int32_t* __restrict qv, const bf16* const* kr, int64_t hd,
                        float* __restrict dst) {
  const int64_t D = HD > 0 ? HD : hd;
  const bf16 *k0 = kr[0], *k1 = kr[1], *k2 = kr[2], *k3 = kr[3], *k4 = kr[4], *k5 = kr[5],
             *k6 = kr[6], *k7 = kr[7];
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
#pragma GCC unroll 4
  for (int64_t d = 0; d < D; d += 2) {
    const __m512bh qd = (__m512bh)_mm512_loadu_si512(qv + d / 2 * kLanes);
    a0 = _mm512_dpbf16_ps(a0, qd, pair_bcast(k0 + d));
    a1 = _mm512_dpbf16_ps(a1, qd, pair_bcast(k1 + d));
    a2 = _mm512_dpbf16_ps(a2, qd, pair_bcast(k2 + d));
    a3 = _mm512_dpbf16_ps(a3, qd, pair_bcast(k3 + d));
    a4 = _mm512_dpbf16_ps(a4, qd, pair_bcast(k4 + d));
    a5 = _mm512_dpbf16_ps(a5, qd, pair_bcast(k5 + d));
    a6 = _mm512_dpbf16_ps(a6, qd, pair_bcast(k6 + d));
    a7 = _mm512_dpbf16_ps(a7, qd, pair_bcast(k7 + d));
  }
  _mm512_storeu_ps(dst, a0), _mm512_storeu_ps(dst + 16, a1), _mm512_storeu_ps(dst + 32, a2);
  _mm512_storeu_ps(dst + 48, a3), _mm512_storeu_ps(dst + 64, a4), _mm512_storeu_ps(dst + 80, a5);
  _mm512_storeu_ps(dst + 96, a6), _mm512_storeu_ps(dst + 112, a7);
}

inline void score_block_any(const int32_t* qv, const bf16* const* kr, int64_t hd, float* dst) {
  switch (hd) {
    case 64: return score_block<64>(qv, kr, hd, dst);
    case 128: return score_block<128>(qv, kr, hd, dst);
    default: return score_block<0>(qv, kr, hd, dst);
  }
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

// Interleave indices for _mm512_permutex2var_epi16(a, ix, b): 32-bit lane c holds (a[c + 16
// half], b[c + 16 half]), the bf16 pair layout VDPBF16PS multiplies.
inline __m512i pair_index(int half) {
  alignas(64) int16_t ix[32];
  for (int c = 0; c < 16; ++c)
    for (int e = 0; e < 2; ++e) ix[2 * c + e] = static_cast<int16_t>(16 * half + c + 32 * e);
  return _mm512_load_si512(ix);
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
template <int NL>
void weighted_v_dp(const int32_t* pp, const int32_t* vn, int64_t np, int64_t vd, float* acc) {
  constexpr int NC = NL <= 8 ? 2 : 1;
  for (int64_t d0 = 0; d0 < vd; d0 += 16 * NC) {
    __m512 a[NC][NL];
    for (int c = 0; c < NC; ++c)
      for (int i = 0; i < NL; ++i) a[c][i] = _mm512_setzero_ps();
    for (int64_t jp = 0; jp < np; ++jp) {
      __m512bh vv[NC];
      for (int c = 0; c < NC; ++c)
        vv[c] = (__m512bh)_mm512_loadu_si512(vn + jp * vd + d0 + 16 * c);
      const int32_t* pj = pp + jp * kLanes;
      for (int i = 0; i < NL; ++i) {
        const __m512bh b = (__m512bh)_mm512_set1_epi32(pj[i]);
        for (int c = 0; c < NC; ++c) a[c][i] = _mm512_dpbf16_ps(a[c][i], b, vv[c]);
      }
    }
    for (int c = 0; c < NC; ++c)
      for (int i = 0; i < NL; ++i) _mm512_storeu_ps(acc + i * vd + d0 + 16 * c, a[c][i]);
  }
}

template <int... Ns>
void weighted_v_dp_lanes(int nl, const int32_t* pp, const int32_t* vn, int64_t np, int64_t vd,
                         float* acc, std::integer_sequence<int, Ns...>) {
  ((nl == Ns + 1 ? (weighted_v_dp<Ns + 1>(pp, vn, np, vd, acc), true) : false) || ...);
}

template <int... Ns>
void weighted_v_lanes(int nl, const float* p, const bf16* const* v, int64_t n, int64_t vd,
                      float* acc, std::integer_sequence<int, Ns...>) {
  ((nl == Ns + 1 ? (weighted_v<Ns + 1>(p, v, n, vd, acc), true) : false) || ...);
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
      for (int64_t v = 0; v < RV; ++v)  // the 8 key rows stay in L1 across the row vectors
        score_block_any(qh + v * P * kLanes, kr, hd, w.sT.get() + (v * kChunk + j0) * kLanes);
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
        weighted_v_dp_lanes(nl, w.pp.get(), w.vn.get(), (n + 1) / 2, vd, acc_out + base * vd,
                            std::make_integer_sequence<int, kLanes>{});
      } else {
        weighted_v_lanes(nl, sv, vp, n, vd, acc_out + base * vd,
                         std::make_integer_sequence<int, kLanes>{});
      }
    }
  }
}


#ifdef SGL_ATTN_AMX
// ---- AMX: the same partials with both products on the tile unit ----------------------------
// Scores: C[key][row] = K[16 keys][32 d] x Q^T, the B tile being the pair layout of q above
// (16 pair rows x 16 query rows), so C lands in the softmax's [key][lane] layout. K rows are
// read as stored (a tile load straight from the pool when 16 slots are consecutive, else
// from a copy). P V: C[row][col] = P[16 rows][32 keys] x V, P rounded to bf16 (as flash
// attention on GPUs does; l keeps the fp32 sum), V rows interleaved in pairs. Each C element
// depends only on its own row of the A tile and column of the B tile (fixed order inside the
// instruction), so the row-independence invariant holds as in the other paths. Tiles:
// 0, 6 = C, 1..4 = A (K steps of 32 d, or P steps of 32 keys), 5, 7 = B; all 16 rows x 64 bytes.

constexpr int64_t kTileKeys = 16;  // keys per score tile
constexpr int64_t kPvKeys = 32;    // keys per P V step

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  _tile_loadconfig(&cfg);
}

// Linux hands out AMX state only on request, once per process (torch's oneDNN asks too);
// SGL_KERNEL_NO_AMX=1 keeps to the VDPBF16PS path (tested so on AMX machines).
bool amx_ready() {
  static const bool ok = [] {
    const char* off = std::getenv("SGL_KERNEL_NO_AMX");
    if (off != nullptr && off[0] == '1') return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// out[i] = column i of the 16 x 16 fp32 matrix r[0..15] (rows), in registers.
inline void transpose16(const __m512 r[16], __m512 out[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int g = 0; g < 4; ++g) {  // u[4g + c], lane L: column 4L + c of rows 4g..4g+3
    u[4 * g] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], 0x44);
    u[4 * g + 1] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], 0xEE);
    u[4 * g + 2] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0x44);
    u[4 * g + 3] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 a = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88);
    const __m512 b = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
    const __m512 a2 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD);
    const __m512 b2 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
    out[c] = _mm512_shuffle_f32x4(a, b, 0x88);
    out[8 + c] = _mm512_shuffle_f32x4(a, b, 0xDD);
    out[4 + c] = _mm512_shuffle_f32x4(a2, b2, 0x88);
    out[12 + c] = _mm512_shuffle_f32x4(a2, b2, 0xDD);
  }
}

struct AmxScratch {
  Buffer<float> sT;  // scores / probabilities [RV][kChunk][16]
  Buffer<bf16> kbuf;  // 16 K rows when their slots are not consecutive [16][hd]
  Buffer<bf16> pb;    // P of one row vector [16 rows][kChunk keys] bf16
  Buffer<bf16> vn;    // V in pairs: [kChunk / 32][vd / 16][16 key pairs][32]
  alignas(64) float cbuf[2][16 * 16];
  // a thread's tile state lives as long as its scratch
  AmxScratch(int64_t hd, int64_t vd, int64_t RV)
      : sT(new float[RV * kChunk * kLanes]), kbuf(new bf16[kTileKeys * hd]),
        pb(new bf16[kLanes * kChunk]), vn(new bf16[kChunk * vd]) {
    configure_tiles();
  }
  ~AmxScratch() { _tile_release(); }
  AmxScratch(const AmxScratch&) = delete;
  AmxScratch& operator=(const AmxScratch&) = delete;
};

// Tile numbers are immediates: A tile a (0..3) is tile a + 1. C tiles 0 and 6 with B tiles 5
// and 7 make two independent chains (tiles are not renamed: a load into the B tile the last
// product reads waits for that product).
// (the intrinsics paste their tile numbers into the asm text: literals only)
#define SGL_TILE_DP_FN(name, C, B)                 \
  inline void name(int a) {                        \
    switch (a) {                                   \
      case 0: _tile_dpbf16ps(C, 1, B); break;      \
      case 1: _tile_dpbf16ps(C, 2, B); break;      \
      case 2: _tile_dpbf16ps(C, 3, B); break;      \
      default: _tile_dpbf16ps(C, 4, B); break;     \
    }                                              \
  }
SGL_TILE_DP_FN(tile_dp_c0, 0, 5)
SGL_TILE_DP_FN(tile_dp_c6, 6, 7)
#undef SGL_TILE_DP_FN

inline void tile_load_a(int a, const void* p, int64_t stride) {
  switch (a) {
    case 0: _tile_loadd(1, p, stride); break;
    case 1: _tile_loadd(2, p, stride); break;
    case 2: _tile_loadd(3, p, stride); break;
    default: _tile_loadd(4, p, stride); break;
  }
}

// C0 (+ C6 when two) = sum over steps st < nst of A_st x B, B of chain k at b[k] + st * bstep.
inline void tile_chains(int nchains, int nst, const char* b0, const char* b1, int64_t bstep) {
  _tile_zero(0);
  if (nchains == 2) _tile_zero(6);
  for (int st = 0; st < nst; ++st) {
    _tile_loadd(5, b0 + st * bstep, 64);
    if (nchains == 2) _tile_loadd(7, b1 + st * bstep, 64);
    tile_dp_c0(st);
    if (nchains == 2) tile_dp_c6(st);
  }
}

void chunk_partials_amx(const Shapes& s, int64_t RV, const int32_t* qP, const bf16* kb,
                        const bf16* vb, const int64_t* idx, const bool* mask, int64_t c0,
                        int64_t c1, const int64_t* next_idx, int64_t next_n, AmxScratch& w,
                        float* m_out, float* l_out, float* acc_out) {
  const int64_t n = c1 - c0, hd = s.hd, vd = s.vd, P = hd / 2;
  const int64_t n32 = (n + kPvKeys - 1) / kPvKeys;  // P V steps
  const bool masked = chunk_masked(s, mask, c0, n);
  // V pairs: (V[2k][c], V[2k + 1][c]) for 16 columns of one 64-byte tile row
  const __m512i lo_i = pair_index(0), hi_i = pair_index(1);
  for (int64_t h = 0; h < s.KVH; ++h) {
    const int32_t* qh = qP + h * RV * P * kLanes;
    for (int64_t j0 = 0; j0 < n; j0 += kTileKeys) {
      prefetch_next(s, kb, vb, next_idx, next_n, j0, j0 + kTileKeys, h);
      const int64_t nk = std::min(kTileKeys, n - j0);
      const int64_t* ix = idx + c0 + j0;
      bool run = nk == kTileKeys;
      for (int64_t u = 1; run && u < kTileKeys; ++u) run = ix[u] == ix[0] + u;
      const bf16* kbase;
      int64_t kstride;
      if (run) {  // 16 consecutive slots: tile loads straight from the pool
        kbase = kb + ix[0] * s.k_ss + h * s.k_sh, kstride = s.k_ss * 2;
      } else {
        for (int64_t u = 0; u < kTileKeys; ++u) {
          bf16* dst = w.kbuf.get() + u * hd;
          if (u < nk)
            std::memcpy(dst, kb + ix[u] * s.k_ss + h * s.k_sh, hd * sizeof(bf16));
          else
            std::memset(dst, 0, hd * sizeof(bf16));
        }
        kbase = w.kbuf.get(), kstride = hd * 2;
      }
      for (int64_t st = 0; st < hd / 32; ++st) tile_load_a(int(st), kbase + st * 32, kstride);
      for (int64_t v = 0; v < RV; v += 2) {  // row vectors v and v + 1 as two chains
        const int nc = v + 1 < RV ? 2 : 1;
        const int32_t* b = qh + v * P * kLanes;  // B of step st: 16 pair rows from st * 16
        tile_chains(nc, int(hd / 32), reinterpret_cast<const char*>(b),
                    reinterpret_cast<const char*>(b + P * kLanes), 16 * kLanes * 4);
        _tile_stored(0, w.sT.get() + (v * kChunk + j0) * kLanes, 64);
        if (nc == 2) _tile_stored(6, w.sT.get() + ((v + 1) * kChunk + j0) * kLanes, 64);
      }
    }
    // V of this head in pairs of keys (keys past n are zeros: their p is 0, and 0 x 0 adds
    // nothing whatever the other keys hold)
    for (int64_t k2 = 0; k2 < n32 * 16; ++k2) {
      const int64_t j = 2 * k2, step = k2 / 16, kp = k2 % 16;
      const bf16* va = j < n ? vb + idx[c0 + j] * s.v_ss + h * s.v_sh : nullptr;
      const bf16* vbb = j + 1 < n ? vb + idx[c0 + j + 1] * s.v_ss + h * s.v_sh : nullptr;
      for (int64_t d0 = 0; d0 < vd; d0 += 32) {
        const __m512i a = va ? _mm512_loadu_si512(va + d0) : _mm512_setzero_si512();
        const __m512i b = vbb ? _mm512_loadu_si512(vbb + d0) : _mm512_setzero_si512();
        bf16* dst = w.vn.get() + ((step * (vd / 16) + d0 / 16) * 16 + kp) * 32;
        _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(a, lo_i, b));
        _mm512_storeu_si512(dst + 16 * 32, _mm512_permutex2var_epi16(a, hi_i, b));
      }
    }
    for (int64_t v = 0; v < RV; ++v) {
      const int nl = static_cast<int>(std::min<int64_t>(kLanes, s.R - v * kLanes));
      float* sv = w.sT.get() + v * kChunk * kLanes;
      const int64_t base = h * s.R + v * kLanes;
      softmax_lanes(s, sv, n, nl, v, masked ? mask + c0 : nullptr, m_out + base, l_out + base);
      for (int64_t j = n; j < n32 * kPvKeys; ++j)  // keys past the chunk weigh 0
        _mm512_storeu_ps(sv + j * kLanes, _mm512_setzero_ps());
      // P as [row][key] bf16, 32 keys at a time
      for (int64_t k0 = 0; k0 < n32 * kPvKeys; k0 += kPvKeys) {
        __m512 r[16], lo[16], hi[16];
        for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_ps(sv + (k0 + j) * kLanes);
        transpose16(r, lo);
        for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_ps(sv + (k0 + 16 + j) * kLanes);
        transpose16(r, hi);
        for (int i = 0; i < 16; ++i)
          _mm512_storeu_si512(w.pb.get() + i * kChunk + k0, (__m512i)_mm512_cvtne2ps_pbh(hi[i], lo[i]));
      }
      for (int64_t st = 0; st < n32; ++st)
        tile_load_a(int(st), w.pb.get() + st * kPvKeys, kChunk * 2);
      for (int64_t c = 0; c < vd / 16; c += 2) {  // column tiles c and c + 1 (vd % 32 == 0)
        const bf16* b = w.vn.get() + c * 16 * 32;  // B of step st: vn[st][c]
        tile_chains(2, int(n32), reinterpret_cast<const char*>(b),
                    reinterpret_cast<const char*>(b + 16 * 32), vd / 16 * 16 * 32 * 2);
        _tile_stored(0, w.cbuf[0], 64);
        _tile_stored(6, w.cbuf[1], 64);
        for (int i = 0; i < nl; ++i) {
          float* dst = acc_out + (base + i) * vd + c * 16;
          _mm512_storeu_ps(dst, _mm512_load_ps(w.cbuf[0] + i * 16));
          _mm512_storeu_ps(dst + 16, _mm512_load_ps(w.cbuf[1] + i * 16));
        }
      }
    }
  }
}
#endif  // SGL_ATTN_AMX

}  // namespace

const char* isa() {
#ifdef SGL_ATTN_AMX
  if (amx_ready()) return "amx-bf16";
#endif
  return "avx512bf16";
}

void partials_bf16_dp(const Shapes& s, const bf16* q, const bf16* kb, const bf16* vb,
                      const int64_t* idx, const bool* mask, float* m, float* l, float* acc) {
  TORCH_CHECK(s.hd % 2 == 0, "decode_attention: odd head dim");
  const int64_t RV = (s.R + kLanes - 1) / kLanes, per = s.KVH * s.R;
  const std::vector<int32_t> qP = pair_queries(s, q, RV);
#ifdef SGL_ATTN_AMX
  if (amx_ready() && s.hd % 32 == 0 && s.hd <= 128 && s.vd % 32 == 0) {
    for_each_chunk(
        s, [&] { return std::make_unique<AmxScratch>(s.hd, s.vd, RV); },
        [&](std::unique_ptr<AmxScratch>& w, int64_t c, int64_t c0, int64_t c1, int64_t next_n) {
          chunk_partials_amx(s, RV, qP.data(), kb, vb, idx, mask, c0, c1, idx + c1, next_n, *w,
                             m + c * per, l + c * per, acc + c * per * s.vd);
        });
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
