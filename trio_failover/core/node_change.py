"""Pure: the node board's records of what it keeps of a node (not its engine's).

The board (``proxy/board.py``) tells every listener each record it applies,
and takes another replica's through the same verb (``NodeBoard.apply``),
with that replica's id as the record's ``origin`` (None: made here). Its
records are these three and ``engine_state.EngineRead``; all four travel
between replicas through one codec (``core/fleet_records.py``).

- ``NodeChange``: a change of the node's readiness (below);
- ``InventoryChange``: the models its last discovery check listed;
- ``LastCheck``: its last finished check, as ``/status`` shows it.

Every change of whether a node takes requests is one ``NodeChange``: it
began cooling (``COOLING``), it takes requests again (``READY``), its last
check could not reach it (``DOWN``), its down flag cleared while a
cooldown still runs (``UP``), or its cooldown ran out with nothing to
tell (``COOLED``: it is down, or it had run out unnoticed). The board
(``proxy/nodes/board.py``) makes them, applies them to its state and hands them
to its listeners; a board over a shared store (issue 31) publishes the
ones it applies and applies the ones other replicas publish. So a record
holds no absolute clock time: the Trio clocks of two processes differ.
``remaining`` is seconds from the moment the record was made.
"""

from __future__ import annotations

import enum

import attrs

from .liveness import CheckRecord

__all__ = ["ChangeKind", "InventoryChange", "LastCheck", "NodeChange"]


class ChangeKind(enum.StrEnum):
    """What happened to a node's readiness."""

    COOLING = "cooling"  # demoted for ``remaining`` seconds (the longer cooldown wins)
    READY = "ready"  # takes requests: no cooldown, not down
    DOWN = "down"  # its last check could not reach it
    UP = "up"  # no longer down, but a cooldown runs on for ``remaining`` seconds
    # Its cooldown ran out, and that is no news: the node is down (still
    # demoted), or it had run out unnoticed when an answer was served.
    COOLED = "cooled"


@attrs.frozen
class NodeChange:
    """One change of one node's readiness.

    Attributes:
        kind: what happened.
        node: the node's name.
        reason: why (a cooldown's outcome, ``expired``, ``success``,
            ``health_check``).
        remaining: with ``COOLING`` and ``UP``, the seconds the node's
            cooldown runs on from the record's making; else 0.
        model: the model a cooldown is for; None: the whole node.
        error: with ``DOWN``, what the failed check said.
        origin: the replica that made it; None: this one.
    """

    kind: ChangeKind
    node: str
    reason: str
    remaining: float = 0.0
    model: str | None = None
    error: str | None = None
    origin: str | None = None


@attrs.frozen
class InventoryChange:
    """A node's inventory, as its last discovery check replaced it.

    Attributes:
        node: the node's name.
        models: the models it listed; None: none it could tell.
        origin: the replica that checked; None: this one.
    """

    node: str
    models: tuple[str, ...] | None
    origin: str | None = None


@attrs.frozen
class LastCheck:
    """A node's last finished check (a liveness check, or discovery's).

    Attributes:
        node: the node's name.
        check: the check, as ``/status`` shows it.
        origin: the replica that checked; None: this one.
    """

    node: str
    check: CheckRecord
    origin: str | None = None
