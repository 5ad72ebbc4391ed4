"""Paged KV cache accounting: fixed-size blocks, block tables, ref counts, prefix cache.

Token i of a request lives in slot `block_ids[i // block_size] * block_size + i % block_size`
of the KV cache, where `block_ids` is the request's block table (`Request.block_ids`).

Prefix cache. Only FULL blocks are cached, under a key chained over the blocks before them:
key(j) = sha256(key(j - 1), salt, adapter id, token ids of block j). A hit on block j therefore
implies the whole prefix up to j matches, for the same tenant salt and the same adapter.

NOTE: registration rule. A block is registered in the cache by the `allocate_slots` call that
makes it full, i.e. in the step that writes its KV. The model writes the KV of every scheduled
token of a layer before any attention of that layer reads, so a request admitted later in the
same step may already hit it. The price: between `schedule()` and the forward, a request that
registered blocks must not leave them behind when it is freed before the forward ran. `free`
forgets any block the request had not finished computing (index >= num_computed_tokens //
block_size), which covers a request preempted after it was scheduled in the same step, and an
engine that aborts every request of a step whose forward failed.

NOTE: free list policy. Blocks with ref count 0 sit in one list; allocation takes from the
head. A freed block that holds no cached content goes to the head (nothing is lost by reusing
it first); a freed cached block goes to the tail, so cached blocks are evicted least recently
freed first. A request frees its blocks in reverse order, so a sequence's tail blocks are
evicted before its head blocks, which more requests share. A cache hit on a free block takes
it back out of the list; a cached block taken for reuse loses its key (evicted).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from engine.core.state import Request


def block_key(
    parent: bytes | None, salt: str | None, adapter_id: str | None, token_ids: Sequence[int]
) -> bytes:
    """Prefix-cache key of one full block, chained to the key of the block before it.

    NOTE: SHA-256, not Python's `hash()`: a collision would hand one tenant's KV to another, and
    `hash()` of ints is neither randomized nor collision resistant, so a crafted prompt could
    collide on purpose. The repr of the tuple is unambiguous (strings are quoted, None is not a
    string), and the parent key has a fixed length, so distinct inputs give distinct messages.
    """
    digest = hashlib.sha256(parent if parent is not None else b"")
    digest.update(repr((salt, adapter_id, tuple(token_ids))).encode())
    return digest.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._block_keys: list[bytes | None] = [None] * num_blocks
        self._block_adapters: list[str | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}  # key -> block id
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # Keys of a request's full blocks, kept while it lives: tokens are only ever appended,
        # so the chain only grows, and a request waiting for several steps hashes once.
        self._request_keys: dict[str, list[bytes]] = {}
        # Prefix-cache statistics, in tokens, counted once per admission.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- read-only views -------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, cached ones included (they are evictable)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, 0..1."""
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def num_token_slots(self) -> int:
        """Tokens the whole cache holds; one sequence can never grow past this."""
        return self.num_blocks * self.block_size

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def is_cached(self, block_id: int) -> bool:
        return self._block_keys[block_id] is not None

    def free_block_ids(self) -> list[int]:
        """Free blocks in allocation order (head first)."""
        return list(self._free)

    def slot(self, request: Request, index: int) -> int:
        """KV-cache slot of token `index` of `request`."""
        block_id = request.block_ids[index // self.block_size]
        return block_id * self.block_size + index % self.block_size

    # ---- the scheduler's calls ------------------------------------------------------

    def get_computed_tokens(self, request: Request) -> int:
        """Prefix-cache hit length, in tokens, for a request that holds no blocks.

        A multiple of block_size and always < request.num_tokens: the last token is recomputed
        even for a fully cached prompt, since its logits are needed. Side effect: only the
        request's key chain is memoized; blocks, ref counts and statistics are untouched.
        """
        assert not request.block_ids, f"{request.request_id} already holds blocks"
        # NOTE: prompt logprobs come from the prefill's logits: every prompt token is
        # computed (its blocks are still cached for the requests after it).
        if not self.enable_prefix_caching or request.sampling.prompt_logprobs is not None:
            return 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        num_hits = 0
        for key in self._keys(request, max_blocks):
            if key not in self._cached:
                break
            num_hits += 1
        return num_hits * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, *, num_cached_tokens: int = 0
    ) -> bool:
        """Grow `request.block_ids` to cover num_computed_tokens + num_cached_tokens +
        num_new_tokens tokens; False (and nothing changed) if free blocks are short.

        `num_cached_tokens` is the value `get_computed_tokens` just returned, passed only for a
        request that holds no blocks; its cached blocks are adopted (shared, or revived from the
        free list). The caller then sets `request.num_computed_tokens` to it.
        """
        assert num_new_tokens >= 1, num_new_tokens
        bs = self.block_size
        is_fresh = not request.block_ids
        if is_fresh:
            assert request.num_computed_tokens == 0, "a request without blocks has no KV"
        else:
            assert num_cached_tokens == 0, "cache hits are adopted only at admission"
        assert num_cached_tokens % bs == 0, num_cached_tokens
        num_known = request.num_computed_tokens + num_cached_tokens
        num_covered = num_known + num_new_tokens
        assert num_covered <= request.num_tokens, (num_covered, request.num_tokens)

        hit_blocks: list[int] = []
        if num_cached_tokens:
            assert self.enable_prefix_caching
            keys = self._keys(request, num_cached_tokens // bs)
            hit_blocks = [self._cached[key] for key in keys]
        num_needed = -(-num_covered // bs) - len(request.block_ids) - len(hit_blocks)
        num_revived = sum(1 for b in hit_blocks if self._ref_counts[b] == 0)
        if num_needed > len(self._free) - num_revived:
            return False

        for block_id in hit_blocks:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1
        request.block_ids.extend(hit_blocks)
        for _ in range(max(num_needed, 0)):
            request.block_ids.append(self._take_free_block())

        if self.enable_prefix_caching:
            if is_fresh:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_cached_tokens
            self._register_full_blocks(request, num_known // bs, num_covered // bs)
        return True

    def filled_slots(self, requests: Iterable[Request]) -> int:
        """Slots assigned to a token (its KV written, or being written by the step in
        progress) in the blocks `requests` hold; a shared block counts once. Against the
        slots of the blocks in use, what paging wastes: the unused tail of each
        sequence's last block."""
        bs = self.block_size
        filled: dict[int, int] = {}
        for request in requests:
            num_known = request.num_tokens
            for index, block_id in enumerate(list(request.block_ids)):
                num = min(bs, max(0, num_known - index * bs))
                filled[block_id] = max(filled.get(block_id, 0), num)
        return sum(filled.values())

    def free(self, request: Request) -> None:
        """Drop the request's hold on its blocks (tail first) and empty its block table.

        Also fine for a request that holds no blocks (it drops the memoized key chain)."""
        num_written_blocks = request.num_computed_tokens // self.block_size
        for index in range(len(request.block_ids) - 1, -1, -1):
            block_id = request.block_ids[index]
            assert self._ref_counts[block_id] > 0, block_id
            self._ref_counts[block_id] -= 1
            key = self._block_keys[block_id]
            if index >= num_written_blocks and key is not None:
                # Registered for KV this request never got to write. Another holder is
                # possible only when a failed step is torn down; it must not be hit again.
                self._forget(block_id)
                key = None
            if self._ref_counts[block_id] == 0:
                self._free[block_id] = None
                if key is None:
                    self._free.move_to_end(block_id, last=False)
        request.block_ids = []
        self._request_keys.pop(request.request_id, None)

    def forget_unwritten(self, request: Request) -> None:
        """Unregister the request's full blocks past its computed tokens: a step that was
        cut short registered them (at allocation) without writing them whole. The step that
        writes them registers them again."""
        for index in range(request.num_computed_tokens // self.block_size,
                           len(request.block_ids)):
            block_id = request.block_ids[index]
            if self._block_keys[block_id] is not None:
                self._forget(block_id)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False, nothing changed) while any block is held,
        since running requests would keep registering blocks and the reset would not be clean."""
        if len(self._free) != self.num_blocks:
            return False
        for block_id in list(self._cached.values()):
            self._forget(block_id)
        return True

    def drop_adapter(self, adapter_id: str) -> int:
        """Forget the cached blocks of one adapter (its weights changed); returns how many.

        Blocks held by running requests stay with them, they just can no longer be hit.
        """
        dropped = [b for b in self._cached.values() if self._block_adapters[b] == adapter_id]
        for block_id in dropped:
            self._forget(block_id)
            if block_id in self._free:
                self._free.move_to_end(block_id, last=False)
        return len(dropped)

    # ---- internals ------------------------------------------------------------------

    def _keys(self, request: Request, num_blocks: int) -> list[bytes]:
        """Keys of the request's first `num_blocks` (full) blocks."""
        assert num_blocks * self.block_size <= request.num_tokens
        keys = self._request_keys.setdefault(request.request_id, [])
        if len(keys) < num_blocks:
            tokens = request.all_token_ids
            bs = self.block_size
            for j in range(len(keys), num_blocks):
                parent = keys[j - 1] if j else None
                block_tokens = tokens[j * bs : (j + 1) * bs]
                keys.append(block_key(parent, request.salt, request.adapter_key, block_tokens))
        return keys[:num_blocks]

    def _register_full_blocks(self, request: Request, first: int, end: int) -> None:
        if end <= first:
            return
        keys = self._keys(request, end)
        for index in range(first, end):
            block_id = request.block_ids[index]
            if self._block_keys[block_id] is not None:
                # Registered by an earlier call of the same step (a chunk that grew).
                assert self._block_keys[block_id] == keys[index], block_id
                continue
            # NOTE: an equal block already cached (two requests computed the same prefix
            # side by side) stays the only entry; this copy is freed as uncached later.
            if keys[index] not in self._cached:
                self._cached[keys[index]] = block_id
                self._block_keys[block_id] = keys[index]
                self._block_adapters[block_id] = request.adapter_key

    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        if self._block_keys[block_id] is not None:
            self._forget(block_id)
        self._ref_counts[block_id] = 1
        return block_id

    def _forget(self, block_id: int) -> None:
        key = self._block_keys[block_id]
        assert key is not None and self._cached.get(key) == block_id, block_id
        del self._cached[key]
        self._block_keys[block_id] = None
        self._block_adapters[block_id] = None
