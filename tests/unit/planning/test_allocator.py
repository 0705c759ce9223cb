"""torch's caching allocator replayed (hf_dist.planning.allocator) against hand-computed sequences.

Each expected figure follows from c10/cuda/CUDACachingAllocator.cpp's rules: 512-byte rounding, the small pool's
2 MiB segments, 20 MiB segments for requests of 1-10 MiB, larger requests' own segments rounded to 2 MiB, best fit,
a split when more than 1 MiB remains (512 B in the small pool), merging only inside a segment.
"""

import pytest

from hf_dist.planning.allocator import (
    CachingAllocator,
    replay,
    replay_training,
    round_size_bytes,
    segment_bytes,
    splits,
)

KIB, MIB = 1024, 1024**2


@pytest.mark.parametrize(("nbytes", "rounded"), [(1, 512), (512, 512), (513, 1024), (3 * MIB + 1, 3 * MIB + 512)])
def test_requests_round_to_512_bytes(nbytes, rounded):
    assert round_size_bytes(nbytes) == rounded


@pytest.mark.parametrize(
    ("rounded", "segment"),
    [
        (512, 2 * MIB),  # small pool
        (1 * MIB, 2 * MIB),  # the largest small request
        (1 * MIB + 512, 20 * MIB),  # 1-10 MiB: a 20 MiB segment to split
        (10 * MIB - 512, 20 * MIB),
        (10 * MIB, 10 * MIB),  # from 10 MiB its own segment, rounded to 2 MiB
        (10 * MIB + 512, 12 * MIB),
    ],
)
def test_segment_sizes(rounded, segment):
    assert segment_bytes(rounded) == segment


def test_split_thresholds():
    assert splits(20 * MIB, 5 * MIB)  # 15 MiB remain
    assert not splits(12 * MIB, 11 * MIB)  # exactly 1 MiB remains: not more than kSmallSize
    assert splits(2 * MIB, 100 * KIB)  # the small pool splits down to 512 B
    assert not splits(2 * MIB, 2 * MIB - 256)  # a remainder under 512 B stays with the block


def test_a_block_that_is_not_split_counts_whole():
    a = CachingAllocator()
    a.malloc(11 * MIB)  # a 12 MiB segment; 1 MiB would remain, which is not split off
    assert (a.allocated, a.reserved) == (12 * MIB, 12 * MIB)


def test_a_freed_block_is_split_and_a_second_request_needs_a_new_segment():
    # 100 MiB freed; 60 MiB takes its low part and 40 MiB stays cached; the next 60 MiB fits nowhere: a new segment
    a = replay([(1, 100 * MIB), (1, None), (2, 60 * MIB), (3, 60 * MIB)])
    assert a.reserved == 160 * MIB
    assert a.allocated == 120 * MIB
    assert a.peak_allocated == 120 * MIB
    assert a.reserve == 40 * MIB


def test_freed_neighbours_merge_inside_a_segment():
    events = [(0, 64 * MIB), (0, None)] + [(k, 16 * MIB) for k in range(1, 5)] + [(k, None) for k in range(1, 5)]
    a = replay([*events, (9, 64 * MIB)])  # the four 16 MiB blocks merged back into one 64 MiB block
    assert a.reserved == 64 * MIB


def test_blocks_of_different_segments_never_merge():
    a = replay([(1, 20 * MIB), (2, 20 * MIB), (1, None), (2, None), (3, 40 * MIB)])
    assert a.reserved == 80 * MIB


def test_small_requests_pack_into_2_mib_segments():
    a = replay([(k, 100 * KIB) for k in range(100)])  # 20 of them per segment
    assert a.reserved == 5 * 2 * MIB
    assert a.allocated == 100 * 100 * KIB


def test_small_and_large_pools_are_apart():
    a = replay([(1, 1 * MIB), (1, None), (2, 1 * MIB + 512)])  # the free 2 MiB small segment cannot serve it
    assert a.reserved == 2 * MIB + 20 * MIB


def test_training_replay_state_made_in_the_first_step_displaces_the_next_steps_activation():
    # step: a 100 MiB activation made and freed; the first optimizer step makes 50 MiB of state in the freed block
    # (split: 50 + 50 cached); the second step's 100 MiB fits nowhere: a new segment; the third reuses it: done
    a = replay_training([], [("act", 100 * MIB), ("act", None)], first_step_extra=[("state", 50 * MIB)], extra_at=2)
    assert a.peak_reserved == 200 * MIB
    assert a.peak_allocated == 150 * MIB
    assert a.reserve == 50 * MIB


def test_training_replay_setup_storages_live_throughout():
    a = replay_training([("w", 30 * MIB)], [("x", 40 * MIB), ("x", None)])
    assert (a.peak_reserved, a.peak_allocated, a.allocated) == (70 * MIB, 70 * MIB, 30 * MIB)


def test_a_block_freed_on_one_stream_serves_only_that_streams_requests():
    """``get_free_block`` takes a block only of the requesting stream (``BlockComparatorSize`` compares the stream
    first): a block a side stream's tensor freed stays cached for that stream."""
    allocator = CachingAllocator()
    side = "reduction"
    allocator.free(allocator.malloc(40 * MIB, side))  # a reduction-stream flatten, freed
    assert allocator.reserved == 40 * MIB
    compute = allocator.malloc(40 * MIB)  # the default stream cannot take it: a segment of its own
    assert allocator.reserved == 80 * MIB and compute.stream is None
    again = allocator.malloc(30 * MIB, side)  # the side stream reuses its own block (split: 10 MiB left)
    assert allocator.reserved == 80 * MIB and again.stream == side
    assert allocator.by_stream == {side: 40 * MIB, None: 40 * MIB}
    allocator.free(compute)
    assert allocator.malloc(10 * MIB, side).stream == side and allocator.reserved == 80 * MIB  # its 10 MiB remainder


def test_a_freed_block_merges_only_with_its_own_streams_neighbours():
    allocator = CachingAllocator()
    a, b = allocator.malloc(3 * MIB, "s"), allocator.malloc(3 * MIB, "s")  # one 20 MiB segment of stream s
    allocator.free(a)
    allocator.free(b)
    assert allocator.reserved == 20 * MIB
    assert allocator.malloc(20 * MIB, "s") is not None and allocator.reserved == 20 * MIB  # the whole segment again
    assert allocator.malloc(3 * MIB) is not None and allocator.reserved == 40 * MIB  # the default stream's own


def test_replay_training_allocates_each_key_on_its_stream():
    # a step: an activation, a flatten on the reduction stream (freed), then another activation of the flatten's size
    step = [(1, 100 * MIB), (2, 40 * MIB), (2, None), (3, 40 * MIB), (1, None), (3, None)]
    one = replay_training([], step)
    two = replay_training([], step, streams={2: "reduction"})
    assert one.peak_reserved == 140 * MIB  # one pool: the activation takes the flatten's block
    assert two.peak_reserved == 180 * MIB and two.by_stream == {None: 140 * MIB, "reduction": 40 * MIB}
