"""Owns the model, its KV cache and tokenizer; turns a SchedulerOutput into logits."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.core.memory import KVCacheBudget, kv_cache_budget
from engine.core.sampler import prompt_token_logprobs
from engine.core.state import ScheduledChunk, SchedulerOutput
from engine.core.step_profile import run_largest_step
from engine.lora.layers import LoRASlots
from engine.models.attention import (
    AttentionMetadata,
    LayerKVCache,
    PrefillSequence,
    allocate_kv_cache,
)
from engine.models.base import CausalLM
from engine.models.checkpoint_quant import checkpoint_scheme, quantized_tensors
from engine.models.cpu_linear import kernel_weight_bytes, pack_linears, packing_available
from engine.models.gguf_weights import GGUF_GROUP, gguf_tensors
from engine.models.loader import (
    ModelConfig,
    ModelLoadError,
    bundled_source,
    iter_safetensors,
    load_tokenizer,
    validate_model_dir,
)
from engine.models.quantized import (
    QuantizationSpec,
    quantize_embeddings,
    weight_bytes,
)
from engine.models.registry import model_class_for
from engine.request import TokenLogprob
from engine.runtime import cpu_features
from engine.runtime.host_memory import (
    idle_trimmer,
    keep_freed_activation_memory,
    release_free_memory,
)
from loraplex_kernels import cpu_build, cpu_decode, cpu_ops, cpu_qdot
from loraplex_kernels.reference import LoRASegments

logger = logging.getLogger(__name__)

# NOTE: on CPU the default cache holds enough tokens for max_num_seqs sequences of
# max_model_len, capped at this many tokens (SmolLM2: 46 KiB per token in float32, so 3
# GiB). The cache is an anonymous mapping (allocate_kv_cache), backed when the engine starts
# (config.kv_cache_prefault) or else only once blocks are written, RSS then following the
# blocks used.
CPU_DEFAULT_KV_CACHE_TOKENS = 65536
# Prompt logprobs: rows of logits computed at a time (x the vocabulary, float32: 128 rows
# of a 128k vocabulary are 64 MiB).
PROMPT_LOGPROB_ROWS = 128

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """`auto` device: CUDA if available else CPU; `auto` dtype: bf16 on CUDA devices that
    support it (compute capability 8.0+), else float16; on CPU bf16 where it has AMX-BF16
    or AVX-512 BF16, else float32 (engine/runtime/cpu_features.py). bfloat16 asked for on a CUDA
    device without it is refused."""
    if device == "auto":
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            dev = torch.device(device)
        except RuntimeError as e:
            raise ValueError(f"unknown device {device!r}") from e
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"unsupported device {device!r} (cpu, cuda, cuda:N or auto)")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available")
    if dtype != "auto" and dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r} (auto, {', '.join(_DTYPES)})")
    if dev.type != "cuda":
        return dev, cpu_features.auto_cpu_dtype() if dtype == "auto" else _DTYPES[dtype]
    if dtype in ("float32", "float16"):
        return dev, _DTYPES[dtype]
    bf16 = _cuda_supports_bf16(dev)
    if dtype == "auto":
        return dev, torch.bfloat16 if bf16 else torch.float16
    if dtype == "bfloat16" and not bf16:
        major, minor = torch.cuda.get_device_capability(dev)
        raise ValueError(
            f"dtype bfloat16 is not supported on {torch.cuda.get_device_name(dev)} "
            f"(compute capability {major}.{minor}; bfloat16 needs 8.0 or newer): use "
            "--dtype float16 (or auto, which picks float16 there)"
        )
    return dev, _DTYPES[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def describe_compute(device: torch.device) -> str:
    """The processor a step runs on, as the startup line and /admin/engine show it."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_features.describe_dtype_choice()


def _cuda_supports_bf16(dev: torch.device) -> bool:
    # NOTE: is_bf16_supported() answers for the current device; ask for this one.
    # including_emulation=False: emulated bf16 on pre-Ampere GPUs is far slower than fp16.
    with torch.cuda.device(dev):
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    metadata: AttentionMetadata
    sample_indices: torch.Tensor  # [S] long: rows of the last token of each sampling chunk
    lora: LoRASegments | None = None  # rows by adapter slot; None: no row has an adapter


@dataclass(frozen=True, slots=True)
class KVCacheSizing:
    num_blocks: int
    max_model_len: int  # capped to the cache's capacity when that is smaller
    budget: KVCacheBudget | None  # CUDA: the profiled budget the blocks came from


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: Path) -> None:
        self.config = config
        self.model_dir = Path(model_dir)
        self._prompt_results: dict[str, tuple[int, list[TokenLogprob]]] = {}
        self.model_config: ModelConfig = validate_model_dir(self.model_dir)
        self.device, self.dtype = resolve_device_dtype(config.device, config.dtype)
        self.compute = describe_compute(self.device)  # what the dtype was chosen for
        self.quantization = QuantizationSpec(config.quantization, config.quantization_group_size)
        # A pre-quantized checkpoint runs at its own precision (checkpoint_quant.py).
        self.checkpoint_scheme = checkpoint_scheme(self.model_dir)
        if self.checkpoint_scheme is not None:
            stored = self.checkpoint_scheme
            if self.quantization.int8_activations:
                raise ValueError(
                    f"--quantization w8a8 quantizes a float checkpoint; {self.model_dir.name} "
                    f"is {stored.describe()} (its config.json): leave --quantization unset")
            if self.quantization.enabled and self.quantization.bits != stored.bits:
                raise ValueError(
                    f"--quantization {self.quantization.scheme} cannot serve "
                    f"{self.model_dir.name}: its weights are {stored.describe()} (its "
                    f"config.json); leave --quantization unset (or int{stored.bits})")
            self.quantization = stored.spec
        self.quantization.check_device(self.device)
        # int4 in groups of 32 on the bundled model: its GGUF's Q4_1 blocks as they are.
        self.gguf_source: Path | None = None
        if (self.checkpoint_scheme is None and self.quantization.scheme == "int4"
                and self.quantization.group == GGUF_GROUP):
            self.gguf_source = bundled_source(self.model_dir)
        cpu_build.configure(config.kernel_settings)
        if self.device.type == "cpu":
            torch.set_num_threads(config.num_threads or len(os.sched_getaffinity(0)))
        self.block_size = config.block_size
        self.tokenizer: Any = load_tokenizer(self.model_dir)

        self.model, self.lora, model_len = self._load_model()
        mc = self.model_config
        self.kv_bytes_per_token = (
            2 * mc.num_layers * mc.kv_size * torch.empty((), dtype=self.dtype).element_size()
        )
        sizing = self._size_kv_cache(model_len)
        self.kv_budget: KVCacheBudget | None = sizing.budget  # CUDA: how the cache was sized
        self.num_blocks, self.max_model_len = sizing.num_blocks, sizing.max_model_len
        self.kv_caches: list[LayerKVCache] = allocate_kv_cache(
            mc.num_layers,
            self.num_blocks,
            self.block_size,
            mc.num_kv_heads,
            mc.head_dim,
            self.dtype,
            self.device,
            prefault=config.kv_cache_prefault,
        )
        logger.info(
            "model %s on %s, %s (--dtype %s; %s): %d KV blocks of %d tokens, "
            "max_model_len %d",
            self.model_dir.name,
            self.device,
            dtype_name(self.dtype),
            self.config.dtype,
            self.compute,
            self.num_blocks,
            self.block_size,
            self.max_model_len,
        )
        self._log_fast_paths()

    def _model_len(self) -> int:
        """The longest sequence the model and --max-model-len allow (before the KV cache's
        capacity is known)."""
        config = self.config
        model_len = self.model_config.max_model_len
        max_pos = self.model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > max_pos:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's "
                f"max_position_embeddings {max_pos} ({self.model_dir.name}); "
                f"use --max-model-len {max_pos} or less"
            )
        if config.max_model_len is not None and config.max_model_len > model_len:
            logger.warning(
                "max_model_len %d exceeds the model's %d; using %d",
                config.max_model_len,
                model_len,
                model_len,
            )
        return min(config.max_model_len or model_len, model_len)

    def _load_model(self) -> tuple[CausalLM, LoRASlots | None, int]:
        """The model with its weights (packed for oneDNN where that is on) and its LoRA
        slots, and the max_model_len its rotary tables were built for."""
        config = self.config
        max_model_len = self._model_len()
        model_cls = model_class_for(self.model_config)
        # Under any quantization every decoder linear is loaded as integers (a pre-quantized
        # checkpoint's float linears, if any, quantized as they arrive to its scheme), so
        # its float weight is never made: on a GPU that would be the float model's memory.
        model: CausalLM = model_cls(
            self.model_config, max_positions=max_model_len, device=self.device,
            dtype=self.dtype, quantized_linears=self.quantization.enabled,
        )
        tensors = iter_safetensors(self.model_dir)
        if self.checkpoint_scheme is not None:
            num_quantized = model.load_weights(quantized_tensors(tensors, self.checkpoint_scheme),
                                               quantize=self.quantization)
        elif self.gguf_source is not None:
            num_quantized = model.load_weights(
                gguf_tensors(self.gguf_source, self.model_config, native=True),
                quantize=self.quantization)
        else:
            # A float checkpoint is quantized layer by layer as it loads: no float copy of
            # the decoder's linear layers is ever held.
            num_quantized = model.load_weights(
                tensors, quantize=self.quantization if self.quantization.enabled else None)
        model.eval()
        if self.quantization.enabled:
            # Every decoder linear was loaded as integers (its float weight never made).
            left = [name for name, module in model.layers.named_modules()
                    if isinstance(module, torch.nn.Linear)]
            if left:
                raise ModelLoadError(f"decoder linear layers left unquantized: {left[:3]}")
            if quantize_embeddings(model, self.dtype, self.quantization.int8_activations):
                tables = "the embeddings and the output projection to int8"
            elif self.device.type != "cpu":
                tables = f"the embeddings and the output projection kept in {self.dtype}"
            else:
                tables = (f"the embeddings and the output projection kept in {self.dtype} (a "
                          f"vocabulary of {self.model_config.vocab_size}, not a multiple of "
                          "16)")
            if self.checkpoint_scheme is not None:
                source = (f"loaded {num_quantized} linear layers as stored "
                          f"({self.checkpoint_scheme.describe()})")
            elif self.gguf_source is not None:
                source = (f"loaded {num_quantized} linear layers from {self.gguf_source.name}"
                          f"'s blocks ({self.quantization.describe()})")
            else:
                source = (f"quantized {num_quantized} linear layers to "
                          f"{self.quantization.describe()}")
            logger.info("%s; %s", source, tables)
        if config.pack_cpu_weights and packing_available(self.device, self.dtype):
            tied = model.embed_tokens.weight if model.lm_head is None else None
            num_packed = pack_linears(model, lm_head_weight=tied)
            every_step = kernel_weight_bytes(model, "every_step")
            tiles = kernel_weight_bytes(model, "tiles")
            if every_step:
                logger.info("packed %d linear layers: bf16 ones run every step on the "
                            "AVX-512 BF16 dot-product kernel (LORAPLEX_CPU_GEMM=0: oneDNN)",
                            num_packed)
            else:
                logger.info("packed %d linear layers for oneDNN", num_packed)
            if tiles:
                logger.info("steps of up to 32 rows run their linear layers on AMX tiles: "
                            "%.0f MiB of weights held a second time in their layout "
                            "(LORAPLEX_CPU_AMX=0 turns it off)",
                            tiles / 2**20)
        if self.device.type == "cpu":
            # The unpacked weights just freed would otherwise stay in the heap for good
            # (and a checkpoint's mapping held by a reference cycle, in the RSS until the
            # collector's next full pass).
            gc.collect()
            release_free_memory()
            keep_freed_activation_memory()
        self.weight_bytes = weight_bytes(model)
        lora: LoRASlots | None = None
        if config.max_loras > 0:
            lora = model.enable_lora(config.max_loras, config.max_lora_rank)
        return model, lora, max_model_len

    def _size_kv_cache(self, max_model_len: int) -> KVCacheSizing:
        """How many blocks the KV cache gets (--kv-cache-tokens; on CUDA what the profiled
        budget leaves; on the CPU enough for max_num_seqs full sequences, capped), and the
        max_model_len that capacity allows."""
        config = self.config
        budget = self._kv_budget(max_model_len)
        if config.kv_cache_tokens:
            num_tokens = config.kv_cache_tokens
        elif budget is not None:
            num_tokens = budget.kv_cache_tokens
            if num_tokens < self.block_size:
                raise ValueError(
                    f"no memory is left for the KV cache: {budget.describe()}; raise "
                    "--gpu-memory-utilization, or lower --max-num-batched-tokens, "
                    "--max-num-seqs, --max-loras or --max-lora-rank"
                )
        else:
            num_tokens = min(config.max_num_seqs * max_model_len, CPU_DEFAULT_KV_CACHE_TOKENS)
        num_blocks = max(1, -(-num_tokens // self.block_size))
        capacity = num_blocks * self.block_size
        if capacity < max_model_len:
            # A longer sequence could never be given blocks; refuse it up front instead.
            logger.warning(
                "KV cache holds %d tokens, fewer than max_model_len %d; capping max_model_len",
                capacity,
                max_model_len,
            )
            max_model_len = capacity
        return KVCacheSizing(num_blocks=num_blocks, max_model_len=max_model_len, budget=budget)

    def _kv_budget(self, max_model_len: int) -> KVCacheBudget | None:
        """CUDA without --kv-cache-tokens: the budget the profiled step leaves the cache;
        None elsewhere."""
        if self.config.kv_cache_tokens or self.device.type != "cuda":
            return None
        budget = self._profile_kv_budget(max_model_len)
        logger.info("KV cache budget: %s", budget.describe())
        return budget

    def describe_quantization(self) -> str:
        """The scheme the weights run under, and where a checkpoint's own integers came
        from ("int4 (groups of 128), as stored: GPTQ")."""
        text = self.quantization.describe()
        if self.checkpoint_scheme is not None:
            return f"{text}, as stored: {self.checkpoint_scheme.describe().split(',')[0]}"
        if self.gguf_source is not None:
            return f"{text}, as stored: GGUF Q4_1"
        return text

    def fast_paths(self) -> dict[str, bool]:
        """CPU: whether each part of a step runs its fast path in this dtype (packed
        oneDNN linears, the fused kernels, paged decode attention); {} on CUDA."""
        if self.device.type != "cpu":
            return {}
        paths = {
            "packed linear layers": self.config.pack_cpu_weights
            and packing_available(self.device, self.dtype),
            "fused norm, activation, K/V write and LoRA kernels": cpu_ops.available(
                self.device, self.dtype),
            "paged decode attention kernel": cpu_decode.available(self.device, self.dtype),
        }
        if self.quantization.int8_activations:
            # Without AVX-512 VNNI the w8a8 layers run the kernel's generic loops: the same
            # results, ~20x slower than --quantization int8's kernel at 32 rows.
            paths["w8a8 integer products on AVX-512 VNNI (without: ~20x slower than "
                  "--quantization int8; use int8 on this CPU)"] = cpu_qdot.variant() == "vnni"
        return paths

    def _log_fast_paths(self) -> None:
        slow = [name for name, fast in self.fast_paths().items() if not fast]
        if slow:
            # NOTE: a warning, not a refusal: the torch paths are correct, only slower
            # (no C compiler, cpu_kernels off, or oneDNN without this dtype).
            logger.warning("%s steps run without: %s", dtype_name(self.dtype), ", ".join(slow))

    def _profile_kv_budget(self, max_model_len: int) -> KVCacheBudget:
        """Run the largest step once and give the KV cache what is left of
        gpu_memory_utilization x the device's memory (kv_cache_budget)."""
        dev = self.device
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        weights = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        scratch_bytes = self.profile_run(max_model_len)
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
        free, total = torch.cuda.mem_get_info(dev)
        # What the process and anything else on the device use outside torch's caching
        # allocator (CUDA context, cuBLAS and Triton workspaces, other processes).
        non_torch = max(0, total - free - torch.cuda.memory_reserved(dev))
        torch.cuda.empty_cache()
        return kv_cache_budget(
            total_bytes=total,
            weights_bytes=weights,
            activation_bytes=max(0, peak - weights - scratch_bytes),
            non_torch_bytes=non_torch,
            kv_bytes_per_token=self.kv_bytes_per_token,
            gpu_memory_utilization=self.config.gpu_memory_utilization,
            block_size=self.block_size,
            kv_gather_divisor=self.model_config.num_layers,
        )

    def profile_run(self, max_model_len: int) -> int:
        """The largest step the config allows, once (see engine/core/step_profile.py); returns
        the bytes of the scratch KV cache it ran against."""
        return run_largest_step(
            self.model, self.lora, self.config, self.model_config,
            max_model_len=max_model_len, dtype=self.dtype, device=self.device,
        )

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def execute(
        self, output: SchedulerOutput, adapter_slots: Mapping[str, int] | None = None
    ) -> torch.Tensor:
        """Run one step; float32 logits [S, V] for the chunks that sample, in chunk order.
        `adapter_slots`: the device slot of every adapter id the chunks' requests use."""
        if not output.chunks:
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        with idle_trimmer.busy() if self.device.type == "cpu" else contextlib.nullcontext():
            return self._execute(output, adapter_slots)

    def _execute(
        self, output: SchedulerOutput, adapter_slots: Mapping[str, int] | None
    ) -> torch.Tensor:
        inputs = self.prepare_inputs(output.chunks, adapter_slots)
        with torch.inference_mode():
            hidden = self.model(
                inputs.input_ids, inputs.positions, inputs.metadata, self.kv_caches, inputs.lora
            )
            if any(c.request.prompt_logprobs is not None for c in output.chunks):
                self._prompt_logprobs(output.chunks, hidden)
            if inputs.sample_indices.numel() == 0:
                return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
            return self.model.compute_logits(hidden[inputs.sample_indices])

    def take_prompt_logprobs(self) -> dict[str, tuple[int, list[TokenLogprob]]]:
        """The prompt logprobs the steps since the last call computed: request id ->
        (the prompt index of the first entry, entries)."""
        taken, self._prompt_results = self._prompt_results, {}
        return taken

    def _prompt_logprobs(self, chunks: list[ScheduledChunk], hidden: torch.Tensor) -> None:
        """For each chunk whose request asked for prompt logprobs: the logprob of every
        prompt token the chunk's positions predict (a chunk of [a, b) predicts a+1 .. b,
        the last prompt token at most), PROMPT_LOGPROB_ROWS rows of logits at a time so
        that a long prompt never holds a prompt x vocabulary tensor."""
        row = 0  # the runner lays chunks out in order, one row per token
        for chunk in chunks:
            request = chunk.request
            k = request.sampling.prompt_logprobs
            end = min(chunk.start + chunk.num_tokens, request.num_prompt_tokens - 1)
            if k is not None and end > chunk.start:
                targets = request.prompt_token_ids[chunk.start + 1:end + 1]
                entries: list[TokenLogprob] = []
                for first in range(0, len(targets), PROMPT_LOGPROB_ROWS):
                    count = min(PROMPT_LOGPROB_ROWS, len(targets) - first)
                    logits = self.model.compute_logits(hidden[row + first:row + first + count])
                    entries += prompt_token_logprobs(logits, targets[first:first + count], k)
                self._prompt_results[request.request_id] = (chunk.start + 1, entries)
            row += chunk.num_tokens

    def prepare_inputs(
        self, chunks: list[ScheduledChunk], adapter_slots: Mapping[str, int] | None = None
    ) -> StepInputs:
        """Flatten a step's chunks into model inputs. `adapter_slots`: the device slot of
        every adapter version the chunks' requests use."""
        slots_of = adapter_slots or {}
        layout = _StepLayout()
        # Single-token chunks at the head of the step share the batched decode call.
        num_decodes = 0
        while num_decodes < len(chunks) and chunks[num_decodes].num_tokens == 1:
            num_decodes += 1
        self._lay_out_decodes(layout, chunks[:num_decodes], slots_of)
        for chunk in chunks[num_decodes:]:
            self._lay_out_prefill(layout, chunk, self._adapter_slot(chunk, slots_of))
        dev = self.device
        return StepInputs(
            input_ids=torch.tensor(layout.token_ids, dtype=torch.long, device=dev),
            positions=torch.tensor(layout.positions, dtype=torch.long, device=dev),
            metadata=self._attention_metadata(layout),
            sample_indices=torch.tensor(layout.sample_rows, dtype=torch.long, device=dev),
            lora=LoRASegments.from_token_slots(layout.token_slots, dev),
        )

    def _adapter_slot(self, chunk: ScheduledChunk, slots_of: Mapping[str, int]) -> int:
        """The device slot of the chunk's adapter version; -1 for the base model."""
        key = chunk.request.adapter_key
        if key is None:
            return -1
        assert self.lora is not None, "adapter request on an engine without LoRA slots"
        return slots_of[key]

    def _lay_out_decodes(
        self, layout: _StepLayout, decodes: list[ScheduledChunk], slots_of: Mapping[str, int]
    ) -> None:
        """One row per decode: its token, position, KV slot and block table."""
        bs = self.block_size
        # NOTE: decodes are laid out longest context first so that consecutive groups
        # pad their gathered K/V only to their own longest context (see decode_groups).
        order = sorted(range(len(decodes)), key=lambda i: -decodes[i].start)
        row_of = [0] * len(decodes)
        for row, i in enumerate(order):
            row_of[i] = row
            request, start = decodes[i].request, decodes[i].start
            blocks = request.block_ids
            num_blocks = start // bs + 1
            assert len(blocks) >= num_blocks, (request.request_id, start, blocks)
            assert start < self.max_model_len, (request.request_id, start, self.max_model_len)
            layout.token_ids.append(request.token_at(start))
            layout.token_slots.append(self._adapter_slot(decodes[i], slots_of))
            layout.positions.append(start)
            layout.slots.append(blocks[start // bs] * bs + start % bs)
            layout.decode_tables.append(blocks[:num_blocks])
            layout.decode_lens.append(start + 1)
        layout.sample_rows.extend(row_of[i] for i, c in enumerate(decodes) if c.samples)

    def _lay_out_prefill(
        self, layout: _StepLayout, chunk: ScheduledChunk, adapter_slot: int
    ) -> None:
        """The chunk's rows: tokens [start, end) with their positions and KV slots."""
        bs = self.block_size
        request, start, n = chunk.request, chunk.start, chunk.num_tokens
        end = start + n
        blocks = request.block_ids
        num_blocks = -(-end // bs)
        assert n > 0 and len(blocks) >= num_blocks, (request.request_id, start, n, blocks)
        assert end <= self.max_model_len, (request.request_id, end, self.max_model_len)
        row = len(layout.token_ids)
        prompt = request.prompt_token_ids
        source = prompt if end <= len(prompt) else request.all_token_ids
        layout.token_ids.extend(source[start:end])
        layout.token_slots.extend([adapter_slot] * n)
        layout.positions.extend(range(start, end))
        i = start
        while i < end:  # one range of KV slots per block the chunk touches
            offset = i % bs
            run = min(bs - offset, end - i)
            base = blocks[i // bs] * bs + offset
            layout.slots.extend(range(base, base + run))
            i += run
        layout.prefills.append((row, n, end, blocks[:num_blocks]))
        if chunk.samples:
            layout.sample_rows.append(row + n - 1)

    def _attention_metadata(self, layout: _StepLayout) -> AttentionMetadata:
        dev = self.device
        tables: torch.Tensor | None = None
        lens: torch.Tensor | None = None
        if layout.decode_tables:
            width = max(len(t) for t in layout.decode_tables)
            padded = [t + [0] * (width - len(t)) for t in layout.decode_tables]
            tables = torch.tensor(padded, dtype=torch.long, device=dev)
            lens = torch.tensor(layout.decode_lens, dtype=torch.long, device=dev)
        prefills = [
            PrefillSequence(
                query_start=row,
                query_len=n,
                context_len=ctx,
                block_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            )
            for row, n, ctx, ids in layout.prefills
        ]
        return AttentionMetadata(
            slot_mapping=torch.tensor(layout.slots, dtype=torch.long, device=dev),
            num_decode_tokens=len(layout.decode_tables),
            decode_block_tables=tables,
            decode_context_lens=lens,
            prefills=prefills,
            block_size=self.block_size,
            decode_group_sizes=decode_group_sizes([len(t) for t in layout.decode_tables]),
        )


class _StepLayout:
    """A step's flattened rows as Python lists, before they become tensors."""

    __slots__ = ("decode_lens", "decode_tables", "positions", "prefills", "sample_rows",
                 "slots", "token_ids", "token_slots")

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.token_slots: list[int] = []  # per row: adapter slot, -1 for the base model
        self.positions: list[int] = []
        self.slots: list[int] = []  # per row: where its K/V goes in the cache
        self.sample_rows: list[int] = []  # rows whose logits are sampled, in chunk order
        self.decode_tables: list[list[int]] = []  # per decode row: its block table
        self.decode_lens: list[int] = []  # per decode row: its context length
        # Per prefill chunk: (first row, rows, context length after it, block table).
        self.prefills: list[tuple[int, int, int, list[int]]] = []


# A decode group is closed when the next (shorter) sequence would pad to less than this
# share of the group's widest block table...
DECODE_GROUP_FILL = 0.75
# ...but groups stay at least this large: each group is one attention call per layer.
MIN_DECODE_GROUP = 4


def decode_group_sizes(widths: list[int]) -> list[int] | None:
    """Split block-table widths, sorted longest first, into padding-bounded groups."""
    sizes: list[int] = []
    group_width = 0
    for width in widths:
        if sizes and (sizes[-1] < MIN_DECODE_GROUP or width >= DECODE_GROUP_FILL * group_width):
            sizes[-1] += 1
        else:
            sizes.append(1)
            group_width = width
    return sizes or None
