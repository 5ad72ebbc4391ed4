"""PEFT adapter directories into LoRAWeights: the numbers checked against PEFT's own merged
weights, and every way an adapter can be refused, each with the message that names why."""

from __future__ import annotations

import math
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.lora.peft import load_peft_adapter
from engine.lora.weights import AdapterError, LoRAWeights
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import ModelConfig, validate_model_dir
from loraplex_kernels.reference import interleave_rope_rows
from tests.utils.peft_adapters import (
    DEFAULT_RELATIVE_DELTA,
    DELETE,
    convert_to_pickle,
    copy_adapter,
    edit_adapter_config,
    edit_adapter_tensors,
    lora_tensor_name,
    make_peft_adapter,
    read_adapter_tensors,
    truncate_weights,
)

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PHI3_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# Module -> how many of its leading output rows are q / k heads, which rope rotates.
_ROPE_ROWS: dict[str, Callable[[ModelConfig], int]] = {
    "q_proj": lambda c: c.q_size,
    "k_proj": lambda c: c.kv_size,
    "qkv_proj": lambda c: c.q_size + c.kv_size,
}
_WEIGHT_NAME = re.compile(r"^model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.weight$")


@pytest.fixture(scope="module")
def gqa_dir(tiny_model_factory: Callable[[str], Path]) -> Path:
    return tiny_model_factory("llama_gqa")


@pytest.fixture(scope="module")
def gqa_config(gqa_dir: Path) -> ModelConfig:
    return validate_model_dir(gqa_dir)


@pytest.fixture(scope="module")
def pristine_adapter(gqa_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A rank-4 adapter on every supported module of llama_gqa; tests break copies of it."""
    out = tmp_path_factory.mktemp("adapters") / "pristine"
    return make_peft_adapter(gqa_dir, out, r=4, alpha=8, targets=ALL_TARGETS, seed=7)


@pytest.fixture
def adapter(pristine_adapter: Path, tmp_path: Path) -> Path:
    return copy_adapter(pristine_adapter, tmp_path / "my-adapter")


def _peft_deltas(base_dir: Path, adapter_dir: Path) -> dict[tuple[int, str], torch.Tensor]:
    """(layer, module) -> merged weight minus base weight, by PEFT's merge_and_unload."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    before = {name: p.detach().clone() for name, p in base.named_parameters()}
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    deltas: dict[tuple[int, str], torch.Tensor] = {}
    for name, param in merged.named_parameters():
        delta = param.detach() - before[name]
        if bool(delta.any()):
            match = _WEIGHT_NAME.match(name)
            assert match is not None, f"PEFT changed {name}"
            deltas[(int(match[1]), match[2])] = delta
    return deltas


def _peft_rank_and_scaling(
    base_dir: Path, adapter_dir: Path
) -> dict[tuple[int, str], tuple[int, float]]:
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter_dir))
    found = {}
    for name, layer in model.named_modules():
        if isinstance(layer, LoraLayer):
            match = re.search(r"layers\.(\d+)\.\w+\.(\w+)$", name)
            assert match is not None, name
            found[(int(match[1]), match[2])] = (layer.r["default"], layer.scaling["default"])
    return found


def _dense(weights: LoRAWeights, key: tuple[int, str]) -> torch.Tensor:
    module = weights.modules[key]
    return module.scaling * (module.b.double() @ module.a.double())


# ---------------------------------------------------------------------------- numbers


@pytest.mark.parametrize(
    ("variant", "r", "alpha", "targets", "use_rslora", "extra"),
    [
        ("llama_gqa", 8, 16, ("q_proj", "v_proj"), False, {}),
        # mistral's head_dim 24 makes q_size (96) differ from hidden_size (64)
        ("mistral", 4, 32, ("q_proj", "k_proj", "v_proj", "o_proj"), True, {}),
        ("mistral", 2, 4, ("gate_proj", "up_proj", "down_proj"), False, {}),
        ("llama_mha_untied", 16, 8, "all-linear", True, {}),
        ("qwen2_bias", 3, 5, r".*\.(k_proj|down_proj)", False, {}),
        ("llama_gqa", 5, 7, ALL_TARGETS, False, {"layers_to_transform": [1]}),
        ("qwen3", 4, 8, ALL_TARGETS, False, {}),
        ("phi3", 4, 8, PHI3_TARGETS, False, {}),
        ("phi3", 2, 4, "all-linear", True, {}),
    ],
    ids=[
        "qv",
        "attention-rslora",
        "mlp",
        "all-linear",
        "regex",
        "one-layer",
        "qwen3",
        "phi3-fused",
        "phi3-all-linear",
    ],
)
def test_dense_delta_equals_peft_merged_weights(
    tiny_model_factory: Callable[[str], Path],
    tmp_path: Path,
    variant: str,
    r: int,
    alpha: float,
    targets: tuple[str, ...] | str,
    use_rslora: bool,
    extra: dict[str, Any],
) -> None:
    base_dir = tiny_model_factory(variant)
    config = validate_model_dir(base_dir)
    adapter_dir = make_peft_adapter(
        base_dir,
        tmp_path / "ad",
        r=r,
        alpha=alpha,
        targets=targets,
        use_rslora=use_rslora,
        seed=r,
        **extra,
    )
    weights = load_peft_adapter(adapter_dir, config, max_rank=64)
    expected = _peft_deltas(base_dir, adapter_dir)

    assert set(weights.modules) == set(expected)
    assert (weights.name, weights.path, weights.rank) == ("ad", adapter_dir, r)
    assert (weights.alpha, weights.use_rslora) == (alpha, use_rslora)
    scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
    for key, delta in expected.items():
        module = weights.modules[key]
        assert module.scaling == pytest.approx(scaling)
        assert module.a.dtype == module.b.dtype == torch.float32
        assert module.a.is_contiguous() and module.b.t().is_contiguous()  # B^T rows
        rotated = _ROPE_ROWS.get(key[1], lambda c: 0)(config)
        if rotated:  # the q and k heads' rows, in the model's pair-interleaved order
            head_rows = interleave_rope_rows(delta[:rotated], config.head_dim)
            delta = torch.cat((head_rows, delta[rotated:]))
        torch.testing.assert_close(_dense(weights, key).float(), delta, rtol=1e-4, atol=1e-5)


def test_rope_permutation_applies_to_q_and_k_only(adapter: Path, gqa_config: ModelConfig) -> None:
    weights = load_peft_adapter(adapter, gqa_config, max_rank=8)
    tensors = read_adapter_tensors(adapter)
    assert len(weights.modules) == 2 * len(ALL_TARGETS)
    for (layer, module), loaded in weights.modules.items():
        a = tensors[lora_tensor_name(layer, module, "lora_A")]
        b = tensors[lora_tensor_name(layer, module, "lora_B")]
        torch.testing.assert_close(loaded.a, a, rtol=0, atol=0)
        if module in ("q_proj", "k_proj"):
            assert not torch.equal(loaded.b, b)
            b = interleave_rope_rows(b, gqa_config.head_dim)
        torch.testing.assert_close(loaded.b, b, rtol=0, atol=0)


def test_rank_and_alpha_patterns_match_peft(gqa_dir: Path, tmp_path: Path) -> None:
    # Keys match the whole module path or a dotted suffix of it, as regular expressions,
    # and the first matching key wins even when a later one would match too. (PEFT writes
    # the config with sorted keys, so the order here is the order in the file.)
    rank_pattern = {"layers.1.self_attn.q_proj": 6, r"layers\.1\.mlp\.\w+": 3, "q_proj": 2}
    # "mlp" and "proj" match no module: neither is the whole last part of a module path.
    alpha_pattern = {
        "^model.layers.0.mlp.down_proj": 3,
        r"layers\.\d\.self_attn\.v_proj": 20,
        "mlp": 100,
        "proj": 50,
    }
    adapter_dir = make_peft_adapter(
        gqa_dir,
        tmp_path / "patterns",
        r=4,
        alpha=8,
        targets=ALL_TARGETS,
        rank_pattern=rank_pattern,
        alpha_pattern=alpha_pattern,
    )
    weights = load_peft_adapter(adapter_dir, validate_model_dir(gqa_dir), max_rank=8)

    def expected(layer: int, module: str) -> tuple[int, float]:
        rank = 4
        if module == "q_proj":
            rank = 6 if layer == 1 else 2
        elif layer == 1 and _parent(module) == "mlp":
            rank = 3
        alpha = {(0, "down_proj"): 3.0, (0, "v_proj"): 20.0, (1, "v_proj"): 20.0}
        return rank, alpha.get((layer, module), 8.0) / rank

    got = {key: (m.rank, m.scaling) for key, m in weights.modules.items()}
    assert got == {(i, m): expected(i, m) for i in range(2) for m in ALL_TARGETS}
    assert got == _peft_rank_and_scaling(gqa_dir, adapter_dir)
    assert weights.rank == 6

    # The order of the keys in the file decides, for PEFT as here: with "q_proj" first,
    # layer 1's q_proj should have rank 2, and its rank-6 tensors no longer fit.
    reordered = {"q_proj": 2, **{k: v for k, v in rank_pattern.items() if k != "q_proj"}}
    edit_adapter_config(adapter_dir, rank_pattern=reordered)
    with pytest.raises(RuntimeError, match="size mismatch"):
        _peft_rank_and_scaling(gqa_dir, adapter_dir)
    with pytest.raises(AdapterError, match=r"layer 1 q_proj has rank 6, but .* says 2"):
        load_peft_adapter(adapter_dir, validate_model_dir(gqa_dir), max_rank=8)


def test_rslora_scaling_uses_each_module_rank(gqa_dir: Path, tmp_path: Path) -> None:
    adapter_dir = make_peft_adapter(
        gqa_dir,
        tmp_path / "rs",
        r=16,
        alpha=8,
        targets=("q_proj", "v_proj"),
        use_rslora=True,
        rank_pattern={"v_proj": 4},
    )
    weights = load_peft_adapter(adapter_dir, validate_model_dir(gqa_dir), max_rank=16)
    assert weights.modules[(0, "q_proj")].scaling == pytest.approx(8 / 4)
    assert weights.modules[(1, "v_proj")].scaling == pytest.approx(8 / 2)
    peft = _peft_rank_and_scaling(gqa_dir, adapter_dir)
    assert set(weights.modules) == set(peft)
    for key, (rank, scaling) in peft.items():
        assert weights.modules[key].rank == rank
        assert weights.modules[key].scaling == pytest.approx(scaling)


def _parent(module: str) -> str:
    return "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"


def test_name_dtype_and_adapter_name_infix(adapter: Path, gqa_config: ModelConfig) -> None:
    plain = load_peft_adapter(adapter, gqa_config, max_rank=4)
    edit_adapter_tensors(adapter, rename=lambda n: n.replace(".weight", ".default.weight"))
    infixed = load_peft_adapter(adapter, gqa_config, max_rank=4, name="t1/a", dtype=torch.bfloat16)
    assert (plain.name, infixed.name) == ("my-adapter", "t1/a")
    assert plain.target_modules == LlamaForCausalLM.target_modules() == set(ALL_TARGETS)
    assert set(infixed.modules) == set(plain.modules)
    for key, module in infixed.modules.items():
        assert module.a.dtype == module.b.dtype == torch.bfloat16
        assert module.a.is_contiguous() and module.b.t().is_contiguous()  # B^T rows
        torch.testing.assert_close(module.b, plain.modules[key].b.bfloat16(), rtol=0, atol=0)
        assert module.scaling == plain.modules[key].scaling


def test_pickle_next_to_safetensors_is_never_opened(
    adapter: Path, gqa_config: ModelConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.save(read_adapter_tensors(adapter), adapter / "adapter_model.bin")
    _forbid_unpickling(monkeypatch)
    assert load_peft_adapter(adapter, gqa_config, max_rank=4).rank == 4


def _forbid_unpickling(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the adapter loader unpickled a file")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)


def test_adapter_writer_is_seeded_and_leaves_the_base_model_as_it_was(
    gqa_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gqa_dir), dtype=torch.float32)
    model.get_parameter("model.norm.weight").requires_grad_(False)
    state = {name: p.detach().clone() for name, p in model.state_dict().items()}
    requires_grad = {name: p.requires_grad for name, p in model.named_parameters()}
    types = {name: type(m) for name, m in model.named_modules()}

    made = [
        read_adapter_tensors(
            make_peft_adapter(gqa_dir, tmp_path / name, seed=seed, base_model=base)
        )
        for name, seed, base in [("a", 1, model), ("b", 1, None), ("c", 2, None)]
    ]
    assert made[0].keys() == made[1].keys() == made[2].keys()
    for name, tensor in made[0].items():
        torch.testing.assert_close(made[1][name], tensor, rtol=0, atol=0)
        assert not torch.equal(made[2][name], tensor)
        assert bool(tensor.abs().min() > 0)  # lora_B is drawn too, not PEFT's zeros

    assert {name: type(m) for name, m in model.named_modules()} == types
    assert {name: p.requires_grad for name, p in model.named_parameters()} == requires_grad
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, state[name], rtol=0, atol=0)

    # The default draw makes each delta about DEFAULT_RELATIVE_DELTA of its base weight.
    weights = load_peft_adapter(tmp_path / "a", validate_model_dir(gqa_dir), max_rank=8)
    for layer, module in weights.modules:
        base = state[f"model.layers.{layer}.self_attn.{module}.weight"]
        ratio = float(_dense(weights, (layer, module)).std()) / float(base.std())
        assert 0.5 * DEFAULT_RELATIVE_DELTA < ratio < 2 * DEFAULT_RELATIVE_DELTA, (module, ratio)


# ---------------------------------------------------------------------------- refusals


def _name(layer: int, module: str, kind: str) -> str:
    return lora_tensor_name(layer, module, kind)


def _set_tensor(name: str, value: torch.Tensor | None) -> Callable[[Path], object]:
    return lambda d: edit_adapter_tensors(d, {name: value})


def _with_value(name: str, value: float) -> Callable[[Path], object]:
    def edit(d: Path) -> object:
        tensor = read_adapter_tensors(d)[name].clone()
        tensor[0, 0] = value
        return edit_adapter_tensors(d, {name: tensor})

    return edit


Q_A, Q_B = _name(0, "q_proj", "lora_A"), _name(0, "q_proj", "lora_B")
ATTN = "base_model.model.model.layers.0.self_attn"

REFUSALS: list[tuple[str, Callable[[Path], object], str]] = [
    # files
    ("no-config", lambda d: (d / "adapter_config.json").unlink(), r"has no adapter_config\.json"),
    (
        "bad-json",
        lambda d: (d / "adapter_config.json").write_text("{'r': 4"),
        r"adapter_config\.json is not valid JSON",
    ),
    (
        "json-list",
        lambda d: (d / "adapter_config.json").write_text("[1, 2]"),
        r"adapter_config\.json must hold a JSON object",
    ),
    (
        "no-weights",
        lambda d: (d / "adapter_model.safetensors").unlink(),
        r"has no adapter_model\.safetensors",
    ),
    ("truncated", truncate_weights, r"adapter_model\.safetensors is not a readable safetensors"),
    (
        "bad-header",
        lambda d: (d / "adapter_model.safetensors").write_bytes(b"\xff" * 64),
        r"adapter_model\.safetensors is not a readable safetensors",
    ),
    # config
    ("peft-type", lambda d: edit_adapter_config(d, peft_type="IA3"), r"peft_type is 'IA3'"),
    ("dora", lambda d: edit_adapter_config(d, use_dora=True), r"use_dora=True asks for DoRA"),
    (
        "modules-to-save",
        lambda d: edit_adapter_config(d, modules_to_save=["lm_head"]),
        r"modules_to_save=\['lm_head'\]",
    ),
    ("bias", lambda d: edit_adapter_config(d, bias="lora_only"), r"bias='lora_only'"),
    ("lora-bias", lambda d: edit_adapter_config(d, lora_bias=True), r"lora_bias=True"),
    (
        "alora",
        lambda d: edit_adapter_config(d, alora_invocation_tokens=[5, 6]),
        r"activated LoRA",
    ),
    (
        "pissa-unconverted",
        lambda d: edit_adapter_config(d, init_lora_weights="pissa_niter_4"),
        r"init_lora_weights='pissa_niter_4' also rewrites the base weights",
    ),
    (
        "target-embeddings",
        lambda d: edit_adapter_config(d, target_modules=["q_proj", "embed_tokens"]),
        r"target_modules includes embed_tokens; LoRA on the embeddings or lm_head",
    ),
    (
        "target-lm-head",
        lambda d: edit_adapter_config(d, target_modules=["lm_head"]),
        r"target_modules includes lm_head",
    ),
    (
        "target-unsupported",
        lambda d: edit_adapter_config(d, target_modules=["q_proj", "dense", "fc1"]),
        r"target_modules includes dense, fc1, which cannot be adapted",
    ),
    (
        "target-not-listed",
        lambda d: edit_adapter_config(d, target_modules=["q_proj", "k_proj"]),
        r"tensors for down_proj, gate_proj, o_proj, up_proj, v_proj \(e\.g\. "
        r"model\.layers\.0\.mlp\.down_proj\), which target_modules in "
        r"adapter_config\.json \(\['q_proj', 'k_proj'\]\) does not select",
    ),
    (
        "target-regex-not-matching",
        lambda d: edit_adapter_config(d, target_modules=r".*\.self_attn\.\w+"),
        r"tensors for down_proj, gate_proj, up_proj \(e\.g\. .*\), which target_modules",
    ),
    ("r-zero", lambda d: edit_adapter_config(d, r=0), r"r must be an integer >= 1, got 0"),
    ("alpha-text", lambda d: edit_adapter_config(d, lora_alpha="8"), r"lora_alpha must be a"),
    (
        "bad-pattern",
        lambda d: edit_adapter_config(d, rank_pattern={"q_proj(": 2}),
        r"rank_pattern key 'q_proj\(' is not a valid regular expression",
    ),
    (
        "config-rank",
        lambda d: edit_adapter_config(d, r=6),
        r"layer 0 down_proj has rank 4, but adapter_config\.json says 6",
    ),
    (
        "pattern-rank",
        lambda d: edit_adapter_config(d, rank_pattern={"o_proj": 2}),
        r"layer 0 o_proj has rank 4, but adapter_config\.json says 2",
    ),
    # tensors
    (
        "no-lora",
        lambda d: edit_adapter_tensors(d, {n: None for n in read_adapter_tensors(d)}),
        r"adapter_model\.safetensors holds no LoRA tensors",
    ),
    (
        "embedding-tensor",
        _set_tensor("base_model.model.model.embed_tokens.lora_embedding_A", torch.zeros(4, 9)),
        r"tensor base_model\.model\.model\.embed_tokens\.lora_embedding_A adapts the embeddings",
    ),
    (
        "lm-head-tensor",
        _set_tensor("base_model.model.lm_head.lora_A.weight", torch.zeros(4, 64)),
        r"tensor base_model\.model\.lm_head\.lora_A\.weight adapts the embeddings or lm_head",
    ),
    (
        "dora-magnitude",
        _set_tensor(f"{ATTN}.q_proj.lora_magnitude_vector", torch.ones(64)),
        r"q_proj\.lora_magnitude_vector is a DoRA magnitude",
    ),
    (
        "saved-module-copy",
        _set_tensor("base_model.model.model.norm.modules_to_save.default.weight", torch.ones(64)),
        r"norm\.modules_to_save\.default\.weight is a fully trained module copy",
    ),
    (
        "unexpected",
        _set_tensor("base_model.model.model.norm.weight", torch.ones(64)),
        r"unexpected tensor base_model\.model\.model\.norm\.weight",
    ),
    (
        "lora-b-bias",
        _set_tensor(f"{ATTN}.q_proj.lora_B.bias", torch.zeros(64)),
        r"q_proj\.lora_B\.bias is a LoRA bias",
    ),
    (
        "unsupported-module",
        _set_tensor(f"{ATTN}.rotary.lora_A.weight", torch.zeros(4, 64)),
        r"adapts model\.layers\.0\.self_attn\.rotary, which cannot be adapted",
    ),
    (
        "wrong-parent",
        _set_tensor("base_model.model.model.layers.0.mlp.q_proj.lora_A.weight", torch.zeros(4, 64)),
        r"adapts model\.layers\.0\.mlp\.q_proj, which cannot be adapted",
    ),
    (
        "layer-out-of-range",
        lambda d: edit_adapter_tensors(d, rename=lambda n: n.replace("layers.1.", "layers.2.")),
        r"is for layer 2, but the base model has 2 layers",
    ),
    ("missing-b", _set_tensor(Q_B, None), r"layer 0 q_proj has lora_A \(.*\) but no lora_B"),
    ("missing-a", _set_tensor(Q_A, None), r"layer 0 q_proj has lora_B \(.*\) but no lora_A"),
    (
        "duplicate-a",
        _set_tensor(Q_A.replace("lora_A.weight", "lora_A.default.weight"), torch.zeros(4, 64)),
        r"are both lora_A of layer 0 q_proj",
    ),
    (
        "rank-disagreement",
        _set_tensor(Q_B, torch.zeros(64, 3)),
        r"layer 0 q_proj: lora_A has rank 4 \(\[4, 64\]\) but lora_B has rank 3",
    ),
    ("vector", _set_tensor(Q_A, torch.zeros(4)), r"has shape \[4\], expected a matrix"),
    (
        "integer",
        _set_tensor(Q_A, torch.zeros(4, 64, dtype=torch.int32)),
        r"has dtype torch\.int32, expected floating point",
    ),
    (
        "in-features",
        _set_tensor(Q_A, torch.zeros(4, 65)),
        r"layer 0 q_proj has lora_A \[4, 65\] and lora_B \[64, 4\], but the base model needs "
        r"\[4, 64\] and \[64, 4\]",
    ),
    ("nan", _with_value(Q_B, math.nan), r"lora_B\.weight has NaN or Inf values"),
    ("inf", _with_value(_name(1, "down_proj", "lora_A"), -math.inf), r"has NaN or Inf values"),
]


@pytest.mark.parametrize(
    ("breaking", "message"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS]
)
def test_refusals(
    adapter: Path,
    gqa_config: ModelConfig,
    breaking: Callable[[Path], object],
    message: str,
) -> None:
    load_peft_adapter(adapter, gqa_config, max_rank=4)  # the unbroken copy loads
    breaking(adapter)
    with pytest.raises(AdapterError, match=message):
        load_peft_adapter(adapter, gqa_config, max_rank=4)


def test_missing_or_file_path_refused(tmp_path: Path, gqa_config: ModelConfig) -> None:
    with pytest.raises(AdapterError, match=r"adapter directory .*nowhere does not exist"):
        load_peft_adapter(tmp_path / "nowhere", gqa_config, max_rank=4)
    (tmp_path / "file").write_text("{}")
    with pytest.raises(AdapterError, match=r"adapter path .*file is not a directory"):
        load_peft_adapter(tmp_path / "file", gqa_config, max_rank=4)


def test_pickle_only_refused_without_unpickling(
    adapter: Path, gqa_config: ModelConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    convert_to_pickle(adapter)
    # The file is a genuine torch.save checkpoint: it could be loaded, and must not be.
    assert set(torch.load(adapter / "adapter_model.bin", weights_only=True)) >= {Q_A, Q_B}
    _forbid_unpickling(monkeypatch)
    with pytest.raises(
        AdapterError,
        match=r"has only adapter_model\.bin: only safetensors .* pickle files are never loaded",
    ):
        load_peft_adapter(adapter, gqa_config, max_rank=4)


def test_rank_above_max_lora_rank_refused(adapter: Path, gqa_config: ModelConfig) -> None:
    with pytest.raises(AdapterError, match=r"rank 4 .* limit of 3; .*--max-lora-rank"):
        load_peft_adapter(adapter, gqa_config, max_rank=3)


def test_adapter_for_another_base_refused(
    adapter: Path, tiny_model_factory: Callable[[str], Path]
) -> None:
    # llama_gqa has 2 kv heads, llama_mha_untied 4: k/v projections differ in size.
    mha_config = validate_model_dir(tiny_model_factory("llama_mha_untied"))
    with pytest.raises(
        AdapterError, match=r"layer 0 k_proj .* needs \[4, 64\] and \[64, 4\]; .*different base"
    ):
        load_peft_adapter(adapter, mha_config, max_rank=4)


def test_half_precision_overflow_refused(adapter: Path, gqa_config: ModelConfig) -> None:
    _with_value(Q_A, 1e6)(adapter)
    assert load_peft_adapter(adapter, gqa_config, max_rank=4).modules[(0, "q_proj")].a[0, 0] == 1e6
    with pytest.raises(AdapterError, match=r"lora_A\.weight overflows torch\.float16"):
        load_peft_adapter(adapter, gqa_config, max_rank=4, dtype=torch.float16)


@pytest.mark.parametrize(
    ("kwargs", "config_message", "tensor_message"),
    [
        ({"use_dora": True}, r"use_dora=True asks for DoRA", r"is a DoRA magnitude"),
        (
            {"modules_to_save": ["norm"]},
            r"modules_to_save=\['norm'\]",
            r"unexpected tensor base_model\.model\.model\.\S*norm\.weight",
        ),
        (
            {"bias": "lora_only"},
            r"bias='lora_only'",
            r"unexpected tensor base_model\.model\.model\.layers\.0\.self_attn\.q_proj\."
            r"base_layer\.bias",
        ),
        (
            {"targets": ("q_proj", "embed_tokens")},
            r"target_modules includes embed_tokens",
            r"tensor base_model\.model\.model\.embed_tokens\.\S+ adapts the embeddings",
        ),
    ],
    ids=["dora", "modules-to-save", "bias", "embeddings"],
)
def test_real_peft_variants_refused(
    tiny_model_factory: Callable[[str], Path],
    tmp_path: Path,
    kwargs: dict[str, Any],
    config_message: str,
    tensor_message: str,
) -> None:
    """Adapters PEFT itself writes with these options are refused by their config and,
    with the config fields hidden, by the tensors they carry."""
    base_dir = tiny_model_factory("llama_attention_bias")
    config = validate_model_dir(base_dir)
    adapter_dir = make_peft_adapter(base_dir, tmp_path / "variant", r=4, alpha=8, **kwargs)
    with pytest.raises(AdapterError, match=config_message):
        load_peft_adapter(adapter_dir, config, max_rank=4)
    hidden = {f: DELETE for f in ("use_dora", "modules_to_save", "bias", "target_modules")}
    edit_adapter_config(adapter_dir, **hidden)
    with pytest.raises(AdapterError, match=tensor_message):
        load_peft_adapter(adapter_dir, config, max_rank=4)
