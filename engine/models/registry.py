"""Hugging Face `model_type` / `architectures` -> the CausalLM class that serves it.

An architecture is served once its class is listed here (or passed to `register`): the
config parser, the model runner, the PEFT loader and the memory model find it by the
config's model type.
"""

from __future__ import annotations

from typing import Any

from engine.models.base import CausalLM
from engine.models.config import ModelConfig, ModelLoadError
from engine.models.llama import LlamaForCausalLM
from engine.models.phi3 import Phi3ForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM

_BY_MODEL_TYPE: dict[str, type[CausalLM]] = {}
_BY_ARCHITECTURE: dict[str, str] = {}  # architecture -> model_type


def register(cls: type[CausalLM]) -> type[CausalLM]:
    """Serve `cls` for its model_types and architectures (usable as a class decorator)."""
    assert cls.model_types, f"{cls.__name__} declares no model_types"
    for model_type in cls.model_types:
        assert _BY_MODEL_TYPE.get(model_type, cls) is cls, f"{model_type} is registered twice"
        _BY_MODEL_TYPE[model_type] = cls
    for architecture, model_type in cls.architectures.items():
        assert model_type in cls.model_types, (architecture, model_type)
        _BY_ARCHITECTURE[architecture] = model_type
    return cls


def supported_model_types() -> tuple[str, ...]:
    return tuple(sorted(_BY_MODEL_TYPE))


def model_class(model_type: str) -> type[CausalLM]:
    """The class of a parsed config's model type (see model_class_for_raw for new ones)."""
    cls = _BY_MODEL_TYPE.get(model_type)
    if cls is None:
        raise ModelLoadError(
            f"unsupported model_type {model_type!r}; "
            f"supported: {', '.join(supported_model_types())}"
        )
    return cls


def model_class_for(config: ModelConfig) -> type[CausalLM]:
    return model_class(config.model_type)


def model_class_for_raw(raw: dict[str, Any], source: str) -> tuple[str, type[CausalLM]]:
    """(model_type, class) of a config.json; a config without `model_type` is found by
    its `architectures`."""
    model_type = raw.get("model_type")
    cls = _BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None
    if cls is None and model_type is None:
        for architecture in raw.get("architectures") or []:
            if architecture in _BY_ARCHITECTURE:
                model_type = _BY_ARCHITECTURE[architecture]
                cls = _BY_MODEL_TYPE[model_type]
                break
    if cls is None:
        raise ModelLoadError(
            f"unsupported model_type {model_type!r} in {source}; "
            f"supported: {', '.join(supported_model_types())}"
        )
    assert isinstance(model_type, str)
    return model_type, cls


for _cls in (LlamaForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM):
    register(_cls)
