"""What every served architecture declares, and the weight loading and LoRA wiring they share.

An architecture is one `CausalLM` subclass. Its class-level data and classmethods are the
single source of its layout: which Hugging Face modules an adapter may target and which
fused linear ("LoRA group") carries each, the (in, out) shape of every such linear, its
parameter count, and the config fields it reads its own way. The PEFT loader, the
placement memory model and the adapter-size bound all ask the class, never a table of
their own.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import QuantizationSpec
from engine.lora.layers import LoRAGroup, LoRASlots
from engine.models.attention import AttentionMetadata, LayerKVCache
from engine.models.config import ArchFields, ModelConfig, ModelLoadError, switched_window
from engine.models.quantized import QuantizedRows, QuantLinear, quantize_rows
from loraplex_kernels import reference as ref

# Modules are built on the meta device, then materialized empty (see LlamaForCausalLM).
META = torch.device("meta")
EMBEDDING_NAME = "model.embed_tokens.weight"  # the embedding table's Hugging Face name


@dataclass(frozen=True, slots=True)
class WeightTarget:
    """Where one checkpoint tensor goes."""

    dest: torch.Tensor  # the parameter, or a row range of a fused one
    # Leading rows of the tensor that rope rotates (q and k heads): stored pair-interleaved.
    rope_rows: int = 0
    # The tensor is one row that every row of dest takes (a per-head norm weight).
    broadcast: bool = False


class CausalLM(nn.Module):
    """A decoder over a step's flattened tokens, with paged KV and multi-LoRA."""

    # Hugging Face `model_type`s this class serves, and config `architectures` names ->
    # their model_type (for configs that name only the architecture).
    model_types: ClassVar[tuple[str, ...]] = ()
    architectures: ClassVar[dict[str, str]] = {}
    # config.json keys that must be present (beyond those every architecture needs).
    required_keys: ClassVar[tuple[str, ...]] = ()
    # LoRA group (one fused linear of a layer) -> the Hugging Face modules it carries, in
    # output-slice order. Every group of a layer shares one adapter slot.
    lora_groups: ClassVar[dict[str, tuple[str, ...]]] = {}
    # Hugging Face module -> its parent in checkpoint and adapter names, e.g. "self_attn".
    module_parents: ClassVar[dict[str, str]] = {}

    # nn.Embedding (engine/models/quantized.py puts a QuantEmbedding here, and an output
    # projection in lm_head, for a quantized base)
    embed_tokens: nn.Embedding
    lm_head: nn.Module | None  # None: tied to embed_tokens
    layers: nn.ModuleList

    def __init__(
        self,
        config: ModelConfig,
        *,
        max_positions: int | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        quantized_linears: bool = False,
    ) -> None:
        """max_positions: the longest sequence to serve (default: config.max_model_len).
        quantized_linears: a subclass leaves its decoder linear weights unmade, for a load
        that quantizes each as it arrives (LlamaForCausalLM)."""
        super().__init__()
        self.config = config
        # Where the weights live and what the activations are in (a quantized base holds
        # some weights as integers).
        self.device = torch.device(device)
        self.dtype = dtype
        # The embedding table as a checkpoint stored it in int8 groups (a GGUF's Q8_0
        # blocks), its float parameter left unmade: quantize_embeddings takes it.
        self.embedding_rows: QuantizedRows | None = None

    # ---------------------------------------------------------------- architecture data

    @classmethod
    def arch_fields(cls, raw: dict[str, Any], source: str) -> ArchFields:
        """This architecture's reading of config.json beyond the common fields; raise
        ModelLoadError for a setting it cannot serve exactly."""
        return ArchFields(sliding_window=switched_window(raw))

    @classmethod
    def linear_shapes(cls, cfg: ModelConfig) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of every module an adapter may target."""
        raise NotImplementedError

    @classmethod
    def rope_rows(cls, module: str, cfg: ModelConfig) -> int:
        """How many leading output rows of `module` rope rotates (0: none)."""
        return 0

    @classmethod
    def count_parameters(cls, cfg: ModelConfig) -> int:
        raise NotImplementedError

    @classmethod
    def target_modules(cls) -> frozenset[str]:
        return frozenset(m for modules in cls.lora_groups.values() for m in modules)

    @classmethod
    def lora_group_shapes(cls, cfg: ModelConfig) -> dict[str, tuple[int, tuple[int, ...]]]:
        """group -> (in_features, output slice sizes), slices in lora_groups order."""
        shapes = cls.linear_shapes(cfg)
        out: dict[str, tuple[int, tuple[int, ...]]] = {}
        for group, modules in cls.lora_groups.items():
            ins = {shapes[m][0] for m in modules}
            assert len(ins) == 1, (group, ins)  # a fused linear has one input
            out[group] = (ins.pop(), tuple(shapes[m][1] for m in modules))
        return out

    # ---------------------------------------------------------------- model

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[LayerKVCache],
        lora: ref.LoRASegments | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, HID]. `lora`: which rows
        use which adapter slot (None: no row has an adapter)."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, HID] of the sampling positions only -> float32 logits [S, V]."""
        if self.lm_head is None:
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    def enable_lora(self, num_slots: int, max_rank: int) -> LoRASlots:
        """Give every LoRA group slot buffers for `num_slots` adapters of rank <= max_rank."""
        device, dtype = self.device, self.dtype
        shapes = self.lora_group_shapes(self.config)
        groups: list[dict[str, LoRAGroup]] = []
        for index in range(len(self.layers)):
            by_name = {
                name: LoRAGroup(num_slots, max_rank, fin, sizes, device=device, dtype=dtype)
                for name, (fin, sizes) in shapes.items()
            }
            self.attach_lora(index, by_name)
            groups.append(by_name)
        return LoRASlots(groups, self.lora_groups)

    def attach_lora(self, layer: int, groups: dict[str, LoRAGroup]) -> None:
        """Hand layer `layer` its LoRA groups (lora_groups' names)."""
        raise NotImplementedError

    # ---------------------------------------------------------------- weights

    def weight_targets(self) -> dict[str, WeightTarget]:
        """Hugging Face tensor name -> where it goes; covers every parameter."""
        raise NotImplementedError

    def ignorable(self, name: str) -> bool:
        """Checkpoint tensors that may be present and are not used."""
        # Old checkpoints store rope frequencies; tied checkpoints may still carry lm_head.
        if name.endswith("rotary_emb.inv_freq"):
            return True
        return name == "lm_head.weight" and self.config.tie_word_embeddings

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedRows]],
                     quantize: QuantizationSpec | None = None) -> int:
        """Copy Hugging Face-named tensors into the parameters; every parameter must be
        covered exactly, else ModelLoadError names what is missing or wrong.

        A decoder linear layer's weight may come as QuantizedRows (a pre-quantized
        checkpoint), and with `quantize` every float one is quantized as it arrives: such a
        layer becomes a QuantLinear once all its parts are in, and its float parameter is
        never written (so a float checkpoint loads at its quantized size). The embedding
        table may come as int8 QuantizedRows too: kept as `embedding_rows`, its float
        parameter unwritten, for quantize_embeddings to take. Returns how many
        layers were loaded quantized."""
        targets = self.weight_targets()
        pending = set(targets)
        unexpected: list[str] = []
        head_dim = self.config.head_dim
        linears = {id(module.weight): (parent, attr, module)
                   for parent in self.layers.modules()
                   for attr, module in parent.named_children() if isinstance(module, nn.Linear)}
        # id(linear weight) -> (first row, rows) of its quantized parts; its float parts.
        quantized: dict[int, list[tuple[int, QuantizedRows]]] = {}
        dense: dict[int, list[str]] = {}
        # How many checkpoint tensors each linear layer is made of, weights and biases (q,
        # k and v: three of each), so that a layer is packed as soon as its last part is in:
        # the unpacked integers (a byte per weight, with their scales) of one layer are
        # held, not the model's. Biases count (id(bias) -> id(its weight)) because the
        # QuantLinear takes a copy of the bias: one read after the packing (a shard boundary
        # between a weight and its bias) would be lost.
        weight_of_bias = {id(module.bias): key for key, (_, _, module) in linears.items()
                          if module.bias is not None}
        left: dict[int, int] = {}  # id(linear weight) -> its parts not yet read
        for where in targets.values():
            base = where.dest if where.dest._base is None else where.dest._base
            key = weight_of_bias.get(id(base), id(base))
            if key in linears:
                left[key] = left.get(key, 0) + 1
        packed: set[int] = set()

        def part_read(key: int) -> None:
            left[key] -= 1
            # A layer with float weight parts too waits for the end (refused there).
            if left[key] == 0 and key in quantized and key not in dense:
                pack_layer(key)

        def pack_layer(key: int) -> None:
            parent, attr, module = linears[key]
            label = f"{attr} [{module.out_features}, {module.in_features}]"
            if key in dense:
                raise ModelLoadError(f"layer {label} mixes quantized and float parts "
                                     f"({', '.join(dense[key])} unquantized)")
            parts = sorted(quantized.pop(key), key=lambda part: part[0])
            try:
                stacked = QuantizedRows.cat([p for _, p in parts])
                qw = stacked.pack(quantize is not None and quantize.int8_activations,
                                  self.device, self.dtype)
            except ValueError as exc:
                raise ModelLoadError(f"layer {label}: {exc}") from None
            setattr(parent, attr, QuantLinear(qw, module.bias, stacked.input_order))
            packed.add(key)
        with torch.no_grad():
            for name, tensor in weights:
                target = targets.get(name)
                if target is None:
                    if not self.ignorable(name):
                        unexpected.append(name)
                    continue
                dest = target.dest
                want = tuple(dest.shape[1:]) if target.broadcast else tuple(dest.shape)
                if tuple(tensor.shape) != want:
                    raise ModelLoadError(
                        f"tensor {name} has shape {list(tensor.shape)}, "
                        f"the config expects {list(want)}"
                    )
                param = dest if dest._base is None else dest._base
                is_linear = id(param) in linears and dest.dim() == 2
                if isinstance(tensor, torch.Tensor) and is_linear and quantize is not None:
                    try:
                        # On a GPU the layer is quantized there, not on the host.
                        tensor = quantize_rows(tensor.to(self.device), quantize)
                    except ValueError as exc:
                        raise ModelLoadError(f"--quantization {quantize.scheme}: {name} "
                                             f"{list(tensor.shape)}: {exc}") from None
                if target.rope_rows:
                    rows = target.rope_rows

                    def rope(t: torch.Tensor, rows: int = rows) -> torch.Tensor:
                        return interleave_leading_rows(t, rows, head_dim)

                    tensor = tensor.map_rows(rope) if isinstance(tensor, QuantizedRows) \
                        else rope(tensor)
                if isinstance(tensor, QuantizedRows) and name == EMBEDDING_NAME \
                        and tensor.bits == 8 and tensor.offsets is None:
                    self.embedding_rows = tensor
                elif isinstance(tensor, QuantizedRows):
                    if not is_linear:
                        raise ModelLoadError(f"tensor {name} is quantized; only the decoder "
                                             "layers' linear weights and the embeddings (int8) "
                                             "may be")
                    row0 = (dest.storage_offset() - param.storage_offset()) // dest.stride(0)
                    quantized.setdefault(id(param), []).append((row0, tensor))
                else:
                    dest.copy_(tensor)
                    if is_linear:
                        dense.setdefault(id(param), []).append(name)
                if name in pending:
                    key = weight_of_bias.get(id(param), id(param))
                    if key in left:
                        part_read(key)
                pending.discard(name)
        if unexpected:
            raise ModelLoadError(
                f"checkpoint has {len(unexpected)} tensors this architecture does not use, "
                f"e.g. {', '.join(sorted(unexpected)[:5])}"
            )
        if pending:
            raise ModelLoadError(
                f"checkpoint is missing {len(pending)} tensors, "
                f"e.g. {', '.join(sorted(pending)[:5])}"
            )
        for key in list(quantized):
            pack_layer(key)  # a layer with float parts too: refused
        return len(packed)


def interleave_leading_rows(tensor: torch.Tensor, rows: int, head_dim: int) -> torch.Tensor:
    """`tensor` with its first `rows` rows (whole rope heads) pair-interleaved per head."""
    if rows == tensor.shape[0]:
        return ref.interleave_rope_rows(tensor, head_dim)
    rotated = ref.interleave_rope_rows(tensor[:rows], head_dim)
    return torch.cat((rotated, tensor[rows:]))
