"""A partition assignor that spreads every priority over the workers ("priority-roundrobin").

The rule: for each subscribed topic, walk the priorities from most to least urgent; within a priority,
hand its partitions (ascending) to the members (sorted by member id) round-robin, and let the member
cursor carry on from where the previous priority stopped instead of restarting at the first member.
Hence, per priority, the members' counts differ by at most one (with at least as many partitions per
priority as members, every worker owns partitions of every priority, so each can serve urgent work), and
the totals differ by at most one too (carrying the cursor rotates the starting member per priority, so
the surplus partitions of successive priorities land on different workers).

Kafka's default assignors ignore priority: with range or round-robin over a topic whose partitions are laid
out in priority blocks, one worker can end up with only urgent partitions and another with none.

Priorities come from schemas.priority, the same function the producers use. The assignor is passed as an
instance (aiokafka only calls .name, .assign, .metadata and .on_assignment), so it can carry the number of
priorities.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping

from aiokafka.coordinator.assignors.abstract import AbstractPartitionAssignor
from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment, ConsumerProtocolMemberMetadata

from schemas.priority import partitions_for_priority


def assign_by_priority(
    num_partitions: int, num_priorities: int, member_ids: list[str]
) -> dict[str, list[int]]:
    """The rule above for one topic: member id -> partitions (ascending)."""
    members = sorted(member_ids)
    out: dict[str, list[int]] = {m: [] for m in members}
    if not members:
        return out
    cursor = 0
    for priority in range(min(num_priorities, num_partitions)):
        for partition in partitions_for_priority(priority, num_partitions, num_priorities):
            out[members[cursor % len(members)]].append(partition)
            cursor += 1
    for partitions in out.values():
        partitions.sort()
    return out


class PriorityRoundRobinAssignor(AbstractPartitionAssignor):
    name = "priority-roundrobin"
    version = 0

    def __init__(self, num_priorities: int, num_layout_partitions: int | None = None) -> None:
        self.num_priorities = num_priorities
        self.num_layout_partitions = num_layout_partitions
        """The configured priority layout's partition count. Partitions past it (the topic grew) are dealt
        round-robin after the layout's, so whoever gets them sees and reports them; the workers never read
        them (intake.py). None: the layout follows the topic."""

    def assign(self, cluster, members: Mapping[str, ConsumerProtocolMemberMetadata]):  # type: ignore[override]
        by_member: dict[str, dict[str, list[int]]] = defaultdict(dict)
        topics = sorted({t for meta in members.values() for t in meta.subscription})
        for topic in topics:
            partitions = cluster.partitions_for_topic(topic)
            if not partitions:
                continue
            num_partitions = max(partitions) + 1
            layout = min(num_partitions, self.num_layout_partitions or num_partitions)
            subscribers = sorted(m for m, meta in members.items() if topic in meta.subscription)
            # A topic with fewer partitions than priorities cannot follow the layout; treat it as one priority.
            num_priorities = self.num_priorities if layout >= self.num_priorities else 1
            for member, assigned in assign_by_priority(layout, num_priorities, subscribers).items():
                by_member[member][topic] = [p for p in assigned if p in partitions]
            for i, partition in enumerate(p for p in sorted(partitions) if p >= layout):
                by_member[subscribers[i % len(subscribers)]][topic].append(partition)
        return {
            member: ConsumerProtocolMemberAssignment(
                self.version, sorted((t, ps) for t, ps in by_member[member].items() if ps), b""
            )
            for member in members
        }

    def metadata(self, topics: Iterable[str]) -> ConsumerProtocolMemberMetadata:  # type: ignore[override]
        return ConsumerProtocolMemberMetadata(self.version, list(topics), b"")

    def on_assignment(self, assignment: ConsumerProtocolMemberAssignment) -> None:  # type: ignore[override]
        pass
