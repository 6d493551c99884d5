"""ServeConfig's exposure fields: listen hosts, TLS files (validated, the error names the field), docs and
reflection switches, and the Serve HTTP options they map to."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from core.config import CHECK_FILES, ServeConfig, http_proxy_options, is_loopback


def _error(**fields) -> str:
    with pytest.raises(ValidationError) as caught:
        ServeConfig.model_validate(fields)
    return str(caught.value)


def test_defaults_listen_on_loopback_with_nothing_extra():
    config = ServeConfig()
    assert is_loopback(config.http_host) and is_loopback(config.grpc_host) and config.ray_loopback_only
    assert not (config.tls.enabled or config.http_docs or config.grpc_reflection)
    assert http_proxy_options(config) == {"host": "127.0.0.1", "port": 8000}


@pytest.mark.parametrize("field", ["http_host", "grpc_host"])
def test_hosts_must_be_addresses_to_listen_on(field):
    assert f"{field}: 'example.com' is not an IP address" in _error(**{field: "example.com"})
    assert ServeConfig.model_validate({field: "::", "auth": {"allow_open": True}}).model_dump()[field] == "::"
    assert not is_loopback("0.0.0.0") and is_loopback("::1") and is_loopback("localhost")


def test_tls_files_come_in_pairs_and_must_exist(tmp_path):
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    assert "tls.key_file: required with the other tls file" in _error(tls={"cert_file": str(cert)})
    assert "tls.cert_file: required with the other tls file" in _error(tls={"key_file": str(key)})
    assert f"tls.cert_file: no such file: {cert}" in _error(tls={"cert_file": str(cert), "key_file": str(key)})
    cert.write_text("cert")
    assert f"tls.key_file: no such file: {key}" in _error(tls={"cert_file": str(cert), "key_file": str(key)})
    key.write_text("key")
    config = ServeConfig(tls={"cert_file": cert, "key_file": key})
    assert config.tls.enabled and config.tls.on_http
    assert http_proxy_options(config) == {"host": "127.0.0.1", "port": 8000, "ssl_certfile": str(cert),
                                          "ssl_keyfile": str(key)}  # fmt: skip


def test_a_config_rendered_for_other_machines_skips_the_file_check():
    tls = {"cert_file": "/etc/voxray/tls/tls.crt", "key_file": "/etc/voxray/tls/tls.key", "http_proxy": False}
    config = ServeConfig.model_validate({"tls": tls}, context={CHECK_FILES: False})
    assert config.tls.enabled and not config.tls.on_http  # HTTPS at a gateway: Serve's proxy stays plain
    assert "ssl_certfile" not in http_proxy_options(config)


@pytest.mark.parametrize("field", ["http_host", "grpc_host"])
def test_listening_beyond_loopback_needs_keys_or_an_explicit_open(field, tmp_path):
    error = _error(**{field: "0.0.0.0"})
    assert f"auth.api_keys_file: required when listening beyond loopback ({field} 0.0.0.0)" in error
    assert "auth.allow_open: true" in error
    assert ServeConfig.model_validate({field: "0.0.0.0", "auth": {"allow_open": True}}).auth.api_keys_file is None
    keys = tmp_path / "api-keys"
    assert ServeConfig.model_validate({field: "0.0.0.0", "auth": {"api_keys_file": str(keys)}}).auth.allow_open is False


def test_loopback_is_open_without_saying_so():
    for host in ("127.0.0.1", "::1", "localhost"):
        assert ServeConfig(http_host=host, grpc_host=host).auth.api_keys_file is None


def test_open_and_keys_together_are_refused(tmp_path):
    error = _error(auth={"api_keys_file": str(tmp_path / "api-keys"), "allow_open": True})
    assert "auth.allow_open: true contradicts auth.api_keys_file" in error
