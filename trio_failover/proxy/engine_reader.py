"""The engine reader: each node's own load and loaded models, every --load-interval (SPEC 5c).

One task per node, all in the nursery ``EngineReader.run`` opens (the
server's services nursery starts it, like discovery). Each task:

1. finds its node's engine: a configured kind at once; ``auto`` at the
   node's first good check (``checked(node, good=True)``, which discovery
   calls after each check), by asking ``engines.DETECTION_PATHS`` and
   judging them with ``engine_parsers.detect_engine``. With discovery off
   there is no check, so nothing is read of an ``auto`` node (the proxy
   then asks a node nothing of its own accord but the liveness checks). A
   round where no read got any answer detects nothing and is tried again;
2. reads its engine's ``SIGNAL_PATHS`` every ``--load-interval`` and with
   each check (``checked``), on a fresh connection each (``wire.fetch``:
   never a slot, never pooled), within the connect timeout and then
   ``SIGNAL_ANSWER_TIMEOUT`` (2 s), at most ``MAX_SIGNAL_BYTES``;
3. hands each parsed reading to the one callback, ``on_signal(node,
   EngineSignal)``; a read that failed gives ``Signals`` with nothing but
   ``last_error``. The callback is synchronous: it decides, it does not wait.

An ``openai`` node (or a kind without reads) gets one ``EngineSignal``
(its kind, no signals) and its task ends. With ``--load-interval 0`` reads
happen only with checks; with that and discovery off, never.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import trio

from ..core import errors
from ..core.config import Config, Upstream
from ..core.engine_parsers import detect_engine
from ..core.engine_state import EngineSignal
from ..core.engines import (
    DETECTION_PATHS,
    MAX_SIGNAL_BYTES,
    SIGNAL_ANSWER_TIMEOUT,
    SIGNAL_PATHS,
    UNKNOWN,
    Answer,
    Detection,
    EngineKind,
    configured_engine,
)
from ..telemetry.logs import logger
from ..wire.connect import Connector
from ..wire.engine_metrics import read_signals
from ..wire.fetch import fetch

OnSignal = Callable[[str, EngineSignal], None]

_FAILURES: tuple[tuple[type[errors.UpstreamError], str], ...] = (
    (errors.ConnectTimeout, "connect timed out"),
    (errors.HeaderTimeout, f"no whole answer in {SIGNAL_ANSWER_TIMEOUT}s"),
    (errors.UpstreamError, "failed"),
)


class EngineReader:
    """Reads every node's engine signals and hands them to ``on_signal``."""

    def __init__(self, config: Config, connector: Connector, on_signal: OnSignal) -> None:
        self.config = config
        self.connector = connector
        self.on_signal = on_signal
        # From connection made to whole answer read; tests may shorten it.
        self.answer_timeout = SIGNAL_ANSWER_TIMEOUT
        self._wake = {node.name: trio.Event() for node in config.upstreams}
        self._good_check = dict.fromkeys(self._wake, False)

    def checked(self, node: str, good: bool) -> None:
        """A check of ``node`` ended (discovery calls this): read with it, detect at a good one."""
        if node not in self._wake:
            return
        self._good_check[node] = self._good_check[node] or good
        self._wake[node].set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Read every node until cancelled; returns at once when nothing would ever be read.

        Cancellation: a read in progress closes its connection at once.
        """
        if not self.config.load_interval and not self.config.discovery_interval:
            task_status.started()
            return
        async with trio.open_nursery() as nursery:
            for node in self.config.upstreams:
                nursery.start_soon(self._read_every, node)
            task_status.started()

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
            if engine is None and self._good_check[node.name]:
                engine = await self._detect(node)
            if engine is None:
                continue
            paths = SIGNAL_PATHS.get(engine.kind, ())
            if not paths:
                self.on_signal(node.name, EngineSignal(engine, UNKNOWN, trio.current_time()))
                return
            try:
                signals = read_signals(engine.kind, await self._read(node, paths))
            except Exception as exc:
                # This task's own boundary, like a check's: a bug in one
                # read must not end the server.
                logger.exception("engine read failed", extra={"fields": {"node": node.name}})
                signals = read_signals(engine.kind, dict.fromkeys(paths, type(exc).__name__))
            self.on_signal(node.name, EngineSignal(engine, signals, trio.current_time()))

    async def _detect(self, node: Upstream) -> Detection | None:
        """The engine of an ``auto`` node; None when no read got an answer at all."""
        answers = await self._read(node, tuple(path for _, path in DETECTION_PATHS))
        got = {path: answer for path, answer in answers.items() if isinstance(answer, Answer)}
        if not got:
            return None
        return detect_engine(got)

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
