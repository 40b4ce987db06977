// decode_attention's partials for bf16 q, K and V on Intel AMX tiles (compiled where -march
// has AMX-TILE and AMX-BF16; elsewhere this file is empty).
#include "decode_attention_bf16.h"

#ifdef SGL_ATTN_AMX
#include <ATen/Parallel.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace sgl_cpu {
namespace attn {
namespace dp {

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

namespace {

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
}  // namespace

void partials_amx(const Shapes& s, int64_t RV, const int32_t* qP, const bf16* kb,
                  const bf16* vb, const int64_t* idx, const bool* mask, float* m, float* l,
                  float* acc) {
  const int64_t per = s.KVH * s.R;
  for_each_chunk(
      s, [&] { return std::make_unique<AmxScratch>(s.hd, s.vd, RV); },
      [&](std::unique_ptr<AmxScratch>& w, int64_t c, int64_t c0, int64_t c1, int64_t next_n) {
        chunk_partials_amx(s, RV, qP, kb, vb, idx, mask, c0, c1, idx + c1, next_n, *w,
                           m + c * per, l + c * per, acc + c * per * s.vd);
      });
}

}  // namespace dp
}  // namespace attn
}  // namespace sgl_cpu
#endif  // SGL_ATTN_AMX
