"""Pure: the records of a change of a node's readiness, as the node board tells them.

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

__all__ = ["ChangeKind", "NodeChange"]


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
    """

    kind: ChangeKind
    node: str
    reason: str
    remaining: float = 0.0
    model: str | None = None
    error: str | None = None
