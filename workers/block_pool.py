"""KV block allocation with adapter-aware prefix caching.

A full block is content-addressed by a hash chain: block i's hash covers its
parent's hash and its own tokens, and the chain starts from the adapter's
identity (its name and version, lora/ref.py: the content digest of its weights, so
an adapter reloaded with other weights never reuses KV computed with its old ones;
the base model has its own root). Two
requests share a block only when every token up to its end and the weights
that produced its KV are the same. The hash is SHA-256, not Python's `hash`:
a collision would hand one tenant's KV to another, and tuple hashes can be
collided on purpose.

Blocks are reference-counted. A block nobody references is free: it sits in
an LRU queue and keeps its cached content until an allocation takes it, so
"free" blocks are both reusable and evictable. Block 0 is the scratch block
(workers/kv_cache.py) and is never handed out.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Sequence as Seq

from lora.ref import AdapterRef


def hash_root(adapter: AdapterRef | None) -> bytes:
    """The chain's start for one set of weights (None = the base model)."""
    return hashlib.sha256(b"loraserve-kv\0" + (b"" if adapter is None else adapter.prefix_key)).digest()


def hash_block(parent: bytes, tokens: Seq[int]) -> bytes:
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


def extend_hashes(hashes: list[bytes], root: bytes, token_ids: Seq[int], block_size: int,
                  num_tokens: int) -> list[bytes]:
    """Append the hashes of the full blocks of `token_ids[:num_tokens]` that `hashes` does not cover yet."""
    for i in range(len(hashes), num_tokens // block_size):
        parent = hashes[-1] if hashes else root
        hashes.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size]))
    return hashes


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        assert num_blocks >= 2, "need at least one usable block besides the scratch block"
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}                    # hash -> block holding that content
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.evicted_blocks = 0                               # cached content dropped to make room

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now (cached content included: it is evicted on reuse)."""
        return len(self.free)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    # ---- prefix lookup -----------------------------------------------------------------------
    def match(self, hashes: Seq[bytes]) -> list[int]:
        """The blocks holding the longest cached prefix of `hashes` (not yet referenced: see `take`)."""
        blocks = []
        if self.enable_caching:
            for h in hashes:
                block = self.cached.get(h)
                if block is None:
                    break
                blocks.append(block)
        return blocks

    def match_prefix(self, seq, block_size: int) -> list[int]:
        """`match` for a sequence (workers/sequence.py) about to be admitted: its hash chain restarted if its
        adapter version is not the one the chain was computed under, then extended to its whole length."""
        root = hash_root(seq.adapter_ref)
        if seq.hash_root != root:
            seq.block_hashes, seq.hash_root, seq.num_registered_blocks = [], root, 0
        extend_hashes(seq.block_hashes, root, seq.token_ids, block_size, len(seq))
        # The last token is always computed: its logits are what the step samples from. Prompt logprobs
        # need every prompt token's logits, so such a request computes its whole prompt.
        usable = 0 if seq.params.prompt_logprobs is not None else (len(seq) - 1) // block_size
        return self.match(seq.block_hashes[:usable])

    def num_free_after_taking(self, blocks: Seq[int]) -> int:
        return len(self.free) - sum(1 for b in blocks if b in self.free)

    def take(self, blocks: Seq[int]) -> None:
        """Reference cached blocks found by `match`."""
        for b in blocks:
            if self.ref_counts[b] == 0:
                del self.free[b]
            self.ref_counts[b] += 1

    def record_query(self, queried: int, hit: int) -> None:
        self.queried_tokens += queried
        self.hit_tokens += hit

    # ---- allocation --------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """`n` blocks for new content; the least recently freed go first (their cached content is dropped)."""
        assert n <= len(self.free), f"asked for {n} blocks, {len(self.free)} free"
        out = []
        for _ in range(n):
            block, _ = self.free.popitem(last=False)
            self._uncache(block)
            self.ref_counts[block] = 1
            out.append(block)
        return out

    def release(self, blocks: Seq[int]) -> None:
        """Drop one reference to each block. A sequence's tail is freed first, so it is evicted first
        (a prefix shared by many requests outlives the suffixes only one of them had)."""
        for b in reversed(blocks):
            self.ref_counts[b] -= 1
            assert self.ref_counts[b] >= 0, f"block {b} released more often than referenced"
            if self.ref_counts[b] == 0:
                self.free[b] = None
                if self.block_hash[b] is None:
                    self.free.move_to_end(b, last=False)   # holds nothing reusable: reuse it first

    def register(self, block: int, block_hash: bytes) -> None:
        """`block` now holds the full content named by `block_hash` (its KV is written)."""
        if not self.enable_caching or self.block_hash[block] is not None:
            return
        if block_hash not in self.cached:   # an identical block already cached keeps serving hits
            self.cached[block_hash] = block
            self.block_hash[block] = block_hash

    def cache_full_blocks(self, seq, num_tokens: int, block_size: int) -> None:
        """Offer the blocks of a sequence that its first `num_tokens` fill, before the step that computes them
        runs: every layer writes the whole step's K/V before any attention reads it, so a request admitted
        later in the same step (the other choices of an n > 1 request, a burst sharing a system prompt)
        already reuses them."""
        full = num_tokens // block_size
        if not self.enable_caching or full <= seq.num_registered_blocks:
            return
        extend_hashes(seq.block_hashes, seq.hash_root, seq.token_ids, block_size, num_tokens)
        for i in range(seq.num_registered_blocks, full):
            self.register(seq.block_table[i], seq.block_hashes[i])
        seq.num_registered_blocks = full

    def _uncache(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            self.block_hash[block] = None
            if self.cached.get(h) == block:
                del self.cached[h]
                self.evicted_blocks += 1

    def stats(self) -> dict:
        return {"queried_tokens": self.queried_tokens, "hit_tokens": self.hit_tokens,
                "cached_blocks": len(self.cached), "evicted_blocks": self.evicted_blocks,
                "hit_rate": self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0}
