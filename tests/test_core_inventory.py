"""Table tests of inventories, health and model lists (trio_failover.core.inventory)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trio_failover.core.inventory import (
    MAX_LISTING_BYTES,
    MAX_NOT_FOUND_BODY,
    CheckFailure,
    CheckVerdict,
    Health,
    Inventory,
    Listing,
    advertised_ids,
    inventory_of,
    is_model_not_found,
    judge_check,
    lists_model,
    models_document,
    needs_live_listing,
    parse_model_list,
    tags_document,
)
from trio_failover.core.names import Configured


def listing(*ids: str) -> bytes:
    return json.dumps(
        {"object": "list", "data": [{"id": i, "object": "model"} for i in ids]}
    ).encode()


# -- parsing a model list --------------------------------------------------------------

LISTINGS = [
    pytest.param(listing("m1", "m2"), Listing(("m1", "m2")), id="two"),
    pytest.param(listing("m1", "m2", "m1"), Listing(("m1", "m2")), id="duplicates-once"),
    pytest.param(listing(), Listing(()), id="empty"),
    pytest.param(b'{"object": "list", "data": null}', Listing(()), id="ollama-null-data"),
    pytest.param(b'{"data": [{"id": "m", "extra": 1}]}', Listing(("m",)), id="extra-fields"),
    pytest.param(b"<html>502</html>", Listing(None, "not a model list: not JSON"), id="html"),
    pytest.param(b"", Listing(None, "not a model list: not JSON"), id="empty-body"),
    pytest.param(b'"\xff"', Listing(None, "not a model list: not UTF-8 text"), id="bad-utf-8"),
    pytest.param(b"[" * 100_000, Listing(None, "not a model list: not JSON"), id="nesting"),
    pytest.param(
        b'[{"id": "m"}]', Listing(None, "not a model list: a JSON array, not an object"), id="array"
    ),
    pytest.param(b"3", Listing(None, "not a model list: a JSON number, not an object"), id="num"),
    pytest.param(b"true", Listing(None, "not a model list: a JSON boolean, not an object"), id="b"),
    pytest.param(b"null", Listing(None, "not a model list: a JSON null, not an object"), id="null"),
    pytest.param(b'"x"', Listing(None, "not a model list: a JSON string, not an object"), id="s"),
    pytest.param(b"{}", Listing(None, 'not a model list: no "data" list'), id="no-data"),
    pytest.param(
        b'{"error": "down"}', Listing(None, 'not a model list: no "data" list'), id="error-object"
    ),
    pytest.param(
        b'{"data": {"id": "m"}}', Listing(None, 'not a model list: no "data" list'), id="data-obj"
    ),
    pytest.param(
        b'{"data": [{"id": "m"}, {"name": "n"}]}',
        Listing(None, 'not a model list: data[1] has no "id" string'),
        id="item-without-id",
    ),
    pytest.param(
        b'{"data": ["m"]}', Listing(None, 'not a model list: data[0] has no "id" string'), id="str"
    ),
    pytest.param(
        b'{"data": [{"id": ""}]}',
        Listing(None, 'not a model list: data[0] has no "id" string'),
        id="e",
    ),
    pytest.param(
        b'{"data": [{"id": 7}]}',
        Listing(None, 'not a model list: data[0] has no "id" string'),
        id="n",
    ),
]


@pytest.mark.parametrize(("body", "expected"), LISTINGS)
def test_parse_model_list(body: bytes, expected: Listing) -> None:
    assert parse_model_list(body) == expected


def test_parse_model_list_refuses_a_huge_body() -> None:
    body = listing("m") + b" " * MAX_LISTING_BYTES
    assert parse_model_list(body) == Listing(
        None, f"not a model list: larger than {MAX_LISTING_BYTES} bytes"
    )


@given(st.binary(max_size=200))
def test_parse_model_list_never_raises(body: bytes) -> None:
    result = parse_model_list(body)
    assert (result.ids is None) == bool(result.error)


@pytest.mark.parametrize(
    ("ids", "expected"), [(("a",), ("a",)), ((), None), (None, None), (["a", "b"], ("a", "b"))]
)
def test_inventory_of(ids: tuple[str, ...] | None, expected: tuple[str, ...] | None) -> None:
    assert inventory_of(ids) == expected


# -- candidates ----------------------------------------------------------------------

MAPPING = {"qwen3:32b": "Qwen/Qwen3-32B"}
MAPPING_STAR = {"qwen3:32b": "Qwen/Qwen3-32B", "*": "Qwen/Qwen3-32B"}

# (model, configured, inventory) -> does the node *list* the name?
LISTS = [
    # Configured names always win over the inventory.
    pytest.param("a", ["a"], None, True, id="list-hit"),
    pytest.param("b", ["a"], ("b",), False, id="list-miss-inventory-ignored"),
    pytest.param("a", ["a"], ("b",), True, id="list-hit-inventory-ignored"),
    pytest.param("qwen3:32b", MAPPING, None, True, id="mapping-key"),
    pytest.param("Qwen/Qwen3-32B", MAPPING, ("Qwen/Qwen3-32B",), False, id="mapping-value-no"),
    pytest.param("anything", MAPPING_STAR, ("anything",), False, id="star-lists-nothing"),
    pytest.param("m1", {"*": "x"}, ("m1",), True, id="star-alone-lists-its-inventory"),
    pytest.param("m1", {"*": "x"}, None, False, id="star-alone-unknown"),
    pytest.param("a", [], ("a",), False, id="empty-list-lists-nothing"),
    pytest.param("a", "a", None, True, id="lone-string-hit"),
    pytest.param("ab", "abc", None, False, id="lone-string-is-not-substring"),
    # No configured models: the inventory, once known.
    pytest.param("m1", None, ("m1", "m2"), True, id="inventory-hit"),
    pytest.param("m3", None, ("m1", "m2"), False, id="inventory-miss"),
    pytest.param("m1", None, frozenset({"m1"}), True, id="inventory-frozenset"),
    pytest.param("m3", None, None, False, id="unknown-lists-nothing"),
    pytest.param("m3", None, (), False, id="empty-inventory-lists-nothing"),
    # Ollama's tag rule, both ways, in configuration and inventories alike.
    pytest.param("llama3.2", None, ("llama3.2:latest",), True, id="bare-finds-latest"),
    pytest.param("llama3.2:latest", None, ("llama3.2",), True, id="latest-finds-bare"),
    pytest.param("llama3.2:latest", ["llama3.2"], None, True, id="configured-bare"),
    pytest.param("llama3.2", {"llama3.2:latest": "x"}, None, True, id="configured-key-latest"),
    pytest.param("llama3.2", None, ("llama3.2:1b",), False, id="other-tag-not-folded"),
    pytest.param("Llama3.2", None, ("llama3.2",), False, id="case-not-folded"),
    pytest.param("gpt-4o-mini", None, ("tiny",), False, id="single-model-alias-only"),
]


@pytest.mark.parametrize(("model", "configured", "inventory", "expected"), LISTS)
def test_lists_model(
    model: str, configured: Configured, inventory: Inventory, expected: bool
) -> None:
    assert lists_model(model, configured, inventory) is expected


# (configured, inventory) -> ids a client may ask for
ADVERTISED = [
    pytest.param(["b", "a", "b"], ("x",), ("b", "a"), id="list-wins-each-once"),
    pytest.param(MAPPING_STAR, ("Qwen/Qwen3-32B",), ("qwen3:32b",), id="mapping-keys-not-star"),
    pytest.param({"*": "m"}, ("m",), ("m",), id="star-alone-advertises-its-inventory"),
    pytest.param({"*": "m"}, None, None, id="star-alone-unknown-asked-live"),
    pytest.param({"*": "m"}, (), None, id="star-alone-empty-inventory-asked-live"),
    pytest.param([], ("x",), (), id="empty-list"),
    pytest.param("a", None, ("a",), id="lone-string"),
    pytest.param(None, ("m1", "m2"), ("m1", "m2"), id="inventory"),
    pytest.param(None, None, None, id="unknown"),
    pytest.param(None, (), None, id="empty-inventory-unknown"),
]


@pytest.mark.parametrize(("configured", "inventory", "expected"), ADVERTISED)
def test_advertised_ids(
    configured: Configured, inventory: Inventory, expected: tuple[str, ...] | None
) -> None:
    assert advertised_ids(configured, inventory) == expected
    assert needs_live_listing(configured, inventory) is (expected is None)


# -- a stale inventory's 404 ---------------------------------------------------------

NOT_FOUND = [
    pytest.param(404, {"error": {"code": "model_not_found", "message": "x"}}, True, id="openai"),
    pytest.param(404, {"error": "model 'llama3' not found, try pulling it first"}, True, id="ol"),
    pytest.param(404, {"error": 'model "llama3" not found'}, True, id="ollama-double-quotes"),
    pytest.param(404, {"error": "Model 'x' Not Found"}, True, id="any-case"),
    pytest.param(404, {"error": {"code": "not_found"}}, False, id="other-code"),
    pytest.param(404, {"error": {"message": "model not found"}}, False, id="message-not-code"),
    pytest.param(404, {"error": "route not found"}, False, id="route"),
    pytest.param(404, {"error": "models not found"}, False, id="models-prefix"),
    pytest.param(404, {"error": "model 'x' is loading"}, False, id="model-other"),
    pytest.param(404, {"detail": "Not Found"}, False, id="fastapi-404"),
    pytest.param(404, ["model x not found"], False, id="array"),
    pytest.param(400, {"error": {"code": "model_not_found"}}, False, id="not-404"),
    pytest.param(200, {"error": "model 'x' not found"}, False, id="200"),
]


@pytest.mark.parametrize(("status", "document", "expected"), NOT_FOUND)
def test_is_model_not_found(status: int, document: object, expected: bool) -> None:
    assert is_model_not_found(status, json.dumps(document).encode()) is expected


@pytest.mark.parametrize(
    "body",
    [b"404 page not found", b"", b"\xff\xfe", b"[" * 100_000],
    ids=["text", "empty", "bytes", "nesting"],
)
def test_is_model_not_found_with_garbage(body: bytes) -> None:
    assert is_model_not_found(404, body) is False


def test_is_model_not_found_refuses_a_large_body() -> None:
    body = json.dumps({"error": {"code": "model_not_found"}}).encode()
    assert is_model_not_found(404, body + b" " * (MAX_NOT_FOUND_BODY - len(body)))
    assert not is_model_not_found(404, body + b" " * (MAX_NOT_FOUND_BODY - len(body) + 1))


# -- health after a check ---------------------------------------------------------

KEEP = (False, None)  # replace_inventory, inventory: the node's inventory stays
UNKNOWN = (True, None)  # the inventory becomes unknown

# judge_check arguments -> verdict
CHECKS = [
    pytest.param(
        {"status": 200, "body": listing("m1", "m2")},
        CheckVerdict(Health.READY, "health_check", True, ("m1", "m2"), None, "ok"),
        id="model-list",
    ),
    pytest.param(
        {"status": 200, "body": listing("m1"), "streaming": True},
        CheckVerdict(Health.READY, "health_check", True, ("m1",), None, "ok"),
        id="model-list-while-streaming",
    ),
    pytest.param(
        {"status": 203, "body": listing()},
        CheckVerdict(Health.READY, "health_check", *UNKNOWN, None, "ok"),
        id="empty-list-ready-inventory-none",
    ),
    pytest.param(
        {"failure": CheckFailure.CONNECT_FAILED, "detail": "connection refused"},
        CheckVerdict(
            Health.DOWN,
            "health_check",
            *KEEP,
            "health check cannot connect (connection refused)",
            "connect_failed",
        ),
        id="connect-failed",
    ),
    pytest.param(
        {"failure": CheckFailure.CONNECT_FAILED, "streaming": True},
        CheckVerdict(
            Health.DOWN, "health_check", *KEEP, "health check cannot connect", "connect_failed"
        ),
        id="connect-failed-while-streaming-counts",
    ),
    pytest.param(
        {"failure": CheckFailure.TIMED_OUT},
        CheckVerdict(
            Health.DOWN, "health_check", *KEEP, "health check: /v1/models timed out", "timed_out"
        ),
        id="timed-out",
    ),
    pytest.param(
        {"failure": CheckFailure.TIMED_OUT, "streaming": True},
        CheckVerdict(Health.UNCHANGED, None, *KEEP, None, "timeout_while_streaming"),
        id="timed-out-while-streaming-does-not-count",
    ),
    pytest.param(
        {"status": 503, "body": b"loading", "streaming": True},
        CheckVerdict(
            Health.DOWN,
            "health_check",
            *KEEP,
            "health check: /v1/models answered 503",
            "server_error",
        ),
        id="5xx",
    ),
    pytest.param(
        {"status": 500, "detail": "boom"},
        CheckVerdict(
            Health.DOWN,
            "health_check",
            *KEEP,
            "health check: /v1/models answered 500 (boom)",
            "server_error",
        ),
        id="5xx-detail",
    ),
    pytest.param(
        {"status": 401, "body": b'{"error": "no key"}'},
        CheckVerdict(
            Health.UNCHANGED, None, *UNKNOWN, "health check: /v1/models answered 401", "bad_status"
        ),
        id="4xx",
    ),
    pytest.param(
        {"status": 404},
        CheckVerdict(
            Health.UNCHANGED, None, *UNKNOWN, "health check: /v1/models answered 404", "bad_status"
        ),
        id="404-no-such-route",
    ),
    pytest.param(
        {"status": 302},
        CheckVerdict(
            Health.UNCHANGED, None, *UNKNOWN, "health check: /v1/models answered 302", "bad_status"
        ),
        id="redirect",
    ),
    pytest.param(
        {"status": 200, "body": b"<html>hi</html>"},
        CheckVerdict(
            Health.UNCHANGED,
            None,
            *UNKNOWN,
            "health check: /v1/models answered 200, not a model list: not JSON",
            "bad_body",
        ),
        id="garbage-body",
    ),
    pytest.param(
        {"status": 200, "body": b'{"models": []}'},
        CheckVerdict(
            Health.UNCHANGED,
            None,
            *UNKNOWN,
            'health check: /v1/models answered 200, not a model list: no "data" list',
            "bad_body",
        ),
        id="wrong-shape",
    ),
    pytest.param(
        {"failure": CheckFailure.NOT_HTTP, "detail": "illegal status line"},
        CheckVerdict(
            Health.UNCHANGED,
            None,
            *UNKNOWN,
            "health check: /v1/models answer is not HTTP/1.1 (illegal status line)",
            "bad_answer",
        ),
        id="not-http-leaves-health-alone",
    ),
]


@pytest.mark.parametrize(("arguments", "expected"), CHECKS)
def test_judge_check(arguments: dict[str, object], expected: CheckVerdict) -> None:
    assert judge_check(**arguments) == expected  # type: ignore[arg-type]


def test_judge_check_needs_a_result() -> None:
    with pytest.raises(ValueError, match="failure or a status"):
        judge_check()


# -- the fleet-wide lists ---------------------------------------------------------------


def entry(model: str, *nodes: str) -> dict[str, object]:
    return {
        "id": model,
        "object": "model",
        "created": 0,
        "owned_by": "trio-failover",
        "nodes": list(nodes),
    }


MODELS = [
    pytest.param(
        [("a", ("m1",)), ("b", ("m2",))],
        [entry("m1", "a"), entry("m2", "b")],
        id="two-nodes-two-models",
    ),
    pytest.param(
        [("a", ("m1", "m2")), ("b", ("m2", "m3", "m2"))],
        [entry("m1", "a"), entry("m2", "a", "b"), entry("m3", "b")],
        id="each-id-once-nodes-in-ranking-order",
    ),
    pytest.param([("a", None), ("b", ("m",))], [entry("m", "b")], id="unreachable-left-out"),
    pytest.param([("a", ()), ("b", None)], [], id="an-empty-answer-is-an-answer"),
    pytest.param(
        [("a", ("llama3.2:latest", "qwen3:8b")), ("b", ("llama3.2", "llama3.2:latest"))],
        [entry("llama3.2:latest", "a", "b"), entry("qwen3:8b", "a")],
        id="bare-and-latest-are-one-model-as-first-spelled",
    ),
    pytest.param(
        [("a", ("llama3.2:1b",)), ("b", ("llama3.2",))],
        [entry("llama3.2:1b", "a"), entry("llama3.2", "b")],
        id="other-tags-stay-apart",
    ),
]


@pytest.mark.parametrize(("nodes", "data"), MODELS)
def test_models_document(
    nodes: list[tuple[str, tuple[str, ...] | None]], data: list[dict[str, object]]
) -> None:
    assert models_document(nodes) == {"object": "list", "data": data}


def test_models_document_with_no_answer_is_none() -> None:
    assert models_document([("a", None), ("b", None)]) is None
    assert models_document([]) is None


def test_models_document_from_configuration_and_live_answers() -> None:
    # a: a mapping with "*"; b: a list; c: nothing configured, asked live.
    nodes = [
        ("a", advertised_ids(MAPPING_STAR, None)),
        ("b", advertised_ids(["qwen3:32b", "llama3"], ("ignored",))),
        ("c", parse_model_list(listing("llama3", "phi4")).ids),
    ]
    document = models_document(nodes, owned_by="fleet")
    assert document is not None
    assert [(e["id"], e["nodes"], e["owned_by"]) for e in document["data"]] == [  # type: ignore[attr-defined]
        ("qwen3:32b", ["a", "b"], "fleet"),
        ("llama3", ["b", "c"], "fleet"),
        ("phi4", ["c"], "fleet"),
    ]


def tags(*names: str, digest: str = "") -> bytes:
    models = [{"name": n, "model": n, "size": 1, "digest": digest or n} for n in names]
    return json.dumps({"models": models}).encode()


TAGS = [
    pytest.param(
        [tags("a:1", "b:1", digest="first"), tags("b:1", "c:1", digest="second")],
        [("a:1", "first"), ("b:1", "first"), ("c:1", "second")],
        id="first-node-wins",
    ),
    pytest.param([None, tags("x")], [("x", "x")], id="unreachable-left-out"),
    pytest.param([b"<html>", tags("x")], [("x", "x")], id="garbage-left-out"),
    pytest.param([b'{"data": []}', tags("x")], [("x", "x")], id="openai-shape-left-out"),
    pytest.param([b'{"models": null}'], [], id="ollama-null-models"),
    pytest.param(
        [b'{"models": [{"name": "a"}, 3, {"size": 1}]}'], [("a", None)], id="junk-entries"
    ),
    pytest.param([b'{"models": [{"model": "m"}]}'], [("m", None)], id="model-without-name"),
    pytest.param(
        [tags("m", digest="first"), tags("m:latest", "m:1b", digest="second")],
        [("m", "first"), ("m:1b", "second")],
        id="bare-and-latest-once",
    ),
]


@pytest.mark.parametrize(("bodies", "expected"), TAGS)
def test_tags_document(bodies: list[bytes | None], expected: list[tuple[str, str | None]]) -> None:
    document = tags_document(bodies)
    assert document is not None
    models = document["models"]
    assert isinstance(models, list)
    assert [(m.get("name", m.get("model")), m.get("digest")) for m in models] == expected


@pytest.mark.parametrize(
    "bodies",
    [[], [None, None], [b"garbage", b'{"models": 3}', b"[]", b"[" * 100_000]],
    ids=["none", "unreachable", "garbage"],
)
def test_tags_document_with_no_answer_is_none(bodies: list[bytes | None]) -> None:
    assert tags_document(bodies) is None


def test_tags_entries_are_kept_as_the_node_sent_them() -> None:
    entry = {"name": "a", "model": "a", "details": {"family": "llama"}, "modified_at": "t"}
    document = tags_document([json.dumps({"models": [entry]}).encode()])
    assert document == {"models": [entry]}
