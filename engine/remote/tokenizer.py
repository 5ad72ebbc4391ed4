"""The base model's tokenizer and chat template for a gateway, without its weights.

A gateway tokenizes prompts itself (token ids go over the wire), exactly as the
in-process engine does, so that both count the same tokens. It checks structured-output
specs itself too, with a grammar compiler of its own built on first use, so that a spec
no worker would serve is refused before a response starts (workers compile it again,
from their own caches).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Protocol

from engine.chat_template import render_chat_ids, template_has_tools
from engine.core.detokenizer import IncrementalDetokenizer
from engine.models.loader import ModelConfig, load_model_config, load_tokenizer, resolve_model_dir
from engine.structured import GrammarCompiler, StructuredOutput


class Tokenizing(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]: ...

    def token_text(self, token_id: int) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def chat_template_has_tools(self) -> bool: ...

    def check_structured_output(self, spec: StructuredOutput) -> None: ...


class TokenizingClient:
    """EngineClient's tokenizing methods, answered by a tokenizer in this process
    (`_tokenizer`): engines whose model is elsewhere (a gateway's workers, an engine
    process) tokenize here, exactly as the in-process engine does."""

    _tokenizer: Tokenizing

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        return self._tokenizer.apply_chat_template(messages, tools)

    @property
    def chat_template_has_tools(self) -> bool:
        return self._tokenizer.chat_template_has_tools

    def token_text(self, token_id: int) -> str:
        return self._tokenizer.token_text(token_id)


class LocalTokenizer:
    def __init__(self, model: str, data_dir: Path) -> None:
        """model: "default" (the bundled SmolLM2, converted on first use) or a directory."""
        from engine.async_engine import model_id_for

        self.model_dir = resolve_model_dir(model, data_dir)
        self.model_config: ModelConfig = load_model_config(self.model_dir)
        self.model_id = model_id_for(model, self.model_dir)
        self._tokenizer = load_tokenizer(self.model_dir)
        self._compiler: GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._has_tools: bool | None = None

    def default_max_adapter_bytes(self, max_rank: int = 64) -> int:
        """The bound of an engine with `--max-lora-rank max_rank` (until workers say)."""
        from engine.async_engine import max_adapter_bytes

        return max_adapter_bytes(self.model_config, max_rank)

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer(text).input_ids)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        return render_chat_ids(self._tokenizer, messages, tools)

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def chat_template_has_tools(self) -> bool:
        if self._has_tools is None:
            self._has_tools = template_has_tools(self._tokenizer)
        return self._has_tools

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Built on first use, with the structured module's default limits and timeout
        (workers apply their own configuration on top)."""
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(
                    self._tokenizer, vocab_size=self.model_config.vocab_size,
                    eos_token_ids=list(self.model_config.eos_token_ids) or None,
                )
            return self._compiler

    def check_structured_output(self, spec: StructuredOutput) -> None:
        self.grammar_compiler.compile(spec)

    def token_text(self, token_id: int) -> str:
        return IncrementalDetokenizer.token_text(self._tokenizer, token_id)
