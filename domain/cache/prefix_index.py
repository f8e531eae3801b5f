"""The prefix-cache policy: a radix tree of cached token prefixes, LRU order and a byte budget.

Entries hold an opaque handle to adapter state (target KV, recurrent state, drafter features) for the
rows of `tokens`. A state can be cut back exactly to any length from `min_length` up (0 for plain KV,
the full length for recurrent or wrapped sliding-window state), so a lookup returns the longest usable
prefix, not merely the longest common one. Pure bookkeeping: no arrays, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import attrs

from mlx_dspark.domain.cache.snapshots import common_prefix as _common


@attrs.define(eq=False, kw_only=True)
class CacheEntry:
    """One cached prefix.

    Attributes:
        tokens: the token ids whose rows the state holds.
        handle: adapter state (or, on the disk tier, the key of its file).
        nbytes: what the state costs in its tier.
        min_length: the shortest prefix the state can be cut to exactly.
        last_used: LRU tick of the last insert or hit.
    """

    tokens: tuple[int, ...]
    handle: Any
    nbytes: int
    min_length: int
    last_used: int = 0

    def usable(self, common: int) -> int:
        """Rows this entry can serve to a prompt sharing `common` leading tokens with it (0 = none)."""
        n = min(common, len(self.tokens))
        return n if n >= max(self.min_length, 1) else 0

    def serves(self, other: CacheEntry) -> bool:
        """Whether every prefix `other` can serve, this entry serves too (then `other` is redundant)."""
        n = len(other.tokens)
        return (
            n <= len(self.tokens)
            and self.min_length <= other.min_length
            and self.tokens[:n] == other.tokens
        )


@attrs.frozen(kw_only=True)
class StoredPrefix:
    """A prefix-cache entry on disk (where and how is the store adapter's business).

    Attributes:
        key: the store's name for it (the token-prefix hash).
        tag: the target state tag it was saved under.
        tokens: its token ids.
        nbytes: its size on disk.
        min_length: the shortest prefix its state can be cut back to.
    """

    key: str
    tag: str
    tokens: tuple[int, ...]
    nbytes: int
    min_length: int


@attrs.frozen(kw_only=True)
class Match:
    """The best entry for a prompt and how many of its leading tokens it serves."""

    entry: CacheEntry
    length: int


@attrs.define(eq=False)
class _Node:
    label: tuple[int, ...] = ()  # the edge from the parent
    children: dict[int, _Node] = attrs.Factory(dict)
    entries: list[CacheEntry] = attrs.Factory(list)
    parent: _Node | None = None


@attrs.frozen(kw_only=True)
class InsertResult:
    """What an insert did.

    Attributes:
        stored: whether the new entry was admitted (not when over budget, or an entry already serves it).
        evicted: entries removed for room, least recently used first (the caller may spill them).
        replaced: entries removed because the new one serves every prefix they served.
    """

    stored: bool
    evicted: tuple[CacheEntry, ...] = ()
    replaced: tuple[CacheEntry, ...] = ()


class PrefixIndex:
    """Cached prefixes under a byte budget.

    Eviction is least recently used, with one guard: an entry is only evicted to make room for an entry
    at least as long (as costly to prefill again). A short side request between two turns of a long
    conversation is therefore dropped itself rather than evict the conversation.

    Args:
        budget_bytes: the most the entries may hold together (0 disables the index).
    """

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._root = _Node()
        self._where: dict[int, _Node] = {}  # id(entry) -> its node
        self._tick = 0
        self.used_bytes = 0

    def __len__(self) -> int:
        return len(self._where)

    def entries(self) -> list[CacheEntry]:
        """Every entry, least recently used first."""
        found = [e for node in self._nodes() for e in node.entries]
        return sorted(found, key=lambda e: e.last_used)

    def lookup(self, tokens: Sequence[int], limit: int | None = None) -> Match | None:
        """The entry serving the most leading tokens of `tokens` (at most `limit`), or None."""
        tokens = tuple(tokens if limit is None else tokens[: max(limit, 0)])
        path: list[tuple[_Node, int]] = []  # (subtree root, tokens shared with every entry below it)
        node, depth = self._root, 0
        while True:
            path.append((node, depth))
            if depth == len(tokens):
                break
            child = node.children.get(tokens[depth])
            if child is None:
                break
            shared = _common(child.label, tokens[depth:])
            if shared < len(child.label):
                path.append((child, depth + shared))
                break
            node, depth = child, depth + shared
        best: Match | None = None
        # Deepest subtree first: any entry below it shares at least `depth` tokens with the prompt.
        for subtree, depth in reversed(path):
            if best is not None and best.length >= depth:
                break
            for entry in _below(subtree):
                n = entry.usable(depth)
                if n and (best is None or (n, entry.last_used) > (best.length, best.entry.last_used)):
                    best = Match(entry=entry, length=n)
        return best

    def touch(self, entry: CacheEntry) -> None:
        """Mark a hit (most recently used)."""
        self._tick += 1
        entry.last_used = self._tick

    def insert(self, entry: CacheEntry) -> InsertResult:
        """Admit `entry` if the budget allows, evicting older entries no longer than it."""
        if entry.nbytes > self.budget_bytes or not entry.tokens:
            return InsertResult(stored=False)
        covering = [e for e in self.entries() if e.serves(entry)]
        if covering:  # an entry already serves every prefix this one would
            self.touch(covering[-1])
            return InsertResult(stored=False)
        replaced = [e for e in self.entries() if entry.serves(e)]
        room = self.budget_bytes - self.used_bytes + sum(e.nbytes for e in replaced)
        victims: list[CacheEntry] = []
        if room < entry.nbytes:
            for old in self.entries():
                if old in replaced or len(old.tokens) > len(entry.tokens):
                    continue
                victims.append(old)
                room += old.nbytes
                if room >= entry.nbytes:
                    break
            if room < entry.nbytes:
                return InsertResult(stored=False)
        for old in (*replaced, *victims):
            self.remove(old)
        self._place(entry)
        self.touch(entry)
        return InsertResult(stored=True, evicted=tuple(victims), replaced=tuple(replaced))

    def remove(self, entry: CacheEntry) -> None:
        """Drop `entry` (a no-op when it is not here)."""
        node = self._where.pop(id(entry), None)
        if node is None:
            return
        node.entries.remove(entry)
        self.used_bytes -= entry.nbytes
        self._prune(node)

    def shrink_to(self, budget_bytes: int) -> list[CacheEntry]:
        """Lower the budget, evicting least recently used entries; returns them."""
        self.budget_bytes = budget_bytes
        out: list[CacheEntry] = []
        for old in self.entries():
            if self.used_bytes <= budget_bytes:
                break
            self.remove(old)
            out.append(old)
        return out

    # The radix tree -------------------------------------------------------------------------------

    def _place(self, entry: CacheEntry) -> None:
        node, rest = self._root, entry.tokens
        while rest:
            child = node.children.get(rest[0])
            if child is None:
                leaf = _Node(label=rest, parent=node)
                node.children[rest[0]] = leaf
                node = leaf
                break
            shared = _common(child.label, rest)
            if shared < len(child.label):
                # Split the edge: node -> middle (shared part) -> child (the rest of its label).
                middle = _Node(label=child.label[:shared], parent=node)
                node.children[rest[0]] = middle
                child.label = child.label[shared:]
                child.parent = middle
                middle.children[child.label[0]] = child
                child = middle
            node, rest = child, rest[shared:]
        node.entries.append(entry)
        self._where[id(entry)] = node
        self.used_bytes += entry.nbytes

    def _prune(self, node: _Node) -> None:
        while node.parent is not None and not node.entries:
            parent = node.parent
            if not node.children:
                del parent.children[node.label[0]]
                node = parent
                continue
            if len(node.children) == 1:  # merge a pass-through node into its only child
                (child,) = node.children.values()
                child.label = node.label + child.label
                child.parent = parent
                parent.children[child.label[0]] = child
            return

    def _nodes(self) -> Iterator[_Node]:
        stack = [self._root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


def _below(node: _Node) -> Iterator[CacheEntry]:
    stack = [node]
    while stack:
        n = stack.pop()
        yield from n.entries
        stack.extend(n.children.values())

