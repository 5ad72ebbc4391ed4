"""An adapter in host memory, in the model's own layout (fused groups, rope-ordered q/k)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

# Hugging Face module names an adapter may target, by the fused linear ("group") of our
# model that carries them, in output-slice order.
GROUP_SLICES: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
TARGET_MODULES: frozenset[str] = frozenset(m for ms in GROUP_SLICES.values() for m in ms)
# module name -> (group, slice index)
MODULE_GROUP: dict[str, tuple[str, int]] = {
    m: (group, k) for group, ms in GROUP_SLICES.items() for k, m in enumerate(ms)
}


class AdapterError(ValueError):
    """An adapter that cannot be served; the message says why, for the operator."""


@dataclass(slots=True)
class LoRAModule:
    """One adapted linear: delta(x) = scaling * (x @ a.T) @ b.T."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]; q_proj / k_proj rows already rope-interleaved
    scaling: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass(slots=True)
class LoRAWeights:
    name: str
    path: Path | None
    rank: int  # the largest rank of any module
    alpha: float
    use_rslora: bool
    # (layer index, Hugging Face module name, e.g. "q_proj") -> module
    modules: dict[tuple[int, str], LoRAModule] = field(default_factory=dict)

    @property
    def target_modules(self) -> frozenset[str]:
        return frozenset(name for _, name in self.modules)

    @property
    def size_bytes(self) -> int:
        return sum(
            m.a.numel() * m.a.element_size() + m.b.numel() * m.b.element_size()
            for m in self.modules.values()
        )
