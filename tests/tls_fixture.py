"""Test certificates for the TLS tests (`lms://`, `rediss://`, peers): a throwaway CA made with
the `openssl` CLI, a server certificate it signed for 127.0.0.1/localhost, and an unrelated CA."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    cert: Path
    key: Path
    other_ca: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _make_ca(cwd: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}", cwd=cwd)


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory) -> TlsFiles:
    """A CA, a server certificate it signed for 127.0.0.1/localhost, and an unrelated CA."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is needed to make test certificates")
    d = tmp_path_factory.mktemp("tls")
    _make_ca(d, "ca")
    _make_ca(d, "other-ca")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "server.pem", "-days", "2", "-extfile", "san.ext", cwd=d)
    return TlsFiles(d / "ca.pem", d / "server.pem", d / "server.key", d / "other-ca.pem")
