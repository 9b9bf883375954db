"""Table tests of model-name matching (trio_failover.core.names).

Ollama's rule and nothing else: a name without a ``:tag`` is ``NAME:latest``.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trio_failover.core.config import Upstream
from trio_failover.core.names import (
    Configured,
    accepts,
    find_name,
    model_key,
    node_model_name,
    same_model,
    spellings,
)
from trio_failover.core.requests import node_body

SPELLINGS = [
    pytest.param("llama3.2", ("llama3.2", "llama3.2:latest"), id="bare"),
    pytest.param("llama3.2:latest", ("llama3.2:latest", "llama3.2"), id="latest"),
    pytest.param("llama3.2:1b", ("llama3.2:1b",), id="other-tag"),
    pytest.param("tiny", ("tiny", "tiny:latest"), id="llama-server-alias"),
    pytest.param("Qwen/Qwen3-32B", ("Qwen/Qwen3-32B", "Qwen/Qwen3-32B:latest"), id="hf-style"),
    pytest.param("hf.co/org/repo:Q4_K_M", ("hf.co/org/repo:Q4_K_M",), id="hf-quant-tag"),
    pytest.param(
        "host:5000/llama3", ("host:5000/llama3", "host:5000/llama3:latest"), id="port-is-no-tag"
    ),
    pytest.param(
        "host:5000/llama3:latest", ("host:5000/llama3:latest", "host:5000/llama3"), id="port-latest"
    ),
    pytest.param(":latest", (":latest",), id="latest-of-nothing"),
    pytest.param("a:b:latest", ("a:b:latest",), id="tag-before-latest"),
    pytest.param("*", ("*",), id="wildcard"),
    pytest.param("", ("",), id="empty"),
    pytest.param("org/", ("org/",), id="trailing-slash"),
    pytest.param("Llama3", ("Llama3", "Llama3:latest"), id="case-kept"),
]


@pytest.mark.parametrize(("name", "expected"), SPELLINGS)
def test_spellings(name: str, expected: tuple[str, ...]) -> None:
    assert spellings(name) == expected


# (first, second) -> the same model?
SAME = [
    ("llama3.2", "llama3.2:latest", True),
    ("llama3.2:latest", "llama3.2", True),
    ("llama3.2", "llama3.2", True),
    ("llama3.2", "llama3.2:1b", False),
    ("llama3.2:1b", "llama3.2:latest", False),
    ("llama3.2", "Llama3.2", False),
    ("llama3.2", " llama3.2", False),
    ("gpt-4o-mini", "tiny", False),
    ("org/m", "m", False),
]


@pytest.mark.parametrize(("first", "second", "expected"), SAME)
def test_same_model(first: str, second: str, expected: bool) -> None:
    assert same_model(first, second) is expected
    assert same_model(second, first) is expected
    assert (model_key(first) == model_key(second)) is expected


names = st.text(alphabet="ab:/.-L", max_size=12)


@given(names, names)
def test_same_model_is_the_equality_of_keys(first: str, second: str) -> None:
    assert same_model(first, second) is (model_key(first) == model_key(second))
    assert same_model(first, first)
    assert model_key(model_key(first)) == model_key(first)


FIND = [
    pytest.param("llama3.2", ("x", "llama3.2:latest"), "llama3.2:latest", id="bare-finds-latest"),
    pytest.param("llama3.2:latest", ["llama3.2"], "llama3.2", id="latest-finds-bare"),
    pytest.param("m", {"m:latest": "B", "m": "A"}, "m", id="exact-first"),
    pytest.param("m:latest", {"m": "A", "m:latest": "B"}, "m:latest", id="exact-first-latest"),
    pytest.param("m:1b", {"m": "A"}, None, id="other-tag"),
    pytest.param("m", frozenset({"m:latest"}), "m:latest", id="set"),
    pytest.param("m", (), None, id="none"),
]


@pytest.mark.parametrize(("name", "collection", "expected"), FIND)
def test_find_name(name: str, collection: tuple[str, ...], expected: str | None) -> None:
    assert find_name(name, collection) == expected


# (model, configured) -> accepted by configuration?, the name the node is sent
CONFIGURED = [
    pytest.param("x", None, True, "x", id="not-configured"),
    pytest.param("llama3.2:latest", ["llama3.2"], True, "llama3.2:latest", id="list-sends-client"),
    pytest.param("llama3.2", {"llama3.2": "llama3.2"}, True, "llama3.2", id="identity"),
    pytest.param(
        "llama3.2:latest", {"llama3.2": "llama3.2"}, True, "llama3.2:latest", id="identity-latest"
    ),
    pytest.param("llama3.2:latest", {"llama3.2": "meta/L"}, True, "meta/L", id="key-bare"),
    pytest.param("llama3.2", {"llama3.2:latest": "meta/L"}, True, "meta/L", id="key-latest"),
    pytest.param("m", {"m": "A", "m:latest": "B"}, True, "A", id="exact-key-wins"),
    pytest.param("m:latest", {"m": "A", "m:latest": "B"}, True, "B", id="exact-key-wins-2"),
    pytest.param("llama3.2:1b", {"llama3.2": "meta/L"}, False, "llama3.2:1b", id="other-tag"),
    pytest.param("llama3.2:1b", {"llama3.2": "L", "*": "S"}, True, "S", id="star"),
    pytest.param("llama3.2", {"llama3.2": "L", "*": "S"}, True, "L", id="key-before-star"),
    pytest.param("x", {"*": "x-node"}, True, "x-node", id="star-alone"),
    pytest.param("gpt-4o-mini", ["tiny"], False, "gpt-4o-mini", id="list-excludes"),
    pytest.param("a", "a", True, "a", id="lone-string"),
    pytest.param("x", [], False, "x", id="empty"),
]


@pytest.mark.parametrize(("model", "configured", "accepted", "sent"), CONFIGURED)
def test_configured_models(model: str, configured: Configured, accepted: bool, sent: str) -> None:
    assert accepts(model, configured) is accepted
    assert node_model_name(model, configured) == sent


REWRITTEN = [
    pytest.param({"llama3.2": "meta/llama-3.2"}, "llama3.2:latest", "meta/llama-3.2", id="k-bare"),
    pytest.param({"llama3.2:latest": "meta/llama-3.2"}, "llama3.2", "meta/llama-3.2", id="k-tag"),
    pytest.param(["llama3.2"], "llama3.2:latest", None, id="list-keeps-the-client-s-bytes"),
    pytest.param(None, "gpt-4o-mini", None, id="unconfigured-keeps-bytes"),
]


@pytest.mark.parametrize(("models", "model", "sent"), REWRITTEN)
def test_the_node_gets_the_client_s_name_or_its_mapping(
    models: Configured, model: str, sent: str | None
) -> None:
    node = Upstream("a", "http://a.test:8000", models=models)
    body = b'{"model": "%s",  "messages": []}' % model.encode()
    document = {"model": model, "messages": []}
    if sent is None:
        assert node_body(body, document, node) is body  # not even re-encoded
    else:
        assert node_body(body, document, node) == (
            b'{"model": "%s", "messages": []}' % sent.encode()
        )
    assert node.serves(model)
    assert node.model_name_for(model) == (model if sent is None else sent)


def test_model_keys_are_kept_within_their_bounds() -> None:
    """Asked again, a name's key is the same; a long name, or one past the bound, is not kept."""
    from trio_failover.core import names as module

    module._KEYS.clear()
    assert model_key("kept") == "kept:latest"
    assert module._KEYS == {"kept": "kept:latest"}
    assert model_key("kept") == "kept:latest"  # from what was kept
    long = "m" * (module._KEY_LENGTH + 1)
    assert model_key(long) == long + ":latest"
    assert long not in module._KEYS
    for number in range(module._KEYS_KEPT + 10):
        assert model_key(f"n{number}:1b") == f"n{number}:1b"
    assert len(module._KEYS) == module._KEYS_KEPT
    assert model_key(f"n{module._KEYS_KEPT + 5}:latest") == f"n{module._KEYS_KEPT + 5}:latest"
    module._KEYS.clear()
