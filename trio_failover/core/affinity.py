"""Pure: cache affinity: which node most likely holds a request's prompt in its cache.

Every turn of a conversation resends its whole history; the node that
served the turn before holds that prompt in its cache and reads it again
in a fraction of the time (docs/capacity.md, "Cache affinity"). Three
parts, each a plain function of data:

1. ``prompt_chain``: a request's prompt as a chain of block hashes, hashed
   once per request. A chat's blocks are its messages in order (role and
   content); a completion's (``prompt``, Ollama's ``/api/generate``) are
   ``BLOCK_BYTES`` slices of its text. The chain is cumulative: hash ``i``
   covers blocks ``0..i`` (and the model), so one hash names a whole
   prefix and no tokenizer is needed.
2. ``AffinityMemory``: per node, the chains it served recently, bounded per
   node and in all, oldest forgotten first. Its one verb, ``remember``,
   takes this proxy's serves and, with replicas, the others' alike.
3. ``prefer``: the node a request prefers, if any. Two rules hold:

   - **Shared openings decide nothing.** A prefix that more than one node
     holds, or that conversations going different ways share (a block
     seen followed by two different next blocks, this request's included),
     is shared; only a match longer than the shared part prefers a node.
     An agent's long system prompt, sent by every conversation, thus
     prefers no node, and ``--balance`` spreads the conversations.
   - **Load wins over cache.** The node is passed over when it is full, or
     its load is ``LOAD_MARGIN`` or more above the least-loaded ready
     candidate's (capacity unknown: ``ATTEMPTS_MARGIN`` attempts in flight
     more). It never lifts a cooling or down node above a ready one.

Nothing here reads a clock, blocks, or imports outside the standard library.
"""

from __future__ import annotations

import json
import zlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import compress
from operator import ne
from typing import Any, NamedTuple

import attrs

from .names import model_key

# A completion's prompt is hashed in slices of this many bytes: a prompt that
# grows at its end (an agent appending to its context) keeps every full
# slice, and so its chain, but for the last.
BLOCK_BYTES = 1024
# At most this many blocks of a prompt are hashed (4 MiB of a completion's
# text); the rest matches nothing, like a prompt no node served.
MAX_BLOCKS = 4096
DIGEST_BYTES = 8

# The memory's bounds, in (node, block) entries; each costs about
# ``ENTRY_BYTES`` of the proxy's memory (measured with tracemalloc, four
# nodes full: the block's place in its node's order, its hash, and its
# next block's).
MAX_PER_NODE = 8192
MAX_TOTAL = 32768
ENTRY_BYTES = 160

# Load wins over cache: the preferred node is passed over at this much
# more load than the least-loaded ready candidate's (``SlotLedger.load``),
# or, its capacity unknown, this many more attempts in flight.
LOAD_MARGIN = 0.5
ATTEMPTS_MARGIN = 2
# Loads are ratios of small ints: 2/3 - 1/6 must count as 0.5.
_EPSILON = 1e-9


@dataclass(frozen=True, slots=True)
class Chain:
    """A prompt's blocks as cumulative hashes.

    ``hashes[i]`` covers the model and blocks ``0..i``: its high 32 bits
    are their CRC-32, its low 32 bits the number of prompt bytes they span
    (modulo 2**32: far more than a request's body may hold).
    """

    hashes: tuple[int, ...]

    @property
    def ends(self) -> tuple[int, ...]:
        """The prompt bytes of each prefix: ``ends[i]`` those of blocks ``0..i``."""
        return tuple(digest & _LOW for digest in self.hashes)

    def matched_bytes(self, blocks: int) -> int:
        """The prompt bytes of the chain's first ``blocks`` blocks."""
        return self.hashes[blocks - 1] & _LOW if blocks > 0 else 0


def prompt_chain(document: Any) -> Chain | None:
    """The chain of a request's prompt; None when its body has no prompt.

    Understands a chat's ``messages`` (OpenAI's and Ollama's ``/api/chat``)
    and a completion's ``prompt`` (OpenAI's, a string or a list; Ollama's
    ``/api/generate``, with its ``system``). The model's name (as Ollama
    resolves it) is folded into every hash: two models never share a cache.

    Each hash is the CRC-32 of the model and the whole prefix, continued
    block by block (so every byte is read once), and the prefix's length:
    not a cryptographic hash, and need not be one. Two prefixes of one
    length colliding (about one chance in 4 billion) cost a cache miss.
    BLAKE2b was measured at several times the cost (docs/performance.md).
    """
    if not isinstance(document, dict):
        return None
    model = document.get("model")
    crc = zlib.crc32(_text_bytes("", model_key(model)) + b"\0" if isinstance(model, str) else b"\0")
    messages = document.get("messages")
    if isinstance(messages, list):
        return _chat_chain(messages, crc)
    blocks = _prompt_blocks(document)
    if not blocks:
        return None
    hashes: list[int] = []
    total = 0
    for block in blocks:
        crc = zlib.crc32(block, crc)
        total += len(block)
        hashes.append((crc << 32) | (total & _LOW))
    return Chain(tuple(hashes))


def _chat_chain(messages: list[Any], crc: int) -> Chain | None:
    # One block per message. The common message ({"role", "content"}: a
    # role of ``_ROLE_BYTES``, content an ASCII string, whose length in
    # bytes is its length) costs no call of ours and no copy of role and
    # content together: a 100 KB context is read once, by the CRC
    # (docs/performance.md); any other as JSON with sorted keys
    # (``_message_bytes``), or, text, as the same bytes as the common one.
    hashes: list[int] = []
    append = hashes.append
    total = 0
    crc32 = zlib.crc32
    roles = _ROLE_BYTES
    for message in messages[:MAX_BLOCKS]:
        if type(message) is dict and len(message) == 2:
            role, content = message.get("role"), message.get("content")
            head = roles.get(role) if type(role) is str else None
            if head is not None and type(content) is str:
                try:
                    data = content.encode()
                except UnicodeEncodeError:  # a lone surrogate
                    data = _utf8(content)
                crc = crc32(data, crc32(head, crc))
                total += len(head) + len(data)
                append((crc << 32) | (total & _LOW))
                continue
        block = _message_bytes(message)
        crc = crc32(block, crc)
        total += len(block)
        append((crc << 32) | (total & _LOW))
    return Chain(tuple(hashes)) if hashes else None


# The roles of the common message, as its block begins: the role and a NUL.
_ROLE_BYTES = {role: role.encode() + b"\0" for role in ("system", "user", "assistant", "tool")}
_LOW = 0xFFFFFFFF


def _prompt_blocks(document: dict[str, Any]) -> list[bytes]:
    prompt = document.get("prompt")
    if prompt is None:
        return []
    text = prompt if isinstance(prompt, str) else _json(prompt)
    system = document.get("system")  # Ollama's /api/generate: it comes before the prompt
    blocks: list[bytes] = []
    if isinstance(system, str) and system:
        blocks.append(_text_bytes("system", system))
    data = _text_bytes("", text)
    end = min(len(data), BLOCK_BYTES * (MAX_BLOCKS - len(blocks)))
    blocks.extend(data[start : start + BLOCK_BYTES] for start in range(0, end, BLOCK_BYTES))
    return blocks


def _message_bytes(message: object) -> bytes:
    # Any message but the common ASCII one (``_chat_chain``): role and
    # content of text that is not ASCII as the common one's bytes; one
    # with content parts, tool calls or names as JSON with sorted keys.
    if isinstance(message, dict) and len(message) == 2:
        role, content = message.get("role"), message.get("content")
        if isinstance(role, str) and isinstance(content, str):
            return _text_bytes(role, content)
    return _json(message).encode()


def _text_bytes(role: str, text: str) -> bytes:
    data = _utf8(text)
    return _utf8(role) + b"\0" + data if role else data


def _utf8(text: str) -> bytes:
    try:
        return text.encode()
    except UnicodeEncodeError:  # a lone surrogate, from a JSON escape
        return text.encode("utf-8", "surrogatepass")


def _json(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


# -- the memory ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Matches:
    """What the memory knows of one chain.

    ``blocks``: per node, the length of its longest match (nodes with none
    left out); ``shared``: how many leading blocks are shared (held by
    several nodes, or the opening of conversations that went different ways).
    """

    blocks: Mapping[str, int]
    shared: int


NO_MATCH = Matches({}, 0)


class AffinityMemory:
    """Per node, the chains it served recently; oldest forgotten first.

    Bounded by ``max_per_node`` (node, block) entries per node and
    ``max_total`` in all (about ``ENTRY_BYTES`` each). A chain is remembered
    from its last block to its first, so a node forgets a conversation's
    latest blocks before its opening, and what a node holds of any chain is
    a prefix of it: a block is never more recent than the blocks before it
    in its chain (its hash covers them, so every chain that holds it holds
    them too, and remembering it touches them after it). ``match`` relies
    on that: it finds each node's match by halving, not block by block.

    ``remember`` is one pass over the chain, from its end, of a move and a
    store per block (the next-block table only for the blocks new to the
    node); ``match`` reads the next-block table in C loops. What that
    costs a 100 KB conversation: docs/performance.md, "Cache affinity".
    """

    def __init__(self, max_per_node: int = MAX_PER_NODE, max_total: int = MAX_TOTAL) -> None:
        if max_per_node < 1 or max_total < 1:
            raise ValueError("affinity memory bounds must be >= 1")
        self.max_per_node = max_per_node
        self.max_total = max_total
        # Per node its blocks, oldest first, each with the number of the
        # ``remember`` that last touched it: the oldest entry in all is the
        # oldest of the nodes' first ones (one call touches one node), so
        # no second order of (node, block) pairs is kept.
        self._by_node: dict[str, OrderedDict[int, int]] = {}
        self._calls = 0
        self._total = 0
        # The one next block seen after a block, or ``_BRANCHED`` once two
        # different ones were (conversations that went different ways).
        self._next: dict[int, int] = {}

    def __len__(self) -> int:
        """The (node, block) entries held."""
        return self._total

    def held(self, node: str) -> int:
        """The blocks ``node`` holds."""
        held = self._by_node.get(node)
        return len(held) if held is not None else 0

    def match(self, chain: Chain) -> Matches:
        """Each node's longest match of ``chain``, and its shared part."""
        hashes = chain.hashes
        blocks: dict[str, int] = {}
        for node, held in self._by_node.items():
            matched = _held_prefix(hashes, held)
            if matched:
                blocks[node] = matched
        if not blocks:
            return NO_MATCH
        if len(blocks) == 1:  # one node holds any of it (the common case): no sort
            (longest,), shared = blocks.values(), 0
        else:
            lengths = sorted(blocks.values())
            longest = lengths[-1]
            # held by two nodes or more: the second-longest match's blocks
            shared = lengths[-2]
        # The last block seen followed by another than this chain's next one,
        # or branched; one with no next seen yields this chain's: no
        # difference. In C loops: a 41-block chain costs no Python per block.
        # A chain of one block has no next block to look at.
        nexts = self._next
        following = hashes[1 : longest + 1]
        if following:
            seen = map(nexts.get, hashes[:longest], following)
            differs = max(compress(range(longest), map(ne, seen, following)), default=-1)
            shared = max(shared, differs + 1)
        if longest == len(hashes) and nexts.get(hashes[-1]) == _BRANCHED:
            shared = longest  # the chain's last block: it has no next to differ from
        return Matches(blocks, shared)

    def remember(self, node: str, hashes: Sequence[int]) -> None:
        """``node`` served the chain ``hashes`` (this proxy's serve, or another replica's)."""
        held = self._by_node.get(node)
        if held is None:
            held = self._by_node[node] = OrderedDict()
        # The opening last: the most recent, forgotten last. A plain loop:
        # map() over move_to_end was measured slower (docs/performance.md).
        # A block's next one is set, or found to differ (branched), only
        # where that next one is new to the node: a next one it held came
        # with its block already (a prefix), so most of a chain is moves.
        self._calls += 1
        call = self._calls
        nexts = self._next
        move = held.move_to_end  # a pop and a store would free and make its link
        following: int | None = None  # the block after this one, when it is new here
        for digest in reversed(hashes):
            if following is not None and nexts.setdefault(digest, following) != following:
                nexts[digest] = _BRANCHED
            if digest in held:
                move(digest)
                following = None
            else:
                self._total += 1
                following = digest
            held[digest] = call  # at the end now: the most recent
        while len(held) > self.max_per_node:
            self._drop(held)
        while self._total > self.max_total:
            self._drop(min(filter(None, self._by_node.values()), key=_oldest_call))

    def _drop(self, held: OrderedDict[int, int]) -> None:
        # a node's oldest block forgotten; by all nodes, its links go too
        digest, _ = held.popitem(last=False)
        self._total -= 1
        if not any(digest in other for other in self._by_node.values()):
            self._next.pop(digest, None)


# Not a block's hash: those are CRC << 32 | length, never negative.
_BRANCHED = -1


def _oldest_call(held: OrderedDict[int, int]) -> int:
    return next(iter(held.values()))


def _held_prefix(hashes: Sequence[int], held: Mapping[int, int]) -> int:
    # How many leading blocks of ``hashes`` ``held`` holds: a prefix
    # (``AffinityMemory``), found by halving.
    low, high = 0, len(hashes)
    if high and hashes[-1] in held:
        return high
    while low < high:
        middle = (low + high) // 2
        if hashes[middle] in held:
            low = middle + 1
        else:
            high = middle
    return low


@attrs.frozen
class Served:
    """``node`` served a request whose prompt has ``chain``: the record replicas share.

    ``chain``: the chain's hashes in hex (``Chain.hashes``); ``origin``: the
    replica that made it (None: this one). ``core/fleet_records.py`` carries
    it as the ``served`` kind.
    """

    node: str
    chain: tuple[str, ...]
    origin: str | None = None

    def hashes(self) -> list[int] | None:
        """The chain as ``AffinityMemory`` keeps it; None when it is not one of ours."""
        if not self.chain or len(self.chain) > MAX_BLOCKS:
            return None
        if any(len(digest) != 2 * DIGEST_BYTES for digest in self.chain):
            return None
        try:
            return [int(digest, 16) for digest in self.chain]
        except ValueError:
            return None


def digest_text(digest: int) -> str:
    """A chain's hash as ``Served`` carries it: 16 hex digits."""
    return f"{digest:016x}"


# -- the choice ------------------------------------------------------------------------


class Candidate(NamedTuple):
    """A candidate node as the choice sees it now.

    ``load``: ``SlotLedger.load`` (``in_flight / max(capacity, 1)``, or the
    engine's reading); ``capacity`` 0: unknown (no limit). A named tuple:
    one is made per candidate of every request, at a third of a frozen
    dataclass's cost.
    """

    name: str
    ready: bool
    full: bool
    load: float
    in_flight: int
    capacity: int


def prefer(matches: Matches, candidates: Sequence[Candidate]) -> str | None:
    """The node the request prefers for its cache, or None (``--balance`` decides).

    The candidate with the longest match beyond the shared part, alone with
    it, among the ready candidates (all of them when none is ready); None
    when nothing it has of its own matches, on a tie, or when load wins:
    the node is full, or ``LOAD_MARGIN`` or more above the least-loaded
    ready candidate (capacity unknown: ``ATTEMPTS_MARGIN`` attempts in
    flight above the fewest).
    """
    blocks = matches.blocks
    if not blocks:
        return None
    group = [node for node in candidates if node.ready] or candidates
    # The longest match in the group, its node, and how many nodes match as long.
    best, home, homes = 0, None, 0
    for node in group:
        held = blocks.get(node.name, 0)
        if held > best:
            best, home, homes = held, node, 1
        elif held == best:
            homes += 1
    if best <= matches.shared or home is None:
        return None  # nothing of its own matches: a new conversation, or a shared opening
    if homes != 1:
        return None  # a tie (two nodes holding one block make it shared: kept for safety)
    if home.full:
        return None
    if home.capacity > 0:
        least = min([node.load for node in group])
        if home.load - least >= LOAD_MARGIN - _EPSILON:
            return None
    elif home.in_flight - min([node.in_flight for node in group]) >= ATTEMPTS_MARGIN:
        return None
    return home.name
