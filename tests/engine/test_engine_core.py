"""EngineCore end to end on SmolLM2: greedy outputs equal HF generating each prompt alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.client import RequestRejected
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.model_runner import decode_group_sizes
from engine.core.output_processor import OutputProcessor
from engine.core.state import Request, RequestStatus
from engine.request import EngineRequest, RequestOutput, SamplingParams, TokenLogprob
from tests.utils.hf_oracle import hf_greedy

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea. The waves",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village near the mountains, there lived an old "
    "clockmaker who repaired every clock in the valley. One morning",
]
NEW_TOKENS = 20


def make_core(smollm2_dir: Path, **overrides: object) -> EngineCore:
    cfg = EngineConfig(model=str(smollm2_dir), **overrides)  # type: ignore[arg-type]
    return EngineCore(cfg)


def run_to_completion(
    core: EngineCore, requests: list[EngineRequest], max_steps: int = 10_000
) -> dict[str, list[RequestOutput]]:
    for r in requests:
        core.add_request(r)
    outputs: dict[str, list[RequestOutput]] = {r.request_id: [] for r in requests}
    for _ in range(max_steps):
        if not core.has_unfinished_requests():
            break
        for out in core.step().outputs:
            outputs[out.request_id].append(out)
    assert not core.has_unfinished_requests(), "engine did not finish"
    return outputs


def token_ids(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def greedy_request(rid: str, ids: list[int], n: int = NEW_TOKENS) -> EngineRequest:
    return EngineRequest(
        request_id=rid, prompt_token_ids=tuple(ids),
        sampling=SamplingParams(max_tokens=n, temperature=0),
    )


@pytest.fixture(scope="module")
def prompt_ids(smollm2_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    return [list(tok(p).input_ids) for p in PROMPTS]


@pytest.fixture(scope="module")
def expected(smollm2_dir: Path, prompt_ids: list[list[int]]) -> list[list[int]]:
    return [hf_greedy(smollm2_dir, ids, NEW_TOKENS) for ids in prompt_ids]


def test_concurrent_greedy_matches_hf(smollm2_dir, prompt_ids, expected) -> None:
    core = make_core(smollm2_dir)
    reqs = [greedy_request(f"r{i}", ids) for i, ids in enumerate(prompt_ids)]
    outs = run_to_completion(core, reqs)
    for i in range(len(reqs)):
        assert token_ids(outs[f"r{i}"]) == expected[i], PROMPTS[i]
    final = [o[-1] for o in outs.values()]
    assert all(o.finished for o in final)
    assert core.block_manager.num_free_blocks == core.runner.num_blocks


def test_chunked_prefill_matches_hf(smollm2_dir, prompt_ids, expected) -> None:
    # The longest prompt is ~35 tokens: a budget of 8 splits every prompt into chunks.
    core = make_core(smollm2_dir, max_num_batched_tokens=8)
    assert max(len(p) for p in prompt_ids) > 8
    reqs = [greedy_request(f"c{i}", ids) for i, ids in enumerate(prompt_ids)]
    outs = run_to_completion(core, reqs)
    for i in range(len(reqs)):
        assert token_ids(outs[f"c{i}"]) == expected[i]


def test_prefix_cache_hit_matches_hf(smollm2_dir, prompt_ids, expected) -> None:
    core = make_core(smollm2_dir, block_size=4)
    long_ids = prompt_ids[3]
    first = run_to_completion(core, [greedy_request("p0", long_ids)])
    assert token_ids(first["p0"]) == expected[3]
    second = run_to_completion(core, [greedy_request("p1", long_ids)])
    assert token_ids(second["p1"]) == expected[3]
    cached = second["p1"][-1].num_cached_tokens
    # Every full block but the one holding the last prompt token is reused.
    assert cached == ((len(long_ids) - 1) // 4) * 4
    assert cached > 0


def test_preemption_with_tiny_kv_cache(smollm2_dir, prompt_ids, expected) -> None:
    # 64 tokens of KV for 4 requests of ~30-55 tokens each: only preemption makes it.
    core = make_core(smollm2_dir, kv_cache_tokens=64, block_size=4, enable_prefix_caching=False)
    ids = [p[:28] for p in prompt_ids]
    want = [hf_greedy(smollm2_dir, p, NEW_TOKENS) for p in ids]
    reqs = [greedy_request(f"k{i}", p) for i, p in enumerate(ids)]
    assert sum(len(p) + NEW_TOKENS for p in ids) > 64
    outs = run_to_completion(core, reqs)
    for i in range(len(reqs)):
        assert token_ids(outs[f"k{i}"]) == want[i]
    assert core.scheduler.num_preemptions > 0
    assert core.block_manager.num_free_blocks == core.runner.num_blocks


def test_abort_frees_blocks(smollm2_dir, prompt_ids) -> None:
    core = make_core(smollm2_dir, enable_prefix_caching=False)
    total = core.block_manager.num_free_blocks
    reqs = [greedy_request(f"a{i}", ids, n=200) for i, ids in enumerate(prompt_ids)]
    states = [core.add_request(r) for r in reqs]
    for _ in range(3):
        core.step()
    held = total - core.block_manager.num_free_blocks
    assert held >= len(reqs)
    a0_blocks = len(states[0].block_ids)
    assert a0_blocks > 0
    out = core.abort_request("a0")
    assert out is not None and out.finished and out.finish_reason == "abort"
    assert total - core.block_manager.num_free_blocks == held - a0_blocks
    for r in reqs[1:]:
        core.abort_request(r.request_id)
    assert core.block_manager.num_free_blocks == total
    assert not core.has_unfinished_requests()


def test_rejects_requests_that_cannot_fit(smollm2_dir) -> None:
    core = make_core(smollm2_dir, kv_cache_tokens=64, block_size=16)
    with pytest.raises(RequestRejected) as err:
        core.add_request(greedy_request("big", list(range(100, 150)), n=32))
    assert err.value.code == "context_length_exceeded"
    assert core.block_manager.num_free_blocks == core.runner.num_blocks


def test_context_rejections_are_worded_as_openai_s(tiny_model_factory) -> None:
    # Clients such as litellm recognise a context overflow by OpenAI's first sentence.
    core = EngineCore(EngineConfig(model=str(tiny_model_factory("llama_gqa")), max_loras=0))
    context = core.max_model_len
    for num_prompt_tokens, max_tokens, param in [(context, 1, "messages"),
                                                 (context - 2, 10, "max_tokens")]:
        with pytest.raises(RequestRejected) as err:
            core.check_request(num_prompt_tokens, max_tokens)
        assert str(err.value).startswith(
            f"This model's maximum context length is {context} tokens. However, "
        )
        assert (err.value.code, err.value.param) == ("context_length_exceeded", param)
    with pytest.raises(RequestRejected, match=rf"you requested {context + 8} tokens "
                       rf"\({context - 2} in the messages, 10 in the completion\)"):
        core.check_request(context - 2, 10)


def test_stop_string_and_max_tokens(smollm2_dir, prompt_ids, expected) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    full_text = tok.decode(expected[0], skip_special_tokens=True)
    stop = full_text.strip().split()[1]  # a word that appears after the start
    core = make_core(smollm2_dir)
    req = EngineRequest(
        request_id="s",
        prompt_token_ids=tuple(prompt_ids[0]),
        sampling=SamplingParams(max_tokens=NEW_TOKENS, temperature=0, stop=[stop]),
    )
    outs = run_to_completion(core, [req])["s"]
    text = "".join(o.new_text for o in outs)
    assert outs[-1].finish_reason == "stop"
    assert stop not in text
    assert full_text.startswith(text)
    assert full_text[len(text) :].lstrip().startswith(stop) or full_text[len(text) :].startswith(
        stop
    )

    core2 = make_core(smollm2_dir)
    outs2 = run_to_completion(core2, [greedy_request("m", prompt_ids[0], n=3)])["m"]
    assert outs2[-1].finish_reason == "length"
    assert token_ids(outs2) == expected[0][:3]


def test_output_processor_stops_on_eos_stop_ids_and_length(smollm2_dir) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    finished: list[tuple[str, RequestStatus]] = []

    def finish(request: Request, status: RequestStatus) -> None:
        request.status = status
        finished.append((request.request_id, status))

    proc = OutputProcessor(tok, [7], max_model_len=6, finish=finish)
    assert proc.eos_token_ids == {7, tok.eos_token_id}
    hello = tok("Hello world").input_ids

    def request(rid: str, **sampling: Any) -> Request:
        r = Request(rid, [1, 2], SamplingParams(**{"max_tokens": 3, **sampling}))
        proc.add(r)
        return r

    eos = request("eos")
    out = proc.append_token(eos, 7, None, 0.5)
    assert (out.new_token_ids, out.new_text, out.finished, out.finish_reason) == (
        [7], "", True, "stop")
    assert eos.first_token_time == 0.5 and "eos" not in proc
    ignoring = request("ignore", ignore_eos=True, stop_token_ids=[9])
    assert not proc.append_token(ignoring, 7, None, 1.0).finished
    assert proc.append_token(ignoring, 9, None, 1.0).finish_reason == "stop"
    long = request("length", max_tokens=2)
    first = proc.append_token(long, hello[0], TokenLogprob(hello[0], -0.1, []), 1.0)
    assert first.new_text == tok.decode(hello[:1]) and not first.finished
    assert first.new_token_texts == [proc.token_text(hello[0])]
    assert [lp.logprob for lp in first.new_logprobs] == [-0.1]
    assert proc.append_token(long, hello[1], None, 1.0).finish_reason == "length"
    context = request("context", max_tokens=100)
    for token in (hello * 4)[:3]:
        assert not proc.append_token(context, token, None, 1.0).finished
    assert proc.append_token(context, hello[0], None, 1.0).finish_reason == "length"  # 6 tokens
    assert finished == [
        ("eos", RequestStatus.FINISHED_STOPPED),
        ("ignore", RequestStatus.FINISHED_STOPPED),
        ("length", RequestStatus.FINISHED_LENGTH),
        ("context", RequestStatus.FINISHED_LENGTH),
    ]
    assert proc.pop("context") is None


@pytest.mark.parametrize("variant", ["llama_gqa", "qwen2_bias", "llama_mha_untied"])
def test_many_varied_requests_on_tiny_models_match_hf(tiny_model_factory, variant: str) -> None:
    """Ten concurrent requests of very different lengths: decodes run in several padded
    groups per step (block size 4), chunked prefill mixes with decodes (budget 48)."""
    model_dir = tiny_model_factory(variant)
    core = EngineCore(
        EngineConfig(model=str(model_dir), block_size=4, max_num_batched_tokens=48, num_threads=1)
    )
    lengths = [3, 120, 7, 64, 33, 90, 5, 47, 18, 101]
    prompts = [[(97 * i + 13 * j) % 4000 + 100 for j in range(n)] for i, n in enumerate(lengths)]
    reqs = [greedy_request(f"t{i}", p, n=16) for i, p in enumerate(prompts)]
    outs = run_to_completion(core, reqs)
    widths = sorted((-(-(n + 8) // 4) for n in lengths), reverse=True)
    assert len(decode_group_sizes(widths) or []) > 1  # several decode groups were in play
    for i, p in enumerate(prompts):
        assert token_ids(outs[f"t{i}"]) == hf_greedy(model_dir, p, 16), (variant, i)
    assert core.block_manager.num_free_blocks == core.runner.num_blocks
