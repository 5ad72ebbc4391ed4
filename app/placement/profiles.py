"""GPU models and their MIG profiles: names, slices, usable memory, valid combinations.

Every supported GPU (A100-40GB, A100-80GB, H100-80GB, H200-141GB) has 7 compute slices and 8
memory slices. A GPU instance of a profile occupies a run of memory slices starting at one of
the profile's placement starts (`nvidia-smi mig -lgipp`): 1g profiles {0..6}:1, 1g double
memory {0,2,4,6}:2, 2g {0,2,4}:2, 3g {0,4}:4, 4g {0}:4, 7g {0}:8. A set of profiles can
coexist when its compute slices add up to at most 7 and its instances can be placed without
overlapping; e.g. 3g + 2g + 1g + 1g fits (2g at 0, 1g at 2 and 3, 3g at 4) while 4g + 4g
does not.

Usable memory is what `nvidia-smi mig -lgip` reports for the profile (GiB), the lowest value
seen across driver versions, since the planner must never overcommit a slice.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

COMPUTE_SLICES = 7
MEMORY_SLICES = 8


@dataclass(frozen=True, slots=True)
class MigProfile:
    name: str  # e.g. "3g.71gb"
    compute_slices: int  # the "3g"
    memory_slices: int  # eighths of the GPU's memory; also the placement size
    starts: tuple[int, ...]  # memory slices an instance may start at
    usable_gib: float

    @property
    def max_instances(self) -> int:
        return len(self.starts)


@dataclass(frozen=True, slots=True)
class GpuModel:
    key: str  # canonical name, e.g. "H200-141GB"
    nominal_gb: int  # the size in the product name
    usable_gib: float  # a whole GPU with MIG off, as CUDA reports it
    profiles: tuple[MigProfile, ...]

    def profile(self, name: str) -> MigProfile | None:
        for profile in self.profiles:
            if profile.name == name:
                return profile
        return None

    @property
    def profile_names(self) -> list[str]:
        return [p.name for p in self.profiles]


# (compute slices, memory slices, placement starts), in the order NVIDIA lists the profiles.
_GEOMETRY: tuple[tuple[int, int, tuple[int, ...]], ...] = (
    (1, 1, (0, 1, 2, 3, 4, 5, 6)),
    (1, 2, (0, 2, 4, 6)),
    (2, 2, (0, 2, 4)),
    (3, 4, (0, 4)),
    (4, 4, (0,)),
    (7, 8, (0,)),
)


def _model(
    key: str, nominal_gb: int, usable_gib: float, profiles: Sequence[tuple[str, float]]
) -> GpuModel:
    assert len(profiles) == len(_GEOMETRY)
    return GpuModel(
        key=key,
        nominal_gb=nominal_gb,
        usable_gib=usable_gib,
        profiles=tuple(
            MigProfile(name, compute, memory, starts, usable)
            for (name, usable), (compute, memory, starts) in zip(profiles, _GEOMETRY, strict=True)
        ),
    )


GPU_MODELS: dict[str, GpuModel] = {
    m.key: m
    for m in (
        _model(
            "A100-40GB",
            40,
            39.39,
            [("1g.5gb", 4.75), ("1g.10gb", 9.62), ("2g.10gb", 9.62), ("3g.20gb", 19.50),
             ("4g.20gb", 19.50), ("7g.40gb", 39.25)],
        ),
        _model(
            "A100-80GB",
            80,
            79.14,
            [("1g.10gb", 9.50), ("1g.20gb", 19.50), ("2g.20gb", 19.50), ("3g.40gb", 39.25),
             ("4g.40gb", 39.25), ("7g.80gb", 79.12)],
        ),
        _model(
            "H100-80GB",
            80,
            79.19,
            [("1g.10gb", 9.75), ("1g.20gb", 19.62), ("2g.20gb", 19.62), ("3g.40gb", 39.50),
             ("4g.40gb", 39.50), ("7g.80gb", 79.19)],
        ),
        # NOTE: no published `-lgip` listing of the H200's 4-memory-slice profiles was at
        # hand; 65.50 is twice the 2-slice figure, below the 71 GB of the name, so a plan
        # errs towards leaving memory unused rather than overcommitting it.
        _model(
            "H200-141GB",
            141,
            139.75,
            [("1g.18gb", 16.00), ("1g.35gb", 32.50), ("2g.35gb", 32.50), ("3g.71gb", 65.50),
             ("4g.71gb", 65.50), ("7g.141gb", 139.75)],
        ),
    )
}

_FAMILIES = ("A100", "H100", "H200")


class UnknownGpuModel(ValueError):
    """A GPU name that matches no entry of GPU_MODELS; the message lists the known ones."""


def resolve_gpu_model(name: str, memory_gb: float | None = None) -> GpuModel:
    """A topology's `model` ("H200", "A100-80GB") or an NVML name ("NVIDIA A100-SXM4-40GB",
    "NVIDIA H100 80GB HBM3") -> its GpuModel. The size comes from the name when it holds
    one, else from `memory_gb`; a family with one size (H100, H200) needs neither."""
    upper = name.upper()
    family = next((f for f in _FAMILIES if f in upper), None)
    known = ", ".join(GPU_MODELS)
    if family is None:
        raise UnknownGpuModel(f"unknown GPU model {name!r}; known models: {known}")
    variants = [m for m in GPU_MODELS.values() if m.key.startswith(family)]
    sizes = {int(s) for s in re.findall(r"(\d+)\s*GB", upper)}
    named = [m for m in variants if m.nominal_gb in sizes]
    if named:
        return named[0]
    if sizes:
        raise UnknownGpuModel(f"unknown GPU model {name!r} (no MIG table for that size); "
                              f"known models: {known}")
    if memory_gb is not None:
        close = [m for m in variants if abs(memory_gb - m.nominal_gb) <= 0.1 * m.nominal_gb]
        if close:
            return close[0]
        raise UnknownGpuModel(
            f"GPU model {name!r} with {memory_gb:g} GB matches none of "
            f"{', '.join(m.key for m in variants)}"
        )
    if len(variants) == 1:
        return variants[0]
    raise UnknownGpuModel(
        f"GPU model {name!r} is ambiguous: say {' or '.join(m.key for m in variants)}, "
        "or give memory_gb"
    )


def check_combination(model: GpuModel, names: Sequence[str]) -> str | None:
    """None when the MIG profiles `names` can coexist on one GPU of `model`; else why not."""
    profiles: list[MigProfile] = []
    for name in names:
        profile = model.profile(name)
        if profile is None:
            return (
                f"{model.key} has no MIG profile {name!r}; "
                f"its profiles: {', '.join(model.profile_names)}"
            )
        profiles.append(profile)
    compute = sum(p.compute_slices for p in profiles)
    if compute > COMPUTE_SLICES:
        return (
            f"{' + '.join(names)} needs {compute} compute slices; "
            f"a {model.key} has {COMPUTE_SLICES}"
        )
    memory = sum(p.memory_slices for p in profiles)
    if memory > MEMORY_SLICES:
        return (
            f"{' + '.join(names)} needs {memory} memory slices; "
            f"a {model.key} has {MEMORY_SLICES}"
        )
    if place(profiles) is None:
        return (
            f"{' + '.join(names)} cannot be placed on a {model.key}: no arrangement of "
            "their instances' memory slices avoids an overlap"
        )
    return None


def place(profiles: Sequence[MigProfile]) -> list[int] | None:
    """A start slice for each profile with no two instances overlapping, or None."""
    # Largest first: they have the fewest starts, so the search fails early.
    order = sorted(range(len(profiles)), key=lambda i: -profiles[i].memory_slices)
    starts: list[int] = [0] * len(profiles)
    used = [False] * MEMORY_SLICES

    def search(k: int) -> bool:
        if k == len(order):
            return True
        i = order[k]
        profile = profiles[i]
        for start in profile.starts:
            span = range(start, start + profile.memory_slices)
            if any(used[s] for s in span):
                continue
            for s in span:
                used[s] = True
            starts[i] = start
            if search(k + 1):
                return True
            for s in span:
                used[s] = False
        return False

    return starts if search(0) else None


def compute_slices_of(profile_name: str) -> int | None:
    """The "3" of "3g.71gb" (also for profiles outside the tables, e.g. "1g.10gb+me")."""
    match = re.match(r"(\d+)g\.", profile_name)
    return int(match.group(1)) if match else None
