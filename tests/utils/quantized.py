"""The oracle of a quantized engine: a checkpoint whose weights are the dequantized ones."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import QuantizationSpec
from engine.core.engine_core import EngineCore
from engine.models.quantized import round_trip_hf_linears
from engine.request import EngineRequest, SamplingParams
from tests.utils.bf16_oracle import engine_tokens_and_logprobs, hf_logprobs
from tests.utils.tiny_models import copy_tokenizer, random_prompt

# The engine's kernel sums each group's integer products in float32 and scales the sum
# once, where HF multiplies by the dequantized float32 weights: the same sums up to
# float32 rounding, so logprobs agree to LOGPROB_TOL (measured: 1e-5 to 3e-5) and every
# greedy token is HF's argmax unless HF's own top-2 margin is below TIE_MARGIN.
LOGPROB_TOL = 1e-4
TIE_MARGIN = 1e-4
NEW_TOKENS = 32
NUM_PROMPTS = 16

# The decoder linear layers the engine quantizes (Hugging Face's names).
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def dequantized_checkpoint(model_dir: Path, out_dir: Path, spec: QuantizationSpec) -> Path:
    """model_dir's model with every decoder linear weight replaced by the values its
    quantization stands for, saved to out_dir (tokenizer included)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    assert round_trip_hf_linears(model, spec) == 7 * model.config.num_hidden_layers
    model.save_pretrained(str(out_dir))
    copy_tokenizer(model_dir, out_dir)
    return out_dir


def assert_engine_agrees_with_oracle(core: EngineCore, oracle_dir: Path,
                                     adapters: dict[str, Path]) -> float:
    """NUM_PROMPTS greedy requests of NEW_TOKENS tokens, in turn on the base and on each
    adapter of `adapters` (added to `core` here), run together in mixed steps; each
    token and logprob checked against HF (PEFT for adapters) on `oracle_dir`'s weights,
    teacher-forced in float32. Returns the worst logprob difference."""
    for name, path in adapters.items():
        core.add_adapter(name, path)
    names: list[str | None] = [None, *adapters]
    requests = []
    for i in range(NUM_PROMPTS):
        prompt = random_prompt(8 + 7 * i, seed=100 + i)
        requests.append(EngineRequest(
            request_id=f"{i}", prompt_token_ids=tuple(prompt), adapter=names[i % len(names)],
            sampling=SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True,
                                    logprobs=0)))
    got = engine_tokens_and_logprobs(core, requests)
    worst = 0.0
    for r in requests:
        tokens, logprobs = got[r.request_id]
        assert len(tokens) == len(logprobs) == NEW_TOKENS
        kwargs = {"adapters": adapters, "adapter": r.adapter} if r.adapter else {}
        hf = hf_logprobs(oracle_dir, torch.float32, list(r.prompt_token_ids), tokens,
                         **kwargs)
        for i, (token, logprob) in enumerate(zip(tokens, logprobs, strict=True)):
            top2 = hf[i].topk(2)
            if int(top2.indices[0]) != token:
                assert float(top2.values[0] - hf[i, token]) <= TIE_MARGIN, (
                    r.request_id, i, token, int(top2.indices[0]))
            worst = max(worst, abs(logprob - float(hf[i, token])))
    assert worst <= LOGPROB_TOL, worst
    return worst
