"""Property tests of the sticky priority assignor: balance always holds, and no balanced assignment moves fewer
partitions. The group is simulated through aiokafka's own structs: every member has its own assignor
instance, its subscription and assignment go through their wire encoding, and members join, leave, restart,
come back with what they owned before (a stale claim), or send unreadable user data.

Optimality is checked two ways that share nothing with the assignor's algorithm: against every assignment
of small cases (brute force), and, for the join/leave sequences, with a certificate from LP duality (see
`dual_bound`) that no balanced assignment keeps more partitions with their owners.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from aiokafka.cluster import ClusterMetadata
from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment, ConsumerProtocolMemberMetadata
from aiokafka.protocol.metadata import MetadataResponse_v0
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from worker.transport.kafka.assignor import (
    PriorityRoundRobinAssignor,
    assign_sticky,
    decode_user_data,
    priority_classes,
)

TOPIC = "requests"
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def cluster_with(num_partitions: int) -> ClusterMetadata:
    cluster = ClusterMetadata()
    cluster.update_metadata(MetadataResponse_v0(
        [(0, "localhost", 9092)], [(0, TOPIC, [(0, p, 0, [0], [0]) for p in range(num_partitions)])]))
    return cluster


def classes_of(num_priorities: int, per_priority: int) -> list[list[int]]:
    return [list(range(p * per_priority, (p + 1) * per_priority)) for p in range(num_priorities)]


def is_balanced(classes: list[list[int]], assignment: dict[str, list[int]]) -> bool:
    """Per class and in total, members' counts differ by at most one."""
    counts = [[len(set(c) & set(ps)) for ps in assignment.values()] for c in classes]
    totals = [len(ps) for ps in assignment.values()]
    return all(max(cs) - min(cs) <= 1 for cs in [*counts, totals])


def num_moved(owners: dict[int, str], assignment: dict[str, list[int]]) -> int:
    return sum(1 for p, m in owners.items() if m in assignment and p not in assignment[m])


def dual_bound(classes: list[list[int]], members: list[str], owners: dict[int, str], u: tuple[int, ...]) -> int:
    """An upper bound, for any integer vector u (one entry per class), on the partitions that any balanced
    assignment keeps with their owners.

    Balance fixes each class c's base share q_c = |c| // n and leaves r_c = |c| % n extra partitions, one
    each to r_c distinct members; each member gets the extra of `low` or `high` classes (floor and ceil of
    sum(r) / n), or the totals would differ by more than one. A member m that owns o_cm partitions of c keeps
    at most min(o_cm, q_c) of them, one more if it gets c's extra and o_cm > q_c (g_cm = 1). So kept <= base +
    max sum g.x over those choices x, a bipartite degree-constrained problem whose LP has a totally unimodular
    matrix. Any dual solution bounds it: sum_c r_c u_c + sum_m min_t [phi(t) + sum_c max(0, g_cm - u_c - t)]
    with phi(t) = high*t for t >= 0 and low*t below (weak duality); t over -2..2 is enough here.
    """
    n = len(members)
    base_share = [len(c) // n for c in classes]
    extras = [len(c) % n for c in classes]
    low = sum(extras) // n
    high = low + (sum(extras) % n > 0)
    owned = [[sum(owners.get(p) == m for p in c) for m in members] for c in classes]
    base = sum(min(o, q) for row, q in zip(owned, base_share) for o in row)
    gains = [[int(o > q) for o in row] for row, q in zip(owned, base_share)]
    bound = sum(r * uc for r, uc in zip(extras, u))
    for m in range(n):
        bound += min((high * t if t >= 0 else low * t) + sum(max(0, gains[c][m] - u[c] - t)
                                                              for c in range(len(classes)))
                     for t in range(-2, 3))
    return base + bound


def certify_minimal_movement(classes, members, owners, assignment) -> None:
    """Finds u whose dual bound equals what the assignment keeps: then no balanced assignment keeps more."""
    kept = sum(1 for p, m in owners.items() if m in assignment and p in assignment[m])
    candidates = sorted(itertools.product(range(-1, 3), repeat=len(classes)), key=lambda u: (sum(map(abs, u)), u))
    for u in candidates:
        bound = dual_bound(classes, members, owners, u)
        assert bound >= kept, f"kept {kept} above the bound {bound}: the accounting is wrong"
        if bound == kept:
            return
    raise AssertionError(f"no certificate that keeping {kept} of {len(owners)} owned partitions is the most")


# --- small cases against every assignment -------------------------------------------------------------------

@st.composite
def small_cases(draw):
    num_members = draw(st.integers(1, 3))
    sizes = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3).filter(lambda s: sum(s) <= 7))
    starts = list(itertools.accumulate([0, *sizes]))
    classes = [list(range(a, b)) for a, b in zip(starts, starts[1:])]
    members = [f"m{i}" for i in range(num_members)]
    holders = members + ["gone", None]  # "gone": owned by a member that left
    owners = {p: h for p in range(starts[-1]) if (h := draw(st.sampled_from(holders))) is not None}
    return classes, members, owners


@FAST
@given(small_cases())
def test_small_cases_move_no_more_than_the_best_balanced_assignment(case):
    classes, members, owners = case
    partitions = [p for c in classes for p in c]
    present = {p: m for p, m in owners.items() if m in members}
    out = assign_sticky(classes, members, present)
    assert sorted(p for ps in out.values() for p in ps) == partitions
    assert is_balanced(classes, out)
    best = min(
        num_moved(present, cand)
        for choice in itertools.product(members, repeat=len(partitions))
        if is_balanced(classes, cand := {m: [p for p, o in zip(partitions, choice) if o == m] for m in members})
    )
    assert num_moved(present, out) == best


# --- join/leave sequences through aiokafka's structs ---------------------------------------------------------

@dataclass
class Member:
    assignor: PriorityRoundRobinAssignor
    member_id: str
    garbled: bool = False  # sends unreadable user data at its next join


@dataclass
class Group:
    num_priorities: int
    per_priority: int
    members: list[Member] = field(default_factory=list)
    departed: list[Member] = field(default_factory=list)  # remember what they owned: a stale claim
    wired: bool = True  # the assignors read the group generation (as make_consumer wires them)
    kafka_generation: int = 0  # the broker's: one more at every rebalance
    joins: int = 0

    def new_member(self) -> Member:
        self.joins += 1
        assignor = PriorityRoundRobinAssignor(
            self.num_priorities, group_generation=(lambda: self.kafka_generation) if self.wired else None)
        return Member(assignor, f"w{self.joins:02d}-{self.joins * 7919 % 97}")

    def rebalance(self) -> tuple[dict[int, str], dict[str, list[int]]]:
        """One generation: every member sends its subscription, the leader assigns, everyone hears its part.
        Returns who owned what (the test's own reading of the claims) and the assignment."""
        self.kafka_generation += 1
        wire = {}
        claims = {}
        for member in self.members:
            meta = member.assignor.metadata([TOPIC])
            if member.garbled:
                meta = ConsumerProtocolMemberMetadata(meta.version, meta.subscription, b"\x00not json")
            wire[member.member_id] = ConsumerProtocolMemberMetadata.decode(meta.encode())
            if not member.garbled:
                claims[member.member_id] = (member.assignor.generation, member.assignor.owned.get(TOPIC, []))
            member.garbled = False
        # Who owns what, read independently: highest generation wins, a tie owns nothing.
        owners: dict[int, str] = {}
        for p in range(self.num_priorities * self.per_priority):
            bids = sorted((g, m) for m, (g, ps) in claims.items() if p in ps)
            if bids and (len(bids) == 1 or bids[-1][0] > bids[-2][0]):
                owners[p] = bids[-1][1]
        cluster = cluster_with(self.num_priorities * self.per_priority)
        leader = self.members[-1].assignor
        result = leader.assign(cluster, wire)
        again = self.members[0].assignor.assign(cluster, dict(reversed(wire.items())))
        # The same assignment whoever leads (what each member held through missed generations, `kept`, depends
        # on the generations the leader made, so it is left out).
        assert {m: (a.assignment, decode_user_data(a.user_data).generation) for m, a in result.items()} == \
            {m: (a.assignment, decode_user_data(a.user_data).generation) for m, a in again.items()}
        assignment = {}
        for member in self.members:
            received = ConsumerProtocolMemberAssignment.decode(result[member.member_id].encode())
            member.assignor.on_assignment(received)
            assignment[member.member_id] = [p for t, ps in received.assignment for p in ps if t == TOPIC]
        return owners, assignment


OPS = st.sampled_from(["join", "leave", "rejoin_stale", "restart", "garble", "same"])


@FAST
@given(num_priorities=st.integers(1, 4), per_priority=st.integers(1, 6), num_members=st.integers(1, 8),
       ops=st.lists(st.tuples(OPS, st.integers(0, 7)), max_size=8), wired=st.booleans())
def test_join_leave_sequences_stay_balanced_and_move_the_fewest_partitions(
        num_priorities, per_priority, num_members, ops, wired):
    group = Group(num_priorities, per_priority, wired=wired)
    group.members = [group.new_member() for _ in range(num_members)]
    classes = classes_of(num_priorities, per_priority)
    for op, i in [("same", 0), *ops]:
        if op == "join" and len(group.members) < 8:
            group.members.append(group.new_member())
        elif op == "leave" and len(group.members) > 1:
            group.departed.append(group.members.pop(i % len(group.members)))
        elif op == "rejoin_stale" and group.departed and len(group.members) < 8:
            # Back with what it owned when it left, under a new member id (Kafka gives it one).
            member = group.departed.pop(i % len(group.departed))
            group.joins += 1
            member.member_id = f"back{group.joins:02d}"
            group.members.append(member)
        elif op == "restart":
            group.members[i % len(group.members)] = group.new_member()
        elif op == "garble":
            group.members[i % len(group.members)].garbled = True
        owners, out = group.rebalance()
        member_ids = sorted(out)
        assert sorted(p for ps in out.values() for p in ps) == list(range(num_priorities * per_priority))
        assert is_balanced(classes, out)
        certify_minimal_movement(classes, member_ids, owners, out)
        if op == "same":  # the claims are the last assignment, which is balanced: nothing needs to move
            assert num_moved(owners, out) == 0
        generations = {m.assignor.generation for m in group.members}
        assert len(generations) == 1  # everyone heard the same stamp
        if wired:  # the stamp is the group's generation: it only grows, so a stale claim always loses
            assert generations == {group.kafka_generation}


def test_a_rebalance_with_nothing_changed_moves_nothing():
    group = Group(3, 2)
    group.members = [group.new_member() for _ in range(3)]
    _, first = group.rebalance()
    owners, second = group.rebalance()
    assert second == first and len(owners) == 6 and num_moved(owners, second) == 0


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=64) | st.text(max_size=40).map(str.encode))
def test_any_user_data_decodes_or_is_ignored(data):
    decoded = decode_user_data(data)
    assert decoded is None or (decoded.generation >= 0 and all(p >= 0 for ps in decoded.owned.values() for p in ps))


@FAST
@given(st.integers(1, 4), st.integers(1, 4), st.integers(0, 5), st.integers(1, 6))
def test_a_grown_topic_is_balanced_too(num_priorities, per_priority, num_grown, num_members):
    layout = num_priorities * per_priority
    classes = priority_classes(range(layout + num_grown), num_priorities, layout)
    out = assign_sticky(classes, [f"m{i}" for i in range(num_members)])
    assert is_balanced(classes, out)
    assert sorted(p for ps in out.values() for p in ps) == list(range(layout + num_grown))
