"""A sticky partition assignor that spreads every priority over the workers ("priority-roundrobin").

Balance, which comes first. A topic's partitions fall into classes: one per priority (schemas.priority, the
same function the producers use) and, when the topic grew past the configured layout, one more for the
partitions past it (the workers never read those, intake.py, but whoever gets them sees and reports them).
With n members, a class of k partitions gives every member k // n or k // n + 1 of them, so every worker owns
partitions of every priority whenever there are at least as many partitions per priority as workers; and
the totals differ by at most one too (each member gets the extra partition of about as many classes as the
others). Kafka's range and round-robin assignors ignore priority: one worker could get only urgent partitions.

Stickiness, second. Each member reports in its subscription's user data the partitions it owns and the
generation at which it got them. Given the balance above, the leader keeps as many partitions with their
owner as possible: it chooses which members get each class's extra partition (a min-cost flow, small: classes
x members) so that the most owners stay within their quota, keeps the partitions each member has held longest
up to its quota (members report when they got each one; ties: the lowest-numbered), and deals out the rest.
Longest held first makes a rolling restart cheap: when a worker leaves, its partitions go to the others; when
it comes back, they give back those newest ones, not work they had long before (whose requests would
restart). Without claims (a fresh group) this is round-robin over the sorted members, the member cursor
carried from one class to the next. The same input always gives the same assignment.

Generations. The leader stamps every assignment with a generation: the group's generation when it is told
one (`group_generation`, which the worker reads from its consumer; Kafka raises it at every rebalance and
keeps it while the group has committed offsets), and never less than one more than the highest generation
any member claims (so without it, the stamp is the assignor's own counter). aiokafka tells an assignor
neither: assign() gets members and metadata only, and on_generation_assignment, which aiokafka's own sticky
assignor defines, is never called (aiokafka 0.14); hence the stamp travels in the assignment's user data. When
two members claim a partition (one missed a rebalance, or a worker came back with what it owned before), the
claim of the higher generation wins; a tie at the highest generation leaves the partition unowned (it moves
wherever balance wants it). Without `group_generation` a stale claim can win in one case: every member that
carried the latest stamp restarted (the counter starts again) while the stale member was away; it then only
decides who keeps which partition, never the balance.

User data: JSON, `{"v": 1, "generation": g, "owned": {topic: [partitions]}, "since": {topic: [generations]}}`
from a member (`since` aligned with `owned`; absent or misaligned: every partition dates from `generation`),
and the same with `owned` empty in an assignment, which may add `"kept": {topic: [partitions]}` (below). Empty or
unreadable user data (a member on the previous
version, which sent none) counts as owning nothing at generation 0; an assignment without a generation (made
by such a leader) leaves the member's generation as it was, or takes the group's when `group_generation` is
given. Readers take any `v` >= 1 and ignore fields they do not know, so later versions may add fields. The
protocol name stays "priority-roundrobin", so old and new workers share a group while a deployment rolls:
either may lead, and every assignment balances each priority.

Held through. A join that reaches the coordinator while the group waits for its leader's assignment fails every
sync of that generation: the members come back one generation on, with no assignment of the one between, and
a worker cannot tell that from a generation it missed while frozen (when another owner may have served its
partitions). That generation had one assignment, though, the leader's, whether or not it was handed out; so a
leader remembers the assignments it makes (`plans`, group generation -> member -> partitions), and when a
member's claim is older than the generation before, its new assignment carries `kept`: the partitions it claimed
and got in every generation since, by those plans (absent when the leader did not make one of them, or stamps
are not group generations). The worker keeps exactly those (Intake.kept_of).
"""

from __future__ import annotations

import logging
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Annotated

import msgspec
from aiokafka.coordinator.assignors.abstract import AbstractPartitionAssignor
from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment, ConsumerProtocolMemberMetadata

from schemas.priority import partitions_for_priority

log = logging.getLogger(__name__)

USER_DATA_VERSION = 1
MAX_GENERATION = 2**31 - 1

Generation = Annotated[int, msgspec.Meta(ge=0, le=MAX_GENERATION)]
Partition = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]


class StickyUserData(msgspec.Struct, frozen=True):
    v: Annotated[int, msgspec.Meta(ge=USER_DATA_VERSION)] = USER_DATA_VERSION
    generation: Generation = 0
    owned: dict[str, list[Partition]] = {}
    since: dict[str, list[Generation]] = {}
    """Per topic, aligned with `owned`: the generation at which the member got each partition (absent: its
    `generation`). Added within version 1: older readers ignore it."""
    group_generation: Generation = 0
    """From a member: the group generation of its last assignment, as its consumer knew it (0: unknown). The stamp
    (`generation`) runs ahead of the group's after the group was recreated; this does not."""
    kept: dict[str, list[Partition]] | None = None
    """In an assignment: per topic, the partitions of it that the member held without a break since its last
    assignment, through every generation in between (whose assignments the leader made and remembers); None
    when the leader cannot tell. Added within version 1: older readers ignore it."""

    def since_of(self, topic: str) -> dict[int, int]:
        owned, since = self.owned.get(topic, []), self.since.get(topic, [])
        if len(since) != len(owned):
            since = [self.generation] * len(owned)
        return dict(zip(owned, since))


def encode_user_data(generation: int, owned: Mapping[str, Iterable[int]] | None = None,
                     since: Mapping[str, Mapping[int, int]] | None = None,
                     kept: Mapping[str, Iterable[int]] | None = None, group_generation: int = 0) -> bytes:
    owned_sorted = {t: sorted(set(ps)) for t, ps in (owned or {}).items()}
    since_lists = {t: [min(generation, (since or {}).get(t, {}).get(p, generation)) for p in ps]
                   for t, ps in owned_sorted.items()} if since else {}
    kept_sorted = None if kept is None else {t: sorted(set(ps)) for t, ps in kept.items()}
    return msgspec.json.encode(StickyUserData(USER_DATA_VERSION, generation, owned_sorted, since_lists,
                                              group_generation, kept_sorted))


def decode_user_data(data: bytes) -> StickyUserData | None:
    """The user data, or None when it is empty or unreadable (never raises)."""
    if not data:
        return None
    try:
        return msgspec.json.decode(data, type=StickyUserData)
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        log.warning("ignoring unreadable assignor user data (%d bytes): %s", len(data), e)
        return None


def resolve_owners(claims: Mapping[str, tuple[int, Iterable[int]]]) -> dict[int, str]:
    """member -> (generation, partitions it claims) to partition -> owner: the claim of the highest generation;
    a tie at the highest leaves the partition without an owner."""
    best: dict[int, tuple[int, list[str]]] = {}
    for member in sorted(claims):
        generation, partitions = claims[member]
        for partition in set(partitions):
            top = best.get(partition)
            if top is None or generation > top[0]:
                best[partition] = (generation, [member])
            elif generation == top[0]:
                top[1].append(member)
    return {p: members[0] for p, (_, members) in best.items() if len(members) == 1}


def priority_classes(
    partitions: Iterable[int], num_priorities: int, num_layout_partitions: int | None = None
) -> list[list[int]]:
    """A topic's partitions by priority (most urgent first), then those past the configured layout."""
    existing = set(partitions)
    if not existing:
        return []
    num_partitions = max(existing) + 1
    layout = min(num_partitions, num_layout_partitions or num_partitions)
    # A topic with fewer partitions than priorities cannot follow the layout; treat it as one priority.
    num_priorities = num_priorities if layout >= num_priorities else 1
    classes = [[p for p in partitions_for_priority(priority, layout, num_priorities) if p in existing]
               for priority in range(num_priorities)]
    classes.append(sorted(p for p in existing if p >= layout))
    return [c for c in classes if c]


def _choose_extras(num_extras: Sequence[int], gains: Sequence[Sequence[int]],
                   preferred: Sequence[Sequence[int]], num_members: int) -> list[list[int]]:
    """For each class c, the num_extras[c] distinct members that get one partition more than the rest, each
    member getting the extra of floor or ceil(total / n) classes; among those choices the most gains (gains[c][m]
    is 1 where member m keeps one more partition with the extra), then the most preferred (the round-robin
    cursor's choice). A min-cost flow source -> class -> member -> sink, by successive shortest paths."""
    num_classes, total = len(num_extras), sum(num_extras)
    low = total // num_members
    high = low + (total % num_members > 0)
    w_gain = total + 1  # one gain outweighs every preference together
    w_low = w_gain * total + total + 1  # filling every member to `low` outweighs everything else
    source, sink = 0, num_classes + num_members + 1
    to: list[int] = []
    cap: list[int] = []
    cost: list[int] = []
    adj: list[list[int]] = [[] for _ in range(sink + 1)]

    def edge(u: int, v: int, capacity: int, unit_cost: int) -> None:  # and its residual twin, at index ^ 1
        for a, b, k, cc in ((u, v, capacity, unit_cost), (v, u, 0, -unit_cost)):
            adj[a].append(len(to))
            to.append(b)
            cap.append(k)
            cost.append(cc)

    for c in range(num_classes):
        edge(source, 1 + c, num_extras[c], 0)
        for m in range(num_members):
            edge(1 + c, 1 + num_classes + m, 1, -(w_gain * gains[c][m] + preferred[c][m]))
    for m in range(num_members):
        edge(1 + num_classes + m, sink, low, -w_low)
        edge(1 + num_classes + m, sink, high - low, 0)
    while True:  # each round pushes one unit along the cheapest augmenting path (SPFA: costs are negative)
        dist: list[int | None] = [None] * (sink + 1)
        via = [-1] * (sink + 1)
        dist[source] = 0
        queue, queued = deque([source]), {source}
        while queue:
            u = queue.popleft()
            queued.discard(u)
            for e in adj[u]:
                v, d = to[e], dist[u] + cost[e]
                if cap[e] > 0 and (dist[v] is None or d < dist[v]):
                    dist[v], via[v] = d, e
                    if v not in queued:
                        queued.add(v)
                        queue.append(v)
        if dist[sink] is None:
            break
        v = sink
        while v != source:
            e = via[v]
            cap[e] -= 1
            cap[e ^ 1] += 1
            v = to[e ^ 1]
    chosen: list[list[int]] = [[] for _ in range(num_classes)]
    for c in range(num_classes):
        for e in adj[1 + c]:
            m = to[e] - 1 - num_classes
            if 0 <= m < num_members and e % 2 == 0 and cap[e] == 0:
                chosen[c].append(m)
    assert [len(ms) for ms in chosen] == list(num_extras), "extras not all placed"
    return chosen


def assign_sticky(classes: Sequence[Sequence[int]], member_ids: Iterable[str],
                  owners: Mapping[int, str] | None = None,
                  since: Mapping[int, int] | None = None) -> dict[str, list[int]]:
    """The rule of the module docstring for one topic: member id -> partitions (ascending). `owners` maps a
    partition to the member that owns it now (conflicts already resolved); other members' claims are ignored.
    `since`: the generation at which its owner got each partition; a member over its quota keeps the ones it
    has held longest (ties: the lowest-numbered)."""
    members = sorted(set(member_ids))
    out: dict[str, list[int]] = {m: [] for m in members}
    if not members:
        return out
    n, owners = len(members), owners or {}
    starts, cursor = [], 0
    for partitions in classes:  # where the round-robin cursor starts each class, carried from class to class
        starts.append(cursor % n)
        cursor += len(partitions)
    since = since or {}
    owned = [[sorted((p for p in partitions if owners.get(p) == m), key=lambda p: (since.get(p, 0), p))
              for m in members] for partitions in classes]
    base = [len(partitions) // n for partitions in classes]
    num_extras = [len(partitions) % n for partitions in classes]
    gains = [[int(len(owned[c][m]) > base[c]) for m in range(n)] for c in range(len(classes))]
    preferred = [[int((m - starts[c]) % n < num_extras[c]) for m in range(n)] for c in range(len(classes))]
    extras = _choose_extras(num_extras, gains, preferred, n)
    for c, partitions in enumerate(classes):
        quota = [base[c] + (m in extras[c]) for m in range(n)]
        kept: set[int] = set()
        for m in range(n):
            keep = owned[c][m][: quota[m]]  # the longest held, when it owns more than its quota
            out[members[m]].extend(keep)
            kept.update(keep)
            quota[m] -= len(keep)
        m = starts[c]
        for partition in sorted(p for p in partitions if p not in kept):
            while quota[m] == 0:
                m = (m + 1) % n
            out[members[m]].append(partition)
            quota[m] -= 1
            m = (m + 1) % n
    for partitions in out.values():
        partitions.sort()
    assert sorted(p for ps in out.values() for p in ps) == sorted(p for c in classes for p in c)
    return out


def assign_by_priority(num_partitions: int, num_priorities: int, member_ids: list[str],
                       owners: Mapping[int, str] | None = None) -> dict[str, list[int]]:
    """assign_sticky over partitions 0..num_partitions-1 laid out in num_priorities priorities."""
    return assign_sticky(priority_classes(range(num_partitions), num_priorities), member_ids, owners)


LED_KEPT = 8
"""Generations whose assignments a leader remembers (PriorityRoundRobinAssignor.plans): a member that missed more
than that starts its partitions over."""


class PriorityRoundRobinAssignor(AbstractPartitionAssignor):
    """aiokafka's side: the leader's assign(), and each member's memory of what it owns for its next join.
    Passed as an instance (aiokafka only calls .name, .assign, .metadata and .on_assignment), so it can carry
    the layout and, per consumer, the ownership."""

    name = "priority-roundrobin"
    version = 0

    def __init__(self, num_priorities: int, num_layout_partitions: int | None = None,
                 group_generation: Callable[[], int] | None = None) -> None:
        self.num_priorities = num_priorities
        self.num_layout_partitions = num_layout_partitions
        """The configured priority layout's partition count. Partitions past it (the topic grew) are dealt out
        as one more class. None: the layout follows the topic."""
        self.group_generation = group_generation
        """The consumer group's current generation (on the leader, during assign: the one being formed)."""
        self.owned: dict[str, list[int]] = {}
        """What this member got in its last assignment, reported at its next join."""
        self.generation = 0
        """The assignor generation of that assignment (0: none yet)."""
        self.since: dict[str, dict[int, int]] = {}
        """Per topic and owned partition, the generation at which this member got it."""
        self.plans: dict[int, dict[str, dict[str, list[int]]]] = {}
        """Group generation -> member -> topic -> partitions: the assignments this member made as the leader of
        the last LED_KEPT generations it led, whether or not that generation's syncs went through (a leader's
        sync that fails leaves every member without that generation's assignment; one that goes through hands
        out this one: either way it was the generation's only assignment)."""
        self.assigned_group_generation = 0
        """The group generation of this member's last assignment (0: unknown), reported at its next join."""
        self.kept: dict[str, list[int]] | None = None
        """What this member's last assignment says it held without a break since the one before (StickyUserData
        .kept); None: unknown."""

    def assign(self, cluster, members: Mapping[str, ConsumerProtocolMemberMetadata]):  # type: ignore[override]
        claims = {m: decode_user_data(meta.user_data) for m, meta in members.items()}
        generation = min(MAX_GENERATION, max(
            1 + max((c.generation for c in claims.values() if c), default=0), self._current_group_generation()))
        by_member: dict[str, dict[str, list[int]]] = defaultdict(dict)
        for topic in sorted({t for meta in members.values() for t in meta.subscription}):
            partitions = cluster.partitions_for_topic(topic)
            if not partitions:
                continue
            subscribers = sorted(m for m, meta in members.items() if topic in meta.subscription)
            owners = resolve_owners({m: (c.generation, c.owned.get(topic, ())) for m in subscribers
                                     if (c := claims[m]) is not None})
            since = {p: claims[owner].since_of(topic).get(p, 0) for p, owner in owners.items()}
            assigned = assign_sticky(priority_classes(partitions, self.num_priorities, self.num_layout_partitions),
                                     subscribers, owners, since)
            moved = sum(1 for p, owner in owners.items() if p in partitions and p not in assigned[owner])
            log.info("assignor generation %d, topic %s: %d members, %d partitions, %d owned before, %d moved",
                     generation, topic, len(subscribers), len(partitions), len(owners), moved)
            for member, ps in assigned.items():
                by_member[member][topic] = ps
        group_generation = self._current_group_generation() if self.group_generation is not None else 0
        if group_generation > 0:
            self.plans[group_generation] = {m: {t: sorted(ps) for t, ps in by_member[m].items()} for m in members}
            for old in sorted(self.plans)[:-LED_KEPT]:
                del self.plans[old]
        return {
            member: ConsumerProtocolMemberAssignment(
                self.version, sorted((t, ps) for t, ps in by_member[member].items() if ps),
                encode_user_data(generation, kept=self._held_since(member, claims[member], group_generation,
                                                                    by_member[member])))
            for member in members
        }

    def _held_since(self, member: str, claim: StickyUserData | None, group_generation: int,
                    assigned: Mapping[str, list[int]]) -> dict[str, list[int]] | None:
        """The partitions of `assigned` that `member` claimed (held at its last assignment, of group generation
        claim.group_generation) and that every generation since gave it, by this leader's plans; None when a
        generation in between is not one this member led, or the member did not say its group generation."""
        if claim is None or group_generation <= 0 or not 0 < claim.group_generation < group_generation:
            return None
        between = range(claim.group_generation + 1, group_generation)
        if any(g not in self.plans for g in between):
            return None
        return {topic: [p for p in ps if p in claim.owned.get(topic, ())
                        and all(p in self.plans[g].get(member, {}).get(topic, ()) for g in between)]
                for topic, ps in assigned.items()}

    def _current_group_generation(self) -> int:
        if self.group_generation is None:
            return 0
        try:
            return self.group_generation()
        except Exception as e:  # noqa: BLE001 - the stamp falls back to the claims; an assignment must still come out
            log.warning("cannot read the group generation, stamping from the claims alone: %r", e)
            return 0

    def metadata(self, topics: Iterable[str]) -> ConsumerProtocolMemberMetadata:  # type: ignore[override]
        return ConsumerProtocolMemberMetadata(self.version, list(topics), encode_user_data(
            self.generation, self.owned, self.since, group_generation=self.assigned_group_generation))

    def on_assignment(self, assignment: ConsumerProtocolMemberAssignment) -> None:  # type: ignore[override]
        before = self.owned
        self.owned = {topic: sorted(partitions) for topic, partitions in assignment.assignment}
        stamp = decode_user_data(assignment.user_data)
        self.kept = stamp.kept if stamp is not None else None
        if self.group_generation is not None:
            self.assigned_group_generation = max(0, self._current_group_generation())
        if stamp is not None:
            self.generation = stamp.generation
        elif self.group_generation is not None:  # a leader on the previous version stamps nothing
            self.generation = max(self.generation, self._current_group_generation())
        # Kept partitions keep their date; new ones date from this assignment.
        self.since = {topic: {p: self.since.get(topic, {}).get(p, self.generation) if p in before.get(topic, ())
                              else self.generation for p in partitions}
                      for topic, partitions in self.owned.items()}
