"""The instance side of the controller (`lmcache/controller/worker.py`) against a real controller
in this process, with small engines on CPU tensors: what the tiers store and evict reaches
`/lookup`, a lost batch, an overflowed queue, a restarted controller and a restarted instance
are resynced, `/clear` reaches the tier, and a controller that is down costs one log line."""

from __future__ import annotations

import pytest
from helpers import post_json
from redis_fixture import free_port
from tier_helpers import keys_of, small_engine, store_prompt, wait_for

from lmcache.controller.messages import Batch
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

    client._stream = type("Broken", (), {"take": staticmethod(broken)})()
    client.start()
    store_prompt(engine, 16, seed=9)
    assert wait_for(lambda: any("stream broke" in w for w in warnings_log()))
    wait_for(lambda: False, timeout=0.3)  # some 30 failing rounds
    assert sum("stream broke" in w for w in warnings_log()) == 1
