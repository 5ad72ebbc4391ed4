"""Prompt logprobs (`SamplingParams.prompt_logprobs`) from the prefill's logits, against
Hugging Face's log-softmax on the same float32 weights (PEFT for an adapter): alone, in
chunks across steps, after another request filled the prefix cache with the same prompt,
and in mixed steps with ordinary requests whose tokens must not change."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.model_runner import PROMPT_LOGPROB_ROWS
from engine.request import EngineRequest, RequestOutput, SamplingParams, TokenLogprob
from tests.utils.hf_oracle import hf_model, peft_model
from tests.utils.peft_adapters import make_peft_adapter
from tests.utils.tiny_models import random_prompt

TOLERANCE = 1e-4  # nats, float32 on both sides (the bound)
TOP = 5


@pytest.fixture(scope="module")
def tiny(tiny_model_factory: Callable[[str], Path],
         tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tiny_model_factory("llama_gqa")
    adapter = make_peft_adapter(base, tmp_path_factory.mktemp("prompt_lp") / "attn", r=8,
                                alpha=16, targets=("q_proj", "k_proj", "v_proj", "o_proj"),
                                seed=21)
    return base, adapter


def core_for(base: Path, adapter: Path, **config: object) -> EngineCore:
    core = EngineCore(EngineConfig(model=str(base), max_loras=2, max_lora_rank=8,
                                   **config))  # type: ignore[arg-type]
    core.add_adapter("attn", adapter)
    return core


def request(rid: str, prompt: list[int], *, adapter: str | None = None,
            prompt_logprobs: int | None = TOP, max_tokens: int = 4) -> EngineRequest:
    return EngineRequest(rid, tuple(prompt), SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True, prompt_logprobs=prompt_logprobs),
        adapter=adapter)


def run(core: EngineCore, requests: list[EngineRequest]) -> dict[str, list[RequestOutput]]:
    for r in requests:
        core.add_request(r)
    outputs: dict[str, list[RequestOutput]] = {r.request_id: [] for r in requests}
    for _ in range(5000):
        if not core.has_unfinished_requests():
            break
        for out in core.step().outputs:
            outputs[out.request_id].append(out)
    assert not core.has_unfinished_requests()
    return outputs


@torch.inference_mode()
def oracle(base: Path, adapter: Path | None, prompt: list[int]) -> torch.Tensor:
    """log-softmax [L, V] of HF's (or PEFT's) logits at every prompt position."""
    if adapter is None:
        model = hf_model(str(base))
    else:
        model = peft_model(str(base), (("attn", str(adapter)),))
        model.set_adapter("attn")  # type: ignore[operator]
    logits = model(torch.tensor([prompt])).logits[0].float()  # type: ignore[operator]
    return torch.log_softmax(logits, dim=-1)


def check(entries: list[TokenLogprob | None] | None, want: torch.Tensor,
          prompt: list[int]) -> None:
    assert entries is not None and len(entries) == len(prompt)
    assert entries[0] is None  # nothing precedes the first token
    for position, entry in enumerate(entries[1:], start=1):
        assert entry is not None, position
        row = want[position - 1]  # the logits before a token predict it
        assert entry.token_id == prompt[position]
        assert abs(entry.logprob - row[prompt[position]].item()) < TOLERANCE, position
        # The rank counts likelier tokens: exact up to ties within the tolerance.
        chosen = row[prompt[position]]
        surely = int((row > chosen + TOLERANCE).sum()) + 1
        assert surely <= entry.rank <= int((row > chosen - TOLERANCE).sum()) + 1
        top_values, top_ids = row.topk(TOP)
        assert [t for t, _ in entry.top] == top_ids.tolist()
        assert max(abs(a - b) for (_, a), b in zip(entry.top, top_values.tolist(),
                                                   strict=True)) < TOLERANCE


def first_output(outputs: list[RequestOutput]) -> RequestOutput:
    """The output that carries them (the first), and no later one."""
    first, *rest = outputs
    assert all(o.prompt_logprobs is None for o in rest)
    return first


@pytest.mark.parametrize("with_adapter", [False, True], ids=["base", "adapter"])
def test_prompt_logprobs_equal_hf(tiny: tuple[Path, Path], with_adapter: bool) -> None:
    base, adapter = tiny
    prompt = random_prompt(37, seed=5)
    core = core_for(base, adapter)
    got = run(core, [request("r", prompt, adapter="attn" if with_adapter else None)])
    check(first_output(got["r"]).prompt_logprobs, oracle(base, adapter if with_adapter
                                                        else None, prompt), prompt)


@pytest.mark.parametrize("budget", [64, 256], ids=["chunks-across-steps", "one-chunk"])
def test_long_prompts_in_chunks_and_in_slices_of_rows(
    tiny: tuple[Path, Path], budget: int
) -> None:
    """A prompt longer than one slice of logit rows, prefilled in chunks across steps
    (64 tokens a step) or in one chunk (two slices)."""
    base, adapter = tiny
    prompt = random_prompt(PROMPT_LOGPROB_ROWS + 90, seed=6)  # the model holds 256
    core = core_for(base, adapter, max_num_batched_tokens=budget)
    got = run(core, [request("long", prompt, adapter="attn")])
    check(first_output(got["long"]).prompt_logprobs, oracle(base, adapter, prompt), prompt)


def test_a_prefix_cache_hit_is_computed_anyway(tiny: tuple[Path, Path]) -> None:
    base, adapter = tiny
    prompt = random_prompt(70, seed=7)
    core = core_for(base, adapter, enable_prefix_caching=True, block_size=16)
    run(core, [request("fill", prompt, prompt_logprobs=None)])
    got = run(core, [request("again", prompt)])
    first = first_output(got["again"])
    assert first.num_cached_tokens == 0  # computed, not taken from the cache
    check(first.prompt_logprobs, oracle(base, None, prompt), prompt)
    # A request without prompt logprobs still hits the cache.
    plain = run(core, [request("plain", prompt, prompt_logprobs=None)])
    assert plain["plain"][0].num_cached_tokens == 64


def test_mixed_steps_leave_other_requests_tokens_unchanged(tiny: tuple[Path, Path]) -> None:
    base, adapter = tiny
    prompts = [random_prompt(n, seed=n) for n in (9, 40, 23, 61)]

    def ordinary(core: EngineCore) -> dict[str, list[int]]:
        got = run(core, [
            request(f"plain-{i}", p, adapter="attn" if i % 2 else None, prompt_logprobs=None,
                    max_tokens=8)
            for i, p in enumerate(prompts)
        ] + [request(f"lp-{i}", p, adapter=None if i % 2 else "attn", prompt_logprobs=0)
             for i, p in enumerate(prompts)] * with_logprobs[0])
        for i, p in enumerate(prompts):
            if with_logprobs[0]:
                entries = first_output(got[f"lp-{i}"]).prompt_logprobs
                check_chosen(entries, oracle(base, None if i % 2 else adapter, p), p)
        return {rid: [t for o in outs for t in o.new_token_ids]
                for rid, outs in got.items() if rid.startswith("plain")}

    with_logprobs = [0]
    alone = ordinary(core_for(base, adapter, max_num_batched_tokens=48))
    with_logprobs = [1]
    mixed = ordinary(core_for(base, adapter, max_num_batched_tokens=48))
    assert mixed == alone


def check_chosen(entries: list[TokenLogprob | None] | None, want: torch.Tensor,
                 prompt: list[int]) -> None:
    """prompt_logprobs=0: the prompt tokens' own logprobs, no alternatives."""
    assert entries is not None and entries[0] is None
    for position, entry in enumerate(entries[1:], start=1):
        assert entry is not None and entry.top == []
        assert abs(entry.logprob - want[position - 1][prompt[position]].item()) < TOLERANCE


def test_a_one_token_prompt_has_only_the_null_entry(tiny: tuple[Path, Path]) -> None:
    base, adapter = tiny
    got = run(core_for(base, adapter), [request("one", [42])])
    assert first_output(got["one"]).prompt_logprobs == [None]


def test_negative_prompt_logprobs_are_refused() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs must be >= 0"):
        SamplingParams(prompt_logprobs=-1)
