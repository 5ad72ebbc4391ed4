"""The tenants a plan places, read from a YAML file:

    tenants:
      - {name: acme, isolation: dedicated, concurrency: 32, context: 4096}
      - {name: small-co, isolation: shared}

`concurrency` x `context` is the KV cache a tenant's worker must hold; a tenant that gives
neither is sized for one sequence of DEFAULT_CONTEXT tokens (capped by the model).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.placement.topology import PlacementInputError, check_keys, read_yaml

DEFAULT_CONCURRENCY = 1
DEFAULT_CONTEXT = 4096
ISOLATIONS = ("dedicated", "shared")  # the values of app.tables.Isolation
_KEYS = {"name", "isolation", "concurrency", "context"}


@dataclass(frozen=True, slots=True)
class TenantSpec:
    name: str
    isolation: str  # "dedicated" | "shared"
    concurrency: int
    context: int | None  # None: DEFAULT_CONTEXT, or the model's max_model_len if shorter

    @property
    def dedicated(self) -> bool:
        return self.isolation == "dedicated"

    def context_for(self, max_model_len: int) -> int:
        return self.context if self.context is not None else min(DEFAULT_CONTEXT, max_model_len)


def load_tenants(path: Path) -> list[TenantSpec]:
    return parse_tenants(read_yaml(path), source=str(path))


def parse_tenants(raw: Any, source: str = "tenants") -> list[TenantSpec]:
    if not isinstance(raw, dict) or not isinstance(raw.get("tenants"), list):
        raise PlacementInputError(f"{source}: expected a mapping with a 'tenants' list")
    tenants: list[TenantSpec] = []
    for i, item in enumerate(raw["tenants"]):
        where = f"{source}: tenants[{i}]"
        check_keys(item, _KEYS, where)
        name = item.get("name")
        if not isinstance(name, str) or not name:
            raise PlacementInputError(f"{where}: 'name' must be a non-empty string")
        if any(t.name == name for t in tenants):
            raise PlacementInputError(f"{where}: tenant {name!r} appears twice")
        isolation = item.get("isolation", "shared")
        if isolation not in ISOLATIONS:
            raise PlacementInputError(
                f"{where} ({name}): isolation must be one of {', '.join(ISOLATIONS)}, "
                f"got {isolation!r}"
            )
        concurrency = _positive_int(item.get("concurrency", DEFAULT_CONCURRENCY),
                                    f"{where} ({name}): 'concurrency'")
        context = item.get("context")
        if context is not None:
            context = _positive_int(context, f"{where} ({name}): 'context'")
        tenants.append(TenantSpec(name, isolation, concurrency, context))
    return tenants


def _positive_int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PlacementInputError(f"{what} must be an integer >= 1, got {value!r}")
    return value
