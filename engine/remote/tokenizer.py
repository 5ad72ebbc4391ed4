"""The base model's tokenizer and chat template for a gateway, without its weights.

A gateway tokenizes prompts itself (token ids go over the wire), exactly as the
in-process engine does, so that both count the same tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from engine.detokenizer import IncrementalDetokenizer
from engine.model_loader import ModelConfig, load_model_config, load_tokenizer, resolve_model


class Tokenizing(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]: ...

    def token_text(self, token_id: int) -> str: ...


class LocalTokenizer:
    def __init__(self, model: str, data_dir: Path) -> None:
        """model: "default" (the bundled SmolLM2, converted on first use) or a directory."""
        from engine.async_engine import model_id_for

        self.model_dir = resolve_model(model, data_dir)
        self.model_config: ModelConfig = load_model_config(self.model_dir)
        self.model_id = model_id_for(model, self.model_dir)
        self._tokenizer = load_tokenizer(self.model_dir)

    def default_max_adapter_bytes(self, max_rank: int = 64) -> int:
        """The bound of an engine with `--max-lora-rank max_rank` (until workers say)."""
        from engine.async_engine import max_adapter_bytes

        return max_adapter_bytes(self.model_config, max_rank)

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer(text).input_ids)

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        rendered = self._tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        # NOTE: as AsyncEngine: templates write their own special tokens into the text.
        return list(self._tokenizer(rendered, add_special_tokens=False).input_ids)

    def token_text(self, token_id: int) -> str:
        return IncrementalDetokenizer.token_text(self._tokenizer, token_id)
