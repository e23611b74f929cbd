"""Slow ranks read back from an event log (elastic.report.stragglers): the lines and the episodes drawn."""

from __future__ import annotations

from elastic.report.stragglers import Episode, episodes, lines


def event(kind: str, time: object, step: object, **fields: object) -> dict:
    return {"event": kind, "time": time, "step": step, "world_size": 4, "restart": 0, **fields}


def test_each_episode_is_a_line_and_a_span_an_unended_one_to_the_end() -> None:
    log = [
        event("step", 1.0, 1),
        event("straggler", 2.0, 5, rank=3, node="n2", host="h2", slowdown=2.5),
        event("straggler", 2.5, 6, rank=1, node="n1", host="h1", slowdown=1.4),
        event("straggler_recovered", 7.0, 20, rank=3, node="n2", host="h2", slowdown=1.01),
    ]
    assert lines(log) == [
        "straggler from step 5: rank 3 on node n2 (host h2), 2.50x the other ranks' work per sample",
        "straggler from step 6: rank 1 on node n1 (host h1), 1.40x the other ranks' work per sample",
        "straggler recovered at step 20: rank 3 on node n2 (host h2), 1.01x",
    ]
    assert episodes(log) == [Episode(3, 2.0, 7.0), Episode(1, 2.5, None)]


def test_a_log_edited_by_hand_shows_question_marks_and_draws_nothing_it_cannot_place() -> None:
    log = [event("straggler", "noon", "x", rank="one", node=3, slowdown=True),
           event("straggler_recovered", 4.0, 9, rank=2)]  # no episode of rank 2 began
    assert lines(log) == [
        "straggler from step ?: rank ? on node ? (host ?), ? the other ranks' work per sample",
        "straggler recovered at step 9: rank 2 on node ? (host ?), ?",
    ]
    assert episodes(log) == []


def test_the_slowdown_metric_is_the_named_ranks_own_while_its_episode_lasts() -> None:
    from support import samples

    from elastic._worker.observe.events import EventLog
    from elastic._worker.observe.metrics import TrainingMetrics

    per_rank = {rank: TrainingMetrics(rank=rank, run_id="job7", restarts=0, world_size=2, samples_per_step=8)
                for rank in (0, 1)}
    log = EventLog(None, restart=0)
    for metrics in per_rank.values():  # every rank's listeners see every event
        log.subscribe(metrics.observe)
    log.emit("straggler", step=5, world_size=2, rank=1, node="n2", host="h2", slowdown=2.5)
    assert samples(per_rank[1])["torchrevive_rank_slowdown"] == 2.5
    assert samples(per_rank[0])["torchrevive_rank_slowdown"] == 0.0
    log.emit("straggler_recovered", step=9, world_size=2, rank=1, node="n2", host="h2", slowdown=1.01)
    assert samples(per_rank[1])["torchrevive_rank_slowdown"] == 0.0


def test_an_eviction_is_a_line_and_ends_the_episode_a_rank_kept_goes_on() -> None:
    log = [
        event("straggler", 2.0, 5, rank=1, node="n1", host="h1", slowdown=3.5),
        event("straggler", 2.2, 6, rank=2, node="n2", host="h2", slowdown=3.2),
        event("straggler_evicted", 2.0, 5, rank=1, node="n1", host="h1", slowdown=3.5, action="evicted",
              reason="3.50x the median of the others' work per sample, at least --evict-factor 3"),
        event("straggler_evicted", 2.2, 6, rank=2, node="n2", host="h2", slowdown=3.2, action="kept", reason="3.20x"),
    ]
    assert lines(log)[2:] == [
        "straggler evicted at step 5: rank 1 on node n1 (host h1), 3.50x the median of the others' work per sample, "
        "at least --evict-factor 3",
        "straggler kept at step 6: rank 2 on node n2 (host h2), 3.20x",
    ]
    assert episodes(log) == [Episode(1, 2.0, 2.0), Episode(2, 2.2, None)]
