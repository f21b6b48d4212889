"""The remote connectors send a chunk's bytes as they are: no copy of a large value on the way
to the socket (issue 18: the copies halved put bandwidth)."""

from lmcache.experimental.remote.redis_connector import RedisConnector


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
