// The CPU ops of sgl_kernel, bound to Python in bindings.cpp.
#pragma once

#include <torch/extension.h>

namespace sgl_cpu {

// y = x @ weight^T (+ bias) for few rows of x, the weight read from DRAM once per call.
at::Tensor small_m_linear(const at::Tensor& x, const at::Tensor& weight,
                          const c10::optional<at::Tensor>& bias);

// "avx512bf16" where bf16 x times bf16 W runs on VDPBF16PS, else "avx2".
std::string linear_isa();

// Attention of q [T, H, hd] over the pool rows k_buf[idx], v_buf[idx] (grouped-query heads),
// with an optional bool mask [T, L]; returns [T, H, vd] in q's dtype.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                            const at::Tensor& idx, const c10::optional<at::Tensor>& mask,
                            double scale);

// What decode_attention of bf16 q, K and V runs on: "amx-bf16", "avx512bf16" or "avx2".
std::string attention_isa();

// RMSNorm of x [M, D] (HF numerics); with a residual, of x + residual, returning
// [normed, x + residual] (else [normed]).
std::vector<at::Tensor> rmsnorm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                const c10::optional<at::Tensor>& residual);

// silu(x[:, :d]) * x[:, d:] for x [M, 2d] -> [M, d].
at::Tensor silu_and_mul(const at::Tensor& x);

// Rotary embedding in place on x [T, heads * head_dim] (rows may be strided), HF's
// rotate_half layout over the first cos.size(1) dims of each head.
void rotary_embedding(at::Tensor& x, int64_t heads, int64_t head_dim, const at::Tensor& cos,
                      const at::Tensor& sin);

}  // namespace sgl_cpu
