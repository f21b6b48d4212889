"""The remote connectors move a chunk's bytes as they are: no copy of a large value on the way to
the socket (issue 18: the copies halved put bandwidth), and on a get each value is read off the
socket by whoever receives it, straight into its memory object (fresh buffers per get paid
first-touch faults and a second copy)."""

import os
import socket
import threading
from typing import Iterator

import pytest
import torch
from helpers import key
from redis_fixture import RedisServer
from tier_helpers import remote_chunk, remote_cpu

from lmcache.experimental.remote.connector import Parts, RemoteConnector, RemoteUnavailableError
from lmcache.experimental.remote.lm_connector import LMServerConnector
from lmcache.experimental.remote.redis_connector import RedisConnector
from lmcache.experimental.remote.serde import NaiveSerde
from lmcache.experimental.remote.value_reader import BufferReader, ValueReader
from lmcache.server import LMCacheServer, ServerConfig
from lmcache.server.protocol import HEADER_SIZE, Op, Status, pack_header, recv_exact


def test_redis_put_sends_a_large_value_without_copying_it() -> None:
    connector = RedisConnector([("127.0.0.1", 1)])  # nothing is sent: only the client is built
    client = connector._make_client(1.0)
    packer = client.connection_pool.connection_kwargs["command_packer"]
    value = memoryview(bytearray(1 << 20))
    parts = packer.pack("SET", "lmcache:key", value)
    assert any(part is value for part in parts), "the value was copied into the packed command"
    assert b"".join(bytes(p) for p in parts).startswith(b"*3\r\n$3\r\nSET\r\n")
    small = packer.pack("GET", "lmcache:key")
    assert b"".join(small) == b"*2\r\n$3\r\nGET\r\n$11\r\nlmcache:key\r\n"


def test_naive_parts_are_the_header_and_a_view_of_the_payload() -> None:
    cpu = remote_cpu()
    obj = remote_chunk(cpu, seed=1)
    parts = NaiveSerde().encode_parts(key(1), obj)
    assert parts.joined() == NaiveSerde().encode(key(1), obj)
    before = bytes(parts.buffers[1])
    obj.tensor.view(-1)[0] += 1  # the payload part is the object's memory, not a copy
    assert bytes(parts.buffers[1]) != before
    obj.ref_count_down()


def test_lm_put_sends_each_large_part_without_joining(monkeypatch) -> None:
    """Joining a chunk's header and payload would copy megabytes under the GIL."""
    srv = LMCacheServer(ServerConfig(port=0, max_size_bytes=64 << 20))
    srv.start_in_thread()
    conn = LMServerConnector(*srv.address)
    sent = []
    real_sendall = socket.socket.sendall
    def sendall(self, data, *args):
        sent.append(data)
        return real_sendall(self, data, *args)

    monkeypatch.setattr(socket.socket, "sendall", sendall)
    header, payload = b"h" * 100, memoryview(os.urandom(1 << 20))
    try:
        assert conn.batched_put([("k", Parts((header, payload)))]) == [True]
        assert any(data is payload for data in sent), "the payload was copied before sending"
        assert bytes(conn.get("k")) == header + bytes(payload)
    finally:
        conn.close()
        srv.shutdown()


# ---- gets: each value is read off the socket by its receiver (value_reader.py) ----------------


@pytest.fixture(params=["lm", "redis"])
def store(request, tmp_path) -> Iterator[RemoteConnector]:
    if request.param == "lm":
        srv = LMCacheServer(ServerConfig(port=0, max_size_bytes=64 << 20))
        srv.start_in_thread()
        conn: RemoteConnector = LMServerConnector(*srv.address)
        yield conn
        conn.close()
        srv.shutdown()
    else:
        server = RedisServer(tmp_path / "redis").start()
        conn = RedisConnector([("127.0.0.1", server.port)], key_prefix="lmcache:tiny:")
        yield conn
        conn.close()
        server.stop()


def test_get_hands_each_value_over_unread_and_skips_what_is_left(store: RemoteConnector) -> None:
    # Values of several Redis read pieces (resp_get.PIECE) and of less than one.
    values = {f"k{i}": os.urandom((2_500_000 if i % 2 else 300_000) + i) for i in range(4)}
    assert all(store.batched_put(list(values.items())))
    keys = ["k0", "missing", "k1", "k2", "k3"]
    seen: list[tuple[int, bytes]] = []

    def receive(i: int, reader: ValueReader) -> None:
        # Read off the connection itself, not out of a buffer the connector filled first.
        assert not isinstance(reader, BufferReader) and reader.size == len(values[keys[i]])
        if i == 2:
            return  # a rejected chunk: nothing read, the connector skips it
        if i == 3:
            seen.append((i, bytes(reader.read(10))))  # the header only, the rest skipped
            return
        target = bytearray(reader.size)
        reader.readinto(memoryview(target))
        seen.append((i, bytes(target)))

    for _ in range(2):  # twice: the connection is still in step afterwards
        seen.clear()
        store.batched_get_into(keys, receive)
        assert seen == [(0, values["k0"]), (3, values["k2"][:10]), (4, values["k3"])]


def test_tier_reads_chunks_into_pool_objects_bit_exact(store: RemoteConnector) -> None:
    cpu = remote_cpu()
    chunks = [remote_chunk(cpu, seed=i) for i in range(3)]
    serde = NaiveSerde()
    assert all(store.batched_put([(f"c{i}", serde.encode(key(i), obj)) for i, obj in enumerate(chunks)]))
    blob = bytearray(serde.encode(key(3), chunks[0]))
    blob[-1] ^= 1
    assert store.put("c3", blob)  # a flipped payload bit: a miss, never data
    got: dict[int, object] = {}
    store.batched_get_into(
        ["c0", "c1", "c3", "c2"],
        lambda i, reader: got.__setitem__(i, serde.receive(key([0, 1, 3, 2][i]), reader, cpu.allocate)),
    )
    assert got[2] is None
    for i, want in ((0, chunks[0]), (1, chunks[1]), (3, chunks[2])):
        obj = got[i]
        assert obj is not None and torch.equal(obj.tensor, want.tensor)
        obj.ref_count_down()


def test_a_value_cut_off_midway_is_unavailable_not_a_short_chunk() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def serve() -> None:  # announces a 1 MB value, sends 1000 bytes of it, hangs up
        conn, _ = listener.accept()
        recv_exact(conn, HEADER_SIZE + 1, "the request (key \"k\")")
        conn.sendall(pack_header(Op.GET, Status.OK, 0, 1 << 20) + bytes(1000))
        conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    conn = LMServerConnector(*listener.getsockname(), timeout=5)
    with pytest.raises(RemoteUnavailableError, match="closed the connection after 1000 of"):
        conn.batched_get_into(["k"], lambda i, reader: reader.readinto(memoryview(bytearray(reader.size))))
    thread.join(timeout=5)
    listener.close()
    conn.close()
