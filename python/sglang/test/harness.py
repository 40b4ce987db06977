"""TinyRunner: the smallest loop that drives a model through the real pools and backend.

It plays the scheduler's part for tests: owns one req_to_token row per request, allocates
KV slots, writes the rows, builds ForwardBatches for EXTEND (prefill, also with a prefix)
and DECODE, and frees everything on `release()`. Not for serving: no batching policy, no
radix cache. Invariant: after `release()` every KV slot and row is free again.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch

from sglang.srt.distributed.parallel_state import tp_group
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool, TokenSlotAllocator
from sglang.srt.mem_cache.mla_pool import create_kv_pool
from sglang.srt.model_executor.forward_batch import ForwardBatch, ForwardMode
from sglang.srt.model_loader.loader import load_model


class TinyRunner:
    def __init__(self, model_path: Optional[str], dtype: Union[str, torch.dtype] = "float32",
                 max_reqs: int = 4, max_context: int = 1024, kv_slots: int = 4096,
                 model: Optional[torch.nn.Module] = None, config=None,
                 device: str = "cpu") -> None:
        """`model` + `config`: drive a module built elsewhere (a draft head) instead.
        `device`: where the weights, pools and batches live (the trainer's features on a
        GPU); off the CPU the backend takes its device-agnostic path."""
        if model is None:
            self.model, self.config = load_model(model_path, dtype=dtype, device=device)
        else:
            self.model, self.config = model, config
        self.device = device
        self.dtype = next(self.model.parameters()).dtype
        cfg = self.config
        self.req_pool = ReqToTokenPool(max_reqs, max_context, device=device)
        self.allocator = TokenSlotAllocator(kv_slots, device=device)
        # the latent pool for MLA, else this TP rank's KV heads (all of them without TP)
        self.kv_pool = create_kv_pool(cfg, kv_slots, self.dtype, device=device,
                                      tp_size=tp_group().size)
        self.backend = TorchNativeAttnBackend()
        self.rows: List[int] = []  # req_to_token row of each running request
        self.lens: List[int] = []  # tokens already in KV, per running request

    # ---- steps -----------------------------------------------------------------------------

    def prefill(self, prompts: Sequence[Sequence[int]], all_logits: bool = False) -> torch.Tensor:
        """Start new requests (dropping any running ones) with one ragged EXTEND.
        Returns [bs, vocab] last-token logits, or [sum(len), vocab] if `all_logits`."""
        self.release()
        for _ in prompts:
            row = self.req_pool.alloc()
            assert row is not None, "out of req_to_token rows"
            self.rows.append(row)
            self.lens.append(0)
        return self.extend(prompts, all_logits=all_logits)

    def extend(self, chunks: Sequence[Sequence[int]], all_logits: bool = False) -> torch.Tensor:
        """EXTEND every running request by its chunk (its existing KV is the prefix)."""
        return self._forward(ForwardMode.EXTEND, chunks, all_logits)

    def decode(self, tokens: Sequence[int]) -> torch.Tensor:
        """One DECODE step: token i is appended to request i. Returns [bs, vocab]."""
        return self._forward(ForwardMode.DECODE, [[t] for t in tokens], False)

    def generate_greedy(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> List[List[int]]:
        """Greedy continuation of each prompt (no stop tokens), batched."""
        logits = self.prefill(prompts)
        out: List[List[int]] = [[] for _ in prompts]
        for step in range(max_new_tokens):
            next_tokens = logits.argmax(-1).tolist()
            for seq, tok in zip(out, next_tokens):
                seq.append(tok)
            if step + 1 < max_new_tokens:
                logits = self.decode(next_tokens)
        self.release()
        return out

    def release(self) -> None:
        """Free every running request's KV slots and row."""
        for row, n in zip(self.rows, self.lens):
            self.allocator.free(self.req_pool.req_to_token[row, :n].clone())
            self.req_pool.free(row)
        self.rows, self.lens = [], []

    # ---- batch building --------------------------------------------------------------------

    def _forward(self, mode: ForwardMode, chunks: Sequence[Sequence[int]],
                 all_logits: bool, capture_layers: Optional[List[int]] = None, **model_kwargs):
        """One forward; `capture_layers` asks the target for those layers' hidden states
        (`self.last_batch.captured_hidden`), `model_kwargs` go to the model (a head's
        features)."""
        assert len(chunks) == len(self.rows), "one chunk per running request"
        ext_lens = [len(c) for c in chunks]
        assert min(ext_lens) > 0, "every request must compute at least one token"
        seq_lens = [n + e for n, e in zip(self.lens, ext_lens)]
        total = sum(ext_lens)
        out_loc = self.allocator.alloc(total)
        assert out_loc is not None, "out of KV slots"
        start = 0
        for row, prefix, ext in zip(self.rows, self.lens, ext_lens):
            self.req_pool.write(row, prefix, out_loc[start : start + ext])
            start += ext
        dev = self.device
        input_ids = torch.tensor([t for c in chunks for t in c], dtype=torch.int64, device=dev)
        positions = torch.cat([torch.arange(n, s, device=dev)
                               for n, s in zip(self.lens, seq_lens)])
        fb = ForwardBatch(
            forward_mode=mode,
            batch_size=len(chunks),
            input_ids=input_ids,
            positions=positions,
            req_pool_indices=torch.tensor(self.rows, dtype=torch.int64, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=dev),
            extend_seq_lens=torch.tensor(ext_lens, dtype=torch.int64, device=dev),
            out_cache_loc=out_loc,
            req_to_token_pool=self.req_pool,
            token_to_kv_pool=self.kv_pool,
            attn_backend=self.backend,
            seq_lens_cpu=seq_lens,
            extend_seq_lens_cpu=ext_lens,
            logits_indices=torch.arange(total, device=dev) if all_logits else None,
            capture_layers=capture_layers,
        )
        self.last_batch = fb
        self.backend.init_forward_metadata(fb)
        with torch.inference_mode():
            logits = self.model(input_ids, positions, fb, **model_kwargs)
        self.lens = seq_lens
        return logits
