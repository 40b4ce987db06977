"""Load a model, its config and its tokenizer from an HF folder or a .gguf file.

The model is built on the meta device (no random init), materialised uninitialised on the
target device, then every parameter is written by `load_weights` (which raises if one is
missing), so loading costs little more than reading and converting the weights.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
from typing import Iterator, Optional, Tuple, Union

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from sglang.srt.distributed.parallel_state import tp_group
from sglang.srt.expert_offload.attach import attach_expert_store
from sglang.srt.expert_offload.config import OffloadConfig
from sglang.srt.model_loader.gguf_loader import GGUFFile, gguf_config, iter_hf_weights
from sglang.srt.utils.checkpoint_files import iter_safetensors
from sglang.srt.models.moe_common import MoECausalLM
from sglang.srt.models.registry import get_model_class

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16,
}


def is_gguf(model_path: str) -> bool:
    return model_path.endswith(".gguf") and os.path.isfile(model_path)


def load_config(model_path: str) -> PretrainedConfig:
    if is_gguf(model_path):
        return gguf_config(GGUFFile(model_path))
    if not os.path.isdir(model_path):
        raise FileNotFoundError(
            f"model path {model_path!r} is neither a .gguf file nor a local model folder"
        )
    return AutoConfig.from_pretrained(model_path)


def resolve_dtype(dtype: Union[str, torch.dtype], config: PretrainedConfig, gguf: bool,
                  device: str = "cpu") -> torch.dtype:
    """`auto`: GGUF -> bfloat16; HF -> the checkpoint's dtype (float16 -> bfloat16 on CPU,
    where half matmuls are slow and overflow-prone), float32 when unspecified."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"--dtype {dtype!r} is not one of auto, {', '.join(_DTYPES)}")
        return _DTYPES[dtype]
    if gguf:
        return torch.bfloat16
    saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(saved, str):
        saved = _DTYPES.get(saved)
    if saved == torch.float16 and str(device).startswith("cpu"):
        logger.info("--dtype auto: the float16 checkpoint runs in bfloat16 on CPU (no "
                    "half-precision kernels); pass --dtype float32 for full precision")
        return torch.bfloat16
    if saved == torch.float16:
        return torch.float16
    return saved if saved in (torch.bfloat16, torch.float32) else torch.float32


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(model_path: str, dtype: Union[str, torch.dtype] = "auto",
               device: str = "cpu", offload: Optional[OffloadConfig] = None,
               moe_expert_cache_slots: Optional[int] = None,
               moe_expert_drop_page_cache: bool = False,
               architecture: Optional[str] = None) -> Tuple[nn.Module, PretrainedConfig]:
    """(model in eval mode without grads, its config) from an HF folder or a .gguf file.

    `architecture` builds another class from the checkpoint (NEXTN: the MTP layer of a
    DeepSeek-V3 target); a class with `draft_config` rewrites the config it is built from.

    With `offload.cache_slots` set (or the `moe_expert_cache_slots` shorthand), MoE models
    keep that many experts per layer in memory and serve the rest from the checkpoint file
    through an ExpertStore (`model.expert_store`)."""
    if offload is None and moe_expert_cache_slots is not None:
        offload = OffloadConfig.slots_only(moe_expert_cache_slots, moe_expert_drop_page_cache)
    slots = offload.cache_slots if offload is not None else None
    gguf_file = GGUFFile(model_path) if is_gguf(model_path) else None
    config = gguf_config(gguf_file) if gguf_file is not None else load_config(model_path)
    torch_dtype = resolve_dtype(dtype, config, gguf_file is not None, device)
    model_class = get_model_class([architecture] if architecture
                                  else getattr(config, "architectures", None) or [])
    if hasattr(model_class, "draft_config"):
        config = model_class.draft_config(config)
    if tp_group().size > 1 and not getattr(model_class, "supports_tensor_parallel", False):
        raise ValueError(f"--tp-size {tp_group().size}: {model_class.__name__} does not run "
                         "tensor-parallel on this fork yet (Llama, Qwen2, Mistral, Mixtral and "
                         "Qwen2/3-MoE do); use "
                         "--tp-size 1")
    offloads = slots is not None and issubclass(model_class, MoECausalLM)
    with torch.device("meta"), _default_dtype(torch_dtype):
        model = model_class(config, expert_cache_slots=slots) if offloads else model_class(config)
    model = model.to_empty(device=device)
    weights = (iter_hf_weights(gguf_file, config) if gguf_file is not None
               else iter_safetensors(model_path))
    model.load_weights(weights)
    if offloads:
        attach_expert_store(model, model_path, offload)
    model.eval().requires_grad_(False)
    return model, config


# ---- tokenizer ------------------------------------------------------------------------------


def default_tokenizer_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "sglang-fork", "tokenizers")


def _gguf_tokenizer_key(path: str) -> str:
    import transformers

    st = os.stat(path)
    ident = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    return hashlib.sha256(ident.encode()).hexdigest()[:24]


def load_tokenizer(model_path: str, cache_dir: Optional[str] = None):
    """A transformers tokenizer. For a .gguf file it is converted from the metadata once
    (several seconds) and cached as an HF tokenizer folder keyed by path, size and mtime."""
    from transformers import AutoTokenizer

    if not is_gguf(model_path):
        return AutoTokenizer.from_pretrained(model_path)
    cached = os.path.join(cache_dir or default_tokenizer_cache_dir(), _gguf_tokenizer_key(model_path))
    if os.path.exists(os.path.join(cached, "tokenizer_config.json")):
        return AutoTokenizer.from_pretrained(cached)
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(model_path)),
                                              gguf_file=os.path.basename(model_path))
    os.makedirs(os.path.dirname(cached), exist_ok=True)
    # Save beside the target and rename, so a concurrent reader never sees half a folder.
    tmp = tempfile.mkdtemp(dir=os.path.dirname(cached), prefix=".tmp-")
    try:
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, cached)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process won the race
    return tokenizer
