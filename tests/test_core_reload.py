"""core/reload.py and the slot ledger's reconfigure: what a reload changes, as tables."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import attrs
import pytest

from trio_failover.core.config import ClientKey, Config, Upstream
from trio_failover.core.reload import (
    config_document,
    config_from_document,
    diff_configs,
    masked,
)
from trio_failover.core.slots import Exhausted, Granted, Queued, SlotLedger, SlotScheduler

A = Upstream("a", "http://10.0.0.1:8000", capacity=4, headers={"Authorization": "Bearer s1"})
B = Upstream("b", "http://10.0.0.2:8000")
C = Upstream("c", "http://10.0.0.3:8000")
BASE = Config(upstreams=[A, B], clients=[ClientKey("alice", "key-1")])


def with_(**changes: Any) -> Config:
    return attrs.evolve(BASE, **changes)


CASES: list[tuple[str, Config, list[str], list[str]]] = [
    ("nothing", with_(), [], []),
    ("node added", with_(upstreams=[A, B, C]), ["node c added"], []),
    ("node removed", with_(upstreams=[A]), ["node b removed"], []),
    ("reordered", with_(upstreams=[B, A]), ["node order changed"], []),
    (
        "capacity",
        with_(upstreams=[attrs.evolve(A, capacity=1), B]),
        ["node a: capacity changed"],
        [],
    ),
    (
        "url, models and headers",
        with_(
            upstreams=[
                attrs.evolve(
                    A, url="http://10.0.0.9:8000", models=["m"], headers={"Authorization": "x"}
                ),
                B,
            ]
        ),
        ["node a: url, models, headers changed"],
        [],
    ),
    (
        "tls options of a node",
        with_(upstreams=[A, attrs.evolve(B, ca_file="/ca.pem", insecure_skip_verify=True)]),
        ["node b: ca_file, insecure_skip_verify changed"],
        [],
    ),
    (
        "keys",
        with_(clients=[ClientKey("alice", "key-2"), ClientKey("bob", "key-3")]),
        ["client bob added", "client alice: key rotated"],
        [],
    ),
    ("keys off", with_(clients=[]), ["client alice removed"], []),
    ("a timeout", with_(response_header_timeout=60.0), ["response_header_timeout: 120 -> 60"], []),
    ("statuses", with_(retry_status=[429]), ["retry_status: 429,500,502,503,504 -> 429"], []),
    ("admin token", with_(admin_token="t0ken"), ["admin_token changed"], []),
    ("listen", with_(listen="0.0.0.0:8080"), [], ["listen: 127.0.0.1:8080 -> 0.0.0.0:8080"]),
    ("admin listen", with_(admin_listen=None), [], ["admin_listen: 127.0.0.1:8081 -> (none)"]),
    ("log level", with_(log_level="debug"), [], ["log_level: info -> debug"]),
    ("tls on", with_(tls_cert="/c.pem", tls_key="/k.pem"), [], ["tls_cert: turning TLS on"]),
    ("discovery on", with_(discovery_interval=0.0), ["discovery_interval: 30 -> 0"], []),
]


@pytest.mark.parametrize(
    ("new", "changes", "refused"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_diff_configs(new: Config, changes: list[str], refused: list[str]) -> None:
    diff = diff_configs(BASE, new)
    assert diff.changes() == changes
    assert [
        reason.partition(" needs")[0].partition(" or off")[0] for reason in diff.refused
    ] == refused
    assert diff.ok is not refused


def test_no_secret_is_named() -> None:
    new = with_(
        clients=[ClientKey("alice", "key-2")],
        admin_token="t0ken",
        upstreams=[attrs.evolve(A, headers={"Authorization": "Bearer s2"}), B],
    )
    text = repr(diff_configs(BASE, new)) + " ".join(diff_configs(BASE, new).changes())
    for secret in ("key-1", "key-2", "t0ken", "s1", "s2"):
        assert secret not in text


def test_turning_discovery_on_needs_a_restart() -> None:
    off = with_(discovery_interval=0.0)
    assert diff_configs(off, BASE).refused == (
        "discovery_interval: turning discovery on needs a restart",
    )


def test_the_shared_state_needs_a_restart() -> None:
    joined = with_(state="redis://127.0.0.1:6379", lease_ttl=10.0)
    assert [reason.partition(":")[0] for reason in diff_configs(BASE, joined).refused] == [
        "state",
        "lease_ttl",
    ]


def test_the_workers_and_the_shared_state_need_a_restart() -> None:
    # The supervisor started the workers; the state is reached at one address.
    shared = with_(state="redis://r:6379", workers=2)
    assert diff_configs(shared, attrs.evolve(shared, workers=3)).refused == (
        "workers: 2 -> 3 needs a restart",
    )
    moved = attrs.evolve(shared, state="redis://:pw@s:6379", state_prefix="x:")
    assert diff_configs(shared, moved).refused == (
        "state: redis://r:6379 -> redis://***@s:6379 needs a restart",  # no password shown
        "state_prefix: trio-failover: -> x: needs a restart",
    )


def test_tls_files_count_only_with_tls_on() -> None:
    tls = with_(tls_cert="/c.pem", tls_key="/k.pem")
    assert diff_configs(tls, tls, tls_files_changed=True).changes() == [
        "tls certificate files changed"
    ]
    assert diff_configs(BASE, BASE, tls_files_changed=True).changes() == []


@pytest.mark.parametrize(
    ("new", "moves"),
    [
        (with_(upstreams=[attrs.evolve(A, capacity=1), B]), False),
        (with_(upstreams=[A, B, C]), True),
        (with_(upstreams=[A]), True),
        (with_(upstreams=[attrs.evolve(A, headers={}), B]), True),
        (with_(response_header_timeout=1.0), False),
    ],
)
def test_which_changes_make_the_waiters_resolve_again(new: Config, moves: bool) -> None:
    assert diff_configs(BASE, new).nodes_changed is moves


def test_a_masked_document_reads_back_and_shows_no_secret() -> None:
    def mask(secret: str) -> str:
        return "h" + hashlib.sha256(secret.encode()).hexdigest()[:16]

    config = with_(
        admin_token="t0ken",
        upstreams=[A, attrs.evolve(B, url="http://user:pw@10.0.0.2:8000", models={"x": "y"})],
        state="redis://:redis-pw@r:6379",
    )
    text = json.dumps(config_document(masked(config, mask)))
    for secret in ("key-1", "t0ken", "s1", "user:pw", "redis-pw"):
        assert secret not in text
    back = config_from_document(json.loads(text))
    assert diff_configs(back, masked(config, mask)).changes() == []
    rotated = masked(attrs.evolve(config, clients=[ClientKey("alice", "key-2")]), mask)
    assert diff_configs(back, rotated).changes()[0] == "client alice: key rotated"


# -- the ledger and the scheduler ------------------------------------------------------


def test_a_lowered_capacity_takes_nothing_until_under_it() -> None:
    ledger = SlotLedger({"a": 4})
    slots = [ledger.take("a") for _ in range(3)]
    ledger.reconfigure({"a": 1})
    for slot in slots:
        assert ledger.is_full("a")
        ledger.release(slot)
    assert not ledger.is_full("a")
    assert ledger.in_flight("a") == 0


def test_a_removed_node_is_full_until_its_slots_are_back() -> None:
    ledger = SlotLedger({"a": 0, "b": 2})
    slot = ledger.take("a")
    ledger.reconfigure({"b": 2, "c": 1})
    assert ledger.nodes == ("b", "c")
    assert ledger.is_full("a")
    assert ledger.in_flight("a") == 1
    assert ledger.release(slot)
    assert ledger.in_flight("a") == 0
    assert ledger.is_full("a")  # retired: never taken again
    ledger.reconfigure({"a": 0, "b": 2})  # added again: open
    assert not ledger.is_full("a")


def test_reconfigure_checks_the_capacities() -> None:
    ledger = SlotLedger({"a": 1})
    with pytest.raises(ValueError, match="capacity"):
        ledger.reconfigure({"a": -1})
    assert ledger.capacity("a") == 1


def test_the_scheduler_moves_its_waiters_only_when_told() -> None:
    scheduler: SlotScheduler[str] = SlotScheduler({"a": 1})
    first = scheduler.acquire("w0", ["a"], ready=lambda _: True)
    assert isinstance(first, Granted)
    queued = scheduler.acquire("w1", ["a"], ready=lambda _: True)
    assert isinstance(queued, Queued)
    assert scheduler.reconfigure({"a": 1}, balance="priority", max_queue=0, moved=False) == []
    assert len(scheduler) == 1
    moved = scheduler.reconfigure({"b": 1}, balance="priority", max_queue=5, moved=True)
    assert moved == [queued.waiter]
    assert queued.waiter.moved
    assert len(scheduler) == 0
    assert scheduler.max_queue == 5
    assert isinstance(scheduler.acquire("w2", ["a"], ready=lambda _: True), Queued)
    assert isinstance(scheduler.acquire("w3", [], ready=lambda _: True), Exhausted)
