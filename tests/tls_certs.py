"""A self-signed certificate for 127.0.0.1 / localhost, made at test time (TLS tests on both protocols).

Uses the `cryptography` package when the venv has it, else the `openssl` CLI.
"""

from __future__ import annotations

import datetime
import ipaddress
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CertPair:
    cert_file: Path
    key_file: Path

    @property
    def cert_pem(self) -> bytes:
        return self.cert_file.read_bytes()


def _with_cryptography(cert_file: Path, key_file: Path) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    alt_names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )


def _with_openssl(cert_file: Path, key_file: Path) -> None:
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key_file), "-out", str(cert_file), "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip


def self_signed(directory: Path) -> CertPair:
    """Write cert.pem / key.pem for localhost and 127.0.0.1 into `directory`."""
    pair = CertPair(directory / "cert.pem", directory / "key.pem")
    try:
        _with_cryptography(pair.cert_file, pair.key_file)
    except ImportError:
        _with_openssl(pair.cert_file, pair.key_file)
    return pair
