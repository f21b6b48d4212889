"""The instance side of the controller (`lmcache/controller/worker.py`) against a real controller
in this process, with small engines on CPU tensors: what the tiers store and evict reaches
`/lookup`, a lost batch, an overflowed queue, a restarted controller and a restarted instance
are resynced, `/clear` reaches the tier, `/pin` keeps a prefix through evictions within its bound
and `/unpin` lets it go, and a controller that is down costs one log line."""

from __future__ import annotations

import pytest
import zmq
from helpers import post_json
from redis_fixture import free_port
from tier_helpers import flush, keys_of, retrieve_and_check, small_engine, store_prompt, wait_for

from lmcache.controller.messages import MAX_COMMAND_BYTES, Batch
from lmcache.controller.server import Controller, ControllerSettings
from lmcache.controller.worker import ControllerClient, command_port
from lmcache.experimental.holdings import KV_EVENTS
from lmcache.integration.vllm.kv_events import KVEventsTranslator

TOKEN = "s3cret-token"
BEAT_S = 0.2


class Cluster:
    """A controller on free ports, and engines configured to report to it."""

    def __init__(self) -> None:
        self.settings = ControllerSettings(port=0, pull_port=free_port(), reply_port=free_port(), token=TOKEN)
        self.controller = Controller(self.settings).start()
        self.engines: list = []
        self.clients: list = []

    def restart_controller(self) -> None:
        self.controller.close()
        self.controller = Controller(self.settings).start()

    def engine(self, instance_id: str = "A", num_chunks: int = 4, **overrides):
        engine = small_engine(num_chunks=num_chunks, enable_controller=True, lmcache_instance_id=instance_id,
                              controller_pull_url=f"127.0.0.1:{self.settings.pull_port}",
                              controller_reply_url=f"127.0.0.1:{self.settings.reply_port}",
                              lmcache_worker_heartbeat_time=BEAT_S, **overrides)
        self.engines.append(engine)
        return engine

    def client(self, engine, start: bool = True, token: str = TOKEN) -> ControllerClient:
        client = ControllerClient(engine, token=token)
        self.clients.append(client)
        return client.start() if start else client

    def post(self, path: str, body: dict, token: str = None) -> tuple:
        host, port = self.controller.http_address
        return post_json(f"http://{host}:{port}{path}", body, token)

    def pin(self, path: str, tokens, instance_id: str = "A", location: str = "Hot", **more) -> int:
        """The `num_tokens` of a /pin or /unpin that must succeed."""
        body = {"instance_id": instance_id, "location": location, "tokens": [int(t) for t in tokens], **more}
        status, answer = self.post(path, body, token=TOKEN)
        assert status == 200, answer
        assert self.post("/check_finish", {"event_id": answer["event_id"]}) == (200, {"status": "finished"})
        return answer["num_tokens"]

    def layout(self, tokens) -> dict:
        status, body = self.post("/lookup", {"tokens": [int(t) for t in tokens]})
        assert status == 200, body
        return body["layout_info"]

    def close(self) -> None:
        for client in self.clients:
            client.close()
        for engine in self.engines:
            engine.close()
        self.controller.close()


def ticked(client: ControllerClient) -> bool:
    """One round of a client whose thread is not started (tests that pace it themselves)."""
    client.tick()
    return True


@pytest.fixture
def cluster():
    made = Cluster()
    yield made
    made.close()


def test_stores_and_evictions_reach_lookup_and_a_closed_instance_leaves(cluster) -> None:
    engine = cluster.engine("A", num_chunks=4)
    client = cluster.client(engine)
    first, *_ = store_prompt(engine, 20, seed=1)  # chunks of 8: 8, 16, 20
    assert wait_for(lambda: cluster.layout(first) == {"A": ["Hot", 20]})
    assert cluster.layout(first[:12].tolist() + [7, 7]) == {"A": ["Hot", 8]}  # only the first chunk is shared
    second, *_ = store_prompt(engine, 16, seed=2)  # the small CPU tier evicts the first prompt's oldest chunks
    assert wait_for(lambda: cluster.layout(second) == {"A": ["Hot", 16]} and cluster.layout(first) == {})
    assert cluster.controller.index.workers("A")[0].resyncs == 1  # the snapshot after registering, no other
    client.close()
    cluster.clients.remove(client)
    assert wait_for(lambda: cluster.post("/health", {"instance_id": "A"})[0] == 404)


def test_the_kv_events_publisher_and_the_controller_each_see_every_event(cluster) -> None:
    engine = cluster.engine("A", num_chunks=8, enable_kv_events=True, kv_events_endpoint="tcp://*:5557")
    assert engine.holdings.consumers == (KV_EVENTS, "controller")
    translator = KVEventsTranslator(engine)
    cluster.client(engine)
    tokens, *_ = store_prompt(engine, 16, seed=3)
    assert wait_for(lambda: cluster.layout(tokens) == {"A": ["Hot", 16]})
    assert len(translator.take()) == 2


def test_a_lost_batch_is_resynced_within_two_heartbeats(cluster) -> None:
    engine = cluster.engine("A", num_chunks=8)
    client = cluster.client(engine, start=False)
    client.tick()  # registers, with an empty snapshot
    tokens, *_ = store_prompt(engine, 16, seed=4)
    real_send, lost = client._send, []
    client._send = lambda message: lost.append(message) if isinstance(message, Batch) and not lost else real_send(message)
    client.tick()  # the batch with both admits is lost on the way
    assert len(lost) == 1 and cluster.layout(tokens) == {}
    for _ in range(2):  # the second heartbeat finds the batch never came, and asks for a snapshot
        client._next_beat_at = 0
        assert wait_for(lambda: ticked(client) and client._answered_beat == client._beat, timeout=10)
    assert wait_for(lambda: ticked(client) and cluster.layout(tokens) == {"A": ["Hot", 16]})
    assert cluster.controller.index.workers("A")[0].resyncs == 2


def test_an_overflowed_queue_is_rebuilt_from_the_tiers_and_resynced(cluster) -> None:
    engine = cluster.engine("A", num_chunks=8)
    client = cluster.client(engine, start=False)
    client.tick()
    engine.holdings._max_pending = 1  # the client fell behind: all but one event dropped for it
    tokens, *_ = store_prompt(engine, 24, seed=5)
    assert wait_for(lambda: ticked(client) and cluster.layout(tokens) == {"A": ["Hot", 24]})
    assert cluster.controller.index.workers("A")[0].resyncs == 2


def test_a_restarted_controller_or_instance_converges_and_a_down_one_costs_one_line(cluster, warnings_log) -> None:
    engine = cluster.engine("A", num_chunks=8)
    old_client = cluster.client(engine)
    first, *_ = store_prompt(engine, 16, seed=6)
    assert wait_for(lambda: cluster.layout(first) == {"A": ["Hot", 16]})
    cluster.controller.close()
    second, *_ = store_prompt(engine, 8, seed=7)  # serving goes on while it is down
    assert wait_for(lambda: sum("no answer to a heartbeat" in w for w in warnings_log()) == 1)
    cluster.controller = Controller(cluster.settings).start()
    assert wait_for(lambda: cluster.layout(first) == {"A": ["Hot", 16]} and cluster.layout(second) == {"A": ["Hot", 8]})
    assert sum("LMCache controller at" in w for w in warnings_log()) == 1  # one line down, none per message

    old_client._stop.set()  # the instance dies without a word, and comes back: a new boot, empty tiers
    old_client._thread.join()
    restarted = cluster.engine("A", num_chunks=8)
    cluster.client(restarted)
    third, *_ = store_prompt(restarted, 8, seed=8)
    assert wait_for(lambda: cluster.layout(third) == {"A": ["Hot", 8]} and cluster.layout(first) == {})
    old_client.close()  # its last words carry the old boot: ignored
    assert cluster.layout(third) == {"A": ["Hot", 8]}


def test_clear_reaches_the_workers_tier_with_the_token_only(cluster) -> None:
    port = free_port()
    engine = cluster.engine("A", num_chunks=8, lmcache_worker_ports=(port,))
    cluster.client(engine)
    tokens, *_ = store_prompt(engine, 16, seed=8)
    assert wait_for(lambda: cluster.layout(tokens) == {"A": ["Hot", 16]})
    (info,) = cluster.post("/query_worker_info", {"instance_id": "A"})[1]["worker_infos"]
    assert (info["ip"], info["port"], info["registration_time"] > 0) == ("127.0.0.1", port, True)
    assert cluster.post("/clear", {"instance_id": "A", "location": "Hot"})[0] == 401
    status, body = cluster.post("/clear", {"instance_id": "A", "location": "Nowhere"}, token=TOKEN)
    assert status == 502 and "tier='Nowhere'" in body["error"]
    status, body = cluster.post("/clear", {"instance_id": "A", "location": "Hot"}, token=TOKEN)
    assert (status, body["num_chunks"], body["num_tokens"]) == (200, 2, 16)
    assert cluster.post("/check_finish", {"event_id": body["event_id"]}) == (200, {"status": "finished"})
    assert engine.storage_manager.listed_keys() == {"Hot": []}
    assert wait_for(lambda: cluster.layout(tokens) == {})

    other = cluster.engine("B", num_chunks=8, lmcache_worker_ports=(free_port(),))
    cluster.client(other, token="another-token")  # a worker that trusts another token
    assert wait_for(lambda: cluster.controller.index.workers("B") != [])
    status, body = cluster.post("/clear", {"instance_id": "B", "location": "Hot"}, token=TOKEN)
    assert status == 502 and "wrong or missing controller token" in body["error"]
    nocmd = cluster.engine("C", num_chunks=8)
    cluster.client(nocmd)
    assert wait_for(lambda: cluster.controller.index.workers("C") != [])
    status, body = cluster.post("/clear", {"instance_id": "C", "location": "Hot"}, token=TOKEN)
    assert status == 502 and "lmcache_worker_ports" in body["error"]
    assert keys_of(engine, tokens)  # (the engine still hashes the prompt: nothing else changed)


def test_each_worker_gets_its_own_command_port() -> None:
    assert command_port(None, 0) is None
    assert [command_port((8500,), rank) for rank in (0, 3)] == [8500, 8503]
    assert command_port((8500, 8600), 1) == 8600
    with pytest.raises(ValueError, match="no port for worker 2"):
        command_port((8500, 8600), 2)


def test_a_round_that_keeps_failing_is_one_log_line_and_serving_goes_on(cluster, warnings_log) -> None:
    engine = cluster.engine("A", num_chunks=8)
    client = cluster.client(engine, start=False)

    def broken(consumer):
        raise RuntimeError("stream broke")

    client._stream = type("Broken", (), {"take": staticmethod(broken),
                                         "wait": staticmethod(lambda consumer, timeout_s: True)})()
    client.start()
    store_prompt(engine, 16, seed=9)
    assert wait_for(lambda: any("stream broke" in w for w in warnings_log()))
    wait_for(lambda: False, timeout=0.3)  # some 30 failing rounds
    assert sum("stream broke" in w for w in warnings_log()) == 1


def churn(engine, seeds) -> None:
    """Store a prompt of two chunks per seed: room the small CPU tier makes by evicting idle chunks."""
    for seed in seeds:
        store_prompt(engine, 16, seed=seed)


def test_pin_keeps_a_prefix_through_evictions_and_unpin_lets_it_go(cluster) -> None:
    engine = cluster.engine("A", num_chunks=8, lmcache_worker_ports=(free_port(),))
    cluster.client(engine)
    kept, source, slots = store_prompt(engine, 20, seed=10)  # chunks end at 8, 16, 20
    other, *_ = store_prompt(engine, 16, seed=11)
    assert wait_for(lambda: cluster.layout(kept) == {"A": ["Hot", 20]})
    assert cluster.pin("/pin", kept, cache_salt="lora-1") == 0  # other keys: the salt is hashed in
    assert cluster.pin("/pin", kept) == 20
    churn(engine, range(20, 24))  # 8 chunks through a tier of 8: every idle chunk goes
    assert wait_for(lambda: cluster.layout(other) == {})
    assert cluster.layout(kept) == {"A": ["Hot", 20]}
    retrieve_and_check(engine, kept, source, slots, 20)
    assert cluster.pin("/unpin", kept) == 20
    assert engine.storage_manager.pins.num_requests == 0
    churn(engine, range(24, 28))  # the same churn, unpinned: it goes too
    assert wait_for(lambda: cluster.layout(kept) == {})
    assert cluster.pin("/unpin", kept) == 0  # nothing left to release


def test_a_pin_of_the_disk_tier_holds_the_prefix_in_cpu_memory_when_the_disk_loses_it(cluster, tmp_path) -> None:
    engine = cluster.engine("A", num_chunks=8, lmcache_worker_ports=(free_port(),), local_disk=str(tmp_path),
                            max_local_disk_size=0.01)
    cluster.client(engine)
    kept, source, slots = store_prompt(engine, 16, seed=16)
    flush(engine)
    assert wait_for(lambda: cluster.layout(kept) == {"A": ["Hot", 16]})
    assert cluster.post("/clear", {"instance_id": "A", "location": "Hot"}, token=TOKEN)[0] == 200
    assert cluster.pin("/pin", kept, location="LocalDiskBackend") == 16  # read back into CPU memory
    churn(engine, range(30, 34))
    disk = engine.storage_manager.tiers[-1]
    assert disk.tier_name == "LocalDiskBackend" and all(disk.remove(key) for key in keys_of(engine, kept))
    retrieve_and_check(engine, kept, source, slots, 16)


def test_pins_stay_within_half_the_cpu_tier_and_clear_or_close_releases_them(cluster, warnings_log) -> None:
    engine = cluster.engine("A", num_chunks=8, lmcache_worker_ports=(free_port(),))
    cluster.client(engine)
    first, *_ = store_prompt(engine, 24, seed=12)  # three whole chunks each
    second, *_ = store_prompt(engine, 24, seed=13)
    assert wait_for(lambda: cluster.layout(second) == {"A": ["Hot", 24]})
    storage, asked = engine.storage_manager, []
    real_pin_prefix = storage.pin_prefix
    storage.pin_prefix = lambda request_id, keys, *rest: asked.append(len(keys)) or \
        real_pin_prefix(request_id, keys, *rest)
    assert cluster.pin("/pin", first) == 24  # 3 chunks of the 4 the bound allows
    assert cluster.pin("/pin", first) == 24  # a repeated /pin replaces the last: counted once
    assert cluster.pin("/pin", second) == 8  # the one chunk that still fits
    assert cluster.pin("/pin", second) == 8
    assert asked == [3, 3, 2, 2]  # never more chunks read than could fit, and one to find the bound
    assert engine.storage_manager.pins.num_pins == 4
    assert sum("reached the bound" in w for w in warnings_log()) == 1
    assert cluster.pin("/pin", first[:8]) == 8  # a shared chunk costs nothing more
    assert cluster.pin("/unpin", first) == 24
    assert cluster.pin("/pin", second) == 24
    assert cluster.pin("/pin", first[:16]) == 8

    status, body = cluster.post("/clear", {"instance_id": "A", "location": "Hot"}, token=TOKEN)
    assert status == 200 and body["num_chunks"] == 6
    assert engine.storage_manager.pins.num_requests == 0  # clear means empty: the pins went too
    assert wait_for(lambda: cluster.layout(second) == {})
    assert (cluster.pin("/unpin", second), cluster.pin("/pin", second)) == (0, 0)

    third, *_ = store_prompt(engine, 16, seed=14)
    assert cluster.pin("/pin", third) == 16
    engine.close()  # the engine's close releases the controller's pins, and calls them no leak
    assert engine.storage_manager.pins.num_pins == 0
    assert not any("LMCache engine closed" in w for w in warnings_log())


def test_pin_and_unpin_refuse_what_they_cannot_do(cluster, warnings_log) -> None:
    engine = cluster.engine("A", num_chunks=8, lmcache_worker_ports=(free_port(),))
    cluster.client(engine)
    tokens, *_ = store_prompt(engine, 16, seed=15)
    assert wait_for(lambda: cluster.layout(tokens) == {"A": ["Hot", 16]})
    nocmd = cluster.engine("C", num_chunks=8)
    cluster.client(nocmd)
    assert wait_for(lambda: cluster.controller.index.workers("C") != [])
    body = {"instance_id": "A", "location": "Hot", "tokens": tokens.tolist()}
    for path in ("/pin", "/unpin"):
        assert cluster.post(path, body)[0] == 401
        assert cluster.post(path, body, token="wrong-token")[0] == 403
        for bad in ({**body, "tokens": "1 2"}, {**body, "location": 3}, {"location": "Hot", "tokens": [1]}):
            status, answer = cluster.post(path, bad, token=TOKEN)
            assert status == 400 and "field" in answer["error"], answer
        assert cluster.post(path, {**body, "instance_id": "nobody"}, token=TOKEN)[0] == 404
        status, answer = cluster.post(path, {**body, "location": "Nowhere"}, token=TOKEN)
        assert status == 502 and "tier='Nowhere'" in answer["error"]
        assert cluster.post("/check_finish", {"event_id": answer["event_id"]}) == (200, {"status": "failed"})
        status, answer = cluster.post(path, {**body, "instance_id": "C"}, token=TOKEN)
        assert status == 502 and "lmcache_worker_ports" in answer["error"]
    assert engine.storage_manager.pins.num_requests == 0  # nothing refused pinned anything

    (info,) = cluster.controller.index.workers("A")
    stranger = zmq.Context.instance().socket(zmq.DEALER)
    stranger.connect(f"tcp://{info.ip}:{info.port}")
    stranger.send(b"x" * (MAX_COMMAND_BYTES + 1))  # the worker's socket drops a frame that large unread
    wait_for(lambda: False, timeout=1.0)
    stranger.close(linger=0)
    assert not any("unreadable command" in w for w in warnings_log())
    assert cluster.pin("/pin", tokens) == 16  # and goes on taking commands
