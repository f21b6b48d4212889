"""The disk tier's read checksum, computed on a thread of its own one piece behind the reader
(`hash_thread`): the same XXH3-64 as the one-shot checksum, in order across a `close` that lands
mid-payload, errors surfacing at `digest`, and the thread kept off the reader's CPU."""

import os
import threading

import pytest
import torch

from lmcache.experimental.storage_backend import chunk_format, hash_thread

PIECE = 64 << 10


def _data(nbytes: int, seed: int = 0) -> memoryview:
    gen = torch.Generator().manual_seed(seed)
    return memoryview(bytearray(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).numpy()))


def _feed(hasher: "hash_thread.PayloadHash", data: memoryview, pieces) -> None:
    for start, end in pieces:
        hasher.update(data[start:end])


def test_digest_is_the_one_shot_checksum_for_payloads_in_turn() -> None:
    thread = hash_thread.HashThread("lmc-test-hash")
    try:
        for seed, nbytes in enumerate((0, 1, PIECE, int(5.5 * PIECE))):
            data = _data(nbytes, seed)
            hasher = thread.payload()
            _feed(hasher, data, chunk_format.hashed_pieces(nbytes, PIECE))
            assert hasher.digest() == chunk_format.payload_checksum(data)
    finally:
        thread.close()


def test_close_mid_payload_keeps_the_pieces_in_order() -> None:
    thread = hash_thread.HashThread("lmc-test-hash")
    data = _data(8 * PIECE)
    pieces = list(chunk_format.hashed_pieces(data.nbytes, PIECE))
    hasher = thread.payload()
    _feed(hasher, data, pieces[:5])  # queued on the thread
    thread.close()
    _feed(hasher, data, pieces[5:])  # hashed inline, after the thread has done the first five
    assert hasher.digest() == chunk_format.payload_checksum(data)
    closed = thread.payload()  # a closed thread hashes everything inline
    _feed(closed, data, pieces)
    assert closed.digest() == chunk_format.payload_checksum(data)


def test_a_hashing_error_surfaces_at_digest_and_the_thread_lives_on() -> None:
    thread = hash_thread.HashThread("lmc-test-hash")
    try:
        bad = thread.payload()
        bad.update(object())  # type: ignore[arg-type]  # not a buffer
        with pytest.raises(TypeError):
            bad.digest()
        data = _data(3 * PIECE)
        good = thread.payload()
        _feed(good, data, chunk_format.hashed_pieces(data.nbytes, PIECE))
        assert good.digest() == chunk_format.payload_checksum(data)
    finally:
        thread.close()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_the_thread_runs_off_the_readers_cpu() -> None:
    """Placed by wake-up affinity, the thread would share the reader's core whenever the others
    had just been busy, and reading and hashing would take turns instead of overlapping."""
    thread = hash_thread.HashThread("lmc-test-hash")
    allowed = os.sched_getaffinity(0)
    reader_cpu = min(allowed)
    seen = {}

    def read_on_one_cpu() -> None:
        os.sched_setaffinity(0, {reader_cpu})
        data = _data(2 * PIECE)
        first = thread.payload()  # starts the thread
        _feed(first, data, chunk_format.hashed_pieces(data.nbytes, PIECE))
        first.digest()
        thread.payload().digest()  # the thread exists now: this payload moves it off our CPU
        seen["mask"] = os.sched_getaffinity(thread._tid)

    reader = threading.Thread(target=read_on_one_cpu)
    reader.start()
    reader.join()
    thread.close()
    assert seen["mask"] == allowed - {reader_cpu}
