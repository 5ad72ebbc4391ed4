"""Quantized base models: `--quantization none|int8|int4|fp8|w8a8`.

The decoder layers' linear layers (q/k/v, o, gate/up, down) hold their weights as int8 or
int4 integers with float32 scales (loraplex_kernels/cpu_quant.py); their activations, the
LoRA deltas added to their outputs, norms, attention and the KV cache stay in the serving
dtype. The embeddings and the output projection (one matrix where they are tied: 21% of
SmolLM2's parameters, held twice unquantized, the output projection's packed copy) are
int8 in groups of 32 under every scheme (EMBEDDING_GROUP): GGUF's Q8_0 grid, the
precision the bundled SmolLM2's embeddings ship in, so that model loses nothing there;
`loraplex bench quant-quality` measures the rest.

- int8: symmetric, one scale per output channel (or per group with a group size). With
  bf16 activations on a CPU with AVX-512 VNNI, per output channel (and the embeddings'
  groups of 32): loraplex_kernels/cpu_qdot.py with wide activations, each row of the
  input as 16-bit integers, two exact integer sums a column (weight-only in its
  precision), at every step size.
- int4: asymmetric per group of `group_size` inputs (a scale and the group's minimum),
  DEFAULT_INT4_GROUP_SIZE by default.
- fp8 (CUDA, compute capability 8.9+): float8 e4m3 per output channel, each row of the
  input quantized to fp8 as the step runs (loraplex_kernels/device_quant.py); refused
  with one line on the CPU (no fp8 units) and on older GPUs.
- w8a8 (CPU): the weights as int8's, and each linear layer's input quantized to int8 as
  the step runs (in groups of 64 inputs), the products summed in integers
  (loraplex_kernels/cpu_qdot.py) at every step size: on AVX-512 VNNI twice the
  multiply-adds an instruction of bf16's. The LoRA deltas read the unquantized input.

On a CUDA GPU the same integers are held in device_quant's row-major layout (decode steps
on a Triton kernel, larger ones over the layer dequantized, with cuBLAS), and the
embeddings and output projection stay in the serving dtype. What follows is the CPU's.

Steps of up to DENSE_ROWS rows (decode, small prefills) run the C kernel on the integers;
larger ones dequantize a layer at a time and run a dense matmul on it, which is faster
there (docs/BENCHMARKS.md, "Quantized base models"): in float32, or, for bf16
activations on a CPU whose bf16 matmuls are the faster (AMX-BF16; AVX-512 BF16 where
timed so, as `--dtype auto` times it), on the weights rounded to bf16, as the bf16
engine's own weights are (a float32 matmul runs at a sixth of a bf16 one with AMX, a
third on a Zen 4: a prefill step of a quantized base took 2-4x the bf16 base's).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from engine.config import QuantizationSpec
from loraplex_kernels import cpu_qdot, cpu_quant, device_quant

# The embeddings and the output projection under any scheme: int8 in groups of 32 inputs
# (GGUF's Q8_0 grid, which the bundled SmolLM2's embeddings ship in), per row where the
# hidden size is not a multiple of 32.
EMBEDDING_BITS, EMBEDDING_GROUP = 8, 32

# Rows above which a step dequantizes a layer and multiplies densely instead of running
# the integer kernel (measured on SmolLM2's layers: the two are even at 256 rows, the
# dense path faster at 512 and more).
DENSE_ROWS = 256


@dataclass(frozen=True, slots=True)
class QuantizedRows:
    """A linear weight [N, K] as integers before packing: what a quantized checkpoint's
    tensors unpack to and what quantization on load makes, so that the loader can fuse and
    rope-permute rows (q, k and v into one layer) before cpu_quant.pack.

    q: [N, K] int8 (8 bits) or uint8 in 0..15 (4 bits); scales, offsets: [N, K / group]
    float32 (offsets None: w = q * scale, else w = q * scale + offset)."""

    q: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    bits: int
    group: int
    # Act-order checkpoints: the inputs in the order the columns of q are stored in (x's
    # columns are gathered in it before the product); None: their own order.
    input_order: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.q.shape
        return n, k

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedRows:
        """The same rows reordered by `fn` (a permutation of dim 0)."""
        return QuantizedRows(_as_values(fn(_as_bytes(self.q)), self.q.dtype), fn(self.scales),
                             None if self.offsets is None else fn(self.offsets),
                             self.bits, self.group, self.input_order)

    @staticmethod
    def cat(parts: list[QuantizedRows]) -> QuantizedRows:
        """Row blocks of one layer (q, k, v) stacked; they must share bits and group."""
        first = parts[0]
        if any((p.bits, p.group) != (first.bits, first.group) for p in parts):
            raise ValueError("its parts are quantized differently: "
                             + ", ".join(f"int{p.bits} groups of {p.group}" for p in parts))
        order = first.input_order
        if any(p.input_order is not order and (
                p.input_order is None or order is None or not torch.equal(p.input_order, order))
               for p in parts):
            raise ValueError("its parts have different act-order input orders (g_idx); "
                             "they share one input, so one order is needed")
        offsets = None
        if any(p.offsets is not None for p in parts):
            offsets = torch.cat([torch.zeros_like(p.scales) if p.offsets is None else p.offsets
                                 for p in parts])
        if any(p.q.dtype != first.q.dtype for p in parts):
            raise ValueError("its parts are quantized differently: "
                             + ", ".join(str(p.q.dtype) for p in parts))
        q = _as_values(torch.cat([_as_bytes(p.q) for p in parts]), first.q.dtype)
        return QuantizedRows(q, torch.cat([p.scales for p in parts]), offsets,
                             first.bits, first.group, first.input_order)

    def pack(self, int8_activations: bool = False, device: torch.device | str = "cpu",
             dtype: torch.dtype | None = None) -> QuantizedWeights:
        """The layout of `device`'s kernels: on the CPU cpu_quant's, or with
        `int8_activations` cpu_qdot's (which takes symmetric int8 per output channel only);
        on CUDA device_quant's (fp8 rows: an Fp8Weight). int8 per output channel for bf16
        activations (`dtype`) on a CPU with AVX-512 VNNI: cpu_qdot's with wide activations
        (each row as 16-bit integers), weight-only in its precision and at least the bf16
        kernel's speed where cpu_quant's converts its integers to bf16 (docs/BENCHMARKS.md,
        "int8 weights against 16-bit activations")."""
        if torch.device(device).type != "cpu":
            if int8_activations:
                raise ValueError("w8a8 runs on the CPU; on a GPU use fp8, int8 or int4")
            if self.q.dtype == device_quant.FP8_DTYPE:
                return device_quant.pack_fp8(self.q, self.scales, device)
            return device_quant.pack(self.q, self.scales, self.offsets, self.bits, self.group,
                                     device)
        if self.q.dtype == device_quant.FP8_DTYPE:
            raise ValueError("fp8 weights run on CUDA GPUs of compute capability 8.9 or newer")
        if int8_activations:
            k = self.shape[1]
            if self.bits != 8 or self.group != k or self.offsets is not None \
                    or self.input_order is not None:
                raise ValueError(f"w8a8 needs int8 per output channel, not int{self.bits} "
                                 f"in groups of {self.group}")
            return cpu_qdot.pack(self.q, self.scales)
        if self.takes_wide_activations(dtype):
            return cpu_qdot.pack(self.q, self.scales, wide=True)
        return cpu_quant.pack(self.q, self.scales, self.offsets, self.bits, self.group)

    def takes_wide_activations(self, dtype: torch.dtype | None) -> bool:
        """Whether these rows run cpu_qdot's wide kernel on the CPU for `dtype` inputs."""
        n, k = self.shape
        return (dtype is not None and self.bits == 8 and self.group == k
                and self.offsets is None and self.input_order is None
                and self.q.dtype == torch.int8 and cpu_qdot.runs_wide(n, k, None, dtype)
                and bool((self.q != -128).all()))


def _as_bytes(q: torch.Tensor) -> torch.Tensor:
    """fp8 values as their bytes (older torch builds cannot concatenate or permute float8
    on CUDA), other integers as they are."""
    return q.view(torch.uint8) if q.dtype == device_quant.FP8_DTYPE else q


def _as_values(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return q.view(dtype) if dtype == device_quant.FP8_DTYPE else q


def quantize_rows(weight: torch.Tensor, spec: QuantizationSpec) -> QuantizedRows:
    """A float weight [N, K] quantized under `spec` (cpu_quant.quantize_integers; fp8:
    device_quant.quantize_fp8, its scales as one group per row)."""
    if spec.scheme == "fp8":
        q, scales = device_quant.quantize_fp8(weight)
        return QuantizedRows(q, scales[:, None], None, 8, weight.shape[1])
    q, scales, offsets, group = cpu_quant.quantize_integers(weight, spec.bits, spec.group)
    return QuantizedRows(q, scales, offsets, spec.bits, group)


# Every layout a QuantLinear holds: the CPU's two, CUDA's two.
QuantizedWeights = (cpu_quant.QuantizedWeight | cpu_qdot.QDotWeight
                    | device_quant.DeviceQuantizedWeight | device_quant.Fp8Weight)


class QuantLinear(nn.Module):
    """y = x W^T + b with W held as a cpu_quant.QuantizedWeight (weight-only), or as a
    cpu_qdot.QDotWeight (w8a8: x quantized to int8 too). x [T, IN] -> [T, OUT] in x's
    dtype."""

    def __init__(self, weight: QuantizedWeights, bias: torch.Tensor | None,
                 input_order: torch.Tensor | None = None) -> None:
        super().__init__()
        self.quantized = weight
        self.in_features, self.out_features = weight.in_features, weight.out_features
        device = weight.scales.device
        self.bias_f32 = None if bias is None else bias.detach().float().to(device).contiguous()
        # Act-order weights: x's columns gathered into the stored order first.
        self.input_order = (None if input_order is None
                            else input_order.long().to(device).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.quantized, cpu_qdot.QDotWeight):
            # Integer products at every step size: w8a8 at 2,048 rows still 1.6x the bf16
            # kernel's speed on a Zen 4 (docs/BENCHMARKS.md, "w8a8"), int8 with wide
            # activations about the bf16 kernel's there.
            flat = x.reshape(-1, self.in_features)
            y = cpu_qdot.linear(flat, self.quantized, self.bias_f32)
            return y.reshape(*x.shape[:-1], self.out_features)
        if self.input_order is not None:
            x = x.index_select(-1, self.input_order)
        if isinstance(self.quantized, device_quant.DeviceQuantizedWeight | device_quant.Fp8Weight):
            flat = x.reshape(-1, self.in_features)
            y = device_quant.linear(flat, self.quantized, self.bias_f32)
            return y.reshape(*x.shape[:-1], self.out_features)
        if x.dim() == 2 and x.shape[0] <= DENSE_ROWS:
            return cpu_quant.linear(x, self.quantized, self.bias_f32)
        w = cpu_quant.dequantize(self.quantized)
        flat = x.reshape(-1, self.in_features)
        if x.dtype == torch.bfloat16 and bf16_dense_is_fast():
            y = torch.nn.functional.linear(flat, w.to(torch.bfloat16))
            if self.bias_f32 is not None:
                y = (y.float() + self.bias_f32).to(torch.bfloat16)
            return y.reshape(*x.shape[:-1], self.out_features)
        # NOTE: elsewhere in float32 whatever x's dtype is: a CPU without AMX may multiply
        # bf16 slower than float32 (engine/runtime/cpu_features.py).
        y = torch.nn.functional.linear(flat.float(), w, self.bias_f32)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        q = self.quantized
        if isinstance(q, cpu_qdot.QDotWeight) and q.wide:
            kind = "int8 per channel, activations as 16-bit integers per row"
        elif isinstance(q, cpu_qdot.QDotWeight):
            kind = f"w8a8, activations in groups of {q.act_group}"
        elif isinstance(q, device_quant.Fp8Weight):
            kind = "fp8 per channel, activations per row"
        else:
            kind = f"int{q.bits}, group {q.group_size}"
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}"


@functools.cache
def bf16_dense_is_fast() -> bool:
    """Whether a dense bf16 matmul beats float32's on this CPU: where `--dtype auto` would
    serve bf16 (AMX-BF16 tiles, or AVX-512 BF16 timed at least BF16_MIN_SPEEDUP faster)."""
    from engine.runtime.cpu_features import auto_cpu_dtype

    return auto_cpu_dtype() == torch.bfloat16


def quantize_linears(module: nn.Module, spec: QuantizationSpec,
                     device: torch.device | str = "cpu") -> int:
    """Replace every `nn.Linear` below `module` by a QuantLinear of `spec` in `device`'s
    layout (QuantizedRows.pack); returns how many. Raises ValueError (one line) for a
    layer whose shape the scheme cannot hold."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            out_features, in_features = child.weight.shape
            try:
                qw = quantize_rows(child.weight, spec).pack(spec.int8_activations, device)
            except ValueError as exc:
                raise ValueError(f"--quantization {spec.scheme}: layer {name} "
                                 f"[{out_features}, {in_features}]: {exc}") from None
            setattr(module, name, QuantLinear(qw, child.bias))
            count += 1
        else:
            count += quantize_linears(child, spec, device)
    return count


def quantizes_embeddings(vocab_size: int) -> bool:
    """Whether the embeddings and the output projection are quantized (quantize_embeddings):
    where the vocabulary fills the kernels' 16-row blocks."""
    return vocab_size % cpu_quant.BLOCK == 0


def embedding_group(hidden_size: int) -> int | None:
    return EMBEDDING_GROUP if hidden_size % EMBEDDING_GROUP == 0 else None


class QuantEmbedding(nn.Module):
    """The embedding table as a cpu_quant.QuantizedWeight, or under w8a8 a grouped
    cpu_qdot.QDotWeight (one row per token): ids [T] -> rows [T, HID] in `dtype`,
    dequantized on lookup."""

    def __init__(self, weight: cpu_quant.QuantizedWeight | cpu_qdot.QDotWeight,
                 dtype: torch.dtype) -> None:
        super().__init__()
        assert weight.bits == 8, "embeddings are int8"
        self.quantized = weight
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = weight.out_features, weight.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        qw = self.quantized
        k, g = qw.in_features, qw.group_size
        flat = ids.reshape(-1)
        blocks, columns = flat // cpu_quant.BLOCK, flat % cpu_quant.BLOCK
        if isinstance(qw, cpu_qdot.QDotWeight):
            quads = qw.packed.view(-1, k // 4, cpu_qdot.BLOCK, 4)[blocks, :, columns, :]
            ints = quads.reshape(-1, k).to(torch.int16) - 128
            scales = (qw.scales[blocks, :, columns] if qw.grouped
                      else qw.scales[flat][:, None])
            rows = ints.float().view(-1, k // g, g) * scales[..., None]
            return rows.reshape(*ids.shape, k).to(self.dtype)
        q = qw.qweight.view(-1, k, cpu_quant.BLOCK).view(torch.int8)[blocks, :, columns]
        rows = q.float().view(-1, k // g, g) * qw.scales[blocks, :, columns][..., None]
        if qw.offsets is not None:
            rows = rows + qw.offsets[blocks, :, columns][..., None]
        return rows.reshape(*ids.shape, k).to(self.dtype)


def quantize_embeddings(model: nn.Module, dtype: torch.dtype,
                        int8_activations: bool = False) -> bool:
    """The model's embeddings and output projection as int8 (EMBEDDING_GROUP): a tied
    output projection reads the same integers as the lookup. `int8_activations` (w8a8): in
    cpu_qdot's layout, the same integers and scales, so that the output projection's input
    is quantized in the same groups and multiplied as integers (at 32 rows 2x the
    weight-only kernel's speed; the bundled model's perplexity unchanged: docs/BENCHMARKS.md,
    "w8a8"). At bf16 on AVX-512 VNNI otherwise: cpu_qdot's layout with wide activations
    (still weight-only, the same integers). False (both kept in `dtype`) where the
    vocabulary is not a multiple of the kernels' 16-row blocks, and on a GPU (a lookup and
    a dense matmul there; not measured quantized yet). A table the checkpoint stored as
    int8 (the model's `embedding_rows`, a GGUF's Q8_0) is packed as stored where it is on
    this grid, else its values are written into the float table first."""
    table = cast(nn.Embedding, model.embed_tokens).weight
    vocab, hidden = table.shape
    group = embedding_group(hidden)
    # The checkpoint's own int8 groups (CausalLM.load_weights), taken from the model.
    stored: QuantizedRows | None = getattr(model, "embedding_rows", None)
    if stored is not None:
        model.__dict__["embedding_rows"] = None  # (a plain attribute of CausalLM)
    quantizing = quantizes_embeddings(vocab) and table.device.type == "cpu"
    if stored is not None and not (
            quantizing and stored.group == group and not bool((stored.q == -128).any())
            and bool(torch.isfinite(stored.scales).all())):
        # Kept in floats, or not this grid (or an integer the symmetric layouts do not
        # hold): the table gets the stored values, quantized below where it is quantized.
        table.data = stored_floats(stored).to(table.device, table.dtype)
        stored = None
    if not quantizing:
        return False

    wide = (not int8_activations and group is not None
            and cpu_qdot.runs_wide(vocab, hidden, group, dtype))

    def pack(q: torch.Tensor, scales: torch.Tensor
             ) -> cpu_quant.QuantizedWeight | cpu_qdot.QDotWeight:
        if int8_activations:
            return cpu_qdot.pack(q, scales, group)
        if wide:  # the same integers and scales, against 16-bit activations
            return cpu_qdot.pack(q, scales, group, wide=True)
        return cpu_quant.pack(q, scales, None, EMBEDDING_BITS, group or hidden)

    def quantize(weight: torch.Tensor) -> cpu_quant.QuantizedWeight | cpu_qdot.QDotWeight:
        q, scales, _, _ = cpu_quant.quantize_integers(weight, EMBEDDING_BITS, group)
        return pack(q, scales)

    # A stored table is taken as it is: ggml's Q8_0 writer puts each block's largest at
    # +-127, where quantizing its float values again gives these same integers and scales.
    qw = pack(stored.q, stored.scales) if stored is not None else quantize(table)
    model.embed_tokens = QuantEmbedding(qw, dtype)
    head = model.lm_head
    if head is None:
        model.lm_head = QuantLinear(qw, None)
    elif isinstance(head, nn.Linear):
        model.lm_head = QuantLinear(quantize(head.weight), head.bias)
    return True


def stored_floats(rows: QuantizedRows) -> torch.Tensor:
    """The float32 values of int8 rows without offsets (q * scale), as a checkpoint's own
    dequantization computes them (a GGUF's Q8_0: gguf_weights.q8_0_float)."""
    n, k = rows.q.shape
    return (rows.q.view(n, k // rows.group, rows.group) * rows.scales[..., None]).view(n, k)


def weight_bytes(model: nn.Module) -> int:
    """The bytes of the model's weights as served: parameters, quantized layers (a tied
    table once) and packed copies (every buffer named as a weight)."""
    total = 0
    counted: set[int] = set()
    for module in model.modules():
        if isinstance(module, QuantLinear | QuantEmbedding):
            qw = module.quantized
            if id(qw) not in counted:
                counted.add(id(qw))
                total += qw.nbytes
            bias = getattr(module, "bias_f32", None)
            if bias is not None:
                total += bias.numel() * 4
        for param in module.parameters(recurse=False):
            total += param.numel() * param.element_size()
        for name, buf in module.named_buffers(recurse=False):
            if name.endswith("weight"):
                total += buf.numel() * buf.element_size()
    return total


# Hugging Face's names of the decoder linear layers quantize_linears covers (Llama, Qwen3,
# Phi-3's fused ones included).
HF_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
              "qkv_proj", "gate_up_proj")


def hf_decoder_linears(hf_model: Any) -> Iterator[nn.Linear]:
    """The decoder linear layers of a Hugging Face model (HF_LINEARS' names)."""
    for name, module in hf_model.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in HF_LINEARS:
            yield module


@torch.no_grad()
def round_trip_hf_linears(hf_model: Any, spec: QuantizationSpec, embeddings: bool = True
                          ) -> int:
    """Replace each decoder linear weight of a Hugging Face model, and with `embeddings`
    its embeddings and output projection (as the CPU engine quantizes them; a GPU keeps
    them), by the values their quantization under `spec` stands for
    (dequantize(quantize(w))), in place; returns how many decoder linears. Quantization is
    per output row, so these are exactly the rows the engine's fused, rope-permuted layers
    hold: the oracle of the quantized engine and of its quality. w8a8 and fp8: the layers
    also get hooks that quantize their inputs as the engine does (hook_int8_activations,
    hook_fp8_activations; a saved checkpoint does not keep them)."""
    count = 0
    for module in hf_decoder_linears(hf_model):
        weight = module.weight
        weight.copy_(dequantized(quantize_rows(weight, spec)).to(weight.dtype))
        count += 1
    if spec.int8_activations:
        hook_int8_activations(hf_model)
    if spec.scheme == "fp8":
        hook_fp8_activations(hf_model)
    if embeddings:
        round_trip_hf_embeddings(hf_model)
    return count


def dequantized(rows: QuantizedRows) -> torch.Tensor:
    """The float32 weight [N, K] quantized rows stand for, on their device, as that
    device's dense path dequantizes them (the CPU's C loop fuses q * scale + offset into
    one multiply-add where torch rounds twice)."""
    if rows.q.dtype == device_quant.FP8_DTYPE:
        return rows.q.float() * rows.scales
    if rows.q.device.type == "cpu":
        return cpu_quant.dequantize(cpu_quant.pack(rows.q, rows.scales, rows.offsets,
                                                   rows.bits, rows.group))
    qw = device_quant.pack(rows.q, rows.scales, rows.offsets, rows.bits, rows.group,
                           rows.q.device)
    return device_quant.dequantize(qw)


def hook_fp8_activations(hf_model: Any) -> int:
    """Give each decoder linear of a Hugging Face model a forward pre-hook that feeds it
    the values its input quantized to fp8 per row stands for
    (device_quant.fake_quantize_fp8); returns how many."""
    count = 0
    for module in hf_decoder_linears(hf_model):
        module.register_forward_pre_hook(
            lambda _module, args: (device_quant.fake_quantize_fp8(args[0]), *args[1:]))
        count += 1
    return count


def hook_int8_activations(hf_model: Any) -> int:
    """Give each decoder linear of a Hugging Face model a forward pre-hook that feeds it
    the values its input quantized as w8a8 quantizes it stands for
    (cpu_qdot.fake_quantize); returns how many. A PEFT adapter wrapping a layer later
    reads the input before the hook, as the engine's adapters do."""
    count = 0

    def hook(module: nn.Module, group: int) -> None:
        module.register_forward_pre_hook(
            lambda _module, args, group=group: (
                cpu_qdot.fake_quantize(args[0], group), *args[1:]))

    for module in hf_decoder_linears(hf_model):
        hook(module, cpu_qdot.act_group(module.in_features))
        count += 1
    # The output projection, where the engine quantizes it (quantize_embeddings): its
    # input in the embeddings' groups.
    embeddings = hf_model.get_input_embeddings().weight
    head = hf_model.get_output_embeddings()
    if quantizes_embeddings(embeddings.shape[0]) and isinstance(head, nn.Linear):
        hidden = embeddings.shape[1]
        hook(head, embedding_group(hidden) or cpu_qdot.act_group(hidden))
    return count


@torch.no_grad()
def round_trip_hf_embeddings(hf_model: Any) -> bool:
    """`round_trip_hf_linears` for the embeddings and the output projection alone (what a
    pre-quantized checkpoint's float tables become in the engine); False where they stay
    unquantized."""
    embeddings = hf_model.get_input_embeddings().weight
    if not quantizes_embeddings(embeddings.shape[0]):
        return False  # kept unquantized (quantize_embeddings)
    group = embedding_group(embeddings.shape[1])
    weights = [embeddings]
    head = getattr(hf_model.get_output_embeddings(), "weight", None)
    if head is not None and head.data_ptr() != embeddings.data_ptr():
        weights.append(head)
    for weight in weights:
        q, scales, _, g = cpu_quant.quantize_integers(weight, EMBEDDING_BITS, group)
        rows = QuantizedRows(q, scales, None, EMBEDDING_BITS, g)
        weight.copy_(dequantized(rows).to(weight.dtype))
    return True
