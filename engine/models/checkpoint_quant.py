"""Pre-quantized checkpoints: GPTQ, AWQ and compressed-tensors integer weights, loaded
straight into the engine's int8 / int4 layout (no float copy of a layer is ever made).

`checkpoint_scheme(model_dir)` reads `config.json`'s `quantization_config`; a format
outside SUPPORTED is refused in one line naming the ones served. `quantized_tensors`
wraps the checkpoint's tensor stream: each quantized linear's parts (packed integers,
scales, zero points) are gathered and unpacked into one QuantizedRows under the layer's
`<prefix>.weight` name, which CausalLM.load_weights fuses and packs like any other.
Every part is checked against the others (shapes, group size, act-order), so a corrupt
or mismatched checkpoint fails at load naming the layer, never at the first request.

Layouts (w = scale * (q - zero) unless said otherwise):
- GPTQ (AutoGPTQ / GPTQModel, `checkpoint_format` "gptq" or "gptq_v2"): qweight int32
  [K * bits / 32, N], input k at bits (k % f) * bits of row k / f (f = 32 / bits);
  qzeros int32 [K / g, N * bits / 32] packed the same way along outputs, stored minus one
  in the original "gptq" format; scales [K / g, N]; g_idx int32 [K], input k's group
  (k / g, or with act-order any assignment of g inputs per group: the columns are then
  sorted by group and the layer gathers its inputs in that order).
- AWQ (AutoAWQ "gemm"): qweight int32 [K, N / 8], nibble i of word c holding output
  8 c + AWQ_ORDER[i]; qzeros [K / g, N / 8] alike; scales [K / g, N].
- compressed-tensors (llm-compressor), weight-only integer schemes:
  "pack-quantized": weight_packed int32 [N, K * bits / 32], input k at bits
  (k % f) * bits, stored as q + 2^(bits - 1) (q signed); weight_scale [N, K / g];
  weight_zero_point (asymmetric only) packed the same way along outputs
  [N * bits / 32, K / g]; weight_shape [2]. "int-quantized" / "naive-quantized": weight
  int8 [N, K] with weight_scale (and weight_zero_point).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import QuantizationSpec
from engine.models.config import ModelLoadError
from engine.models.quantized import QuantizedRows

SUPPORTED = ("GPTQ (4 or 8 bits, act-order included), AWQ (GEMM, 4 bits, zero points) and "
             "compressed-tensors weight-only int4 / int8 (pack-quantized, int-quantized)")

# AWQ packs eight outputs per word in this order: nibble i holds output 8 c + AWQ_ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)

_COMPRESSED_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")


@dataclass(frozen=True, slots=True)
class CheckpointScheme:
    """How a checkpoint's linear weights are stored."""

    method: str  # "gptq", "awq", "compressed-tensors"
    bits: int
    group: int | None  # inputs per scale; None: one per output channel
    symmetric: bool = False
    gptq_zero_offset: int = 0  # GPTQ's original format stores zero points minus one
    fmt: str = ""  # compressed-tensors' format

    @property
    def spec(self) -> QuantizationSpec:
        """The engine's scheme these weights run under."""
        return QuantizationSpec(f"int{self.bits}", self.group)

    def describe(self) -> str:
        name = {"gptq": "GPTQ", "awq": "AWQ"}.get(self.method, self.method)
        if self.fmt:
            name += f" {self.fmt}"
        return f"{name}, {self.spec.describe()}"

    @property
    def parts(self) -> tuple[str, ...]:
        """The tensor names (after the layer's prefix) of a quantized linear."""
        if self.method == "gptq":
            return ("qweight", "qzeros", "scales", "g_idx")
        if self.method == "awq":
            return ("qweight", "qzeros", "scales")
        return ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape",
                "weight_g_idx")

    def owns(self, part: str, tensor: torch.Tensor) -> bool:
        """Whether a tensor named `<prefix>.<part>` is a quantized linear's part."""
        if part in self.parts:
            return True
        # int-quantized: the integers under the float weight's own name.
        return part == "weight" and self.fmt != "pack-quantized" and \
            self.method == "compressed-tensors" and tensor.dtype == torch.int8

    def unpack(self, prefix: str, parts: dict[str, torch.Tensor]) -> QuantizedRows:
        try:
            if self.method == "gptq":
                return _unpack_gptq(self, parts)
            if self.method == "awq":
                return _unpack_awq(self, parts)
            return _unpack_compressed(self, parts)
        except (KeyError, ValueError, RuntimeError) as exc:
            detail = f"lacks {exc.args[0]}" if isinstance(exc, KeyError) else str(exc)
            raise ModelLoadError(f"{self.describe()}: layer {prefix} {detail}") from None


def checkpoint_scheme(model_dir: Path) -> CheckpointScheme | None:
    """The quantization `config.json` declares (None: float weights); ModelLoadError, one
    line, for one that is not served."""
    try:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None  # load_model_config reports it
    config = raw.get("quantization_config")
    if not config:
        return None
    if not isinstance(config, dict):
        raise ModelLoadError("config.json's quantization_config is not an object")
    method = str(config.get("quant_method", "")).lower()
    if method == "gptq":
        return _gptq_scheme(config)
    if method == "awq":
        return _awq_scheme(config)
    if method == "compressed-tensors":
        return _compressed_scheme(config)
    raise ModelLoadError(f"quantization {method or 'without a quant_method'!r} in config.json "
                         f"is not served; served: {SUPPORTED}")


def _refuse(what: str) -> ModelLoadError:
    return ModelLoadError(f"{what} is not served; served: {SUPPORTED}")


def _group(value: Any) -> int | None:
    if value in (None, -1, 0):
        return None
    if not isinstance(value, int) or value < 2 or value % 2:
        raise ModelLoadError(f"config.json's quantization group size {value!r} is not an even "
                             "number >= 2 (or -1 for one per channel)")
    return value


def _gptq_scheme(config: dict[str, Any]) -> CheckpointScheme:
    bits = config.get("bits")
    if bits not in (4, 8):
        raise _refuse(f"GPTQ with {bits} bits")
    fmt = str(config.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse(f"GPTQ checkpoint format {fmt!r}")
    return CheckpointScheme("gptq", bits, _group(config.get("group_size", 128)),
                            symmetric=bool(config.get("sym", True)),
                            gptq_zero_offset=1 if fmt == "gptq" else 0)


def _awq_scheme(config: dict[str, Any]) -> CheckpointScheme:
    bits = config.get("bits", config.get("w_bit"))
    version = str(config.get("version", "gemm")).lower()
    if bits != 4:
        raise _refuse(f"AWQ with {bits} bits")
    if version != "gemm":
        raise _refuse(f"AWQ version {version!r}")
    if not config.get("zero_point", True):
        raise _refuse("AWQ without zero points")
    return CheckpointScheme("awq", 4, _group(config.get("group_size", config.get("q_group_size",
                                                                                 128))))


def _compressed_scheme(config: dict[str, Any]) -> CheckpointScheme:
    status = config.get("quantization_status", "compressed")
    if status != "compressed":
        raise _refuse(f"a compressed-tensors checkpoint in status {status!r}")
    groups = config.get("config_groups") or {}
    if len(groups) != 1:
        raise _refuse(f"compressed-tensors with {len(groups)} config groups")
    [group_config] = groups.values()
    fmt = str(group_config.get("format") or config.get("format") or "").lower()
    if fmt not in _COMPRESSED_FORMATS:
        raise _refuse(f"compressed-tensors format {fmt!r}")
    if group_config.get("input_activations") or group_config.get("output_activations"):
        raise _refuse("compressed-tensors activation quantization")
    weights = group_config.get("weights") or {}
    bits, kind = weights.get("num_bits"), weights.get("type", "int")
    if kind != "int" or bits not in (4, 8):
        raise _refuse(f"compressed-tensors {kind} weights of {bits} bits")
    strategy = weights.get("strategy")
    if strategy not in ("group", "channel"):
        raise _refuse(f"compressed-tensors strategy {strategy!r}")
    if weights.get("actorder") not in (None, "static", "group", "weight"):
        raise _refuse(f"compressed-tensors act-order {weights.get('actorder')!r}")
    if fmt != "pack-quantized" and bits != 8:
        raise _refuse(f"compressed-tensors {fmt} with {bits} bits")
    group = _group(weights.get("group_size")) if strategy == "group" else None
    if strategy == "group" and group is None:
        raise ModelLoadError("config.json: compressed-tensors group strategy without a "
                             "group_size")
    return CheckpointScheme("compressed-tensors", bits, group,
                            symmetric=bool(weights.get("symmetric", True)), fmt=fmt)


def quantized_tensors(tensors: Iterable[tuple[str, torch.Tensor]], scheme: CheckpointScheme
                      ) -> Iterator[tuple[str, torch.Tensor | QuantizedRows]]:
    """The checkpoint's tensors with each quantized linear's parts replaced by one
    `<prefix>.weight` QuantizedRows (after the float tensors: a layer's parts may lie in
    several shards)."""
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        prefix, _, part = name.rpartition(".")
        if prefix and scheme.owns(part, tensor):
            layers.setdefault(prefix, {})[part] = tensor
        else:
            yield name, tensor
    for prefix, parts in layers.items():
        yield f"{prefix}.weight", scheme.unpack(prefix, parts)


# ---------------------------------------------------------------------------- unpacking


def _unpack_int32(packed: torch.Tensor, bits: int, dim: int, what: str) -> torch.Tensor:
    """Values of `bits` packed into int32 words along `dim` (value i of a word at bits
    i * bits), as int32 in 0 .. 2^bits - 1; the packed dimension grows 32 / bits times."""
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(f"{what} is {packed.dtype} {list(packed.shape)}, expected 2-D int32")
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    if dim == 0:
        values = (packed[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
        return values.reshape(packed.shape[0] * per_word, packed.shape[1])
    values = (packed[:, :, None] >> shifts[None, None, :]) & ((1 << bits) - 1)
    return values.reshape(packed.shape[0], packed.shape[1] * per_word)


def _expect(t: torch.Tensor, shape: tuple[int, ...], what: str, group: int) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"has {what} of shape {list(t.shape)}; {list(shape)} is expected for "
                         f"groups of {group} inputs (is the group size in config.json the one "
                         "it was quantized with?)")


def _rows(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, bits: int, group: int
          ) -> QuantizedRows:
    """w = scales * (q - zeros): q [N, K] unsigned in 0 .. 2^bits - 1, zeros and scales
    [N, K / group] -> the engine's integers, scales and offsets."""
    s = scales.float()
    if not bool(torch.isfinite(s).all()):
        raise ValueError("has scales that are not finite")
    if bits == 4:
        return QuantizedRows(q.to(torch.uint8), s, -zeros.float() * s, 4, group)
    # The engine's int8 is signed: q - 128, and the offset makes up the difference.
    return QuantizedRows((q - 128).to(torch.int8), s, (128 - zeros.float()) * s, 8, group)


def _unpack_gptq(scheme: CheckpointScheme, parts: dict[str, torch.Tensor]) -> QuantizedRows:
    bits = scheme.bits
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    q = _unpack_int32(qweight, bits, 0, "qweight").t()  # [N, K]
    n, k = q.shape
    group = scheme.group or k
    if k % group:
        raise ValueError(f"has {k} inputs, which groups of {group} do not divide")
    _expect(scales, (k // group, n), "scales", group)
    zeros = _unpack_int32(qzeros, bits, 1, "qzeros")
    _expect(zeros, (k // group, n), "zero points (unpacked)", group)
    rows = _rows(q, (zeros + scheme.gptq_zero_offset).t(), scales.t(), bits, group)
    return _act_order(rows, parts.get("g_idx"), "g_idx")


def _act_order(rows: QuantizedRows, g_idx: torch.Tensor | None, what: str) -> QuantizedRows:
    """Act-order weights (GPTQ's desc_act): input k belongs to group g_idx[k]. The
    columns are stored sorted by group, so that each group is contiguous, and the layer
    gathers x's columns in that order. A g_idx of k / group changes nothing."""
    _, k = rows.shape
    group = rows.group
    if g_idx is None or torch.equal(g_idx.long(), torch.arange(k) // group):
        return rows
    g_idx = g_idx.long()
    if g_idx.shape != (k,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= k // group or \
            not bool((torch.bincount(g_idx, minlength=k // group) == group).all()):
        raise ValueError(f"has a {what} that does not put {group} inputs in each of "
                         f"{k // group} groups")
    order = torch.argsort(g_idx, stable=True)
    return QuantizedRows(rows.q[:, order].contiguous(), rows.scales, rows.offsets,
                         rows.bits, group, order)


def _awq_unpack(packed: torch.Tensor, what: str) -> torch.Tensor:
    """AWQ's [R, C] int32 -> [R, 8 C] values in output order."""
    values = _unpack_int32(packed, 4, 1, what).reshape(packed.shape[0], -1, 8)
    out = torch.empty_like(values)
    out[:, :, list(AWQ_ORDER)] = values
    return out.reshape(packed.shape[0], -1)


def _unpack_awq(scheme: CheckpointScheme, parts: dict[str, torch.Tensor]) -> QuantizedRows:
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    q = _awq_unpack(qweight, "qweight").t()  # [N, K]
    n, k = q.shape
    group = scheme.group or k
    if k % group:
        raise ValueError(f"has {k} inputs, which groups of {group} do not divide")
    _expect(scales, (k // group, n), "scales", group)
    zeros = _awq_unpack(qzeros, "qzeros")
    _expect(zeros, (k // group, n), "zero points (unpacked)", group)
    return _rows(q, zeros.t(), scales.t(), 4, group)


def _unpack_compressed(scheme: CheckpointScheme, parts: dict[str, torch.Tensor]
                       ) -> QuantizedRows:
    bits, offset = scheme.bits, 1 << (scheme.bits - 1)
    scales = parts["weight_scale"]
    if "weight_packed" in parts:
        shape = parts["weight_shape"]
        if shape.numel() != 2:
            raise ValueError(f"has a weight_shape of {shape.numel()} values")
        n, k = (int(v) for v in shape.tolist())
        packed = _unpack_int32(parts["weight_packed"], bits, 1, "weight_packed")
        if packed.shape[0] != n or packed.shape[1] < k or packed.shape[1] - k >= 32 // bits:
            raise ValueError(f"has weight_packed for {list(packed.shape)} values, "
                             f"weight_shape says {[n, k]}")
        q = packed[:, :k]  # unsigned: the signed value + offset
    else:
        signed = parts["weight"]
        n, k = signed.shape
        q = signed.to(torch.int32) + offset
    group = scheme.group or k
    if k % group:
        raise ValueError(f"has {k} inputs, which groups of {group} do not divide")
    if scales.dim() == 1:
        scales = scales[:, None]
    _expect(scales, (n, k // group), "weight_scale", group)
    zero_point = parts.get("weight_zero_point")
    if scheme.symmetric or zero_point is None:
        if not scheme.symmetric:
            raise KeyError("weight_zero_point")
        zeros = torch.zeros(n, k // group)
    elif scheme.fmt == "pack-quantized":
        # Packed along outputs, as unsigned values; any word padding dropped.
        unpacked = _unpack_int32(zero_point, bits, 0, "weight_zero_point")
        if unpacked.shape[1] != k // group or not n <= unpacked.shape[0] < n + 32 // bits:
            raise ValueError(f"has weight_zero_point for {list(unpacked.shape)} values, "
                             f"{[n, k // group]} expected")
        zeros = unpacked[:n].float() - offset
    else:
        zeros = zero_point.reshape(n, -1).float()
        _expect(zeros, (n, k // group), "weight_zero_point", group)
    # w = scale * (signed - zero) = scale * (q - (offset + zero)).
    return _act_order(_rows(q, zeros + offset, scales, bits, group), parts.get("weight_g_idx"),
                      "weight_g_idx")
