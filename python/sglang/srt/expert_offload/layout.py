"""Page-aligned experts: a checkpoint layout and fast-tier slots that let a load go straight
from the disk into its slot.

With the page cache dropped (`--moe-expert-drop-page-cache`), the slow tier reads experts with
O_DIRECT (sources.py). O_DIRECT needs the file offset, the length and the destination address
aligned to the disk's block size. A plain `save_file` checkpoint puts a tensor wherever the
JSON header and the tensors before it end (rarely on a page; docs/decisions.md), so every load
read the enclosing pages into a bounce buffer and moved them into the slot: a memmove per
tensor on the cores the draft and the verify need. Here:

- `save_aligned` writes a safetensors file whose data starts on a page (the header padded
  with spaces, as the format allows) and whose expert tensors come first, so each starts on
  a page when expert sizes are whole pages (SmolLM2's 1.7 MB, Qwen-MoEfied's 1.6 MB are);
- `aligned_empty` allocates slot tensors on a page boundary;
- `python -m sglang.srt.expert_offload.layout SRC_DIR DST_DIR` repacks a checkpoint
  folder this way (config, tokenizer and other files are copied as they are).

Files in any other layout still load (through the bounce buffer); nothing here changes
what a tensor holds.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import sys
from typing import Callable, Dict, List, Optional

import torch

ALIGN = 4096  # a page; a multiple of every disk's logical block size we meet
_DTYPE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8",
                torch.bool: "BOOL", torch.float64: "F64", torch.int16: "I16"}


def is_expert_tensor(name: str) -> bool:
    """Routed expert weights in every layout we load (`experts.{i}.`), not shared experts."""
    return ".experts." in name


def aligned_empty(shape, dtype: torch.dtype, align: int = ALIGN) -> torch.Tensor:
    """An uninitialised CPU tensor whose data starts on an `align`-byte boundary."""
    nbytes = math.prod(int(s) for s in shape) * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(nbytes + align, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % align
    return raw[skip : skip + nbytes].view(dtype).view(tuple(shape))


def save_aligned(tensors: Dict[str, torch.Tensor], path: str,
                 metadata: Optional[Dict[str, str]] = None,
                 first: Callable[[str], bool] = is_expert_tensor) -> None:
    """Write `tensors` as safetensors with the data section on a page and the tensors that
    `first` selects at its front (then the rest; each group by name). Readers see an
    ordinary safetensors file."""
    names = sorted(tensors, key=lambda n: (not first(n), n))
    header: Dict[str, dict] = {}
    offset = 0
    for name in names:
        t = tensors[name]
        if t.dtype not in _DTYPE_NAMES:
            raise ValueError(f"{name}: dtype {t.dtype} has no safetensors name here")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = dict(metadata)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((-(8 + len(raw))) % ALIGN)  # data begins on a page
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in names:
            t = tensors[name].detach().contiguous().cpu()
            f.write(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    os.replace(tmp, path)  # a crash never leaves a half-written checkpoint behind


def expert_misalignment(path: str) -> List[str]:
    """Expert tensors of safetensors file `path` that do not start on a page."""
    from sglang.srt.expert_offload.sources import _safetensors_offsets

    return [name for name, ((start, _), _) in _safetensors_offsets(path).items()
            if is_expert_tensor(name) and start % ALIGN]


def repack_folder(src: str, dst: str) -> List[str]:
    """Copy checkpoint folder `src` to `dst` with every safetensors file written by
    `save_aligned` (one output file per input file, names and index kept). Returns the
    expert tensors still off a page (sizes that are not whole pages)."""
    from safetensors import safe_open

    os.makedirs(dst, exist_ok=True)
    off: List[str] = []
    for entry in sorted(os.listdir(src)):
        s, d = os.path.join(src, entry), os.path.join(dst, entry)
        if not entry.endswith(".safetensors"):
            if os.path.isfile(s):
                shutil.copy2(s, d)
            continue
        with safe_open(s, framework="pt", device="cpu") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            meta = f.metadata()
        save_aligned(tensors, d, meta)
        off += expert_misalignment(d)
    return off


def main(argv: Optional[List[str]] = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Repack a safetensors checkpoint folder so its "
                                 "expert tensors start on pages (direct disk reads).")
    ap.add_argument("src")
    ap.add_argument("dst")
    args = ap.parse_args(argv)
    if os.path.abspath(args.src) == os.path.abspath(args.dst):
        ap.error("DST must differ from SRC")
    off = repack_folder(args.src, args.dst)
    print(f"wrote {args.dst}; expert tensors off a page: {len(off)}"
          + (f" (e.g. {off[0]}: sizes not whole pages)" if off else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
