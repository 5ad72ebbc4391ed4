"""The bundled SmolLM2 GGUF read at its own precision: Q4_1 blocks as int4 groups of 32.

The reader's values are checked against transformers' own conversion of the same file
(the safetensors cache every test serves), tensor by tensor; the engine serving
`--quantization int4` from the blocks is checked against HF and PEFT on that float
model (whose linears are exactly the blocks' values) with its embeddings on the engine's
int8 grid.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.models.config import ModelLoadError
from engine.models.gguf_weights import GGUF_GROUP, gguf_tensors, read_gguf
from engine.models.loader import (
    SOURCE_MARKER,
    bundled_gguf_path,
    bundled_source,
    iter_safetensors,
    load_model_config,
)
from engine.models.quantized import QuantizedRows, QuantLinear
from loraplex_kernels import cpu_quant
from tests.utils.peft_adapters import make_peft_adapter
from tests.utils.quantized import assert_engine_agrees_with_oracle
from tests.utils.quantized_checkpoints import save_oracle

pytestmark = pytest.mark.skipif(not cpu_quant.available(), reason="no C compiler here")


def test_the_gguf_reader_gives_the_values_transformers_converts(smollm2_dir: Path) -> None:
    assert bundled_source(smollm2_dir) == bundled_gguf_path()
    cache = dict(iter_safetensors(smollm2_dir))
    seen = set()
    quantized = 0
    for name, value in gguf_tensors(bundled_gguf_path(), load_model_config(smollm2_dir),
                                    native=True):
        if isinstance(value, QuantizedRows):
            # The decoder linears' Q4_1 blocks, and the embedding table's Q8_0 ones.
            bits = 8 if name == "model.embed_tokens.weight" else 4
            assert (value.bits, value.group) == (bits, GGUF_GROUP), name
            got = cpu_quant.dequantize_reference(value.pack())
            quantized += 1
        else:
            got = value
        assert got.shape == cache[name].shape, name
        assert torch.equal(got, cache[name]), (name, float((got - cache[name]).abs().max()))
        seen.add(name)
    assert seen == set(cache)
    assert quantized == 7 * 30 + 1  # every decoder linear of the 30 layers is Q4_1


def test_a_damaged_gguf_fails_in_one_line(tmp_path: Path) -> None:
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(bundled_gguf_path().read_bytes()[: 20_000_000])
    with pytest.raises(ModelLoadError, match=r"is not a GGUF file the engine can read: tensor "
                                             r"\S+ \[\d+(, \d+)?\] does not fit the file"):
        read_gguf(truncated)
    wrong = tmp_path / "wrong.gguf"
    wrong.write_bytes(b"GGML" + bytes(64))
    with pytest.raises(ModelLoadError, match=r"not a GGUF v2 / v3 file"):
        read_gguf(wrong)


@pytest.fixture(scope="module")
def served_from_blocks(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
                       ) -> tuple[EngineCore, Path, dict[str, Path]]:
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("gguf_int4")
    oracle = save_oracle(
        AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32),
        smollm2_dir, root / "oracle")
    adapters = {
        "attn8": make_peft_adapter(smollm2_dir, root / "attn8", r=8, alpha=16, seed=51,
                                   targets=("q_proj", "k_proj", "v_proj", "o_proj")),
        "all4": make_peft_adapter(smollm2_dir, root / "all4", r=4, alpha=8, seed=52,
                                  targets=("q_proj", "k_proj", "v_proj", "o_proj",
                                           "gate_proj", "up_proj", "down_proj")),
    }
    core = EngineCore(EngineConfig(model=str(smollm2_dir), dtype="float32",
                                   quantization="int4", max_loras=2, max_cpu_loras=2,
                                   max_lora_rank=8, max_num_seqs=64))
    return core, oracle, adapters


def test_int4_on_the_bundled_model_serves_its_q4_1_blocks(served_from_blocks,
                                                          smollm2_dir: Path) -> None:
    core, oracle, adapters = served_from_blocks
    assert core.runner.gguf_source == bundled_gguf_path()
    assert core.runner.describe_quantization() == "int4 (groups of 32), as stored: GGUF Q4_1"
    model = core.runner.model
    layers = [m for m in model.layers.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 4 * 30
    assert {(m.quantized.bits, m.quantized.group_size) for m in layers} == {(4, GGUF_GROUP)}
    # The embedding table is the file's Q8_0 blocks as stored (no float table made): the
    # integers and scales that quantizing its float values (transformers' conversion)
    # gives, and the tied output projection reads the same ones.
    table = model.embed_tokens.quantized
    floats = next(t for n, t in iter_safetensors(smollm2_dir) if n == "model.embed_tokens.weight")
    want = cpu_quant.quantize(floats, 8, GGUF_GROUP)
    assert torch.equal(table.qweight, want.qweight) and torch.equal(table.scales, want.scales)
    assert model.lm_head.quantized is table and model.embedding_rows is None
    assert_engine_agrees_with_oracle(core, oracle, adapters)


def test_a_copy_without_the_marker_is_quantized_on_load(smollm2_dir: Path,
                                                        tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(smollm2_dir, copy)
    (copy / SOURCE_MARKER).unlink()
    assert bundled_source(copy) is None
    core = EngineCore(EngineConfig(model=str(copy), dtype="float32", quantization="int4",
                                   max_loras=1, max_num_seqs=4))
    assert core.runner.gguf_source is None
    assert core.runner.quantization.group == GGUF_GROUP
    assert core.runner.describe_quantization() == "int4 (groups of 32)"
