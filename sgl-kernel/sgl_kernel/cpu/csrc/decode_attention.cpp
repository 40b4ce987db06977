// Attention of a few query rows (decode, speculative verify) over KV slots of a paged pool,
// on AVX2 + FMA, split over the keys (flash-decoding) so 2 threads share even one request.
//
// out[t, h] = softmax(scale * q[t, h] . K[idx]^T, masked by mask[t]) @ V[idx], where query
// head h reads KV head h / G (grouped-query attention, G = H / KVH).
//
// Why a kernel: torch's SDPA reads a strided [KVH, L, hd] view of the pool at ~6 GB/s for
// one query row (2 ms per layer at 8K keys, SmolLM2 heads, fp32) and a gather of the slots
// copies as many bytes as attention reads. Here every K and V row is read from the pool
// once, in place, through `idx` (any order, any number of runs: a cached document, a
// question, a verify tree, a draft's compressed view), and shared by the G * T query rows
// of its KV head while in L1.
//
// Layout: the G * T query rows of a KV head sit in the 8 lanes of a vector (qT), so a score
// is one FMA chain per lane over the head dim (a K element broadcast, no horizontal sums)
// and softmax runs on 8 rows at once; each V row is loaded once per 8 columns for all rows.
// (The previous layout, one row at a time against 8 keys, spent as much on horizontal sums
// and loads as on FMAs: 0.43 ms a layer for Qwen2.5-0.5B at 4K, G = 7.)
//
// Work item = a chunk of kChunk keys (all KV heads); a chunk's max, sum and weighted V sum are
// merged by log-sum-exp in chunk order. Invariant: a row's result depends only on its own
// query, its mask row and the keys, never on the other rows or the thread count (chunk
// boundaries are fixed; every sum runs per lane in key / dim order), so a verify row equals
// the decode row at the same position when the masks select the same keys in the same
// chunks. Masked keys contribute exactly 0 (p = 0 times a finite V row: the slot list only
// names slots whose KV was written, a verify's tree tokens before its attention runs).
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "decode_attention.h"
#include "ops.h"
#include "vec.h"

namespace {

using bf16 = at::BFloat16;
namespace vec = sgl_cpu::vec;

namespace attn = sgl_cpu::attn;
using attn::kChunk;
using attn::kExpFloor;
using attn::kNegInf;
using attn::Shapes;
constexpr int64_t kBlock = 8;    // keys scored together (one accumulator each)
constexpr int64_t kLanes = 8;    // query rows per vector

// e^x for 8 lanes, x <= 0; lanes below kExpFloor give exactly 0.
inline __m256 exp8(__m256 x) {
  const __m256 floor_v = _mm256_set1_ps(kExpFloor);
  const __m256 zero_mask = _mm256_cmp_ps(x, floor_v, _CMP_LT_OQ);
  return _mm256_andnot_ps(zero_mask, vec::exp8_in_range(_mm256_max_ps(x, floor_v)));
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const bf16* p) {  // bf16 is the top half of an fp32
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline void store_out(float v, float* dst) { *dst = v; }
inline void store_out(float v, bf16* dst) { *dst = bf16(v); }  // round to nearest even

// Scratch of one thread, reused across its work items.
struct Scratch {
  std::vector<float> kf, sT;  // kf: a block's K rows in fp32; sT: scores [RV][kChunk][8]
  Scratch(int64_t hd, int64_t RV) : kf(kBlock * hd), sT(RV * kChunk * kLanes) {}
};

// The query rows of every KV head with rows in the lanes: qT[((h * RV + v) * hd + d) * 8 + i]
// = scale * q[t, h * G + g, d] for row r = 8 v + i = t * G + g; lanes past the last row are 0.
template <typename QT>
std::vector<float> transpose_queries(const Shapes& s, const QT* q) {
  std::vector<float> qT(s.KVH * s.RV * s.hd * kLanes, 0.0f);
  for (int64_t h = 0; h < s.KVH; ++h)
    for (int64_t r = 0; r < s.R; ++r) {
      const int64_t t = r / s.G, g = r % s.G, v = r / kLanes, i = r % kLanes;
      const QT* src = q + t * s.q_st + (h * s.G + g) * s.q_sh;
      float* dst = qT.data() + (h * s.RV + v) * s.hd * kLanes + i;
      for (int64_t d = 0; d < s.hd; ++d) dst[d * kLanes] = vec::to_f32(src[d]) * s.scale;
    }
  return qT;
}

// This head's K rows of keys idx[0:n] (n <= 8) as fp32 rows buf[u * hd : (u + 1) * hd]
// (copied even when already fp32: fixed offsets from one base keep the score loop's
// address arithmetic to one register). Rows past n are zeros (their scores are never used).
template <typename KT>
inline void key_block(const KT* pool, int64_t ss, int64_t sh, const int64_t* idx, int64_t n,
                      int64_t h, int64_t hd, float* buf) {
  for (int64_t j = 0; j < kBlock; ++j) {
    float* dst = buf + j * hd;
    if (j >= n) {
      std::memset(dst, 0, hd * sizeof(float));
      continue;
    }
    const KT* src = pool + idx[j] * ss + h * sh;
    for (int64_t d = 0; d < hd; d += 8) _mm256_storeu_ps(dst + d, load8(src + d));
  }
}

// Scores of 8 query rows (the lanes of qv) against 8 keys (rows of kf, hd apart): per head
// dim one query vector and one broadcast element of each key, so there is no horizontal
// reduction and the 8 accumulators are independent FMA chains. dst[u * 8 + i] = row i . key
// u, summed over d in order (per lane, whatever the block: a row's score never depends on
// the other rows). HD > 0: the head dim known at compile time (constant offsets); 0: hd.
template <int HD>
inline void score_block(const float* __restrict qv, const float* __restrict kf, int64_t hd,
                        float* __restrict dst) {
  const int64_t D = HD > 0 ? HD : hd;
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
#pragma GCC unroll 4
  for (int64_t d = 0; d < D; ++d) {
    const __m256 qd = _mm256_loadu_ps(qv + d * kLanes);
    a0 = _mm256_fmadd_ps(qd, _mm256_broadcast_ss(kf + d), a0);
    a1 = _mm256_fmadd_ps(qd, _mm256_broadcast_ss(kf + D + d), a1);
    a2 = _mm256_fmadd_ps(qd, _mm256_broadcast_ss(kf + 2 * D + d), a2);
    a3 = _mm256_fmadd_ps(qd, _mm256_broadcast_ss(kf + 3 * D + d), a3);
    a4 = _mm256_fmadd_ps(qd, _mm256_broadcast_ss(kf + 4 * D + d), a4);
    a5 = _mm256_fmadd_ps(qd, _mm256_broadcast_ss(kf + 5 * D + d), a5);
    a6 = _mm256_fmadd_ps(qd, _mm256_broadcast_ss(kf + 6 * D + d), a6);
    a7 = _mm256_fmadd_ps(qd, _mm256_broadcast_ss(kf + 7 * D + d), a7);
  }
  _mm256_storeu_ps(dst, a0), _mm256_storeu_ps(dst + 8, a1), _mm256_storeu_ps(dst + 16, a2);
  _mm256_storeu_ps(dst + 24, a3), _mm256_storeu_ps(dst + 32, a4), _mm256_storeu_ps(dst + 40, a5);
  _mm256_storeu_ps(dst + 48, a6), _mm256_storeu_ps(dst + 56, a7);
}

inline void score_block_any(const float* qv, const float* kf, int64_t hd, float* dst) {
  switch (hd) {
    case 64: return score_block<64>(qv, kf, hd, dst);
    case 128: return score_block<128>(qv, kf, hd, dst);
    default: return score_block<0>(qv, kf, hd, dst);
  }
}

// acc[i * vd + d] = sum_j p[j * 8 + i] * v_j[d] for the first NL lanes (rows), keys in order.
// Per 8 columns: one V load shared by NL rows (one register each). Masked keys have p = 0
// exactly and add nothing.
template <int NL, typename KT>
void weighted_v(const float* p, const KT* const* v, int64_t n, int64_t vd, float* acc) {
  for (int64_t d0 = 0; d0 < vd; d0 += 8) {
    __m256 a[NL];
    for (int i = 0; i < NL; ++i) a[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const __m256 vv = load8(v[j] + d0);
      const float* pj = p + j * kLanes;
      for (int i = 0; i < NL; ++i) a[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(pj + i), vv, a[i]);
    }
    for (int i = 0; i < NL; ++i) _mm256_storeu_ps(acc + i * vd + d0, a[i]);
  }
}

template <typename KT>
void weighted_v_lanes(int nl, const float* p, const KT* const* v, int64_t n, int64_t vd, float* acc) {
  switch (nl) {
    case 1: return weighted_v<1>(p, v, n, vd, acc);
    case 2: return weighted_v<2>(p, v, n, vd, acc);
    case 3: return weighted_v<3>(p, v, n, vd, acc);
    case 4: return weighted_v<4>(p, v, n, vd, acc);
    case 5: return weighted_v<5>(p, v, n, vd, acc);
    case 6: return weighted_v<6>(p, v, n, vd, acc);
    case 7: return weighted_v<7>(p, v, n, vd, acc);
    default: return weighted_v<8>(p, v, n, vd, acc);
  }
}

// One work item: keys [c0, c1), every KV head (a contiguous run of slots is then read as
// one stream). Writes per (head, row) of the R rows of each head: m (max score), l (sum of
// exp) and acc (exp-weighted V sum, vd floats), at [h * R + r].
template <typename KT>
void chunk_partials(const Shapes& s, const float* qT, const KT* kb, const KT* vb,
                    const int64_t* idx, const bool* mask, int64_t c0, int64_t c1,
                    const int64_t* next_idx, int64_t next_n, Scratch& w, float* m_out,
                    float* l_out, float* acc_out) {
  const int64_t n = c1 - c0, hd = s.hd, vd = s.vd;
  const bool masked = attn::chunk_masked(s, mask, c0, n);
  const KT* vp[kChunk];
  for (int64_t h = 0; h < s.KVH; ++h) {
    const float* qh = qT + h * s.RV * hd * kLanes;
    for (int64_t j = 0; j < n; ++j) vp[j] = vb + idx[c0 + j] * s.v_ss + h * s.v_sh;
    for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
      attn::prefetch_next(s, kb, vb, next_idx, next_n, j0, j0 + kBlock, h);
      key_block(kb, s.k_ss, s.k_sh, idx + c0 + j0, std::min(kBlock, n - j0), h, hd, w.kf.data());
      for (int64_t v = 0; v < s.RV; ++v)  // the 8 key rows stay in L1 across the row vectors
        score_block_any(qh + v * hd * kLanes, w.kf.data(), hd,
                        w.sT.data() + (v * kChunk + j0) * kLanes);
    }
    for (int64_t v = 0; v < s.RV; ++v) {
      const int nl = static_cast<int>(std::min<int64_t>(kLanes, s.R - v * kLanes));
      float* sv = w.sT.data() + v * kChunk * kLanes;
      if (masked) {  // masked keys score -inf: exp gives exactly 0
        for (int i = 0; i < nl; ++i) {
          const bool* mrow = mask + ((v * kLanes + i) / s.G) * s.L + c0;
          for (int64_t j = 0; j < n; ++j)
            if (!mrow[j]) sv[j * kLanes + i] = kNegInf;
        }
      }
      __m256 m8 = _mm256_set1_ps(kNegInf);
      for (int64_t j = 0; j < n; ++j) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(sv + j * kLanes));
      // a lane that sees no key of this chunk subtracts 0, so its exps are 0 (not NaN)
      const __m256 none = _mm256_cmp_ps(m8, _mm256_set1_ps(kNegInf), _CMP_EQ_OQ);
      const __m256 msub = _mm256_andnot_ps(none, m8);
      __m256 l8 = _mm256_setzero_ps();
      for (int64_t j = 0; j < n; ++j) {
        const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(sv + j * kLanes), msub));
        _mm256_storeu_ps(sv + j * kLanes, p);
        l8 = _mm256_add_ps(l8, p);
      }
      alignas(32) float mx[kLanes], ls[kLanes];
      _mm256_store_ps(mx, m8);
      _mm256_store_ps(ls, l8);
      const int64_t base = h * s.R + v * kLanes;
      for (int i = 0; i < nl; ++i) m_out[base + i] = mx[i], l_out[base + i] = ls[i];
      weighted_v_lanes(nl, sv, vp, n, vd, acc_out + base * vd);
    }
  }
}

// The chunks' partials of each (head, row) merged by log-sum-exp in chunk order.
template <typename QT>
void merge(const Shapes& s, const float* m, const float* l, const float* acc, QT* out) {
  const int64_t nchunks = (s.L + kChunk - 1) / kChunk, rows = s.R, per = s.KVH * rows;
  at::parallel_for(0, s.KVH * rows, 16, [&](int64_t b, int64_t e) {
    std::vector<float> o(s.vd);
    for (int64_t hr = b; hr < e; ++hr) {
      const int64_t h = hr / rows, r = hr % rows, t = r / s.G, g = r % s.G;
      float mx = kNegInf;
      for (int64_t c = 0; c < nchunks; ++c) mx = std::max(mx, m[c * per + hr]);
      std::fill(o.begin(), o.end(), 0.0f);
      float denom = 0.0f;
      if (mx != kNegInf) {
        for (int64_t c = 0; c < nchunks; ++c) {
          const float mc = m[c * per + hr];
          if (mc == kNegInf) continue;
          const float w = std::exp(mc - mx);
          denom += w * l[c * per + hr];
          const float* a = acc + (c * per + hr) * s.vd;
          for (int64_t d = 0; d < s.vd; ++d) o[d] += w * a[d];
        }
      }
      // a row that sees no key at all gets zeros (SDPA would give NaN)
      const float inv = denom > 0.0f ? 1.0f / denom : 0.0f;
      QT* dst = out + t * s.o_st + (h * s.G + g) * s.o_sh;
      for (int64_t d = 0; d < s.vd; ++d) store_out(o[d] * inv, dst + d);
    }
  });
}

template <typename QT, typename KT>
void run(const Shapes& s, const QT* q, const KT* kb, const KT* vb, const int64_t* idx,
         const bool* mask, QT* out) {
  const int64_t nchunks = (s.L + kChunk - 1) / kChunk, rows = s.R;
  const int64_t per = s.KVH * rows;  // partials per chunk
  // every partial is written before the merge reads it: no zeroing (5 MB for a 7-token
  // verify at 16K keys)
  std::unique_ptr<float[]> m(new float[nchunks * per]), l(new float[nchunks * per]),
      acc(new float[nchunks * per * s.vd]);
  if constexpr (std::is_same_v<QT, bf16> && std::is_same_v<KT, bf16>) {
    if (attn::has_dp()) {  // AVX512-BF16: decode_attention_dp.cpp
      attn::partials_bf16_dp(s, q, kb, vb, idx, mask, m.get(), l.get(), acc.get());
      merge(s, m.get(), l.get(), acc.get(), out);
      return;
    }
  }
  const std::vector<float> qT = transpose_queries(s, q);
  attn::for_each_chunk(
      s, [&] { return Scratch(s.hd, s.RV); },
      [&](Scratch& w, int64_t c, int64_t c0, int64_t c1, int64_t next_n) {
        chunk_partials(s, qT.data(), kb, vb, idx, mask, c0, c1, idx + c1, next_n, w,
                       m.get() + c * per, l.get() + c * per, acc.get() + c * per * s.vd);
      });
  merge(s, m.get(), l.get(), acc.get(), out);
}

}  // namespace

namespace sgl_cpu {

std::string attention_isa() { return attn::isa(); }

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                            const at::Tensor& idx, const c10::optional<at::Tensor>& mask,
                            double scale) {
  TORCH_CHECK(q.device().is_cpu() && k_buf.device().is_cpu() && v_buf.device().is_cpu(),
              "decode_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_buf.dim() == 3 && v_buf.dim() == 3,
              "decode_attention: q [T, H, hd], k_buf [S, KVH, hd], v_buf [S, KVH, vd]");
  auto is_ok = [](at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16; };
  TORCH_CHECK(is_ok(q.scalar_type()) && is_ok(k_buf.scalar_type()),
              "decode_attention: float32 or bfloat16 only");
  TORCH_CHECK(k_buf.scalar_type() == v_buf.scalar_type(), "decode_attention: K and V dtypes differ");
  TORCH_CHECK(q.stride(2) == 1 && k_buf.stride(2) == 1 && v_buf.stride(2) == 1,
              "decode_attention: the last dim must be contiguous");
  const int64_t T = q.size(0), H = q.size(1), hd = q.size(2), KVH = k_buf.size(1);
  const int64_t vd = v_buf.size(2);
  TORCH_CHECK(k_buf.size(2) == hd && v_buf.size(1) == KVH && H % KVH == 0,
              "decode_attention: head shapes do not match");
  TORCH_CHECK(hd % 8 == 0 && vd % 8 == 0, "decode_attention: head dims must be multiples of 8");
  TORCH_CHECK(idx.dim() == 1 && idx.scalar_type() == at::kLong, "decode_attention: idx int64 [L]");
  at::Tensor ix = idx.contiguous();
  const int64_t L = ix.size(0);
  if (L > 0) {  // an index past the pool would read foreign memory
    const int64_t* ip0 = ix.data_ptr<int64_t>();
    const auto [lo, hi] = std::minmax_element(ip0, ip0 + L);
    TORCH_CHECK(*lo >= 0 && *hi < k_buf.size(0) && *hi < v_buf.size(0),
                "decode_attention: a slot index is outside the pool");
  }
  at::Tensor mk;
  const bool* mp = nullptr;
  if (mask.has_value() && mask->defined()) {
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->dim() == 2 && mask->size(0) == T &&
                    mask->size(1) == L,
                "decode_attention: mask must be bool [T, L]");
    mk = mask->contiguous();
    mp = mk.data_ptr<bool>();
  }
  at::Tensor out = at::empty({T, H, vd}, q.options());
  if (T == 0) return out;
  if (L == 0) return out.zero_();
  const int64_t G = H / KVH, R = G * T;
  Shapes s{T, H, KVH, G, hd, vd, L, R, (R + kLanes - 1) / kLanes, q.stride(0), q.stride(1), k_buf.stride(0),
           k_buf.stride(1), v_buf.stride(0), v_buf.stride(1), out.stride(0), out.stride(1),
           static_cast<float>(scale)};
  const int64_t* ip = ix.data_ptr<int64_t>();
  const bool q32 = q.scalar_type() == at::kFloat, k32 = k_buf.scalar_type() == at::kFloat;
  if (q32 && k32) {
    run<float, float>(s, q.data_ptr<float>(), k_buf.data_ptr<float>(), v_buf.data_ptr<float>(), ip, mp,
                      out.data_ptr<float>());
  } else if (q32) {
    run<float, bf16>(s, q.data_ptr<float>(), k_buf.data_ptr<bf16>(), v_buf.data_ptr<bf16>(), ip, mp,
                     out.data_ptr<float>());
  } else if (k32) {
    run<bf16, float>(s, q.data_ptr<bf16>(), k_buf.data_ptr<float>(), v_buf.data_ptr<float>(), ip, mp,
                     out.data_ptr<bf16>());
  } else {
    run<bf16, bf16>(s, q.data_ptr<bf16>(), k_buf.data_ptr<bf16>(), v_buf.data_ptr<bf16>(), ip, mp,
                    out.data_ptr<bf16>());
  }
  return out;
}

}  // namespace sgl_cpu
