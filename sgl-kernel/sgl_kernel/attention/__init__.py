"""Attention kernels in Triton, each tested against a torch reference in
`sgl_kernel.reference`:

- `decode_attention`: one query per request over a KV slot list, split-K (decode.py);
- `extend_attention`: many queries per request, causal or custom (tree) mask (extend.py),
  with `pack_custom_masks` turning per-request bool masks into its packed form;
- `gather_kv_indices`: requests' req_to_token rows flattened into one slot list (kv_indices.py);
- `build_tree_mask`: ancestor masks of draft trees in that packed form (spec_ops.py);
- `move_kv_slots`: KV compaction, rows src -> dst in every layer in one launch (spec_ops.py).

`python -m sgl_kernel.attention.compile_check [--all]` compiles every kernel for sm_90 with
the launch configuration a GPU run uses, without a GPU (test_triton_attention runs it).

Importing this package does not import triton; each name imports its module on first use.
On CPU the kernels run only under Triton's interpreter (TRITON_INTERPRET=1 set before the
process first imports triton), which is for tests: it is slow.
"""

from __future__ import annotations

import importlib

_WHERE = {
    "decode_attention": "decode",
    "default_num_kv_splits": "decode",
    "extend_attention": "extend",
    "pack_custom_masks": "extend",
    "gather_kv_indices": "kv_indices",
    "build_tree_mask": "spec_ops",
    "move_kv_slots": "spec_ops",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'sgl_kernel.attention' has no attribute {name!r}")
    module = importlib.import_module(f"sgl_kernel.attention.{_WHERE[name]}")
    return getattr(module, name)
