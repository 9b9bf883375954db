"""Pure: the node board's records as the replicas share them, and their envelope.

One codec for every record the board tells (``core/node_change.py``,
``engine_state.EngineRead``), driven by the records' own attrs fields: a
table (``KINDS``) names each type's ``kind``, the JSON names that differ
from the attributes, and what a record's age does to it; the rest follows
from each field's type. ``encode`` turns a record into the JSON object
Redis holds, ``decode`` an object another replica wrote back into a record
(None when it is not a whole one of ours). The kinds:

- ``readiness``: one ``NodeChange`` (cooling, ready, down, up, cooled),
  with the seconds its cooldown runs on from its making (``remaining_s``);
- ``inventory``: an ``InventoryChange``, the models a node's last discovery
  check listed (``null``: it listed none it could tell);
- ``last_check``: a ``LastCheck``, the node's last finished check, as
  ``/status`` shows it (its ``kind`` as ``check``);
- ``engine``: one good read of the node's engine (``EngineRead``): its
  ``Detection`` as ``engine``, its ``Signals`` as ``signals``;
- ``served``: cache affinity's record (``affinity.Served``): the node
  served a request whose prompt has this chain of hashes (hex).
- ``share``: a replica's waiting and running clients with their use
  (``fleet_share.ShareSummary``), for fair share across replicas; about no
  node (``Kind.nodeless``).

The rules of the JSON form, one for every type:

- ``node`` and ``origin`` are the envelope's (``{"from": REPLICA, "node":
  NODE|null, "record": {...}}``), not the record's;
- a clock time (a field named ``at``) travels as its age, ``age_s``, since
  the replicas' clocks differ; read back, it is dated on the reader's
  clock, the seconds it lay in Redis (a snapshot's ``age``) included;
- seconds (a JSON name ending in ``_s``) are rounded to the millisecond;
- enums as their values, sets as sorted lists, tuples as lists, mappings
  and nested records as objects;
- read back, a field left out is its default and one not known is
  ignored; a field of the wrong type (a count that is not a whole number
  >= 0, a number that is not finite and >= 0) makes the record not one:
  never half applied.

Each record is kept in the node's hash by its kind (one ``engine`` record,
the latest), a readiness record also by its ``key``, so that the hash keeps
the latest of each part of the node's state: a readiness record's key is
``cooldown`` (its cooldown, or a model's: ``cooldown:MODEL``) or ``down``
(its down flag). A joining replica applies the stored records oldest first
(``snapshot_order``): played in the order they happened, the two parts
give the state they made.
"""

from __future__ import annotations

import enum
import functools
import json
import math
import types
import typing
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

import attrs

from .affinity import Served
from .engine_state import EngineRead
from .fleet_share import ShareSummary
from .node_change import ChangeKind, InventoryChange, LastCheck, NodeChange

__all__ = [
    "KINDS",
    "Kind",
    "Record",
    "RemoteRecord",
    "decode",
    "decode_envelope",
    "encode",
    "encode_envelope",
    "read_snapshot",
    "read_value",
    "record_field",
    "snapshot_order",
    "value_json",
]

Record = NodeChange | InventoryChange | LastCheck | EngineRead | Served | ShareSummary
"""A record of the node board, as the replicas share it."""

ENVELOPE = ("node", "origin")  # the envelope's fields, not the record's
CLOCK, AGE = "at", "age_s"  # a clock time travels as its age


@attrs.frozen
class Kind:
    """How one record type travels (``KINDS``).

    Attributes:
        kind: the record's ``"kind"``.
        type: the record type.
        names: attribute -> JSON name, where they differ.
        inline: a field holding a record whose fields are this record's own
            (``LastCheck.check``).
        key: the record's part of the node's state, its hash field beside
            its kind (None: one per kind).
        aged: the record as it stands ``age`` seconds after it was written;
            None: nothing left to apply.
        nodeless: about no node (a replica's record): read with ``node`` None.
    """

    kind: str
    type: type
    names: Mapping[str, str] = attrs.field(factory=dict)
    inline: str | None = None
    key: Callable[[Any], str] | None = None
    aged: Callable[[Any, float], Any] | None = None
    nodeless: bool = False


# The part of a node's state each kind of change sets (its record's key).
_PART = {
    ChangeKind.COOLING: "cooldown",
    ChangeKind.COOLED: "cooldown",
    ChangeKind.READY: "cooldown",  # clears the down flag too: played in order, it wins
    ChangeKind.DOWN: "down",
    ChangeKind.UP: "down",
}


def _change_key(change: NodeChange) -> str:
    part = _PART[change.kind]
    return part if change.model is None or part != "cooldown" else f"{part}:{change.model}"


def _aged_change(change: NodeChange, age: float) -> NodeChange | None:
    """What is left of ``change`` ``age`` seconds on; None: a cooldown that ran out.

    Nothing left to apply then: this replica's own ticker sees to expiries.
    """
    left = max(0.0, change.remaining - max(0.0, age))
    if change.kind is ChangeKind.COOLING and left <= 0:
        return None
    if change.kind is ChangeKind.UP and left <= 0:
        change = attrs.evolve(change, kind=ChangeKind.READY)  # its cooldown ran out too
    return attrs.evolve(change, remaining=left)


KINDS = (
    Kind(
        "readiness",
        NodeChange,
        names={"kind": "change", "remaining": "remaining_s"},
        key=_change_key,
        aged=_aged_change,
    ),
    Kind("inventory", InventoryChange),
    Kind("last_check", LastCheck, names={"kind": "check"}, inline="check"),
    Kind("engine", EngineRead),
    Kind("served", Served),
    Kind("share", ShareSummary, nodeless=True),
)
_BY_TYPE = {kind.type: kind for kind in KINDS}
_BY_KIND = {kind.kind: kind for kind in KINDS}


# -- records -------------------------------------------------------------------------


def encode(record: Record, now: float) -> dict[str, Any]:
    """The JSON object of ``record``, written at ``now`` (this process's clock)."""
    kind = _BY_TYPE[type(record)]
    document: dict[str, Any] = {"kind": kind.kind}
    if kind.key is not None:
        document["key"] = kind.key(record)
    document.update(_fields_json(record, kind.names, now, skip={*ENVELOPE, kind.inline}))
    if kind.inline is not None:
        document.update(_fields_json(getattr(record, kind.inline), kind.names, now))
    return document


def decode(remote: RemoteRecord, now: float) -> Record | None:
    """The record ``remote`` carries, dated on this clock (``now``); never raises.

    None when it is not a whole record of ours (another version's kind, a
    field of the wrong type), when it is about no node (or, for a
    ``nodeless`` kind, about one), or when nothing of
    it is left to apply (``Kind.aged``).
    """
    kind = _BY_KIND.get(str(remote.record.get("kind")))
    if kind is None or (remote.node is None) != kind.nodeless:
        return None
    clock = (now, remote.age)
    fields: dict[str, Any] = {"node": remote.node, "origin": remote.origin}
    try:
        fields.update(
            _read_fields(kind.type, remote.record, "", kind.names, clock, {*ENVELOPE, kind.inline})
        )
        if kind.inline is not None:
            inline = _hints(kind.type)[kind.inline]
            fields[kind.inline] = _read_object(inline, remote.record, "", kind.names, clock)
    except ValueError:
        return None
    record: Record = kind.type(**fields)
    return (
        record if kind.aged is None else typing.cast(Record | None, kind.aged(record, remote.age))
    )


def value_json(value: Any) -> Any:
    """Any value of a record's field (``Signals``, ``Detection``, ...) in its JSON form."""
    return _json(value, "", 0.0)


def read_value(hint: Any, document: object, where: str) -> Any:
    """The value of type ``hint`` whose JSON form is ``document``.

    Raises:
        ValueError: not one; the message names the field by ``where``
            (``signals.busy: expected a whole number >= 0 or null``).
    """
    return _read(hint, document, where, (0.0, 0.0))


# -- the codec, by the fields' types -------------------------------------------------


def _fields_json(
    record: Any, names: Mapping[str, str], now: float, skip: Collection[str | None] = ()
) -> dict[str, Any]:
    document: dict[str, Any] = {}
    for field in attrs.fields(type(record)):
        if field.name in skip:
            continue
        value = getattr(record, field.name)
        if field.name == CLOCK:
            document[AGE] = round(max(0.0, now - value), 3)
            continue
        name = names.get(field.name, field.name)
        document[name] = _json(value, name, now)
    return document


def _json(value: Any, name: str, now: float) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if attrs.has(type(value)):
        return _fields_json(value, {}, now)
    if isinstance(value, frozenset):
        return sorted(_json(item, name, now) for item in value)
    if isinstance(value, tuple | list):
        return [_json(item, name, now) for item in value]
    if isinstance(value, Mapping):
        return {key: _json(item, name, now) for key, item in sorted(value.items())}
    if isinstance(value, float) and name.endswith("_s"):
        return round(value, 3)
    return value


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _read_object(
    cls: type,
    document: object,
    where: str,
    names: Mapping[str, str],
    clock: tuple[float, float],
) -> Any:
    if not isinstance(document, dict):
        raise ValueError(f"{where}: expected an object, got {document!r}")
    return cls(**_read_fields(cls, document, where, names, clock))


def _read_fields(
    cls: type,
    document: Mapping[str, Any],
    where: str,
    names: Mapping[str, str],
    clock: tuple[float, float],
    skip: Collection[str | None] = (),
) -> dict[str, Any]:
    hints, fields = _hints(cls), {}
    for field in attrs.fields(cls):
        if field.name in skip:
            continue
        name = AGE if field.name == CLOCK else names.get(field.name, field.name)
        path = f"{where}.{name}" if where else name
        if field.name == CLOCK:
            now, age = clock
            fields[field.name] = now - max(0.0, age) - _number(document.get(name, 0.0), path)
        elif name in document or field.default is attrs.NOTHING:
            fields[field.name] = _read(hints[field.name], document.get(name), path, clock)
    return fields


def _read(hint: Any, value: object, where: str, clock: tuple[float, float]) -> Any:
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = (arg for arg in args if arg is not type(None))
        return _read(inner, value, where, clock)
    origin = typing.get_origin(hint) or hint
    if origin in (frozenset, tuple):
        if not isinstance(value, list):
            raise ValueError(f"{where}: expected a list, got {value!r}")
        return origin(_read(args[0], item, where, clock) for item in value)
    if origin in (Mapping, dict):
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected an object, got {value!r}")
        return {
            _text(key, where): _read(args[1], item, f"{where}.{key}", clock)
            for key, item in value.items()
        }
    if attrs.has(origin):
        return _read_object(origin, value, where, {}, clock)
    if isinstance(origin, type) and issubclass(origin, enum.Enum):
        try:
            return origin(_text(value, where))
        except ValueError:
            raise ValueError(f"{where}: not a {origin.__name__}: {value!r}") from None
    reader = _SCALARS.get(origin)
    if reader is None:  # a record type this codec was not taught: a bug, not bad data
        raise TypeError(f"{where}: no JSON form for {hint!r}")
    return reader(value, where)


def _text(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where}: expected a string, got {value!r}")
    return value


def _flag(value: object, where: str) -> bool:
    if type(value) is not bool:
        raise ValueError(f"{where}: expected true or false, got {value!r}")
    return value


def _whole(value: object, where: str) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"{where}: expected a whole number >= 0, got {value!r}")
    return value


def _number(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}: expected a number >= 0, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}: expected a finite number >= 0, got {value!r}")
    return float(value)


_SCALARS: dict[Any, Callable[[object, str], Any]] = {
    str: _text,
    bool: _flag,
    int: _whole,
    float: _number,
}


# -- the envelope ----------------------------------------------------------------------


@attrs.frozen
class RemoteRecord:
    """A record another replica published, or one loaded from the snapshot.

    Attributes:
        origin: the replica that wrote it (its id).
        node: the node it is about, or None.
        record: the record's JSON object (a ``"kind"`` in it): ``decode`` reads it.
        age: seconds since it was written, by Redis' clock: 0.0 for a record
            just told, more for one loaded from the snapshot.
    """

    origin: str
    node: str | None
    record: Mapping[str, Any]
    age: float = 0.0


def encode_envelope(origin: str, node: str | None, record: Mapping[str, Any]) -> bytes:
    """The envelope of ``record`` as published and stored.

    Raises:
        ValueError: the record has no string ``"kind"``, or is not JSON-serialisable
            (``TypeError`` from ``json`` becomes this too).
    """
    if not isinstance(record.get("kind"), str):
        raise ValueError(f"a record needs a string 'kind': {record!r}")
    try:
        text = json.dumps({"from": origin, "node": node, "record": dict(record)}, allow_nan=False)
    except (TypeError, ValueError) as exc:  # ValueError: NaN or infinity
        raise ValueError(f"a record must be JSON-serialisable: {exc}") from exc
    return text.encode()


def record_field(record: Mapping[str, Any]) -> str:
    """The field of a node's hash that keeps ``record``: its kind, and its key if it has one.

    ``{"kind": "readiness", "key": "cooldown:qwen3"}`` -> ``readiness:cooldown:qwen3``:
    a per-model cooldown does not replace another model's, while a later
    record of the same kind and key replaces the earlier one.
    """
    key = record.get("key")
    return str(record["kind"]) if key is None else f"{record['kind']}:{key}"


def decode_envelope(data: bytes, age: float = 0.0) -> RemoteRecord | None:
    """The record in ``data``, or None when it is not one of our envelopes (never raises)."""
    try:
        envelope = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(envelope, dict):
        return None
    origin, node, record = envelope.get("from"), envelope.get("node"), envelope.get("record")
    if not isinstance(origin, str) or not (node is None or isinstance(node, str)):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("kind"), str):
        return None
    return RemoteRecord(origin=origin, node=node, record=record, age=age)


def read_snapshot(reply: object) -> list[RemoteRecord]:
    """The ``SNAPSHOT`` script's reply as records, each with its age; what is not ours is skipped.

    Raises:
        ValueError: the reply is not ``[now_ms, [field, value, ...], ...]``.
    """
    if not (isinstance(reply, list) and reply and isinstance(reply[0], int)):
        raise ValueError(f"unexpected reply to the snapshot script: {reply!r}")
    now_ms = reply[0]
    records: list[RemoteRecord] = []
    for flat in reply[1:]:
        if not isinstance(flat, list) or len(flat) % 2:
            raise ValueError(f"unexpected hash in the snapshot: {flat!r}")
        for value in flat[1::2]:
            stamp, _, data = value.partition(b" ") if isinstance(value, bytes) else (b"", b"", b"")
            if not stamp.isdigit():
                continue
            age = max(0, now_ms - int(stamp)) / 1000
            record = decode_envelope(data, age)
            if record is not None:
                records.append(record)
    return records


def snapshot_order(records: Iterable[RemoteRecord]) -> list[RemoteRecord]:
    """The snapshot's records oldest first: the order to apply them in."""
    return sorted(records, key=lambda record: -record.age)
