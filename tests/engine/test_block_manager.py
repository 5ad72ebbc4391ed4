"""BlockManager: block tables, ref counts, free-list order, prefix-cache hits and eviction."""

from __future__ import annotations

from typing import Any

import pytest

from engine.core.block_manager import BlockManager, block_key
from engine.core.state import Request
from tests.utils import factories


def make_request(*args: Any, adapter_key: str | None = None, **kwargs: Any) -> Request:
    """A request as the engine admits it: `adapter_key` is its adapter version's key."""
    request = factories.make_request(*args, **kwargs)
    request.adapter_key = adapter_key
    return request


BS = 4


def admit(bm: BlockManager, request: Request, num_new: int | None = None) -> int:
    """Admit like the scheduler does: look up the cache, allocate, take the hit; returns the hit."""
    num_hit = bm.get_computed_tokens(request)
    todo = request.num_tokens - num_hit if num_new is None else num_new
    assert bm.allocate_slots(request, todo, num_cached_tokens=num_hit)
    request.num_computed_tokens = num_hit
    return num_hit


def compute(request: Request, num_tokens: int | None = None) -> None:
    """What update_after_step does after the forward."""
    request.num_computed_tokens = (
        request.num_tokens if num_tokens is None else request.num_computed_tokens + num_tokens
    )


def test_allocate_block_table_slots_and_usage() -> None:
    bm = BlockManager(8, BS, True)
    a = make_request("a", 10)
    assert admit(bm, a) == 0
    assert a.block_ids == [0, 1, 2]
    assert [bm.ref_count(b) for b in range(4)] == [1, 1, 1, 0]
    assert bm.free_block_ids() == [3, 4, 5, 6, 7]
    assert bm.num_free_blocks == 5
    assert bm.usage == pytest.approx(3 / 8)
    assert [bm.slot(a, i) for i in (0, 3, 4, 9)] == [0, 3, 4, 9]
    # Only the two full blocks are cached; the partial third one is not.
    assert [bm.is_cached(b) for b in (0, 1, 2)] == [True, True, False]
    assert bm.num_cached_blocks == 2


def test_decode_growth_fills_then_adds_blocks() -> None:
    bm = BlockManager(8, BS, True)
    a = make_request("a", 10)
    admit(bm, a)
    compute(a)
    a.output_token_ids += [50, 51]  # 12 tokens: the third block is full once computed
    assert bm.allocate_slots(a, 2)
    assert a.block_ids == [0, 1, 2]
    assert bm.is_cached(2)
    compute(a)
    a.output_token_ids.append(52)
    assert bm.allocate_slots(a, 1)
    assert a.block_ids == [0, 1, 2, 3]
    assert bm.slot(a, 12) == 12
    assert not bm.is_cached(3)
    # Growth is no prefix-cache query: only the admission counted.
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (10, 0)


def test_prefix_hit_shares_blocks_and_counts_tokens() -> None:
    bm = BlockManager(8, BS, True)
    a = make_request("a", 10)
    b = make_request("b", 10)
    admit(bm, a)
    compute(a)
    assert admit(bm, b) == 8
    assert b.block_ids == [0, 1, 3]
    assert [bm.ref_count(x) for x in (0, 1, 2, 3)] == [2, 2, 1, 1]
    assert bm.prefix_cache_queries == 20
    assert bm.prefix_cache_hits == 8
    compute(b)
    bm.free(a)
    assert [bm.ref_count(x) for x in (0, 1, 2, 3)] == [1, 1, 0, 1]
    assert bm.free_block_ids() == [2, 4, 5, 6, 7]
    bm.free(b)
    assert bm.num_free_blocks == 8
    assert b.block_ids == []


def test_same_block_content_at_another_position_is_no_hit() -> None:
    bm = BlockManager(8, BS, True)
    a = make_request("a", [0, 1, 2, 3, 4, 5, 6, 7, 8])
    admit(bm, a)
    b = make_request("b", [9, 9, 9, 9, 4, 5, 6, 7, 8])
    assert bm.get_computed_tokens(b) == 0


def test_fully_cached_prompt_recomputes_its_last_token() -> None:
    bm = BlockManager(8, BS, True)
    a = make_request("a", 8)
    admit(bm, a)
    compute(a)
    assert a.block_ids == [0, 1]
    b = make_request("b", 8)
    # Both blocks are cached, but the last token must be computed: only one block hits.
    assert admit(bm, b) == 4
    assert b.block_ids == [0, 2]
    # Block 2 holds the same tokens as block 1: the cache keeps block 1 as the only entry.
    assert not bm.is_cached(2)
    c = make_request("c", 9)
    assert admit(bm, c) == 8
    assert c.block_ids == [0, 1, 3]


@pytest.mark.parametrize(
    ("salt_b", "adapter_b", "hit"),
    [("t1", "x", 8), ("t2", "x", 0), (None, "x", 0), ("t1", "y", 0), ("t1", None, 0)],
)
def test_salt_and_adapter_are_part_of_the_key(
    salt_b: str | None, adapter_b: str | None, hit: int
) -> None:
    bm = BlockManager(8, BS, True)
    a = make_request("a", 10, salt="t1", adapter_key="x")
    admit(bm, a)
    compute(a)
    b = make_request("b", 10, salt=salt_b, adapter_key=adapter_b)
    assert bm.get_computed_tokens(b) == hit


def test_block_key_is_stable_and_separates_inputs() -> None:
    k = block_key(None, "s", None, [1, 2, 3, 4])
    assert k == block_key(None, "s", None, (1, 2, 3, 4))
    assert len(k) == 32
    assert k != block_key(None, "s", "None", [1, 2, 3, 4])
    assert k != block_key(None, None, None, [1, 2, 3, 4])
    assert block_key(k, "s", None, [5]) != block_key(None, "s", None, [5])


def test_free_order_and_lru_eviction_of_cached_blocks() -> None:
    bm = BlockManager(6, BS, True)
    a = make_request("a", 10)
    admit(bm, a)
    compute(a)
    bm.free(a)
    # Reverse order: the uncached tail block 2 goes to the head (reused first), then the
    # cached blocks 1 and 0 go to the tail, so block 1 (the sequence's tail) is evicted first.
    assert bm.free_block_ids() == [2, 3, 4, 5, 1, 0]
    b = make_request("b", 13, first_token=100)
    admit(bm, b)
    compute(b)
    assert b.block_ids == [2, 3, 4, 5]
    assert [bm.is_cached(x) for x in (0, 1)] == [True, True]
    c = make_request("c", 3, first_token=200)
    admit(bm, c)
    assert c.block_ids == [1]  # evicted: it loses a's key
    assert [bm.is_cached(x) for x in (0, 1)] == [True, False]
    assert bm.free_block_ids() == [0]
    a2 = make_request("a2", 10)
    assert bm.get_computed_tokens(a2) == 4  # a's first block survived, its second did not


def test_hit_on_free_block_revives_it_and_counts_it_as_taken() -> None:
    bm = BlockManager(3, BS, True)
    a = make_request("a", 9)
    admit(bm, a)
    compute(a)
    bm.free(a)
    assert bm.free_block_ids() == [2, 1, 0]
    # 13 tokens: hits blocks 0 and 1 (both free) and needs 2 more, but only 1 is left.
    too_big = make_request("big", [*range(8), 90, 91, 92, 93, 94])
    assert bm.get_computed_tokens(too_big) == 8
    assert not bm.allocate_slots(too_big, 5, num_cached_tokens=8)
    assert too_big.block_ids == []
    assert bm.free_block_ids() == [2, 1, 0]
    assert [bm.ref_count(x) for x in range(3)] == [0, 0, 0]
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (9, 0)
    b = make_request("b", 9)
    assert admit(bm, b) == 8
    assert b.block_ids == [0, 1, 2]
    assert bm.free_block_ids() == []
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (18, 8)


def test_failed_growth_changes_nothing() -> None:
    bm = BlockManager(2, BS, True)
    a = make_request("a", 8)
    admit(bm, a)
    compute(a)
    a.output_token_ids.append(7)
    assert not bm.allocate_slots(a, 1)
    assert a.block_ids == [0, 1]
    assert [bm.ref_count(x) for x in range(2)] == [1, 1]
    assert bm.num_free_blocks == 0


def test_free_forgets_blocks_whose_kv_was_never_written() -> None:
    bm = BlockManager(4, BS, True)
    a = make_request("a", 8)
    admit(bm, a)
    assert bm.num_cached_blocks == 2
    compute(a, 4)  # only the first block was computed before the request went away
    bm.free(a)
    assert bm.num_cached_blocks == 1
    assert [bm.is_cached(x) for x in (0, 1)] == [True, False]
    assert bm.free_block_ids() == [1, 2, 3, 0]
    assert bm.get_computed_tokens(make_request("b", 8)) == 4


def test_drop_adapter_forgets_only_that_adapter() -> None:
    bm = BlockManager(8, BS, True)
    x = make_request("x", 8, adapter_key="x")
    y = make_request("y", 8, adapter_key="y")
    admit(bm, x)
    admit(bm, y)
    compute(x)
    compute(y)
    bm.free(x)
    assert bm.free_block_ids() == [4, 5, 6, 7, 1, 0]
    assert bm.drop_adapter("x") == 2
    # Forgotten free blocks hold nothing now: they move to the head, to be reused first.
    assert bm.free_block_ids() == [1, 0, 4, 5, 6, 7]
    assert bm.get_computed_tokens(make_request("x2", 8, adapter_key="x")) == 0
    assert bm.get_computed_tokens(make_request("y2", 8, adapter_key="y")) == 4
    assert bm.drop_adapter("y") == 2  # held by y: no longer hit, still held
    assert y.block_ids == [2, 3]
    assert bm.num_cached_blocks == 0


def test_reset_prefix_cache_refused_while_blocks_are_held() -> None:
    bm = BlockManager(4, BS, True)
    a = make_request("a", 8)
    admit(bm, a)
    compute(a)
    assert not bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 2
    bm.free(a)
    assert bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0
    assert bm.get_computed_tokens(make_request("b", 8)) == 0
    assert bm.num_free_blocks == 4


def test_prefix_caching_disabled() -> None:
    bm = BlockManager(4, BS, False)
    a = make_request("a", 8)
    admit(bm, a)
    compute(a)
    assert bm.num_cached_blocks == 0
    assert bm.get_computed_tokens(make_request("b", 8)) == 0
    bm.free(a)
    # Uncached blocks go to the head as they are freed (tail first): LIFO reuse.
    assert bm.free_block_ids() == [0, 1, 2, 3]
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (0, 0)


def test_constructor_rejects_empty_cache() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, BS, True)


def test_tearing_down_a_failed_step_forgets_blocks_shared_before_written() -> None:
    bm = BlockManager(8, BS, True)
    a = make_request("a", 10)
    b = make_request("b", 10)
    admit(bm, a)
    assert admit(bm, b) == 8  # same-step hit on blocks whose KV the forward will write
    # The forward failed: nothing was computed, both requests are dropped.
    bm.free(a)
    assert [bm.is_cached(x) for x in (0, 1)] == [False, False]
    bm.free(b)
    assert bm.num_free_blocks == 8
    assert bm.num_cached_blocks == 0
    assert bm.get_computed_tokens(make_request("c", 10)) == 0


def test_filled_slots_count_computed_kv_once_per_block() -> None:
    bm = BlockManager(16, BS, True)
    a = make_request("a", 10, max_tokens=4)
    admit(bm, a)
    assert bm.filled_slots([a]) == 10  # blocks of 4, 4 and 2 of 4, being computed
    compute(a)
    assert bm.filled_slots([a]) == 10
    b = make_request("b", [*a.prompt_token_ids[:8], 77, 78, 79], max_tokens=4)
    assert admit(bm, b) == 8  # shares a's two full blocks
    compute(b)
    assert bm.filled_slots([a, b]) == 10 + 3  # the shared blocks once
    a.output_token_ids.append(7)  # sampled; its KV is written by the next step
    assert bm.filled_slots([a, b]) == 11 + 3
    assert (bm.num_blocks - bm.num_free_blocks) * BS == 16  # 4 blocks held


def test_a_chunk_that_grows_in_its_step_registers_each_block_once() -> None:
    bm = BlockManager(16, BS, True)
    a = make_request("a", 20)
    assert bm.allocate_slots(a, 6)
    assert bm.num_cached_blocks == 1
    assert bm.allocate_slots(a, 13)  # the same step's chunk, grown: blocks 1 and 2 too
    assert bm.num_cached_blocks == 3 and len(a.block_ids) == 4
    b = make_request("b", [*a.prompt_token_ids[:12], 5], max_tokens=2)
    assert bm.get_computed_tokens(b) == 12
