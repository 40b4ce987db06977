"""GGUF (llama.cpp) checkpoints: metadata -> transformers config, tensors -> HF names.

The header is parsed here with `struct` over a memory map instead of `gguf.GGUFReader`:
the reader builds one numpy view per token string (~100k for a 49k vocab), which costs
3-5 s before a single weight is read; walking the same header here takes ~0.1 s. Tensor
data stays a zero-copy view into the map and is dequantized with `gguf.quants.dequantize`
(vectorised numpy). The test suite checks this parser against `GGUFReader`.

llama.cpp stores the Q and K projections of the `llama` architecture with rows permuted
for its interleaved rotary; `iter_hf_weights` undoes it (as transformers' GGUF loader
does). `qwen2` files are not permuted.
"""

from __future__ import annotations

import dataclasses
import mmap
import re
import struct
import warnings
from typing import Any, Dict, Iterator, Optional, Tuple

import numpy as np
import torch
from transformers import LlamaConfig, MistralConfig, PretrainedConfig, Qwen2Config

_GGUF_MAGIC = b"GGUF"
# GGUF value type -> struct format (little endian), for scalars and numeric arrays.
_SCALAR_FMT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NP_DTYPE = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
             6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclasses.dataclass
class GGUFTensorInfo:
    name: str
    shape: Tuple[int, ...]  # numpy / HF order (rows first); GGUF stores it reversed
    qtype: int  # gguf.GGMLQuantizationType value
    offset: int  # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    """Metadata and tensor directory of a .gguf file; tensor data is read lazily via mmap."""

    def __init__(self, path: str) -> None:
        from gguf import GGML_QUANT_SIZES

        self.path = path
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = self._map
        if buf[:4] != _GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (bad magic)")
        self.version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if self.version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {self.version} is not supported (need 2 or 3)")
        self._pos = 24
        self.metadata: Dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._read_str()
            (vtype,) = self._unpack("<I")
            self.metadata[key] = self._read_value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = self._read_str()
            (n_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{n_dims}Q")
            qtype, offset = self._unpack("<IQ")
            infos.append((name, tuple(reversed(dims)), qtype, offset))
        align = int(self.metadata.get("general.alignment", 32))
        data_start = (self._pos + align - 1) // align * align
        self.tensors: Dict[str, GGUFTensorInfo] = {}
        for name, shape, qtype, offset in infos:
            block, type_size = GGML_QUANT_SIZES[qtype]
            nbytes = int(np.prod(shape)) // block * type_size
            self.tensors[name] = GGUFTensorInfo(name, shape, qtype, data_start + offset, nbytes)

    # ---- header walking -----------------------------------------------------------------

    def _unpack(self, fmt: str) -> tuple:
        out = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return out

    def _read_str(self) -> str:
        (n,) = struct.unpack_from("<Q", self._map, self._pos)
        start = self._pos + 8
        self._pos = start + n
        return self._map[start : start + n].decode("utf-8", errors="replace")

    def _read_value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._read_str()
        if vtype == _ARRAY:
            etype, count = self._unpack("<IQ")
            if etype == _STRING:
                return [self._read_str() for _ in range(count)]
            if etype == _ARRAY:
                return [self._read_value(_ARRAY) for _ in range(count)]
            dtype = np.dtype(_NP_DTYPE[etype]).newbyteorder("<")
            arr = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._pos)
            self._pos += arr.nbytes
            return arr.tolist()
        (value,) = self._unpack("<" + _SCALAR_FMT[vtype])
        return value

    # ---- tensor data --------------------------------------------------------------------

    def raw(self, name: str) -> np.ndarray:
        """Zero-copy bytes of a tensor, shaped as `gguf.quants.dequantize` expects."""
        info = self.tensors[name]
        data = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return data.reshape(*info.shape[:-1], -1)

    def dequantize(self, name: str) -> np.ndarray:
        """float32 array of the tensor's shape."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        qtype = GGMLQuantizationType(self.tensors[name].qtype)
        out = dequantize(self.raw(name), qtype)
        return out.astype(np.float32, copy=False).reshape(self.tensors[name].shape)


# ---- config ---------------------------------------------------------------------------------

# model type -> (config class, architecture name in sglang.srt.models.registry)
_CONFIG_CLASSES = {
    "llama": (LlamaConfig, "LlamaForCausalLM"),
    "qwen2": (Qwen2Config, "Qwen2ForCausalLM"),
    "mistral": (MistralConfig, "MistralForCausalLM"),
}


def gguf_model_type(gf: GGUFFile) -> str:
    """llama | qwen2 | mistral. llama.cpp files Mistral under `llama`; as transformers does,
    the model name tells them apart."""
    arch = gf.metadata["general.architecture"]
    if arch == "llama" and "mistral" in str(gf.metadata.get("general.name", "")).lower():
        return "mistral"
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: llama, qwen2")
    return arch


def gguf_config(gf: GGUFFile) -> PretrainedConfig:
    md, arch = gf.metadata, gf.metadata["general.architecture"]
    model_type = gguf_model_type(gf)

    def get(key: str, default: Any = None) -> Any:
        return md.get(f"{arch}.{key}", default)

    heads = get("attention.head_count")
    hidden = get("embedding_length")
    vocab = get("vocab_size") or len(md.get("tokenizer.ggml.tokens", [])) or None
    if vocab is None:
        vocab = gf.tensors["token_embd.weight"].shape[0]
    rope: Dict[str, Any] = {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 10000.0))}
    scaling = get("rope.scaling.type")
    if scaling == "linear":
        rope.update(rope_type="linear", factor=float(get("rope.scaling.factor")))
    elif scaling not in (None, "none"):
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported (only linear)")
    if "rope_freqs.weight" in gf.tensors:
        # llama3-style scaling stored as per-frequency factors; we do not rebuild it.
        raise ValueError("GGUF files with rope_freqs (Llama 3.1 rope scaling) are not supported")
    kwargs = dict(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_hidden_layers=get("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=get("attention.head_count_kv", heads),
        head_dim=get("attention.key_length", hidden // heads),
        max_position_embeddings=get("context_length", 4096),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_parameters=rope,
        tie_word_embeddings="output.weight" not in gf.tensors,
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=md.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=md.get("tokenizer.ggml.padding_token_id"),
    )
    if model_type == "mistral":
        kwargs["sliding_window"] = get("attention.sliding_window")
    config_class, architecture = _CONFIG_CLASSES[model_type]
    config = config_class(**kwargs)
    config.architectures = [architecture]
    return config


# ---- tensors -------------------------------------------------------------------------------

_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> Optional[str]:
    """The HF checkpoint name of a llama.cpp tensor name, or None if it has none."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m is None or m.group(2) not in _BLOCK_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order (per head: interleaved pairs -> two halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def iter_hf_weights(gf: GGUFFile, config: PretrainedConfig) -> Iterator[Tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every tensor the model needs, dequantized one at a time."""
    permute = gf.metadata["general.architecture"] == "llama"
    for name in gf.tensors:
        target = hf_name(name)
        if target is None:
            continue  # e.g. rope_freqs handled (refused) in gguf_config
        with warnings.catch_warnings():
            # F32 tensors are read-only views of the map; they are only ever copied from.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            w = torch.from_numpy(gf.dequantize(name))
        if permute and ".attn_q." in name:
            w = _unpermute(w, config.num_attention_heads)
        elif permute and ".attn_k." in name:
            w = _unpermute(w, config.num_key_value_heads)
        yield target, w

