import pytest

from worker.engine.block_pool import FREED_BLOCK, BlockPool, hash_block, salt_key
from worker.engine.request import Request

BS = 4


def req(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, list(token_ids))


def compute_all(pool: BlockPool, request: Request) -> None:
    """Admit with prefix hits, compute every token in one go, offer the full blocks to the cache."""
    computed = pool.get_computed_blocks(request)
    num_new = request.num_tokens - len(computed) * BS
    assert pool.allocate_for(request, num_new, computed)
    request.num_computed_tokens += num_new
    pool.cache_full_blocks(request)


def test_allocate_grows_to_exact_block_count_and_free_returns_all():
    pool = BlockPool(num_blocks=8, block_size=BS)
    request = req("a", range(10))
    assert pool.allocate_for(request, 5)
    assert request.block_ids == [0, 1]
    request.num_computed_tokens = 5
    assert pool.allocate_for(request, 5)  # tokens 5..9 -> 3 blocks in all
    assert request.block_ids == [0, 1, 2]
    assert pool.num_used_blocks == 3 and pool.usage == pytest.approx(3 / 8)
    pool.check_invariants([request])
    pool.free(request)
    assert request.block_ids == [] and pool.num_free_blocks == 8 and pool.usage == 0.0
    pool.check_invariants([])


def test_allocate_failure_changes_nothing():
    pool = BlockPool(num_blocks=4, block_size=BS)
    a, b = req("a", range(12)), req("b", range(100, 108))
    assert pool.allocate_for(a, 12)
    assert not pool.allocate_for(b, 8)  # needs 2, 1 free
    assert b.block_ids == [] and pool.num_free_blocks == 1
    pool.check_invariants([a, b])
    assert pool.allocate_for(b, 4)


def test_shared_prefix_reuses_full_blocks_by_ref_count():
    pool = BlockPool(num_blocks=16, block_size=BS)
    a = req("a", range(10))  # blocks [0..3] [4..7] full, [8, 9] partial
    compute_all(pool, a)
    assert pool.num_cached_blocks == 2
    b = req("b", list(range(9)) + [77, 78])  # shares 9 tokens: 2 full blocks
    computed = pool.get_computed_blocks(b)
    assert computed == a.block_ids[:2]
    assert pool.allocate_for(b, b.num_tokens - 8, computed)
    assert b.num_computed_tokens == 8
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert [pool.ref_count(block_id) for block_id in b.block_ids] == [2, 2, 1]
    assert (pool.num_queried_tokens, pool.num_hit_tokens) == (10 + 11, 8)
    assert pool.hit_rate == pytest.approx(8 / 21)
    pool.check_invariants([a, b])


def test_partial_block_is_never_shared():
    pool = BlockPool(num_blocks=16, block_size=BS)
    compute_all(pool, req("a", range(6)))
    assert pool.get_computed_blocks(req("b", range(7))) != []  # the full first block only
    assert len(pool.get_computed_blocks(req("c", range(7)))) == 1


def test_whole_prompt_cached_still_computes_the_last_block():
    pool = BlockPool(num_blocks=16, block_size=BS)
    a = req("a", range(8))
    compute_all(pool, a)
    assert pool.num_cached_blocks == 2
    b = req("b", range(8))
    computed = pool.get_computed_blocks(b)
    assert computed == a.block_ids[:1]  # at most num_tokens - 1 tokens: the block with the last token is left
    assert pool.allocate_for(b, 4, computed)
    assert b.num_computed_tokens == 4 and b.block_ids[1] != a.block_ids[1]


def test_hash_is_chained_over_the_parent():
    pool = BlockPool(num_blocks=16, block_size=BS)
    compute_all(pool, req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Same second block, different first block: no hit for the second either.
    assert pool.get_computed_blocks(req("b", [9, 9, 9, 9, 5, 6, 7, 8, 9])) == []
    assert hash_block(b"", [5, 6, 7, 8]) != hash_block(hash_block(b"", [1, 2, 3, 4]), [5, 6, 7, 8])
    assert hash_block(b"", [1, 2]) == hash_block(b"", [1, 2])


def test_freed_cached_blocks_are_evicted_oldest_first_tail_first():
    pool = BlockPool(num_blocks=6, block_size=BS)
    a, b = req("a", range(9)), req("b", range(100, 109))
    compute_all(pool, a)
    compute_all(pool, b)
    a_full, b_full = a.block_ids[:2], b.block_ids[:2]
    pool.free(a)
    pool.free(b)
    # a before b; within a request the tail block first (its head is what others share).
    assert pool.evictable_block_ids() == [a_full[1], a_full[0], b_full[1], b_full[0]]
    assert pool.num_free_blocks == 6 and pool.usage == 0.0
    c = req("c", range(200, 216))
    assert pool.allocate_for(c, 16)  # 4 blocks: the 2 plain free ones, then a's two cached ones
    assert pool.num_evictions == 2 and pool.evictable_block_ids() == [b_full[1], b_full[0]]
    assert pool.get_computed_blocks(req("a2", range(9))) == []
    assert pool.get_computed_blocks(req("b2", range(100, 109))) == b_full
    pool.check_invariants([c])


def test_reviving_an_evictable_hit_counts_against_free_blocks():
    pool = BlockPool(num_blocks=3, block_size=BS)
    a = req("a", range(9))
    compute_all(pool, a)  # 3 blocks, 2 cached
    pool.free(a)
    b = req("b", range(9))
    computed = pool.get_computed_blocks(b)
    assert len(computed) == 2
    holder = req("h", range(50, 54))
    assert pool.allocate_for(holder, 4)  # takes the only plain free block
    # b needs its 2 hits revived plus 1 new block, but only the 2 evictable blocks are left.
    assert not pool.allocate_for(b, 1, computed)
    assert b.block_ids == [] and pool.num_evictable_blocks == 2
    pool.check_invariants([holder, b])
    pool.free(holder)
    assert pool.allocate_for(b, 1, computed)
    pool.check_invariants([b])


def test_a_hit_on_a_referenced_block_needs_no_free_block():
    pool = BlockPool(num_blocks=3, block_size=BS)
    a = req("a", range(8))
    compute_all(pool, a)  # 2 blocks, both cached and held
    b = req("b", list(range(4)) + [9])
    computed = pool.get_computed_blocks(b)
    assert computed == a.block_ids[:1]
    assert pool.allocate_for(b, 1, computed)
    assert pool.num_free_blocks == 0 and pool.ref_count(computed[0]) == 2
    pool.check_invariants([a, b])


def test_same_prefix_computed_twice_keeps_one_cached_copy():
    pool = BlockPool(num_blocks=8, block_size=BS)
    a, b = req("a", range(8)), req("b", range(8))
    assert pool.allocate_for(a, 8) and pool.allocate_for(b, 8)
    for request in (a, b):
        request.num_computed_tokens = 8
        pool.cache_full_blocks(request)
    assert pool.num_cached_blocks == 2
    pool.check_invariants([a, b])
    pool.free(b)
    pool.free(a)
    assert pool.num_evictable_blocks == 2 and pool.num_free_blocks == 8
    pool.check_invariants([])


def test_output_tokens_are_cached_for_resume():
    pool = BlockPool(num_blocks=8, block_size=BS)
    a = req("a", range(6))
    compute_all(pool, a)
    a.output_token_ids += [40, 41, 42]  # as if decoded: 9 tokens, 8 computed
    assert pool.allocate_for(a, 2)
    a.num_computed_tokens = 8
    pool.cache_full_blocks(a)
    pool.free(a)  # preempted by recompute
    a.num_computed_tokens = 0
    assert pool.get_computed_blocks(a) == [0, 1]  # prompt block and the block holding output tokens


def test_caching_disabled():
    pool = BlockPool(num_blocks=8, block_size=BS, enable_caching=False)
    a = req("a", range(8))
    compute_all(pool, a)
    assert pool.num_cached_blocks == 0 and pool.get_computed_blocks(req("b", range(8))) == []
    pool.free(a)
    assert pool.num_evictable_blocks == 0 and pool.num_free_blocks == 8
    assert pool.num_queried_tokens == 0
    pool.check_invariants([])


def test_check_invariants_catches_a_missing_holder_and_a_double_free():
    pool = BlockPool(num_blocks=4, block_size=BS)
    a, b = req("a", range(4)), req("b", range(4))
    assert pool.allocate_for(a, 4) and pool.allocate_for(b, 4)
    with pytest.raises(AssertionError):
        pool.check_invariants([a])  # b's block has a ref nobody accounts for
    b.block_ids.append(a.block_ids[0])  # a block table entry without a ref
    with pytest.raises(AssertionError):
        pool.check_invariants([a, b])
    b.block_ids.pop()
    pool.free(a)
    a.block_ids.append(0)
    with pytest.raises(AssertionError):
        pool.free(a)  # ref would go below zero


def test_a_cache_salt_is_a_namespace_of_its_own():
    pool = BlockPool(num_blocks=16, block_size=BS)
    prompt = list(range(9))
    compute_all(pool, Request("a", prompt, cache_salt=salt_key("tenant-a")))
    assert pool.get_computed_blocks(Request("b", prompt, cache_salt=salt_key("tenant-b"))) == []
    assert pool.get_computed_blocks(Request("plain", prompt)) == []  # the shared namespace is another one
    assert len(pool.get_computed_blocks(Request("a2", prompt, cache_salt=salt_key("tenant-a")))) == 2
    assert salt_key(None) == b"" and salt_key("x") != salt_key("y")


def test_blocks_behind_the_window_go_back_keyed_and_a_later_hit_needs_only_the_window():
    """kv_window 6: after 24 tokens no later query reads a key before 19, so blocks 0-3 go back, keyed (evictable).
    Two of them are then evicted; a request with the same 20 tokens still resumes at token 20, holding only the
    blocks its next query's window reaches (3 and 4) behind three FREED_BLOCK entries."""
    pool = BlockPool(num_blocks=8, block_size=BS, kv_window=6)
    a = req("a", range(24))
    compute_all(pool, a)
    assert pool.free_outside_window(a) == 4 and pool.free_outside_window(a) == 0
    assert a.block_ids[:4] == [FREED_BLOCK] * 4 and a.num_freed_blocks == 4 and pool.num_window_freed == 4
    assert pool.num_evictable_blocks == 4 and pool.num_cached_blocks == 6
    pool.check_invariants([a])
    c = req("c", range(100, 116))
    compute_all(pool, c)  # two free blocks, then the two oldest given-back ones evicted
    assert pool.num_evictions == 2 and pool.evictable_block_ids() == [2, 3]  # a's blocks were 0-5

    b = req("b", range(21))
    hit = pool.get_computed_blocks(b)
    assert hit[:3] == [FREED_BLOCK] * 3 and len(hit) == 5 and FREED_BLOCK not in hit[3:]
    assert pool.allocate_for(b, 1, hit)
    assert b.num_computed_tokens == 20 and b.num_freed_blocks == 3 and b.block_ids[4] == a.block_ids[4]
    assert pool.ref_count(b.block_ids[4]) == 2 and pool.ref_count(b.block_ids[3]) == 1
    pool.check_invariants([a, b, c])
    for request in (a, b, c):
        pool.free(request)
        assert request.num_freed_blocks == 0
    pool.check_invariants([])
    assert pool.num_free_blocks == 8

