"""BlockPool: reference counts, the content-addressed cache, LRU eviction of free cached blocks."""
from lora.ref import AdapterRef
from workers.block_pool import BlockPool, extend_hashes, hash_root

BS = 4


def chain(tokens, adapter=None):
    return extend_hashes([], hash_root(adapter), tokens, BS, len(tokens))


def test_hash_chain_names_the_whole_prefix_and_the_weights():
    a = chain(list(range(12)))
    assert len(a) == 3 and len(chain(list(range(13)))) == 3          # only full blocks
    assert chain([9] + list(range(1, 12)))[1:] != a[1:]              # a change early changes every later hash
    v1, v2 = AdapterRef("sql", "1", "/a/sql"), AdapterRef("sql", "2", "/a/sql")
    assert chain(list(range(12)), v1)[0] != a[0]                      # an adapter's KV never matches the base's
    assert chain(list(range(12)), v2)[0] != chain(list(range(12)), v1)[0]   # nor another version's
    assert chain(list(range(12)), AdapterRef("sq", "l\x001"))[0] != chain(list(range(12)), v1)[0]
    # the same weights (version) from another source, pinned or not: the same KV
    assert chain(list(range(12)), AdapterRef("sql", "1", "/b/sql", pinned=True)) == chain(list(range(12)), v1)
    grown = chain(list(range(8)))
    assert extend_hashes(grown, hash_root(None), list(range(12)), BS, 12) == a   # extends in place


def cached(pool: BlockPool, hashes: list) -> list[int]:
    """New blocks holding these full blocks' KV, registered under their hashes."""
    blocks = pool.allocate(len(hashes))
    for block, h in zip(blocks, hashes):
        pool.register(block, h)
    return blocks


def test_match_take_release_share_blocks_by_reference():
    pool = BlockPool(9)
    hashes = chain(list(range(12)))
    first = cached(pool, hashes)
    assert pool.match(hashes) == first and pool.num_free == 5
    pool.take(first[:2])                        # a second request shares the first two blocks
    pool.release(first)                         # the first request ends
    assert pool.ref_counts[first[0]] == 1 and pool.ref_counts[first[2]] == 0 and pool.num_free == 6
    pool.release(first[:2])
    assert pool.num_free == 8 and pool.match(hashes) == first   # free, and still cached


def test_allocation_evicts_least_recently_freed_and_uncached_first():
    pool = BlockPool(5)                          # 4 usable blocks
    old, new = chain([1] * 8), chain([2] * 8)
    a, b = cached(pool, old), cached(pool, new)
    pool.release(a)                              # freed first: evicted first
    pool.release(b)
    taken = pool.allocate(2)
    assert sorted(taken) == sorted(a) and pool.match(old) == [] and pool.match(new) == b
    pool.release(taken)                          # unhashed now: reused before the cached ones
    assert sorted(pool.allocate(2)) == sorted(taken) and pool.match(new) == b


def test_a_sequence_tail_is_evicted_before_its_shared_head():
    pool = BlockPool(4)
    hashes = chain(list(range(12)))
    blocks = cached(pool, hashes)
    pool.release(blocks)
    pool.allocate(1)
    assert pool.match(hashes) == blocks[:2]      # the last block went; the prefix still hits


def test_duplicate_content_keeps_the_first_copy_cached():
    pool = BlockPool(4)
    h = chain([5] * 4)[0]
    x, y = pool.allocate(2)
    pool.register(x, h)
    pool.register(y, h)                          # computed twice (two requests in one step)
    assert pool.match([h]) == [x] and pool.block_hash[y] is None
    pool.release([x, y])
    assert pool.match([h]) == [x]


def test_caching_off_never_matches():
    pool = BlockPool(4, enable_caching=False)
    h = chain([5] * 4)[0]
    [x] = pool.allocate(1)
    pool.register(x, h)
    assert pool.match([h]) == [] and pool.stats()["cached_blocks"] == 0
