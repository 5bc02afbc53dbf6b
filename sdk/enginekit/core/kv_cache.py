"""Paged KV-cache bookkeeping: a pool of fixed-size blocks with reference counts and a prefix cache.

The tensors themselves live in the model runner; this module only decides which block ids each request
owns. A full block is identified by a hash chained over its tokens and every token before it, so two
requests with the same prompt prefix share the same blocks.
"""

from __future__ import annotations

from collections import OrderedDict

from enginekit.core.request import Request


class Block:
    __slots__ = ("block_hash", "block_id", "ref_count")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None


class BlockPool:
    """All KV blocks; free blocks are kept in eviction order (least recently freed first)."""

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, Block] = {}
        # Fresh blocks leave the front of the free list in id order and freed ones join at its back, so
        # exactly the blocks [0, num_used_blocks) have ever been handed out.
        self.num_used_blocks = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def lookup(self, block_hash: int) -> Block | None:
        return self._cached.get(block_hash)

    def allocate(self, count: int) -> list[Block]:
        allocated = []
        for _ in range(count):
            block = self.blocks[self._free.popitem(last=False)[0]]
            if block.block_hash is not None:  # evict its cached content
                del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_count = 1
            allocated.append(block)
        if allocated:
            self.num_used_blocks = max(self.num_used_blocks, max(b.block_id for b in allocated) + 1)
        return allocated

    def touch(self, blocks: list[Block]) -> None:
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def release(self, blocks: list[Block]) -> None:
        # Tail blocks first, so they are evicted before the shared prefix blocks.
        for block in reversed(blocks):
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = None

    def cache(self, block: Block, block_hash: int) -> None:
        if block.block_hash is None and block_hash not in self._cached:
            block.block_hash = block_hash
            self._cached[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; only possible when no request holds a block."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        return True


_LONG_ROPE_CHAIN = 0x10A6_2043  # the seed of the block hash chain of long-rotated (longrope) sequences
_LORA_CHAIN = 0x10BA_0000  # with a LoRA adapter's key: the seed of its requests' chain


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.block_ids: dict[str, list[int]] = {}  # request id -> block table
        self._blocks: dict[str, list[Block]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self.freed: list[
            str
        ] = []  # requests whose blocks were freed since the runner last heard (take_freed)
        self.num_prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_prefix_hits = 0  # of them, found

    def get_computed_blocks(self, request: Request) -> list[Block]:
        """Cached blocks matching the request's leading full blocks (at least one token left to compute)."""
        if not (self.enable_prefix_caching and request.is_cacheable):
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, max_blocks)
        hits = []
        for block_hash in hashes:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[Block] | None = None
    ) -> bool:
        """Give the request blocks for ``num_new_tokens`` more tokens; False (nothing changed) if full."""
        computed_blocks = computed_blocks or []
        blocks = self._blocks.get(request.request_id)
        num_held = len(blocks) if blocks else 0
        total = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        num_needed = -(-total // self.block_size) - num_held - len(computed_blocks)
        reused_free = sum(1 for block in computed_blocks if block.ref_count == 0)
        if num_needed > self.pool.num_free_blocks - reused_free:
            return False
        if blocks is None:
            blocks = self._blocks[request.request_id] = []
            self.block_ids[request.request_id] = []
            self._num_cached_blocks[request.request_id] = len(computed_blocks)
        self.pool.touch(computed_blocks)
        new_blocks = computed_blocks + self.pool.allocate(max(num_needed, 0))
        blocks.extend(new_blocks)
        self.block_ids[request.request_id].extend(block.block_id for block in new_blocks)
        return True

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Whether a running request's ``num_new_tokens`` more tokens fit in the blocks it holds and the free ones."""
        held = len(self._blocks.get(request.request_id, ()))
        total = request.num_computed_tokens + num_new_tokens
        return -(-total // self.block_size) - held <= self.pool.num_free_blocks

    def trim(self, request: Request, num_tokens: int) -> None:
        """Give back the blocks past the first ``num_tokens`` tokens of a running request (the slots of proposals
        the step rejected). Those blocks hold no cached content: only blocks of known tokens are ever cached."""
        blocks = self._blocks.get(request.request_id)
        keep = -(-num_tokens // self.block_size)
        if blocks is None or len(blocks) <= keep:
            return
        assert self._num_cached_blocks[request.request_id] <= keep
        self.pool.release(blocks[keep:])
        del blocks[keep:]
        del self.block_ids[request.request_id][keep:]

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's newly completed full blocks in the prefix cache."""
        if not (self.enable_prefix_caching and request.is_cacheable):
            return
        # a token still on its way from the device (an overlapped step's) is computed but not known: not hashed yet
        num_full = min(request.num_computed_tokens, len(request.all_token_ids)) // self.block_size
        num_cached = self._num_cached_blocks[request.request_id]
        if num_full <= num_cached:
            return
        blocks = self._blocks[request.request_id]
        hashes = self._block_hashes(request, num_full)
        for index in range(num_cached, num_full):
            self.pool.cache(blocks[index], hashes[index])
        self._num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        blocks = self._blocks.pop(request.request_id, None)
        if blocks is not None:
            self.pool.release(blocks)
            del self.block_ids[request.request_id]
            del self._num_cached_blocks[request.request_id]
            self.freed.append(request.request_id)

    def take_freed(self) -> list[str]:
        """The requests whose blocks were freed since the last call (the runner forgets their block tables)."""
        freed, self.freed = self.freed, []
        return freed

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.num_prefix_queries += num_tokens
        self.num_prefix_hits += num_hit_tokens

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def _block_hashes(self, request: Request, num_blocks: int) -> list[int]:
        hashes = request.block_hashes
        size = self.block_size
        tokens = request.all_token_ids
        # a longrope sequence past the original length holds other keys for the same tokens: its own chain; so
        # does each LoRA adapter (its keys and values are another model's)
        parent = hashes[-1] if hashes else (_LONG_ROPE_CHAIN if request.rope_long else 0)
        if not hashes and request.lora is not None:
            parent = hash((parent, _LORA_CHAIN, request.lora.key))
        for index in range(len(hashes), num_blocks):
            # NOTE: a 64-bit hash chain; a collision would share a wrong block, odds ~2**-64 per pair.
            parent = hash((parent, tuple(tokens[index * size : (index + 1) * size])))
            hashes.append(parent)
        return hashes[:num_blocks]
