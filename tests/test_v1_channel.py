"""The scheduler-to-worker channel of the v1 door: framing (lookups with the request id they pin
for, unpins), a real Unix socket, errors."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from types import SimpleNamespace

import pytest

from lmcache.integration.vllm.request_log import RequestCounters
from lmcache.integration.vllm.v1.worker_channel import (
    ChannelError,
    InProcessChannel,
    SocketChannel,
    WorkerChannelServer,
    channel_socket_path,
    MAX_REQUEST_ID_BYTES,
    decode_lookup,
    decode_unpin,
    encode_lookup,
    encode_unpin,
)


class Endpoint:
    """Answers like a worker side: hit = number of leading even tokens; counters per request."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], str]] = []
        self.request_ids: list[str] = []
        self.computed: list[int] = []
        self.unpinned: list[list[str]] = []
        self.counters = {"r1": RequestCounters(loaded_tokens=7, stored_tokens=9)}

    def lookup(self, token_ids, cache_salt, request_id="", computed=0):
        tokens = list(token_ids)
        self.calls.append((tokens, cache_salt))
        self.request_ids.append(request_id)
        self.computed.append(computed)
        if cache_salt == "explode":
            raise KeyError("no such tier")
        hit = 0
        while hit < len(tokens) and tokens[hit] % 2 == 0:
            hit += 1
        return hit

    def unpin(self, request_ids):
        self.unpinned.append(list(request_ids))

    def pop_request_counters(self, req_id):
        return self.counters.pop(req_id, None) or RequestCounters()

    def lookup_async(self, token_ids, cache_salt, request_id, computed=0):
        return self.lookup(token_ids, cache_salt, request_id, computed), cache_salt == "slow"

    def pop_async_loaded(self, req_id):
        return {"loaded": 512, "none": 0}.get(req_id)


@pytest.fixture
def served():
    folder = tempfile.mkdtemp(prefix="lmc-", dir="/tmp")
    path = os.path.join(folder, "w.sock")
    endpoint = Endpoint()
    server = WorkerChannelServer(endpoint, path)
    server.start()
    yield endpoint, server, path
    server.close()
    shutil.rmtree(folder, ignore_errors=True)


def test_lookup_body_round_trip_and_checks():
    tokens = [0, 5, 2**31 - 1, 1023]
    assert decode_lookup(encode_lookup(tokens, "sälz")) == (tokens, "sälz", "", 0)
    assert decode_lookup(encode_lookup(tokens, "sälz", "cmpl-7-0", 300)) == (tokens, "sälz", "cmpl-7-0", 300)
    assert decode_lookup(encode_lookup([], "")) == ([], "", "", 0)
    with pytest.raises(ValueError, match="salt length"):
        decode_lookup(encode_lookup([1], "abc")[:9])
    with pytest.raises(ValueError, match="request id length"):
        decode_lookup(encode_lookup([1], "", "req")[:6])
    with pytest.raises(ValueError, match="ends before its length field"):
        decode_lookup(b"\x00\x00")
    with pytest.raises(ValueError, match="whole int32"):
        decode_lookup(encode_lookup([1], "") + b"\x01")
    with pytest.raises(ValueError, match="computed-tokens field"):
        decode_lookup(encode_lookup([], "")[:-2])
    with pytest.raises(ValueError, match="computed tokens must fit a u32"):
        encode_lookup([1], "", "r", -1)
    huge_id = (MAX_REQUEST_ID_BYTES + 1).to_bytes(4, "little") + b"x" * (MAX_REQUEST_ID_BYTES + 1)
    with pytest.raises(ValueError, match="limit 4096"):
        decode_lookup(huge_id + encode_lookup([1], "")[4:])
    with pytest.raises(ValueError, match="request id of 4097 bytes exceeds"):
        encode_lookup([1], "", "x" * (MAX_REQUEST_ID_BYTES + 1))


def test_unpin_body_round_trip_and_checks():
    ids = ["a", "cmpl-ä-1", ""]
    assert decode_unpin(encode_unpin(ids)) == ids
    assert decode_unpin(encode_unpin([])) == []
    body = encode_unpin(["abc", "de"])
    with pytest.raises(ValueError, match="shorter than its count"):
        decode_unpin(b"\x01")
    with pytest.raises(ValueError, match="does not fit"):
        decode_unpin(body[:-1])
    with pytest.raises(ValueError, match="bytes after its 2 request ids"):
        decode_unpin(body + b"\x00")
    # A count the body cannot hold is refused before any loop runs over it.
    with pytest.raises(ValueError, match="unpin count 4294967295"):
        decode_unpin(b"\xff\xff\xff\xff" + body[4:])


def test_socket_channel_answers_lookups_and_counters(served):
    endpoint, server, path = served
    client = SocketChannel(path, connect_timeout=5)
    try:
        long_prompt = [2] * 5000 + [3, 4]
        assert client.lookup(long_prompt, '{"lora":["x",""]}') == 5000
        assert endpoint.calls[-1] == (long_prompt, '{"lora":["x",""]}')
        assert client.lookup([], "") == 0
        assert client.pop_request_counters("r1") == RequestCounters(7, 9)
        assert client.pop_request_counters("r1") == RequestCounters(0, 0)
        assert endpoint.request_ids == ["", ""]
    finally:
        client.close()


def test_socket_channel_carries_request_ids_and_unpins(served):
    endpoint, server, path = served
    client = SocketChannel(path, connect_timeout=5)
    try:
        assert client.lookup([2, 2, 3], "", "cmpl-1-0") == 2
        assert endpoint.request_ids == ["cmpl-1-0"]
        client.unpin(["cmpl-1-0", "cmpl-2-0"])
        client.unpin([])
        assert endpoint.unpinned == [["cmpl-1-0", "cmpl-2-0"], []]
        # An id the frame cannot carry is a failed call for the scheduler side, not a crash.
        with pytest.raises(ChannelError, match="cannot send the call: request id of 4097 bytes"):
            client.lookup([2], "", "x" * (MAX_REQUEST_ID_BYTES + 1))
        with pytest.raises(ChannelError, match="cannot send the call"):
            client.unpin(["x" * (MAX_REQUEST_ID_BYTES + 1)])
        assert client.lookup([2], "", "next") == 1
        assert endpoint.request_ids[-1] == "next"
    finally:
        client.close()


def test_worker_errors_reach_the_scheduler_and_the_server_lives_on(served):
    endpoint, server, path = served
    client = SocketChannel(path, connect_timeout=5)
    try:
        with pytest.raises(ChannelError, match="KeyError: 'no such tier'"):
            client.lookup([2, 2], "explode")
        assert client.lookup([2, 2], "") == 2
    finally:
        client.close()


def test_a_peer_sending_garbage_is_dropped_without_hurting_others(served):
    endpoint, server, path = served
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.connect(path)
    raw.sendall(b"GARBAGE-GARBAGE-")
    raw.settimeout(5)
    try:  # the server closed this connection (a reset when it left bytes unread)
        assert raw.recv(16) == b""
    except ConnectionResetError:
        pass
    raw.close()
    client = SocketChannel(path, connect_timeout=5)
    try:
        assert client.lookup([4, 1], "") == 1
    finally:
        client.close()


def test_connecting_to_nobody_is_a_clear_error():
    path = os.path.join(tempfile.gettempdir(), "lmcache-test-no-such-channel.sock")
    with pytest.raises(ChannelError, match="cannot connect to the worker channel at .*no-such-channel"):
        SocketChannel(path, connect_timeout=0.3)


def test_closing_the_server_removes_its_socket(served):
    endpoint, server, path = served
    assert os.path.exists(path)
    server.close()
    assert not os.path.exists(path)
    with pytest.raises(ChannelError):
        SocketChannel(path, connect_timeout=0.2)


def test_in_process_channel_calls_through():
    endpoint = Endpoint()
    channel = InProcessChannel(endpoint)
    assert channel.lookup([2, 4, 5], "s") == 2
    assert channel.lookup([2, 4, 5], "s", "r9") == 2
    channel.unpin(("r9",))
    assert endpoint.request_ids == ["", "r9"] and endpoint.unpinned == [["r9"]]
    assert channel.pop_request_counters("r1").stored_tokens == 9


def test_socket_path_names_the_instance(monkeypatch):
    config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(engine_id="0f1e2d3c-aaaa-bbbb-cccc-000000000000"),
        parallel_config=SimpleNamespace(data_parallel_rank=2),
    )
    path = channel_socket_path(config)
    assert path.endswith("lmcache-0f1e2d3c-aaaa-bbbb-cccc-000000000000-dp2.sock")
    monkeypatch.setattr(tempfile, "gettempdir", lambda: "/" + "x" * 100)
    with pytest.raises(ChannelError, match="longer than 107 bytes"):
        channel_socket_path(config)
    config.kv_transfer_config = None
    with pytest.raises(ChannelError, match="engine_id"):
        channel_socket_path(config)


def test_socket_channel_carries_async_lookups_and_load_results(served):
    endpoint, server, path = served
    client = SocketChannel(path, connect_timeout=5)
    try:
        assert client.lookup_async([2, 2, 3], "slow", "r7") == (2, True)
        assert client.lookup_async([2, 3], "", "r8", 256) == (1, False)
        assert endpoint.request_ids == ["r7", "r8"] and endpoint.computed == [0, 256]
        assert [client.pop_async_loaded(r) for r in ("loaded", "none", "unknown")] == [512, 0, None]
    finally:
        client.close()
