"""The official clients work through the proxy with client keys on.

The ``openai`` client sends its ``api_key=`` as ``Authorization: Bearer``;
the ``ollama`` client sends the headers it is given. Both run (their
synchronous forms, in a thread, as most programs use them) against the
fake node of ``auth_fleet`` over real 127.0.0.1 sockets, streamed and not,
and both turn a wrong key into their own authentication error.
"""

from __future__ import annotations

from typing import Any

import ollama
import openai
import pytest
import trio
from auth_fleet import ALICE_KEY, BOB_KEY, CLIENTS, LIMIT, MODEL, WRONG_KEY, running

MESSAGES: Any = [{"role": "user", "content": "hi"}]


def openai_session(base_url: str) -> tuple[str, str, openai.AuthenticationError]:
    """A plain and a streamed chat with the right key, then one with a wrong key."""
    right = openai.OpenAI(base_url=base_url + "/v1", api_key=ALICE_KEY, max_retries=0)
    wrong = openai.OpenAI(base_url=base_url + "/v1", api_key=WRONG_KEY, max_retries=0)
    with right, wrong:
        plain = right.chat.completions.create(model=MODEL, messages=MESSAGES)
        stream = right.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream)
        with pytest.raises(openai.AuthenticationError) as refused:
            wrong.chat.completions.create(model=MODEL, messages=MESSAGES)
    return plain.choices[0].message.content or "", streamed, refused.value


async def test_openai_client_with_its_api_key() -> None:
    with trio.fail_after(LIMIT):
        async with running(clients=CLIENTS) as proxy:
            plain, streamed, refused = await trio.to_thread.run_sync(
                openai_session, proxy.bound.client_url
            )
            await proxy.finished(2)
            status = proxy.proxy.status()

    assert plain == streamed == "word0 word1 word2 "
    assert refused.status_code == 401
    assert refused.code == "invalid_api_key"
    assert [w["client"] for w in status["workloads"]] == ["alice", "alice"]
    assert len(proxy.node.received) == 2  # the refused one never reached it
    assert all(r.header("authorization") is None for r in proxy.node.received)


def ollama_session(host: str) -> tuple[str, str, ollama.ResponseError]:
    """A plain and a streamed chat with the right key, then one with a wrong key."""
    right = ollama.Client(host=host, headers={"Authorization": f"Bearer {BOB_KEY}"})
    wrong = ollama.Client(host=host, headers={"Authorization": f"Bearer {WRONG_KEY}"})
    with right, wrong:
        plain = right.chat(model=MODEL, messages=MESSAGES, stream=False)
        parts = right.chat(model=MODEL, messages=MESSAGES, stream=True)
        streamed = "".join(part.message.content or "" for part in parts)
        with pytest.raises(ollama.ResponseError) as refused:
            wrong.chat(model=MODEL, messages=MESSAGES)
    return plain.message.content or "", streamed, refused.value


async def test_ollama_client_with_an_authorization_header() -> None:
    with trio.fail_after(LIMIT):
        async with running(clients=CLIENTS) as proxy:
            plain, streamed, refused = await trio.to_thread.run_sync(
                ollama_session, proxy.bound.client_url
            )
            await proxy.finished(2)
            status = proxy.proxy.status()

    assert plain == streamed == "hello"
    assert refused.status_code == 401
    # Ollama's shape: the client shows the proxy's message as the error.
    assert refused.error == "missing or invalid API key"
    assert [w["client"] for w in status["workloads"]] == ["bob", "bob"]
    assert len(proxy.node.received) == 2
    assert all(r.header("authorization") is None for r in proxy.node.received)
