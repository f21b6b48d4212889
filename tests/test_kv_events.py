"""LMCache's holdings as vLLM KV events (`integration/vllm/kv_events.py`), without starting vLLM:
the events built from vLLM's own classes, the ZeroMQ frames vLLM's decoder reads, and a
publisher that fails without failing the engine. The end-to-end runs are `check_kv_events` in
tests/test_v1_e2e.py (both vLLM lines)."""

from __future__ import annotations

import socket

import msgspec
import pytest
import torch
import zmq
from helpers import prompt, slots_for
from kv_reference import make_kvcaches
from tier_helpers import ENGINE_GEO, keys_of, small_engine, store_prompt

from lmcache.experimental.chunk_tokens import BlockNames, ChunkTokens
from lmcache.integration.vllm.kv_events import (
    KVEventsPublisher,
    KVEventsTranslator,
    block_hash,
    check_kv_events_config,
    connector_kv_events,
    endpoint_for_rank,
    start_kv_events,
)
from lmcache.integration.vllm.vllm_compat import is_legacy_vllm, kv_event_types

BlockStored, BlockRemoved, KVEventBatch = kv_event_types()
CHUNK = 8  # helpers.CHUNK: the small engines' chunk size


def events_engine(num_chunks: int, endpoint: str = "tcp://*:5557"):
    return small_engine(num_chunks=num_chunks, enable_kv_events=True, kv_events_endpoint=endpoint)


def test_stores_evictions_and_tails_become_vllm_events() -> None:
    engine = events_engine(num_chunks=3)
    translator = KVEventsTranslator(engine)
    tokens, *_ = store_prompt(engine, 20, seed=1)  # 2 whole chunks and a tail of 4
    keys = keys_of(engine, tokens)
    stored = translator.take()
    assert [type(e) for e in stored] == [BlockStored, BlockStored]  # the tail is no block
    assert [e.token_ids for e in stored] == [tokens[:8].tolist(), tokens[8:16].tolist()]
    assert [e.block_hashes for e in stored] == [[block_hash(keys[0])], [block_hash(keys[1])]]
    assert [e.parent_block_hash for e in stored] == [None, block_hash(keys[0])]
    assert all(e.block_size == CHUNK and e.lora_id is None for e in stored)

    store_prompt(engine, 16, seed=2)  # evicts the three least recently used: both chunks and the tail
    later = translator.take()
    removed = [h for e in later if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed == [block_hash(keys[0]), block_hash(keys[1])]  # the tail's loss is not published
    assert sum(isinstance(e, BlockStored) for e in later) == 2
    engine.close()
    assert translator.take() == []  # the CPU tier's close is logged, not an AllBlocksCleared


def test_a_store_with_vllms_block_names_publishes_them_for_each_whole_chunk() -> None:
    """vLLM 0.32 (blocks of 4 here): each chunk is its blocks' vLLM hashes, parented by the block
    before it, stored and removed under them; a chunk whose blocks are not all named stays ours,
    also when a later store names it (its events name it one way)."""
    engine = events_engine(num_chunks=3)
    translator = KVEventsTranslator(engine)
    names = BlockNames(block_size=4, first=0, hashes=(10, 11, 12, 13))  # chunk 2's blocks unnamed
    tokens, source, slots = store_prompt(engine, 24, seed=6, block_names=names)  # 3 chunks of 8
    keys = keys_of(engine, tokens)
    stored = translator.take()
    assert [e.block_hashes for e in stored] == [[10, 11], [12, 13], [block_hash(keys[2])]]
    assert [e.parent_block_hash for e in stored] == [None, 11, block_hash(keys[1])]
    assert [e.block_size for e in stored] == [4, 4, CHUNK]
    assert [e.token_ids for e in stored] == [tokens[i:i + CHUNK].tolist() for i in (0, 8, 16)]

    mask = torch.arange(24) >= 8  # stored again from the second chunk: names from its parent's block
    engine.store(tokens, mask, kvcaches=source, slot_mapping=slots,
                 block_names=BlockNames(block_size=4, first=1, hashes=(11, 12, 13, 14, 15)))
    assert translator.take() == []  # nothing new admitted
    store_prompt(engine, 24, seed=7)  # evicts all three
    removed = [e.block_hashes for e in translator.take() if isinstance(e, BlockRemoved)]
    assert sorted(removed, key=str) == sorted([[10, 11], [12, 13], [block_hash(keys[2])]], key=str)
    engine.close()


def test_a_layer_by_layer_store_names_its_chunks_too() -> None:
    engine = events_engine(num_chunks=4)
    translator = KVEventsTranslator(engine)
    tokens, source, slots = prompt(16, seed=8), make_kvcaches(ENGINE_GEO, seed=8), slots_for(ENGINE_GEO, 16, seed=8)
    names = BlockNames(block_size=4, first=0, hashes=(20, 21, 22, 23))
    for _ in engine.store_layer(tokens, kvcaches=source, slot_mapping=slots, block_names=names):
        pass
    assert [e.block_hashes for e in translator.take()] == [[20, 21], [22, 23]]
    engine.close()


def test_block_names_of_a_chunk_need_every_block_and_the_parent() -> None:
    names = BlockNames(block_size=4, first=3, hashes=(3, 4, 5, 6, 7))  # blocks 3..7
    assert names.of_chunk(16, 24) == ((4, 5), 3)
    assert names.of_chunk(20, 32) == ((5, 6, 7), 4)
    assert names.of_chunk(12, 20) is None  # its parent, block 2, is not named
    assert names.of_chunk(24, 36) is None  # block 8 is not named
    assert names.of_chunk(18, 26) is None  # not whole blocks
    assert BlockNames(block_size=4, first=0, hashes=(0, 1)).of_chunk(0, 8) == ((0, 1), None)


def test_an_admit_whose_tokens_were_forgotten_is_counted_not_published() -> None:
    engine = events_engine(num_chunks=4)
    engine.chunk_tokens = ChunkTokens(max_chunks=1)  # the store records both chunks before either is admitted
    translator = KVEventsTranslator(engine)
    tokens, *_ = store_prompt(engine, 16, seed=3)
    assert [e.token_ids for e in translator.take()] == [tokens[8:].tolist()]
    assert translator.undescribed == 1
    engine.close()


def test_frames_are_topic_sequence_and_a_batch_vllm_decodes(tmp_path) -> None:
    endpoint = f"ipc://{tmp_path}/events"
    engine = events_engine(num_chunks=4, endpoint=endpoint)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    publisher = KVEventsPublisher(KVEventsTranslator(engine), endpoint, "kv").start()
    sub.connect(endpoint)
    try:
        # A SUB's subscription reaches the PUB asynchronously: store once it is there.
        store_prompt(engine, 8, seed=4)
        assert sub.poll(5000, zmq.POLLIN)
        topic, seq, payload = sub.recv_multipart()
        batch = msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload)
        assert (topic, int.from_bytes(seq, "big")) == (b"kv", 0) and len(seq) == 8
        assert [type(e) for e in batch.events] == [BlockStored] and batch.ts > 0
    finally:
        publisher.close()
        sub.close(linger=0)
        engine.close()


def test_an_endpoint_in_use_or_a_failing_publish_leaves_serving_alone() -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        engine = events_engine(num_chunks=4, endpoint=f"tcp://*:{port}")
        assert start_kv_events(engine, rank=0) is None  # logged; the engine serves without events
    store_prompt(engine, 8, seed=5)
    publisher = start_kv_events(engine, rank=0)
    assert publisher is not None

    def broken():
        raise RuntimeError("translator broke")

    publisher._translator.take = broken
    publisher._publish()
    assert publisher.unsent == 1
    publisher.close()
    engine.close()


def test_without_an_endpoint_events_go_to_vllms_hook_which_vllm_0_9_2_lacks() -> None:
    engine = small_engine(num_chunks=4, enable_kv_events=True)
    if is_legacy_vllm():
        with pytest.raises(ValueError, match="kv_events_endpoint=None: vLLM 0.9.2"):
            connector_kv_events(engine)
        with pytest.raises(ValueError, match="kv_events_endpoint=None: vLLM 0.9.2"):
            check_kv_events_config(engine.config)  # what a worker checks before building its engine
    else:
        assert isinstance(connector_kv_events(engine), KVEventsTranslator)
    assert connector_kv_events(events_engine(num_chunks=4)) is None  # an endpoint: LMCache publishes
    assert start_kv_events(engine, rank=0) is None  # no endpoint: nothing of its own
    engine.close()


@pytest.mark.parametrize("endpoint, rank, expected", [
    ("tcp://*:5557", 0, "tcp://*:5557"),
    ("tcp://*:5557", 2, "tcp://*:5559"),
    ("tcp://10.0.0.1:5557", 1, "tcp://10.0.0.1:5558"),
    ("ipc:///run/lmc/events", 1, "ipc:///run/lmc/events_1"),
])
def test_each_worker_publishes_on_its_own_endpoint(endpoint, rank, expected) -> None:
    assert endpoint_for_rank(endpoint, rank) == expected
