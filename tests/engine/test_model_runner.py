"""ModelRunner: device and cache sizing, the exact inputs built from a SchedulerOutput,
and logits against Hugging Face transformers over hand-built steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.core.model_runner import CPU_DEFAULT_KV_CACHE_TOKENS, ModelRunner, resolve_device_dtype
from engine.core.state import Request, ScheduledChunk, SchedulerOutput
from engine.request import SamplingParams
from engine.runtime.cpu_features import auto_cpu_dtype
from tests.utils.tiny_models import random_prompt


def _runner(model_dir: Path, **kwargs: object) -> ModelRunner:
    settings: dict[str, object] = {"device": "cpu", "num_threads": 1, "block_size": 8}
    settings.update(kwargs)
    return ModelRunner(EngineConfig(**settings), model_dir)  # type: ignore[arg-type]


def _request(
    name: str, prompt: list[int], blocks: list[int], outputs: list[int] | None = None
) -> Request:
    req = Request(name, prompt, SamplingParams(temperature=0.0))
    req.block_ids = list(blocks)
    req.output_token_ids = list(outputs or [])
    return req


def test_resolve_device_dtype() -> None:
    cpu = torch.device("cpu")
    # auto on the CPU: bf16 where it has bf16 units, else float32 (test_cpu_features.py
    # forces both ways).
    if not torch.cuda.is_available():
        assert resolve_device_dtype("auto", "auto") == (cpu, auto_cpu_dtype())
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device_dtype("cuda", "auto")
    assert resolve_device_dtype("cpu", "auto") == (cpu, auto_cpu_dtype())
    assert resolve_device_dtype("cpu", "float32") == (cpu, torch.float32)
    assert resolve_device_dtype("cpu", "bfloat16") == (cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        resolve_device_dtype("cpu", "int8")
    with pytest.raises(ValueError, match="unsupported device 'meta'"):
        resolve_device_dtype("meta", "auto")


def test_kv_cache_sizing(tiny_model_factory) -> None:
    model_dir = tiny_model_factory("llama_gqa")
    runner = _runner(model_dir, kv_cache_tokens=100, block_size=16)
    assert runner.num_blocks == 7  # ceil(100 / 16)
    assert len(runner.kv_caches) == 2
    for cache in runner.kv_caches:
        assert cache.key.shape == cache.value.shape == (7, 16, 2, 16)
        assert cache.key.dtype == torch.float32
    assert runner.max_model_len == 112  # capped to what the 7 blocks hold

    default = _runner(model_dir, max_num_seqs=3, max_model_len=100)
    assert (default.num_blocks, default.max_model_len) == (38, 100)  # 300 tokens / 8

    capped = _runner(model_dir, max_num_seqs=512)  # 512 * 256 tokens is over the CPU cap
    assert capped.num_blocks == CPU_DEFAULT_KV_CACHE_TOKENS // 8
    assert capped.max_model_len == 256  # the model's own limit

    with pytest.raises(ValueError, match="max_model_len 1000 exceeds the model's "
                       "max_position_embeddings 256"):
        _runner(model_dir, kv_cache_tokens=1024, max_model_len=1000)


def test_num_threads_is_applied(tiny_model_factory) -> None:
    before = torch.get_num_threads()
    try:
        _runner(tiny_model_factory("llama_gqa"), kv_cache_tokens=64, num_threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_prepare_inputs_layout(tiny_model_factory) -> None:
    runner = _runner(tiny_model_factory("llama_gqa"), kv_cache_tokens=256)
    r1 = _request("r1", list(range(100, 110)), [9, 3], outputs=[7])
    r1.num_computed_tokens = 10
    r2 = _request("r2", [200, 201, 202], [12], outputs=[5, 6])
    r2.num_computed_tokens = 4
    r3 = _request("r3", list(range(300, 320)), [2, 6, 11])
    r3.num_computed_tokens = 6
    r4 = _request("r4", [400, 401, 402, 403], [1])
    chunks = [
        ScheduledChunk(r1, 10, 1),
        ScheduledChunk(r2, 4, 1),
        ScheduledChunk(r3, 6, 12),  # positions 6..17 of 20: does not sample
        ScheduledChunk(r4, 0, 4),
    ]
    inputs = runner.prepare_inputs(chunks)
    assert inputs.input_ids.tolist() == [7, 6, *range(306, 318), 400, 401, 402, 403]
    assert inputs.positions.tolist() == [10, 4, *range(6, 18), 0, 1, 2, 3]
    meta = inputs.metadata
    r1_slot = 3 * 8 + 2  # position 10: block 1 of [9, 3], offset 2
    r2_slot = 12 * 8 + 4
    r3_slots = [22, 23, *range(48, 56), 88, 89]  # positions 6..17 over blocks 2, 6, 11
    r4_slots = [8, 9, 10, 11]
    assert meta.slot_mapping.tolist() == [r1_slot, r2_slot, *r3_slots, *r4_slots]
    assert meta.num_decode_tokens == 2
    assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
    assert meta.decode_block_tables.tolist() == [[9, 3], [12, 0]]
    assert meta.decode_context_lens.tolist() == [11, 5]
    assert [tuple(g.mask.shape) for g in meta.decode_groups] == [(2, 1, 1, 16)]
    assert [
        (p.query_start, p.query_len, p.context_len, p.block_ids.tolist()) for p in meta.prefills
    ] == [(2, 12, 18, [2, 6, 11]), (14, 4, 4, [1])]
    assert meta.prefills[0].mask is not None and meta.prefills[1].mask is None
    assert inputs.sample_indices.tolist() == [0, 1, 17]


def test_prepare_inputs_lora_rows_follow_the_adapter_version(tiny_model_factory) -> None:
    runner = _runner(tiny_model_factory("llama_gqa"), kv_cache_tokens=256, max_loras=2)
    decode = _request("d", [5, 6, 7], [4], outputs=[8])
    decode.num_computed_tokens = 3
    decode.adapter_id, decode.adapter_key = "x", "x#2"
    base = _request("b", [10, 11], [5])
    prefill = _request("p", [20, 21, 22], [6])
    prefill.adapter_id, prefill.adapter_key = "x", "x#1"  # an older version, still running
    chunks = [ScheduledChunk(decode, 3, 1), ScheduledChunk(base, 0, 2),
              ScheduledChunk(prefill, 0, 3)]
    inputs = runner.prepare_inputs(chunks, {"x#1": 0, "x#2": 1})
    assert inputs.lora is not None
    # Rows: the decode (0), the base prefill (1, 2), the other prefill (3..5); by slot.
    assert inputs.lora.segments == ((0, 3, 0), (3, 4, 1))
    assert inputs.lora.token_indices.tolist() == [3, 4, 5, 0]
    assert runner.prepare_inputs([ScheduledChunk(base, 0, 2)]).lora is None


def test_single_token_chunk_after_a_prefill_is_not_a_decode(tiny_model_factory) -> None:
    runner = _runner(tiny_model_factory("llama_gqa"), kv_cache_tokens=256)
    r1 = _request("r1", [5, 6, 7], [4])
    r2 = _request("r2", [8, 9], [5], outputs=[3])
    r2.num_computed_tokens = 2
    meta = runner.prepare_inputs([ScheduledChunk(r1, 0, 3), ScheduledChunk(r2, 2, 1)]).metadata
    assert meta.num_decode_tokens == 0
    assert [(p.query_start, p.query_len, p.context_len) for p in meta.prefills] == [
        (0, 3, 3),
        (3, 1, 3),
    ]


def _hf_last_logits(model_dir: Path, sequences: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.inference_mode():
        return [model(torch.tensor([s])).logits[0, -1] for s in sequences]


@pytest.mark.parametrize("variant", ["llama_gqa", "qwen2_bias"])
def test_execute_matches_transformers_over_steps(variant: str, tiny_model_factory) -> None:
    model_dir = tiny_model_factory(variant)
    runner = _runner(model_dir, kv_cache_tokens=256)
    assert runner.num_blocks == 32
    a = _request("a", random_prompt(11, seed=1), [17, 4])
    b = _request("b", random_prompt(19, seed=2), [30, 8, 21])
    c = _request("c", random_prompt(5, seed=3), [13])

    # Step 1: a whole (samples), b's first 7 tokens (does not sample), c whole (samples).
    step1 = [ScheduledChunk(a, 0, 11), ScheduledChunk(b, 0, 7), ScheduledChunk(c, 0, 5)]
    logits1 = runner.execute(SchedulerOutput(step1))
    for chunk in step1:
        chunk.request.num_computed_tokens += chunk.num_tokens
    a.output_token_ids.append(int(logits1[0].argmax()))
    c.output_token_ids.append(int(logits1[1].argmax()))

    # Step 2: decodes of a and c, then the rest of b (starting mid-prompt).
    step2 = [ScheduledChunk(a, 11, 1), ScheduledChunk(c, 5, 1), ScheduledChunk(b, 7, 12)]
    logits2 = runner.execute(SchedulerOutput(step2))

    # Step 3: nothing samples -> no rows.
    d = _request("d", random_prompt(9, seed=4), [2, 3])
    empty = runner.execute(SchedulerOutput([ScheduledChunk(d, 0, 4)]))

    vocab = runner.vocab_size
    assert logits1.shape == (2, vocab) and logits2.shape == (3, vocab)
    assert empty.shape == (0, vocab)
    assert runner.execute(SchedulerOutput([])).shape == (0, vocab)
    expected = _hf_last_logits(
        model_dir,
        [
            a.prompt_token_ids,
            c.prompt_token_ids,
            a.all_token_ids,
            c.all_token_ids,
            b.prompt_token_ids,
        ],
    )
    got = [logits1[0], logits1[1], logits2[0], logits2[1], logits2[2]]
    for ours, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)

    # Only the blocks handed out were written; block 0 was never anyone's.
    used = {17, 4, 30, 8, 21, 13, 2}
    key = runner.kv_caches[0].key
    written = {i for i in range(runner.num_blocks) if bool(key[i].abs().sum() > 0)}
    assert written == used
