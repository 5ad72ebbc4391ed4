"""Slot-stacked LoRA buffers of every fused linear of the model, and their forward.

Each fused linear of each layer (a "LoRA group" of the architecture, e.g. Llama's qkv,
o, gate_up and down) gets one `LoRAGroup`: device buffers for `num_slots` adapters of
rank up to `max_rank` in the layout documented in loraplex_kernels/reference.py. An adapter in
use occupies one slot in every group; a base-model token uses none and is never touched.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch

from engine.lora.weights import LoRAModule, LoRAWeights
from loraplex_kernels import cpu_ops
from loraplex_kernels import reference as ref

# Segments of at most this many rows (decode-sized) run in the fused CPU kernel, or
# without it their LoRA matmuls single-threaded.
SMALL_SEGMENT_ROWS = 64


class LoRAGroup:
    def __init__(
        self,
        num_slots: int,
        max_rank: int,
        in_features: int,
        slice_sizes: Sequence[int],
        *,
        device: torch.device,
        dtype: torch.dtype,
        use_kernels: bool | None = None,
    ) -> None:
        """use_kernels: the Triton path (default: on CUDA). Tests set it on CPU tensors with
        TRITON_INTERPRET=1 to run the CUDA code path in the interpreter."""
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.in_features = in_features
        self.slice_sizes = tuple(slice_sizes)
        offsets = [0]
        for size in self.slice_sizes:
            offsets.append(offsets[-1] + size)
        self.slice_offsets = tuple(offsets)
        num_slices = len(self.slice_sizes)
        self.device, self.dtype = device, dtype
        # NOTE: two layouts of the same weights. On CUDA the slot-stacked buffers the Triton
        # kernels read (loraplex_kernels/reference.py); on CPU one PackedLoRA per slot: views of the
        # host copy's own A and B^T, sized to the adapter's ranks, nothing copied.
        self.use_kernels = device.type == "cuda" if use_kernels is None else use_kernels
        stacked = (num_slots, num_slices, max_rank, in_features) if self.use_kernels else (0,)
        self.lora_a = torch.zeros(stacked, device=device, dtype=dtype)
        b_shape = (num_slots, offsets[-1], max_rank) if self.use_kernels else (0,)
        self.lora_b = torch.zeros(b_shape, device=device, dtype=dtype)
        self.packed: list[ref.PackedLoRA | None] = [None] * num_slots
        # CPU: each slot's PackedLoRA as the fused kernel reads it (loraplex_kernels/cpu_ops.py);
        # a row of zeros for an empty slot.
        self.cpu_kernel = not self.use_kernels and cpu_ops.available(device, dtype)
        rows = num_slots if self.cpu_kernel else 0
        self.desc = torch.zeros(rows, cpu_ops.DESC_WIDTH, dtype=torch.int64)
        self.desc_scales = torch.zeros(rows, cpu_ops.MAX_SLICES, dtype=torch.float32)
        self.ranks = torch.zeros(num_slots, num_slices, dtype=torch.int32, device=device)
        self.scalings = torch.zeros(num_slots, num_slices, dtype=torch.float32, device=device)
        # Host-side "does this slot adapt any slice of this group": a step whose segments
        # touch none of them skips the group without reading the device.
        self.slot_active = [False] * num_slots

    def set_slot(self, slot: int, modules: Sequence[LoRAModule | None]) -> None:
        """Install one adapter's modules (one per slice, None: not targeted) in `slot`."""
        assert len(modules) == len(self.slice_sizes)
        self.clear_slot(slot)
        ranks: list[int] = []
        scales: list[float] = []
        for k, module in enumerate(modules):
            if module is None:
                ranks.append(0)
                scales.append(0.0)
                continue
            r = module.rank
            lo, hi = self.slice_offsets[k], self.slice_offsets[k + 1]
            assert r <= self.max_rank, (r, self.max_rank)
            assert module.a.shape == (r, self.in_features), module.a.shape
            assert module.b.shape == (hi - lo, r), module.b.shape
            if self.use_kernels:
                self.lora_a[slot, k, :r].copy_(module.a)
                self.lora_b[slot, lo:hi, :r].copy_(module.b)
            ranks.append(r)
            scales.append(module.scaling)
        if not self.use_kernels:
            self.packed[slot] = ref.pack_lora_slot(
                [None if m is None else (m.a, m.b, m.scaling) for m in modules],
                self.slice_offsets,
                dtype=self.dtype,
                device=self.device,
            )
            packed = self.packed[slot]
            if self.cpu_kernel and packed is not None:
                row, row_scales = cpu_ops.slot_descriptor(packed.slices)
                self.desc[slot] = torch.tensor(row, dtype=torch.int64)
                self.desc_scales[slot] = torch.tensor(row_scales, dtype=torch.float32)
        self.ranks[slot] = torch.tensor(ranks, dtype=torch.int32)
        self.scalings[slot] = torch.tensor(scales, dtype=torch.float32)
        self.slot_active[slot] = any(ranks)

    def clear_slot(self, slot: int) -> None:
        if self.cpu_kernel:
            self.desc[slot] = 0  # before its tensors go
        self.packed[slot] = None
        self.ranks[slot] = 0
        self.scalings[slot] = 0.0
        self.slot_active[slot] = False

    def touches(self, segs: ref.LoRASegments) -> bool:
        """Whether any row of the step has an adapter that adapts a slice of this group."""
        return any(self.slot_active[slot] for _, _, slot in segs.segments)

    def apply(self, y: torch.Tensor, x: torch.Tensor, segs: ref.LoRASegments) -> None:
        """y [T, OUT] += each adapted row's LoRA delta of x [T, IN], in place."""
        if not self.touches(segs):
            return
        if self.use_kernels:
            from loraplex_kernels.lora_expand import lora_expand
            from loraplex_kernels.lora_shrink import lora_shrink

            shrunk = lora_shrink(x, self.lora_a, self.ranks, segs)
            lora_expand(y, shrunk, self.lora_b, self.ranks, self.scalings, self.slice_offsets, segs)
            return
        if (self.cpu_kernel and segs.max_seg_len <= SMALL_SEGMENT_ROWS
                and x.stride(1) == 1 and y.stride(1) == 1):
            # Decode-sized segments: one fused call for every segment of the step.
            cpu_ops.lora_segments(y, x, segs.token_indices, segs.seg_table, self.desc,
                                  self.desc_scales, self.max_rank)
            return
        if segs.max_seg_len > SMALL_SEGMENT_ROWS or torch.get_num_threads() == 1:
            ref.add_lora_packed(y, x, self.packed, segs)
            return
        # NOTE: decode-sized segments run on one thread. Their matmuls are a few
        # microseconds of work; split over the intra-op pool they wait on a barrier, which
        # stalls for far longer whenever another thread of the process (the HTTP event
        # loop) holds a core. Measured through the server: 32 requests on 17 adapters
        # (Zipf) ran 15-20% slower than on 32 distinct adapters until this.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            ref.add_lora_packed(y, x, self.packed, segs)
        finally:
            torch.set_num_threads(threads)


class LoRASlots:
    """All LoRA groups of a model: install an adapter into a slot of every group."""

    def __init__(
        self,
        groups: list[dict[str, LoRAGroup]],  # per layer: group name -> group
        group_modules: Mapping[str, Sequence[str]],  # group -> its modules in slice order
    ) -> None:
        self.groups = groups
        self.group_modules = {name: tuple(modules) for name, modules in group_modules.items()}
        first = next(iter(groups[0].values())) if groups else None
        self.num_slots = first.num_slots if first is not None else 0
        self.max_rank = first.max_rank if first is not None else 0
        self.device = first.device if first is not None else None
        self.last_install_s = 0.0  # how long the last install took (benchmarks, logs)

    def install(self, slot: int, weights: LoRAWeights) -> None:
        start = time.perf_counter()
        for layer, by_name in enumerate(self.groups):
            for name, group in by_name.items():
                modules = self.group_modules[name]
                group.set_slot(slot, [weights.modules.get((layer, m)) for m in modules])
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.last_install_s = time.perf_counter() - start

    def clear(self, slot: int) -> None:
        for by_name in self.groups:
            for group in by_name.values():
                group.clear_slot(slot)
