"""The configurations the peer harness knows: which engine runs each, with what settings, and
which of the same engine's configurations is its plain decoding. Every peer at its own
documentation's settings: vLLM's ngram at three settings of k and lookup lengths (its docs'
example k=5 / lookup 4..2 among them), transformers' prompt lookup at its documented 10
tokens, llama.cpp's prompt lookup (`LlamaPromptLookupDecoding`, whose defaults are 10 tokens
and n-grams up to 2) at two settings."""

from __future__ import annotations

import dataclasses
from typing import Dict


@dataclasses.dataclass(frozen=True)
class PeerConfig:
    engine: str  # a module under engines/
    env: str  # "ours" (this repo's venv), "vllm" or "llama" (their own environments)
    plain: str  # the same engine's plain configuration
    dtype: str  # for the reference lookup: bfloat16, float32 or the GGUF's q4_k_m
    settings: Dict[str, object]


def _vllm_ngram(k: int, lo: int, hi: int) -> Dict[str, object]:
    return {"speculative_config": {"method": "ngram", "num_speculative_tokens": k,
                                   "prompt_lookup_min": lo, "prompt_lookup_max": hi}}


CONFIGS: Dict[str, PeerConfig] = {
    "ours plain": PeerConfig("ours", "ours", "ours plain", "bfloat16", {"dtype": "bfloat16"}),
    "ours NGRAM": PeerConfig("ours", "ours", "ours plain", "bfloat16",
                             {"dtype": "bfloat16", "speculative_algorithm": "NGRAM"}),
    "ours plain fp32": PeerConfig("ours", "ours", "ours plain fp32", "float32",
                                  {"dtype": "float32"}),
    "ours NGRAM fp32": PeerConfig("ours", "ours", "ours plain fp32", "float32",
                                  {"dtype": "float32", "speculative_algorithm": "NGRAM"}),
    "hf plain fp32": PeerConfig("transformers_hf", "ours", "hf plain fp32", "float32",
                                {"dtype": "float32"}),
    # bf16 only to check the harness against transformers' reference figure (bf16); the
    # fair comparison is fp32 (torch's bf16 matmul is slow on some CPUs)
    "hf plain bf16": PeerConfig("transformers_hf", "ours", "hf plain bf16", "bfloat16",
                                {"dtype": "bfloat16"}),
    "hf lookup10 fp32": PeerConfig("transformers_hf", "ours", "hf plain fp32", "float32",
                                   {"dtype": "float32", "prompt_lookup_num_tokens": 10}),
    "vllm plain": PeerConfig("vllm_cpu", "vllm", "vllm plain", "bfloat16", {}),
    "vllm ngram k10 l1-2": PeerConfig("vllm_cpu", "vllm", "vllm plain", "bfloat16",
                                      _vllm_ngram(10, 1, 2)),
    "vllm ngram k5 l2-4": PeerConfig("vllm_cpu", "vllm", "vllm plain", "bfloat16",
                                     _vllm_ngram(5, 2, 4)),
    "vllm ngram k10 l1-4": PeerConfig("vllm_cpu", "vllm", "vllm plain", "bfloat16",
                                      _vllm_ngram(10, 1, 4)),
    "llama.cpp plain": PeerConfig("llama_cpp_engine", "llama", "llama.cpp plain", "q4_k_m", {}),
    "llama.cpp lookup k10 n2": PeerConfig("llama_cpp_engine", "llama", "llama.cpp plain",
                                          "q4_k_m", {"lookup": {"num_pred_tokens": 10,
                                                                "max_ngram_size": 2}}),
    "llama.cpp lookup k5 n3": PeerConfig("llama_cpp_engine", "llama", "llama.cpp plain",
                                         "q4_k_m", {"lookup": {"num_pred_tokens": 5,
                                                               "max_ngram_size": 3}}),
}

REFERENCE_ENGINE = {"ours": None, "transformers_hf": "transformers", "vllm_cpu": "vllm",
                    "llama_cpp_engine": "llama.cpp"}
