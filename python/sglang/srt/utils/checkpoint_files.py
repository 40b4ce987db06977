"""Reading Hugging Face safetensors checkpoints (single file or sharded)."""

from __future__ import annotations

import glob
import json
import os
from typing import Iterator, List, Tuple

import torch


def safetensors_files(folder: str) -> List[str]:
    """The checkpoint's .safetensors files: those named by the shard index if there is one."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, s) for s in shards]
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors in {folder}; convert .bin checkpoints with save_pretrained"
            "(safe_serialization=True) or pass a .gguf file"
        )
    return files


def iter_safetensors(folder: str) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every shard; tensors are memory-mapped views."""
    from safetensors import safe_open

    for path in safetensors_files(folder):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def folder_architectures(path) -> List[str]:
    """A model folder's config.json architectures ([] for a GGUF file or no config)."""
    config = os.path.join(path, "config.json") if path and os.path.isdir(path) else None
    if config is None or not os.path.isfile(config):
        return []
    with open(config) as f:
        return list(json.load(f).get("architectures") or [])
