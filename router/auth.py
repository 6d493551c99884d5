"""API keys and per-key quotas for the Router (both protocols).

Keys are stored as sha256 hex digests in the file `auth.api_keys_file` names (a k8s Secret
mounted as a file), re-read when it changes; no file configured = open (every client served,
logged at start). `ApiKeys.check` authenticates one request from its authorization value
(`Bearer <key>`) and takes one token from the key's rate bucket; `hold_stream` counts a
synthesis stream against the key's concurrency limit until it ends. Keys never reach a log
line, an error message or a metric label: a key is known by its name in the file (or the first
8 hex digits of its digest).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from core.config import AuthConfig

logger = logging.getLogger("ray.serve.voxray.auth")  # under Serve's logger: lines land in the replica log
SHA256_HEX_CHARS = 64
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


class Unauthenticated(Exception):
    """No key, a malformed authorization value, or a key not in the file (gRPC UNAUTHENTICATED / 401)."""


class QuotaExceeded(Exception):
    """The key is over its request rate or concurrent streams (RESOURCE_EXHAUSTED / 429)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class KeyUsage:
    """One key's token bucket and open streams."""

    tokens: float
    refilled_at_s: float
    open_streams: int = 0


@dataclass
class KeyFile:
    """Digest -> key name, as read from the keys file at `mtime_ns`."""

    names: dict[str, str] = field(default_factory=dict)
    mtime_ns: int = -1


def parse_keys_file(text: str) -> dict[str, str]:
    """`<sha256-hex> [name]` per line ('#' starts a comment) -> {digest: name}."""
    names: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        parts = line.split("#", 1)[0].split()
        if not parts:
            continue
        digest = parts[0].lower()
        if len(digest) != SHA256_HEX_CHARS or any(ch not in "0123456789abcdef" for ch in digest):
            raise ValueError(f"api keys file line {number}: expected a sha256 hex digest first")
        names[digest] = parts[1] if len(parts) > 1 else digest[:8]
    return names


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def bearer_key(authorization: str | None) -> str:
    """The key in an authorization value `Bearer <key>`; raises Unauthenticated otherwise."""
    if not authorization:
        raise Unauthenticated("authorization: missing API key (send 'Bearer <key>')")
    scheme, _, key = authorization.strip().partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key or not key.isascii() or not key.isprintable():
        raise Unauthenticated("authorization: expected 'Bearer <key>'")
    return key


class ApiKeys:
    """The Router's key check and per-key quotas (state is per Router replica)."""

    def __init__(
        self, config: AuthConfig, clock: Callable[[], float] = time.monotonic, listen_host: str = "127.0.0.1"
    ) -> None:
        self.config = config
        self.clock = clock
        self.usage: dict[str, KeyUsage] = {}
        self.keys = KeyFile()
        self.checked_at_s = float("-inf")
        if self.is_open:
            log = logger.warning if listen_host in LOOPBACK_HOSTS else logger.error
            log(
                "auth: no api_keys_file configured; the server is OPEN (every client is served without a key) "
                "and it listens on %s. Set auth.api_keys_file before exposing it beyond loopback.",
                listen_host,
            )
        else:
            self._reload()
            logger.info("auth: %d API keys loaded from %s", len(self.keys.names), config.api_keys_file)

    @property
    def is_open(self) -> bool:
        return self.config.api_keys_file is None

    def check(self, authorization: str | None) -> str | None:
        """The key's name (None when open) after taking one request from its rate; raises
        Unauthenticated or QuotaExceeded."""
        if self.is_open:
            return None
        self._maybe_reload()
        name = self.keys.names.get(key_digest(bearer_key(authorization)))
        if name is None:
            raise Unauthenticated("authorization: unknown API key")
        self._take_token(name)
        return name

    @contextmanager
    def hold_stream(self, name: str | None) -> Iterator[None]:
        """Count one synthesis stream against the key's concurrency limit while the block runs."""
        if name is None:
            yield
            return
        usage = self._usage(name)
        if usage.open_streams >= self.config.max_streams_per_key:
            logger.info("auth: key %r at its %d concurrent streams", name, self.config.max_streams_per_key)
            raise QuotaExceeded(f"key quota: {self.config.max_streams_per_key} concurrent streams in use", 1.0)
        usage.open_streams += 1
        try:
            yield
        finally:
            usage.open_streams -= 1

    def _usage(self, name: str) -> KeyUsage:
        if name not in self.usage:
            self.usage[name] = KeyUsage(tokens=float(self.config.burst_per_key), refilled_at_s=self.clock())
        return self.usage[name]

    def _take_token(self, name: str) -> None:
        usage, now = self._usage(name), self.clock()
        rate, burst = self.config.requests_per_s_per_key, float(self.config.burst_per_key)
        usage.tokens = min(burst, usage.tokens + (now - usage.refilled_at_s) * rate)
        usage.refilled_at_s = now
        if usage.tokens < 1.0:
            retry_after_s = (1.0 - usage.tokens) / rate
            logger.info("auth: key %r over %.3g requests/s", name, rate)
            raise QuotaExceeded(f"key quota: over {rate:g} requests/s", retry_after_s)
        usage.tokens -= 1.0

    def _maybe_reload(self) -> None:
        now = self.clock()
        if now - self.checked_at_s >= self.config.reload_interval_s:
            self.checked_at_s = now
            try:
                self._reload()
            except (OSError, ValueError) as err:  # keep serving with the keys last read
                logger.error("auth: keeping the %d keys last read: %s", len(self.keys.names), err)

    def _reload(self) -> None:
        path = Path(self.config.api_keys_file)
        mtime_ns = os.stat(path).st_mtime_ns
        if mtime_ns != self.keys.mtime_ns:
            self.keys = KeyFile(parse_keys_file(path.read_text()), mtime_ns)
            if not self.keys.names:
                logger.warning("auth: %s holds no keys; every request will be refused", path)
