"""Placing tenants on GPUs and MIG slices: which workers to start, where, and with what.

Slots are the places a worker can run: an existing GPU instance, a whole GPU with MIG off,
or, on a `mig: auto` GPU, an instance the plan proposes to create.

NOTE: the policy, in order:
1. Dedicated tenants, largest footprint first, each get a slot of their own: the smallest
   (usable memory, then compute slices) whose memory model holds weights + adapters +
   activations + CUDA context + KV for `concurrency` x `context`. On an auto GPU that is the
   smallest profile that fits and still forms a valid MIG combination with the profiles
   already chosen there.
2. What is left of each auto GPU becomes as few shared instances as possible: the largest
   profile that keeps the combination valid, repeated (e.g. A100-80GB with one dedicated
   1g.10gb: 4g.40gb + 2g.20gb). Instances the model does not fit in are not proposed.
3. Every shared worker serves every shared tenant (the gateway routes a shared tenant to
   any shared worker and spreads adapters by rendezvous hashing), so shared tenants, in
   file order, draw from one pool: the KV tokens of all shared workers. A tenant whose
   `concurrency` x `context` exceeds what is left of the pool, or one of whose sequences no
   shared worker can hold, is unplaced; it is listed only on workers that hold one of its
   sequences.
4. Shared tenants are the default service: when any exist and step 1 left no slot a shared
   worker fits in, the dedicated tenants give one up, the last placed (smallest footprint)
   first whose slot lets a shared worker take shared tenants; that tenant is unplaced.
Nothing is placed where the memory model says it does not fit; what cannot be placed is
reported with the numbers that decided it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from app.placement.profiles import COMPUTE_SLICES, GpuModel, check_combination
from app.placement.tenants import TenantSpec
from app.placement.topology import Gpu, MigMode, Topology
from engine.core.memory import GIB, MemoryBreakdown, MemoryModel, WorkerShape
from engine.models.loader import ModelConfig


@dataclass(frozen=True, slots=True)
class PlanOptions:
    shape: WorkerShape = field(default_factory=WorkerShape)
    model: str = "default"  # what each worker's --model names


@dataclass(frozen=True, slots=True)
class Worker:
    node: str
    gpu: int
    mig_profile: str | None  # None: the whole GPU
    memory_gb: float  # usable GiB of the slot
    isolation: str  # "dedicated" | "shared"
    tenants: tuple[str, ...]
    max_loras: int
    max_num_seqs: int
    kv_cache_tokens: int
    env: dict[str, str]
    resources: dict[str, int]  # the Kubernetes resource request
    args: tuple[str, ...]  # engine flags for `loraplex worker`
    setup: str | None  # what the operator must do first (create the MIG instance, ...)
    memory: MemoryBreakdown

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "gpu": self.gpu,
            "mig_profile": self.mig_profile,
            "memory_gb": self.memory_gb,
            "isolation": self.isolation,
            "tenants": list(self.tenants),
            "max_loras": self.max_loras,
            "max_num_seqs": self.max_num_seqs,
            "kv_cache_tokens": self.kv_cache_tokens,
            "env": dict(self.env),
            "resources": dict(self.resources),
            "args": list(self.args),
            "setup": self.setup,
            "memory": self.memory.as_gib(),
        }


@dataclass(frozen=True, slots=True)
class Unplaced:
    tenant: str
    reason: str


@dataclass(frozen=True, slots=True)
class Plan:
    workers: tuple[Worker, ...]
    unplaced: tuple[Unplaced, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "workers": [w.to_dict() for w in self.workers],
            "unplaced": [{"tenant": u.tenant, "reason": u.reason} for u in self.unplaced],
        }


@dataclass(slots=True)
class _Slot:
    node: str
    node_pos: int
    gpu: Gpu
    seq: int  # position among the GPU's instances (creation order on auto GPUs)
    profile: str | None
    memory_gib: float
    compute_slices: int
    uuid: str | None = None
    to_create: bool = False

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)

    @property
    def order(self) -> tuple[int, int, int]:
        return (self.node_pos, self.gpu.index, self.seq)

    @property
    def where(self) -> str:
        kind = f"MIG {self.profile}" if self.profile else "whole GPU"
        return f"{self.node} GPU {self.gpu.index} {kind}"


@dataclass(slots=True)
class _AutoGpu:
    node: str
    node_pos: int
    gpu: Gpu
    model: GpuModel
    chosen: list[_Slot] = field(default_factory=list)

    def candidate(self, profile_name: str) -> _Slot | None:
        if check_combination(self.model, [*(s.profile or "" for s in self.chosen),
                                          profile_name]) is not None:
            return None
        profile = self.model.profile(profile_name)
        assert profile is not None
        return _Slot(self.node, self.node_pos, self.gpu, len(self.chosen), profile.name,
                     profile.usable_gib, profile.compute_slices, to_create=True)


@dataclass(slots=True)
class _Assignment:
    slot: _Slot
    isolation: str
    max_num_seqs: int
    tenants: list[str] = field(default_factory=list)


def plan(
    topology: Topology, tenants: list[TenantSpec], cfg: ModelConfig, options: PlanOptions
) -> Plan:
    first = _Planner(topology, cfg, options)
    result = first.run(tenants)
    if not any(not t.dedicated for t in tenants) or _has_shared_worker(result):
        return result
    # NOTE: the dedicated tenants the first pass could not place stay unplaced (for the
    # same reason): the slot given up is for the shared tenants, not for them.
    left_out = {u.tenant: u.reason for u in first.unplaced}
    for name in reversed(first.dedicated_placed):
        retry = _Planner(topology, cfg, options).run(tenants, displaced=name, left_out=left_out)
        if _has_shared_worker(retry):
            return retry
    return result


def _has_shared_worker(result: Plan) -> bool:
    return any(w.isolation == "shared" for w in result.workers)


class _Planner:
    def __init__(self, topology: Topology, cfg: ModelConfig, options: PlanOptions) -> None:
        self.cfg = cfg
        self.options = options
        self.memory = MemoryModel(cfg, options.shape)
        self.free: list[_Slot] = []
        self.auto: list[_AutoGpu] = []
        for node_pos, node in enumerate(topology.nodes):
            for gpu in node.gpus:
                if gpu.mig is MigMode.OFF:
                    self.free.append(_Slot(node.name, node_pos, gpu, 0, None, gpu.memory_gib,
                                           COMPUTE_SLICES, gpu.uuid))
                elif gpu.mig is MigMode.INSTANCES:
                    for seq, inst in enumerate(gpu.instances):
                        self.free.append(_Slot(node.name, node_pos, gpu, seq, inst.profile,
                                               inst.memory_gib, inst.compute_slices, inst.uuid))
                else:
                    assert gpu.model is not None
                    self.auto.append(_AutoGpu(node.name, node_pos, gpu, gpu.model))
        self.assignments: list[_Assignment] = []
        self.unplaced: list[Unplaced] = []
        self.dedicated_placed: list[str] = []  # in placement order

    def run(
        self,
        tenants: list[TenantSpec],
        *,
        displaced: str | None = None,
        left_out: dict[str, str] | None = None,
    ) -> Plan:
        """displaced: a dedicated tenant left unplaced so that its slot can go to the
        shared tenants (policy step 4); left_out: dedicated tenants not to place, with the
        reason."""
        left_out = left_out or {}
        max_len = self.cfg.max_model_len
        placeable: list[TenantSpec] = []
        for t in tenants:
            if t.context_for(max_len) > max_len:
                self._unplace(t, f"context {t.context} exceeds the model's max_model_len "
                                 f"{max_len}")
            else:
                placeable.append(t)
        dedicated = [t for t in placeable if t.dedicated]
        dedicated.sort(key=lambda t: -self._footprint(t).total)  # stable: file order on ties
        shared = [t for t in placeable if not t.dedicated]
        for t in dedicated:
            if t.name in left_out:
                self._unplace(t, left_out[t.name])
            elif t.name == displaced:
                names = ", ".join(s.name for s in shared)
                self._unplace(t, "no free GPU or MIG slice is left for a dedicated worker "
                                 f"once one is kept for the shared tenants ({names})")
            else:
                self._place_dedicated(t)
        if shared:
            self._place_shared(shared)
        return self._result(tenants)

    # -- dedicated -------------------------------------------------------------------

    def _footprint(self, t: TenantSpec) -> MemoryBreakdown:
        kv = self.memory.kv_tokens_for(t.concurrency, t.context_for(self.cfg.max_model_len))
        return self.memory.breakdown(kv, max_num_seqs=t.concurrency)

    def _place_dedicated(self, t: TenantSpec) -> None:
        need = self._footprint(t)
        candidates = [s for s in self.free if self.memory.fits(need, s.memory_bytes)]
        for auto in self.auto:
            by_size = sorted(auto.model.profiles, key=lambda p: (p.usable_gib, p.compute_slices))
            fitting = (p for p in by_size if self.memory.fits(need, int(p.usable_gib * GIB)))
            smallest = next((s for p in fitting if (s := auto.candidate(p.name))), None)
            if smallest is not None:
                candidates.append(smallest)
        if not candidates:
            ctx = t.context_for(self.cfg.max_model_len)
            largest = self._largest_open_slot()
            if largest is None:
                reason = "no free GPU or MIG slice is left for a dedicated worker"
            else:
                reason = (f"needs {need.describe()} for {t.concurrency} x {ctx} tokens; the "
                          f"largest free slot has {largest.memory_gib:.2f} GiB "
                          f"({largest.where}), of which gpu_memory_utilization "
                          f"{self.options.shape.gpu_memory_utilization} may be used")
            self._unplace(t, reason)
            return
        slot = min(candidates, key=lambda s: (s.memory_gib, s.compute_slices, s.order))
        if slot.to_create:
            next(a for a in self.auto if a.gpu is slot.gpu).chosen.append(slot)
        else:
            self.free.remove(slot)
        self.assignments.append(_Assignment(slot, "dedicated", t.concurrency, [t.name]))
        self.dedicated_placed.append(t.name)

    def _largest_open_slot(self) -> _Slot | None:
        open_slots = list(self.free)
        for auto in self.auto:
            open_slots += [s for p in auto.model.profiles if (s := auto.candidate(p.name))]
        return min(open_slots, key=lambda s: (-s.memory_gib, s.order), default=None)

    # -- shared ----------------------------------------------------------------------

    def _place_shared(self, tenants: list[TenantSpec]) -> None:
        seqs = self.options.shape.max_num_seqs
        candidates = list(self.free)
        for auto in self.auto:
            candidates += self._fill(auto)
        pool: list[_Assignment] = []
        for slot in sorted(candidates, key=lambda s: s.order):
            if self.memory.kv_cache_tokens(slot.memory_bytes, seqs) > 0:
                pool.append(_Assignment(slot, "shared", seqs))
        capacity = {id(a): self.memory.kv_cache_tokens(a.slot.memory_bytes, seqs) for a in pool}
        total = sum(capacity.values())
        left = total
        for t in tenants:
            ctx = t.context_for(self.cfg.max_model_len)
            one = self.memory.kv_tokens_for(1, ctx)
            demand = self.memory.kv_tokens_for(t.concurrency, ctx)
            eligible = [a for a in pool if capacity[id(a)] >= one]
            if not pool:
                self._unplace(t, self._no_shared_pool_reason())
            elif not eligible:
                self._unplace(t, f"one {ctx}-token sequence needs {one} KV tokens; the largest "
                                 f"shared worker holds {max(capacity.values())}")
            elif demand > left:
                self._unplace(t, f"needs {demand} KV tokens ({t.concurrency} x {ctx}); the "
                                 f"shared workers have {left} of {total} left")
            else:
                left -= demand
                for a in eligible:
                    a.tenants.append(t.name)
        for a in pool:
            if not a.tenants:
                continue
            if a.slot.to_create:
                next(x for x in self.auto if x.gpu is a.slot.gpu).chosen.append(a.slot)
            self.assignments.append(a)

    def _fill(self, auto: _AutoGpu) -> list[_Slot]:
        """Shared instances for what is left of an auto GPU: the largest that fits, again."""
        seqs = self.options.shape.max_num_seqs
        profiles = sorted(auto.model.profiles, key=lambda p: (-p.usable_gib, -p.compute_slices))
        planned = _AutoGpu(auto.node, auto.node_pos, auto.gpu, auto.model, list(auto.chosen))
        added: list[_Slot] = []
        while True:
            for profile in profiles:
                if self.memory.kv_cache_tokens(int(profile.usable_gib * GIB), seqs) == 0:
                    continue
                slot = planned.candidate(profile.name)
                if slot is not None:
                    planned.chosen.append(slot)
                    added.append(slot)
                    break
            else:
                return added

    def _no_shared_pool_reason(self) -> str:
        largest = self._largest_open_slot()
        if largest is None:
            return "no GPU or MIG slice is left for shared workers"
        fixed = self.memory.breakdown(self.options.shape.block_size)
        return (f"a worker of this model needs at least {fixed.describe()}; the largest slot "
                f"left for shared workers has {largest.memory_gib:.2f} GiB ({largest.where})")

    # -- output ----------------------------------------------------------------------

    def _unplace(self, t: TenantSpec, reason: str) -> None:
        self.unplaced.append(Unplaced(t.name, reason))

    def _result(self, tenants: list[TenantSpec]) -> Plan:
        order = {t.name: i for i, t in enumerate(tenants)}
        workers = [self._worker(a) for a in sorted(self.assignments, key=lambda a: a.slot.order)]
        unplaced = sorted(self.unplaced, key=lambda u: order[u.tenant])
        return Plan(workers=tuple(workers), unplaced=tuple(unplaced))

    def _worker(self, a: _Assignment) -> Worker:
        slot, shape = a.slot, self.options.shape
        kv = self.memory.kv_cache_tokens(slot.memory_bytes, a.max_num_seqs)
        env, setup = self._device(slot)
        args: tuple[str, ...] = (
            "--model", self.options.model,
            "--dtype", shape.dtype,
            "--max-loras", str(shape.max_loras),
            "--max-lora-rank", str(shape.max_lora_rank),
            "--max-num-seqs", str(a.max_num_seqs),
            "--max-num-batched-tokens", str(shape.max_num_batched_tokens),
            "--block-size", str(shape.block_size),
            "--kv-cache-tokens", str(kv),
        )
        if shape.quantization != "none":
            args += ("--quantization", shape.quantization)
        if shape.quantization_group_size is not None:
            args += ("--quantization-group-size", str(shape.quantization_group_size))
        resource = f"nvidia.com/mig-{slot.profile}" if slot.profile else "nvidia.com/gpu"
        return Worker(
            node=slot.node,
            gpu=slot.gpu.index,
            mig_profile=slot.profile,
            memory_gb=round(slot.memory_gib, 2),
            isolation=a.isolation,
            tenants=tuple(a.tenants),
            max_loras=shape.max_loras,
            max_num_seqs=a.max_num_seqs,
            kv_cache_tokens=kv,
            env={"CUDA_VISIBLE_DEVICES": env},
            resources={resource: 1},
            args=args,
            setup=setup,
            memory=self.memory.breakdown(kv, a.max_num_seqs),
        )

    def _device(self, slot: _Slot) -> tuple[str, str | None]:
        """(CUDA_VISIBLE_DEVICES, setup step) of a slot."""
        i = slot.gpu.index
        if slot.profile is None:
            return (slot.uuid or str(i)), None
        if slot.to_create:
            auto = next(a for a in self.auto if a.gpu is slot.gpu)
            # Larger instances first: their placements are the most constrained.
            layout = sorted((s.profile or "" for s in auto.chosen),
                            key=lambda name: -_memory_slices(auto.model, name))
            return (
                f"MIG-<uuid of new {slot.profile} instance #{slot.seq} on {slot.node} GPU {i}>",
                f"create the MIG instances on {slot.node} GPU {i}: nvidia-smi -i {i} -mig 1; "
                f"nvidia-smi mig -i {i} -cgi {','.join(layout)} -C; then set "
                "CUDA_VISIBLE_DEVICES to the instance's UUID (nvidia-smi -L)",
            )
        if slot.uuid:
            uuid = slot.uuid if slot.uuid.startswith("MIG-") else f"MIG-{slot.uuid}"
            return uuid, None
        return (
            f"MIG-<uuid of {slot.profile} instance #{slot.seq} on {slot.node} GPU {i}>",
            f"look up the instance's UUID with nvidia-smi -L on {slot.node}",
        )


def _memory_slices(model: GpuModel, profile_name: str) -> int:
    profile = model.profile(profile_name)
    assert profile is not None
    return profile.memory_slices
