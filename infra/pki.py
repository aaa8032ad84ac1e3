"""A local certificate authority for the secured stack (``infra/stack up --secure``), made with the
machine's ``openssl`` on first use and kept in the state directory (never in the repository).

Files in ``<dir>`` (keys mode 0600):

* ``ca.pem`` / ``ca.key``: the CA (RSA 2048, 10 years); clients trust ``ca.pem``
  (``KVBUS_KAFKA_SSL_CA``, ``KVBUS_REDIS_SSL_CA``, ``KVBUS_REGISTRY_SSL_CA``).
* ``<name>.pem`` / ``<name>.key``: a certificate signed by the CA for ``127.0.0.1`` and ``localhost``
  (subject ``CN=<name>``; usable as server and as client certificate) and its key (PKCS#8,
  unencrypted: Kafka's PEM keystore, Redis and Quarkus read it as is).
* ``<name>.keystore.pem``: key and certificate chain in one file (Kafka's ``ssl.keystore.type=PEM``
  with ``ssl.keystore.location``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .procs import ServiceError

DAYS = 3650
SANS = "DNS:localhost,IP:127.0.0.1"


@dataclass(frozen=True)
class CertFiles:
    """A certificate issued by the local CA."""

    cert: Path
    """PEM certificate."""
    key: Path
    """PEM private key (PKCS#8, unencrypted, mode 0600)."""
    keystore: Path
    """Key followed by the certificate and the CA certificate (Kafka PEM keystore, mode 0600)."""
    ca: Path
    """PEM certificate of the CA that signed it."""


def _openssl(args: list[str], cwd: Path) -> None:
    exe = shutil.which("openssl")
    if exe is None:
        raise ServiceError("openssl is not installed (the secured stack makes its CA with it): apt-get install openssl")
    res = subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL)
    if res.returncode != 0:
        raise ServiceError(f"openssl {args[0]} failed (exit {res.returncode}): {res.stderr.strip()[-1000:]}")


def _new_key(path: Path) -> None:
    old = os.umask(0o077)
    try:
        _openssl(["genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", str(path)], path.parent)
    finally:
        os.umask(old)
    path.chmod(0o600)


def ensure_ca(directory: Path) -> tuple[Path, Path]:
    """The CA certificate and key in ``directory``, created if missing. Returns ``(ca.pem, ca.key)``."""
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    cert, key = directory / "ca.pem", directory / "ca.key"
    if cert.is_file() and key.is_file():
        return cert, key
    _new_key(key)
    _openssl(["req", "-x509", "-new", "-key", str(key), "-sha256", "-days", str(DAYS), "-subj", "/CN=kvbus local CA",
              "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
              "-out", str(cert)], directory)
    return cert, key


def ensure_cert(directory: Path, name: str) -> CertFiles:
    """A certificate ``CN=<name>`` for 127.0.0.1/localhost signed by the CA in ``directory`` (both
    created if missing)."""
    ca_cert, ca_key = ensure_ca(directory)
    files = CertFiles(directory / f"{name}.pem", directory / f"{name}.key", directory / f"{name}.keystore.pem", ca_cert)
    if files.cert.is_file() and files.key.is_file() and files.keystore.is_file():
        return files
    _new_key(files.key)
    csr = directory / f"{name}.csr"
    ext = directory / f"{name}.ext"
    _openssl(["req", "-new", "-key", str(files.key), "-subj", f"/CN={name}", "-out", str(csr)], directory)
    ext.write_text(f"subjectAltName={SANS}\nbasicConstraints=CA:FALSE\n"
                   "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth,clientAuth\n")
    _openssl(["x509", "-req", "-in", str(csr), "-CA", str(ca_cert), "-CAkey", str(ca_key), "-CAcreateserial",
              "-days", str(DAYS), "-sha256", "-extfile", str(ext), "-out", str(files.cert)], directory)
    csr.unlink(missing_ok=True)
    ext.unlink(missing_ok=True)
    old = os.umask(0o077)
    try:
        files.keystore.write_text(files.key.read_text() + files.cert.read_text() + ca_cert.read_text())
    finally:
        os.umask(old)
    files.keystore.chmod(0o600)
    return files
