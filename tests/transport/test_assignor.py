"""The priority-aware assignor: every worker gets every priority where counts allow, totals balanced, and a
rebalance leaves partitions where they are whenever balance allows. Random join/leave sequences are in
test_assignor_properties.py."""

import asyncio

import pytest
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener
from aiokafka.cluster import ClusterMetadata
from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment, ConsumerProtocolMemberMetadata
from aiokafka.protocol.metadata import MetadataResponse_v0

from schemas.priority import priority_of_partition
from worker.transport.kafka.aiokafka_compat import group_generation
from worker.transport.kafka.assignor import (
    PriorityRoundRobinAssignor,
    assign_by_priority,
    assign_sticky,
    decode_user_data,
    encode_user_data,
    resolve_owners,
)


def test_one_worker_gets_everything():
    assert assign_by_priority(6, 3, ["w"]) == {"w": [0, 1, 2, 3, 4, 5]}


def test_two_workers_each_get_one_partition_of_every_priority():
    out = assign_by_priority(6, 3, ["b", "a"])
    assert out == {"a": [0, 2, 4], "b": [1, 3, 5]}


def test_three_workers_rotate_the_surplus():
    out = assign_by_priority(6, 3, ["w0", "w1", "w2"])
    assert out == {"w0": [0, 3], "w1": [1, 4], "w2": [2, 5]}
    assert sorted(len(v) for v in out.values()) == [2, 2, 2]


@pytest.mark.parametrize("num_members", [1, 2, 3, 4, 5, 7, 10])
@pytest.mark.parametrize("num_per_priority", [1, 2, 3, 4])
def test_balance_and_coverage(num_members, num_per_priority):
    num_priorities = 3
    num_partitions = num_priorities * num_per_priority
    members = [f"m{i}" for i in range(num_members)]
    out = assign_by_priority(num_partitions, num_priorities, members)
    assigned = sorted(p for ps in out.values() for p in ps)
    assert assigned == list(range(num_partitions))  # each exactly once
    totals = [len(ps) for ps in out.values()]
    assert max(totals) - min(totals) <= 1
    for priority in range(num_priorities):
        counts = [sum(priority_of_partition(p, num_partitions, num_priorities) == priority for p in ps)
                  for ps in out.values()]
        assert max(counts) - min(counts) <= 1
        if num_members <= num_per_priority:
            assert min(counts) >= 1  # every worker can serve this priority


def test_the_aiokafka_interface_on_real_cluster_metadata():
    cluster = ClusterMetadata()
    # Feed a metadata response the way the client does: a topic with 6 partitions.
    from aiokafka.protocol.metadata import MetadataResponse_v0

    response = MetadataResponse_v0(
        [(0, "localhost", 9092)],
        [(0, "requests", [(0, p, 0, [0], [0]) for p in range(6)])],
    )
    cluster.update_metadata(response)
    members = {m: ConsumerProtocolMemberMetadata(0, ["requests"], b"") for m in ("m-b", "m-a")}
    assignor = PriorityRoundRobinAssignor(num_priorities=3)
    result = assignor.assign(cluster, members)
    assert result["m-a"].assignment == [("requests", [0, 2, 4])]
    assert result["m-b"].assignment == [("requests", [1, 3, 5])]
    assert assignor.metadata(["requests"]).subscription == ["requests"]
    assert assignor.name == "priority-roundrobin"


def test_a_grown_topic_keeps_the_configured_layout_and_deals_out_the_extra_partitions():
    cluster = ClusterMetadata()
    from aiokafka.protocol.metadata import MetadataResponse_v0

    # Configured 3 x 2 = 6; the topic grew to 9. Taken as its own layout (3 per priority), partition 2 would
    # become priority 0: the assignor must keep dealing 0..5 by the configured layout.
    cluster.update_metadata(MetadataResponse_v0(
        [(0, "localhost", 9092)], [(0, "requests", [(0, p, 0, [0], [0]) for p in range(9)])]))
    members = {m: ConsumerProtocolMemberMetadata(0, ["requests"], b"") for m in ("m-a", "m-b")}
    result = PriorityRoundRobinAssignor(num_priorities=3, num_layout_partitions=6).assign(cluster, members)
    assert result["m-a"].assignment == [("requests", [0, 2, 4, 6, 8])]
    assert result["m-b"].assignment == [("requests", [1, 3, 5, 7])]


# --- stickiness ----------------------------------------------------------------------------------------------

def six_partitions() -> ClusterMetadata:
    cluster = ClusterMetadata()
    cluster.update_metadata(MetadataResponse_v0(
        [(0, "localhost", 9092)], [(0, "requests", [(0, p, 0, [0], [0]) for p in range(6)])]))
    return cluster


def rebalance(assignors: dict[str, PriorityRoundRobinAssignor]) -> dict[str, list[int]]:
    """One generation through the wire encoding: subscriptions in, the last member leads, assignments out."""
    wire = {m: ConsumerProtocolMemberMetadata.decode(a.metadata(["requests"]).encode()) for m, a in assignors.items()}
    result = list(assignors.values())[-1].assign(six_partitions(), wire)
    out = {}
    for member, assignor in assignors.items():
        assignor.on_assignment(ConsumerProtocolMemberAssignment.decode(result[member].encode()))
        out[member] = assignor.owned.get("requests", [])
    return out


def claim(generation: int, partitions: list[int],
          group_generation: int | None = None) -> ConsumerProtocolMemberMetadata:
    """A member's subscription: what it owns since its last assignment, stamped `generation`, of group generation
    `group_generation` (default: the stamp, as when the leader knew the group's)."""
    return ConsumerProtocolMemberMetadata(0, ["requests"], encode_user_data(
        generation, {"requests": partitions}, group_generation=generation if group_generation is None
        else group_generation))


def test_a_third_worker_takes_two_partitions_and_the_others_keep_the_rest():
    """The issue's measurement: 2 workers, 3 priorities x 2 partitions, a third joins. The eager round-robin
    moved 4 of 6 ({w1: 0,2,4; w2: 1,3,5} -> {w1: 0,3; w2: 1,4; w3: 2,5}); 2 is the least that balances.
    Balanced here means: every worker owns 2 partitions, of 2 different priorities, and each priority's 2
    partitions sit on 2 different workers (6 = 3 x 2 cannot give every worker every priority)."""
    assignors = {m: PriorityRoundRobinAssignor(3) for m in ("w1", "w2")}
    before = rebalance(assignors)
    assert before == {"w1": [0, 2, 4], "w2": [1, 3, 5]}
    assignors["w3"] = PriorityRoundRobinAssignor(3)
    after = rebalance(assignors)
    moved = [p for m in ("w1", "w2") for p in before[m] if p not in after[m]]
    assert len(moved) == 2 and sorted(after["w3"]) == sorted(moved)
    for partitions in after.values():
        assert len(partitions) == 2
        assert len({priority_of_partition(p, 6, 3) for p in partitions}) == 2
    for priority in range(3):
        owners = [m for m, ps in after.items() for p in ps if priority_of_partition(p, 6, 3) == priority]
        assert len(owners) == len(set(owners)) == 2
    assert rebalance(assignors) == after  # nothing changed: nothing moves


def test_a_leaving_worker_hands_over_only_its_own_partitions():
    assignors = {m: PriorityRoundRobinAssignor(3) for m in ("w1", "w2", "w3")}
    before = rebalance(assignors)
    del assignors["w2"]
    after = rebalance(assignors)
    for member in ("w1", "w3"):
        assert set(before[member]) <= set(after[member])
    assert sorted(after["w1"] + after["w3"]) == list(range(6))


def test_a_stale_claim_loses_to_the_current_owner():
    """b missed the rebalance in which a got partition 0; back, both claim it. One priority of six partitions,
    so each member gets three: there is room for either to keep 0, and the higher generation does."""
    def partitions(result, member):
        return [tp.partition for tp in result[member].partitions()]

    assignor = PriorityRoundRobinAssignor(num_priorities=1)
    result = assignor.assign(six_partitions(), {"a": claim(2, [0, 1]), "b": claim(1, [0])})
    assert partitions(result, "a") == [0, 1, 2] and partitions(result, "b") == [3, 4, 5]
    result = assignor.assign(six_partitions(), {"a": claim(1, [0, 1]), "b": claim(2, [0])})
    assert 0 in partitions(result, "b") and 0 not in partitions(result, "a")


def test_claim_conflicts_resolve_by_generation_and_a_tie_owns_nothing():
    assert resolve_owners({"a": (2, [0, 1]), "b": (1, [0, 2])}) == {0: "a", 1: "a", 2: "b"}
    assert resolve_owners({"a": (2, [0, 1]), "b": (2, [0])}) == {1: "a"}
    assert resolve_owners({"a": (3, [5, 5])}) == {5: "a"}


def test_the_stamp_is_the_group_generation_when_the_assignor_is_told_it():
    group_generation = 41
    assignor = PriorityRoundRobinAssignor(3, group_generation=lambda: group_generation)
    result = assignor.assign(six_partitions(), {"a": claim(7, [0, 1]), "b": claim(0, [])})
    assert decode_user_data(result["a"].user_data).generation == 41
    # Without it, one more than the highest claim: the assignor's own counter.
    result = PriorityRoundRobinAssignor(3).assign(six_partitions(), {"a": claim(7, [0, 1]), "b": claim(0, [])})
    assert decode_user_data(result["a"].user_data).generation == 8


def test_a_member_reports_what_it_got_and_the_stamp_it_got_it_under():
    assignor = PriorityRoundRobinAssignor(3)
    assert decode_user_data(assignor.metadata(["requests"]).user_data).owned == {}
    assignor.on_assignment(ConsumerProtocolMemberAssignment(0, [("requests", [4, 0])], encode_user_data(9)))
    reported = decode_user_data(assignor.metadata(["requests"]).user_data)
    assert (reported.generation, reported.owned) == (9, {"requests": [0, 4]})


def test_mixed_versions_share_a_group():
    """A worker on the previous version sends no user data (it owns nothing here) and stamps nothing when it
    leads; the new workers keep their generation then, or take the group's when they can read it."""
    members = {"new": claim(5, [0, 2, 4]), "old": ConsumerProtocolMemberMetadata(0, ["requests"], b"")}
    result = PriorityRoundRobinAssignor(3).assign(six_partitions(), members)
    assert [tp.partition for tp in result["new"].partitions()] == [0, 2, 4]
    assert [tp.partition for tp in result["old"].partitions()] == [1, 3, 5]
    new = PriorityRoundRobinAssignor(3)
    new.on_assignment(ConsumerProtocolMemberAssignment(0, [("requests", [0])], encode_user_data(5)))
    new.on_assignment(ConsumerProtocolMemberAssignment(0, [("requests", [0, 2])], b""))  # an old leader
    assert (new.generation, new.owned) == (5, {"requests": [0, 2]})
    told = PriorityRoundRobinAssignor(3, group_generation=lambda: 12)
    told.on_assignment(ConsumerProtocolMemberAssignment(0, [("requests", [0, 2])], b""))
    assert told.generation == 12


@pytest.mark.parametrize("data", [b"", b"\x00\x01garbage", b"[]", b'{"v": 0}', b'{"v": 1, "generation": -1}',
                                  b'{"v": 1, "owned": {"t": [-3]}}', "\u00e9".encode("latin-1")])
def test_unreadable_user_data_owns_nothing(data):
    assert decode_user_data(data) is None
    member = ConsumerProtocolMemberMetadata(0, ["requests"], data)
    result = PriorityRoundRobinAssignor(3).assign(six_partitions(), {"a": member, "b": claim(1, [1, 3, 5])})
    assert [tp.partition for tp in result["b"].partitions()] == [1, 3, 5]


def test_user_data_is_versioned_json_that_later_versions_may_extend():
    assert encode_user_data(3, {"t": [2, 1, 2]}) == (
        b'{"v":1,"generation":3,"owned":{"t":[1,2]},"since":{},"group_generation":0,"kept":null}')
    assert encode_user_data(3, {"t": [2, 1]}, {"t": {1: 2, 2: 3}}, group_generation=3) == (
        b'{"v":1,"generation":3,"owned":{"t":[1,2]},"since":{"t":[2,3]},"group_generation":3,"kept":null}')
    # What the previous version wrote reads as before: no group generation, nothing said of what was kept.
    earlier = decode_user_data(b'{"v":1,"generation":3,"owned":{"t":[1,2]},"since":{}}')
    assert (earlier.generation, earlier.group_generation, earlier.kept) == (3, 0, None)
    later = decode_user_data(b'{"v": 2, "generation": 4, "owned": {"t": [0]}, "rack": "a"}')
    assert (later.generation, later.owned) == (4, {"t": [0]})


@pytest.mark.kafka
async def test_through_a_real_broker_a_joining_worker_takes_two_partitions(kafka_topics):
    """aiokafka's own coordinator carries the claims and the stamps: the stamp is the group generation, and when
    a third consumer joins two, only two partitions move."""
    kafka = kafka_topics
    consumers: list[AIOKafkaConsumer] = []
    assignors: list[PriorityRoundRobinAssignor] = []

    async def join() -> None:
        assignor = PriorityRoundRobinAssignor(kafka.num_priorities, kafka.num_request_partitions)
        consumer = AIOKafkaConsumer(**kafka.client_kwargs(), group_id=kafka.group_id, enable_auto_commit=False,
                                    partition_assignment_strategy=(assignor,), heartbeat_interval_ms=500)
        assignor.group_generation = lambda: group_generation(consumer)
        await consumer.start()
        consumer.subscribe([kafka.request_topic])
        consumers.append(consumer)
        assignors.append(assignor)

    async def settled() -> list[tuple[int, list[int]]]:
        for _ in range(100):
            await asyncio.gather(*(c.getmany(timeout_ms=100) for c in consumers))
            state = [(group_generation(c), sorted(tp.partition for tp in c.assignment())) for c in consumers]
            if len({g for g, _ in state}) == 1 and sum(len(ps) for _, ps in state) == 6:
                return state
        raise AssertionError(f"the group did not settle: {state}")

    try:
        await join()
        await settled()
        await join()
        before = await settled()
        await join()
        after = await settled()
        assert [len(ps) for _, ps in after] == [2, 2, 2]
        assert sum(len(set(b) - set(a)) for (_, b), (_, a) in zip(before, after)) == 2
        assert [a.generation for a in assignors] == [g for g, _ in after]  # the stamp is the group's generation
    finally:
        for consumer in consumers:
            await consumer.stop()


def test_a_member_over_its_quota_keeps_what_it_has_held_longest():
    classes = [[0, 1, 2, 3]]
    # "b" got 0 long ago (generation 2) and 1, 2 recently (generation 9, when "c" left); "c" is back.
    owners = {0: "b", 1: "b", 2: "b", 3: "a"}
    out = assign_sticky(classes, ["a", "b", "c"], owners, since={0: 2, 1: 9, 2: 9, 3: 2})
    assert 0 in out["b"] and out["a"] == [3] and len(out["c"]) >= 1
    assert set(out["c"]) <= {1, 2}  # the newcomer gets the partitions "b" took over last


def test_members_report_when_they_got_each_partition():
    assignor = PriorityRoundRobinAssignor(1, 4)
    assignor.on_assignment(ConsumerProtocolMemberAssignment(0, [("t", [0, 1])], encode_user_data(5)))
    assignor.on_assignment(ConsumerProtocolMemberAssignment(0, [("t", [1, 2])], encode_user_data(6)))
    reported = decode_user_data(assignor.metadata(["t"]).user_data)
    assert reported.owned == {"t": [1, 2]} and reported.since_of("t") == {1: 5, 2: 6}
    old_format = decode_user_data(b'{"v": 1, "generation": 4, "owned": {"t": [3]}}')
    assert old_format.since_of("t") == {3: 4}


def test_an_assignment_says_what_a_member_held_through_the_generations_it_missed():
    """The leader remembers the assignments it made; a member whose claim is older than the last generation gets,
    in its assignment, the partitions it held through every generation in between, when the leader made them
    all (a join that aborts a generation's syncs leaves its members one generation behind)."""
    group_generation = 5
    assignor = PriorityRoundRobinAssignor(3, group_generation=lambda: group_generation)

    def kept(result, member):
        return decode_user_data(result[member].user_data).kept

    result = assignor.assign(six_partitions(), {"a": claim(4, [0, 2, 4]), "b": claim(4, [1, 3, 5])})
    assert kept(result, "a") == {"requests": [0, 2, 4]}  # the generation right after its claim: all it keeps
    plan5 = assignor.plans[5]
    group_generation = 6  # generation 5's syncs failed: a, b and a newcomer come back claiming generation 4
    result = assignor.assign(six_partitions(), {"a": claim(4, [0, 2, 4]), "b": claim(4, [1, 3, 5]), "c": claim(0, [])})
    for member in ("a", "b"):
        got = [tp.partition for tp in result[member].partitions()]
        assert kept(result, member) == {"requests": [p for p in got if p in plan5[member]["requests"]]}
        assert kept(result, member)["requests"]  # each kept some through generation 5
    assert kept(result, "c") is None  # nothing claimed: nothing to tell
    # A claim from before a generation this leader did not make (3, or 4 here): it cannot tell.
    group_generation = 7
    result = assignor.assign(six_partitions(), {"a": claim(3, [0, 2]), "b": claim(6, [1, 3])})
    b_got = [tp.partition for tp in result["b"].partitions()]
    assert kept(result, "a") is None and kept(result, "b") == {"requests": [p for p in b_got if p in (1, 3)]}
    # A member that does not say its group generation (a stamp can run ahead of the group's): none either.
    result = assignor.assign(six_partitions(), {"a": claim(6, [0, 2], group_generation=0), "b": claim(6, [1, 3])})
    assert kept(result, "a") is None and kept(result, "b") is not None
    # The member reads it from its assignment, and reports the group generation it got it in.
    member = PriorityRoundRobinAssignor(3, group_generation=lambda: 7)
    member.on_assignment(ConsumerProtocolMemberAssignment.decode(result["b"].encode()))
    assert member.kept == decode_user_data(result["b"].user_data).kept
    assert decode_user_data(member.metadata(["requests"]).user_data).group_generation == 7


@pytest.mark.kafka
async def test_through_a_real_broker_a_join_during_the_leaders_assignment_leaves_that_generation_unassigned(
        kafka_topics):
    """A member that joins while the group waits for its leader's assignment fails every sync of that generation:
    the members come back one generation on having held nothing of it. The leader's assignment was that
    generation's only one, so the next assignment tells each member (the follower too) which partitions it held
    through it (what lets a worker keep them: Intake.kept_of)."""
    import threading
    import time

    kafka = kafka_topics
    topic = kafka.request_topic
    got: dict[str, list[tuple[int, list[int]]]] = {"a": [], "b": [], "c": []}
    fourth_joined, stop_fourth = threading.Event(), threading.Event()

    class SlowLeader(PriorityRoundRobinAssignor):
        slow = False

        def assign(self, cluster, members):
            if self.slow and len(members) == 3:
                self.slow = False
                threading.Thread(target=lambda: asyncio.run(fourth()), daemon=True).start()
                assert fourth_joined.wait(20)
                time.sleep(1.0)  # its JoinGroup reaches the coordinator before this assignment's SyncGroup
            return super().assign(cluster, members)

    def consumer_of(assignor: PriorityRoundRobinAssignor) -> AIOKafkaConsumer:
        consumer = AIOKafkaConsumer(**kafka.client_kwargs(), group_id=kafka.group_id, enable_auto_commit=False,
                                    partition_assignment_strategy=(assignor,), heartbeat_interval_ms=500)
        assignor.group_generation = lambda: group_generation(consumer)
        return consumer

    async def fourth() -> None:
        d = consumer_of(PriorityRoundRobinAssignor(kafka.num_priorities))
        await d.start()
        d.subscribe([topic])
        fourth_joined.set()
        while not stop_fourth.is_set():
            await d.getmany(timeout_ms=100)
        await d.stop()

    class Recorder(ConsumerRebalanceListener):
        def __init__(self, name: str, consumer: AIOKafkaConsumer) -> None:
            self.name, self.consumer = name, consumer

        async def on_partitions_revoked(self, revoked) -> None:
            pass

        async def on_partitions_assigned(self, assigned) -> None:
            got[self.name].append((group_generation(self.consumer), sorted(tp.partition for tp in assigned)))

    consumers: dict[str, tuple[AIOKafkaConsumer, PriorityRoundRobinAssignor]] = {}

    async def join(name: str, assignor: PriorityRoundRobinAssignor) -> None:
        consumer = consumer_of(assignor)
        await consumer.start()
        consumer.subscribe([topic], listener=Recorder(name, consumer))
        consumers[name] = (consumer, assignor)
        for _ in range(300):
            await asyncio.gather(*(c.getmany(timeout_ms=100) for c, _ in consumers.values()))
            if got[name] and len({gs[-1][0] for gs in got.values() if gs}) == 1:
                return
        raise AssertionError(f"{name} did not get an assignment: {got}")

    leader = SlowLeader(kafka.num_priorities)
    try:
        await join("a", leader)
        await join("b", PriorityRoundRobinAssignor(kafka.num_priorities))
        leader.slow = True
        await join("c", PriorityRoundRobinAssignor(kafka.num_priorities))  # its generation's syncs fail
        (g1, _), (g2, a2), (g4, a4) = got["a"]
        (b2_gen, b2), (b4_gen, b4) = got["b"]
        assert (g2, b2_gen) == (g1 + 1, g1 + 1) and g4 == b4_gen == g2 + 2 and got["c"][0][0] == g4, got
        plan = leader.plans[g2 + 1]  # the aborted generation's assignment, never handed out
        b_id = consumers["b"][0]._coordinator.member_id
        a_id = consumers["a"][0]._coordinator.member_id
        b_kept = [p for p in b4 if p in b2 and p in plan[b_id][topic]]
        assert consumers["b"][1].kept == {topic: b_kept} and b_kept, (b2, plan[b_id], b4)
        assert leader.kept == {topic: [p for p in a4 if p in a2 and p in plan[a_id][topic]]}
    finally:
        stop_fourth.set()
        for consumer, _ in consumers.values():
            await consumer.stop()
