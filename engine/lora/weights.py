"""An adapter in host memory, in the model's own layout (rope-ordered q/k rows).

Which modules an adapter may target, and which fused linear of the model carries each,
is the architecture's (`lora_groups` of its class in engine/models).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.errors import AdapterError as AdapterError


@dataclass(slots=True)
class LoRAModule:
    """One adapted linear: delta(x) = scaling * (x @ a.T) @ b.T."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]; the rows rope rotates (q and k heads) already interleaved
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
