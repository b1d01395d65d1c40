"""Bounded, expiring in-memory store behind `response_format="url"`.

Tokens are unguessable (secrets.token_urlsafe); entries expire after `ttl_s` and the oldest are
evicted once either the entry count or the byte total would exceed its bound, so a flood of url
requests cannot grow the server's memory without limit. Expiry is checked on every read. An
entry made for an API key is served only to that key (serving/owners.py).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from .owners import visible


@dataclass
class _Entry:
    data: bytes
    media_type: str
    expires: float
    owner: str | None = None


class UrlStore:
    def __init__(self, max_items: int = 256, max_bytes: int = 256 << 20, ttl_s: float = 600.0):
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, data: bytes, media_type: str, owner: str | None = None) -> str:
        token = secrets.token_urlsafe(24)
        with self._lock:
            self._expire(time.monotonic())
            self._entries[token] = _Entry(data, media_type, time.monotonic() + self.ttl_s, owner)
            self._bytes += len(data)
            while self._entries and (
                len(self._entries) > self.max_items or self._bytes > self.max_bytes
            ):
                _, old = self._entries.popitem(last=False)
                self._bytes -= len(old.data)
        return token

    def get(self, token: str, requester: str | None = None) -> tuple[bytes, str] | None:
        """(bytes, media type), or None: unknown, expired, or another key's."""
        with self._lock:
            self._expire(time.monotonic())
            entry = self._entries.get(token)
            if entry is None or not visible(entry.owner, requester):
                return None
            return entry.data, entry.media_type

    def __len__(self) -> int:
        return len(self._entries)

    def _expire(self, now: float) -> None:
        # Entries are in insertion order and share one TTL, so expired ones lead.
        while self._entries:
            token, entry = next(iter(self._entries.items()))
            if entry.expires > now:
                break
            del self._entries[token]
            self._bytes -= len(entry.data)
