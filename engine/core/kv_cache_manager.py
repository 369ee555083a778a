"""Paged KV cache bookkeeping: a reference-counted block pool with prefix caching.

Full blocks are named by a hash chain (hash of the parent block's hash and the
block's token ids) and stay findable after their request ends, until the pool
needs them: free blocks are reused least-recently-freed first, and a block
that is reused loses its hash. Token ids are kept beside the hash and compared
on a hit, so a hash collision can never hand out the wrong KV.

The hashes are the same in every process (engine/core/block_hash.py), so routers can
compute them too; changes to the set of findable hashes are recorded as KV events
(stored, removed, cleared) for the engine-core server to publish.

Sliding windows: when every layer of the model attends within a window, a sequence's
blocks that lie wholly before the window of its next query are read by no layer; they
are given back as the sequence moves on (free_slid_out), so a sequence holds about
window / block_size blocks however long it grows. Their places in its block table name
the null block, which is never handed out or written (the last block of the pool). A
given-back block keeps its hash: a later request whose whole prefix is still cached
takes it back as any cached block, so prefix hits stay exact.

State blocks (hybrid models, `state_blocks`): every running request also holds one
block for its recurrent state (each Mamba layer's share of that block holds the
request's state in that layer). It is taken with the request's first blocks and given
back with them, on finish, abort and preemption alike.
"""
from __future__ import annotations

from collections import OrderedDict

from engine.core.block_hash import block_hash, root_seed
from engine.core.kv_events import KVEventLog
from engine.core.request import Request
from engine.wire.protocol import KVEvents


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


class KVCacheManager:
    """Hands out cache blocks to requests; the model runner only sees block ids."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 window: int = 0, state_blocks: bool = False) -> None:
        """window: the sliding window every layer attends within (0: the model has
        full-attention layers, and a sequence keeps all its blocks); state_blocks: each
        request also holds a block for its recurrent state."""
        self.num_blocks = num_blocks
        self.state_blocks = state_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window
        # the block that stands for given-back ones in block tables (sliding windows)
        self.null_block = num_blocks - 1 if window else -1
        self.usable_blocks = num_blocks - 1 if window else num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order: the first is the least recently freed.
        self.free: OrderedDict[int, None] = OrderedDict(
            (i, None) for i in range(self.usable_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found
        self.events = KVEventLog()  # changes to `cached`, for the routers

    # ---- accounting -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - len(self.free) / self.usable_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -----------------------------------------------------------------
    def find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids of the longest cached prefix of the request's tokens.

        At least one token is always left to compute, so the request yields logits.
        """
        if not self.enable_prefix_caching:
            return []
        tokens = request.all_token_ids
        usable = (len(tokens) - 1) // self.block_size
        hits: list[int] = []
        root = request.cache_root
        parent = root_seed(request.lora)
        for i in range(usable):
            block_tokens = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            chunk = _key(root, block_tokens)
            h = block_hash(parent, block_tokens)
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            hits.append(block_id)
            parent = h
        self.prefix_queries += len(tokens)
        self.prefix_hits += len(hits) * self.block_size
        return hits

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while any block is held."""
        if len(self.free) != self.usable_blocks:
            return False
        self.cached.clear()
        self.events.cleared()
        for block in self.blocks:
            block.block_hash, block.token_ids = None, ()
        self.prefix_queries = self.prefix_hits = 0
        return True

    # ---- allocation -------------------------------------------------------------------
    def allocate(self, request: Request, num_new_tokens: int,
                 cached_block_ids: list[int] = ()) -> bool:
        """Give the request blocks for num_new_tokens more tokens (after cached ones).

        Returns False, changing nothing, when the pool cannot cover them.
        """
        cached_free = sum(1 for b in cached_block_ids if self.blocks[b].ref_cnt == 0)
        total = request.num_computed_tokens + len(cached_block_ids) * self.block_size
        total += num_new_tokens
        needed = self.blocks_needed(total) - len(request.block_ids) - len(cached_block_ids)
        state = 1 if self.state_blocks and request.state_block < 0 else 0
        if needed + state + cached_free > len(self.free):
            return False
        if state:
            request.state_block = self._pop_free()
        for block_id in cached_block_ids:
            self._take(block_id)
            request.block_ids.append(block_id)
        if cached_block_ids:
            request.block_hashes = [self.blocks[b].block_hash for b in request.block_ids]
        for _ in range(max(needed, 0)):
            request.block_ids.append(self._pop_free())
        if self.enable_prefix_caching:
            self._register_full_blocks(request, min(total, request.num_tokens))
        return True

    def _pop_free(self) -> int:
        """The least recently freed block, forgotten by the prefix cache, held once."""
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
                self.events.removed(block.block_hash)
            block.block_hash, block.token_ids = None, ()
        block.ref_cnt = 1
        return block_id

    def free_request(self, request: Request) -> None:
        """Return the request's blocks; the tail goes first so it is evicted first."""
        if request.state_block >= 0:
            self._release(request.state_block)
            request.state_block = -1
        for block_id in reversed(request.block_ids):
            if block_id != self.null_block:
                self._release(block_id)
        request.block_ids = []
        request.block_hashes = []
        request.num_freed_blocks = 0

    def free_slid_out(self, request: Request) -> int:
        """Give back the request's blocks that no query from its next token on can see
        (every layer's window ends before them); returns how many."""
        if not self.window:
            return 0
        first_seen = request.num_computed_tokens - self.window + 1
        out = min(max(first_seen, 0) // self.block_size, len(request.block_ids))
        freed = 0
        for i in range(request.num_freed_blocks, out):
            block_id = request.block_ids[i]
            if block_id != self.null_block:
                self._release(block_id)
                request.block_ids[i] = self.null_block
                freed += 1
        request.num_freed_blocks = max(out, request.num_freed_blocks)
        return freed

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            self.free[block_id] = None

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_cnt == 0:
            del self.free[block_id]
        block.ref_cnt += 1

    def _register_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Hash the request's blocks that will be full once num_tokens are computed."""
        full = num_tokens // self.block_size
        tokens = request.all_token_ids
        root = request.cache_root
        for i in range(len(request.block_hashes), full):
            parent = request.block_hashes[-1] if request.block_hashes else root_seed(request.lora)
            block_tokens = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            h = block_hash(parent, block_tokens)
            request.block_hashes.append(h)
            block = self.blocks[request.block_ids[i]]
            if block.block_hash is None:
                block.block_hash, block.token_ids = h, _key(root, block_tokens)
                if h not in self.cached:
                    self.cached[h] = block.block_id
                    self.events.stored(h)

    # ---- KV events (engine/core/kv_events.py) ------------------------------------------
    def take_events(self) -> KVEvents | None:
        """Changes to the findable hashes since the last call (the first: a snapshot)."""
        return self.events.take(self.cached)

    def snapshot_events(self) -> KVEvents:
        """Every findable hash, as a cleared + stored batch (for a newly connected router)."""
        return self.events.snapshot(self.cached)


def _key(root, tokens: tuple[int, ...]) -> tuple:
    """A block's identity beside its hash: its tokens, and the adapter it was computed
    under (compared on a hit, so not even a hash collision mixes adapters)."""
    return tokens if root is None else (root, tokens)
