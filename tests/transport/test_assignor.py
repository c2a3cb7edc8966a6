"""The priority-aware assignor: every worker gets every priority where counts allow, totals balanced."""

import pytest
from aiokafka.cluster import ClusterMetadata
from aiokafka.coordinator.protocol import ConsumerProtocolMemberMetadata

from schemas.priority import priority_of_partition
from worker.transport.assignor import PriorityRoundRobinAssignor, assign_by_priority


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
