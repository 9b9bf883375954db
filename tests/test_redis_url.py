"""The shared state's address, ``redis://[USER:PASS@]HOST:PORT[/DB]``: a table."""

from __future__ import annotations

import pytest

from trio_failover.core.redis_url import RedisAddress, parse_redis_url


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("redis://redis", RedisAddress(host="redis")),
        ("redis://redis:6379", RedisAddress(host="redis")),
        ("redis://10.0.0.5:6380/", RedisAddress(host="10.0.0.5", port=6380)),
        ("redis://10.0.0.5:6380/2", RedisAddress(host="10.0.0.5", port=6380, db=2)),
        ("rediss://cache.example:6380", RedisAddress(host="cache.example", port=6380, tls=True)),
        ("redis://:s3cret@redis", RedisAddress(host="redis", password="s3cret")),
        (
            "redis://app:s3cret@redis:7000/15",
            RedisAddress(host="redis", port=7000, username="app", password="s3cret", db=15),
        ),
        # Percent-encoded login; an '@' in the password is taken up to the last '@'.
        (
            "redis://app:p%40ss%3Aw@redis",
            RedisAddress(host="redis", username="app", password="p@ss:w"),
        ),
        ("redis://app:p@ss@redis", RedisAddress(host="redis", username="app", password="p@ss")),
        ("redis://[::1]:6379/1", RedisAddress(host="::1", db=1)),
        ("REDIS://Redis.Example", RedisAddress(host="redis.example")),
        ("  redis://redis  ", RedisAddress(host="redis")),
    ],
)
def test_parse(text: str, expected: RedisAddress) -> None:
    assert parse_redis_url(text) == expected


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("memory", "expected redis://"),
        ("http://redis:6379", "expected redis://"),
        ("unix:///run/redis.sock", "expected redis://"),
        ("redis://", "no host"),
        ("redis://:6379", "no host"),
        ("redis://redis:port", "bad port"),
        ("redis://redis:70000", "bad port"),
        ("redis://redis:0", "port 0"),
        ("redis://redis/db1", "database number"),
        ("redis://redis/1/2", "database number"),
        ("redis://redis/-1", "database number"),
        ("redis://redis/\u0661", "database number"),  # ARABIC-INDIC DIGIT ONE is no number here
        ("redis://redis?db=1", "query"),
        ("redis://redis/0?", "query"),
        ("redis://redis#x", "fragment"),
        ("redis://app@redis", "needs a password"),
        ("redis://app:@redis", "empty password"),
    ],
)
def test_refused(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says) as caught:
        parse_redis_url(text)
    assert "redis://[USER:PASS@]HOST[:PORT][/DB]" in str(caught.value)


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("redis://redis", "redis://redis:6379"),
        ("rediss://app:s3cret@redis:6380/3", "rediss://app:***@redis:6380/3"),
        ("redis://:s3cret@[::1]", "redis://:***@[::1]:6379"),
    ],
)
def test_display_masks_the_password(text: str, shown: str) -> None:
    address = parse_redis_url(text)
    assert address.display() == shown
    assert "s3cret" not in repr(address)
