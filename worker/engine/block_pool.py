"""KV-cache blocks as plain ints: a free list, reference counts and a prefix cache with LRU eviction.

Every block is in exactly one state:
    free        ref 0, no hash; in `_free_block_ids`.
    evictable   ref 0, hashed (holds a full block of known tokens); in `_evictable`, oldest first.
    referenced  ref > 0, hashed or not; held by exactly `ref` request block tables.
Blocks have one size and any block serves any position, so there is no fragmentation: a request holding
`n` tokens needs exactly ceil(n / block_size) blocks, wherever they are.

Prefix caching: the key of a full block is sha256(parent block's key + the block's token ids), so one key
names the whole prefix up to the block's end. The first block's parent key is the request's cache salt
(salt_key: empty for the shared namespace), so requests of different tenants or salts never share a block.
A 256-bit hash makes collisions negligible, so the tokens are not stored. Keys cover output tokens too, so a
preempted request finds its own blocks again on resume.

Sliding windows (`kv_window`, set when every layer of the model has one): a query at position p reads keys in
(p - window, p] only, so once a request has computed n tokens no later query reads a key before n - window + 1.
Its blocks wholly before that are given back as it goes (`free_outside_window`) and their block-table entries
become FREED_BLOCK, so a long generation holds about window / block_size + 1 blocks. A keyed block given back
stays in the prefix cache (evictable) for other requests: its key names the whole prefix up to its end, whoever
computed it. For the same reason a prefix hit on such a model needs only the blocks the next query's window
reaches (`get_computed_blocks`); the entries before them start the table as FREED_BLOCK.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Sequence

from worker.engine.request import MAX_DRAFT_TOKENS, Request


FREED_BLOCK = -1
"""A block-table entry whose block went back to the pool because no layer's window reaches it any more. Never a
block id: attention must not read it (worker/model/torch_attention.py gathers only from a window's first block)."""


def salt_key(cache_salt: str | None, adapter: str | None = None) -> bytes:
    """The parent key of a request's first block: b"" for the shared namespace of the base model, else a key of
    the salt and the adapter, so the same tokens under two salts never share a block (a tenant cannot time
    another's prompts), nor under two LoRA adapters (their K/V differ: an adapter changes q, k and v)."""
    if cache_salt is None and adapter is None:
        return b""
    key = b"salt\0" + (cache_salt or "").encode("utf-8", "surrogatepass")
    if adapter is not None:
        key += b"\0adapter\0" + adapter.encode("utf-8", "surrogatepass")
    return hashlib.sha256(key).digest()


def hash_block(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """Prefix-cache key of a full block: chained over the parent's key (b"" for the first block)."""
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 kv_window: int | None = None) -> None:
        assert num_blocks >= 1 and block_size >= 1, (num_blocks, block_size)
        assert kv_window is None or kv_window >= 1, kv_window
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.kv_window = kv_window
        """The widest layer window when every layer has one: blocks before it are given back. None: kept."""
        self._ref_counts = [0] * num_blocks
        self._block_hashes: list[bytes | None] = [None] * num_blocks
        self._hash_to_block_id: dict[bytes, int] = {}
        self._free_block_ids: deque[int] = deque(range(num_blocks))
        # Insertion order is LRU order: the first key is evicted first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        # Per request: how many leading blocks of its table were already offered to the cache.
        self._num_hashed_blocks: dict[str, int] = {}
        self.num_queried_tokens = 0
        """Tokens looked up in the prefix cache at admissions, resumes after preemption included."""
        self.num_hit_tokens = 0
        """Tokens of those lookups found in the cache."""
        self.num_evictions = 0
        self.num_window_freed = 0
        """Blocks given back by requests because no layer's window reached them any more."""

    # ---- counters -----------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: free ones plus evictable cached ones."""
        return len(self._free_block_ids) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with a prefix-cache key, referenced or evictable."""
        return len(self._hash_to_block_id)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests (evictable cached blocks count as free)."""
        return self.num_used_blocks / self.num_blocks

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def evictable_block_ids(self) -> list[int]:
        """Evictable blocks, the next one to be evicted first."""
        return list(self._evictable)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_blocks_outside_window(self, num_computed_tokens: int) -> int:
        """Leading blocks that no query at a position >= num_computed_tokens reads (0 without kv_window)."""
        if self.kv_window is None:
            return 0
        return max(0, num_computed_tokens - self.kv_window + 1) // self.block_size

    # ---- the request-facing API ---------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> list[int]:
        """Cached blocks holding a prefix of the request's tokens, in order. Changes nothing.

        At most num_tokens - 1 tokens are matched: the step must compute at least the last token so that the
        model produces logits for the next one. Only full blocks are ever cached.
        """
        assert not request.block_ids and request.num_computed_tokens == 0, request.request_id
        if not self.enable_caching:
            return []
        max_num_blocks = (request.num_tokens - 1) // self.block_size
        lookup = self._hash_to_block_id.get
        block_ids: list[int] = []
        if self.kv_window is None:
            for i in range(max_num_blocks):
                block_id = lookup(self._block_hash(request, i))
                if block_id is None:
                    break
                block_ids.append(block_id)
            return block_ids
        # Windowed: a hit of m blocks needs only blocks [outside, m) cached, outside = what its next query's
        # window leaves out. A block's key covers the whole prefix, so a run of cached blocks past a miss is
        # still the request's own prefix. The longest such hit wins (it resumes a long preempted generation
        # from its window instead of from the start).
        best = run_start = 0
        for i in range(max_num_blocks):
            block_id = lookup(self._block_hash(request, i))
            block_ids.append(block_id)
            if block_id is None:
                run_start = i + 1
            elif run_start <= self.num_blocks_outside_window((i + 1) * self.block_size):
                best = i + 1
        outside = self.num_blocks_outside_window(best * self.block_size)
        return [FREED_BLOCK] * outside + block_ids[outside:best]

    def allocate_for(self, request: Request, num_new_tokens: int, computed_block_ids: Sequence[int] = (),
                     num_draft: int = 0) -> bool:
        """Grow request.block_ids to hold num_scheduled_tokens + num_new_tokens tokens.

        `computed_block_ids` (from get_computed_blocks, only while the request holds no blocks) go first and
        their tokens count as computed (this sets num_computed_tokens); FREED_BLOCK entries among them (leading
        ones only) take no block. `num_draft`: the last of the new tokens are speculative, past the known ones.
        Returns False, touching nothing, when too few blocks are free.
        """
        assert num_new_tokens >= 1, num_new_tokens
        if not computed_block_ids:  # the common case, a running request: often its blocks already hold it
            num_total_tokens = request.num_computed_tokens + request.num_inflight_tokens + num_new_tokens
            if num_total_tokens <= len(request.block_ids) * self.block_size:
                assert num_total_tokens <= request.num_known_tokens + num_draft, request.request_id
                return True
        admitting = not request.block_ids
        if computed_block_ids:
            assert admitting and request.num_computed_tokens == 0, request.request_id
        num_cached_tokens = len(computed_block_ids) * self.block_size
        num_total_tokens = request.num_scheduled_tokens + num_cached_tokens + num_new_tokens
        assert num_total_tokens <= request.num_known_tokens + num_draft, (request.request_id, num_total_tokens,
                                                                          request.num_known_tokens)
        num_held = len(request.block_ids) + len(computed_block_ids)
        num_new_blocks = max(0, self.num_blocks_for(num_total_tokens) - num_held)
        # Reviving an evictable hit takes it out of the free count just like a fresh block does.
        num_revived = sum(1 for block_id in computed_block_ids if block_id != FREED_BLOCK
                          and self._ref_counts[block_id] == 0)
        if num_new_blocks + num_revived > self.num_free_blocks:
            return False

        if admitting and self.enable_caching:
            self.num_queried_tokens += request.num_tokens
            self.num_hit_tokens += num_cached_tokens
        num_freed = 0
        for block_id in computed_block_ids:
            if block_id == FREED_BLOCK:
                num_freed += 1
            else:
                self._touch(block_id)
        if computed_block_ids:
            request.block_ids.extend(computed_block_ids)
            request.num_freed_blocks = num_freed
            request.num_computed_tokens = num_cached_tokens
            self._num_hashed_blocks[request.request_id] = len(computed_block_ids)
        for _ in range(num_new_blocks):
            request.block_ids.append(self._take_free_block())
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Give a key to each full block whose tokens are all computed, so later requests can share it."""
        if not self.enable_caching:
            return
        num_full_blocks = request.num_computed_tokens // self.block_size
        assert num_full_blocks <= len(request.block_ids), request.request_id
        # Entries given back before they were keyed (the window outran the cache) are gone for the cache.
        start = max(self._num_hashed_blocks.get(request.request_id, 0), request.num_freed_blocks)
        for i in range(start, num_full_blocks):
            block_id = request.block_ids[i]
            assert self._block_hashes[block_id] is None, (request.request_id, i, block_id)
            block_hash = self._block_hash(request, i)
            if block_hash in self._hash_to_block_id:
                # Another request computed the same prefix in the same steps; keep the first copy. This one
                # stays unkeyed and returns to the free list when released.
                continue
            self._block_hashes[block_id] = block_hash
            self._hash_to_block_id[block_hash] = block_id
        self._num_hashed_blocks[request.request_id] = max(start, num_full_blocks)

    def free(self, request: Request) -> None:
        """Release the request's blocks. Keyed ones become evictable, tail first so they are evicted first
        (a prompt's head is the part most likely shared)."""
        for block_id in reversed(request.block_ids):
            if block_id != FREED_BLOCK:
                self._release(block_id)
        request.block_ids.clear()
        request.num_freed_blocks = 0
        self._num_hashed_blocks.pop(request.request_id, None)

    def free_outside_window(self, request: Request) -> int:
        """Give back the request's blocks that no later query reads (kv_window), oldest first; their entries
        become FREED_BLOCK. Call after cache_full_blocks, so that a full block is keyed before it goes: it then
        stays in the prefix cache. Returns the number given back."""
        num_outside = self.num_blocks_outside_window(request.num_computed_tokens)
        start = request.num_freed_blocks
        if num_outside <= start:
            return 0
        block_ids = request.block_ids
        for i in range(start, num_outside):
            self._release(block_ids[i])
            block_ids[i] = FREED_BLOCK
        request.num_freed_blocks = num_outside
        self.num_window_freed += num_outside - start
        return num_outside - start

    def check_invariants(self, requests: Iterable[Request]) -> None:
        """`requests`: every request holding blocks. Raises AssertionError on any broken invariant."""
        requests = list(requests)
        holders = Counter(block_id for request in requests for block_id in request.block_ids
                          if block_id != FREED_BLOCK)
        free_block_ids = set(self._free_block_ids)
        assert len(free_block_ids) == len(self._free_block_ids), "a block is on the free list twice"
        assert not free_block_ids & set(self._evictable), "a block is both free and evictable"
        assert all(0 <= block_id < self.num_blocks for block_id in holders), "a block id out of range"
        num_hashed = 0
        for block_id in range(self.num_blocks):
            ref = self._ref_counts[block_id]
            block_hash = self._block_hashes[block_id]
            assert ref == holders.get(block_id, 0), (block_id, ref, holders.get(block_id, 0))
            is_free = block_id in free_block_ids
            is_evictable = block_id in self._evictable
            assert is_free + is_evictable + (ref > 0) == 1, (block_id, is_free, is_evictable, ref)
            assert not is_free or block_hash is None, block_id
            assert not is_evictable or block_hash is not None, block_id
            if block_hash is not None:
                num_hashed += 1
                assert self._hash_to_block_id.get(block_hash) == block_id, block_id
        assert num_hashed == len(self._hash_to_block_id)
        assert self.enable_caching or num_hashed == 0
        for request in requests:
            num_freed = request.num_freed_blocks
            live = request.block_ids[num_freed:]
            assert request.block_ids[:num_freed] == [FREED_BLOCK] * num_freed, request.request_id
            assert FREED_BLOCK not in live and len(set(live)) == len(live), request.request_id
            # Nothing given back that a query yet to run reads: the next one is at num_computed_tokens.
            assert num_freed <= self.num_blocks_outside_window(request.num_computed_tokens), request.request_id
            assert len(request.block_ids) >= self.num_blocks_for(request.num_computed_tokens), request.request_id
            # Blocks written by a step's rejected drafts stay with the request for its next steps.
            assert len(request.block_ids) <= self.num_blocks_for(request.num_tokens + MAX_DRAFT_TOKENS), (
                request.request_id)

    # ---- internals ----------------------------------------------------------------------------------

    def _block_hash(self, request: Request, index: int) -> bytes:
        """Key of the request's block `index` (must be full); extends request.block_hashes as needed."""
        hashes = request.block_hashes
        while len(hashes) <= index:
            i = len(hashes)
            token_ids = request.token_slice(i * self.block_size, (i + 1) * self.block_size)
            assert len(token_ids) == self.block_size, (request.request_id, i)
            hashes.append(hash_block(hashes[-1] if hashes else request.cache_salt, token_ids))
        return hashes[index]

    def _release(self, block_id: int) -> None:
        self._ref_counts[block_id] -= 1
        assert self._ref_counts[block_id] >= 0, block_id
        if self._ref_counts[block_id] == 0:
            if self._block_hashes[block_id] is None:
                self._free_block_ids.append(block_id)
            else:
                self._evictable[block_id] = None

    def _touch(self, block_id: int) -> None:
        if self._ref_counts[block_id] == 0:
            del self._evictable[block_id]
        self._ref_counts[block_id] += 1

    def _take_free_block(self) -> int:
        if self._free_block_ids:
            block_id = self._free_block_ids.popleft()
        else:
            block_id, _ = self._evictable.popitem(last=False)
            block_hash = self._block_hashes[block_id]
            assert block_hash is not None
            del self._hash_to_block_id[block_hash]
            self._block_hashes[block_id] = None
            self.num_evictions += 1
        assert self._ref_counts[block_id] == 0, block_id
        self._ref_counts[block_id] = 1
        return block_id
