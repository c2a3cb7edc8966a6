"""API keys without a broker: the keys file and its reload, the checks a request pays, the priority ceiling,
who may name a tenant, and the CLI that makes keys (printed once, stored hashed)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

from gateway.app import Caller
from gateway.cli import open_bind_refusal
from gateway.keys import KeyEntry, KeyFileError, Keys, digest, new_key, read_keys, write_keys
from gateway.openai_api import ApiError, Tiers
from gateway.settings import GatewaySettings


def entry(key: str, ident: str, **kw) -> KeyEntry:
    return KeyEntry(id=ident, sha256=digest(key), tenant=kw.pop("tenant", "acme"), **kw)


def test_a_key_is_checked_by_its_hash_and_a_revoked_one_stops_working_after_a_reload(tmp_path):
    path = tmp_path / "keys.json"
    (ident, key), (other_id, other) = new_key(), new_key()
    write_keys(path, [entry(key, ident), entry(other, other_id, tenant="beta")])
    assert key not in path.read_text() and digest(key) in path.read_text()
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    keys = Keys(path)
    keys.load()
    assert keys.enabled
    assert keys.check(f"Bearer {key}").tenant == "acme"
    assert keys.check(f"Bearer {other}").tenant == "beta"
    for bad in (None, "", key, f"Bearer {key}x", f"Bearer {key[:-1]}", "Bearer sk-llmw-", f"Basic {key}",
                f"Bearer {other[:21]}{key[21:]}"):  # another key's id with this key's secret
        assert keys.check(bad) is None, bad

    write_keys(path, [entry(other, other_id, tenant="beta")])
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))  # a reload within the same mtime tick
    asyncio.run(keys.reload_if_changed())
    assert keys.check(f"Bearer {key}") is None and keys.check(f"Bearer {other}") is not None


def test_a_bad_keys_file_fails_the_start_and_a_bad_reload_keeps_the_last_keys(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text('{"keys": [{"id": "nothex", "sha256": "00", "tenant": "a"}]}')
    with pytest.raises(KeyFileError, match="malformed"):
        Keys(path).load()
    ident, key = new_key()
    write_keys(path, [entry(key, ident)])
    keys = Keys(path)
    keys.load()
    path.write_text("{not json")
    asyncio.run(keys.reload_if_changed())
    assert keys.check(f"Bearer {key}") is not None
    # A file with every key revoked refuses everyone: keys stay on.
    write_keys(path, [])
    empty = Keys(path)
    empty.load()
    assert empty.enabled and empty.check(f"Bearer {key}") is None
    absent = Keys(tmp_path / "absent.json")
    absent.load()
    assert not absent.enabled  # no file: an open gateway


def test_the_rate_limit_refills_over_the_minute(tmp_path):
    path = tmp_path / "keys.json"
    ident, key = new_key()
    write_keys(path, [entry(key, ident, requests_per_minute=2)])
    keys = Keys(path)
    keys.load()
    e = keys.check(f"Bearer {key}")
    assert keys.wait_s(e) == 0 and keys.wait_s(e) == 0
    wait = keys.wait_s(e)
    assert 25 < wait <= 30  # one request a 30 s


def test_the_priority_ceiling_refuses_what_is_asked_and_lowers_the_default():
    tiers = Tiers(num_priorities=3, default_priority=1)
    assert tiers.priority(None, None, most_urgent=2) == 2  # default lowered to what the key may use
    assert tiers.priority("flex", None, most_urgent=2) == 2
    assert tiers.priority(None, "0", most_urgent=0) == 0
    for tier, header in (("priority", None), (None, "1"), ("scale", None)):
        with pytest.raises(ApiError) as refused:
            tiers.priority(tier, header, most_urgent=2)
        assert refused.value.status == 403 and refused.value.code == "priority_not_allowed"


def test_only_a_trusted_key_or_an_open_gateway_names_a_tenant():
    ordinary = Caller(KeyEntry(id="0" * 12, sha256="0" * 64, tenant="acme"))
    trusted = Caller(KeyEntry(id="1" * 12, sha256="0" * 64, tenant="upstream", trusted=True))
    assert ordinary.tenant(None) == "acme" and ordinary.tenant("acme") == "acme"
    with pytest.raises(ApiError) as refused:
        ordinary.tenant("victim")
    assert refused.value.status == 403 and refused.value.param == "X-Tenant"
    assert trusted.tenant("team-x") == "team-x" and trusted.tenant(None) == "upstream"
    assert Caller(None).tenant("anyone") == "anyone" and Caller(None).owner == "anonymous"
    assert ordinary.owner == "0" * 12


def test_without_keys_the_gateway_binds_loopback_only_unless_behind_a_proxy(tmp_path):
    base = GatewaySettings(data_dir=tmp_path)
    assert open_bind_refusal(base) is None  # 127.0.0.1
    assert open_bind_refusal(base.model_copy(update={"host": "::1"})) is None
    refusal = open_bind_refusal(base.model_copy(update={"host": "0.0.0.0"}))
    assert refusal and "GATEWAY_KEYS_FILE" in refusal and "GATEWAY_BEHIND_AUTH_PROXY" in refusal
    assert open_bind_refusal(base.model_copy(update={"host": "0.0.0.0", "behind_auth_proxy": True})) is None
    write_keys(base.keys_path, [])
    assert open_bind_refusal(base.model_copy(update={"host": "0.0.0.0"})) is None


def _cli(*args: str, home) -> subprocess.CompletedProcess:
    env = {**os.environ, "GATEWAY_DATA_DIR": str(home)}
    return subprocess.run([sys.executable, "-m", "worker.cli", "gateway", *args], env=env, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.slow
def test_the_keys_cli_prints_a_key_once_lists_and_revokes(tmp_path):
    made = _cli("keys", "add", "--tenant", "acme", "--most-urgent", "2", "--requests-per-minute", "60",
                "--name", "ci", home=tmp_path)
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip()
    (stored,) = read_keys(tmp_path / "keys.json")
    assert key.startswith("sk-llmw-") and stored.sha256 == digest(key) and stored.most_urgent == 2
    listed = _cli("keys", "list", home=tmp_path)
    assert stored.id in listed.stdout and "acme" in listed.stdout and key not in listed.stdout
    assert _cli("keys", "revoke", "nope", home=tmp_path).returncode == 1
    assert _cli("keys", "revoke", stored.id, home=tmp_path).returncode == 0
    assert read_keys(tmp_path / "keys.json") == []


def test_an_open_gateway_on_a_public_address_refuses_to_start_naming_the_settings(tmp_path):
    started = time.monotonic()
    refused = _cli("--host", "0.0.0.0", "--port", "0", home=tmp_path)
    assert refused.returncode == 2 and time.monotonic() - started < 10
    assert "GATEWAY_KEYS_FILE" in refused.stderr and "GATEWAY_BEHIND_AUTH_PROXY" in refused.stderr


def test_the_gateways_state_follows_llm_worker_home(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_WORKER_HOME", str(tmp_path))
    monkeypatch.delenv("GATEWAY_DATA_DIR", raising=False)
    settings = GatewaySettings()
    assert settings.data_dir == tmp_path / "gateway" and settings.keys_path == tmp_path / "gateway" / "keys.json"
