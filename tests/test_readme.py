"""The README's opening says what the engine serves: every family of the model registry."""

from __future__ import annotations

from pathlib import Path

from engine.models.registry import model_class, supported_model_types

README = Path(__file__).parents[1] / "README.md"
# model_type -> how the README names the family
NAMES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3",
         "phi3": "Phi-3"}


def _opening() -> str:
    return README.read_text().split("\n## ", 1)[0]


def test_the_opening_names_every_registered_family() -> None:
    opening = " ".join(_opening().split())
    assert "registry of model families" in opening
    for model_type in supported_model_types():
        assert model_class(model_type) is not None
        assert NAMES[model_type] in opening, model_type
    assert "Llama-family forward" not in opening
