"""`KVCacheManager`: the paged KV block pool with prefix caching (vLLM v1 `KVCacheManager` + `BlockPool`).

Pure bookkeeping, no tensors: it hands out block ids; the model runner owns a KV tensor of
`num_blocks` blocks of `block_size` token slots and writes position `p` of a request to slot
`p % block_size` of block `block_ids[p // block_size]`.

- Block 0 is the reserved *null block* (as in vLLM): never handed out, so the model runner may pad
  block tables and slot mappings with 0. Usable blocks are `1 .. num_blocks - 1`.
- Free blocks sit in an LRU queue (an `OrderedDict`: O(1) pop-front, append, remove-from-middle).
  `free` releases a request's blocks tail first, so its prefix blocks stay cached longest. A freed block
  that holds no cached prefix (no hash: prefix caching off, or a partial block) goes to the queue's
  front instead: it is reused before any cached block is evicted, and the pool's written blocks stay
  as few as the peak use needs (a CPU pool's pages are committed on first write: `kernels.base.zeros`).
- Prefix cache: a *full* block is keyed by the chain hash `H(parent_hash, block_tokens)`. H is
  BLAKE2b-128 over the parent hash and the int64 token bytes, not Python's `hash()`: cached blocks
  are shared across requests (and users), so a collision would serve one prompt's KV to another;
  Python's 64-bit tuple hash is fast but not collision-resistant against crafted input. A cached block keeps its hash after it is freed and loses it only when it
  is popped for a new allocation (eviction). One block per hash: a later block with the same
  content is simply not registered.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from troupe.core.request import Request

NULL_BLOCK_ID = 0
_ROOT_HASH = int.from_bytes(hashlib.blake2b(b"troupe-prefix-cache-root", digest_size=16).digest(), "little")


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """The chain hash of one full block: 128-bit BLAKE2b of (parent hash, token ids as int64)."""
    h = hashlib.blake2b(digest_size=16)
    h.update((_ROOT_HASH if parent_hash is None else parent_hash).to_bytes(16, "little"))
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


class KVCacheManager:
    """Block pool, per-request block tables and the prefix cache.

    Contract (what mutates when):
    - `get_computed_blocks(req)` is a pure lookup (it only extends `req.block_hashes`, the hash
      chain of the request's full blocks): nothing is reserved until `allocate_slots` succeeds.
    - `allocate_slots(req, n, hit_blocks, hit_tokens)` either does nothing and returns None (not
      enough free blocks: the scheduler's preemption signal) or grows the request's block table so
      it covers `req.num_computed_tokens + hit_tokens + n` tokens: hit blocks get `ref_cnt += 1`
      (leaving the free queue if they were free), new blocks are popped from the free queue front
      (evicting their cached hash). The first successful call for a request is its admission and
      is counted in the prefix stats (`prefix_queries`/`prefix_hits`, tokens, first admission only).
    - `cache_blocks(req)` registers the request's full blocks whose tokens are all computed
      (`req.num_computed_tokens`); call it after the step that computed them ran.
    - `free(req)` drops the block table: `ref_cnt -= 1` per block, tail first; blocks reaching 0
      join the free queue tail (cached ones keep their hash), or its front if they hold no hash.
      Idempotent.
    Invariants: a block is in the free queue iff its `ref_cnt` is 0; `ref_cnt` equals the number of
    block tables holding it; a block with a hash is full and never written again.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._tables: dict[str, list[int]] = {}  # request id -> block ids
        self._num_cached_blocks: dict[str, int] = {}  # request id -> leading blocks already registered
        self.prefix_queries = 0  # cumulative prompt tokens looked up (first admission only)
        self.prefix_hits = 0  # cumulative tokens served from the prefix cache

    # ------------------------------------------------------------------ sizes

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def max_tokens_capacity(self) -> int:
        """Tokens one request can hold when it has the whole pool."""
        return self.num_usable_blocks * self.block_size

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (cached free blocks count as free)."""
        return 1.0 - len(self._free) / self.num_usable_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (a copy); empty if it holds no blocks."""
        return list(self._tables.get(request_id, ()))

    # ------------------------------------------------------------------ prefix cache

    def _update_block_hashes(self, req: Request) -> None:
        bs, hashes, tokens = self.block_size, req.block_hashes, req.all_token_ids
        for i in range(len(hashes), len(tokens) // bs):
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, tokens[i * bs:(i + 1) * bs]))

    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """Longest run of cached full blocks that prefixes the request's tokens, never covering the
        last token (it is recomputed for logits). Returns (block ids, number of hit tokens)."""
        if not self.enable_prefix_caching:
            return [], 0
        self._update_block_hashes(req)
        hits: list[int] = []
        for h in req.block_hashes[:(req.num_tokens - 1) // self.block_size]:
            block_id = self._cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits, len(hits) * self.block_size

    def cache_blocks(self, req: Request) -> None:
        """Register the request's full, computed blocks (up to `req.num_computed_tokens`)."""
        table = self._tables.get(req.request_id)
        if not self.enable_prefix_caching or table is None:
            return
        start = self._num_cached_blocks[req.request_id]
        # computed and known: with async scheduling the computed count runs one token ahead of the known ones
        end = min(min(req.num_computed_tokens, len(req.all_token_ids)) // self.block_size, len(table))
        if end <= start:
            return
        self._update_block_hashes(req)
        for i in range(start, end):
            h, block_id = req.block_hashes[i], table[i]
            if h not in self._cached and self.block_hash[block_id] is None:
                self._cached[h] = block_id
                self.block_hash[block_id] = h
        self._num_cached_blocks[req.request_id] = end

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is held by a request."""
        if len(self._free) != self.num_usable_blocks:
            return False
        self._cached.clear()
        self.block_hash = [None] * self.num_blocks
        return True

    # ------------------------------------------------------------------ allocation

    def allocate_slots(self, req: Request, num_new_tokens: int, new_computed_blocks: Sequence[int] = (),
                       num_new_computed_tokens: int = 0) -> list[int] | None:
        """Grow the block table to cover `num_computed_tokens + num_new_computed_tokens +
        num_new_tokens`; returns the newly popped block ids ([] if none were needed) or None,
        changing nothing, when the free queue is too short."""
        rid = req.request_id
        table = self._tables.get(rid)
        if table is not None and not new_computed_blocks and \
                req.num_computed_tokens + num_new_tokens <= len(table) * self.block_size:
            return []  # the held blocks already cover the chunk (most decode steps): nothing to pop
        if new_computed_blocks:
            assert not table and req.num_computed_tokens == 0, "prefix hits are only taken at admission"
            assert num_new_computed_tokens == len(new_computed_blocks) * self.block_size
        num_held = len(table or ()) + len(new_computed_blocks)
        total = req.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_to_pop = max(0, self.num_blocks_for(total) - num_held)
        num_revived = sum(1 for b in new_computed_blocks if self.ref_cnt[b] == 0)  # leave the free queue
        if num_to_pop + num_revived > len(self._free):
            return None
        if table is None:
            table = self._tables[rid] = []
            self._num_cached_blocks[rid] = 0
            if self.enable_prefix_caching and req.num_preemptions == 0:
                self.prefix_queries += req.num_tokens
                self.prefix_hits += num_new_computed_tokens
        for b in new_computed_blocks:
            if self.ref_cnt[b] == 0:
                del self._free[b]
            self.ref_cnt[b] += 1
        table.extend(new_computed_blocks)
        self._num_cached_blocks[rid] += len(new_computed_blocks)
        new_blocks = [self._pop_free() for _ in range(num_to_pop)]
        table.extend(new_blocks)
        return new_blocks

    def _pop_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        h = self.block_hash[block_id]
        if h is not None:  # evict: the block is about to be overwritten
            del self._cached[h]
            self.block_hash[block_id] = None
        self.ref_cnt[block_id] = 1
        return block_id

    def free(self, req: Request) -> None:
        """Release the request's blocks, tail first (they are evicted before its prefix)."""
        table = self._tables.pop(req.request_id, None)
        self._num_cached_blocks.pop(req.request_id, None)
        for b in reversed(table or ()):
            self.ref_cnt[b] -= 1
            assert self.ref_cnt[b] >= 0
            if self.ref_cnt[b] == 0:
                self._free[b] = None
                if self.block_hash[b] is None:  # nothing cached in it: reused first
                    self._free.move_to_end(b, last=False)
