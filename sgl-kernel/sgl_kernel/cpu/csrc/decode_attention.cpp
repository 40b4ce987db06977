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
// Work item = a chunk of kChunk keys (all KV heads); a chunk's max, sum and weighted V sum are
// merged by log-sum-exp in chunk order. Invariant: a row's result depends only on its own
// query, its mask row and the keys, never on the other rows or the thread count (chunk
// boundaries are fixed), so a verify row equals the decode row at the same position when
// the masks select the same keys in the same chunks. Masked keys contribute exactly 0.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace {

using bf16 = at::BFloat16;
namespace vec = sgl_cpu::vec;
using vec::hsum;

constexpr int64_t kChunk = 128;   // keys per work item (fixed: see the invariant above)
constexpr int64_t kRowBlock = 32;  // query rows whose scores sit in L1 together
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// exp(x) for x below this is < 2e-38: taken as 0 (the max subtracted makes x <= 0).
constexpr float kExpFloor = -87.0f;

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

struct Shapes {
  int64_t T, H, KVH, G, hd, vd, L;
  int64_t q_st, q_sh;          // q strides (token, head); last dim contiguous
  int64_t k_ss, k_sh, v_ss, v_sh;  // pool strides (slot, head)
  int64_t o_st, o_sh;
  float scale;
};

// Scratch of one thread, reused across its work items.
struct Scratch {
  std::vector<float> qf, sc, zero, kf, vf;  // kf / vf: a chunk's K / V rows widened to fp32
  std::vector<const float*> kp, vp;         // this head's K / V row of each key of the chunk
  Scratch(int64_t hd, int64_t vd, bool widen)
      : qf(kRowBlock * hd), sc(kRowBlock * kChunk), zero(hd, 0.0f),
        kf(widen ? kChunk * hd : 0), vf(widen ? kChunk * vd : 0), kp(kChunk), vp(kChunk) {}
};

inline void rows_of(const float* pool, int64_t ss, int64_t sh, const int64_t* idx, int64_t n,
                    int64_t h, int64_t, float*, const float** out) {
  for (int64_t j = 0; j < n; ++j) out[j] = pool + idx[j] * ss + h * sh;  // read in place
}

inline void rows_of(const bf16* pool, int64_t ss, int64_t sh, const int64_t* idx, int64_t n,
                    int64_t h, int64_t dim, float* buf, const float** out) {
  for (int64_t j = 0; j < n; ++j) {  // widened once, then shared by every query row
    const bf16* src = pool + idx[j] * ss + h * sh;
    float* dst = buf + j * dim;
    for (int64_t d = 0; d < dim; d += 8) _mm256_storeu_ps(dst + d, load8(src + d));
    out[j] = dst;
  }
}

// Scores of one query row (pre-scaled) against 8 keys: 8 independent FMA chains (one chain
// per dot would wait on FMA latency), reduced by one transpose-add.
inline __m256 dot8(const float* qr, const float* const* kr, int64_t hd) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int64_t d = 0; d < hd; d += 8) {
    const __m256 qv = _mm256_loadu_ps(qr + d);
    a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[0] + d), a0);
    a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[1] + d), a1);
    a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[2] + d), a2);
    a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[3] + d), a3);
    a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[4] + d), a4);
    a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[5] + d), a5);
    a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[6] + d), a6);
    a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[7] + d), a7);
  }
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// acc[0:vd] = sum_j p[j] * v[j][0:vd] in key order, skipping p == 0 (exactly nothing). 64
// columns at a time stay in registers; every element is summed in the same order either way.
inline void weighted_v(const float* p, const float* const* v, int64_t n, int64_t vd, float* acc) {
  int64_t d0 = 0;
  for (; d0 + 64 <= vd; d0 += 64) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t j = 0; j < n; ++j) {
      if (p[j] == 0.0f) continue;
      const __m256 pv = _mm256_set1_ps(p[j]);
      const float* vr = v[j] + d0;
      a0 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vr), a0);
      a1 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vr + 8), a1);
      a2 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vr + 16), a2);
      a3 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vr + 24), a3);
      a4 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vr + 32), a4);
      a5 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vr + 40), a5);
      a6 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vr + 48), a6);
      a7 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vr + 56), a7);
    }
    float* o = acc + d0;
    _mm256_storeu_ps(o, a0), _mm256_storeu_ps(o + 8, a1), _mm256_storeu_ps(o + 16, a2);
    _mm256_storeu_ps(o + 24, a3), _mm256_storeu_ps(o + 32, a4), _mm256_storeu_ps(o + 40, a5);
    _mm256_storeu_ps(o + 48, a6), _mm256_storeu_ps(o + 56, a7);
  }
  for (; d0 < vd; d0 += 8) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j)
      if (p[j] != 0.0f) a = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(v[j] + d0), a);
    _mm256_storeu_ps(acc + d0, a);
  }
}

// One work item: keys [c0, c1), every KV head (a contiguous run of slots is then read as
// one stream). Writes per (head, row) of the G * T rows of each head: m (max score), l (sum
// of exp) and acc (exp-weighted V sum, vd floats), at [h * rows + r].
template <typename QT, typename KT>
void chunk_partials(const Shapes& s, const QT* q, const KT* kb, const KT* vb, const int64_t* idx,
                    const bool* mask, int64_t c0, int64_t c1, Scratch& w,
                    float* m_out, float* l_out, float* acc_out) {
  const int64_t n = c1 - c0, rows = s.G * s.T, hd = s.hd, vd = s.vd;
  // keys are scored 8 at a time; a short last block scores a zero row, so every key is
  // summed in the same order wherever it falls
  const int64_t n8 = (n + 7) / 8 * 8;
  float* qf = w.qf.data();
  const float** kp = w.kp.data();
  const float** vp = w.vp.data();
  for (int64_t h = 0; h < s.KVH; ++h) {
    rows_of(kb, s.k_ss, s.k_sh, idx + c0, n, h, hd, w.kf.data(), kp);
    rows_of(vb, s.v_ss, s.v_sh, idx + c0, n, h, vd, w.vf.data(), vp);
    for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
      const int64_t nr = std::min(kRowBlock, rows - r0);
      for (int64_t i = 0; i < nr; ++i) {  // row r = t * G + g reads query head h * G + g
        const int64_t r = r0 + i, t = r / s.G, g = r % s.G;
        const QT* src = q + t * s.q_st + (h * s.G + g) * s.q_sh;
        for (int64_t d = 0; d < hd; d += 8)
          _mm256_storeu_ps(qf + i * hd + d, _mm256_mul_ps(load8(src + d), _mm256_set1_ps(s.scale)));
      }
      for (int64_t j0 = 0; j0 < n8; j0 += 8) {
        const float* kr[8];
        for (int u = 0; u < 8; ++u) kr[u] = j0 + u < n ? kp[j0 + u] : w.zero.data();
        for (int64_t i = 0; i < nr; ++i) {  // the 8 key rows stay in L1 across the rows
          float* dst = w.sc.data() + i * kChunk + j0;
          _mm256_storeu_ps(dst, dot8(qf + i * hd, kr, hd));
          const bool* mrow = mask == nullptr ? nullptr : mask + ((r0 + i) / s.G) * s.L + c0;
          for (int u = 0; u < 8; ++u)  // masked keys and the padding score -inf
            if (j0 + u >= n || (mrow != nullptr && !mrow[j0 + u])) dst[u] = kNegInf;
        }
      }
      for (int64_t i = 0; i < nr; ++i) {
        const int64_t r = h * rows + r0 + i;
        float* srow = w.sc.data() + i * kChunk;
        __m256 mx8 = _mm256_set1_ps(kNegInf);
        for (int64_t j = 0; j < n8; j += 8) mx8 = _mm256_max_ps(mx8, _mm256_loadu_ps(srow + j));
        alignas(32) float mx[8];
        _mm256_store_ps(mx, mx8);
        const float m = *std::max_element(mx, mx + 8);
        m_out[r] = m;
        if (m == kNegInf) {  // this row sees no key of this chunk
          l_out[r] = 0.0f;
          std::fill(acc_out + r * vd, acc_out + (r + 1) * vd, 0.0f);
          continue;
        }
        const __m256 mv = _mm256_set1_ps(m);
        __m256 lsum = _mm256_setzero_ps();
        for (int64_t j = 0; j < n8; j += 8) {  // padding and masked lanes give exactly 0
          __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(srow + j), mv));
          _mm256_storeu_ps(srow + j, p);
          lsum = _mm256_add_ps(lsum, p);
        }
        l_out[r] = hsum(lsum);
        weighted_v(srow, vp, n, vd, acc_out + r * vd);
      }
    }
  }
}

template <typename QT, typename KT>
void run(const Shapes& s, const QT* q, const KT* kb, const KT* vb, const int64_t* idx,
         const bool* mask, QT* out) {
  const int64_t nchunks = (s.L + kChunk - 1) / kChunk, rows = s.G * s.T;
  const int64_t per = s.KVH * rows;  // partials per chunk
  std::vector<float> m(nchunks * per), l(nchunks * per), acc(nchunks * per * s.vd);
  at::parallel_for(0, nchunks, 1, [&](int64_t b, int64_t e) {
    Scratch w(s.hd, s.vd, !std::is_same<KT, float>::value);
    for (int64_t c = b; c < e; ++c) {
      const int64_t c0 = c * kChunk, c1 = std::min(s.L, c0 + kChunk);
      chunk_partials(s, q, kb, vb, idx, mask, c0, c1, w, m.data() + c * per, l.data() + c * per,
                     acc.data() + c * per * s.vd);
    }
  });
  // merge the chunks of each (head, row) in chunk order
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
          const float* a = acc.data() + (c * per + hr) * s.vd;
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

}  // namespace

namespace sgl_cpu {

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
  Shapes s{T, H, KVH, H / KVH, hd, vd, L, q.stride(0), q.stride(1), k_buf.stride(0),
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
