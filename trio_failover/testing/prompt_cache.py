"""A fake node with a prompt cache: its time to first byte grows with the uncached prompt.

Every turn of a conversation resends its whole history; an engine that
served the turn before reads the part it holds from its cache and computes
only the rest (llama-server's slots and host-memory cache, vLLM's prefix
cache). ``PromptCache`` is that engine, as a ``FakeNode`` behaviour: it
keeps the last ``entries`` prompts it served, and a request's prefill takes
``base`` plus ``seconds_per_kib`` for each KiB of its prompt past the
longest prefix it shares with one of them. The head and a first byte come
after the prefill, the rest of the body ``decode`` seconds later (or
``seconds_per_token`` for each of the request's ``max_tokens``). Part of the test kit; import
it from ``trio_failover.testing``.
"""

from __future__ import annotations

import json
from collections import deque

import h11

from .fakes import NodeIO, ReceivedRequest, chat_completion, is_health


class PromptCache:
    """A ``FakeNode`` behaviour that simulates an engine's prompt cache.

    ``prefills``: per request served, the prompt bytes it held and the
    bytes it computed, in order.
    """

    def __init__(
        self,
        *,
        entries: int = 2,
        base: float = 0.05,
        seconds_per_kib: float = 0.1,
        decode: float = 0.5,
        seconds_per_token: float = 0.01,
    ) -> None:
        self.cached: deque[bytes] = deque(maxlen=entries)
        self.base = base
        self.seconds_per_kib = seconds_per_kib
        self.decode = decode
        self.seconds_per_token = seconds_per_token
        self.prefills: list[tuple[int, int]] = []

    async def __call__(self, io: NodeIO, request: ReceivedRequest) -> None:
        """Serve one request: prefill what is not cached, then answer."""
        if is_health(request):
            await io.send(h11.Response(status_code=200, headers=[(b"content-length", b"0")]))
            await io.send(h11.EndOfMessage())
            return
        prompt, tokens = prompt_text(request.body), max_tokens(request.body)
        held = max((common_prefix(prompt, cached) for cached in self.cached), default=0)
        self.prefills.append((held, len(prompt) - held))
        self.cached.append(prompt)  # what the engine holds now, the newest last
        await io.pause(self.base + (len(prompt) - held) / 1024 * self.seconds_per_kib)
        body = json.dumps(chat_completion("fake-model", "an answer")).encode()
        # The first token comes with the head; the rest of the answer after ``decode``.
        await io.send(
            h11.Response(status_code=200, headers=[(b"content-type", b"application/json")]),
            h11.Data(data=body[:1]),
        )
        await io.pause(self.decode if tokens is None else tokens * self.seconds_per_token)
        await io.send(h11.Data(data=body[1:]), h11.EndOfMessage())


def prompt_text(body: bytes) -> bytes:
    """The text an engine would read for a request: its messages' roles and contents."""
    try:
        document = json.loads(body)
    except ValueError:
        return body
    if not isinstance(document, dict):
        return body
    messages = document.get("messages")
    if isinstance(messages, list):
        return "".join(
            f"<{message.get('role')}>{message.get('content')}"
            for message in messages
            if isinstance(message, dict)
        ).encode()
    return str(document.get("prompt", "")).encode()


def max_tokens(body: bytes) -> int | None:
    """The request's ``max_tokens``, if it has one."""
    try:
        document = json.loads(body)
    except ValueError:
        return None
    tokens = document.get("max_tokens") if isinstance(document, dict) else None
    return tokens if isinstance(tokens, int) else None


def common_prefix(first: bytes, second: bytes) -> int:
    """The length of the longest common prefix of two byte strings."""
    limit = min(len(first), len(second))
    low, high = 0, limit  # bisection on whole slices: fast for long prompts
    while low < high:
        middle = (low + high + 1) // 2
        if first[:middle] == second[:middle]:
            low = middle
        else:
            high = middle - 1
    return low
