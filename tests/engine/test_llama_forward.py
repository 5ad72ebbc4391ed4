"""Our Llama-family forward against Hugging Face transformers, and the paged reference ops.

The greedy loop below stands in for a scheduler: it allocates KV blocks itself, runs
decodes of several sequences together with prefill chunks in the same forward, splits
prompts into chunks, and starts one sequence on blocks already filled by another
(a prefix-cache hit), so its first query token sits mid-sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.config import EngineConfig
from engine.core.model_runner import ModelRunner
from engine.core.state import Request, ScheduledChunk, SchedulerOutput
from engine.models.llama import rope_inv_freq_for
from engine.models.loader import parse_model_config
from engine.request import SamplingParams
from loraplex_kernels import cpu_ops
from loraplex_kernels import reference as ref
from tests.utils.tiny_models import BASE_SETTINGS, VARIANTS, random_prompt

# ---------------------------------------------------------------------------- reference ops


def _scrambled_cache(
    keys: list[torch.Tensor], values: list[torch.Tensor], num_blocks: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """Write each sequence's K/V [C, KVH, D] into non-contiguous blocks of a fresh cache."""
    kvh, hd = keys[0].shape[1:]
    key_cache = torch.randn(num_blocks, block_size, kvh, hd)  # garbage outside the sequences
    value_cache = torch.randn(num_blocks, block_size, kvh, hd)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
    tables = []
    for k, v in zip(keys, values, strict=True):
        n = math.ceil(k.shape[0] / block_size)
        blocks, order = order[:n], order[n:]
        slots = torch.tensor(
            [blocks[i // block_size] * block_size + i % block_size for i in range(k.shape[0])]
        )
        ref.write_kv_cache(k, v, key_cache, value_cache, slots)
        tables.append(blocks)
    return key_cache, value_cache, tables


def test_write_kv_cache_puts_each_token_in_its_slot() -> None:
    key_cache = torch.zeros(4, 2, 1, 3)
    value_cache = torch.zeros(4, 2, 1, 3)
    key = torch.arange(9.0).view(3, 1, 3)
    ref.write_kv_cache(key, -key, key_cache, value_cache, torch.tensor([5, 0, 6]))
    assert key_cache[2, 1, 0].tolist() == [0.0, 1.0, 2.0]  # slot 5 = block 2, offset 1
    assert key_cache[0, 0, 0].tolist() == [3.0, 4.0, 5.0]
    assert key_cache[3, 0, 0].tolist() == [6.0, 7.0, 8.0]
    assert value_cache[3, 0, 0].tolist() == [-6.0, -7.0, -8.0]
    assert int((key_cache != 0).any(dim=-1).sum()) == 3


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2), (4, 1)])
def test_paged_decode_attention_matches_dense(num_heads: int, num_kv_heads: int) -> None:
    torch.manual_seed(0)
    block_size, hd, lens = 4, 8, [1, 7, 13, 4]
    keys = [torch.randn(n, num_kv_heads, hd) for n in lens]
    values = [torch.randn(n, num_kv_heads, hd) for n in lens]
    key_cache, value_cache, tables = _scrambled_cache(keys, values, 16, block_size)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    query = torch.randn(len(lens), num_heads, hd)
    out = ref.paged_decode_attention(
        query, key_cache, value_cache, block_tables, torch.tensor(lens), hd**-0.5
    )
    for i in range(len(lens)):
        expected = ref.dense_causal_attention_reference(
            query[i : i + 1], keys[i], values[i], hd**-0.5
        )
        torch.testing.assert_close(out[i : i + 1], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("query_len", "context_len"), [(5, 5), (3, 11), (1, 9), (8, 16)])
def test_paged_prefill_attention_matches_dense(query_len: int, context_len: int) -> None:
    torch.manual_seed(0)
    num_heads, num_kv_heads, hd, block_size = 6, 2, 8, 4
    key = torch.randn(context_len, num_kv_heads, hd)
    value = torch.randn(context_len, num_kv_heads, hd)
    key_cache, value_cache, (blocks,) = _scrambled_cache([key], [value], 12, block_size)
    query = torch.randn(query_len, num_heads, hd)
    out = ref.paged_prefill_attention(
        query, key_cache, value_cache, torch.tensor(blocks), context_len, hd**-0.5
    )
    expected = ref.dense_causal_attention_reference(query, key, value, hd**-0.5)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    if query_len == context_len:
        fresh = ref.causal_attention(query, key, value, hd**-0.5)
        torch.testing.assert_close(fresh, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("length", [1, 15, 16, 17, 100, 345])
def test_causal_attention_pads_bf16_only_and_matches_dense(length: int) -> None:
    gen = torch.Generator().manual_seed(length)
    query = torch.randn(length, 9, 64, generator=gen) * 2
    key = torch.randn(length, 3, 64, generator=gen) * 2
    value = torch.randn(length, 3, 64, generator=gen)
    # float32: the unpadded call, bit for bit (what the Hugging Face oracle computes).
    unpadded = F.scaled_dot_product_attention(
        query.transpose(0, 1)[None], key.transpose(0, 1)[None], value.transpose(0, 1)[None],
        is_causal=True, scale=0.125, enable_gqa=True,
    )[0].transpose(0, 1)
    assert torch.equal(ref.causal_attention(query, key, value, 0.125), unpadded)
    # bf16, padded to a multiple of ref.CAUSAL_PAD rows: the dense result to bf16 rounding.
    q, k, v = (t.bfloat16() for t in (query, key, value))
    got = ref.causal_attention(q, k, v, 0.125)
    assert got.shape == (length, 9, 64) and got.dtype == torch.bfloat16
    want = ref.dense_causal_attention_reference(q, k, v, 0.125)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1e-2)


def test_prefill_mask_places_queries_at_the_end_of_the_context() -> None:
    mask = ref.prefill_attention_mask(2, 4, torch.device("cpu"))
    assert mask.tolist() == [[True, True, True, False], [True, True, True, True]]


@pytest.mark.parametrize("variant", ["llama_gqa", "llama3_rope", "llama_linear_rope"])
def test_rope_tables_match_transformers(variant: str) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    settings = {**BASE_SETTINGS, **VARIANTS[variant][1]}
    hf_config = LlamaConfig(**settings)
    ours = parse_model_config(hf_config.to_dict())
    inv_freq = rope_inv_freq_for(ours)
    cos, sin = ref.rope_cos_sin(inv_freq, 200)
    positions = torch.arange(200)[None]
    hf_cos, hf_sin = LlamaRotaryEmbedding(hf_config)(torch.zeros(1, 1, 1), positions)
    assert torch.equal(torch.cat((cos, cos), -1), hf_cos[0])
    assert torch.equal(torch.cat((sin, sin), -1), hf_sin[0])
    if ours.rope_scaling is not None:  # the scaling really changes the table
        plain = ref.rope_inv_freq(ours.head_dim, ours.rope_theta)
        assert not torch.equal(plain, inv_freq)


# ---------------------------------------------------------------------------- greedy loop


@dataclass
class Arrival:
    request: Request
    step: int
    # (donor, num_blocks): start on the donor's first blocks, already filled.
    prefix_from: tuple[Request, int] | None = None


@dataclass
class GreedyLoop:
    runner: ModelRunner
    chunk_size: int
    eos_token_id: int
    free_blocks: list[int] = field(default_factory=list)
    # Per step: (decode request ids, [(request id, start, num_tokens) of prefill chunks]).
    trace: list[tuple[list[str], list[tuple[str, int, int]]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Hand blocks out from the top so block ids never line up with positions.
        self.free_blocks = list(range(self.runner.num_blocks))

    def _grow(self, request: Request, num_tokens: int) -> None:
        bs = self.runner.block_size
        while len(request.block_ids) * bs < num_tokens:
            request.block_ids.append(self.free_blocks.pop())

    def run(self, arrivals: list[Arrival], max_new_tokens: int) -> dict[str, list[int]]:
        bs = self.runner.block_size
        running: list[Request] = []
        done: set[str] = set()
        step = 0
        while len(done) < len(arrivals):
            for arrival in arrivals:
                if arrival.step != step:
                    continue
                req = arrival.request
                if arrival.prefix_from is not None:
                    donor, num_blocks = arrival.prefix_from
                    shared = num_blocks * bs
                    assert donor.num_computed_tokens >= shared
                    assert donor.all_token_ids[:shared] == req.prompt_token_ids[:shared]
                    req.block_ids = donor.block_ids[:num_blocks]
                    req.num_computed_tokens = shared
                running.append(req)
            live = [r for r in running if r.request_id not in done]
            decodes = [r for r in live if r.output_token_ids]
            prefills = [r for r in live if not r.output_token_ids]
            chunks = []
            for r in decodes:
                self._grow(r, r.num_tokens)
                chunks.append(ScheduledChunk(r, r.num_computed_tokens, 1))
            for r in prefills:
                n = min(self.chunk_size, r.num_prompt_tokens - r.num_computed_tokens)
                self._grow(r, r.num_computed_tokens + n)
                chunks.append(ScheduledChunk(r, r.num_computed_tokens, n))
            self.trace.append(
                (
                    [r.request_id for r in decodes],
                    [(c.request.request_id, c.start, c.num_tokens) for c in chunks[len(decodes) :]],
                )
            )
            sampling = [c for c in chunks if c.samples]
            logits = self.runner.execute(SchedulerOutput(chunks))
            assert logits.shape == (len(sampling), self.runner.vocab_size)
            assert logits.dtype == torch.float32
            for c in chunks:
                c.request.num_computed_tokens += c.num_tokens
            for c, token in zip(sampling, logits.argmax(dim=-1).tolist(), strict=True):
                req = c.request
                req.output_token_ids.append(token)
                if token == self.eos_token_id or req.num_output_tokens == max_new_tokens:
                    done.add(req.request_id)
            step += 1
        return {a.request.request_id: a.request.output_token_ids for a in arrivals}


def hf_greedy(model_dir: Path, prompts: dict[str, list[int]], max_new_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    results = {}
    with torch.inference_mode():
        for name, prompt in prompts.items():
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
            )
            results[name] = out[0, len(prompt) :].tolist()
    return results


def make_request(name: str, prompt: list[int], eos: int) -> Request:
    return Request(name, prompt, SamplingParams(temperature=0.0), eos_token_id=eos)


def run_scenario(
    runner: ModelRunner, prompts: dict[str, list[int]], chunk_size: int, max_new_tokens: int
) -> tuple[dict[str, list[int]], GreedyLoop]:
    """a, b, d arrive at steps 0, 1, 2; c starts on a's first blocks once a has prefilled."""
    bs = runner.block_size
    eos = runner.model_config.eos_token_ids[0]
    reqs = {name: make_request(name, p, eos) for name, p in prompts.items()}
    shared_blocks = _common_prefix(prompts["a"], prompts["c"]) // bs
    assert shared_blocks >= 1
    a_prefill_steps = math.ceil(len(prompts["a"]) / chunk_size)
    loop = GreedyLoop(runner, chunk_size, eos)
    outputs = loop.run(
        [
            Arrival(reqs["a"], 0),
            Arrival(reqs["b"], 1),
            Arrival(reqs["d"], 2),
            Arrival(reqs["c"], a_prefill_steps + 1, prefix_from=(reqs["a"], shared_blocks)),
        ],
        max_new_tokens,
    )
    # The scenario really mixed work: batched decodes beside a prefill chunk that starts
    # mid-prompt, and c's first chunk starting after the shared blocks.
    assert any(len(decs) >= 2 and any(start > 0 for _, start, _ in pre) for decs, pre in loop.trace)
    c_chunks = [(s, n) for _, pre in loop.trace for rid, s, n in pre if rid == "c"]
    assert c_chunks[0][0] == shared_blocks * bs
    return outputs, loop


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tiny_greedy_matches_transformers(variant: str, tiny_model_factory) -> None:
    model_dir = tiny_model_factory(variant)
    max_new = 24
    prompts = {
        "a": random_prompt(37, seed=1),
        "b": random_prompt(21, seed=2),
        "d": random_prompt(50, seed=4),
    }
    prompts["c"] = prompts["a"][:32] + random_prompt(9, seed=3)
    runner = ModelRunner(
        EngineConfig(
            device="cpu", block_size=8, kv_cache_tokens=1024, max_num_seqs=4, num_threads=1
        ),
        model_dir,
    )
    ours, _ = run_scenario(runner, prompts, chunk_size=10, max_new_tokens=max_new)
    expected = hf_greedy(model_dir, prompts, max_new)
    for name in prompts:
        assert len(expected[name]) == max_new  # no early EOS: the whole run is compared
        assert ours[name] == expected[name], name


@pytest.mark.parametrize("kernels", [True, False], ids=["cpu-kernels", "torch-ops"])
def test_the_cpu_kernels_and_the_torch_ops_both_match_transformers(
    kernels: bool, tiny_model_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused CPU kernels (SiLU-and-multiply, the K/V write, RMSNorm) are what the model
    runs when they build, and the torch ops they replace give the same greedy tokens."""
    if kernels and not cpu_ops.available(torch.device("cpu"), torch.float32):
        pytest.skip("no C compiler for the CPU kernels")
    calls: dict[str, int] = {"silu_mul": 0, "write_kv": 0}
    for name in calls:
        real = getattr(cpu_ops, name)

        def counting(*args: object, _real=real, _name=name) -> object:
            calls[_name] += 1
            return _real(*args)

        monkeypatch.setattr(cpu_ops, name, counting)
    if not kernels:
        monkeypatch.setattr(cpu_ops, "available", lambda device, dtype: False)
    model_dir = tiny_model_factory("llama_gqa")
    prompts = {"a": random_prompt(30, seed=7), "b": random_prompt(12, seed=8),
               "d": random_prompt(19, seed=9)}
    prompts["c"] = prompts["a"][:24] + random_prompt(5, seed=10)
    runner = ModelRunner(
        EngineConfig(device="cpu", block_size=8, kv_cache_tokens=512, max_num_seqs=4),
        model_dir,
    )
    ours, _ = run_scenario(runner, prompts, chunk_size=10, max_new_tokens=12)
    assert ours == hf_greedy(model_dir, prompts, 12)
    if kernels:
        assert calls["silu_mul"] > 0 and calls["write_kv"] > 0, calls
    else:
        assert calls == {"silu_mul": 0, "write_kv": 0}


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers(smollm2_dir: Path) -> None:
    runner = ModelRunner(
        EngineConfig(device="cpu", block_size=16, kv_cache_tokens=2048, max_num_seqs=4),
        smollm2_dir,
    )
    tok = runner.tokenizer

    def chat(text: str) -> list[int]:
        messages = [{"role": "user", "content": text}]
        return list(
            tok.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )

    prompts = {
        "a": chat("What is the capital of France?"),
        "b": chat("Name three primary colors."),
        "c": chat("What is the capital of Germany?"),
        "d": chat("Write one sentence about the sea."),
    }
    max_new = 20
    ours, _ = run_scenario(runner, prompts, chunk_size=16, max_new_tokens=max_new)
    expected = hf_greedy(smollm2_dir, prompts, max_new)
    assert tok.decode(ours["a"], skip_special_tokens=True) == "The capital of France is Paris."
    for name in prompts:
        assert ours[name] == expected[name], (name, tok.decode(ours[name]))


@pytest.mark.parametrize("head_dim", [8, 64])
def test_interleaved_rope_equals_rotate_half_on_permuted_rows(head_dim: int) -> None:
    gen = torch.Generator().manual_seed(head_dim)
    num_heads, hidden, num_tokens = 3, 16, 5
    weight = torch.randn(num_heads * head_dim, hidden, generator=gen)
    x = torch.randn(num_tokens, hidden, generator=gen)
    positions = torch.tensor([0, 1, 7, 30, 99])
    cos, sin = ref.rope_cos_sin(ref.rope_inv_freq(head_dim, 10000.0), 100)
    plain = (x @ weight.T).view(num_tokens, num_heads, head_dim)
    want = ref.apply_rope(plain, cos[positions][:, None], sin[positions][:, None])
    permuted = (x @ ref.interleave_rope_rows(weight, head_dim).T).view(
        num_tokens, num_heads, head_dim
    )
    rope = torch.complex(cos, sin)[positions][:, None]
    got = ref.apply_rope_interleaved(permuted, rope)
    # Same values, pair-interleaved: undo the permutation on the output rows.
    half = head_dim // 2
    unpermuted = torch.cat((got[..., 0::2], got[..., 1::2]), dim=-1)
    torch.testing.assert_close(unpermuted, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(permuted, plain)  # the rows really moved
    assert unpermuted.shape == (num_tokens, num_heads, 2 * half)


def test_interleaved_rope_rotates_half_precision_in_float32() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 2, 16, generator=gen)
    cos, sin = ref.rope_cos_sin(ref.rope_inv_freq(16, 10000.0), 4)
    rope = torch.complex(cos, sin)[:, None]
    want = ref.apply_rope_interleaved(x, rope)
    got = ref.apply_rope_interleaved(x.to(torch.bfloat16), rope)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
