"""Adapter names and their versions: which version each name serves, which requests hold
which version, and when a replaced version may go.

NOTE: a name maps to its current version's key ("name#3"); requests carry the key, so the
prefix cache and the adapter cache never mix two versions. A replaced or removed version
is retired: requests already holding its key finish on it, then it is dropped from the
adapter cache, and its key is handed to the step thread (`drain_dropped`) to forget its
prefix-cache blocks. Thread-safe: registration runs on callers' threads, binding on the
step thread.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from pathlib import Path

from engine.client import AdapterInfo, RequestRejected
from engine.lora.cache import AdapterCache
from engine.lora.weights import LoRAWeights


def adapter_name(key: str) -> str:
    """The name of a version's key ("name#3" -> "name")."""
    return key.rpartition("#")[0]


class AdapterVersions:
    def __init__(self, cache: AdapterCache | None) -> None:
        self._cache = cache  # None: LoRA disabled, nothing can be registered
        self._lock = threading.Lock()
        self._current: dict[str, AdapterInfo] = {}  # name -> current version
        self._paths: dict[str, Path] = {}  # key -> directory, to reload from disk
        self._refs: Counter[str] = Counter()  # key -> live requests
        self._retired: set[str] = set()
        self._dropped: list[str] = []  # keys whose prefix-cache blocks are to go
        self._numbers = itertools.count(1)

    def register(self, name: str, weights: LoRAWeights) -> AdapterInfo:
        """Serve validated weights as `name`; replaces the current version."""
        assert self._cache is not None, "LoRA disabled: load_adapter refuses first"
        with self._lock:
            key = f"{name}#{next(self._numbers)}"
            info = AdapterInfo(
                name=name,
                key=key,
                path=None if weights.path is None else str(weights.path),
                rank=weights.rank,
                alpha=weights.alpha,
                use_rslora=weights.use_rslora,
                target_modules=tuple(sorted(weights.target_modules)),
                size_bytes=weights.size_bytes,
                created=int(time.time()),
            )
            if weights.path is not None:
                self._paths[key] = Path(weights.path)
            self._cache.add(key, weights)
            old = self._current.get(name)
            self._current[name] = info
            if old is not None:
                self._retire(old.key)
        return info

    def remove(self, name: str) -> bool:
        with self._lock:
            info = self._current.pop(name, None)
            if info is None:
                return False
            self._retire(info.key)
        return True

    def get(self, name: str) -> AdapterInfo | None:
        with self._lock:
            return self._current.get(name)

    def served(self) -> list[AdapterInfo]:
        with self._lock:
            return sorted(self._current.values(), key=lambda a: a.name)

    def path_of(self, key: str) -> Path | None:
        """The directory a version was loaded from (to load it again); None once dropped."""
        with self._lock:
            return self._paths.get(key)

    def bind(self, name: str) -> str:
        """The key of `name`'s current version, held by one more request until `unbind`."""
        with self._lock:
            info = self._current.get(name)
            if info is None:
                raise RequestRejected(
                    f"The model '{name}' does not exist.", code="model_not_found", param="model"
                )
            self._refs[info.key] += 1
            return info.key

    def unbind(self, key: str) -> None:
        with self._lock:
            self._refs[key] -= 1
            if not self._refs[key]:
                del self._refs[key]
                if key in self._retired:
                    self._drop(key)

    def drain_dropped(self) -> list[str]:
        """Keys dropped since the last call (their prefix-cache blocks are to go)."""
        with self._lock:
            dropped, self._dropped = self._dropped, []
        return dropped

    def _retire(self, key: str) -> None:
        # Under _lock.
        self._retired.add(key)
        if not self._refs[key]:
            self._drop(key)

    def _drop(self, key: str) -> None:
        # Under _lock; no request holds the key any more.
        assert self._cache is not None
        self._retired.discard(key)
        self._refs.pop(key, None)
        self._paths.pop(key, None)
        self._cache.remove(key)
        self._dropped.append(key)
