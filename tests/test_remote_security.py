"""A remote tier that can go on a network: Redis passwords and ACL users, `lm://` tokens, TLS
(`lms://`, `rediss://`), protected mode, and secrets kept out of every log line, error and repr.

Real servers throughout (redis-server, our server in-process and as `python -m lmcache.server`),
shared per module; certificates come from a throwaway CA made with the `openssl` CLI."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
import redis
import torch
from helpers import key
from tier_helpers import FAST_REMOTE, remote_backend, remote_chunk, remote_cpu, wait_for
from tls_fixture import TlsFiles, tls_files  # noqa: F401 (a fixture)
from redis_fixture import ROOT, LMServerProcess, RedisServer, free_port

from lmcache.experimental.config import LMCacheEngineConfig, mask_url, parse_remote_url
from lmcache.experimental.remote import create_connector
from lmcache.experimental.remote.connector import RemoteAuthError, RemoteUnavailableError
from lmcache.server.protocol import HEADER_SIZE, Op, Status, parse_header, recv_exact, send_frame
from lmcache.server.security import CLIENT_CA_ENV, CLIENT_TOKEN_ENV
from lmcache.server.server import LMCacheServer, ServerConfig, is_loopback

TOKEN = "tok-Zq81/x+y"  # has characters a URL must percent-encode
TOKEN_IN_URL = "tok-Zq81%2Fx%2By"
WRONG_TOKEN = "wrong-Kp42"
REDIS_PASSWORD = "p@ss:w/rd-77"
REDIS_PASSWORD_IN_URL = "p%40ss%3Aw%2Frd-77"
ACL_USER, ACL_PASSWORD = "alice", "alice-Hx19"
SECRETS = (TOKEN, TOKEN_IN_URL, WRONG_TOKEN, REDIS_PASSWORD, REDIS_PASSWORD_IN_URL, ACL_PASSWORD)

# ---------------------------------------------------------------- fixtures



class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))  # includes the traceback of logged exceptions


@pytest.fixture(scope="module")
def lmcache_lines() -> Iterator[_Collect]:
    """Every line any lmcache logger writes during this module, at DEBUG and above."""
    top = logging.getLogger("lmcache")
    handler, level = _Collect(), top.level
    top.addHandler(handler)
    top.setLevel(logging.DEBUG)
    yield handler
    top.removeHandler(handler)
    top.setLevel(level)


@pytest.fixture(scope="module")
def token_server(lmcache_lines) -> Iterator[LMCacheServer]:
    server = LMCacheServer(ServerConfig(port=0, token=TOKEN.encode()))
    server.start_in_thread()
    yield server
    server.shutdown()


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory, tls_files: TlsFiles) -> Iterator[LMServerProcess]:
    """`python -m lmcache.server` with a token file and TLS, its log kept for the secret grep."""
    d = tmp_path_factory.mktemp("lms")
    token_file = d / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    server = LMServerProcess(
        extra_args=["--token-file", str(token_file), "--tls-cert", str(tls_files.cert), "--tls-key", str(tls_files.key)],
        log_path=d / "server.log",
    ).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def redis_auth(tmp_path_factory) -> Iterator[RedisServer]:
    """redis-server with a `requirepass` password and an ACL user."""
    server = RedisServer(
        tmp_path_factory.mktemp("redis-auth"),
        extra_args=["--requirepass", REDIS_PASSWORD, "--user", ACL_USER, "on", f">{ACL_PASSWORD}", "~lmcache:*", "+@all"],
    ).start()
    yield server
    server.stop()


def _store_one(url: str, n: int, **kwargs):
    """Store chunk `key(n)` through a remote tier at `url`; the chunk, once acknowledged."""
    cpu = remote_cpu()
    writer = remote_backend(url, cpu=cpu, **kwargs)
    chunk = remote_chunk(cpu, seed=n)
    writer.submit_put_task(key(n), chunk)
    writer.close()
    assert writer.remote_stats().puts_acknowledged == 1
    return chunk


def _reads_back(url: str, n: int, want) -> None:
    reader = remote_backend(url)
    got = reader.get_blocking(key(n))
    assert got is not None and torch.equal(got.tensor, want.tensor), f"{n}: not the chunk stored"
    got.ref_count_down()
    reader.close()


def _lm_url(server: LMCacheServer, userinfo: str = "", scheme: str = "lm") -> str:
    return f"{scheme}://{userinfo}127.0.0.1:{server.address[1]}"


# ---------------------------------------------------------------- URLs, masking, config


@pytest.mark.parametrize(
    "url, user, password, db, hosts",
    [
        ("redis://:p%40ss@h:1", None, "p@ss", None, (("h", 1),)),
        ("redis://bob:pw@h:1/3", "bob", "pw", 3, (("h", 1),)),
        ("rediss://bob@h:1", "bob", None, None, (("h", 1),)),
        ("redis-cluster://:pw@a:1,b:2", None, "pw", None, (("a", 1), ("b", 2))),
        ("redis-sentinel://u:p@a:1,b:2/svc", "u", "p", None, (("a", 1), ("b", 2))),
        ("lm://:t%2Fk@h:1", None, "t/k", None, (("h", 1),)),
        ("lms://h:1", None, None, None, (("h", 1),)),
        ("redis://:a@b@h:1", None, "a@b", None, (("h", 1),)),
    ],
)
def test_url_userinfo_is_parsed_and_percent_decoded(url, user, password, db, hosts) -> None:
    parsed = parse_remote_url(url)
    assert (parsed.username, parsed.password, parsed.db, parsed.hosts) == (user, password, db, hosts)
    assert password is None or password not in repr(parsed)


def test_mask_url_hides_the_password_in_every_form() -> None:
    assert mask_url("redis://user:s3cret@h:1/2") == "redis://user:***@h:1/2"
    assert mask_url("lm://:s3cret@h:1") == "lm://:***@h:1"
    assert mask_url("redis://user@h:1") == "redis://user@h:1"
    assert mask_url("redis://h:1") == "redis://h:1"
    assert mask_url("bogus://:s3cret@@what") == "bogus://:***@what"
    assert parse_remote_url("redis-sentinel://u:s3cret@a:1/svc").display() == "redis-sentinel://u:***@a:1/svc"


def test_bad_urls_and_config_dumps_never_show_the_secret(monkeypatch) -> None:
    for bad in ("redis://:s3cret@h:notaport", "redis://:s3cret@h:1/x", "ftp://:s3cret@h:1", "lm://:s3cret@a:1,b:2"):
        with pytest.raises(ValueError) as err:
            LMCacheEngineConfig.from_defaults(remote_url=bad)
        assert "s3cret" not in str(err.value) and "***" in str(err.value)
    monkeypatch.setenv("LMCACHE_REMOTE_URL", "redis://:s3cret@h:0")
    with pytest.raises(ValueError) as err:
        LMCacheEngineConfig.from_env()
    assert "s3cret" not in str(err.value) and "LMCACHE_REMOTE_URL" in str(err.value)
    config = LMCacheEngineConfig.from_defaults(remote_url="redis://u:s3cret@h:1", remote_password="other-s3cret")
    assert "s3cret" not in repr(config) and "redis://u:***@h:1" in repr(config)
    assert "remote_password='***'" in repr(config)
    with pytest.raises(ValueError) as err:
        LMCacheEngineConfig.from_defaults().with_overrides({"remote_pasword": "s3cret"})
    assert "s3cret" not in str(err.value) and "remote_password" in str(err.value)


def test_remote_password_comes_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("LMCACHE_REMOTE_URL", "redis://127.0.0.1:6379")
    monkeypatch.setenv("LMCACHE_REMOTE_SERDE", "naive")
    monkeypatch.setenv("LMCACHE_REMOTE_PASSWORD", "env-s3cret")
    assert LMCacheEngineConfig.from_env().remote_password == "env-s3cret"


# ---------------------------------------------------------------- Redis with a password / ACL user


@pytest.mark.parametrize(
    "userinfo, tail",
    [(f":{REDIS_PASSWORD_IN_URL}@", ""), (f":{REDIS_PASSWORD_IN_URL}@", "/2"), (f"{ACL_USER}:{ACL_PASSWORD}@", "")],
    ids=["requirepass", "requirepass-db2", "acl-user"],
)
def test_redis_with_credentials_in_the_url_stores_and_hits(redis_auth, lmcache_lines, userinfo, tail) -> None:
    url = f"redis://{userinfo}127.0.0.1:{redis_auth.port}{tail}"
    _reads_back(url, 21, _store_one(url, 21))
    admin = redis.Redis(port=redis_auth.port, password=REDIS_PASSWORD, db=2 if tail else 0)
    assert admin.keys("lmcache:*"), "the chunk is not in the database the URL names"
    admin.flushall()
    admin.close()


def test_redis_password_from_the_config_key_and_a_wrong_one(redis_auth, lmcache_lines) -> None:
    url = f"redis://127.0.0.1:{redis_auth.port}"
    _store_one(url, 5, password=REDIS_PASSWORD)
    for bad_url in (url, f"redis://:{WRONG_TOKEN}@127.0.0.1:{redis_auth.port}"):
        bad = remote_backend(bad_url, options=FAST_REMOTE)
        assert not bad.contains(key(5)) and bad.get_blocking(key(5)) is None
        assert not bad.is_up
        bad.close()


def test_rediss_checks_the_server_against_the_configured_ca(tmp_path, tls_files, lmcache_lines, monkeypatch) -> None:
    port = free_port()
    server = RedisServer(
        tmp_path / "rediss",
        extra_args=["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(tls_files.cert),
                    "--tls-key-file", str(tls_files.key), "--tls-ca-cert-file", str(tls_files.ca),
                    "--tls-auth-clients", "no", "--requirepass", REDIS_PASSWORD],
        port=port,
    )
    try:
        server.start()
    except RuntimeError as err:
        pytest.skip(f"this redis-server has no TLS: {err}")
    try:
        url = f"rediss://:{REDIS_PASSWORD_IN_URL}@127.0.0.1:{port}"
        monkeypatch.setenv(CLIENT_CA_ENV, str(tls_files.ca))
        good = create_connector(url)
        assert good.put("k", b"over tls") and bytes(good.get("k")) == b"over tls"
        good.close()
        monkeypatch.setenv(CLIENT_CA_ENV, str(tls_files.other_ca))
        with pytest.raises(RemoteUnavailableError):
            create_connector(url).get("k")
    finally:
        server.stop()


# ---------------------------------------------------------------- lm:// with a token


def test_lm_token_client_stores_and_hits_and_intruders_get_nothing(token_server, lmcache_lines, monkeypatch) -> None:
    original = _store_one(_lm_url(token_server, f":{TOKEN_IN_URL}@"), 1)
    refusals_before = token_server.info()["auth_refusals"]

    for intruder_url in (_lm_url(token_server), _lm_url(token_server, f":{WRONG_TOKEN}@")):
        intruder_cpu = remote_cpu()
        intruder = remote_backend(intruder_url, options=FAST_REMOTE, cpu=intruder_cpu)
        assert not intruder.contains(key(1))
        assert intruder.get_blocking(key(1)) is None
        intruder.submit_put_task(key(1), remote_chunk(intruder_cpu, seed=666))  # try to overwrite
        intruder.close()
        assert intruder.remote_stats().puts_acknowledged == 0 and not intruder.is_up
        with pytest.raises(RemoteAuthError):
            create_connector(intruder_url).put(key(1).to_string(), b"evil")
    assert wait_for(lambda: token_server.info()["auth_refusals"] >= refusals_before + 4)

    monkeypatch.setenv(CLIENT_TOKEN_ENV, TOKEN)  # the token from the environment instead of the URL
    _reads_back(_lm_url(token_server), 1, original)  # not what an intruder tried to write


def test_lm_server_serves_nothing_before_the_handshake(token_server) -> None:
    with socket.create_connection(token_server.address, timeout=5) as sock:
        send_frame(sock, Op.GET, key=b"anything")
        header = parse_header(recv_exact(sock, HEADER_SIZE, "reply"), 1 << 20, is_request=False)
        reason = bytes(recv_exact(sock, header.payload_len, "reason"))
        assert (header.op, header.status) == (Op.ERROR, Status.BAD_REQUEST)
        assert b"authentication required" in reason
        assert sock.recv(1) == b"", "the connection stays open after a refusal"
    with socket.create_connection(token_server.address, timeout=5) as sock:
        send_frame(sock, Op.AUTH, payload=b"x" * 32)
        header = parse_header(recv_exact(sock, HEADER_SIZE, "reply"), 1 << 20, is_request=False)
        recv_exact(sock, header.payload_len, "nonce and proof")
        send_frame(sock, Op.AUTH, payload=b"y" * 32)  # a made-up proof
        header = parse_header(recv_exact(sock, HEADER_SIZE, "reply"), 1 << 20, is_request=False)
        refusal = json.loads(bytes(recv_exact(sock, header.payload_len, "refusal")))
        assert (header.op, header.status, refusal["reason"]) == (Op.AUTH, Status.REFUSED, "auth_failed")
        assert sock.recv(1) == b""


def test_a_client_with_a_token_will_not_trust_a_server_without_one(lmcache_lines) -> None:
    server = LMCacheServer(ServerConfig(port=0))
    server.start_in_thread()
    try:
        with pytest.raises(RemoteAuthError, match="cannot prove"):
            create_connector(_lm_url(server, f":{TOKEN_IN_URL}@")).ping()
        plain = create_connector(_lm_url(server))  # the same client code, no token: works
        assert plain.put("k", b"v") and bytes(plain.get("k")) == b"v"
        plain.close()
    finally:
        server.shutdown()


# ---------------------------------------------------------------- lms:// (TLS) and protected mode


def test_lms_with_the_right_ca_works_and_plaintext_or_wrong_ca_get_nothing(tls_server, tls_files, lmcache_lines, monkeypatch) -> None:
    port = tls_server.port
    monkeypatch.setenv(CLIENT_CA_ENV, str(tls_files.ca))
    original = _store_one(f"lms://:{TOKEN_IN_URL}@127.0.0.1:{port}", 2)

    plaintext = remote_backend(f"lm://:{TOKEN_IN_URL}@127.0.0.1:{port}", options=FAST_REMOTE)
    assert not plaintext.contains(key(2)) and plaintext.get_blocking(key(2)) is None
    plaintext.close()
    monkeypatch.setenv(CLIENT_CA_ENV, str(tls_files.other_ca))
    with pytest.raises(RemoteAuthError, match="TLS handshake failed"):
        create_connector(f"lms://:{TOKEN_IN_URL}@127.0.0.1:{port}").ping()
    wrong_ca = remote_backend(f"lms://:{TOKEN_IN_URL}@127.0.0.1:{port}", options=FAST_REMOTE)
    assert not wrong_ca.contains(key(2)) and wrong_ca.get_blocking(key(2)) is None
    wrong_ca.close()

    monkeypatch.setenv(CLIENT_CA_ENV, str(tls_files.ca))
    _reads_back(f"lms://:{TOKEN_IN_URL}@localhost:{port}", 2, original)  # host name checked too
    admin = create_connector(f"lms://:{TOKEN_IN_URL}@127.0.0.1:{port}")
    assert admin.info()["tls_refusals"] >= 1  # the plaintext client
    admin.close()


def test_a_silent_peer_cannot_hold_a_tls_handshake_open(tls_files) -> None:
    server = LMCacheServer(ServerConfig(port=0, frame_timeout_s=0.5, tls_cert=str(tls_files.cert), tls_key=str(tls_files.key)))
    server.start_in_thread()
    try:
        with socket.create_connection(server.address, timeout=10) as sock:
            started = time.monotonic()
            assert sock.recv(1) == b""  # closed by the server, not by our timeout
            assert time.monotonic() - started < 5
        assert wait_for(lambda: server.info()["frame_timeouts"] == 1)
    finally:
        server.shutdown()


def test_protected_mode_refuses_a_public_bind_without_a_token() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "lmcache.server", "0.0.0.0", "0"],
        capture_output=True, text=True, timeout=60, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert proc.returncode == 2
    assert "LMCACHE_SERVER_TOKEN" in proc.stderr and "--no-auth" in proc.stderr
    with pytest.raises(ValueError, match="--token-file"):
        ServerConfig(host="10.1.2.3")
    assert ServerConfig(host="0.0.0.0", no_auth=True).no_auth
    assert ServerConfig(host="0.0.0.0", token=b"t").token == b"t" and "token=" not in repr(ServerConfig(token=b"t"))
    assert [is_loopback(h) for h in ("127.0.0.1", "::1", "localhost", "0.0.0.0", "example.com")] == [
        True, True, True, False, False,
    ]


# ---------------------------------------------------------------- the grep (last: it reads what the others logged)


def test_no_secret_in_anything_logged(token_server, tls_server, redis_auth, lmcache_lines) -> None:
    # One more refused client of each kind, so this test has lines of its own when run alone.
    for url in (_lm_url(token_server, f":{WRONG_TOKEN}@"), f"redis://{ACL_USER}:{WRONG_TOKEN}@127.0.0.1:{redis_auth.port}"):
        backend = remote_backend(url, options=FAST_REMOTE)
        assert not backend.contains(key(7))
        backend.close()
    text = "\n".join(lmcache_lines.lines)
    assert ":***@" in text, "the refusals above were not logged with the masked URL"
    server_log = Path(tls_server.log_path).read_text() if tls_server.log_path else ""
    redis_log = (redis_auth.workdir / "redis.log").read_text()
    for secret in SECRETS:
        assert secret not in text, f"an lmcache log line shows the secret {secret!r}"
        assert secret not in server_log, f"the server's log shows the secret {secret!r}"
        assert secret not in redis_log
