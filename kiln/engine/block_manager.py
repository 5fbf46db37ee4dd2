"""The paged KV cache's bookkeeping: which blocks are free, which a sequence owns, and which
hold a known prefix (automatic prefix caching).

With prefix caching, a block full of computed tokens is keyed by a chained hash of every
token up to its end (its tokens and its predecessor's key), since a block's keys and values
depend on all the tokens before it. A new sequence whose prompt starts with cached blocks
shares them (reference counts) and computes only the rest. A block nobody references any
more keeps its content in an LRU pool and is handed out again, its key dropped, only when
no never-used block is left: until then another request with the same prefix can take it
back. The hash is Python's 64-bit hash of a tuple of ints (no randomisation); a hit is also
checked against the block's own tokens, so only a collision of the chained hash between two
different prefixes that end in the same block of tokens could share a wrong block.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from kiln.engine.sequence import Sequence


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up (at admission)
    hits: int = 0  # of those, tokens found in the cache (not computed again)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.free_blocks = deque(range(num_blocks))  # never used, or their key dropped
        self.ref_counts = [0] * num_blocks
        self.block_key: dict[int, tuple[int, tuple[int, ...]]] = {}  # block -> (hash, its tokens)
        self.cached: dict[int, int] = {}  # hash -> block
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody references, oldest first
        self._chains: dict[Sequence, tuple[int, int | None]] = {}  # seq -> (blocks keyed, the last one's hash)
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks) + len(self.evictable)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int, hit: list[int] = ()) -> bool:
        """Whether seq can take `num_new_tokens` more, after sharing the cached blocks `hit`
        (cached_prefix's answer, at admission): those in the LRU pool leave it too."""
        total = seq.num_computed_tokens + len(hit) * self.block_size + num_new_tokens
        needed = max(0, -(-total // self.block_size) - len(seq.block_table) - len(hit))
        return needed + sum(block in self.evictable for block in hit) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow seq's block table so it covers its computed tokens plus `num_new_tokens`."""
        for _ in range(self.blocks_needed(seq, num_new_tokens)):
            block = self.free_blocks.popleft() if self.free_blocks else self._evict()
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        """Return seq's blocks: a block still shared stays; a cached one joins the LRU pool."""
        self.cache_full_blocks(seq)
        self._chains.pop(seq, None)
        for block in reversed(seq.block_table):  # the tail first: a prefix outlives its extensions
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if block in self.block_key:
                    self.evictable[block] = None
                else:
                    self.free_blocks.append(block)
        seq.block_table = []

    # -- prefix caching ------------------------------------------------------------------------

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks a sequence about to be admitted (no blocks yet) starts with: at most
        all its tokens but one, which must be computed for its logits."""
        # prompt_logprobs needs every prompt position's logits: nothing is skipped.
        if not self.enable_prefix_caching or seq.block_table or seq.params.prompt_logprobs is not None:
            return []
        blocks, parent = [], None
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            parent = hash((parent, tokens))
            block = self.cached.get(parent)
            if block is None or self.block_key[block][1] != tokens:
                break
            blocks.append(block)
        return blocks

    def share(self, seq: Sequence, blocks: list[int]) -> None:
        """Admit seq on the cached `blocks` (cached_prefix's answer): their tokens count as computed."""
        if not self.enable_prefix_caching:
            return
        self.stats.queries += seq.num_tokens
        self.stats.hits += len(blocks) * self.block_size
        for block in blocks:
            self.evictable.pop(block, None)
            self.ref_counts[block] += 1
        seq.block_table = list(blocks)
        seq.num_computed_tokens = len(blocks) * self.block_size
        if blocks:
            self._chains[seq] = (len(blocks), self.block_key[blocks[-1]][0])

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Key the blocks of seq that have filled since the last call: all their tokens known
        and computed."""
        if not self.enable_prefix_caching:
            return
        done, parent = self._chains.get(seq, (0, None))
        full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        if full <= done:
            return
        for i in range(done, full):
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            parent = hash((parent, tokens))
            if parent not in self.cached:  # else the same content is in another block already
                block = seq.block_table[i]
                self.block_key[block] = (parent, tokens)
                self.cached[parent] = block
        self._chains[seq] = (full, parent)

    def _evict(self) -> int:
        """The least recently freed cached block, its key dropped."""
        block, _ = self.evictable.popitem(last=False)
        key, _ = self.block_key.pop(block)
        del self.cached[key]
        return block
