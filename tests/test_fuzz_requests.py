"""Property: whatever bytes a client sends, the proxy stays up, answers with
valid HTTP responses or closes, and forwards only requests that h11 accepts.

Each example runs the whole proxy over an in-memory stream under the
autojump clock, in its own ``trio.run``: a request built from parts (some of
them bad), pipelined, mutated byte by byte, cut into fragments with pauses
between them. A strict h11 server parsing the same bytes is the reference:
the requests the node receives must be a prefix of the ones it accepts.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from typing import Any

import attrs
import h11
import trio
import trio.testing
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from test_client_limits import RawResult, exchange, parse_responses

from trio_failover.core.config import Config
from trio_failover.core.headers import HOP_BY_HOP, connection_tokens
from trio_failover.proxy import Proxy
from trio_failover.testing import FakeNode, Fleet, ReceivedRequest, healthy

MAX_HEAD = 512
MAX_BODY = 256
PROXY_ERRORS = {400, 408, 413, 431}

# -- building requests -----------------------------------------------------------------------

TOKENS = ["X-A", "Accept", "Content-Type", "X-Request-Id", "Authorization", "Expect"]
HOPS = ["Connection", "Keep-Alive", "TE", "Trailer", "Upgrade", "Proxy-Authorization"]
BAD_NAMES = ["X A", "X:A", "", "X\x00A", "Héader"]
VALUES = ["1", "keep-alive", "close", "100-continue", "chunked", "x-a, te", "a b", "  padded  "]
BAD_VALUES = ["a\rb", "a\nb", "a\x00b", "a\r\n b", "a\r\n\tb", "\x7f"]


def mostly(good: st.SearchStrategy[Any], bad: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``good`` nine times in ten: most parts of a request are valid, some are not."""
    return st.integers(0, 9).flatmap(lambda n: bad if n == 0 else good)


names = mostly(
    st.one_of(
        st.sampled_from(TOKENS + HOPS), st.from_regex(r"\A[A-Za-z0-9!#$%&'*+.^_`|~-]{1,12}\Z")
    ),
    st.sampled_from(BAD_NAMES),
)
values = mostly(
    st.one_of(
        st.sampled_from(VALUES),
        st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=20),
    ),
    st.one_of(
        st.sampled_from(BAD_VALUES),
        st.builds(lambda n: "v" * n, st.integers(MAX_HEAD // 2, MAX_HEAD)),  # too large a head
    ),
)
bodies = st.one_of(st.binary(max_size=40), st.binary(min_size=MAX_BODY - 8, max_size=MAX_BODY + 8))


@st.composite
def one_request(draw: st.DrawFn) -> bytes:
    method = draw(
        mostly(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]), st.just("G T"))
    )
    target = draw(
        mostly(
            st.sampled_from(["/", "/v1/chat/completions", "/a?b=c", "http://h/x"]),
            st.sampled_from(["*", "/%00", "", "/a b"]),
        )
    )
    version = draw(
        mostly(st.sampled_from(["HTTP/1.1", "HTTP/1.0"]), st.sampled_from(["HTTP/2.0", "HTTP/1.x"]))
    )
    headers: list[tuple[str, str]] = []
    if version != "HTTP/1.0" or draw(st.booleans()):
        headers.append(("Host", draw(mostly(st.just("proxy.test"), st.sampled_from(["", "a b"])))))
    headers += draw(st.lists(st.tuples(names, values), max_size=4))
    body = draw(bodies)
    framing = draw(
        mostly(
            st.sampled_from(["none", "length", "length", "chunked"]),
            st.sampled_from(["both", "wrong length"]),
        )
    )
    payload = b""
    if framing in ("length", "both"):
        headers.append(("Content-Length", str(len(body))))
    if framing == "wrong length":
        headers.append(("Content-Length", draw(st.sampled_from(["-1", "1x", "3, 4", "99"]))))
    if framing in ("chunked", "both"):
        headers.append(("Transfer-Encoding", "chunked"))
        sizes = draw(st.lists(st.integers(1, 64), max_size=5))
        rest = body
        for size in sizes:
            piece, rest = rest[:size], rest[size:]
            if piece:
                size = len(piece)
                size_text = draw(
                    mostly(
                        st.sampled_from([f"{size:x}", f"{size:x};ext=1"]),
                        st.sampled_from(["zz", f"{size:x} ", f"{size:x};e\rx", f"{size:x};\x01"]),
                    )
                )
                payload += size_text.encode() + b"\r\n" + piece + b"\r\n"
        payload += draw(
            mostly(
                st.sampled_from([b"0\r\n\r\n", b"0\r\nX-T: y\r\n\r\n"]),
                st.sampled_from([b"0\r\n\n", b"0\r\nX-T: y\n\n", b"0\r\n X: y\r\n\r\n"]),
            )
        )
    elif framing != "none":
        payload = body
    order = draw(st.permutations(headers))
    head = f"{method} {target} {version}\r\n" + "".join(f"{n}: {v}\r\n" for n, v in order)
    return head.encode("utf-8") + b"\r\n" + payload


@st.composite
def mutated(draw: st.DrawFn, data: bytes) -> bytes:
    """``data`` with a few byte-level mutations."""
    out = bytearray(data)
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2, 3]))):
        position = draw(st.integers(0, len(out)))
        kind = draw(st.sampled_from(["insert", "delete", "replace", "lf", "fold", "dup"]))
        if kind == "insert":
            out[position:position] = draw(
                st.one_of(
                    st.binary(min_size=1, max_size=4),
                    st.sampled_from([b"\r\n", b"\n", b"\r", b" ", b":", b"\r\n\r\n"]),
                )
            )
        elif kind == "delete":
            del out[position : position + draw(st.integers(1, 4))]
        elif kind == "replace" and position < len(out):
            out[position] = draw(st.integers(0, 255))
        elif kind == "lf":
            index = out.find(b"\r\n", position)
            if index >= 0:
                del out[index]
        elif kind == "fold":
            index = out.find(b"\r\n", position)
            if index >= 0:
                out[index + 2 : index + 2] = b" "
        elif kind == "dup":
            out[position:position] = out[position : position + draw(st.integers(1, 40))]
    return bytes(out)


@attrs.frozen
class Case:
    """What one example sends: byte fragments, a pause between them, and the end."""

    data: bytes
    cuts: tuple[int, ...]
    pause: float
    half_close: bool

    @property
    def parts(self) -> list[bytes]:
        edges = [0, *sorted(set(self.cuts)), len(self.data)]
        return [self.data[a:b] for a, b in itertools.pairwise(edges) if b > a]


@st.composite
def cases(draw: st.DrawFn) -> Case:
    if draw(st.integers(0, 9)) == 0:
        data = draw(st.binary(max_size=400))  # now and then, plain noise
    else:
        requests = draw(st.lists(one_request(), min_size=1, max_size=3))
        data = draw(mutated(b"".join(requests)))
    cuts = draw(st.lists(st.integers(0, max(len(data), 1)), max_size=5))
    pause = draw(st.sampled_from([0.0, 0.0, 0.5, 2.0, 7.0]))
    return Case(data, tuple(cuts), pause, draw(st.booleans()))


# -- the reference parse ---------------------------------------------------------------------


@attrs.frozen
class Accepted:
    method: bytes
    target: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes


def h11_accepts(data: bytes, *, closed: bool) -> list[Accepted]:
    """The complete requests a strict h11 server reads from ``data``, up to its first error."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
    conn.receive_data(data)
    if closed:
        conn.receive_data(b"")
    accepted: list[Accepted] = []
    head: h11.Request | None = None
    body = b""
    try:
        while True:
            event = conn.next_event()
            if isinstance(event, h11.Request):
                head, body = event, b""
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage) and head is not None:
                accepted.append(Accepted(head.method, head.target, list(head.headers), body))
                conn.send(h11.Response(status_code=200, headers=[(b"content-length", b"0")]))
                conn.send(h11.EndOfMessage())
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return accepted
                conn.start_next_cycle()
            else:
                return accepted
    except h11.ProtocolError:
        return accepted


_CHUNK_LINE = re.compile(rb"([0-9A-Fa-f]{1,20})((?:;[^\x00-\x08\x0a-\x1f\x7f]*)?)\r\n")
_TRAILER_LINE = re.compile(rb"[^\x00-\x20\x7f][^\x00-\x08\x0a-\x1f\x7f]*\r\n")
_HEAD_CTL = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def strict_chunks(rest: bytes) -> bool:
    """Whether ``rest`` begins with a whole chunked body by RFC 9112 7.1, read strictly.

    Every line ends in CRLF, nothing follows a size but ``;`` or CRLF, no
    control byte but HTAB in an extension or trailer, no obs-fold; and the
    data, extension and trailer bytes stay within ``MAX_BODY``.
    """
    pos = counted = 0
    while True:
        line = _CHUNK_LINE.match(rest, pos)
        if line is None:
            return False
        size = int(line[1], 16)
        counted += size + max(0, len(line[2]) - 1)
        pos = line.end()
        if size == 0:
            break
        if rest[pos + size : pos + size + 2] != b"\r\n":
            return False
        pos += size + 2
    while (field := _TRAILER_LINE.match(rest, pos)) is not None:
        counted += len(field[0]) - 2
        pos = field.end()
    return rest[pos : pos + 2] == b"\r\n" and counted <= MAX_BODY


def proxy_accepts(data: bytes) -> list[Accepted]:
    """The requests the proxy must forward when the client is neither slow nor gone.

    h11's, up to the first that the proxy refuses on purpose: a head over
    ``MAX_HEAD``, a bare CR or LF, an obs-fold, a control byte other than
    HTAB, ``Transfer-Encoding`` with ``Content-Length`` or in HTTP/1.0, a
    chunked body that is not strictly well-formed, a body over ``MAX_BODY``.
    """
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
    conn.receive_data(data)
    accepted: list[Accepted] = []
    while True:
        rest = conn.trailing_data[0]
        end = re.search(rb"\n\r?\n", rest)
        if end is None:
            return accepted
        head = rest[: end.end()]
        lines = head.split(b"\r\n")
        if len(head) > MAX_HEAD or any(b"\r" in line or b"\n" in line for line in lines):
            return accepted
        if any(line[:1] in (b" ", b"\t") for line in lines[1:]) or _HEAD_CTL.search(head):
            return accepted
        try:
            request = conn.next_event()
            assert isinstance(request, h11.Request)
            names = {name for name, _ in request.headers}
            if b"transfer-encoding" in names and (
                b"content-length" in names or request.http_version == b"1.0"
            ):
                return accepted
            if b"transfer-encoding" in names and not strict_chunks(conn.trailing_data[0]):
                return accepted
            body = b""
            while not isinstance(event := conn.next_event(), h11.EndOfMessage):
                if not isinstance(event, h11.Data):
                    return accepted
                body += event.data
                if len(body) > MAX_BODY:
                    return accepted
        except h11.ProtocolError:
            return accepted
        accepted.append(Accepted(request.method, request.target, list(request.headers), body))
        conn.send(h11.Response(status_code=200, headers=[(b"content-length", b"0")]))
        conn.send(h11.EndOfMessage())
        if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
            return accepted
        conn.start_next_cycle()


# -- the property ----------------------------------------------------------------------------


def check_forwarded(received: Sequence[ReceivedRequest], reference: Sequence[Accepted]) -> None:
    assert len(received) <= len(reference), "forwarded a request h11 rejects"
    for got, want in zip(received, reference, strict=False):
        assert got.method == want.method
        assert got.body == want.body
        if want.target.startswith(b"/"):
            assert got.target == want.target
        else:
            assert got.target.startswith(b"/")
        forbidden = HOP_BY_HOP | connection_tokens(want.headers)
        assert not forbidden & {name for name, _ in got.headers}
        assert not any(b"_" in name for name, _ in got.headers)


def check_answers(result: RawResult, received: Sequence[ReceivedRequest], case: Case) -> None:
    statuses = result.statuses
    served = [status for status in statuses if status not in PROXY_ERRORS]
    assert set(served) <= {200}, statuses  # a healthy node: anything else is the proxy's fault
    errors = [status for status in statuses if status in PROXY_ERRORS]
    assert len(errors) <= 1, statuses  # an error answer closes the connection...
    assert statuses[len(served) :] == errors, statuses  # ...so it comes last
    assert set(result.informational) <= {100}
    for response in result.responses:
        if response.status in PROXY_ERRORS:
            assert response.header("connection") == b"close"
            assert response.header("content-type") == b"application/json"
    if case.half_close:
        assert len(served) <= len(received)  # a workload may be cut short by the FIN
    else:
        assert len(served) == len(received)


async def run_case(case: Case) -> tuple[RawResult, list[ReceivedRequest]]:
    async with Fleet({"a": FakeNode(healthy(b'{"ok": true}'))}) as fleet:
        config = Config(
            upstreams=fleet.upstreams(),
            admin_listen=None,
            max_request_head=MAX_HEAD,
            max_request_body=MAX_BODY,
            client_header_timeout=5.0,
            keepalive_timeout=3.0,
        )
        proxy = Proxy(config, connector=fleet.connector)
        result = await exchange(
            proxy, case.parts, pause=case.pause, half_close=case.half_close, parse=False
        )
        return result, list(fleet["a"].received)


def parse(result: RawResult, received: Sequence[ReceivedRequest]) -> RawResult:
    """Parse the answers strictly, knowing which requests were HEAD.

    The node saw the method of each forwarded request. A last, refused
    request may have been a HEAD too (then the proxy's error has no body),
    unless it was refused before h11 could read its method: both are tried.
    """
    methods = [request.method for request in received]
    try:
        responses, informational = parse_responses(result.raw, methods)
    except (h11.ProtocolError, AssertionError):
        responses, informational = parse_responses(result.raw, [*methods, b"HEAD"])
    return attrs.evolve(result, responses=responses, informational=informational)


def run(case: Case) -> None:
    raw, received = trio.run(run_case, case, clock=trio.testing.MockClock(autojump_threshold=0))
    check_forwarded(received, h11_accepts(case.data, closed=case.half_close))
    if not case.half_close and case.pause * len(case.parts) < 3.0:
        # No timeout can have struck, and no close: exactly these go through.
        assert len(received) == len(proxy_accepts(case.data))
    result = parse(raw, received)
    check_answers(result, received, case)
    event(f"answers: {' '.join(map(str, result.statuses)) or 'none'}")
    event(f"forwarded: {len(received)}")


EXAMPLES: list[Any] = [
    Case(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n" * 2, (), 0.0, False),
    Case(b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\nab", (5,), 1.0, True),
    Case(b"GET / HTTP/1.1\r\nHost: a\r\nX: a\r\n b\r\n\r\n", (), 0.0, False),
    Case(b"HEAD / HTTP/1.1\r\nHost: a\r\nContent-Length: 9\r\n\r\n", (), 0.0, False),
    Case(b"GET / HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\n\r\n", (), 0.0, False),
    # A 100 Continue, then the client's FIN cancels the workload: the
    # connection closes before the final response, which is no malformed answer.
    Case(
        b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"
        b"GET / HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\n\r\n",
        (30,),
        0.5,
        True,
    ),
]


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(cases())
@example(EXAMPLES[0])
@example(EXAMPLES[1])
@example(EXAMPLES[2])
@example(EXAMPLES[3])
@example(EXAMPLES[4])
@example(EXAMPLES[5])
def test_any_bytes_get_valid_answers_and_only_valid_requests_are_forwarded(case: Case) -> None:
    run(case)
