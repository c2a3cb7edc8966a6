"""API keys of the gateway: who may call it, as which tenant, at which priorities, how often.

A key is `sk-llmw-<id>-<secret>`. The keys file (GATEWAY_KEYS_FILE, JSON, written by `llm-worker gateway keys`
or mounted from a Kubernetes Secret) holds, per key, its id, the SHA-256 of the whole key, and what the key
may do; never the key itself. A presented key is found by its id and checked by comparing digests in constant
time, so a check costs one hash of about 60 bytes. The secret is 256 random bits: a plain hash is enough (a
password hash's slowness protects guessable secrets, and these are not guessable).

The file is read again when it changes (checked every `reload_s`), so adding or revoking a key needs no
restart; a file that no longer parses keeps the keys read last, with an error in the log.

Without a keys file the gateway is open: every caller is trusted (X-Tenant and X-Priority are honoured), which
is safe only on loopback or behind a proxy that authenticates; cli.py refuses any other address then.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
import re
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

log = logging.getLogger(__name__)

PREFIX = "sk-llmw-"
KEY_ID = re.compile(r"^[0-9a-f]{12}$")
TENANT = re.compile(r"^[!-~]{1,64}$")
"""As schemas.request's TenantId allows (visible ASCII), so that a key's tenant is always a valid wire tenant."""


class KeyEntry(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One key as the keys file stores it."""

    id: str
    sha256: str
    tenant: str
    most_urgent: int = 1
    """The most urgent priority the key may use (0 is the most urgent of all): a ceiling, not a default."""
    trusted: bool = False
    """May name another tenant (X-Tenant): for an upstream that authenticates its own users."""
    requests_per_minute: int = 0
    """Requests a minute (generation, files, batches); 0: no limit."""
    background: bool = True
    """May create background responses (`background: true`): work that runs after the caller has gone and that
    the gateway keeps, so an operator can keep a key to interactive requests."""
    name: str = ""
    created_at: int = 0


class KeysFile(msgspec.Struct, kw_only=True):
    keys: list[KeyEntry] = []


class KeyFileError(ValueError):
    pass


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> tuple[str, str]:
    """(id, key)."""
    ident = secrets.token_hex(6)
    return ident, f"{PREFIX}{ident}-{secrets.token_urlsafe(32)}"


def key_id_of(key: str) -> str | None:
    """The id inside a presented key, or None when it is not one of ours (never logged whole)."""
    if not key.startswith(PREFIX):
        return None
    ident = key[len(PREFIX):len(PREFIX) + 12]
    return ident if KEY_ID.match(ident) and key[len(PREFIX) + 12:len(PREFIX) + 13] == "-" else None


def read_keys(path: Path) -> list[KeyEntry]:
    try:
        parsed = msgspec.json.decode(path.read_bytes(), type=KeysFile)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise KeyFileError(f"GATEWAY_KEYS_FILE {path} cannot be read: {exc}") from None
    seen: set[str] = set()
    for entry in parsed.keys:
        if not KEY_ID.match(entry.id) or entry.id in seen:
            raise KeyFileError(f"GATEWAY_KEYS_FILE {path}: key id {entry.id!r} is malformed or repeated")
        if not re.fullmatch(r"[0-9a-f]{64}", entry.sha256):
            raise KeyFileError(f"GATEWAY_KEYS_FILE {path}: key {entry.id} has no valid sha256")
        if not TENANT.match(entry.tenant):
            raise KeyFileError(f"GATEWAY_KEYS_FILE {path}: key {entry.id} has an invalid tenant {entry.tenant!r}")
        if entry.most_urgent < 0 or entry.requests_per_minute < 0:
            raise KeyFileError(f"GATEWAY_KEYS_FILE {path}: key {entry.id} has a negative limit")
        seen.add(entry.id)
    return parsed.keys


def write_keys(path: Path, keys: list[KeyEntry]) -> None:
    """Atomically, readable by its owner only (it names tenants and limits, though no key)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(msgspec.json.format(msgspec.json.encode(KeysFile(keys=keys)), indent=2))
    os.replace(tmp, path)


@dataclass(slots=True)
class Rate:
    """A token bucket of `per_minute` requests, refilled continuously."""

    per_minute: int
    tokens: float = 0.0
    at: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.tokens = float(self.per_minute)

    def take(self, now: float) -> float:
        """0 when a request may go now, else the seconds until one may."""
        self.tokens = min(self.per_minute, self.tokens + (now - self.at) * self.per_minute / 60.0)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) * 60.0 / self.per_minute


class Keys:
    """The keys file, read again when it changes. `check` is what a request pays: a dict lookup and a hash."""

    def __init__(self, path: Path, reload_s: float = 2.0) -> None:
        self.path = path
        self.reload_s = reload_s
        self._by_id: dict[str, KeyEntry] = {}
        self._rates: dict[str, Rate] = {}
        self._seen: tuple | None = None
        self._task: asyncio.Task | None = None

    @property
    def enabled(self) -> bool:
        """Whether keys are required: a keys file exists (one with no keys left refuses everyone)."""
        return self._seen is not None

    def _stamp(self) -> tuple | None:
        try:
            st = os.stat(self.path)  # follows the symlink a mounted Secret swaps on update
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def load(self) -> None:
        """Read the file now; raises KeyFileError when it exists and is bad (a start must fail on it)."""
        stamp = self._stamp()
        entries = read_keys(self.path) if stamp is not None else []
        self._apply(stamp, entries)

    def _apply(self, stamp: tuple | None, entries: list[KeyEntry]) -> None:
        self._by_id = {entry.id: entry for entry in entries}
        # A key keeps its bucket across reloads unless its rate changed.
        self._rates = {entry.id: self._rates[entry.id] if entry.id in self._rates
                       and self._rates[entry.id].per_minute == entry.requests_per_minute
                       else Rate(entry.requests_per_minute)
                       for entry in entries if entry.requests_per_minute > 0}
        if stamp != self._seen:
            log.info("API keys: %s (%d keys)", self.path if stamp is not None else "none, the gateway is open",
                     len(entries))
        self._seen = stamp

    async def reload_if_changed(self) -> None:
        stamp = await asyncio.to_thread(self._stamp)
        if stamp == self._seen:
            return
        if stamp is None:
            log.error("GATEWAY_KEYS_FILE %s is gone: keeping the %d keys read last", self.path, len(self._by_id))
            return
        try:
            entries = await asyncio.to_thread(read_keys, self.path)
        except KeyFileError as exc:
            log.error("%s; keeping the %d keys read last", exc, len(self._by_id))
            self._seen = stamp  # not again until it changes
            return
        self._apply(stamp, entries)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.reload_s)
            try:
                await self.reload_if_changed()
            except Exception:
                log.exception("reading GATEWAY_KEYS_FILE %s failed", self.path)

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name="gateway-keys")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def check(self, authorization: str | None) -> KeyEntry | None:
        """The key's entry, or None when the header names no valid key."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        key = authorization[7:].strip()
        ident = key_id_of(key)
        entry = self._by_id.get(ident) if ident is not None else None
        if entry is None or not hmac.compare_digest(digest(key), entry.sha256):
            return None
        return entry

    def wait_s(self, entry: KeyEntry) -> float:
        """0 when the key may send one more request now, else how long until it may."""
        rate = self._rates.get(entry.id)
        return 0.0 if rate is None else rate.take(time.monotonic())
