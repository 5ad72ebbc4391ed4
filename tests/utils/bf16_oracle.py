"""Hugging Face as the oracle of an engine that cannot equal it bit for bit (bf16, a
quantized base): teacher-forced logprobs of the engine's tokens.

A bf16 engine cannot equal the float32 oracle bit for bit, nor HF's own bf16 path: HF
rounds after every op, our kernels compute in float32 and round once. So the engine's
greedy tokens are scored by HF (PEFT for an adapter) in one forward over prompt + tokens,
in bfloat16 and in float32, and the logprobs compared position by position.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.core.engine_core import EngineCore
from engine.request import EngineRequest
from tests.utils.hf_oracle import hf_model, peft_model


def engine_tokens_and_logprobs(core: EngineCore, requests: list[EngineRequest]
                               ) -> dict[str, tuple[list[int], list[float]]]:
    """Runs `requests` together to the end: request id -> (tokens, their logprobs); the
    requests ask for logprobs=0."""
    for r in requests:
        core.add_request(r)
    got: dict[str, tuple[list[int], list[float]]] = {r.request_id: ([], []) for r in requests}
    deadline = time.monotonic() + 300
    while core.has_unfinished_requests():
        assert time.monotonic() < deadline, "engine did not finish"
        result = core.step()
        if result.idle:
            time.sleep(0.01)  # adapters loading
        for out in result.outputs:
            tokens, logprobs = got[out.request_id]
            tokens.extend(out.new_token_ids)
            logprobs.extend(lp.logprob for lp in out.new_logprobs)
    return got


@torch.inference_mode()
def hf_logprobs(
    model_dir: Path,
    dtype: torch.dtype,
    prompt: list[int],
    tokens: list[int],
    *,
    adapters: dict[str, Path] | None = None,
    adapter: str | None = None,
) -> torch.Tensor:
    """[len(tokens), V] float32 log-softmax of HF's logits before each of `tokens`."""
    key = tuple(sorted((n, str(p)) for n, p in (adapters or {}).items()))
    model = peft_model(str(model_dir), key, dtype) if key else hf_model(str(model_dir), dtype)
    ids = torch.tensor([prompt + tokens])
    if key:
        if adapter is None:
            with model.disable_adapter():  # type: ignore[operator]
                logits = model(input_ids=ids).logits
        else:
            model.set_adapter(adapter)  # type: ignore[operator]
            logits = model(input_ids=ids).logits
    else:
        logits = model(input_ids=ids).logits
    start = len(prompt) - 1
    return torch.log_softmax(logits[0, start : start + len(tokens)].float(), dim=-1)


@dataclass(slots=True)
class Agreement:
    """How one generation of the engine agrees with HF at bf16 and at float32."""

    positions: int = 0
    top1_agree: int = 0  # positions where our token is HF bf16's argmax
    top1_agree_clear: int = 0  # ... of the positions where HF bf16's top-2 margin is clear
    clear: int = 0
    top1_agree_f32: int = 0  # positions where our token is HF float32's argmax
    hf_bf16_agree_f32: int = 0  # ... where HF bf16's argmax is HF float32's
    max_abs_vs_bf16: float = 0.0  # |our logprob - HF bf16's| of our token, worst position
    sq_vs_f32: float = 0.0  # sums of squares over positions, against HF float32:
    sq_hf_bf16_vs_f32: float = 0.0  # ... ours, and HF bf16's own

    def add(self, ours: list[float], tokens: list[int], bf16: torch.Tensor,
            f32: torch.Tensor, *, clear_margin: float) -> None:
        for i, (token, logprob) in enumerate(zip(tokens, ours, strict=True)):
            self.positions += 1
            top2 = bf16[i].topk(2)
            agree = int(top2.indices[0]) == token
            self.top1_agree += agree
            f32_best = int(f32[i].argmax())
            self.top1_agree_f32 += f32_best == token
            self.hf_bf16_agree_f32 += f32_best == int(top2.indices[0])
            if float(top2.values[0] - top2.values[1]) > clear_margin:
                self.clear += 1
                self.top1_agree_clear += agree
            diff = abs(logprob - float(bf16[i, token]))
            if diff > self.max_abs_vs_bf16:
                self.max_abs_vs_bf16 = diff
            self.sq_vs_f32 += (logprob - float(f32[i, token])) ** 2
            self.sq_hf_bf16_vs_f32 += float(bf16[i, token] - f32[i, token]) ** 2

    @property
    def rms_vs_f32(self) -> float:
        return math.sqrt(self.sq_vs_f32 / max(1, self.positions))

    @property
    def rms_hf_bf16_vs_f32(self) -> float:
        return math.sqrt(self.sq_hf_bf16_vs_f32 / max(1, self.positions))

    def summary(self) -> str:
        return (f"{self.positions} positions: top-1 as HF bf16 {self.top1_agree}, clear "
                f"{self.top1_agree_clear}/{self.clear}; top-1 as HF float32: ours "
                f"{self.top1_agree_f32}, HF bf16 {self.hf_bf16_agree_f32}; max |ours - HF bf16| "
                f"{self.max_abs_vs_bf16:.4f}; RMS vs HF float32: ours {self.rms_vs_f32:.4f}, "
                f"HF bf16 {self.rms_hf_bf16_vs_f32:.4f}")
