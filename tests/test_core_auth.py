"""Table tests of client keys and the admin token (trio_failover.core.auth)."""

from __future__ import annotations

import hmac

import pytest

from trio_failover.core import auth
from trio_failover.core.auth import (
    ClientCheck,
    Keys,
    admin_allowed,
    check_client,
    forwarded_headers,
    presented_credentials,
)

# The real one, kept before a test replaces it (auth.hmac is the hmac module).
ORIGINAL_COMPARE = hmac.compare_digest

KEYS: Keys = (("alice", "sk-alice-0123"), ("bob", "sk-bob-4567"), ("carol", "ключ-carol"))

# request headers -> ClientCheck, with KEYS configured
CHECKS = [
    pytest.param(
        [(b"authorization", b"Bearer sk-alice-0123")], ClientCheck(True, "alice"), id="bearer"
    ),
    pytest.param([(b"x-api-key", b"sk-bob-4567")], ClientCheck(True, "bob"), id="x-api-key"),
    pytest.param(
        [(b"authorization", b"bearer  sk-bob-4567 ")],
        ClientCheck(True, "bob"),
        id="scheme-case-spaces",
    ),
    pytest.param(
        [(b"authorization", "Bearer ключ-carol".encode())],
        ClientCheck(True, "carol"),
        id="utf-8-key",
    ),
    pytest.param([], ClientCheck(False), id="no-key"),
    pytest.param(
        [(b"authorization", b"Bearer sk-alice-012")], ClientCheck(False), id="prefix-of-a-key"
    ),
    pytest.param(
        [(b"authorization", b"Bearer sk-alice-01234")], ClientCheck(False), id="key-plus-one"
    ),
    pytest.param(
        [(b"authorization", b"Basic sk-alice-0123")], ClientCheck(False), id="other-scheme"
    ),
    pytest.param([(b"authorization", b"sk-alice-0123")], ClientCheck(False), id="no-scheme"),
    pytest.param([(b"authorization", b"Bearer")], ClientCheck(False), id="empty-bearer"),
    pytest.param([(b"x-api-key", b"")], ClientCheck(False), id="empty-x-api-key"),
    pytest.param([(b"api-key", b"sk-alice-0123")], ClientCheck(False), id="other-header"),
    pytest.param(
        [(b"authorization", b"Bearer wrong"), (b"x-api-key", b"sk-bob-4567")],
        ClientCheck(True, "bob"),
        id="one-wrong-one-right",
    ),
    pytest.param(
        [(b"x-api-key", b"sk-bob-4567"), (b"authorization", b"Bearer sk-alice-0123")],
        ClientCheck(True, "alice"),
        id="two-right-first-configured-wins",
    ),
]


@pytest.mark.parametrize(("headers", "expected"), CHECKS)
def test_check_client(headers: list[tuple[bytes, bytes]], expected: ClientCheck) -> None:
    assert check_client(headers, KEYS) == expected


@pytest.mark.parametrize(("headers", "_expected"), CHECKS)
def test_no_keys_means_no_check(headers: list[tuple[bytes, bytes]], _expected: object) -> None:
    assert check_client(headers, ()) == ClientCheck(True, None)


def test_duplicate_key_gives_the_first_name() -> None:
    keys: Keys = (("first", "same"), ("second", "same"))
    assert check_client([(b"x-api-key", b"same")], keys) == ClientCheck(True, "first")


def test_every_key_is_compared(monkeypatch: pytest.MonkeyPatch) -> None:
    # No early exit: a hit on the first key still compares against the rest.
    calls: list[int] = []

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(1)
        return ORIGINAL_COMPARE(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    headers = [(b"authorization", b"Bearer sk-alice-0123"), (b"x-api-key", b"nope")]
    assert check_client(headers, KEYS).name == "alice"
    assert len(calls) == len(KEYS) * 2


def test_compared_as_equal_length_digests(monkeypatch: pytest.MonkeyPatch) -> None:
    lengths: set[tuple[int, int]] = set()

    def recording(a: bytes, b: bytes) -> bool:
        lengths.add((len(a), len(b)))
        return ORIGINAL_COMPARE(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", recording)
    check_client([(b"x-api-key", b"short")], KEYS)
    assert lengths == {(32, 32)}


HEADERS = [
    (b"host", b"proxy"),
    (b"authorization", b"Bearer sk-alice-0123"),
    (b"x-api-key", b"sk-alice-0123"),
    (b"content-type", b"application/json"),
]


def test_forwarded_headers_drop_credentials_while_keys_are_configured() -> None:
    assert forwarded_headers(HEADERS, KEYS) == [
        (b"host", b"proxy"),
        (b"content-type", b"application/json"),
    ]


def test_forwarded_headers_unchanged_without_keys() -> None:
    forwarded = forwarded_headers(HEADERS, ())
    assert forwarded == HEADERS
    assert forwarded is not HEADERS


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ([(b"authorization", b"Bearer a"), (b"x-api-key", b" b ")], [b"a", b"b"]),
        ([(b"authorization", b"Token a")], []),
        ([(b"authorization", b"Bearer   ")], []),
    ],
)
def test_presented_credentials(headers: list[tuple[bytes, bytes]], expected: list[bytes]) -> None:
    assert presented_credentials(headers) == expected


TOKEN = "adm-s3cret+/="

# (headers, target) -> allowed, with TOKEN configured
ADMIN = [
    pytest.param([(b"authorization", b"Bearer adm-s3cret+/=")], b"/status", True, id="bearer"),
    pytest.param([], b"/status?token=adm-s3cret%2B%2F%3D", True, id="query-percent-encoded"),
    pytest.param([], b"/events?x=1&token=adm-s3cret%2B/%3D", True, id="query-among-others"),
    pytest.param([], b"/status?token=adm-s3cret+/=", False, id="query-plus-is-space"),
    pytest.param([], b"/status", False, id="none"),
    pytest.param([], b"/status?token=", False, id="empty-query-token"),
    pytest.param([], b"/status?tok=adm-s3cret%2B%2F%3D", False, id="other-parameter"),
    pytest.param([(b"x-api-key", b"adm-s3cret+/=")], b"/status", False, id="x-api-key-not-admin"),
    pytest.param([(b"authorization", b"Bearer adm-s3cret")], b"/", False, id="prefix"),
    pytest.param(
        [(b"authorization", b"Bearer wrong")],
        b"/?token=adm-s3cret%2B%2F%3D",
        True,
        id="wrong-header-right-query",
    ),
]


@pytest.mark.parametrize(("headers", "target", "expected"), ADMIN)
def test_admin_allowed(headers: list[tuple[bytes, bytes]], target: bytes, expected: bool) -> None:
    assert admin_allowed(headers, target, TOKEN) is expected


@pytest.mark.parametrize(("headers", "target", "_expected"), ADMIN)
def test_admin_open_without_token(
    headers: list[tuple[bytes, bytes]], target: bytes, _expected: bool
) -> None:
    assert admin_allowed(headers, target, None) is True


def test_reprs_hold_no_secret() -> None:
    check = check_client([(b"x-api-key", b"sk-alice-0123")], KEYS)
    refused = check_client([(b"x-api-key", b"sk-alice-012")], KEYS)
    for text in (repr(check), repr(refused), str(check)):
        assert "sk-" not in text
    assert repr(check) == "ClientCheck(allowed=True, name='alice')"


def test_bad_input_raises_without_secrets() -> None:
    # A key of the wrong type (a shell bug) fails without quoting it.
    with pytest.raises(AttributeError) as caught:
        check_client([(b"x-api-key", b"x")], (("alice", b"sk-alice-bytes"),))  # type: ignore[arg-type]
    assert "sk-alice" not in str(caught.value)
