"""Pre-quantized checkpoints of a tiny model, and the float checkpoint each stands for.

compressed-tensors checkpoints are written by the library itself (what llm-compressor
saves), and their oracle is the library's own decompression as transformers loads it.
GPTQ and AWQ are written here, exactly to their published layouts (GPTQModel and AutoAWQ
need CUDA to run): the integers come from a round-to-nearest min/max quantization done
here, and the oracle holds scale * (q - zero) with the fp16 scales as stored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from engine.models.quantized import round_trip_hf_embeddings
from tests.utils.quantized import LINEARS
from tests.utils.tiny_models import copy_tokenizer

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble i of a word holds column 8c + this


def _load(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)


def _linears(model: Any) -> dict[str, torch.nn.Linear]:
    return {name: m for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in LINEARS}


def save_oracle(model: Any, model_dir: Path, out_dir: Path) -> Path:
    """`model` (float weights) with its embeddings on the engine's int8 grid, saved with
    model_dir's tokenizer: what the engine's quantized model computes."""
    round_trip_hf_embeddings(model)
    model.save_pretrained(str(out_dir))
    copy_tokenizer(model_dir, out_dir)
    return out_dir


def minmax_quantize(w: torch.Tensor, bits: int, group: int, symmetric: bool,
                    min_zero: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> q [N, K] in 0 .. 2^bits - 1, zeros [N, K / g] (integers), fp16 scales
    [N, K / g]: w ~ scale * (q - zero)."""
    n, k = w.shape
    top = 2**bits - 1
    wg = w.reshape(n, k // group, group)
    if symmetric:
        scale = (wg.abs().amax(-1) / (top // 2)).half()
        zero = torch.full_like(scale, (top + 1) // 2, dtype=torch.float32)
    else:
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        scale = ((hi - lo) / top).half()
        zero = torch.round(-lo / scale.float()).clamp(min_zero, top)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(wg / scale.float()[..., None] + zero[..., None]).clamp(0, top)
    return q.reshape(n, k).int(), zero.int(), scale


def dequantized(q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, group: int
                ) -> torch.Tensor:
    n, k = q.shape
    w = (q.reshape(n, k // group, group) - zero[..., None]).float() * scale.float()[..., None]
    return w.reshape(n, k)


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] unsigned values -> int32 [R / f, C], value r at bits (r % f) * bits of word
    r / f (f = 32 / bits): GPTQ's qweight layout."""
    per_word = 32 // bits
    rows, cols = values.shape
    out = torch.zeros(rows // per_word, cols, dtype=torch.int32)
    for j in range(per_word):
        out |= values[j::per_word].int() << (bits * j)
    return out


def write_checkpoint(model: Any, model_dir: Path, out_dir: Path,
                     tensors: dict[str, torch.Tensor], quantization_config: dict[str, Any],
                     drop: tuple[str, ...] = ()) -> Path:
    """model's float tensors other than its quantized linears' weights, plus `tensors`,
    saved with `quantization_config` in config.json (tensors named in `drop` left out)."""
    from safetensors.torch import save_file

    quantized = {f"{name}.weight" for name in _linears(model)}
    if model.config.tie_word_embeddings:
        quantized.add("lm_head.weight")  # the embeddings' own tensor
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k not in quantized}
    state.update(tensors)
    for name in drop:
        del state[name]
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (out_dir / "config.json").write_text(json.dumps(config))
    copy_tokenizer(model_dir, out_dir)
    return out_dir


def gptq_checkpoint(model_dir: Path, out_dir: Path, oracle_dir: Path, *, bits: int = 4,
                    group: int | None = 64, symmetric: bool = False, v2: bool = False,
                    config_group: int | None = None, drop: tuple[str, ...] = (),
                    act_order: bool = False, bad_g_idx: bool = False) -> tuple[Path, Path]:
    """A GPTQ checkpoint of model_dir's model (qweight, qzeros, scales, g_idx per linear;
    zero points minus one unless `v2`) and its oracle. `config_group` writes another group
    size into config.json than the tensors have. `act_order`: each input's group comes
    from a random order of the inputs (one per input width, so that q, k and v, which
    share their input, share it too), as GPTQ's desc_act assigns them; `bad_g_idx`: a
    g_idx of all zeros."""
    model = _load(model_dir)
    tensors: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, linear in _linears(model).items():
            w = linear.weight
            k = w.shape[1]
            g = group or k
            g_idx = torch.arange(k, dtype=torch.int32) // g
            if act_order:
                order = torch.randperm(k, generator=torch.Generator().manual_seed(k))
                g_idx = torch.empty(k, dtype=torch.int32)
                g_idx[order] = torch.arange(k, dtype=torch.int32) // g
            # Quantized group by group: the columns sorted by group, then put back.
            by_group = torch.argsort(g_idx.long(), stable=True)
            back = torch.argsort(by_group)
            # The original format stores zero - 1 and so cannot hold a zero point of 0.
            q, zero, scale = minmax_quantize(w[:, by_group], bits, g, symmetric,
                                             min_zero=0 if v2 else 1)
            w.copy_(dequantized(q, zero, scale, g)[:, back])
            q = q[:, back]
            stored_zero = zero - (0 if v2 else 1)
            tensors[f"{name}.qweight"] = pack_rows(q.t(), bits)
            tensors[f"{name}.qzeros"] = _pack_columns(stored_zero.t(), bits)
            tensors[f"{name}.scales"] = scale.t().contiguous()
            tensors[f"{name}.g_idx"] = torch.zeros_like(g_idx) if bad_g_idx else g_idx
    config = {"quant_method": "gptq", "bits": bits,
              "group_size": (config_group or group or -1), "desc_act": act_order,
              "sym": symmetric, "checkpoint_format": "gptq_v2" if v2 else "gptq"}
    write_checkpoint(model, model_dir, out_dir, tensors, config, drop)
    return out_dir, save_oracle(model, model_dir, oracle_dir)


def _pack_columns(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] unsigned -> int32 [R, C / f], column c at bits (c % f) * bits of word c / f
    (GPTQ's qzeros; values wrap to `bits`, as GPTQ's stored zero minus one does)."""
    per_word = 32 // bits
    rows, cols = values.shape
    out = torch.zeros(rows, cols // per_word, dtype=torch.int32)
    mask = 2**bits - 1
    for j in range(per_word):
        out |= (values[:, j::per_word].int() & mask) << (bits * j)
    return out


def awq_checkpoint(model_dir: Path, out_dir: Path, oracle_dir: Path, *, group: int = 64
                   ) -> tuple[Path, Path]:
    """An AutoAWQ GEMM checkpoint (4 bits, zero points): qweight int32 [K, N / 8] and
    qzeros [K / g, N / 8] with AWQ_ORDER's interleave, fp16 scales [K / g, N]."""
    model = _load(model_dir)
    tensors: dict[str, torch.Tensor] = {}

    def awq_pack(values: torch.Tensor) -> torch.Tensor:  # [R, C] -> [R, C / 8]
        out = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int32)
        for i, column in enumerate(AWQ_ORDER):
            out |= values[:, column::8].int() << (4 * i)
        return out

    with torch.no_grad():
        for name, linear in _linears(model).items():
            w = linear.weight
            q, zero, scale = minmax_quantize(w, 4, group, symmetric=False)
            w.copy_(dequantized(q, zero, scale, group))
            tensors[f"{name}.qweight"] = awq_pack(q.t().contiguous())
            tensors[f"{name}.qzeros"] = awq_pack(zero.t().contiguous())
            tensors[f"{name}.scales"] = scale.t().contiguous()
    config = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
              "version": "gemm"}
    write_checkpoint(model, model_dir, out_dir, tensors, config)
    return out_dir, save_oracle(model, model_dir, oracle_dir)


def compressed_tensors_checkpoint(model_dir: Path, out_dir: Path, oracle_dir: Path, *,
                                  bits: int, symmetric: bool, group: int | None,
                                  fmt: str = "pack-quantized") -> tuple[Path, Path]:
    """model_dir's model quantized and saved by compressed-tensors (min/max scales and zero
    points from its calculate_qparams), and as oracle the float model transformers
    decompresses it to."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    model = _load(model_dir)
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric,
                            strategy="group" if group else "channel", group_size=group)
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
        ignore=["lm_head"]), show_progress=False)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "weight_scale"):
                w = module.weight
                n, k = w.shape
                wg = w.reshape(n, k // (group or k), group or k)
                scale, zero = calculate_qparams(wg.amin(-1), wg.amax(-1), args)
                module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
                if hasattr(module, "weight_zero_point"):
                    module.weight_zero_point.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(str(out_dir))
    compressor.update_config(str(out_dir))
    copy_tokenizer(model_dir, out_dir)
    decompressed = AutoModelForCausalLM.from_pretrained(
        str(out_dir), dtype=torch.float32,
        quantization_config=CompressedTensorsConfig(run_compressed=False))
    oracle = _load(model_dir)
    with torch.no_grad():
        state = decompressed.state_dict()
        for name, linear in _linears(oracle).items():
            linear.weight.copy_(state[f"{name}.weight"])
    return out_dir, save_oracle(oracle, model_dir, oracle_dir)
