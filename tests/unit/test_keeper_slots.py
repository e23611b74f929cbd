"""Who holds a snapshot keeper's connection slots (launcher/keeper_slots.py), in one process, no sockets."""

from __future__ import annotations

from elastic._agent.launcher.keeper_slots import Slots


def test_idle_strangers_give_way_and_the_jobs_signed_connections_keep_their_slots() -> None:
    slots = Slots(total=4, per_address=2)
    # One stranger address: it holds at most 2 slots and replaces only its own connections.
    assert slots.admit("s1", "6.6.6.6").evict == []
    assert slots.admit("s2", "6.6.6.6").evict == []
    assert slots.admit("s3", "6.6.6.6").evict == ["s1"]
    assert not slots.holds("s1") and slots.counts() == (0, 2)
    # Strangers on many addresses fill the table; a new connection replaces the oldest of the address
    # holding the most unproven ones.
    assert slots.admit("t1", "7.7.7.7").admitted and slots.admit("t2", "8.8.8.8").admitted
    job = slots.admit("job1", "10.0.0.2")
    assert job.admitted and job.evict == ["s2"]
    slots.prove("job1")  # its signed request passed: it keeps its slot from now on
    for i in range(10):  # a stranger reconnecting as fast as it can never takes the job's slot
        admission = slots.admit(f"x{i}", f"9.9.9.{i}")
        assert admission.admitted and "job1" not in admission.evict
    assert slots.holds("job1")
    slots.release("job1")  # its peer closed it
    assert not slots.holds("job1")
    slots.release("s1")  # an evicted connection's handler ending changes nothing
    assert slots.counts() == (0, 3)


def test_only_a_table_full_of_the_jobs_own_traffic_refuses_a_connection() -> None:
    slots = Slots(total=3, per_address=8)
    for name in ("a", "b", "c"):
        assert slots.admit(name, "10.0.0.2").admitted
        slots.prove(name)
    refused = slots.admit("d", "6.6.6.6")
    assert not refused.admitted and refused.evict == [] and not slots.holds("d")
    slots.release("b")
    assert slots.admit("d", "6.6.6.6").admitted
