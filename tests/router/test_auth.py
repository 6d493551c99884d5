"""API keys and per-key quotas (`router.auth`) on a hand-driven clock; the same checks through a
real Serve are in tests/deployments/test_hardening.py."""

from __future__ import annotations

import hashlib
import logging
import os

import pytest

from core.config import AuthConfig
from router.auth import ApiKeys, QuotaExceeded, Unauthenticated, parse_keys_file


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@pytest.fixture
def keys_file(tmp_path):
    path = tmp_path / "api-keys"
    path.write_text(f"# team keys\n{digest('k-alpha')} alpha\n\n{digest('k-beta').upper()}  # no name\n")
    return path


def make_keys(path, clock, **limits) -> ApiKeys:
    return ApiKeys(AuthConfig(api_keys_file=path, **limits), clock=clock)


def test_open_without_a_keys_file_and_says_so(caplog):
    with caplog.at_level(logging.WARNING, logger="ray.serve.voxray.auth"):
        keys = ApiKeys(AuthConfig())
    assert keys.is_open and "OPEN" in caplog.text and caplog.records[-1].levelno == logging.WARNING
    ApiKeys(AuthConfig(), listen_host="0.0.0.0")
    assert caplog.records[-1].levelno == logging.ERROR and "0.0.0.0" in caplog.text
    assert keys.check(None) is None
    with keys.hold_stream(None):
        pass


def test_bearer_keys_are_checked_against_their_digests(keys_file):
    keys = make_keys(keys_file, Clock())
    assert keys.check("Bearer k-alpha") == "alpha"
    assert keys.check("bearer   k-beta ") == digest("k-beta")[:8]
    for bad in (None, "", "k-alpha", "Basic k-alpha", "Bearer ", "Bearer k-gamma", "Bearer k-alpha\u20ac"):
        with pytest.raises(Unauthenticated) as err:
            keys.check(bad)
        assert str(err.value).startswith("authorization:") and "k-" not in str(err.value)


def test_request_rate_is_a_token_bucket_per_key(keys_file):
    clock = Clock()
    keys = make_keys(keys_file, clock, requests_per_s_per_key=2.0, burst_per_key=3)
    for _ in range(3):
        keys.check("Bearer k-alpha")
    with pytest.raises(QuotaExceeded) as err:
        keys.check("Bearer k-alpha")
    assert err.value.retry_after_s == pytest.approx(0.5)
    assert keys.check("Bearer k-beta")  # another key's bucket is untouched
    clock.now_s += 0.5
    keys.check("Bearer k-alpha")


def test_concurrent_streams_per_key(keys_file):
    keys = make_keys(keys_file, Clock(), max_streams_per_key=2)
    with keys.hold_stream("alpha"), keys.hold_stream("alpha"):
        with pytest.raises(QuotaExceeded), keys.hold_stream("alpha"):
            pass
        with keys.hold_stream("beta"):
            pass
    with keys.hold_stream("alpha"):  # released when the streams ended
        pass


def test_keys_file_is_reread_when_it_changes_and_kept_when_broken(keys_file, caplog):
    clock = Clock()
    keys = make_keys(keys_file, clock, reload_interval_s=5.0)
    keys_file.write_text(f"{digest('k-new')} new\n")
    os.utime(keys_file, ns=(1, 1))
    assert keys.check("Bearer k-new") == "new"  # the first check reads it
    keys_file.write_text("not a digest\n")
    os.utime(keys_file, ns=(2, 2))
    clock.now_s += 5.0
    assert keys.check("Bearer k-new") == "new"
    assert "line 1" in caplog.text and "not a digest" not in caplog.text


def test_keys_never_reach_the_log(keys_file, caplog):
    keys = make_keys(keys_file, Clock(), burst_per_key=1, max_streams_per_key=1)
    with caplog.at_level(logging.DEBUG):
        keys.check("Bearer k-alpha")
        for call in (lambda: keys.check("Bearer k-alpha"), lambda: keys.check("Bearer k-secret-guess")):
            with pytest.raises((QuotaExceeded, Unauthenticated)):
                call()
    assert "k-alpha" not in caplog.text and "k-secret" not in caplog.text and digest("k-alpha") not in caplog.text


def test_malformed_keys_file_fails_at_start(tmp_path):
    path = tmp_path / "keys"
    path.write_text("secret-in-plain-text\n")
    with pytest.raises(ValueError, match="line 1"):
        ApiKeys(AuthConfig(api_keys_file=path))
    assert parse_keys_file("") == {}
