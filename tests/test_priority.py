"""The priority <-> partition mapping that producers and workers share."""

from __future__ import annotations

import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.priority import partition_for, partitions_for_priority, priority_of_partition

LAYOUTS = [(num_partitions, num_priorities) for num_priorities in range(1, 9)
           for num_partitions in range(num_priorities, 41)]


def test_blocks_partition_the_topic():
    for num_partitions, num_priorities in LAYOUTS:
        check_layout(num_partitions, num_priorities)


def check_layout(num_partitions: int, num_priorities: int) -> None:
    blocks = [partitions_for_priority(p, num_partitions, num_priorities) for p in range(num_priorities)]
    # Together the blocks are every partition, once, in order: contiguous and non-overlapping.
    assert [partition for block in blocks for partition in block] == list(range(num_partitions))
    num_per_priority = num_partitions // num_priorities
    assert all(len(block) == num_per_priority for block in blocks[:-1])
    assert len(blocks[-1]) == num_per_priority + num_partitions % num_priorities  # leftovers go last
    for priority, block in enumerate(blocks):
        for partition in block:
            assert priority_of_partition(partition, num_partitions, num_priorities) == priority


def test_worked_examples():
    assert [partitions_for_priority(p, 6, 3) for p in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert [partitions_for_priority(p, 8, 3) for p in range(3)] == [[0, 1], [2, 3], [4, 5, 6, 7]]
    assert [priority_of_partition(p, 5, 5) for p in range(5)] == [0, 1, 2, 3, 4]
    assert partitions_for_priority(0, 7, 1) == list(range(7))


@pytest.mark.parametrize(
    "call",
    [
        lambda: priority_of_partition(0, 2, 3),  # fewer partitions than priorities
        lambda: partitions_for_priority(0, 2, 3),
        lambda: partition_for(0, "k", 2, 3),
        lambda: priority_of_partition(0, 4, 0),
        lambda: priority_of_partition(4, 4, 2),
        lambda: priority_of_partition(-1, 4, 2),
        lambda: partitions_for_priority(2, 4, 2),
        lambda: partitions_for_priority(-1, 4, 2),
    ],
)
def test_bad_arguments_raise(call):
    with pytest.raises(ValueError):
        call()


@st.composite
def layouts(draw):
    num_priorities = draw(st.integers(1, 16))
    num_partitions = draw(st.integers(num_priorities, 300))
    return num_partitions, num_priorities


@settings(max_examples=200, deadline=None)
@given(layouts(), st.data(), st.text(max_size=40))
def test_partition_for_lands_in_its_priority_and_is_stable(layout, data, key):
    num_partitions, num_priorities = layout
    priority = data.draw(st.integers(0, num_priorities - 1))
    partition = partition_for(priority, key, num_partitions, num_priorities)
    assert partition in partitions_for_priority(priority, num_partitions, num_priorities)
    assert priority_of_partition(partition, num_partitions, num_priorities) == priority
    assert partition_for(priority, key.encode("utf-8"), num_partitions, num_priorities) == partition


def test_partition_for_is_standard_crc32():
    # 0xCBF43926 is CRC-32's published check value for "123456789": an implementation in another
    # language that passes its own check-value test picks the same partitions.
    assert zlib.crc32(b"123456789") == 0xCBF43926
    assert partition_for(1, "123456789", 30, 3) == 10 + 0xCBF43926 % 10
    assert partition_for(2, "123456789", 31, 3) == 20 + 0xCBF43926 % 11
    # Non-ASCII keys hash their UTF-8 bytes.
    assert partition_for(0, "clé", 7, 1) == zlib.crc32("clé".encode("utf-8")) % 7


def test_partition_for_spreads_keys():
    counts = [0] * 4
    for i in range(4000):
        counts[partition_for(1, f"req-{i}", 12, 3) - 4] += 1
    assert all(800 < count < 1200 for count in counts), counts


def test_a_conversation_then_an_adapter_then_the_request_picks_the_partition():
    """The routing key: a conversation's turns share a partition, then the requests of one adapter do (they reach
    the worker that has it loaded), and requests of the base spread by their ids."""
    from schemas.request import GenerationRequest

    def partition(**fields) -> int:
        return partition_for(1, GenerationRequest(prompt="p", **fields).routing_key, 12, 3)

    assert GenerationRequest(id="r", prompt="p", session_id="s", model="m").routing_key == "s"
    assert GenerationRequest(id="r", prompt="p", model="m").routing_key == "m"
    assert GenerationRequest(id="r", prompt="p").routing_key == "r"
    assert len({partition(id=f"r{i}", model="support-bot") for i in range(50)}) == 1
    assert len({partition(id=f"r{i}") for i in range(50)}) == 4  # the base: every partition of the priority
    assert len({partition(id=f"r{i}", model=f"tenant-{i}") for i in range(50)}) == 4  # adapters spread too
