"""sgl_kernel: kernels for the engine, each beside a torch reference.

Only the torch references live here for now; Triton kernels (paged decode attention,
tree-verify attention, fused MoE) join with the GPU work and are tested against these.
"""

from sgl_kernel.reference import paged_attention_reference

__all__ = ["paged_attention_reference"]
