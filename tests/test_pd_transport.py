"""PD transport through real ZeroMQ sockets on 127.0.0.1: a prefiller engine's stored chunks
pushed into a decoder engine's receive buffer and loaded bit-exact; the buffer's byte bound and
unclaimed-KV timeout; hostile frames refused while the receiver keeps serving; a dead receiver
costs a bounded wait, never an error."""

from __future__ import annotations

import json
import time

import pytest
import torch
import zmq
from helpers import CHUNK, key, metadata
from redis_fixture import free_port
from tier_helpers import ENGINE_CHUNK_BYTES, ENGINE_GEO, retrieve_and_check, small_engine, store_prompt

from lmcache.experimental.memory_management import HostMemoryAllocator
from lmcache.experimental.pd.disagg_spec import DisaggSpec
from lmcache.experimental.pd.receiver import PDReceiveBuffer
from lmcache.experimental.pd.sender import PDSender
from lmcache.experimental.pd.wire import WireError, push_frames, read_push, read_reply
from lmcache.experimental.storage_backend import LocalCPUBackend

N = 4 * CHUNK + 3  # four whole chunks and a partial one


def receiver_engine(port: int, buffer_chunks: int = 16, **overrides):
    return small_engine(
        64, enable_pd=True, pd_role="receiver", pd_peer_host="127.0.0.1", pd_peer_init_port=port,
        pd_buffer_size=buffer_chunks * ENGINE_CHUNK_BYTES, **overrides,
    )


def spec(port: int, req_id: str = "r1") -> DisaggSpec:
    return DisaggSpec(req_id, "127.0.0.1", port, port + 1)


def all_true(n: int) -> torch.Tensor:
    return torch.ones(n, dtype=torch.bool)


def test_pushed_prompt_is_found_and_loaded_bit_exact() -> None:
    port = free_port()
    sender_engine, decoder = small_engine(64), receiver_engine(port)
    sender = PDSender(worker_id=0, timeout_s=5)
    try:
        tokens, source, slots = store_prompt(sender_engine, N, seed=3)
        assert sender.push_stored(sender_engine, spec(port), tokens, all_true(N), "") == N
        assert decoder.lookup(tokens) == N
        assert decoder.lookup(tokens, request_id="q", pin=True) == N  # claimed into CPU memory
        buffer = decoder.storage_manager.tiers[-1]
        assert isinstance(buffer, PDReceiveBuffer) and buffer.held_keys() == [] and buffer.used_bytes == 0
        retrieve_and_check(decoder, tokens, source, slots, N)
        decoder.lookup_unpin(["q"])
    finally:
        sender.close()
        sender_engine.close()
        decoder.close()


def test_push_that_does_not_fit_is_refused_and_the_prefix_stays_usable() -> None:
    port = free_port()
    sender_engine, decoder = small_engine(64), receiver_engine(port, buffer_chunks=2)
    sender = PDSender(worker_id=0, timeout_s=5)
    try:
        tokens, source, slots = store_prompt(sender_engine, N, seed=4)
        assert sender.push_stored(sender_engine, spec(port), tokens, all_true(N), "") == 2 * CHUNK
        # The request is marked failed: its later steps push nothing.
        assert sender.push_stored(sender_engine, spec(port), tokens, all_true(N), "") == 0
        assert decoder.lookup(tokens) == 2 * CHUNK
        retrieve_and_check(decoder, tokens, source, slots, 2 * CHUNK)
    finally:
        sender.close()
        sender_engine.close()
        decoder.close()


def test_dead_receiver_costs_a_bounded_wait_and_is_skipped_after() -> None:
    port = free_port()  # nothing listens there
    sender_engine = small_engine(64)
    sender = PDSender(worker_id=0, timeout_s=0.5)
    try:
        tokens, _, _ = store_prompt(sender_engine, N, seed=5)
        began = time.monotonic()
        assert sender.push_stored(sender_engine, spec(port, "a"), tokens, all_true(N), "") == 0
        assert time.monotonic() - began < 3
        began = time.monotonic()
        assert sender.push_stored(sender_engine, spec(port, "b"), tokens, all_true(N), "") == 0
        assert time.monotonic() - began < 0.2  # the peer is skipped while it is down
    finally:
        sender.close()
        sender_engine.close()


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_unclaimed_chunks_are_freed_after_the_timeout() -> None:
    cpu = LocalCPUBackend(HostMemoryAllocator(8 * ENGINE_CHUNK_BYTES))
    clock = FakeClock()
    buffer = PDReceiveBuffer(metadata(ENGINE_GEO), 4 * ENGINE_CHUNK_BYTES, cpu, ttl_s=30, clock=clock)
    obj = cpu.allocate(torch.Size([2, ENGINE_GEO.num_layers, CHUNK, ENGINE_GEO.hidden]), ENGINE_GEO.dtype)
    assert obj is not None
    for i in range(3):
        obj.tensor.fill_(i)
        k = key(i, "test/model")
        assert buffer.accept(read_push([bytes(f) for f in push_frames(i, "r", k, obj)])) is None
        clock.now += 10
    assert len(buffer.held_keys()) == 3 and buffer.used_bytes >= 3 * ENGINE_CHUNK_BYTES
    clock.now += 1  # the first push is now 31 s old
    assert buffer.reap() == 1 and not buffer.contains(key(0, "test/model"))
    got = buffer.get_blocking(key(1, "test/model"))
    assert got is not None and bool((got.tensor == 1).all())
    got.ref_count_down()
    clock.now += 100
    assert buffer.reap() == 1 and buffer.held_keys() == [] and buffer.used_bytes == 0
    obj.ref_count_down()
    buffer.close()


def test_chunk_of_another_model_or_shape_is_refused() -> None:
    cpu = LocalCPUBackend(HostMemoryAllocator(8 * ENGINE_CHUNK_BYTES))
    buffer = PDReceiveBuffer(metadata(ENGINE_GEO), 4 * ENGINE_CHUNK_BYTES, cpu)
    good_shape = torch.Size([2, ENGINE_GEO.num_layers, CHUNK, ENGINE_GEO.hidden])
    obj = cpu.allocate(good_shape, ENGINE_GEO.dtype)
    wrong = cpu.allocate(torch.Size([2, ENGINE_GEO.num_layers, CHUNK, ENGINE_GEO.hidden + 1]), ENGINE_GEO.dtype)
    assert obj is not None and wrong is not None
    other_model = buffer.accept(read_push(push_frames(1, "r", key(1, "other/model"), obj)))
    assert other_model is not None and "not for this decoder" in other_model
    bad_shape = buffer.accept(read_push(push_frames(1, "r", key(2, "test/model"), wrong)))
    assert bad_shape is not None and "not a KV chunk" in bad_shape
    assert buffer.held_keys() == []
    obj.ref_count_down()
    wrong.ref_count_down()
    buffer.close()


def _frames(obj_key=None):
    cpu = LocalCPUBackend(HostMemoryAllocator(2 * ENGINE_CHUNK_BYTES))
    obj = cpu.allocate(torch.Size([2, ENGINE_GEO.num_layers, CHUNK, ENGINE_GEO.hidden]), ENGINE_GEO.dtype)
    frames = [bytes(f) for f in push_frames(7, "r", obj_key or key(1, "test/model"), obj)]
    obj.ref_count_down()
    return frames


def _corrupt_payload(frames):
    payload = bytearray(frames[2])
    payload[0] ^= 1
    return [frames[0], frames[1], bytes(payload)]


HOSTILE = {
    "two frames": lambda f: f[:2],
    "meta not json": lambda f: [b"\xff{", f[1], f[2]],
    "meta huge": lambda f: [b" " * 5000, f[1], f[2]],
    "meta list": lambda f: [b"[1]", f[1], f[2]],
    "wrong version": lambda f: [json.dumps({"v": 9, "seq": 1, "req_id": "r"}).encode(), f[1], f[2]],
    "negative seq": lambda f: [json.dumps({"v": 1, "seq": -1, "req_id": "r"}).encode(), f[1], f[2]],
    "no req_id": lambda f: [json.dumps({"v": 1, "seq": 1}).encode(), f[1], f[2]],
    "header garbage": lambda f: [f[0], b"LMCK" + b"\x00" * 40, f[2]],
    "header with trailing bytes": lambda f: [f[0], f[1] + b"x", f[2]],
    "payload short": lambda f: [f[0], f[1], f[2][:-1]],
    "payload corrupt": _corrupt_payload,
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_frames_are_refused_by_the_parser(name: str) -> None:
    with pytest.raises(WireError):
        read_push(HOSTILE[name](_frames()))


def test_receiver_answers_hostile_pushes_and_keeps_serving() -> None:
    port = free_port()
    decoder = receiver_engine(port)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        good = _frames()
        for name, make in HOSTILE.items():
            sock.send_multipart(make(good))
            reply = read_reply(sock.recv())
            assert not reply.ok and reply.error, name
        sock.send_multipart(good)
        assert read_reply(sock.recv()).ok
        assert decoder.storage_manager.contains(key(1, "test/model"))
    finally:
        sock.close()
        decoder.close()


def test_receiver_port_in_use_is_a_clear_error() -> None:
    port = free_port()
    first = receiver_engine(port)
    try:
        with pytest.raises(OSError, match=f"127.0.0.1:{port}.*pd_peer_host/pd_peer_init_port"):
            receiver_engine(port)
    finally:
        first.close()


def test_a_frame_bigger_than_a_chunk_is_dropped_and_the_receiver_keeps_serving() -> None:
    port = free_port()
    decoder = receiver_engine(port)
    ctx = zmq.Context.instance()
    big, good = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    for sock in (big, good):
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 1500)
        sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        frames = _frames()
        big.send_multipart([frames[0], frames[1], b"\0" * (2 * ENGINE_CHUNK_BYTES + (1 << 17))])
        with pytest.raises(zmq.Again):
            big.recv()  # zmq cut that connection: no reply
        good.send_multipart(frames)
        assert read_reply(good.recv()).ok
    finally:
        big.close()
        good.close()
        decoder.close()
