"""A Llama GGUF read at its own precision: Q4_1 linear layers become the engine's int4
groups of 32 integer for integer (a scale and the block's minimum), with no float copy.

The bundled SmolLM2 ships as `SmolLM2-135M-Instruct.Q4_1.gguf`: its decoder linears are
Q4_1, its embeddings Q8_0, its norms F32. `--quantization int4` on the default model (the
group size at its default 32) loads the linears from these blocks directly, and the
embedding table's Q8_0 blocks become the engine's int8 groups of 32 as stored (no float
table is made); every other tensor is read as float (another Q8_0 tensor dequantized) and
any other quantized type through gguf's own dequantization, then quantized on load like a
float checkpoint's.

ggml's blocks (32 weights each, little-endian): Q4_1 = fp16 d, fp16 m, 16 bytes whose low
nibbles are weights 0-15 and high nibbles 16-31, w = d q + m; Q8_0 = fp16 d, 32 int8,
w = d q. llama.cpp's converter stores q and k rows permuted per head (each head's two
rotary halves interleaved); they are put back in Hugging Face's order here, and the
engine's own rope interleave applies as for any checkpoint.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.models.base import EMBEDDING_NAME
from engine.models.config import ModelConfig, ModelLoadError
from engine.models.quantized import QuantizedRows, stored_floats

GGUF_GROUP = 32  # weights per ggml block

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(name: str) -> str | None:
    """A llama GGUF tensor's Hugging Face name (None for one the engine does not use)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def _unpermute(heads: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The inverse of llama.cpp's q / k row permutation for `heads` heads."""

    def rows(t: torch.Tensor) -> torch.Tensor:
        n = t.shape[0]
        return t.reshape(heads, n // heads // 2, 2, *t.shape[1:]).transpose(1, 2) \
            .reshape(t.shape).contiguous()

    return rows


def _fp16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The little-endian fp16 field at byte `at` of each block ([..., blocks, bytes]), as
    float32 [..., blocks]."""
    return blocks[..., at:at + 2].contiguous().view(torch.float16)[..., 0].float()


def q4_1_rows(raw: np.ndarray, k: int) -> QuantizedRows:
    """Q4_1 rows (uint8 [N, K / 32 * 20]) -> int4 groups of 32 with scales and minimums."""
    blocks = torch.from_numpy(raw).view(raw.shape[0], k // 32, 20)
    qs = blocks[..., 4:20]
    q = torch.cat((qs & 15, qs >> 4), dim=-1).reshape(raw.shape[0], k)
    return QuantizedRows(q.contiguous(), _fp16(blocks, 0), _fp16(blocks, 2), 4, GGUF_GROUP)


def q8_0_rows(raw: np.ndarray, k: int) -> QuantizedRows:
    """Q8_0 rows (uint8 [N, K / 32 * 34]) -> int8 groups of 32 with their scales."""
    blocks = torch.from_numpy(raw).view(raw.shape[0], k // 32, 34)
    q = blocks[..., 2:34].contiguous().view(torch.int8).reshape(raw.shape[0], k)
    return QuantizedRows(q, _fp16(blocks, 0), None, 8, GGUF_GROUP)


Q8_0_CHUNK_ROWS = 4096


def q8_0_float(raw: np.ndarray, k: int) -> torch.Tensor:
    """Q8_0 rows (uint8 [N, K / 32 * 34]) -> float32 [N, K], dequantized Q8_0_CHUNK_ROWS
    rows at a time into the result.

    NOTE: in one pass over the table its temporaries (the bytes, the integers as floats,
    their product) were twice the float table again: for SmolLM2's embeddings 226 MiB
    on top of a server's peak RSS at load."""
    n = raw.shape[0]
    out = torch.empty(n, k)
    for start in range(0, n, Q8_0_CHUNK_ROWS):
        stop = min(n, start + Q8_0_CHUNK_ROWS)
        out[start:stop] = stored_floats(q8_0_rows(raw[start:stop], k))
    return out


# GGUF metadata value types -> their size in bytes (strings and arrays are read apart).
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # outermost first ([N, K] for an N x K matrix)
    kind: int  # ggml type
    path: Path
    offset: int  # of its first byte in the file
    rows: int
    row_bytes: int

    def read(self) -> np.ndarray:
        """Its bytes, uint8 [rows, row_bytes], read into memory of their own.

        NOTE: read, not mapped: every page of a mapped file a tensor was read from stays in
        the process's RSS for as long as the mapping, and the load held the whole file's
        (96 MiB for SmolLM2's) on top of the weights it had made."""
        data = np.empty((self.rows, self.row_bytes), dtype=np.uint8)
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                if f.readinto(data.data) != data.nbytes:
                    raise ModelLoadError(f"{self.path} ends inside tensor {self.name}")
        except OSError as exc:
            raise ModelLoadError(f"cannot read {self.path}: {exc}") from exc
        return data


def read_gguf(path: Path) -> list[GGUFTensor]:
    """The tensors of a GGUF file (v2 or v3): where each one lies, its data not yet read.

    NOTE: gguf's own GGUFReader parses every metadata value into numpy views, which for
    a tokenizer's 100,000 strings took 8-10 s; this reads the header and skips the
    metadata (only general.alignment is kept) in well under a second."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        buf = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    view = memoryview(buf)  # type: ignore[arg-type]
    pos = 0

    def take(fmt: str) -> Any:
        nonlocal pos
        values = struct.unpack_from("<" + fmt, view, pos)
        pos += struct.calcsize("<" + fmt)
        return values[0] if len(values) == 1 else values

    def string() -> str:
        nonlocal pos
        length = take("Q")
        text = bytes(view[pos:pos + length]).decode("utf-8", "replace")
        pos += length
        return text

    def skip(kind: int) -> int | None:
        """Skips one value of `kind`; returns it where it is an integer."""
        nonlocal pos
        if kind == _STRING:
            length = take("Q")  # (read before pos moves past it)
            pos += length
            return None
        if kind == _ARRAY:
            inner, count = take("I"), take("Q")
            if inner in _SCALAR_SIZES:
                pos += count * _SCALAR_SIZES[inner]
            else:
                for _ in range(count):
                    skip(inner)
            return None
        if kind not in _SCALAR_SIZES:
            raise ValueError(f"unknown metadata type {kind}")
        fmt = {1: "B", 2: "H", 4: "I", 8: "Q"}[_SCALAR_SIZES[kind]]
        return int(take(fmt))

    try:
        magic, version = bytes(view[0:4]), struct.unpack_from("<I", view, 4)[0]
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"not a GGUF v2 / v3 file (magic {magic!r}, version {version})")
        pos = 8
        num_tensors, num_values = take("Q"), take("Q")
        alignment = 32
        for _ in range(num_values):
            key, kind = string(), take("I")
            value = skip(kind)
            if key == "general.alignment" and value:
                alignment = value
        infos = []
        for _ in range(num_tensors):
            name, dims = string(), take("I")
            ne = [take("Q") for _ in range(dims)]
            infos.append((name, tuple(reversed(ne)), take("I"), take("Q")))
        start = -(-pos // alignment) * alignment
        tensors = []
        for name, shape, kind, offset in infos:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
            row_bytes = shape[-1] // block * size
            at = start + offset
            if shape[-1] % block or at + rows * row_bytes > len(buf):
                raise ValueError(f"tensor {name} {list(shape)} does not fit the file")
            tensors.append(GGUFTensor(name, shape, kind, path, at, rows, row_bytes))
    except (ValueError, struct.error, KeyError) as exc:
        raise ModelLoadError(f"{path} is not a GGUF file the engine can read: {exc}") from None
    finally:
        # NOTE: the helpers above call each other, a reference cycle that holds `view`
        # until the garbage collector runs: released here, the header's pages are unmapped
        # on return, not at the collector's next pass.
        view.release()
    return tensors


def gguf_tensors(path: Path, config: ModelConfig, *, native: bool
                 ) -> Iterator[tuple[str, torch.Tensor | QuantizedRows]]:
    """The GGUF's tensors under Hugging Face names: with `native`, Q4_1 linears and a
    Q8_0 embedding table as QuantizedRows (int4 and int8 groups of 32, as stored);
    everything else float32."""
    from gguf.constants import GGMLQuantizationType as T
    from gguf.quants import dequantize

    for tensor in read_gguf(path):
        name = hf_name(tensor.name)
        if name is None:
            continue
        shape, kind, raw = list(tensor.shape), tensor.kind, tensor.read()
        value: torch.Tensor | QuantizedRows
        if kind == T.Q4_1 and native and len(shape) == 2:
            value = q4_1_rows(raw, shape[1])
        elif kind == T.Q8_0 and native and name == EMBEDDING_NAME and len(shape) == 2:
            value = q8_0_rows(raw, shape[1])
        elif kind == T.Q8_0 and len(shape) == 2:
            value = q8_0_float(raw, shape[1])
        elif kind == T.F32:
            value = torch.from_numpy(raw.view(np.float32)).reshape(shape)
        elif kind == T.F16:
            value = torch.from_numpy(raw.view(np.float16).astype(np.float32)).reshape(shape)
        else:
            value = torch.from_numpy(
                np.asarray(dequantize(raw, T(kind)), dtype=np.float32)).reshape(shape)
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_heads if "q_proj" in name else config.num_kv_heads
            rows = _unpermute(heads)
            value = value.map_rows(rows) if isinstance(value, QuantizedRows) else rows(value)
        yield name, value
