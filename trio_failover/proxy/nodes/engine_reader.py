"""The engine reader: each node's own load and loaded models, every --load-interval.

One task per node, all in the nursery ``EngineReader.run`` opens. What is
detected, read and when is told in docs/engines.md ("Detection (`auto`)",
"What is read, how often, what it changes"); the decisions are
``core/engine_parsers.py``'s (``next_detection``, the parsers). Each task
finds its node's engine (``auto``: at its first good check, ``checked``,
which discovery calls), then reads its ``SIGNAL_PATHS`` on a fresh
connection each (``wire.fetch``) and hands each reading to the one
callback, ``on_signal(EngineRead)`` (the board's ``apply``): synchronous,
it decides, it does not wait. A read that failed gives ``Signals`` with
nothing but ``last_error``.

A reload (``reconcile``, from ``reload.py``) starts the tasks of added
nodes, stops those of removed ones, and starts afresh those of kept nodes
whose URL, TLS or engine changed (all of them when ``--load-interval`` or
the discovery interval did), as ``discovery.py`` does with its checkers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

import trio

from ...core import errors
from ...core.config import Config, LiveConfig, Upstream, live_config, take_over
from ...core.engine_parsers import next_detection
from ...core.engine_state import EngineRead
from ...core.engines import (
    DETECTION_PATHS,
    MAX_SIGNAL_BYTES,
    SIGNAL_ANSWER_TIMEOUT,
    SIGNAL_PATHS,
    UNKNOWN,
    Answer,
    Ask,
    Detection,
    EngineKind,
    configured_engine,
)
from ...core.inventory import CHECK_PATH
from ...telemetry.logs import logger
from ...wire.connect import Connector
from ...wire.engine_metrics import read_signals
from ...wire.fetch import fetch

OnSignal = Callable[[EngineRead], None]

_FAILURES: tuple[tuple[type[errors.UpstreamError], str], ...] = (
    (errors.ConnectTimeout, "connect timed out"),
    (errors.HeaderTimeout, f"no whole answer in {SIGNAL_ANSWER_TIMEOUT}s"),
    (errors.UpstreamError, "failed"),
)


class EngineReader:
    """Reads every node's engine signals and hands them to ``on_signal``."""

    def __init__(
        self, config: Config | LiveConfig, connector: Connector, on_signal: OnSignal
    ) -> None:
        self._settings = live_config(config)
        self.connector = connector
        self.on_signal = on_signal
        # From connection made to whole answer read; tests may shorten it.
        self.answer_timeout = SIGNAL_ANSWER_TIMEOUT
        self._wake = {node.name: trio.Event() for node in self.config.upstreams}
        # What the readers were started with (its intervals, each node as
        # read): a reload compares the new configuration with it.
        self._read_as = _read_as(self.config)
        self._good_check = dict.fromkeys(self._wake, False)
        self._listing: dict[str, Answer] = {}  # each node's last check's GET /v1/models
        self._nursery: trio.Nursery | None = None  # while ``run`` runs
        self._tasks: dict[str, trio.CancelScope] = {}  # the running readers, by node

    @property
    def config(self) -> Config:
        """The running configuration (the proxy's one ``LiveConfig``), read at use."""
        return self._settings.config

    def checked(self, node: str, good: bool, listing: Answer | None = None) -> None:
        """A check of ``node`` ended (discovery calls this): read with it, detect at a good one.

        ``listing``: the check's answer to ``GET /v1/models``, where it asked
        that: detection weighs it (llama-cpp-python's) and never asks it
        itself, since on llama-cpp-python that read would end a running stream.
        """
        if node not in self._wake:
            return
        self._good_check[node] = self._good_check[node] or good
        if listing is not None:
            self._listing[node] = listing
        self._wake[node].set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Read every node until cancelled (a reload may add, stop and restart readers).

        Cancellation: a read in progress closes its connection at once.
        """
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                for node in self.config.upstreams:
                    self._start(node)
                task_status.started()
                await trio.sleep_forever()  # the readers come and go with reloads
        finally:
            self._nursery = None
            self._tasks.clear()

    def reconcile(self, config: Config, restart: Iterable[str] = ()) -> None:
        """A reload: read the added nodes, stop reading the removed ones.

        ``restart``: kept nodes whose reader begins again with the new
        settings. A kept node whose URL, TLS or engine changed is restarted
        too, and every node when an interval changed. Before ``run`` only
        the configuration is taken.
        """
        take_over(self._settings, config)
        intervals, before = self._read_as
        self._read_as = _read_as(config)
        restart = set(restart)
        if intervals != self._read_as[0]:
            restart |= set(before)
        for node in config.upstreams:
            kept = before.get(node.name)
            if kept is not None and _reads_differently(kept, node):
                restart.add(node.name)
        names = {node.name for node in config.upstreams}
        for name in [name for name in self._tasks if name not in names or name in restart]:
            self._tasks.pop(name).cancel()
        for name in [name for name in self._wake if name not in names or name in restart]:
            del self._wake[name]
            del self._good_check[name]
            self._listing.pop(name, None)
        for node in config.upstreams:
            if node.name not in self._wake:
                self._wake[node.name] = trio.Event()
                self._good_check[node.name] = False
            if node.name not in self._tasks:
                self._start(node)

    def _start(self, node: Upstream) -> None:
        if self._nursery is None or (
            not self.config.load_interval and not self.config.discovery_interval
        ):
            return  # nothing would ever be read
        scope = self._tasks[node.name] = trio.CancelScope()
        self._nursery.start_soon(self._reader, node, scope)

    async def _reader(self, node: Upstream, scope: trio.CancelScope) -> None:
        with scope:
            await self._read_every(node)
        if self._tasks.get(node.name) is scope:
            del self._tasks[node.name]

    async def _read_every(self, node: Upstream) -> None:
        engine = configured_engine(EngineKind(node.engine))
        interval = self.config.load_interval
        if engine is None and not self.config.discovery_interval:
            return  # auto is found at a check; with none, nothing is read of it
        deadline = trio.current_time()
        while True:
            with trio.move_on_at(deadline):
                await self._wake[node.name].wait()
            self._wake[node.name] = trio.Event()
            started = trio.current_time()
            deadline = started + interval if interval else math.inf
            in_hand: dict[str, Answer] = {}  # detection's answers: not asked again
            if engine is None and self._good_check[node.name]:
                engine, in_hand = await self._detect(node)
            if engine is None:
                continue
            paths = SIGNAL_PATHS.get(engine.kind, ())
            if not paths:
                self.on_signal(EngineRead(node.name, engine, UNKNOWN, trio.current_time()))
                return
            answers: dict[str, Answer | str] = {p: a for p, a in in_hand.items() if p in paths}
            try:
                answers |= await self._read(node, tuple(p for p in paths if p not in answers))
                signals = read_signals(engine.kind, answers)
            except Exception as exc:
                # This task's own boundary, like a check's: a bug in one
                # read must not end the server.
                logger.exception("engine read failed", extra={"fields": {"node": node.name}})
                signals = read_signals(engine.kind, dict.fromkeys(paths, type(exc).__name__))
            self.on_signal(EngineRead(node.name, engine, signals, trio.current_time()))

    async def _detect(self, node: Upstream) -> tuple[Detection | None, dict[str, Answer]]:
        """The engine of an ``auto`` node (None: no answer decided), and the answers it got.

        One question at a time, as ``next_detection`` asks them: the first
        answer that shows an engine ends it, and the round's signal read
        takes the answers it got rather than ask them again.
        """
        answers: dict[str, Answer | None] = {}
        listing = self._listing.get(node.name)
        if listing is not None:
            answers[CHECK_PATH] = listing  # the check's: never asked here
        for _ in range(len(DETECTION_PATHS) + 1):  # each step asks a path not asked yet
            step = next_detection(answers)
            if not isinstance(step, Ask):
                return step, {p: a for p, a in answers.items() if isinstance(a, Answer)}
            got = (await self._read(node, (step.path,)))[step.path]
            answers[step.path] = got if isinstance(got, Answer) else None
        raise AssertionError("detection asked every path and did not end")  # pragma: no cover

    async def _read(self, node: Upstream, paths: tuple[str, ...]) -> Mapping[str, Answer | str]:
        """``GET`` each of ``paths`` in turn: its answer, or why there is none."""
        answers: dict[str, Answer | str] = {}
        for path in paths:
            try:
                got = await fetch(
                    node,
                    path.encode(),
                    connector=self.connector,
                    config=self.config,
                    answer_timeout=self.answer_timeout,
                    limit=MAX_SIGNAL_BYTES + 1,
                )
            except errors.UpstreamError as exc:
                answers[path] = next(words for kind, words in _FAILURES if isinstance(exc, kind))
                continue
            answers[path] = Answer(got.status, "", got.body)
        return answers


def _reads_differently(old: Upstream, new: Upstream) -> bool:
    """Whether a kept node's reader must begin again: another address, TLS or engine."""
    return (old.url, old.engine, old.ca_file, old.insecure_skip_verify) != (
        new.url,
        new.engine,
        new.ca_file,
        new.insecure_skip_verify,
    )


def _read_as(config: Config) -> tuple[tuple[float, float], dict[str, Upstream]]:
    """The settings a reader reads by: the intervals, and each node's definition."""
    intervals = (config.load_interval, config.discovery_interval)
    return intervals, {node.name: node for node in config.upstreams}
