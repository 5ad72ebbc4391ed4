"""Reading a PEFT LoRA adapter directory into `LoRAWeights`, checked against the base model.

A directory holds `adapter_config.json` and `adapter_model.safetensors`, as PEFT's
`save_pretrained` writes them. Everything the server cannot apply exactly as PEFT would
(DoRA, biases, embeddings, fully trained module copies, ...) is refused with a message that
names the file, field or tensor at fault. Pickle weights are refused without being opened.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.lora.weights import AdapterError, LoRAModule, LoRAWeights
from engine.models.base import CausalLM, interleave_leading_rows
from engine.models.loader import ModelConfig
from engine.models.registry import model_class_for

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_WEIGHTS_FILE = "adapter_model.bin"
ALL_LINEAR = "all-linear"

_EMBEDDING_MODULES = ("embed_tokens", "lm_head")

# Config fields that, when set, ask for something other than plain LoRA on the base weights.
_REFUSED_FIELDS: dict[str, str] = {
    "use_dora": "DoRA (weight-decomposed LoRA)",
    "lora_bias": "a trained bias on lora_B",
    "use_qalora": "QA-LoRA (pooled inputs)",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
    "arrow_config": "Arrow routing",
    "use_bdlora": "block-diagonal LoRA (BD-LoRA)",
    "monteclora_config": "MonteCLoRA",
    "kasa_config": "KaSA",
    "layer_replication": "layer replication",
    "target_parameters": "LoRA on raw parameters (target_parameters)",
    "trainable_token_indices": "trainable token embeddings",
    "modules_to_save": "fully trained copies of base modules (modules_to_save)",
}
# NOTE: these initializations also rewrite the base weights; an adapter saved without PEFT's
# conversion back to a plain LoRA only fits that rewritten base, not ours.
_BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")

# base_model.model.<module>.lora_A[.<adapter name>].weight
_TENSOR_NAME = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+)\.(?P<kind>lora_A|lora_B)(?:\.[^.]+)?"
    r"\.(?P<param>weight|bias)$"
)
_MODULE_PATH = re.compile(
    r"^(?:model\.)?layers\.(?P<layer>\d+)\.(?P<parent>[^.]+)\.(?P<name>[^.]+)$"
)


@dataclass(slots=True)
class _AdapterConfig:
    r: int
    lora_alpha: float
    use_rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    # None (PEFT's per-architecture default), a list of module names, or a regex
    target_modules: list[str] | str | None


@dataclass(slots=True)
class _Factors:
    """The two tensors of one adapted module, as found in the file."""

    module_path: str  # e.g. "model.layers.0.self_attn.q_proj"
    a_name: str | None = None
    a: torch.Tensor | None = None
    b_name: str | None = None
    b: torch.Tensor | None = None


def load_peft_adapter(
    path: Path,
    model_config: ModelConfig,
    *,
    max_rank: int,
    name: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> LoRAWeights:
    """Read and validate a PEFT LoRA directory for the architecture of `model_config`
    (the modules it may target and their shapes are its class's, see engine/models);
    the B rows rope rotates come back rope-interleaved."""
    arch = model_class_for(model_config)
    path = Path(path)
    if not path.exists():
        raise AdapterError(f"adapter directory {path} does not exist")
    if not path.is_dir():
        raise AdapterError(f"adapter path {path} is not a directory")
    config_path = path / CONFIG_FILE
    config = _parse_config(_read_json(config_path), config_path, arch.target_modules())
    weights_path = _weights_file(path)
    tensors = _read_tensors(weights_path)

    found = _group_tensors(tensors, weights_path, model_config, arch)
    _check_targets(found, config, config_path, weights_path)
    modules: dict[tuple[int, str], LoRAModule] = {}
    for key, factors in sorted(found.items()):
        modules[key] = _build_module(
            key, factors, config, model_config, arch, weights_path, dtype
        )
    rank = max(m.rank for m in modules.values())
    if rank > max_rank:
        (layer, module), worst = max(modules.items(), key=lambda kv: kv[1].rank)
        raise AdapterError(
            f"{weights_path}: rank {worst.rank} (layer {layer} {module}) is above the server's "
            f"limit of {max_rank}; start the server with a larger --max-lora-rank to serve it"
        )
    return LoRAWeights(
        name=name if name is not None else (path.name or path.resolve().name),
        path=path,
        rank=rank,
        alpha=config.lora_alpha,
        use_rslora=config.use_rslora,
        modules=modules,
    )


# ---------------------------------------------------------------------------- config


def _read_json(config_path: Path) -> dict[str, Any]:
    if not config_path.is_file():
        raise AdapterError(f"{config_path.parent} has no {CONFIG_FILE}")
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{config_path} is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise AdapterError(f"{config_path} must hold a JSON object, not {type(raw).__name__}")
    return raw


def _parse_config(
    raw: dict[str, Any], config_path: Path, supported: frozenset[str]
) -> _AdapterConfig:
    peft_type = raw.get("peft_type")
    if peft_type is not None and peft_type != "LORA":
        raise AdapterError(
            f"{config_path}: peft_type is {peft_type!r}; only LORA adapters can be served"
        )
    for field_name, what in _REFUSED_FIELDS.items():
        value = raw.get(field_name)
        if value:  # absent, null, false, [] and {} all mean "not used"
            raise AdapterError(
                f"{config_path}: {field_name}={value!r} asks for {what}, which is not "
                "supported; only plain LoRA adapters can be served"
            )
    bias = raw.get("bias", "none")
    if bias != "none":
        raise AdapterError(
            f"{config_path}: bias={bias!r} trains the base model's biases, which adapters "
            "cannot carry here; only bias='none' is supported"
        )
    init = raw.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_REWRITING_INITS):
        raise AdapterError(
            f"{config_path}: init_lora_weights={init!r} also rewrites the base weights; save "
            "the adapter with PEFT's conversion to plain LoRA "
            "(path_initial_model_for_weight_conversion) to serve it"
        )
    # NOTE: missing r / lora_alpha take PEFT's own defaults (8), as PEFT would load them.
    r = raw.get("r", 8)
    if not _is_int(r) or r < 1:
        raise AdapterError(f"{config_path}: r must be an integer >= 1, got {r!r}")
    alpha = raw.get("lora_alpha", 8)
    if not _is_number(alpha):
        raise AdapterError(f"{config_path}: lora_alpha must be a finite number, got {alpha!r}")
    use_rslora = raw.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise AdapterError(f"{config_path}: use_rslora must be true or false, got {use_rslora!r}")
    rank_pattern = _pattern(raw, "rank_pattern", config_path)
    for key, value in rank_pattern.items():
        if not _is_int(value) or value < 1:
            raise AdapterError(
                f"{config_path}: rank_pattern[{key!r}] must be an integer >= 1, got {value!r}"
            )
    alpha_pattern = _pattern(raw, "alpha_pattern", config_path)
    for key, value in alpha_pattern.items():
        if not _is_number(value):
            raise AdapterError(
                f"{config_path}: alpha_pattern[{key!r}] must be a finite number, got {value!r}"
            )
    return _AdapterConfig(
        r=int(r),
        lora_alpha=float(alpha),
        use_rslora=use_rslora,
        rank_pattern={k: int(v) for k, v in rank_pattern.items()},
        alpha_pattern={k: float(v) for k, v in alpha_pattern.items()},
        target_modules=_parse_targets(raw.get("target_modules"), config_path, supported),
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _pattern(raw: dict[str, Any], field_name: str, config_path: Path) -> dict[str, Any]:
    value = raw.get(field_name) or {}
    if not isinstance(value, dict):
        raise AdapterError(f"{config_path}: {field_name} must be an object, got {value!r}")
    for key in value:
        try:
            re.compile(key)
        except re.error as e:
            raise AdapterError(
                f"{config_path}: {field_name} key {key!r} is not a valid regular expression: {e}"
            ) from e
    return value


def _parse_targets(
    value: Any, config_path: Path, supported: frozenset[str]
) -> list[str] | str | None:
    if value is None:
        return None
    if isinstance(value, str):
        if value == ALL_LINEAR:
            return value
        try:
            re.compile(value)
        except re.error as e:
            raise AdapterError(
                f"{config_path}: target_modules {value!r} is not a valid regular expression: {e}"
            ) from e
        return value
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise AdapterError(
            f"{config_path}: target_modules must be a list of module names or a string, "
            f"got {value!r}"
        )
    # A list entry may be a dotted path ("self_attn.q_proj"); its last part names the module.
    leaves = {t: t.rsplit(".", 1)[-1] for t in value if t != ALL_LINEAR}
    embeddings = sorted(t for t, leaf in leaves.items() if leaf in _EMBEDDING_MODULES)
    if embeddings:
        raise AdapterError(
            f"{config_path}: target_modules includes {', '.join(embeddings)}; LoRA on the "
            "embeddings or lm_head is not supported"
        )
    unsupported = sorted(t for t, leaf in leaves.items() if leaf not in supported)
    if unsupported:
        raise AdapterError(
            f"{config_path}: target_modules includes {', '.join(unsupported)}, which cannot "
            f"be adapted (supported: {', '.join(sorted(supported))}, or {ALL_LINEAR!r})"
        )
    return list(value)


def _pattern_value(patterns: dict[str, Any], module_path: str, default: Any) -> Any:
    """PEFT's rule for rank_pattern / alpha_pattern: the first key, in file order, that
    matches the whole module path or a dotted suffix of it, as a regular expression."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module_path):
            return value
    return default


# ---------------------------------------------------------------------------- tensors


def _weights_file(path: Path) -> Path:
    weights_path = path / WEIGHTS_FILE
    if weights_path.is_file():
        return weights_path
    if (path / PICKLE_WEIGHTS_FILE).is_file():
        # NOTE: a pickle file can run arbitrary code when loaded, so it is never opened.
        raise AdapterError(
            f"{path} has only {PICKLE_WEIGHTS_FILE}: only safetensors adapter weights "
            f"({WEIGHTS_FILE}) are accepted, pickle files are never loaded; re-save the "
            "adapter with safe_serialization=True"
        )
    raise AdapterError(f"{path} has no {WEIGHTS_FILE}")


def _read_tensors(weights_path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(weights_path), framework="pt") as f:
            return {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 - not a mapping
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise AdapterError(f"{weights_path} is not a readable safetensors file: {e}") from e


def _group_tensors(
    tensors: dict[str, torch.Tensor],
    weights_path: Path,
    model_config: ModelConfig,
    arch: type[CausalLM],
) -> dict[tuple[int, str], _Factors]:
    found: dict[tuple[int, str], _Factors] = {}
    supported = arch.target_modules()
    for tensor_name, tensor in tensors.items():
        parts = tensor_name.split(".")
        if (
            "lora_embedding_A" in parts
            or "lora_embedding_B" in parts
            or any(p in _EMBEDDING_MODULES for p in parts)
        ):
            raise AdapterError(
                f"{weights_path}: tensor {tensor_name} adapts the embeddings or lm_head, "
                "which is not supported"
            )
        if "lora_magnitude_vector" in parts:
            raise AdapterError(
                f"{weights_path}: tensor {tensor_name} is a DoRA magnitude; DoRA adapters "
                "are not supported"
            )
        if "modules_to_save" in parts or "original_module" in parts:
            raise AdapterError(
                f"{weights_path}: tensor {tensor_name} is a fully trained module copy "
                "(modules_to_save), which is not supported"
            )
        match = _TENSOR_NAME.match(tensor_name)
        if match is None:
            raise AdapterError(
                f"{weights_path}: unexpected tensor {tensor_name}; only lora_A / lora_B "
                "weights of the supported modules are accepted"
            )
        if match["param"] == "bias":
            raise AdapterError(
                f"{weights_path}: tensor {tensor_name} is a LoRA bias (lora_bias), which is "
                "not supported"
            )
        module_path = match["module"]
        where = _MODULE_PATH.match(module_path)
        leaf = module_path.rsplit(".", 1)[-1]
        if (
            where is None
            or leaf not in supported
            or arch.module_parents[leaf] != where["parent"]
        ):
            raise AdapterError(
                f"{weights_path}: tensor {tensor_name} adapts {module_path}, which cannot be "
                f"adapted (supported modules: {', '.join(sorted(supported))})"
            )
        layer = int(where["layer"])
        if layer >= model_config.num_layers:
            raise AdapterError(
                f"{weights_path}: tensor {tensor_name} is for layer {layer}, but the base model "
                f"has {model_config.num_layers} layers"
            )
        factors = found.setdefault((layer, leaf), _Factors(module_path))
        if match["kind"] == "lora_A":
            if factors.a_name is not None:
                raise AdapterError(
                    f"{weights_path}: tensors {factors.a_name} and {tensor_name} are both "
                    f"lora_A of layer {layer} {leaf}"
                )
            factors.a_name, factors.a = tensor_name, tensor
        else:
            if factors.b_name is not None:
                raise AdapterError(
                    f"{weights_path}: tensors {factors.b_name} and {tensor_name} are both "
                    f"lora_B of layer {layer} {leaf}"
                )
            factors.b_name, factors.b = tensor_name, tensor
    if not found:
        raise AdapterError(f"{weights_path} holds no LoRA tensors")
    return found


def _check_targets(
    found: dict[tuple[int, str], _Factors],
    config: _AdapterConfig,
    config_path: Path,
    weights_path: Path,
) -> None:
    """Tensors for a module the config does not target would be ignored by PEFT: refuse."""
    targets = config.target_modules
    if targets is None or targets == ALL_LINEAR:
        return
    unselected: dict[str, str] = {}  # module name -> an example path
    for (_, module), factors in sorted(found.items()):
        path = factors.module_path
        if isinstance(targets, str):
            targeted = re.fullmatch(targets, path) is not None
        else:
            targeted = any(t == ALL_LINEAR or path == t or path.endswith("." + t) for t in targets)
        if not targeted:
            unselected.setdefault(module, path)
    if unselected:
        raise AdapterError(
            f"{weights_path} has tensors for {', '.join(sorted(unselected))} (e.g. "
            f"{next(iter(unselected.values()))}), which target_modules in {config_path.name} "
            f"({targets!r}) does not select"
        )


def _build_module(
    key: tuple[int, str],
    factors: _Factors,
    config: _AdapterConfig,
    model_config: ModelConfig,
    arch: type[CausalLM],
    weights_path: Path,
    dtype: torch.dtype,
) -> LoRAModule:
    layer, module = key
    if factors.a is None or factors.b is None:
        have, missing = ("lora_A", "lora_B") if factors.b is None else ("lora_B", "lora_A")
        raise AdapterError(
            f"{weights_path}: layer {layer} {module} has {have} "
            f"({factors.a_name or factors.b_name}) but no {missing}"
        )
    a, b = factors.a, factors.b
    for tensor_name, tensor in ((factors.a_name, a), (factors.b_name, b)):
        if tensor.dim() != 2:
            raise AdapterError(
                f"{weights_path}: tensor {tensor_name} has shape {list(tensor.shape)}, "
                "expected a matrix"
            )
        if not tensor.is_floating_point():
            raise AdapterError(
                f"{weights_path}: tensor {tensor_name} has dtype {tensor.dtype}, expected "
                "floating point"
            )
    rank = int(a.shape[0])
    if b.shape[1] != rank:
        raise AdapterError(
            f"{weights_path}: layer {layer} {module}: lora_A has rank {rank} "
            f"({list(a.shape)}) but lora_B has rank {b.shape[1]} ({list(b.shape)})"
        )
    expected_rank = _pattern_value(config.rank_pattern, factors.module_path, config.r)
    if rank != expected_rank:
        raise AdapterError(
            f"{weights_path}: layer {layer} {module} has rank {rank}, but {CONFIG_FILE} "
            f"says {expected_rank} (r / rank_pattern)"
        )
    in_features, out_features = arch.linear_shapes(model_config)[module]
    if a.shape[1] != in_features or b.shape[0] != out_features:
        raise AdapterError(
            f"{weights_path}: layer {layer} {module} has lora_A {list(a.shape)} and lora_B "
            f"{list(b.shape)}, but the base model needs [{rank}, {in_features}] and "
            f"[{out_features}, {rank}]; was the adapter trained for a different base model?"
        )
    alpha = _pattern_value(config.alpha_pattern, factors.module_path, config.lora_alpha)
    scaling = alpha / math.sqrt(rank) if config.use_rslora else alpha / rank

    out: list[torch.Tensor] = []
    for tensor_name, tensor in ((factors.a_name, a), (factors.b_name, b)):
        if not bool(torch.isfinite(tensor).all()):
            raise AdapterError(f"{weights_path}: tensor {tensor_name} has NaN or Inf values")
        cast = tensor.to(dtype)
        if not bool(torch.isfinite(cast).all()):
            raise AdapterError(f"{weights_path}: tensor {tensor_name} overflows {dtype}")
        out.append(cast)
    a_out, b_out = out
    rope_rows = arch.rope_rows(module, model_config)
    if rope_rows:
        b_out = interleave_leading_rows(b_out, rope_rows, model_config.head_dim)
    # B is kept as the transpose of a contiguous B^T: the layout the CPU slots read in
    # place (loraplex_kernels/reference.py PackedLoRA), so a CPU slot needs no copy of it.
    return LoRAModule(a=a_out.contiguous(), b=b_out.t().contiguous().t(), scaling=float(scaling))
