"""Test certificates, made by the test: a CA and certificates it signs (with the `cryptography` package when it
is installed, else the openssl command), for the TLS tests of the service and of the CF client.

    ca = make_ca(tmp, "ca")                       # tmp/ca.pem, tmp/ca.key
    server = issue(ca, tmp, "server", ip="127.0.0.1")   # (tmp/server.pem, tmp/server.key)
"""

from __future__ import annotations

import datetime
import ipaddress
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

try:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    HAVE_CRYPTOGRAPHY = True
except ImportError:  # pragma: no cover - depends on the environment
    HAVE_CRYPTOGRAPHY = False


@dataclass(frozen=True)
class CA:
    name: str
    cert: Path
    key: Path


def _need_openssl() -> None:
    if shutil.which("openssl") is None:
        pytest.skip("neither the cryptography package nor openssl is available to make test certificates")


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_ca(directory: Path, name: str) -> CA:
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    if HAVE_CRYPTOGRAPHY:
        pk = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"test CA {name}")])
        now = datetime.datetime.now(datetime.UTC)
        c = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(pk.public_key())
             .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
             .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                          content_commitment=False, key_encipherment=False, data_encipherment=False,
                                          key_agreement=False, encipher_only=False, decipher_only=False),
                            critical=True)
             .sign(pk, hashes.SHA256()))
        _write(cert, key, c, pk)
    else:
        _need_openssl()
        _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1",
                 "-subj", f"/CN=test CA {name}", "-addext", "basicConstraints=critical,CA:TRUE",
                 "-addext", "keyUsage=critical,keyCertSign,cRLSign", "-keyout", str(key), "-out", str(cert))
    return CA(name, cert, key)


def issue(ca: CA, directory: Path, name: str, *, ip: str = "127.0.0.1") -> tuple[Path, Path]:
    """A leaf certificate for NAME signed by CA, valid for the address ip (server or client use)."""
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    if HAVE_CRYPTOGRAPHY:
        ca_key = serialization.load_pem_private_key(ca.key.read_bytes(), None)
        ca_cert = x509.load_pem_x509_certificate(ca.cert.read_bytes())
        pk = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        c = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
             .issuer_name(ca_cert.subject).public_key(pk.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]), critical=False)
             .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
             .sign(ca_key, hashes.SHA256()))  # type: ignore[arg-type]
        _write(cert, key, c, pk)
    else:
        _need_openssl()
        csr = directory / f"{name}.csr"
        _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-subj", f"/CN={name}",
                 "-keyout", str(key), "-out", str(csr))
        ext = directory / f"{name}.ext"
        ext.write_text(f"subjectAltName=IP:{ip}\nbasicConstraints=critical,CA:FALSE\n")
        _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca.cert), "-CAkey", str(ca.key), "-CAcreateserial",
                 "-days", "1", "-extfile", str(ext), "-out", str(cert))
    key.chmod(0o600)
    return cert, key


def _write(cert: Path, key: Path, c: x509.Certificate, pk: ec.EllipticCurvePrivateKey) -> None:
    cert.write_bytes(c.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(pk.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption()))
    key.chmod(0o600)
