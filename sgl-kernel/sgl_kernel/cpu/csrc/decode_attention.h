// What the two decode_attention paths share: shapes, the chunking (fixed: a row's result must
// not depend on the thread count) and the per-chunk partials they hand to one merge.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <limits>

namespace sgl_cpu {
namespace attn {

constexpr int64_t kChunk = 128;  // keys per work item (fixed: see decode_attention.cpp)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// exp(x) for x below this is < 2e-38: taken as 0 (the max subtracted makes x <= 0).
constexpr float kExpFloor = -87.0f;

struct Shapes {
  int64_t T, H, KVH, G, hd, vd, L;
  int64_t R, RV;               // query rows per KV head (G * T); 8-lane vectors holding them (AVX2)
  int64_t q_st, q_sh;          // q strides (token, head); last dim contiguous
  int64_t k_ss, k_sh, v_ss, v_sh;  // pool strides (slot, head)
  int64_t o_st, o_sh;
  float scale;
};

// True where the AVX512-BF16 path is compiled in (decode_attention_dp.cpp).
bool has_dp();

// "amx-bf16" (tiles: Sapphire Rapids and later, when Linux grants the state), "avx512bf16"
// (VDPBF16PS) or "avx2": the instructions decode_attention of bf16 q, K and V runs on.
const char* isa();

// The AVX512-BF16 path's partials for bf16 q, K and V: per chunk c and (KV head h, row r) at
// i = c * KVH * R + h * R + r: m[i] (max score), l[i] (sum of exp) and acc[i * vd ...] (the
// exp-weighted V sum). Same layout and meaning as the AVX2 path's.
void partials_bf16_dp(const Shapes& s, const at::BFloat16* q, const at::BFloat16* kb,
                      const at::BFloat16* vb, const int64_t* idx, const bool* mask, float* m,
                      float* l, float* acc);

}  // namespace attn
}  // namespace sgl_cpu
