// Python bindings of the CPU ops (one module for every source, see ../__init__.py).
#include <torch/extension.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("small_m_linear", &sgl_cpu::small_m_linear, "y = x @ weight^T (+ bias), W read once",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none());
  m.def("decode_attention", &sgl_cpu::decode_attention,
        "attention of a few query rows over pool slots idx (GQA, optional bool mask)",
        py::arg("q"), py::arg("k_buf"), py::arg("v_buf"), py::arg("idx"),
        py::arg("mask") = py::none(), py::arg("scale"));
  m.def("rmsnorm", &sgl_cpu::rmsnorm, "RMSNorm (HF numerics), the residual add fused",
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("residual") = py::none());
  m.def("silu_and_mul", &sgl_cpu::silu_and_mul, "silu(gate) * up of x [M, 2d]", py::arg("x"));
  m.def("linear_isa", &sgl_cpu::linear_isa,
        "the instruction set small_m_linear uses for bf16 x and bf16 W");
  m.def("attention_isa", &sgl_cpu::attention_isa,
        "the instruction set decode_attention uses for bf16 q, K and V");
  m.def("rotary_embedding", &sgl_cpu::rotary_embedding, "rotary embedding in place (rotate_half)",
        py::arg("x"), py::arg("heads"), py::arg("head_dim"), py::arg("cos"), py::arg("sin"));
}
