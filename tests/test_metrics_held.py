"""The per-request series held between scrapes read exactly as prometheus-client's own."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from trio_failover.telemetry.metrics import Metrics

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]

# On, just below and just above bucket bounds, past the last, and zero.
DURATIONS = [0.0, 0.005, 0.0050001, 0.004999, 0.3, 1.0, 2.5, 600.0, 600.5, 1e6]


def samples(metrics: Metrics) -> Samples:
    text = generate_latest(metrics.registry).decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.name.endswith("_created")  # wall-clock times: differ by nature
    }


def update_directly(metrics: Metrics, durations: list[float]) -> None:
    """The same updates through prometheus-client's children, as before the hold."""
    for value in durations:
        metrics.attempts.labels("a", "completed").inc()
        metrics.commits.labels("a").inc()
        metrics.time_to_head.labels("a").observe(value)
        metrics.time_to_commit.labels("a").observe(value / 2)
        metrics.workloads.labels("completed", "anonymous").inc()
        metrics.duration.labels("a").observe(value * 3)
        metrics.affinity_requests.labels("a", "hit" if value < 1 else "miss").inc()
        if value < 1:
            metrics.affinity_matched_bytes.labels("a").inc(int(value * 1000) + 1)


def update_held(metrics: Metrics, durations: list[float]) -> None:
    for value in durations:
        metrics.attempt_ended("a", "completed")
        metrics.committed("a", value, value / 2)
        metrics.finished("completed", "anonymous", "a", value * 3)
        hit = value < 1
        metrics.affinity_served("a", hit, int(value * 1000) + 1 if hit else 0)


def test_held_updates_read_as_direct_ones_across_scrapes() -> None:
    direct, held = Metrics(["a", "b"]), Metrics(["a", "b"])
    for part in (DURATIONS[:4], [], DURATIONS[4:]):  # a scrape after each part
        update_directly(direct, part)
        update_held(held, part)
        assert samples(held) == samples(direct)
    assert samples(held)[
        ("trio_failover_attempts_total", frozenset({("node", "a"), ("outcome", "completed")}))
    ] == len(DURATIONS)


def test_a_workload_without_a_node_counts_but_observes_no_duration() -> None:
    metrics = Metrics(["a"])
    metrics.finished("failed", "anonymous", None, 1.0)
    found = samples(metrics)
    assert (
        found[
            (
                "trio_failover_workloads_total",
                frozenset({("state", "failed"), ("client", "anonymous")}),
            )
        ]
        == 1
    )
    assert found[("trio_failover_workload_duration_seconds_count", frozenset({("node", "a")}))] == 0


def test_a_label_set_gets_its_created_series_at_its_first_count() -> None:
    metrics = Metrics(["a"])
    metrics.attempt_ended("a", "header_timeout")
    # The child exists from the count on, before any scrape adds to it.
    names = {
        (metric.name, sample.name, tuple(sorted(sample.labels.items())))
        for metric in metrics.attempts.collect()
        for sample in metric.samples
    }
    labels = (("node", "a"), ("outcome", "header_timeout"))
    assert ("trio_failover_attempts", "trio_failover_attempts_created", labels) in names


def test_direct_and_held_updates_of_one_series_add_up() -> None:
    metrics = Metrics(["a"])
    metrics.attempt_ended("a", "header_timeout")
    metrics.child(metrics.attempts, "a", "header_timeout").inc()  # a rare path's update
    value = metrics.registry.get_sample_value(
        "trio_failover_attempts_total", {"node": "a", "outcome": "header_timeout"}
    )
    assert value == 2


def test_a_restricted_view_sees_the_held_counts() -> None:
    metrics = Metrics(["a"])
    metrics.committed("a", 0.1, 0.2)
    view = metrics.registry.restricted_registry(["trio_failover_commits_total"])
    text = generate_latest(view).decode()  # type: ignore[arg-type]
    assert 'trio_failover_commits_total{node="a"} 1.0' in text


@pytest.mark.parametrize("value", DURATIONS)
def test_each_value_lands_in_prometheus_client_s_bucket(value: float) -> None:
    direct, held = Metrics(["a"]), Metrics(["a"])
    direct.duration.labels("a").observe(value)
    held.finished("completed", "anonymous", "a", value)
    assert samples(held) == {
        **samples(direct),
        # The direct one skipped the workloads counter.
        (
            "trio_failover_workloads_total",
            frozenset({("state", "completed"), ("client", "anonymous")}),
        ): 1.0,
    }
