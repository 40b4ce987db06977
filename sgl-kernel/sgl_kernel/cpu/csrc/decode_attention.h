// What the two decode_attention paths share: shapes, the chunking (fixed: a row's result must
// not depend on the thread count) and the per-chunk partials they hand to one merge.
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
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

// True when some row of the mask hides a key of the chunk [c0, c0 + n): most chunks are seen
// whole by every row (only a verify's own tokens are masked), and skip the per-lane masking.
inline bool chunk_masked(const Shapes& s, const bool* mask, int64_t c0, int64_t n) {
  for (int64_t t = 0; mask != nullptr && t < s.T; ++t)
    if (std::memchr(mask + t * s.L + c0, 0, n) != nullptr) return true;  // a bool is one byte
  return false;
}

template <typename T>
inline void prefetch_row(const T* row, int64_t dim) {  // into L2
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t o = 0; o < dim * int64_t(sizeof(T)); o += 64) _mm_prefetch(p + o, _MM_HINT_T1);
}

// The rows are scattered (idx), so the hardware prefetchers miss them and a row read on demand
// waits on DRAM: head h's K and V rows of the next chunk's keys [j0, j1) (of next_n) are
// fetched into L2 while this chunk computes, a few per block to keep the miss queues from
// filling.
template <typename KT>
inline void prefetch_next(const Shapes& s, const KT* kb, const KT* vb, const int64_t* next_idx,
                          int64_t next_n, int64_t j0, int64_t j1, int64_t h) {
  for (int64_t j = j0; j < std::min(j1, next_n); ++j) {
    prefetch_row(kb + next_idx[j] * s.k_ss + h * s.k_sh, s.hd);
    prefetch_row(vb + next_idx[j] * s.v_ss + h * s.v_sh, s.vd);
  }
}

// body(w, c, c0, c1, next_n) for every chunk c (keys [c0, c1)) across threads; w = make() is
// the thread's scratch, next_n the key count of the thread's next chunk (0 at the end of its
// range: nothing to prefetch).
template <typename Make, typename Body>
void for_each_chunk(const Shapes& s, Make make, Body body) {
  const int64_t nchunks = (s.L + kChunk - 1) / kChunk;
  at::parallel_for(0, nchunks, 1, [&](int64_t b, int64_t e) {
    auto w = make();
    for (int64_t c = b; c < e; ++c) {
      const int64_t c0 = c * kChunk, c1 = std::min(s.L, c0 + kChunk);
      body(w, c, c0, c1, c + 1 < e ? std::min(s.L, c1 + kChunk) - c1 : 0);
    }
  });
}

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
