"""What loading a model leaves in the process: no checkpoint mapping held past the load, no
quantized layer's unpacked integers held past its last part, and no torch._dynamo (nor the
Triton it imports) on the CPU path. Each of these was a share of a quantized server's RSS
(docs/BENCHMARKS.md, "A quantized server's memory")."""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.config import QuantizationSpec
from engine.models.gguf_weights import gguf_tensors
from engine.models.loader import bundled_gguf_path, iter_safetensors, load_model_config
from engine.models.quantized import QuantLinear
from engine.models.registry import model_class_for
from loraplex_kernels import cpu_quant

REPO = Path(__file__).resolve().parents[2]


def _mapped(path: Path) -> bool:
    return str(path) in Path("/proc/self/maps").read_text()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux's /proc")
def test_reading_the_gguf_holds_no_mapping_of_it(smollm2_dir: Path) -> None:
    """The header is read from a mapping released before the first tensor is given, and
    each tensor's bytes are read into memory of their own: a mapping's pages stayed in the
    RSS for the whole load (the file's 96 MiB on top of the weights made from it)."""
    path = bundled_gguf_path()
    config = load_model_config(smollm2_dir)
    gc.collect()
    gc.disable()  # no collector pass may be what unmaps it
    try:
        tensors = gguf_tensors(path, config, native=True)
        names, held = [], []
        for name, tensor in tensors:
            names.append(name)
            held.append(tensor)  # the tensors given so far, all of them kept
            if len(names) in (1, 100):
                assert not _mapped(path), f"mapped while {name} is read"
        assert len(names) == 272 and not _mapped(path)
    finally:
        gc.enable()


@pytest.mark.skipif(not cpu_quant.available(), reason="no C compiler here")
def test_a_quantized_layer_is_packed_as_soon_as_its_last_part_is_in(tiny_model_factory) -> None:
    """Layer by layer: when the first layer's parts are all in, it is a QuantLinear before
    the next layer's first tensor is read."""
    model_dir = tiny_model_factory("llama_gqa")
    config = load_model_config(model_dir)
    model = model_class_for(config)(config, dtype=torch.float32)
    seen: list[tuple[str, int]] = []

    def counting():
        for name, tensor in sorted(iter_safetensors(model_dir)):
            seen.append((name, sum(isinstance(m, QuantLinear) for m in model.layers.modules())))
            yield name, tensor

    assert model.load_weights(counting(), quantize=QuantizationSpec("int8")) == 4 * 2
    # By the time layer 1's tensors are read (sorted names: all of layer 0's first), the
    # four linears of layer 0 are packed.
    first_of_layer_1 = next(count for name, count in seen if name.startswith("model.layers.1."))
    assert first_of_layer_1 == 4
    assert sum(isinstance(m, QuantLinear) for m in model.layers.modules()) == 8


def test_building_and_loading_a_model_on_the_cpu_imports_no_dynamo(smollm2_dir: Path) -> None:
    """nn.Embedding's random init on the meta device imports torch._dynamo, which imports
    Triton (~130 MiB resident together); the engine gives it its table instead."""
    code = (
        "import sys\n"
        "from engine.config import EngineConfig\n"
        "from engine.core.engine_core import EngineCore\n"
        f"EngineCore(EngineConfig(model={str(smollm2_dir)!r}, dtype='float32',"
        " quantization='int4', kv_cache_tokens=256, max_loras=1))\n"
        "print(sorted(m for m in ('torch._dynamo', 'triton') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-2000:]


@pytest.mark.parametrize("variant", ["llama_gqa", "llama_attention_bias"])
def test_a_load_that_quantizes_never_makes_the_float_linears(tiny_model_factory,
                                                            variant: str) -> None:
    """quantized_linears: the decoder linear weights stay on the meta device (no memory:
    on a GPU the float model would be allocated in full otherwise), their biases are made
    and loaded; after a quantizing load nothing of the model is left on meta."""
    model_dir = tiny_model_factory(variant)
    config = load_model_config(model_dir)
    model = model_class_for(config)(config, dtype=torch.float32, quantized_linears=True)
    linears = [m for m in model.layers.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.weight.is_meta for m in linears)
    assert all(m.bias is None or not m.bias.is_meta for m in linears)
    assert not model.embed_tokens.weight.is_meta
    assert model.load_weights(iter_safetensors(model_dir),
                              quantize=QuantizationSpec("int4")) == 4 * 2
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    layers = [m for m in model.layers.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 8 and not any(isinstance(m, torch.nn.Linear)
                                        for m in model.layers.modules())
    biased = [m for m in layers if m.bias_f32 is not None]
    assert bool(biased) == (variant == "llama_attention_bias")
    # The biases are the checkpoint's, not the empty memory they were made in.
    from safetensors.torch import load_file

    stored = load_file(model_dir / "model.safetensors")
    if biased:
        o_bias = stored["model.layers.0.self_attn.o_proj.bias"]
        assert torch.equal(model.layers[0].self_attn.o_proj.bias_f32, o_bias.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_bias_read_after_its_layers_weights_is_kept(tiny_model_factory,
                                                      dtype: torch.dtype) -> None:
    """A sharded checkpoint may put a layer's bias after a shard boundary, past its
    weights: the layer is packed only once its bias is in too (its QuantLinear holds a
    copy of the bias)."""
    model_dir = tiny_model_factory("llama_attention_bias")
    config = load_model_config(model_dir)
    stored = dict(iter_safetensors(model_dir))
    weights_first = sorted(stored.items(), key=lambda item: item[0].endswith(".bias"))
    model = model_class_for(config)(config, dtype=dtype, quantized_linears=True)
    assert model.load_weights(iter(weights_first), quantize=QuantizationSpec("int8")) == 8
    for name, tensor in stored.items():
        # (q and k rows are stored rope-interleaved: their biases are not slices as read.)
        if name.startswith("model.layers.") and name.endswith("_proj.bias") \
                and not name.endswith(("q_proj.bias", "k_proj.bias")):
            parent, _, proj = name.removeprefix("model.").removesuffix(".bias").rpartition(".")
            fused = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                     "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
            layer = model.get_submodule(f"{parent}.{fused.get(proj, proj)}")
            assert isinstance(layer, QuantLinear)
            assert layer.bias_f32 is not None
            want = tensor.to(dtype).float()
            assert any(torch.equal(layer.bias_f32[i:i + want.numel()], want)
                       for i in range(0, layer.bias_f32.numel() - want.numel() + 1)), name


def _with_stored_embeddings(model_dir: Path, q_edit=None, group: int = 32):
    """The checkpoint's tensors, its embedding table as int8 QuantizedRows in `group`s (a
    GGUF's Q8_0 blocks), and those rows."""
    from engine.models.quantized import QuantizedRows

    tensors = dict(iter_safetensors(model_dir))
    table = tensors["model.embed_tokens.weight"]
    q, scales, _, _ = cpu_quant.quantize_integers(table, 8, group)
    if q_edit is not None:
        q_edit(q)
    rows = QuantizedRows(q, scales, None, 8, group)
    tensors["model.embed_tokens.weight"] = rows  # type: ignore[assignment]
    return tensors, rows


def _load_stored(model_dir: Path, tensors) -> torch.nn.Module:
    config = load_model_config(model_dir)
    model = model_class_for(config)(config, dtype=torch.float32, quantized_linears=True)
    model.load_weights(iter(tensors.items()), quantize=QuantizationSpec("int8"))
    return model


@pytest.mark.skipif(not cpu_quant.available(), reason="no C compiler here")
def test_an_embedding_table_stored_as_int8_is_served_as_stored(tiny_model_factory) -> None:
    from engine.models.quantized import QuantEmbedding, quantize_embeddings

    model_dir = tiny_model_factory("llama_gqa")
    tensors, rows = _with_stored_embeddings(model_dir)
    model = _load_stored(model_dir, tensors)
    assert model.embedding_rows is rows  # kept aside; the float table never written
    assert quantize_embeddings(model, torch.float32)
    assert isinstance(model.embed_tokens, QuantEmbedding) and model.embedding_rows is None
    want = cpu_quant.pack(rows.q, rows.scales, None, 8, 32)
    got = model.embed_tokens.quantized
    assert torch.equal(got.qweight, want.qweight) and torch.equal(got.scales, want.scales)
    assert model.lm_head.quantized is got


@pytest.mark.skipif(not cpu_quant.available(), reason="no C compiler here")
@pytest.mark.parametrize("case", ["an integer of -128", "groups of 16"])
def test_an_int8_table_off_the_served_grid_is_quantized_from_its_values(
        tiny_model_factory, case: str) -> None:
    """An integer the symmetric layouts do not hold, or groups other than the served ones:
    the table's float values (q * scale) are quantized as a float checkpoint's would be."""
    from engine.models.quantized import quantize_embeddings, stored_floats

    def edit(q: torch.Tensor) -> None:
        q[5, 3] = -128

    model_dir = tiny_model_factory("llama_gqa")
    tensors, rows = _with_stored_embeddings(
        model_dir, q_edit=edit if case == "an integer of -128" else None,
        group=16 if case == "groups of 16" else 32)
    model = _load_stored(model_dir, tensors)
    assert quantize_embeddings(model, torch.float32)
    want = cpu_quant.quantize(stored_floats(rows), 8, 32)
    got = model.embed_tokens.quantized
    assert torch.equal(got.qweight, want.qweight) and torch.equal(got.scales, want.scales)


def test_an_int8_table_kept_as_floats_gets_its_values(smollm2_dir: Path,
                                                      tmp_path: Path) -> None:
    """A vocabulary that is not a multiple of the kernels' 16-row blocks keeps its table
    in floats: the stored rows' values are written into it."""
    from engine.models.quantized import quantize_embeddings, stored_floats
    from tests.utils.tiny_models import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "odd_vocab", smollm2_dir, vocab_size=1000)
    tensors, rows = _with_stored_embeddings(model_dir)
    model = _load_stored(model_dir, tensors)
    assert not quantize_embeddings(model, torch.float32)
    assert model.embedding_rows is None
    assert torch.equal(model.embed_tokens.weight, stored_floats(rows))
