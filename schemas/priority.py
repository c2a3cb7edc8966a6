"""Which request-topic partitions carry which priority. Producers and workers both use these functions, so
the mapping is written once; it is simple enough to reimplement in any language from this docstring.

Contiguous blocks: with K = num_partitions // num_priorities partitions per priority, partition p has
priority min(p // K, num_priorities - 1). Priority 0 is the most urgent. When num_partitions is not a
multiple of num_priorities, the leftover partitions (num_partitions % num_priorities of them) join the last,
least urgent priority, so every urgent priority keeps exactly K. The worker's settings always give a multiple
(num_priorities x partitions_per_priority).

Within a priority, `partition_for` picks a partition by CRC-32 (zlib, IEEE 802.3 polynomial, the one in
Java's java.util.zip.CRC32, Go's hash/crc32.ChecksumIEEE and Node's zlib.crc32) of the key's UTF-8 bytes,
taken modulo the priority's partition count: partition p·K + crc32(key) mod K. The key is the request's
`session_id` when it has one, else its `model` when it names one (a LoRA adapter), else its `id`
(GenerationRequest.routing_key): the turns of a conversation then share a partition, and through the sticky
assignor a worker and its prefix cache; the requests of one adapter share a partition too, so the worker that
loaded it serves them instead of every worker loading every adapter. Kafka's own default
partitioner (murmur2 over all partitions) would ignore priority, so producers must name the partition
themselves.
"""

from __future__ import annotations

import zlib


def _check_layout(num_partitions: int, num_priorities: int) -> int:
    """Validate the layout; return K, the partitions of each priority but the last."""
    if num_priorities < 1:
        raise ValueError(f"num_priorities must be >= 1, got {num_priorities}")
    if num_partitions < num_priorities:
        raise ValueError(
            f"num_partitions ({num_partitions}) must be >= num_priorities ({num_priorities}): "
            "every priority needs a partition"
        )
    return num_partitions // num_priorities


def priority_of_partition(partition: int, num_partitions: int, num_priorities: int) -> int:
    """The priority (0 = most urgent) of a request-topic partition."""
    num_per_priority = _check_layout(num_partitions, num_priorities)
    if not 0 <= partition < num_partitions:
        raise ValueError(f"partition {partition} is outside 0..{num_partitions - 1}")
    return min(partition // num_per_priority, num_priorities - 1)


def partitions_for_priority(priority: int, num_partitions: int, num_priorities: int) -> list[int]:
    """The partitions of one priority, ascending."""
    num_per_priority = _check_layout(num_partitions, num_priorities)
    if not 0 <= priority < num_priorities:
        raise ValueError(f"priority {priority} is outside 0..{num_priorities - 1}")
    start = priority * num_per_priority
    end = num_partitions if priority == num_priorities - 1 else start + num_per_priority
    return list(range(start, end))


def partition_for(priority: int, key: str | bytes, num_partitions: int, num_priorities: int) -> int:
    """The partition a producer writes a request of this priority and key (its session id, else its id) to.

    Stable across processes and languages: crc32(utf8(key)) mod len(partitions) picks among the priority's
    partitions.
    """
    partitions = partitions_for_priority(priority, num_partitions, num_priorities)
    key_bytes = key.encode("utf-8") if isinstance(key, str) else bytes(key)
    return partitions[zlib.crc32(key_bytes) % len(partitions)]
