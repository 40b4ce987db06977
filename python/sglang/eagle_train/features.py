"""The target's features over the corpus, computed by our own engine, dumped to disk.

Per sequence: the outputs of the head's three target layers (what `fc` reads at serving
time) and of the target's last layer (its next-token distribution, the training label,
is the target's norm and lm_head over it). Shards of a few sequences; a rerun resumes
after the last complete shard (a shard is written to a temporary name, then renamed).
"""

from __future__ import annotations

import json
import os
from typing import Iterator, List, Sequence

import torch
from safetensors.torch import load_file, save_file

from sglang.srt.model_executor.forward_batch import ForwardMode
from sglang.test.harness import TinyRunner

SHARD_SEQUENCES = 8


def shard_path(folder: str, k: int) -> str:
    return os.path.join(folder, f"shard_{k:05d}.safetensors")


def done_shards(folder: str) -> int:
    k = 0
    while os.path.exists(shard_path(folder, k)):
        k += 1
    return k


def dump_features(runner: TinyRunner, target_path: str, sequences: Sequence[Sequence[int]],
                  layers: List[int], folder: str, progress: bool = True) -> int:
    """Write every sequence's features under `folder` (the target run by `runner`, one
    sequence at a time); returns the number of shards. Resumes: shards already complete
    are kept (the run's target, layers and sequence count must be the same)."""
    os.makedirs(folder, exist_ok=True)
    meta_path = os.path.join(folder, "meta.json")
    meta = {"target": os.path.abspath(target_path), "layers": layers,
            "sequences": len(sequences), "shard_sequences": SHARD_SEQUENCES}
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            old = json.load(f)
        if old != meta:
            raise ValueError(f"{folder} holds features of another run ({old}); use a fresh "
                             "--output-dir or delete its features/ folder")
    else:
        with open(meta_path, "w") as f:
            json.dump(meta, f)
    total = (len(sequences) + SHARD_SEQUENCES - 1) // SHARD_SEQUENCES
    first = done_shards(folder)
    if first >= total:
        return total
    last = runner.config.num_hidden_layers - 1
    capture = sorted(set(layers) | {last})
    bar = _bar(total, first, progress)
    for k in range(first, total):
        tensors = {}
        for j, seq in enumerate(sequences[k * SHARD_SEQUENCES: (k + 1) * SHARD_SEQUENCES]):
            runner.rows, runner.lens = [runner.req_pool.alloc()], [0]
            runner._forward(ForwardMode.EXTEND, [list(seq)], False, capture_layers=capture)
            got = runner.last_batch.captured_hidden
            width = got.shape[1] // len(capture)
            parts = {i: got[:, n * width: (n + 1) * width] for n, i in enumerate(capture)}
            tensors[f"{j}.ids"] = torch.tensor(seq, dtype=torch.int64)
            # bfloat16 on disk: half the bytes, features a head reads rounded anyway
            tensors[f"{j}.aux"] = torch.cat([parts[i] for i in layers], -1).bfloat16().cpu()
            tensors[f"{j}.last"] = parts[last].bfloat16().contiguous().cpu()
            runner.release()
        tmp = shard_path(folder, k) + ".tmp"
        save_file(tensors, tmp)
        os.replace(tmp, shard_path(folder, k))
        bar.update(1)
    bar.close()
    return total


def iter_shard(folder: str, k: int) -> Iterator[tuple]:
    """(ids, aux, last) of each sequence in shard k, features in bfloat16 as stored (half
    the memory of float32 for a corpus held whole; the trainer widens one at a time)."""
    t = load_file(shard_path(folder, k))
    n = sum(1 for name in t if name.endswith(".ids"))
    for j in range(n):
        yield t[f"{j}.ids"], t[f"{j}.aux"], t[f"{j}.last"]


def _bar(total: int, initial: int, show: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="target features (shards)",
                disable=not show)
