// The CPU ops of sgl_kernel, bound to Python in bindings.cpp.
#pragma once

#include <torch/extension.h>

namespace sgl_cpu {

// y = x @ weight^T (+ bias) for few rows of x, the weight read from DRAM once per call.
at::Tensor small_m_linear(const at::Tensor& x, const at::Tensor& weight,
                          const c10::optional<at::Tensor>& bias);

// Attention of q [T, H, hd] over the pool rows k_buf[idx], v_buf[idx] (grouped-query heads),
// with an optional bool mask [T, L]; returns [T, H, vd] in q's dtype.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                            const at::Tensor& idx, const c10::optional<at::Tensor>& mask,
                            double scale);

}  // namespace sgl_cpu
