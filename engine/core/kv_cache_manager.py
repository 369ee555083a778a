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
from engine.core_messages import KVEvents


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "group")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] = ()
        self.group = 0  # the KV group whose prefix cache finds it (when hashed)


class KVCacheManager:
    """Hands out cache blocks to requests; the model runner only sees block ids."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 windows: tuple[int, ...] | int = 0, state_blocks: bool = False) -> None:
        """windows: each KV group's sliding window (engine.core.kv_groups; one int: one
        group), 0 for full attention, whose sequences keep all their blocks;
        state_blocks: each request also holds a block for its recurrent state."""
        self.windows = (windows,) if isinstance(windows, int) else tuple(windows)
        self.num_blocks = num_blocks
        self.state_blocks = state_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # the block that stands for given-back ones in block tables (sliding windows)
        slides = any(self.windows)
        self.null_block = num_blocks - 1 if slides else -1
        self.usable_blocks = num_blocks - 1 if slides else num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order: the first is the least recently freed.
        self.free: OrderedDict[int, None] = OrderedDict(
            (i, None) for i in range(self.usable_blocks))
        # per group: block hash -> block id; the first group's is the one routers see
        self.caches: list[dict[int, int]] = [{} for _ in self.windows]
        self.cached = self.caches[0]
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
        """Blocks a sequence of num_tokens holds before any slides out, every group's."""
        return -(-num_tokens // self.block_size) * len(self.windows)

    def _tables(self, request: Request) -> list[list[int]]:
        """The request's block table of each group (made on first use)."""
        while len(request.group_blocks) < len(self.windows):
            request.group_blocks.append([])
            request.group_freed.append(0)
        return request.group_blocks

    # ---- prefix cache -----------------------------------------------------------------
    def find_cached_prefix(self, request: Request) -> list[list[int]]:
        """Each group's block ids of the longest prefix of the request's tokens that every
        group has cached (hit_tokens counts it).

        At least one token is always left to compute, so the request yields logits.
        """
        hits: list[list[int]] = [[] for _ in self.windows]
        if not self.enable_prefix_caching:
            return hits
        tokens = request.all_token_ids
        usable = (len(tokens) - 1) // self.block_size
        root = request.cache_root
        parent = root_seed(request.lora)
        for i in range(usable):
            block_tokens = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            chunk = block_key(root, block_tokens)
            h = block_hash(parent, block_tokens)
            found = [cache.get(h) for cache in self.caches]
            if any(b is None or self.blocks[b].token_ids != chunk for b in found):
                break
            for table, block_id in zip(hits, found):
                table.append(block_id)
            parent = h
        self.prefix_queries += len(tokens)
        self.prefix_hits += len(hits[0]) * self.block_size
        return hits

    def hit_tokens(self, hits: list[list[int]]) -> int:
        return len(hits[0]) * self.block_size if hits else 0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while any block is held."""
        if len(self.free) != self.usable_blocks:
            return False
        for cache in self.caches:
            cache.clear()
        self.events.cleared()
        for block in self.blocks:
            block.block_hash, block.token_ids = None, ()
        self.prefix_queries = self.prefix_hits = 0
        return True

    # ---- allocation -------------------------------------------------------------------
    def allocate(self, request: Request, num_new_tokens: int,
                 hits: list[list[int]] | None = None, register: bool = True) -> bool:
        """Give the request blocks for num_new_tokens more tokens (after its prefix-cache
        hits, each group's, from find_cached_prefix), in every group. register False:
        the new tokens' full blocks are not made findable yet (KV a connector is still
        loading into them: register_computed once it is in).

        Returns False, changing nothing, when the pool cannot cover them.
        """
        tables = self._tables(request)
        hits = hits or [[] for _ in self.windows]
        hit_blocks = len(hits[0])
        total = request.num_computed_tokens + hit_blocks * self.block_size + num_new_tokens
        per_group = -(-total // self.block_size)
        needed = [max(per_group - len(table) - hit_blocks, 0) for table in tables]
        cached_free = sum(1 for group in hits for b in group if self.blocks[b].ref_cnt == 0)
        state = 1 if self.state_blocks and request.state_block < 0 else 0
        if sum(needed) + state + cached_free > len(self.free):
            return False
        for table, group_hits in zip(tables, hits):  # before any pop: a hit may be free
            for block_id in group_hits:
                self._take(block_id)
                table.append(block_id)
        if state:
            request.state_block = self._pop_free()
        if hit_blocks:
            request.block_hashes = [self.blocks[b].block_hash for b in tables[0]]
        for table, count in zip(tables, needed):
            for _ in range(count):
                table.append(self._pop_free())
        if self.enable_prefix_caching and register:
            self._register_full_blocks(request, min(total, request.num_tokens))
        return True

    def register_computed(self, request: Request) -> None:
        """Make the request's full blocks up to its computed tokens findable (after a
        connector filled them)."""
        if self.enable_prefix_caching:
            self._register_full_blocks(request, request.num_computed_tokens)

    def _pop_free(self) -> int:
        """The least recently freed block, forgotten by the prefix cache, held once."""
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            cache = self.caches[block.group]
            if cache.get(block.block_hash) == block_id:
                del cache[block.block_hash]
                if block.group == 0:
                    self.events.removed(block.block_hash)
            block.block_hash, block.token_ids = None, ()
        block.ref_cnt = 1
        return block_id

    def free_request(self, request: Request) -> None:
        """Return the request's blocks; the tail goes first so it is evicted first."""
        if request.state_block >= 0:
            self._release(request.state_block)
            request.state_block = -1
        for table in request.group_blocks:
            for block_id in reversed(table):
                if block_id != self.null_block:
                    self._release(block_id)
        request.group_blocks = [[]]
        request.group_freed = [0]
        request.block_hashes = []

    def trim(self, request: Request) -> int:
        """Give back the blocks past those the request's known tokens need (what rejected
        proposed tokens took); returns how many. They were never hashed: only known
        tokens' full blocks are."""
        keep = -(-request.num_tokens // self.block_size)
        freed = 0
        for table in request.group_blocks:
            while len(table) > keep:
                block_id = table.pop()
                if block_id != self.null_block:
                    self._release(block_id)
                    freed += 1
        return freed

    def free_slid_out(self, request: Request) -> int:
        """Give back the request's blocks that no query from its next token on can see
        (outside their group's window); returns how many."""
        freed = 0
        for g, window in enumerate(self.windows):
            if not window or g >= len(request.group_blocks):
                continue
            table = request.group_blocks[g]
            first_seen = request.num_computed_tokens - window + 1
            out = min(max(first_seen, 0) // self.block_size, len(table))
            for i in range(request.group_freed[g], out):
                if table[i] != self.null_block:
                    self._release(table[i])
                    table[i] = self.null_block
                    freed += 1
            request.group_freed[g] = max(out, request.group_freed[g])
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
        """Hash the request's blocks that will be full once num_tokens are computed, in
        every group's prefix cache (the same hash chain: the same tokens)."""
        full = num_tokens // self.block_size
        tokens = request.all_token_ids
        root = request.cache_root
        first = len(request.block_hashes)
        for i in range(first, full):
            parent = request.block_hashes[-1] if request.block_hashes else root_seed(request.lora)
            block_tokens = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            h = block_hash(parent, block_tokens)
            request.block_hashes.append(h)
            for g, (cache, table) in enumerate(zip(self.caches, request.group_blocks)):
                block = self.blocks[table[i]]
                if block.block_hash is None and table[i] != self.null_block:
                    block.block_hash, block.token_ids = h, block_key(root, block_tokens)
                    block.group = g
                    if h not in cache:
                        cache[h] = block.block_id
                        if g == 0:
                            self.events.stored(h)

    # ---- KV events (engine/core/kv_events.py) ------------------------------------------
    def take_events(self) -> KVEvents | None:
        """Changes to the findable hashes since the last call (the first: a snapshot)."""
        return self.events.take(self.cached)

    def snapshot_events(self) -> KVEvents:
        """Every findable hash, as a cleared + stored batch (for a newly connected router)."""
        return self.events.snapshot(self.cached)


def block_key(root, tokens: tuple[int, ...]) -> tuple:
    """A block's identity beside its hash: its tokens, and the adapter it was computed
    under (compared on a hit, so not even a hash collision mixes adapters)."""
    return tokens if root is None else (root, tokens)
