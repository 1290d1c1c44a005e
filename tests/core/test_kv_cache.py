"""KVCacheManager: block allocation, LRU free queue, prefix cache (ported from vLLM's
`tests/v1/core/test_prefix_caching.py` basics)."""

from __future__ import annotations

import pytest
from factories import make_request

from troupe.core.kv_cache import NULL_BLOCK_ID, KVCacheManager, hash_block_tokens
from troupe.core.request import Request

BS = 4
def compute(kv: KVCacheManager, req: Request, num_tokens: int | None = None) -> None:
    """Admit `req` with its prefix hit, pretend its tokens ran, and register its full blocks."""
    hits, hit_tokens = kv.get_computed_blocks(req)
    n = (req.num_tokens if num_tokens is None else num_tokens) - hit_tokens
    assert kv.allocate_slots(req, n, hits, hit_tokens) is not None
    req.num_computed_tokens = hit_tokens + n
    kv.cache_blocks(req)


def free_order(kv: KVCacheManager) -> list[int]:
    return list(kv._free)


def check_invariants(kv: KVCacheManager) -> None:
    held = [b for table in kv._tables.values() for b in table]
    for b in range(1, kv.num_blocks):
        assert kv.ref_cnt[b] == held.count(b)
        assert (b in kv._free) == (kv.ref_cnt[b] == 0)
    assert NULL_BLOCK_ID not in kv._free and NULL_BLOCK_ID not in held


@pytest.mark.parametrize(("num_tokens", "num_blocks"), [(1, 1), (4, 1), (5, 2), (12, 3), (13, 4)])
def test_allocate_covers_tokens(num_tokens: int, num_blocks: int) -> None:
    """The block table covers ceil(tokens / block_size) blocks, never the null block 0."""
    kv = KVCacheManager(10, BS)
    req = make_request(num_tokens)
    new = kv.allocate_slots(req, num_tokens)
    assert new == kv.get_block_ids(req.request_id) and len(new) == num_blocks
    assert NULL_BLOCK_ID not in new
    assert kv.num_free_blocks == 9 - num_blocks
    assert kv.usage == pytest.approx(num_blocks / 9)
    check_invariants(kv)


def test_allocate_grows_incrementally() -> None:
    """Later calls only pop blocks for tokens past the current table; [] when none are needed."""
    kv = KVCacheManager(10, BS)
    req = make_request(6)
    assert len(kv.allocate_slots(req, 3) or []) == 1
    req.num_computed_tokens = 3
    assert kv.allocate_slots(req, 1) == []
    req.num_computed_tokens = 4
    assert len(kv.allocate_slots(req, 2) or []) == 1
    assert len(kv.get_block_ids(req.request_id)) == 2


def test_allocate_fails_without_side_effects() -> None:
    """Not enough free blocks: None, and the pool and table are unchanged."""
    kv = KVCacheManager(4, BS)  # 3 usable
    a, b = make_request(8), make_request(8)
    assert kv.allocate_slots(a, 8) is not None
    before = free_order(kv)
    assert kv.allocate_slots(b, 8) is None
    assert free_order(kv) == before and kv.get_block_ids(b.request_id) == []
    assert kv.max_tokens_capacity == 12


def test_free_is_lru_tail_first() -> None:
    """Freed cached blocks go to the queue tail, each request's tail block first (prefix evicted last)."""
    kv = KVCacheManager(8, BS)
    a, b = make_request(12), make_request(8)
    kv.allocate_slots(a, 12)
    kv.allocate_slots(b, 8)
    a.num_computed_tokens, b.num_computed_tokens = 12, 8
    kv.cache_blocks(a)
    kv.cache_blocks(b)
    ta, tb = kv.get_block_ids(a.request_id), kv.get_block_ids(b.request_id)
    assert all(kv.block_hash[x] is not None for x in ta + tb)
    untouched = free_order(kv)
    kv.free(a)
    kv.free(b)
    kv.free(b)  # idempotent
    assert free_order(kv) == untouched + ta[::-1] + tb[::-1]
    assert kv.num_free_blocks == kv.num_usable_blocks
    check_invariants(kv)


def test_uncached_blocks_are_reused_first() -> None:
    """A freed block that holds no cached prefix (prefix caching off, or a partial block) goes to the
    queue's front: the next allocation takes it before any never-used or cached block, so a pool's
    written blocks stay as few as its peak use."""
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    a = make_request(6)  # two blocks, the second partial
    kv.allocate_slots(a, 6)
    ta = kv.get_block_ids(a.request_id)
    never_used = free_order(kv)
    kv.free(a)
    assert free_order(kv) == ta + never_used  # the prefix block first, then the tail block
    b = make_request(6)
    kv.allocate_slots(b, 6)
    assert kv.get_block_ids(b.request_id) == ta
    check_invariants(kv)

    cached = KVCacheManager(8, BS)  # with caching on: the full block keeps its hash and goes to the tail
    c = make_request(6)
    cached.allocate_slots(c, 6)
    c.num_computed_tokens = 6
    cached.cache_blocks(c)
    full, partial = cached.get_block_ids(c.request_id)
    rest = free_order(cached)
    cached.free(c)
    assert free_order(cached) == [partial] + rest + [full]
    check_invariants(cached)


@pytest.mark.parametrize(("prompt_len", "expected_hit_tokens"), [
    (3, 0),  # no full block
    (4, 0),  # one full block but it holds the last token
    (5, 4),
    (8, 4),  # the last token is always recomputed
    (9, 8),
    (11, 8),
])
def test_prefix_hit_is_block_aligned_and_spares_last_token(prompt_len: int, expected_hit_tokens: int) -> None:
    """A second identical prompt hits every full cached block that does not hold its last token."""
    kv = KVCacheManager(10, BS)
    prompt = list(range(100, 100 + prompt_len))
    first = make_request(prompt)
    compute(kv, first)
    hits, hit_tokens = kv.get_computed_blocks(make_request(prompt))
    assert hit_tokens == expected_hit_tokens
    assert hits == kv.get_block_ids(first.request_id)[:expected_hit_tokens // BS]


def test_prefix_hit_shares_blocks_and_stops_at_divergence() -> None:
    """Hits stop at the first differing block; shared blocks get ref_cnt 2 and survive one free."""
    kv = KVCacheManager(10, BS)
    common = [1, 2, 3, 4, 5, 6, 7, 8]
    a = make_request(common + [9, 9, 9, 9, 9])
    compute(kv, a)
    b = make_request(common[:4] + [0, 0, 0, 0, 9, 9])
    hits, hit_tokens = kv.get_computed_blocks(b)
    assert hit_tokens == 4 and hits == kv.get_block_ids(a.request_id)[:1]
    assert kv.allocate_slots(b, b.num_tokens - 4, hits, 4) is not None
    assert kv.ref_cnt[hits[0]] == 2
    kv.free(a)
    assert kv.ref_cnt[hits[0]] == 1 and hits[0] not in kv._free
    check_invariants(kv)


def test_cached_block_survives_free_until_evicted() -> None:
    """A freed cached block is still a hit (revived out of the free queue) until it is popped."""
    kv = KVCacheManager(4, BS)  # 3 usable
    prompt = list(range(9))
    a = make_request(prompt)
    compute(kv, a)
    kv.free(a)
    b = make_request(prompt)
    hits, hit_tokens = kv.get_computed_blocks(b)
    assert hit_tokens == 8
    free_before = kv.num_free_blocks
    assert kv.allocate_slots(b, 1, hits, hit_tokens) is not None
    assert kv.num_free_blocks == free_before - 3  # two revived + one popped
    kv.free(b)
    big = make_request(12)  # pops all three blocks: every hash is evicted
    assert kv.allocate_slots(big, 12) is not None
    assert kv.get_computed_blocks(make_request(prompt)) == ([], 0)
    assert kv._cached == {}


def test_eviction_order_is_lru() -> None:
    """The prompt freed first loses its cached blocks first."""
    kv = KVCacheManager(5, BS)  # 4 usable
    old, new = list(range(5)), list(range(50, 55))
    a, b = make_request(old), make_request(new)
    compute(kv, a)
    compute(kv, b)
    kv.free(a)  # a's cached block enters the queue before b's; the partial blocks go to its front
    kv.free(b)
    assert kv.allocate_slots(make_request(12), 12) is not None  # both partial blocks, then a's cached one
    assert kv.get_computed_blocks(make_request(old)) == ([], 0)
    assert kv.get_computed_blocks(make_request(new))[1] == 4


def test_allocation_counts_revived_hits_against_free_blocks() -> None:
    """Reviving a free cached block consumes a free block: the request must fit with it."""
    kv = KVCacheManager(4, BS)  # 3 usable
    prompt = list(range(5))
    compute(kv, a := make_request(prompt))
    kv.free(a)
    b = make_request(prompt + list(range(100, 108)))  # 13 tokens: 1 hit block + 3 new > 3 usable
    hits, hit_tokens = kv.get_computed_blocks(b)
    assert hit_tokens == 4
    assert kv.allocate_slots(b, b.num_tokens - 4, hits, hit_tokens) is None
    assert kv.num_free_blocks == 3 and kv.ref_cnt[hits[0]] == 0


def test_reset_prefix_cache_refused_while_in_use() -> None:
    """reset_prefix_cache is False while any block is held, True afterwards (and hits are gone)."""
    kv = KVCacheManager(6, BS)
    prompt = list(range(9))
    compute(kv, a := make_request(prompt))
    assert kv.reset_prefix_cache() is False
    assert kv.get_computed_blocks(make_request(prompt))[1] == 8
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert kv.get_computed_blocks(make_request(prompt)) == ([], 0)
    assert all(h is None for h in kv.block_hash)


def test_prefix_caching_disabled() -> None:
    """With prefix caching off nothing is hashed, looked up or counted."""
    kv = KVCacheManager(6, BS, enable_prefix_caching=False)
    prompt = list(range(9))
    compute(kv, make_request(prompt))
    assert kv.get_computed_blocks(make_request(prompt)) == ([], 0)
    assert kv._cached == {} and kv.prefix_queries == 0


def test_duplicate_content_is_registered_once() -> None:
    """Two requests computing the same prompt concurrently: only the first block per hash is cached."""
    kv = KVCacheManager(8, BS)
    prompt = list(range(9))
    a, b = make_request(prompt), make_request(prompt)
    for r in (a, b):
        assert kv.allocate_slots(r, 9) is not None
        r.num_computed_tokens = 9
    kv.cache_blocks(a)
    kv.cache_blocks(b)
    assert len(kv._cached) == 2
    assert all(kv.block_hash[x] is None for x in kv.get_block_ids(b.request_id))
    kv.free(a)
    kv.free(b)
    check_invariants(kv)


def test_prefix_stats_count_first_admission_only() -> None:
    """Queries count prompt tokens and hits the served tokens, once per request (not on resume)."""
    kv = KVCacheManager(10, BS)
    prompt = list(range(10))
    compute(kv, make_request(prompt))
    compute(kv, b := make_request(prompt))
    assert (kv.prefix_queries, kv.prefix_hits) == (20, 8)
    kv.free(b)
    b.num_computed_tokens, b.num_preemptions = 0, 1
    compute(kv, b)
    assert (kv.prefix_queries, kv.prefix_hits) == (20, 8)


def test_hash_chain_depends_on_parent() -> None:
    """The same block tokens hash differently under different parents; hashing is deterministic."""
    h1 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h1 == hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(h1, [5, 6]) != hash_block_tokens(None, [5, 6])
    assert hash_block_tokens(None, [1, 2, 3, 4]) != hash_block_tokens(None, [1, 2, 3, 5])


@pytest.mark.parametrize("num_blocks", [0, 1])
def test_pool_needs_a_usable_block(num_blocks: int) -> None:
    """Block 0 is reserved, so a pool needs at least two blocks."""
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(num_blocks, BS)
