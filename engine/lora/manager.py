"""The LoRA adapters one engine serves: names checked, PEFT directories validated, versions
bound to requests (engine/lora/versions.py), the two-tier cache (engine/lora/cache.py)
and the requests whose adapter could not be loaded.

The step machinery (engine/core/engine_core.py) owns the manager and hands it what it
needs: the model's LoRA slots and config, and its requests as AdapterBindings."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

import torch

from engine.client import AdapterInfo
from engine.config import EngineConfig
from engine.errors import AdapterLoadError
from engine.lora.cache import AdapterCache
from engine.lora.layers import LoRASlots
from engine.lora.peft import load_peft_adapter
from engine.lora.versions import AdapterVersions, adapter_name
from engine.lora.weights import AdapterError, LoRAWeights
from engine.models.config import ModelConfig

# What requests may put in `model` to name an adapter; '@' is kept for `name@version`.
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-/:]{0,127}")


class AdapterBinding(Protocol):
    """What the manager reads and sets on a request (the core's Request)."""

    request_id: str
    adapter_id: str | None  # the adapter's name as requested; None: the base model
    adapter_key: str | None  # the version bound to it ("name#3"); None: not bound


class AdapterManager:
    def __init__(
        self, config: EngineConfig, slots: LoRASlots | None, model_config: ModelConfig,
        dtype: torch.dtype, model_dir: Path, *, wakeup: Callable[[], None] | None = None,
    ) -> None:
        """slots: the model's LoRA slots (None: LoRA disabled); wakeup: called (from the
        loader thread) when an adapter finished loading."""
        self.config = config
        self.model_config = model_config
        self.dtype = dtype
        self.model_dir = model_dir
        self.wakeup = wakeup
        self.cache: AdapterCache | None = None  # None: LoRA disabled
        self._loads_ended = False  # a load ended since the last `between_steps`
        if slots is not None:
            self.cache = AdapterCache(
                max_loras=config.max_loras,
                max_cpu_loras=config.max_cpu_loras,
                load=self.reload,
                install=slots.install,
                evict=slots.clear,
                on_ready=self._on_ready,
            )
        self.versions = AdapterVersions(self.cache)

    def load(self, name: str, path: str | Path) -> LoRAWeights:
        """Read and validate a PEFT directory (any thread; touches no engine state)."""
        if self.cache is None:
            raise AdapterError("LoRA adapters are disabled on this engine (--max-loras 0)")
        if not ADAPTER_NAME.fullmatch(name):
            raise AdapterError(
                f"invalid adapter name {name!r}: 1-128 characters among letters, digits and "
                "'._-/:', starting with a letter or digit ('@' is kept for versions)"
            )
        if name == self.model_dir.name or name == self.config.model:
            raise AdapterError(f"adapter name {name!r} is the base model's name")
        return load_peft_adapter(
            Path(path),
            self.model_config,
            max_rank=self.config.max_lora_rank,
            name=name,
            dtype=self.dtype,
        )

    def register(self, name: str, weights: LoRAWeights) -> AdapterInfo:
        """Serve validated weights as `name` (thread-safe); replaces the current version."""
        return self.versions.register(name, weights)

    def reload(self, key: str) -> LoRAWeights:
        """The adapter cache's loader: read a version back from disk (loader thread)."""
        path = self.versions.path_of(key)
        if path is None:
            raise AdapterError(f"adapter {key} has no directory to load it from")
        return self.load(adapter_name(key), path)

    def bind(self, request: AdapterBinding) -> None:
        """Give a request naming an adapter its current version's key (held until unbind)."""
        if request.adapter_id is not None:
            request.adapter_key = self.versions.bind(request.adapter_id)

    def unbind(self, request: AdapterBinding) -> None:
        if request.adapter_key is not None:
            self.versions.unbind(request.adapter_key)

    def device_slots(self, requests: Iterable[AdapterBinding]) -> dict[str, int]:
        """The device slot of each adapter version the requests (of a step) use."""
        slots: dict[str, int] = {}
        for request in requests:
            key = request.adapter_key
            if key is not None and key not in slots:
                assert self.cache is not None, "adapter request on an engine without LoRA"
                slot = self.cache.slot_of(key)
                assert slot is not None, f"adapter {key} scheduled without a device slot"
                slots[key] = slot
        return slots

    def between_steps(
        self, waiting: Iterable[AdapterBinding], drop_cached_kv: Callable[[str], object]
    ) -> dict[str, BaseException]:
        """Housekeeping on the step thread: the cached KV of dropped versions goes
        (`drop_cached_kv` of each version's key); returns the waiting requests whose
        adapter could not be loaded (by request id, with the error for their callers),
        for the engine to fail."""
        for key in self.versions.drain_dropped():
            drop_cached_kv(key)
        if not self._loads_ended or self.cache is None:
            return {}
        self._loads_ended = False
        failures: dict[str, BaseException] = {}
        for request in waiting:
            version = request.adapter_key
            error = None if version is None else self.cache.load_error(version)
            if error is not None:
                failures[request.request_id] = AdapterLoadError(
                    f"adapter '{request.adapter_id}' could not be loaded: {error}"
                )
        return failures

    def _on_ready(self, key: str) -> None:
        self._loads_ended = True
        if self.wakeup is not None:
            self.wakeup()
