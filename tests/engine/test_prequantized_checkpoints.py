"""Pre-quantized checkpoints (GPTQ, AWQ, compressed-tensors) served at their own precision.

Each format is built from a tiny random Llama: compressed-tensors by the library itself,
GPTQ and AWQ to their published layouts (tests/utils/quantized_checkpoints.py). The oracle
is the float model each stands for (compressed-tensors: the library's own decompression),
run by HF and PEFT; the engine must agree with it as closely as with its own quantization
on load (tests/utils/quantized.py's tolerances), for the base and two adapters of mixed
ranks in the same steps. A corrupt or mismatched checkpoint must fail when the engine
loads, in one line naming the layer.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.models.config import ModelLoadError
from engine.models.quantized import QuantEmbedding, QuantLinear
from loraplex_kernels import cpu_quant
from tests.utils.peft_adapters import make_peft_adapter
from tests.utils.quantized import LINEARS, assert_engine_agrees_with_oracle
from tests.utils.quantized_checkpoints import (
    awq_checkpoint,
    compressed_tensors_checkpoint,
    gptq_checkpoint,
)

pytestmark = pytest.mark.skipif(not cpu_quant.available(), reason="no C compiler here")

Builder = Callable[[Path, Path, Path], tuple[Path, Path]]

# name -> (builder(model_dir, out_dir, oracle_dir), bits, group the engine runs)
FORMATS: dict[str, tuple[Builder, int, int]] = {
    "gptq-int4-g64": (lambda m, o, r: gptq_checkpoint(m, o, r, bits=4, group=64), 4, 64),
    "gptq-int4-sym-v2": (lambda m, o, r: gptq_checkpoint(m, o, r, bits=4, group=32,
                                                         symmetric=True, v2=True), 4, 32),
    "gptq-int4-act-order": (lambda m, o, r: gptq_checkpoint(m, o, r, bits=4, group=32,
                                                            act_order=True), 4, 32),
    "gptq-int8-channel": (lambda m, o, r: gptq_checkpoint(m, o, r, bits=8, group=None,
                                                          symmetric=True), 8, 0),
    "awq-int4-g64": (lambda m, o, r: awq_checkpoint(m, o, r, group=64), 4, 64),
    "ct-pack-int4-g32": (lambda m, o, r: compressed_tensors_checkpoint(
        m, o, r, bits=4, symmetric=False, group=32), 4, 32),
    "ct-pack-int4-sym-channel": (lambda m, o, r: compressed_tensors_checkpoint(
        m, o, r, bits=4, symmetric=True, group=None), 4, 0),
    "ct-pack-int8-g32": (lambda m, o, r: compressed_tensors_checkpoint(
        m, o, r, bits=8, symmetric=False, group=32), 8, 32),
    "ct-int-quantized-int8": (lambda m, o, r: compressed_tensors_checkpoint(
        m, o, r, bits=8, symmetric=True, group=None, fmt="int-quantized"), 8, 0),
}


@pytest.fixture(scope="module")
def adapters(tiny_model_factory, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tiny_model_factory("llama_gqa")
    root = tmp_path_factory.mktemp("prequant_adapters")
    return {
        "attn4": make_peft_adapter(base, root / "attn4", r=4, alpha=8, seed=41,
                                   targets=("q_proj", "k_proj", "v_proj", "o_proj")),
        "all16": make_peft_adapter(base, root / "all16", r=16, alpha=16, seed=42,
                                   targets=LINEARS),
    }


def _core(model_dir: Path, **settings: object) -> EngineCore:
    return EngineCore(EngineConfig(model=str(model_dir), dtype="float32", max_loras=2,
                                   max_cpu_loras=2, max_lora_rank=16, max_num_seqs=64,
                                   **settings))  # type: ignore[arg-type]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_prequantized_checkpoint_serves_what_it_stores(
    fmt: str, tiny_model_factory, adapters: dict[str, Path], tmp_path: Path
) -> None:
    build, bits, group = FORMATS[fmt]
    base = tiny_model_factory("llama_gqa")
    checkpoint, oracle = build(base, tmp_path / "checkpoint", tmp_path / "oracle")
    config = json.loads((checkpoint / "config.json").read_text())
    assert "quantization_config" in config
    core = _core(checkpoint)
    runner = core.runner
    assert runner.checkpoint_scheme is not None
    assert runner.quantization.scheme == f"int{bits}"
    method = {"gptq": "GPTQ", "awq": "AWQ"}.get(fmt.split("-")[0], "compressed-tensors")
    assert runner.describe_quantization().startswith(f"int{bits} (")
    assert runner.describe_quantization().endswith(f", as stored: {method}" + (
        f" {runner.checkpoint_scheme.fmt}" if method == "compressed-tensors" else ""))
    layers = [m for m in runner.model.layers.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 4 * 2  # qkv, o, gate_up, down of both layers, fused as stored
    for layer in layers:
        assert layer.quantized.bits == bits
        assert layer.quantized.group_size == (group or layer.in_features)
        # Act-order layers gather their inputs into the stored order; the rest do not.
        assert (layer.input_order is not None) == ("act-order" in fmt)
    assert isinstance(runner.model.embed_tokens, QuantEmbedding)
    assert_engine_agrees_with_oracle(core, oracle, adapters)


def test_a_float_checkpoint_is_quantized_as_it_loads(tiny_model_factory) -> None:
    """With --quantization, each float linear is quantized when its tensor arrives: the
    layer's float parameter is never written (so it never becomes resident)."""
    from engine.config import QuantizationSpec
    from engine.models.loader import iter_safetensors, load_model_config
    from engine.models.registry import model_class_for

    base = tiny_model_factory("llama_gqa")
    config = load_model_config(base)
    model = model_class_for(config)(config, max_positions=64, device=torch.device("cpu"),
                                    dtype=torch.float32)
    count = model.load_weights(iter_safetensors(base), quantize=QuantizationSpec("int4"))
    assert count == 4 * 2
    assert not any(isinstance(m, torch.nn.Linear) for m in model.layers.modules())
    assert sum(isinstance(m, QuantLinear) for m in model.layers.modules()) == 4 * 2


@pytest.mark.parametrize(
    ("build", "message"),
    [
        # config.json says groups of 32; the tensors hold groups of 64.
        (lambda m, o, r: gptq_checkpoint(m, o, r, group=64, config_group=32),
         r"GPTQ, int4 \(groups of 32\): layer model\.layers\.\d+\.\S+ has scales "
         r"of shape \[\d+, \d+\]; \[\d+, \d+\] is expected for groups of 32"),
        (lambda m, o, r: gptq_checkpoint(
            m, o, r, drop=("model.layers.1.self_attn.k_proj.scales",)),
         r"layer model\.layers\.1\.self_attn\.k_proj lacks scales"),
        (lambda m, o, r: gptq_checkpoint(m, o, r, group=64, bad_g_idx=True),
         r"layer model\.layers\.\d+\.mlp\.down_proj has a g_idx that does not put 64 "
         r"inputs in each of 2 groups"),
    ],
    ids=["wrong-group-size", "missing-scales", "uneven-act-order-groups"],
)
def test_a_corrupt_or_mismatched_checkpoint_fails_at_load(
    build: Builder, message: str, tiny_model_factory, tmp_path: Path
) -> None:
    checkpoint, _ = build(tiny_model_factory("llama_gqa"), tmp_path / "c", tmp_path / "o")
    with pytest.raises(ModelLoadError, match=message):
        _core(checkpoint)


def test_packed_weights_of_the_wrong_shape_fail_at_load(tiny_model_factory,
                                                        tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    checkpoint, _ = gptq_checkpoint(tiny_model_factory("llama_gqa"), tmp_path / "c",
                                    tmp_path / "o")
    state = load_file(str(checkpoint / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.qweight"
    state[name] = state[name][:, :64].contiguous()  # half its output columns
    save_file(state, str(checkpoint / "model.safetensors"))
    # The packed integers disagree with the layer's scales ...
    with pytest.raises(ModelLoadError,
                       match=r"layer model\.layers\.0\.mlp\.up_proj has scales of shape "
                             r"\[1, 128\]; \[1, 64\] is expected"):
        _core(checkpoint)
    # ... and, cut consistently, with the model's config.
    for part in ("qzeros", "scales"):
        cut = f"model.layers.0.mlp.up_proj.{part}"
        state[cut] = state[cut][:, :64 if part == "scales" else 8].contiguous()
    save_file(state, str(checkpoint / "model.safetensors"))
    with pytest.raises(ModelLoadError,
                       match=r"tensor model\.layers\.0\.mlp\.up_proj\.weight has shape "
                             r"\[64, 64\], the config expects \[128, 64\]"):
        _core(checkpoint)


@pytest.mark.parametrize(
    ("quantization_config", "message"),
    [
        ({"quant_method": "bitsandbytes", "load_in_4bit": True},
         r"quantization 'bitsandbytes' in config\.json is not served; served: GPTQ"),
        ({"quant_method": "gptq", "bits": 3, "group_size": 128},
         r"GPTQ with 3 bits is not served"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
         r"AWQ version 'gemv' is not served"),
        ({"quant_method": "compressed-tensors", "format": "float-quantized",
          "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float"}}}},
         r"compressed-tensors format 'float-quantized' is not served"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 7},
         r"group size 7 is not an even number"),
    ],
)
def test_a_scheme_that_is_not_served_is_refused_in_one_line(
    quantization_config: dict, message: str, tiny_model_factory, tmp_path: Path
) -> None:
    import shutil

    checkpoint = tmp_path / "model"
    shutil.copytree(tiny_model_factory("llama_gqa"), checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message) as info:
        _core(checkpoint)
    assert "\n" not in str(info.value)


def test_quantization_that_disagrees_with_the_checkpoint_is_refused(
    tiny_model_factory, tmp_path: Path
) -> None:
    checkpoint, _ = awq_checkpoint(tiny_model_factory("llama_gqa"), tmp_path / "c",
                                   tmp_path / "o")
    with pytest.raises(ValueError, match=r"--quantization int8 cannot serve c: its weights "
                                         r"are AWQ, int4 \(groups of 64\)"):
        _core(checkpoint, quantization="int8")
    with pytest.raises(ValueError, match=r"--quantization w8a8 quantizes a float checkpoint; c "
                                         r"is AWQ, int4 \(groups of 64\)"):
        _core(checkpoint, quantization="w8a8")
    # The matching scheme is accepted: the checkpoint's groups are kept.
    core = _core(checkpoint, quantization="int4")
    assert core.runner.quantization.group == 64


def test_fused_parts_must_share_one_input_order() -> None:
    from engine.models.quantized import QuantizedRows

    def part(order: torch.Tensor | None) -> QuantizedRows:
        return QuantizedRows(torch.zeros(16, 64, dtype=torch.uint8), torch.ones(16, 2),
                             torch.zeros(16, 2), 4, 32, order)

    same = torch.randperm(64, generator=torch.Generator().manual_seed(1))
    fused = QuantizedRows.cat([part(same), part(same.clone())])
    assert fused.shape == (32, 64) and torch.equal(fused.input_order, same)
    assert QuantizedRows.cat([part(None), part(None)]).input_order is None
    for other in (None, torch.arange(64)):
        with pytest.raises(ValueError, match="different act-order input orders"):
            QuantizedRows.cat([part(same), part(other)])
