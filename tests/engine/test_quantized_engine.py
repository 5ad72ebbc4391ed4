"""A weight-only quantized base (--quantization int8 / int4) against Hugging Face on the
same dequantized weights, for the base model and PEFT adapters in mixed steps.

The oracle: the model's checkpoint with each decoder linear layer's weight replaced by
dequantize(quantize(w)), exactly the values the engine's integers and scales stand for
(quantization is per output row, so the engine's fused and rope-permuted q/k/v rows
quantize to the same rows). HF, and PEFT with the adapters on top, score the engine's
greedy tokens teacher-forced in float32.

The engine's kernel sums each group's integer products in float32 and scales the sum once
(cpu_quant.c), where HF multiplies by the dequantized float32 weights: the same sums up to
float32 rounding, so logprobs agree to tests/utils/quantized.py's LOGPROB_TOL and every
greedy token is HF's argmax unless HF's own top-2 margin is below its TIE_MARGIN. Against
the unquantized checkpoint the same comparison fails within the first three tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig, QuantizationSpec
from engine.core.engine_core import EngineCore
from engine.models.config import ModelLoadError
from engine.models.quantized import QuantEmbedding, QuantLinear
from engine.request import EngineRequest, SamplingParams
from loraplex_kernels import cpu_qdot, cpu_quant
from tests.utils.bf16_oracle import Agreement, engine_tokens_and_logprobs, hf_logprobs
from tests.utils.peft_adapters import make_peft_adapter
from tests.utils.quantized import (
    LINEARS,
    LOGPROB_TOL,
    assert_engine_agrees_with_oracle,
    dequantized_checkpoint,
)
from tests.utils.tiny_models import random_prompt

pytestmark = pytest.mark.skipif(not cpu_quant.available(), reason="no C compiler here")



@pytest.fixture(scope="module")
def adapters(tiny_model_factory, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tiny_model_factory("llama_gqa")
    root = tmp_path_factory.mktemp("quant_adapters")
    # Mixed ranks and targets: attention only at rank 4, every linear at rank 16.
    return {
        "attn4": make_peft_adapter(base, root / "attn4", r=4, alpha=8, seed=31,
                                   targets=("q_proj", "k_proj", "v_proj", "o_proj")),
        "all16": make_peft_adapter(base, root / "all16", r=16, alpha=16, seed=32,
                                   targets=LINEARS),
    }


@pytest.mark.parametrize(("scheme", "group"),
                         [("int8", None), ("int4", None), ("int4", 64), ("w8a8", None)])
def test_quantized_engine_agrees_with_hf_and_peft_on_the_dequantized_weights(
    scheme: str, group: int | None, tiny_model_factory, adapters: dict[str, Path],
    tmp_path: Path,
) -> None:
    base = tiny_model_factory("llama_gqa")
    spec = QuantizationSpec(scheme, group)
    oracle_dir = dequantized_checkpoint(base, tmp_path / "dequantized", spec)
    core = EngineCore(EngineConfig(model=str(base), dtype="float32", quantization=scheme,
                                   quantization_group_size=group, max_loras=2,
                                   max_cpu_loras=2, max_lora_rank=16, max_num_seqs=64))
    model = core.runner.model
    layers = [m for m in model.layers.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 4 * 2  # qkv, o, gate_up, down of both layers
    assert {m.quantized.bits for m in layers} == {spec.bits}
    # w8a8: every layer on the integer-activation kernel (the oracle's hooks stand for it).
    assert all(isinstance(m.quantized, cpu_qdot.QDotWeight) == spec.int8_activations
               for m in layers)
    # The tied output projection reads the embeddings' own int8 integers.
    assert isinstance(model.embed_tokens, QuantEmbedding) and isinstance(model.lm_head,
                                                                          QuantLinear)
    assert model.lm_head.quantized is model.embed_tokens.quantized
    assert model.lm_head.quantized.bits == 8
    # w8a8: the output projection's input quantized too, in the embeddings' groups.
    assert isinstance(model.lm_head.quantized, cpu_qdot.QDotWeight) == spec.int8_activations
    assert_engine_agrees_with_oracle(core, oracle_dir, adapters,
                                     int8_activations=spec.int8_activations)


# bf16 against HF bf16 on the dequantized weights, as test_bf16_accuracy.py holds SmolLM2
# (it says why bf16 cannot be bit-equal), adapted to a tiny random model, whose next-token
# distributions are nearly flat: only ~15% of positions have a clear top-2 margin, and HF
# bf16 itself picks float32's argmax at only ~93% of them. So: every clear position
# agrees; the engine picks float32's argmax no less often than HF bf16 does, less
# BF16_TOP1_SLACK of the positions; its RMS logprob error against float32 at most
# BF16_RMS_RATIO times HF bf16's own (measured 1.17 for int8); and its worst logprob
# difference from HF bf16 within BF16_LOGPROB_TOL (measured 0.37 for int8: a near-tie
# position where the two bf16 paths round differently).
BF16_CLEAR_MARGIN, BF16_TOP1_SLACK, BF16_LOGPROB_TOL, BF16_RMS_RATIO = 0.7, 0.03, 0.5, 1.75
# w8a8 in bf16: each layer's input is quantized from bf16 values, whose rounding moves
# some of them across a rounding boundary of x / scale against the float32 oracle's (a
# jump of one integer, where bf16 alone moves a value by 2^-9): HF bf16 with the same
# quantization picks float32's argmax at 344 of 384 positions against 356 for weight-only
# int8, the engine at 331, every clear position agreeing and its RMS error 1.19x HF
# bf16's. Its top-1 slack is W8A8_TOP1_SLACK of the positions.
W8A8_TOP1_SLACK = 0.05


@pytest.mark.parametrize(("scheme", "group"), [("int8", None), ("int4", None), ("w8a8", None)])
def test_quantized_bf16_engine_agrees_with_hf_bf16_on_the_dequantized_weights(
    scheme: str, group: int | None, tiny_model_factory, adapters: dict[str, Path],
    tmp_path: Path,
) -> None:
    """The quantized layers' bf16 steps (on AVX-512 BF16: the dot-product tiles, rows read
    as bf16; elsewhere float32 tiles over the widened rows) for the base and adapters in
    mixed steps of 2-16 rows, each greedy token scored by HF (PEFT) in bf16 and float32
    on the dequantized weights, teacher-forced."""
    base = tiny_model_factory("llama_gqa")
    oracle_dir = dequantized_checkpoint(base, tmp_path / "dequantized",
                                        QuantizationSpec(scheme, group))
    core = EngineCore(EngineConfig(model=str(base), dtype="bfloat16", quantization=scheme,
                                   quantization_group_size=group, max_loras=2,
                                   max_cpu_loras=2, max_lora_rank=16, max_num_seqs=64))
    assert core.runner.dtype == torch.bfloat16
    layers = [m.quantized for m in core.runner.model.layers.modules()
              if isinstance(m, QuantLinear)]
    assert layers
    wide = cpu_qdot.variant() == "vnni"
    if scheme == "int8":  # decoder layers on AVX-512 VNNI: against 16-bit activations
        assert all(isinstance(q, cpu_qdot.QDotWeight) and q.wide for q in layers) == wide
        assert all(isinstance(q, cpu_quant.QuantizedWeight) for q in layers) != wide
    if scheme != "w8a8":  # the output projection's int8 groups of 32, weight-only
        head = core.runner.model.lm_head.quantized
        assert (isinstance(head, cpu_qdot.QDotWeight) and head.wide and head.grouped) == wide
    for name, path in adapters.items():
        core.add_adapter(name, path)
    names: list[str | None] = [None, *adapters]
    requests = [
        EngineRequest(
            request_id=f"{i}", prompt_token_ids=tuple(random_prompt(8 + 7 * i, seed=200 + i)),
            adapter=names[i % len(names)],
            sampling=SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                    logprobs=0))
        for i in range(16)
    ]
    got = engine_tokens_and_logprobs(core, requests)
    agreement = Agreement()
    for r in requests:
        tokens, logprobs = got[r.request_id]
        kwargs = {"adapters": adapters, "adapter": r.adapter} if r.adapter else {}
        prompt = list(r.prompt_token_ids)
        bf16 = hf_logprobs(oracle_dir, torch.bfloat16, prompt, tokens, **kwargs)
        f32 = hf_logprobs(oracle_dir, torch.float32, prompt, tokens, **kwargs)
        agreement.add(logprobs, tokens, bf16, f32, clear_margin=BF16_CLEAR_MARGIN)
    report = agreement.summary()
    assert agreement.clear > 0 and agreement.top1_agree_clear == agreement.clear, report
    slack = W8A8_TOP1_SLACK if scheme == "w8a8" else BF16_TOP1_SLACK
    assert agreement.top1_agree_f32 >= (agreement.hf_bf16_agree_f32
                                        - slack * agreement.positions), report
    assert agreement.max_abs_vs_bf16 <= BF16_LOGPROB_TOL, report
    assert agreement.rms_vs_f32 <= BF16_RMS_RATIO * agreement.rms_hf_bf16_vs_f32, report


def test_quantized_weights_are_smaller_and_reported(tiny_model_factory) -> None:
    base = tiny_model_factory("llama_gqa")
    sizes = {}
    for scheme in ("none", "int8", "int4"):
        core = EngineCore(EngineConfig(model=str(base), dtype="float32", quantization=scheme,
                                       max_loras=1, max_num_seqs=4))
        sizes[scheme] = core.runner.weight_bytes
        assert core.runner.quantization.scheme == scheme
    # The decoder linears are 2 x 40,960 parameters, 4 bytes each unquantized; the tied
    # embeddings 49,152 x 64, held twice unquantized (the output projection's packed copy)
    # and once as int8 in groups of 32 (1 byte and a 4-byte scale per 32).
    linear_params = 2 * (64 * 128 + 64 * 64 + 64 * 256 + 128 * 64)
    table = 49152 * 64
    table_int8 = table + table // 32 * 4
    assert sizes["none"] - sizes["int8"] >= (
        linear_params * 3 - linear_params // 16 + 2 * table * 4 - table_int8)
    assert sizes["int8"] - sizes["int4"] >= linear_params // 2 - linear_params // 4
    assert sizes["int4"] < 0.3 * sizes["none"]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"quantization": "int3"}, "unknown quantization 'int3'"),
        ({"quantization": "int4", "quantization_group_size": 7}, "even number"),
        ({"quantization": "none", "quantization_group_size": 32}, "int8 and int4 only"),
    ],
)
def test_bad_quantization_settings_are_refused(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**settings)


def test_fp8_on_the_cpu_and_a_group_that_does_not_fit_fail_at_load(tiny_model_factory) -> None:
    base = tiny_model_factory("llama_gqa")
    with pytest.raises(ValueError, match=r"fp8 needs a CUDA GPU of compute capability 8\.9"):
        EngineCore(EngineConfig(model=str(base), device="cpu", quantization="fp8"))
    # 48 divides neither 64 nor 128 inputs: refused when the model loads, naming the layer.
    with pytest.raises(ModelLoadError, match=r"--quantization int4: "
                       r"model\.layers\.\d+\.\w+\.\w+\.weight \[64, (64|128)\]: "
                       r"group size 48 does not divide (64|128) input features"):
        EngineCore(EngineConfig(model=str(base), device="cpu", quantization="int4",
                                quantization_group_size=48))


def test_a_vocabulary_off_the_kernels_blocks_keeps_its_embeddings(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    from tests.utils.tiny_models import make_tiny_model

    base = make_tiny_model(tmp_path / "odd_vocab", smollm2_dir, vocab_size=49150)
    core = EngineCore(EngineConfig(model=str(base), dtype="float32", quantization="int8",
                                   max_loras=1, max_num_seqs=4))
    model = core.runner.model
    assert isinstance(model.embed_tokens, torch.nn.Embedding)
    assert not isinstance(model.lm_head, QuantLinear)
    prompt = random_prompt(12, seed=7, vocab_size=49150)
    request = EngineRequest(request_id="odd", prompt_token_ids=tuple(prompt),
                            sampling=SamplingParams(max_tokens=8, temperature=0,
                                                    ignore_eos=True, logprobs=0))
    [(tokens, logprobs)] = engine_tokens_and_logprobs(core, [request]).values()
    oracle = dequantized_checkpoint(base, tmp_path / "oracle", QuantizationSpec("int8"))
    hf = hf_logprobs(oracle, torch.float32, prompt, tokens)
    assert all(abs(lp - float(hf[i, t])) <= LOGPROB_TOL
               for i, (t, lp) in enumerate(zip(tokens, logprobs, strict=True)))


@pytest.mark.parametrize("amx", [True, False])
def test_a_long_bf16_step_multiplies_the_dequantized_weights_densely(
    amx: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past DENSE_ROWS rows a layer is dequantized and multiplied densely: where bf16
    matmuls are the faster in bf16 (the weights rounded to bf16, as the bf16 engine's own
    are), elsewhere in float32; both within bf16's rounding of the float32 product."""
    from engine.models import quantized

    gen = torch.Generator().manual_seed(5)
    qw = cpu_quant.quantize(torch.randn(96, 128, generator=gen), 8, None)
    bias = torch.randn(96, generator=gen)
    layer = QuantLinear(qw, bias)
    x = torch.randn(quantized.DENSE_ROWS + 40, 128, generator=gen).to(torch.bfloat16)
    monkeypatch.setattr(quantized, "bf16_dense_is_fast", lambda: amx)
    y = layer(x)
    w = cpu_quant.dequantize(qw)
    if amx:
        expected = (torch.nn.functional.linear(x, w.to(torch.bfloat16)).float() + bias)
    else:
        expected = torch.nn.functional.linear(x.float(), w, bias)
    assert y.dtype == torch.bfloat16 and torch.equal(y, expected.to(torch.bfloat16))
    exact = torch.nn.functional.linear(x.float(), w, bias)
    assert torch.allclose(y.float(), exact, rtol=2e-2, atol=0.1 * float(exact.abs().mean()))


@pytest.mark.parametrize("picked", [torch.bfloat16, torch.float32])
def test_the_dense_path_is_bf16_where_dtype_auto_would_serve_bf16(
    monkeypatch: pytest.MonkeyPatch, picked: torch.dtype
) -> None:
    """AMX, or AVX-512 BF16 timed faster (a Zen 4): what `--dtype auto` decides, once."""
    from engine.models import quantized
    from engine.runtime import cpu_features

    monkeypatch.setattr(cpu_features, "auto_cpu_dtype", lambda: picked)
    quantized.bf16_dense_is_fast.cache_clear()
    try:
        assert quantized.bf16_dense_is_fast() is (picked == torch.bfloat16)
    finally:
        quantized.bf16_dense_is_fast.cache_clear()
