"""torch's CUDA caching allocator, replayed: what it reserves for a sequence of allocations and frees.

A pure model of ``c10/cuda/CUDACachingAllocator.cpp`` (``DeviceCachingAllocator``, torch 2.x with the default
``PYTORCH_CUDA_ALLOC_CONF``: no ``max_split_size_mb``, no ``roundup_power2_divisions``, no garbage collection, no
expandable segments):

- ``round_size``: every request is rounded up to a multiple of 512 B (``kMinBlockSize``);
- ``get_pool``: requests of at most 1 MiB (``kSmallSize``) come from the small pool, the rest from the large pool;
- ``get_free_block``: the smallest cached free block of the pool that holds the request (``BlockComparatorSize``:
  by size, then address);
- ``get_allocation_size``: without one, a new segment (``cudaMalloc``) of 2 MiB for a small request
  (``kSmallBuffer``), 20 MiB for a request under 10 MiB (``kLargeBuffer``, ``kMinLargeAlloc``), else the request
  rounded up to 2 MiB (``kRoundLarge``);
- ``should_split``: the block is split when what remains is at least 512 B (small pool) or more than 1 MiB (large
  pool); the request takes the block's low addresses, the remainder goes back to the pool;
- ``free_block`` / ``try_merge_blocks``: a freed block merges with its free neighbours of the same segment, never
  across segments: a segment is only returned to CUDA by ``empty_cache`` or an out-of-memory retry, so the reserved
  total never falls during training.

- streams: a block belongs to the stream whose request made its segment (``Block::stream``, every block of a segment
  the segment's stream); ``get_free_block`` looks up the pool by (stream, size, address) (``BlockComparatorSize``
  compares the stream first) and takes a block only of the requesting stream, so a block freed by one stream's
  tensor is cached for that stream's next requests and no other's. ``record_stream`` only delays when a freed block
  returns to its own stream's pool (``insert_events``); a replay that has no timing returns it at the free.

``allocated`` counts blocks as the allocator does (``allocated_bytes`` adds ``block->size``: a request that leaves at
most 1 MiB of its segment keeps the whole segment), which is ``torch.cuda.max_memory_allocated``'s unit.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

MIN_BLOCK_BYTES = 512  # kMinBlockSize
SMALL_REQUEST_BYTES = 1 << 20  # kSmallSize: the largest small-pool request
SMALL_SEGMENT_BYTES = 2 << 20  # kSmallBuffer
LARGE_SEGMENT_BYTES = 20 << 20  # kLargeBuffer: the segment of a request between 1 and 10 MiB
MIN_LARGE_ALLOC_BYTES = 10 << 20  # kMinLargeAlloc: from here a request gets a segment of its own size
ROUND_LARGE_BYTES = 2 << 20  # kRoundLarge


def round_size_bytes(nbytes: int) -> int:
    """``DeviceCachingAllocator::round_size`` without ``roundup_power2_divisions``."""
    if nbytes < MIN_BLOCK_BYTES:
        return MIN_BLOCK_BYTES
    return MIN_BLOCK_BYTES * -(-nbytes // MIN_BLOCK_BYTES)


def segment_bytes(rounded: int) -> int:
    """``get_allocation_size``: the ``cudaMalloc`` a request makes when no cached block holds it."""
    if rounded <= SMALL_REQUEST_BYTES:
        return SMALL_SEGMENT_BYTES
    if rounded < MIN_LARGE_ALLOC_BYTES:
        return LARGE_SEGMENT_BYTES
    return ROUND_LARGE_BYTES * -(-rounded // ROUND_LARGE_BYTES)


def splits(block_bytes: int, rounded: int) -> bool:
    """``should_split``: whether a block of ``block_bytes`` serving ``rounded`` gives its remainder back."""
    remaining = block_bytes - rounded
    if rounded <= SMALL_REQUEST_BYTES:
        return remaining >= MIN_BLOCK_BYTES
    return remaining > SMALL_REQUEST_BYTES


@dataclass
class _Block:
    addr: int
    size: int
    small: bool
    stream: object = None  # the stream the block's segment was cudaMalloc'd for (None: the default stream)
    free: bool = True
    prev: _Block | None = None
    next: _Block | None = None


@dataclass
class CachingAllocator:
    """One device's caching allocator. ``malloc`` returns a handle for ``free``; ``stream`` names the stream a request
    is made on (None: the default stream), whose pool alone serves it."""

    reserved: int = 0
    allocated: int = 0
    peak_reserved: int = 0
    peak_allocated: int = 0
    _pools: dict[tuple[object, bool], list[tuple[int, int]]] = field(default_factory=dict)  # (stream, small)
    by_stream: dict[object, int] = field(default_factory=dict)  # reserved per stream (segments are never returned)
    _by_addr: dict[int, _Block] = field(default_factory=dict)
    _next_addr: int = 0

    def malloc(self, nbytes: int, stream: object = None) -> _Block | None:
        """Serve a request of ``nbytes`` made on ``stream`` (None for 0 bytes: torch allocates nothing for an empty
        storage)."""
        if nbytes <= 0:
            return None
        rounded = round_size_bytes(nbytes)
        small = rounded <= SMALL_REQUEST_BYTES
        block = self._take_free(stream, small, rounded) or self._new_segment(stream, small, segment_bytes(rounded))
        if splits(block.size, rounded):
            rest = _Block(block.addr + rounded, block.size - rounded, small, block.stream, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, rounded
            self._insert(rest)
        block.free = False
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def free(self, block: _Block | None) -> None:
        if block is None:
            return
        self.allocated -= block.size
        block.free = True
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self._remove(neighbour)
                if neighbour is block.prev:
                    block.addr, block.prev = neighbour.addr, neighbour.prev
                    if block.prev is not None:
                        block.prev.next = block
                else:
                    block.next = neighbour.next
                    if block.next is not None:
                        block.next.prev = block
                block.size += neighbour.size
        self._insert(block)

    @property
    def reserve(self) -> int:
        """Reserved beyond the peak allocated: ``max_memory_reserved - max_memory_allocated``."""
        return self.peak_reserved - self.peak_allocated

    def _new_segment(self, stream: object, small: bool, size: int) -> _Block:
        block = _Block(self._next_addr, size, small, stream)
        self._next_addr += size
        self.reserved += size
        self.by_stream[stream] = self.by_stream.get(stream, 0) + size
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block

    def _take_free(self, stream: object, small: bool, rounded: int) -> _Block | None:
        pool = self._pools.setdefault((stream, small), [])
        i = bisect.bisect_left(pool, (rounded, -1))
        if i == len(pool):
            return None
        _, addr = pool.pop(i)
        return self._by_addr.pop(addr)

    def _insert(self, block: _Block) -> None:
        bisect.insort(self._pools.setdefault((block.stream, block.small), []), (block.size, block.addr))
        self._by_addr[block.addr] = block

    def _remove(self, block: _Block) -> None:
        pool = self._pools[(block.stream, block.small)]
        del pool[bisect.bisect_left(pool, (block.size, block.addr))]
        del self._by_addr[block.addr]


def replay(events, allocator: CachingAllocator | None = None, streams=None) -> CachingAllocator:
    """Run ``events`` -- ``(key, nbytes)`` to allocate a tensor's storage under ``key``, ``(key, None)`` to free it --
    through ``allocator`` (a new one by default) and return it. ``streams``: the stream each key is allocated on, for
    the keys not allocated on the default stream."""
    allocator = allocator or CachingAllocator()
    streams = streams or {}
    live: dict = {}
    for key, nbytes in events:
        if nbytes is None:
            allocator.free(live.pop(key, None))
        else:
            live[key] = allocator.malloc(nbytes, streams.get(key))
    return allocator


# the steps a training run is replayed for: the reserved total stops growing within three steps on every traced run
# (docs/measurements.md, "The caching allocator's reserve against real GPUs"); the GPU measurements took their
# maximum over 5 steps
MAX_STEPS = 8


def replay_training(
    setup, step, *, first_step_extra=(), extra_at: int | None = None, max_steps: int = MAX_STEPS, streams=None
):
    """The allocator after a training run: ``setup`` (the model's storages, made once), then ``step`` -- one training
    step's events, ``(key, nbytes)`` / ``(key, None)`` as in :func:`replay` -- over and over, until a step reserves
    nothing new (its free blocks then fit the next step's requests as they fitted this one's), at most ``max_steps``.

    ``first_step_extra``: allocations only the first step makes, at index ``extra_at`` of its events (the optimizer
    state, created by the first ``optimizer.step()`` in the blocks that step's activations freed). A key of ``step``
    names a new storage in every repetition; a key allocated in ``setup`` names the same storage throughout, and a
    step's storage still alive when the next step allocates its key again is freed first (what rebinding a Python
    name to the next step's tensor does). ``streams``: the stream a key is allocated on, for the keys not allocated
    on the default stream (each step allocates a key on the stream the traced step did)."""
    allocator = CachingAllocator()
    streams = streams or {}
    live: dict = {}

    def play(events, scope):
        for key, nbytes in events:
            if nbytes is None:
                allocator.free(live.pop((scope, key), None) or live.pop((None, key), None))
            else:
                allocator.free(live.pop((scope - 1, key), None) if scope else None)
                live[(scope, key)] = allocator.malloc(nbytes, streams.get(key))

    play(setup, None)
    step = list(step)
    at = len(step) if extra_at is None else extra_at
    for repetition in range(max_steps):
        before = allocator.reserved
        if repetition == 0:
            play(step[:at], 0)
            play(first_step_extra, None)
            play(step[at:], 0)
        else:
            play(step, repetition)
        if repetition and allocator.reserved == before:
            break
    return allocator
