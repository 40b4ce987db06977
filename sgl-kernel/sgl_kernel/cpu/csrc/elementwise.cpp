// The small per-token ops of a decoder layer, each one pass over its rows: RMSNorm with the
// residual add fused, rotary embedding in place on q and k, and silu(gate) * up.
//
// Why: at decode time a layer's norms, rotary and activation are ~40 tiny torch ops
// (casts, pow, mean, rsqrt, cat, neg, slices, ...); their dispatch cost was ~14 ms of a
// 55 ms decode step of Qwen2.5-0.5B (24 layers), more than attention at 4K context.
//
// Numerics follow the torch code they replace (which follows Hugging Face), rounding to the
// model dtype wherever torch's ops do: the residual sum, the normalised row, each rotary
// product and the sum, silu's result and the product with up. Float contraction into FMAs
// is off in this file, so float32 rotary is bit-identical to torch's; RMSNorm's mean of
// squares and silu's exp differ from torch's only in the last bits (summation order,
// exp polynomial). Rows are independent (a verify row equals the decode row bit for bit).
#pragma GCC optimize("fp-contract=off")

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "ops.h"
#include "vec.h"

namespace {

using bf16 = at::BFloat16;
namespace vec = sgl_cpu::vec;


// Rows per thread below which another thread costs more than it saves (~32K elements).
constexpr int64_t kMinElemsPerThread = 1 << 15;

template <typename T>
inline T to_t(float v);
template <>
inline float to_t<float>(float v) { return v; }
template <>
inline bf16 to_t<bf16>(float v) { return bf16(v); }  // round to nearest even, as torch

// Value after rounding to T (what torch's op in dtype T would store), kept as float.
template <typename T>
inline float rnd(float v) { return vec::to_f32(to_t<T>(v)); }

inline int64_t grain_rows(int64_t width) {
  return std::max<int64_t>(1, kMinElemsPerThread / std::max<int64_t>(width, 1));
}

// e^x for 8 lanes over the whole float range: x clamped to [-87, 88] (e^88 < FLT_MAX).
inline __m256 exp8(__m256 x) {
  return vec::exp8_in_range(
      _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f)));
}

// 8 lanes of T as fp32, and back. bf16 rounds to nearest even with NaN -> 0x7fc0 in integer
// ops, exactly as c10::BFloat16(float) (VCVTNEPS2BF16 would flush denormals to zero). The
// element-wise conversions were most of these ops' time: silu_and_mul of 10 rows of
// Qwen2.5-0.5B took 107 us.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256i bf16_bits(__m256 v) {  // in the low half of each 32-bit lane
  const __m256i b = _mm256_castps_si256(v);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1)),
                                        _mm256_set1_epi32(0x7fff));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, bias), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(bf16* p, __m256 v) {
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_bits(v), bf16_bits(v)), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
// rnd<T> on 8 lanes
template <typename T>
inline __m256 rnd8(__m256 v) {
  if constexpr (std::is_same<T, float>::value) {
    return v;
  } else {
    return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v), 16));
  }
}

template <typename T>
void rmsnorm_rows(const T* x, int64_t ldx, const T* res, int64_t ldr, const T* w, float eps,
                  int64_t M, int64_t D, T* out, T* sum_out) {
  at::parallel_for(0, M, grain_rows(D), [&](int64_t m0, int64_t m1) {
    std::vector<float> s(D);
    for (int64_t m = m0; m < m1; ++m) {
      const T* xr = x + m * ldx;
      if (res != nullptr) {  // torch: x + residual in the model dtype
        const T* rr = res + m * ldr;
        T* sr = sum_out + m * D;
        int64_t i = 0;
        for (; i + 8 <= D; i += 8) {
          const __m256 v = rnd8<T>(_mm256_add_ps(load8(xr + i), load8(rr + i)));
          store8(sr + i, v);
          _mm256_storeu_ps(s.data() + i, v);
        }
        for (; i < D; ++i) {
          const T v = to_t<T>(vec::to_f32(xr[i]) + vec::to_f32(rr[i]));
          sr[i] = v;
          s[i] = vec::to_f32(v);
        }
      } else {
        int64_t i = 0;
        for (; i + 8 <= D; i += 8) _mm256_storeu_ps(s.data() + i, load8(xr + i));
        for (; i < D; ++i) s[i] = vec::to_f32(xr[i]);
      }
      // The mean of squares accumulated in double: close to exact, so it lands within an ulp
      // of torch's (pairwise) float sum; a plain float sum of 1.5K squares was off by several.
      __m256d acc0 = _mm256_setzero_pd(), acc1 = acc0;
      int64_t i = 0;
      for (; i + 8 <= D; i += 8) {
        const __m256 v = _mm256_loadu_ps(s.data() + i);
        const __m256 sq = _mm256_mul_ps(v, v);  // squares rounded to float, as torch's pow(2)
        acc0 = _mm256_add_pd(acc0, _mm256_cvtps_pd(_mm256_castps256_ps128(sq)));
        acc1 = _mm256_add_pd(acc1, _mm256_cvtps_pd(_mm256_extractf128_ps(sq, 1)));
      }
      alignas(32) double part[4];
      _mm256_store_pd(part, _mm256_add_pd(acc0, acc1));
      double ssd = (part[0] + part[1]) + (part[2] + part[3]);
      for (; i < D; ++i) ssd += static_cast<double>(s[i] * s[i]);
      const float ss = static_cast<float>(ssd);
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
      T* o = out + m * D;
      // torch: weight * (x * rsqrt(...)).to(dtype), the product in the model dtype
      const __m256 inv8 = _mm256_set1_ps(inv);
      int64_t j = 0;
      for (; j + 8 <= D; j += 8)
        store8(o + j, _mm256_mul_ps(load8(w + j), rnd8<T>(_mm256_mul_ps(_mm256_loadu_ps(s.data() + j), inv8))));
      for (; j < D; ++j) o[j] = to_t<T>(vec::to_f32(w[j]) * rnd<T>(s[j] * inv));
    }
  });
}

template <typename T>
void silu_mul_rows(const T* x, int64_t ldx, int64_t M, int64_t d, T* out) {
  at::parallel_for(0, M, grain_rows(2 * d), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const T* g = x + m * ldx;
      const T* u = g + d;
      T* o = out + m * d;
      int64_t j = 0;
      for (; j + 8 <= d; j += 8) {
        const __m256 gx = load8(g + j);
        // silu(g) = g / (1 + e^-g), rounded to the model dtype as torch's silu stores it
        const __m256 sl = _mm256_div_ps(gx, _mm256_add_ps(_mm256_set1_ps(1.0f),
                                                          exp8(_mm256_sub_ps(_mm256_setzero_ps(), gx))));
        store8(o + j, _mm256_mul_ps(rnd8<T>(sl), load8(u + j)));
      }
      for (; j < d; ++j) {
        const float gv = vec::to_f32(g[j]);
        o[j] = to_t<T>(rnd<T>(gv / (1.0f + std::exp(-gv))) * vec::to_f32(u[j]));
      }
    }
  });
}

// x [T, heads * hd] (row stride ldx) rotated in place, HF's rotate_half layout: for j < h
// (h = rot / 2): x[j] * cos[j] - x[j + h] * sin[j]; for h <= j < rot: x[j] * cos[j] +
// x[j - h] * sin[j]; dims from rot on pass through. Each product and the sum round to T.
template <typename T>
void rope_rows(T* x, int64_t ldx, int64_t heads, int64_t hd, const T* cos, const T* sin,
               int64_t ldc, int64_t rot, int64_t Tn) {
  const int64_t h = rot / 2;
  at::parallel_for(0, Tn, grain_rows(heads * hd), [&](int64_t t0, int64_t t1) {
    std::vector<float> a(h), b(h);
    for (int64_t t = t0; t < t1; ++t) {
      const T* c = cos + t * ldc;
      const T* s = sin + t * ldc;
      for (int64_t head = 0; head < heads; ++head) {
        T* xr = x + t * ldx + head * hd;
        for (int64_t j = 0; j < h; ++j) a[j] = vec::to_f32(xr[j]), b[j] = vec::to_f32(xr[j + h]);
        for (int64_t j = 0; j < h; ++j) {
          xr[j] = to_t<T>(rnd<T>(a[j] * vec::to_f32(c[j])) - rnd<T>(b[j] * vec::to_f32(s[j])));
          xr[j + h] = to_t<T>(rnd<T>(b[j] * vec::to_f32(c[j + h])) + rnd<T>(a[j] * vec::to_f32(s[j + h])));
        }
      }
    }
  });
}

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, ": CPU tensors only");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, what,
              ": float32 or bfloat16 only");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, what, ": a 2-D tensor with contiguous rows");
}

}  // namespace

namespace sgl_cpu {

std::vector<at::Tensor> rmsnorm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                const c10::optional<at::Tensor>& residual) {
  check_rows(x, "rmsnorm");
  const int64_t M = x.size(0), D = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == D && weight.scalar_type() == x.scalar_type(),
              "rmsnorm: weight must be [D] in x's dtype");
  at::Tensor w = weight.contiguous();
  at::Tensor out = at::empty({M, D}, x.options());
  at::Tensor sum;
  const bool has_res = residual.has_value() && residual->defined();
  if (has_res) {
    check_rows(*residual, "rmsnorm residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "rmsnorm: residual must match x");
    sum = at::empty({M, D}, x.options());
  }
  if (M == 0) return has_res ? std::vector<at::Tensor>{out, sum} : std::vector<at::Tensor>{out};
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == at::kFloat) {
    rmsnorm_rows<float>(x.data_ptr<float>(), x.stride(0),
                        has_res ? residual->data_ptr<float>() : nullptr,
                        has_res ? residual->stride(0) : 0, w.data_ptr<float>(), e, M, D,
                        out.data_ptr<float>(), has_res ? sum.data_ptr<float>() : nullptr);
  } else {
    rmsnorm_rows<bf16>(x.data_ptr<bf16>(), x.stride(0),
                       has_res ? residual->data_ptr<bf16>() : nullptr,
                       has_res ? residual->stride(0) : 0, w.data_ptr<bf16>(), e, M, D,
                       out.data_ptr<bf16>(), has_res ? sum.data_ptr<bf16>() : nullptr);
  }
  return has_res ? std::vector<at::Tensor>{out, sum} : std::vector<at::Tensor>{out};
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "silu_and_mul");
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_and_mul: the last dim must be even (gate, up)");
  const int64_t M = x.size(0), d = x.size(1) / 2;
  at::Tensor out = at::empty({M, d}, x.options());
  if (M == 0 || d == 0) return out;
  if (x.scalar_type() == at::kFloat) {
    silu_mul_rows<float>(x.data_ptr<float>(), x.stride(0), M, d, out.data_ptr<float>());
  } else {
    silu_mul_rows<bf16>(x.data_ptr<bf16>(), x.stride(0), M, d, out.data_ptr<bf16>());
  }
  return out;
}

void rotary_embedding(at::Tensor& x, int64_t heads, int64_t head_dim, const at::Tensor& cos,
                      const at::Tensor& sin) {
  check_rows(x, "rotary_embedding");
  check_rows(cos, "rotary_embedding cos");
  check_rows(sin, "rotary_embedding sin");
  const int64_t Tn = x.size(0), rot = cos.size(1);
  TORCH_CHECK(x.size(1) == heads * head_dim, "rotary_embedding: x must be [T, heads * head_dim]");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == Tn && rot % 2 == 0 && rot <= head_dim
                  && cos.stride(0) == sin.stride(0),
              "rotary_embedding: cos and sin must be [T, rot] with an even rot <= head_dim");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rotary_embedding: cos / sin must be in x's dtype");
  if (Tn == 0) return;
  if (x.scalar_type() == at::kFloat) {
    rope_rows<float>(x.data_ptr<float>(), x.stride(0), heads, head_dim, cos.data_ptr<float>(),
                     sin.data_ptr<float>(), cos.stride(0), rot, Tn);
  } else {
    rope_rows<bf16>(x.data_ptr<bf16>(), x.stride(0), heads, head_dim, cos.data_ptr<bf16>(),
                    sin.data_ptr<bf16>(), cos.stride(0), rot, Tn);
  }
}

}  // namespace sgl_cpu
