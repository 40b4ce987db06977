"""The slow tier of the expert store: where every expert's weights always live.

`SafetensorsExpertSource` reads experts from the checkpoint's memory-mapped safetensors
files (`safe_open(framework="pt")` gives tensors backed by the mapping, so an expert costs
RAM only while its pages are cached). With `drop_page_cache`, the pages of an expert are
dropped after each load (`madvise(MADV_DONTNEED)` on our mapping, then
`posix_fadvise(POSIX_FADV_DONTNEED)` on the file), so the next load of it is a real disk
read: the situation of an MoE larger than RAM.

On a GPU the store reads through `staging.PinnedStagingSource` (a few pinned buffers, then
asynchronous host-to-device copies).
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import struct
import threading
from typing import Dict, List, Optional, Protocol, Tuple

import torch

# (layer, expert) -> checkpoint names of its (gate, up, down) projection weights
ExpertKeys = Dict[Tuple[int, int], Tuple[str, str, str]]

_MADV_RANDOM, _MADV_WILLNEED, _MADV_DONTNEED = 1, 3, 4
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class ExpertSource(Protocol):
    def read_into(self, layer: int, expert: int, w13: torch.Tensor, w2: torch.Tensor) -> int:
        """Copy the expert into w13 [2I, H] (gate rows, then up rows) and w2 [H, I]; returns
        the bytes read from the slow tier."""


_SERIAL_CHUNK = 16384  # elements: below ATen's grain size, so a copy_ stays single-threaded


def copy_serial(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) (dtype converts) without ATen's OpenMP parallelism.

    Loads run on the store's background thread; a torch op that opens an OpenMP parallel
    region there leaves that thread its own OpenMP team, which then competes with the
    forward's threads for the cores for as long as the process lives (docs/decisions.md). A
    plain memmove (same dtype, CPU) or copies in chunks below the grain size (conversion)
    never open a region."""
    if src.dtype == dst.dtype and src.is_contiguous() and dst.is_contiguous() \
            and src.device.type == dst.device.type == "cpu":
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())
        return
    d, s = dst.view(-1), src.reshape(-1)
    for i in range(0, d.numel(), _SERIAL_CHUNK):
        d[i : i + _SERIAL_CHUNK].copy_(s[i : i + _SERIAL_CHUNK])


_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _safetensors_offsets(path: str) -> Dict[str, Tuple[Tuple[int, int], tuple]]:
    """name -> ((start, end) byte range in the file, (dtype, shape)) (format: u64 header
    length, then a JSON header)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    base = 8 + n
    return {k: ((base + v["data_offsets"][0], base + v["data_offsets"][1]),
                (_ST_DTYPES.get(v["dtype"]), tuple(v["shape"])))
            for k, v in header.items() if k != "__metadata__"}


class SafetensorsExpertSource:
    """Experts of an HF checkpoint folder (one file or shards with an index)."""

    def __init__(self, folder: str, keys: ExpertKeys, drop_page_cache: bool = False) -> None:
        from safetensors import safe_open

        from sglang.srt.utils.checkpoint_files import safetensors_files

        self.keys = keys
        self.drop_page_cache = drop_page_cache
        self._handles: List = []
        self._where: Dict[str, Tuple[int, Tuple[int, int]]] = {}  # name -> (file, byte range)
        self._fds: List[int] = []
        self._dtypes: Dict[str, tuple] = {}  # name -> (dtype, shape) on disk
        for i, path in enumerate(safetensors_files(folder)):
            self._handles.append(safe_open(path, framework="pt", device="cpu"))
            self._fds.append(os.open(path, os.O_RDONLY))
            for name, (rng, dtype) in _safetensors_offsets(path).items():
                self._where[name] = (i, rng)
                self._dtypes[name] = dtype
        missing = [n for names in keys.values() for n in names if n not in self._where]
        if missing:
            raise KeyError(f"checkpoint in {folder} lacks expert tensors, e.g. {missing[:3]}")
        self._libc = ctypes.CDLL(None, use_errno=True) if drop_page_cache else None
        # With the page cache out of the picture, reads go around it (O_DIRECT): the disk
        # writes into an aligned buffer and one memmove places the tensor. A buffered read
        # (page allocation, copy, then the drop) costs several times the CPU, which a
        # prefetch's loads take from the draft's forwards (docs/decisions.md). None where the
        # file system refuses O_DIRECT.
        self._direct_fds: Optional[List[int]] = None
        self._bounce = threading.local()  # per loader thread: an aligned read buffer
        # tensors read with O_DIRECT straight into their slot / through the bounce buffer
        self.reads = {"direct": 0, "bounced": 0}
        self._reads_lock = threading.Lock()
        if drop_page_cache and hasattr(os, "O_DIRECT"):
            try:
                self._direct_fds = [os.open(p, os.O_RDONLY | os.O_DIRECT)
                                    for p in safetensors_files(folder)]
            except OSError:
                self._direct_fds = None
        if drop_page_cache:
            # No readahead on the mappings: it would pull neighbouring experts into the page
            # cache, and their next loads would not be disk reads. Loads ask for exactly
            # their bytes instead (MADV_WILLNEED), which the kernel reads in large requests.
            for i, path in enumerate(safetensors_files(folder)):
                name = next((n for n, (f, _) in self._where.items() if f == i), None)
                if name is not None:
                    base = self._tensor(name).data_ptr() - self._where[name][1][0]
                    self._madvise(base, os.path.getsize(path), _MADV_RANDOM)

    def _tensor(self, name: str) -> torch.Tensor:
        return self._handles[self._where[name][0]].get_tensor(name)  # a view of the mapping

    def read_into(self, layer: int, expert: int, w13: torch.Tensor, w2: torch.Tensor) -> int:
        gate_name, up_name, down_name = self.keys[(layer, expert)]
        inter = w13.shape[0] // 2
        total = 0
        for name, dst in ((gate_name, w13[:inter]), (up_name, w13[inter:]), (down_name, w2)):
            if self._pread_into(name, dst):
                total += dst.numel() * dst.element_size()
                continue
            src = self._tensor(name)
            if self.drop_page_cache:
                self._madvise(src.data_ptr(), src.numel() * src.element_size(), _MADV_WILLNEED)
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != slot {tuple(dst.shape)}")
            copy_serial(dst, src)  # page faults read the file here
            total += src.numel() * src.element_size()
            if self.drop_page_cache:
                self._drop(name, src)
        return total

    def _pread_into(self, name: str, dst: torch.Tensor) -> bool:
        """Read tensor `name` straight from the file into `dst` (one syscall, no page faults
        on the mapping; the GIL is released while the disk works). Only when no conversion
        is needed: same dtype, same size, a contiguous CPU destination."""
        file_idx, (start, end) = self._where[name]
        nbytes = dst.numel() * dst.element_size()
        if (dst.device.type != "cpu" or not dst.is_contiguous() or end - start != nbytes
                or self._dtypes.get(name) != (dst.dtype, tuple(dst.shape))):
            return False
        if self._direct_fds is not None and self._read_direct(file_idx, start, end, dst):
            return True
        buf = (ctypes.c_char * nbytes).from_address(dst.data_ptr())
        fd, done = self._fds[file_idx], 0
        view = memoryview(buf).cast("B")
        while done < nbytes:
            n = os.preadv(fd, [view[done:]], start + done)
            if n <= 0:
                raise OSError(f"short read of {name} from the checkpoint")
            done += n
        if self.drop_page_cache:
            os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)
        return True

    def _read_direct(self, file_idx: int, start: int, end: int, dst: torch.Tensor) -> bool:
        """Bytes [start, end) of the file into `dst` through O_DIRECT: straight into `dst`
        where both are page-aligned, else the enclosing page-aligned span into this thread's
        page-aligned buffer, then a memmove. False (and buffered reads from then on) where
        the file system refuses it."""
        nbytes = end - start
        if start % _PAGE == 0 and nbytes % _PAGE == 0 and dst.data_ptr() % _PAGE == 0:
            # an aligned tensor into an aligned slot (layout.py): the disk writes the
            # slot itself, no bounce buffer and no memmove on the cores
            out = (ctypes.c_char * nbytes).from_address(dst.data_ptr())
            return self._count("direct", self._pread_direct(file_idx, start,
                                                            memoryview(out).cast("B")))
        lo = start - start % _PAGE
        span = end - lo + (-(end - lo)) % _PAGE
        buf = getattr(self._bounce, "buf", None)
        if buf is None or len(buf) < span:
            if buf is not None:
                buf.close()
            buf = mmap.mmap(-1, span)  # anonymous mappings are page-aligned
            self._bounce.buf = buf
        if not self._pread_direct(file_idx, lo, memoryview(buf)[:span], end):
            return False
        base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        ctypes.memmove(dst.data_ptr(), base + (start - lo), end - start)
        return self._count("bounced", True)

    def _count(self, how: str, done: bool) -> bool:
        if done:
            with self._reads_lock:
                self.reads[how] += 1
        return done

    def _pread_direct(self, file_idx: int, lo: int, view: memoryview,
                      end: Optional[int] = None) -> bool:
        """O_DIRECT read of file bytes [lo, end) (default: the view's length) into the
        page-aligned `view`. False (and buffered reads from then on) where the file system
        refuses O_DIRECT."""
        end = lo + len(view) if end is None else end
        fd, done = self._direct_fds[file_idx], 0
        try:
            while lo + done < end:
                n = os.preadv(fd, [view[done:]], lo + done)
                if n <= 0:  # the file ends inside the last page: done short of the view
                    break
                done += n
        except OSError:  # e.g. EINVAL: this file system takes no O_DIRECT
            fds, self._direct_fds = self._direct_fds, None
            for d in fds or []:
                os.close(d)
            return False
        finally:
            view.release()
        if lo + done < end:
            raise OSError("short read of an expert from the checkpoint")
        return True

    def _drop(self, name: str, mapped: torch.Tensor) -> None:
        """Unmap our pages of `name`, then ask the kernel to drop them from the page cache
        (mapped pages are never dropped, hence the madvise first)."""
        self._madvise(mapped.data_ptr(), mapped.numel() * mapped.element_size(), _MADV_DONTNEED)
        file_idx, (start, end) = self._where[name]
        os.posix_fadvise(self._fds[file_idx], start, end - start, os.POSIX_FADV_DONTNEED)

    def _madvise(self, addr: int, nbytes: int, advice: int) -> None:
        lo = addr - addr % _PAGE
        hi = addr + nbytes
        hi += (-hi) % _PAGE
        self._libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), advice)

    def close(self) -> None:
        for fd in self._fds + (self._direct_fds or []):
            os.close(fd)
        self._fds, self._handles, self._direct_fds = [], [], None


def close_source(source: Optional[ExpertSource]) -> None:
    close = getattr(source, "close", None)
    if close is not None:
        close()
