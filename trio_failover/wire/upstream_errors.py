"""The one error mapper of the node side: Trio, OS, TLS and h11 errors of one
phase become the ``UpstreamError`` subclass that names the outcome.

``upstream.py`` (the attempt) and ``fetch.py`` (the proxy's own GETs) map
their errors here and nowhere else; what an outcome means for the workload
is ``outcome.judge``'s call.
"""

from __future__ import annotations

import re
import ssl
from collections.abc import Iterator
from contextlib import contextmanager

import h11
import trio

from ..core import errors
from . import sockopts
from .http1 import EarlyClose

IO_ERRORS = (
    h11.RemoteProtocolError,
    trio.BrokenResourceError,
    trio.ClosedResourceError,
    OSError,
)


def map_error(node: str, phase: str, exc: BaseException) -> errors.UpstreamError:
    """The error-tree form of a Trio, OS, TLS or h11 error of one phase."""
    if phase == "connect":
        if isinstance(exc, ssl.SSLError):
            return errors.TLSError(node, phase, f"{exc}")
        if _caused_by(exc, ssl.SSLError):
            return errors.TLSError(node, phase, f"{exc.__cause__}")
        return errors.ConnectFailed(node, phase, f"{exc}")
    if isinstance(exc, EarlyClose):
        return errors.UpstreamClosedEarly(node, phase, f"{exc}")
    if isinstance(exc, h11.RemoteProtocolError):
        return errors.UpstreamProtocolError(node, phase, without_peer_bytes(f"{exc}"))
    if sockopts.is_dead_peer_error(exc):
        return errors.DeadPeer(node, phase, "peer stopped answering")
    if _caused_by(exc, ssl.SSLError):
        return errors.TLSError(node, phase, f"{exc.__cause__ or exc}")
    return errors.UpstreamReset(node, phase, f"{exc.__cause__ or exc}")


@contextmanager
def mapped(node: str, phase: str) -> Iterator[None]:
    """Map Trio, OS, TLS and h11 errors of one phase onto the error tree."""
    try:
        yield
    except (EarlyClose, *IO_ERRORS) as exc:
        raise map_error(node, phase, exc) from exc


# Where h11 quotes the peer's bytes in a message: "illegal status line:
# bytearray(b'...')", "malformed chunk footer: b'..' (expected b'\\r\\n')".
_QUOTED = re.compile(r":?\s*(?:bytearray\()?\bb['\"].*", re.DOTALL)


def without_peer_bytes(message: str) -> str:
    """h11's error message without the raw bytes it quotes.

    On a pooled connection those bytes may be the end of another client's
    answer (a node that sent more than it declared); they go to the
    attempts list of a 502, ``/status``, events and logs, so only h11's
    words for what was wrong are kept.
    """
    return _QUOTED.sub("", message) or "malformed answer"


def _caused_by(exc: BaseException, kind: type[BaseException]) -> bool:
    seen: BaseException | None = exc
    for _ in range(8):  # a cause chain is short; bound the walk anyway
        if seen is None:
            return False
        if isinstance(seen, kind):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
