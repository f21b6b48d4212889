"""The controller without an engine (`lmcache/controller/`): its index (holdings learned from
numbered batches, gaps and restarts resynced, silent workers dropped, `/lookup` longest first and
hashed as the instances hash), its HTTP API (token, bad input), its sockets (unreadable frames)
and its flags (bind address, bad values). The instance side is tests/test_controller_worker.py."""

from __future__ import annotations

import json
import socket
from typing import Dict, List, Optional

import pytest
import zmq
from conftest import random_prompt
from helpers import post_json
from redis_fixture import free_port
from tier_helpers import wait_for

from lmcache.controller.__main__ import parse_settings
from lmcache.controller.commands import CommandResult
from lmcache.controller.http_api import ControllerAPI
from lmcache.controller.index import ControllerIndex
from lmcache.controller.messages import (
    Batch,
    ClearCommand,
    CommandMessage,
    Deregister,
    Heartbeat,
    Operation,
    Register,
    Snapshot,
    encode,
)
from lmcache.controller.server import Controller, ControllerSettings
from lmcache.experimental.token_database import prefix_chunk_hashes

CHUNK = 4
TOKEN = "s3cret-token"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def register(index: ControllerIndex, instance: str = "A", worker: int = 0, boot: str = "b1",
             chunk_size: int = CHUNK, world_size: int = 1, held: Optional[Dict[str, List[str]]] = None,
             next_seq: int = 1) -> None:
    index.apply(Register(instance, worker, world_size, boot, "vllm", "m", chunk_size, heartbeat_s=1.0))
    index.apply(Snapshot(instance, worker, boot, next_seq, held or {}))


def hashes(tokens: List[int], chunk_size: int = CHUNK) -> List[str]:
    return [h for _, h in prefix_chunk_hashes(tokens, chunk_size)]


def batch(first: int, ops: List[tuple], instance: str = "A", worker: int = 0, boot: str = "b1") -> Batch:
    operations = [Operation(op, loc, key, first + i) for i, (op, loc, key) in enumerate(ops)]
    return Batch(instance, worker, boot, first, first + len(ops), operations)


def lookup(index: ControllerIndex, tokens: List[int]) -> List[tuple]:
    return [(m.instance_id, m.location, m.matched_prefix_len) for m in index.lookup(tokens)]


# ---------------------------------------------------------------- the index

def test_lookup_answers_the_longest_prefix_first_hashed_as_the_instances_hash() -> None:
    index = ControllerIndex()
    tokens = random_prompt(10, seed=1)  # chunks end at 4, 8, 10
    h = hashes(tokens)
    register(index, "short", held={"Hot": h[:1]})
    register(index, "long", held={"Hot": h[:1], "LocalDiskBackend": h})
    register(index, "none", held={"Hot": h[1:]})  # no first chunk: no prefix
    assert lookup(index, tokens) == [("long", "LocalDiskBackend", 10), ("short", "Hot", 4)]
    # a prefix spread over locations is what a retrieve loads; the location is the longest run
    register(index, "spread", held={"Hot": [h[0], h[2]], "LocalDiskBackend": [h[1]]})
    assert ("spread", "Hot", 10) in lookup(index, tokens)
    # tensor parallel: an instance holds what all of its workers hold
    register(index, "tp", worker=0, world_size=2, held={"Hot": h})
    register(index, "tp", worker=1, world_size=2, held={"Hot": h[:2]})
    assert ("tp", "Hot", 8) in lookup(index, tokens)
    # another chunk size is hashed with its own size
    register(index, "big", chunk_size=8, held={"Hot": hashes(tokens, 8)[:1]})
    assert ("big", "Hot", 8) in lookup(index, tokens)


def test_batches_admit_and_evict_in_order_and_a_clear_drops_a_location() -> None:
    index = ControllerIndex()
    tokens = random_prompt(8, seed=2)
    h = hashes(tokens)
    register(index)
    index.apply(batch(1, [("admit", "Hot", h[0]), ("admit", "Hot", h[1])]))
    assert lookup(index, tokens) == [("A", "Hot", 8)]
    index.apply(batch(3, [("evict", "Hot", h[1])]))
    assert lookup(index, tokens) == [("A", "Hot", 4)]
    index.apply(batch(4, [("clear", "Hot", "")]))
    assert lookup(index, tokens) == []


def test_a_gap_marks_the_worker_stale_until_the_snapshot_its_heartbeat_asks_for() -> None:
    index = ControllerIndex()
    tokens = random_prompt(8, seed=3)
    h = hashes(tokens)
    register(index)
    index.apply(batch(1, [("admit", "Hot", h[0])]))
    index.apply(batch(5, [("admit", "Hot", h[1])]))  # events 2..4 never arrived
    assert index.workers("A")[0].stale
    reply = index.heartbeat(Heartbeat("A", 0, "b1", beat=1, sent_seq=6))
    assert reply.registered and reply.resync
    index.apply(batch(6, [("admit", "Hot", h[1])]))  # ignored: the snapshot covers it
    index.apply(Snapshot("A", 0, "b1", 7, {"Hot": h}))
    assert lookup(index, tokens) == [("A", "Hot", 8)] and not index.workers("A")[0].stale
    assert not index.heartbeat(Heartbeat("A", 0, "b1", beat=2, sent_seq=7)).resync


def test_a_lost_last_batch_is_found_by_two_heartbeats_not_one() -> None:
    index = ControllerIndex()
    register(index)
    index.apply(batch(1, [("admit", "Hot", "ab")]))
    # the worker sent events up to 5; the batch with 2..4 may still be on its way: not yet a loss
    assert not index.heartbeat(Heartbeat("A", 0, "b1", beat=1, sent_seq=5)).resync
    assert index.heartbeat(Heartbeat("A", 0, "b1", beat=2, sent_seq=5)).resync
    index.apply(Snapshot("A", 0, "b1", 5, {"Hot": ["ab", "cd"]}))
    # a batch that is merely late: the next heartbeat finds it arrived
    assert not index.heartbeat(Heartbeat("A", 0, "b1", beat=3, sent_seq=6)).resync
    index.apply(batch(5, [("evict", "Hot", "cd")]))
    assert not index.heartbeat(Heartbeat("A", 0, "b1", beat=4, sent_seq=6)).resync


def test_a_restarted_instance_is_resynced_and_its_old_boot_ignored() -> None:
    index = ControllerIndex()
    tokens = random_prompt(8, seed=4)
    h = hashes(tokens)
    register(index, held={"Hot": h})
    index.apply(Register("A", 0, 1, "b2", "vllm", "m", CHUNK, heartbeat_s=1.0))  # a new boot
    assert lookup(index, tokens) == []  # nothing known until its snapshot
    assert index.heartbeat(Heartbeat("A", 0, "b2", beat=1, sent_seq=1)).resync
    index.apply(batch(1, [("admit", "Hot", h[0])], boot="b1"))  # the old process's last words
    assert not index.heartbeat(Heartbeat("A", 0, "b1", beat=9, sent_seq=2)).registered
    index.apply(Snapshot("A", 0, "b2", 1, {"Hot": h[:1]}))
    assert lookup(index, tokens) == [("A", "Hot", 4)]
    index.apply(Deregister("A", 0, "b2"))
    assert index.workers("A") == []


def test_a_worker_silent_for_the_missed_heartbeats_is_dropped() -> None:
    clock = Clock()
    index = ControllerIndex(missed_heartbeats=3, clock=clock)
    register(index, "A")
    register(index, "B")
    clock.now += 2.5
    index.heartbeat(Heartbeat("B", 0, "b1", beat=1, sent_seq=1))
    assert index.expire() == []
    clock.now += 0.6  # A: 3.1 s of silence at a 1 s period
    assert index.expire() == [("A", 0)]
    assert [w.instance_id for w in index.workers("B")] == ["B"] and index.workers("A") == []
    assert not index.heartbeat(Heartbeat("A", 0, "b1", beat=2, sent_seq=1)).registered  # register again
    with pytest.raises(ValueError, match="missed_heartbeats"):
        ControllerIndex(missed_heartbeats=0)


# ---------------------------------------------------------------- the HTTP API

class Api:
    """A `ControllerAPI` on a free port, its index, and the commands it sent: to two workers, of
    which worker 1 pins at most one chunk; only "Hot" is a tier."""

    def __init__(self, token: Optional[str] = TOKEN) -> None:
        self.index = ControllerIndex()
        self.sent: list = []
        self.api = ControllerAPI(self.index, self._send, token)
        host, port = self.api.serve("127.0.0.1", 0)
        self.base = f"http://{host}:{port}"

    def _send(self, instance_id: str, command: CommandMessage) -> List[CommandResult]:
        self.sent.append((instance_id, command))
        if command.location != "Hot":
            return [CommandResult(0, True), CommandResult(1, False, error="no such tier")]
        if isinstance(command, ClearCommand):
            return [CommandResult(0, True, 3), CommandResult(1, True, 3)]
        return [CommandResult(0, True, num_tokens=len(command.tokens)),
                CommandResult(1, True, num_tokens=min(len(command.tokens), CHUNK))]

    def post(self, path: str, body, token: Optional[str] = None, method: str = "POST") -> tuple:
        return post_json(self.base + path, body, token, method)


@pytest.fixture
def api():
    served = Api()
    yield served
    served.api.close()


def test_http_lookup_health_worker_info_and_their_bad_input(api) -> None:
    tokens = random_prompt(12, seed=5)
    h = hashes(tokens)
    register(api.index, "one", held={"Hot": h[:1]})
    register(api.index, "three", held={"Hot": h})
    status, body = api.post("/lookup", {"tokens": tokens})
    assert status == 200 and list(body["layout_info"].items()) == [("three", ["Hot", 12]), ("one", ["Hot", 4])]
    assert isinstance(body["event_id"], str) and body["event_id"]
    status, body = api.post("/health", {"instance_id": "one"})
    assert (status, body["error_codes"]) == (200, {"0": 0})
    status, body = api.post("/query_worker_info", {"instance_id": "three", "worker_ids": [0]})
    assert status == 200 and body["worker_infos"][0]["num_chunks"] == {"Hot": 3}
    assert api.post("/health", {"instance_id": "nobody"})[0] == 404
    for path, bad, says in [
        ("/lookup", b"{not json", "not JSON"),
        ("/lookup", b"[1, 2]", "JSON object"),
        ("/lookup", {"tokens": "1 2 3"}, "'tokens'"),
        ("/lookup", {"tokens": [1, -2]}, "'tokens'"),
        ("/lookup", {"tokens": [True]}, "'tokens'"),
        ("/query_worker_info", {"instance_id": "three", "worker_ids": "0"}, "'worker_ids'"),
        ("/health", {}, "'instance_id'"),
        ("/nowhere", {}, "no such path"),
    ]:
        status, body = api.post(path, bad)
        assert status in (400, 404) and says in body["error"], (path, bad, body)
    assert api.post("/lookup", {}, method="GET")[0] == 405
    assert api.post("/lookup", {"tokens": tokens})[0] == 200  # the server took all that in its stride


def test_a_body_too_large_is_refused_before_it_is_read(api) -> None:
    with socket.create_connection(("127.0.0.1", int(api.base.rsplit(":", 1)[1])), timeout=10) as conn:
        conn.sendall(b"POST /lookup HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999999\r\n\r\n")
        assert b" 413 " in conn.recv(4096).split(b"\r\n", 1)[0]


def test_clear_needs_the_token_and_its_event_can_be_checked(api) -> None:
    register(api.index, "A")
    assert api.post("/clear", {"instance_id": "A", "location": "Hot"})[0] == 401
    assert api.post("/clear", {"instance_id": "A", "location": "Hot"}, token="wrong-token")[0] == 403
    assert api.sent == []
    status, body = api.post("/clear", {"instance_id": "A", "location": "Hot"}, token=TOKEN)
    assert status == 200 and (body["num_chunks"], body["num_tokens"]) == (3, 3 * CHUNK)
    assert api.post("/check_finish", {"event_id": body["event_id"]}) == (200, {"status": "finished"})
    status, body = api.post("/clear", {"instance_id": "A", "location": "Cold"}, token=TOKEN)
    assert status == 502 and "worker 1: no such tier" in body["error"] and "worker 0" not in body["error"]
    assert api.post("/check_finish", {"event_id": body["event_id"]}) == (200, {"status": "failed"})
    assert api.post("/check_finish", {"event_id": "nope"})[0] == 404
    assert api.post("/clear", {"instance_id": "B", "location": "Hot"}, token=TOKEN)[0] == 404


def test_pin_and_unpin_need_the_token_and_answer_the_prefix_every_worker_pinned(api) -> None:
    register(api.index, "A")
    tokens = random_prompt(3 * CHUNK, seed=2)
    for path in ("/pin", "/unpin"):
        body = {"instance_id": "A", "location": "Hot", "tokens": tokens}
        assert api.post(path, body)[0] == 401
        assert api.post(path, body, token="wrong-token")[0] == 403
        assert api.sent == []
        status, answer = api.post(path, body, token=TOKEN)
        assert (status, answer["num_tokens"]) == (200, CHUNK)  # worker 1 did one chunk: a load needs both
        assert api.post("/check_finish", {"event_id": answer["event_id"]}) == (200, {"status": "finished"})
        status, answer = api.post(path, {**body, "location": "Cold"}, token=TOKEN)
        assert status == 502 and f"{path[1:]} of 'Cold' on 'A' failed: worker 1: no such tier" in answer["error"]
        assert api.post("/check_finish", {"event_id": answer["event_id"]}) == (200, {"status": "failed"})
        assert api.post(path, {**body, "instance_id": "B"}, token=TOKEN)[0] == 404
        for bad, says in [({"instance_id": "A", "location": "Hot"}, "'tokens'"),
                          ({"instance_id": "A", "location": "Hot", "tokens": [1, -2]}, "'tokens'"),
                          ({"instance_id": "A", "tokens": tokens}, "'location'"),
                          ({"location": "Hot", "tokens": tokens}, "'instance_id'"),
                          ({**body, "cache_salt": 7}, "'cache_salt'")]:
            status, answer = api.post(path, bad, token=TOKEN)
            assert status == 400 and says in answer["error"], (path, bad, answer)
        api.sent.clear()
    api.post("/pin", {"instance_id": "A", "location": "Hot", "tokens": tokens, "cache_salt": "lora-1"}, token=TOKEN)
    ((instance, command),) = api.sent
    assert (instance, type(command).__name__, command.tokens, command.cache_salt) == \
        ("A", "PinCommand", tokens, "lora-1")


def test_without_a_token_state_changing_calls_are_refused() -> None:
    served = Api(token=None)
    try:
        register(served.index, "A")
        status, body = served.post("/clear", {"instance_id": "A", "location": "Hot"}, token="anything")
        assert status == 403 and "--token" in body["error"] and served.sent == []
        assert served.post("/lookup", {"tokens": [1, 2, 3]})[0] == 200  # reading needs none
    finally:
        served.api.close()


# ---------------------------------------------------------------- the process: sockets and flags

def test_the_controller_binds_loopback_by_default_and_survives_unreadable_frames() -> None:
    controller = Controller(ControllerSettings(port=0, pull_port=0, reply_port=0)).start()
    try:
        assert controller.http_address[0] == "127.0.0.1"
        pull, reply = controller.worker_ports
        ctx = zmq.Context.instance()
        push = ctx.socket(zmq.PUSH)
        push.connect(f"tcp://127.0.0.1:{pull}")
        for frame in (b"\x00garbage", encode(Heartbeat("A", 0, "b", 1, 1)), b""):
            push.send(frame)  # a heartbeat belongs on the reply socket: refused here too
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{reply}")
        dealer.send(b"not msgpack")
        dealer.send_multipart([b"two", b"frames"])
        assert wait_for(lambda: controller._receiver.unreadable == 5, timeout=10)
        # still serving: a real worker registers and is answered
        push.send(encode(Register("A", 0, 1, "b", "vllm", "m", CHUNK, heartbeat_s=1.0)))
        assert wait_for(lambda: controller.index.workers("A") != [], timeout=10)
        dealer.send(encode(Heartbeat("A", 0, "b", beat=1, sent_seq=1)))
        assert dealer.poll(10_000)
        push.close(linger=0)
        dealer.close(linger=0)
    finally:
        controller.close()
    with socket.socket() as probe:  # closed: the port is free again
        probe.bind(("127.0.0.1", controller.http_address[1]))


def test_a_controller_restarted_at_once_on_the_same_ports_binds_them_and_answers() -> None:
    """`close` returns with the workers' ports released (ZeroMQ closes sockets in the background),
    so a controller started right after on the same ports, as a test or an embedding does, binds."""
    settings = ControllerSettings(port=0, pull_port=free_port(), reply_port=free_port())
    ctx = zmq.Context.instance()
    push, dealer = ctx.socket(zmq.PUSH), ctx.socket(zmq.DEALER)  # connected workers keep the ports busy
    push.connect(f"tcp://127.0.0.1:{settings.pull_port}")
    dealer.connect(f"tcp://127.0.0.1:{settings.reply_port}")
    controller = Controller(settings).start()
    try:
        for _ in range(5):  # each one failed to bind about every other time when it was not so
            controller.close()
            controller = Controller(settings).start()
        dealer.send(encode(Heartbeat("A", 0, "b", beat=1, sent_seq=1)))
        assert dealer.poll(10_000)
    finally:
        controller.close()
        push.close(linger=0)
        dealer.close(linger=0)


def test_flags_as_upstream_spells_them_and_clear_errors_for_bad_ones(capsys, monkeypatch) -> None:
    s = parse_settings(["--host", "0.0.0.0", "--port", "9000", "--monitor-ports", '{"pull": 8300, "reply": 8400}'])
    assert (s.host, s.port, s.pull_port, s.reply_port, s.token) == ("0.0.0.0", 9000, 8300, 8400, None)
    assert (parse_settings(["--monitor-port", "9001"]).pull_port, parse_settings(["--monitor-port", "9001"]).reply_port) == (9001, 9002)
    assert parse_settings([]).host == "127.0.0.1"
    monkeypatch.setenv("LMCACHE_CONTROLLER_TOKEN", TOKEN)
    assert parse_settings([]).token == TOKEN
    for argv, says in [
        (["--monitor-ports", "{pull: 1}"], "--monitor-ports: not JSON"),
        (["--monitor-ports", '{"pull": 8300}'], "keys pull and reply"),
        (["--monitor-ports", '{"pull": 8300, "reply": "x"}'], "--monitor-ports reply"),
        (["--monitor-ports", '{"pull": 8300, "reply": 8300}'], "must differ"),
        (["--monitor-ports", '{"pull": 1, "reply": 2}', "--monitor-port", "3"], "give one"),
        (["--port", "70000"], "--port: '70000' is not a port"),
        (["--port", "8300"], "also a monitor port"),
        (["--token", "short"], "at least 8 characters"),
        (["--missed-heartbeats", "0"], "--missed-heartbeats"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            parse_settings(argv)
        assert exit_info.value.code == 2
        assert says in capsys.readouterr().err, argv


def test_a_port_in_use_is_an_error_naming_it() -> None:
    from lmcache.controller.__main__ import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["--port", str(port), "--monitor-ports", json.dumps({"pull": free_port(), "reply": free_port()})]) == 1


def test_python_m_lmcache_controller_serves_until_sigterm() -> None:
    import os
    import signal
    import subprocess
    import sys

    ports = json.dumps({"pull": free_port(), "reply": free_port()})
    proc = subprocess.Popen([sys.executable, "-m", "lmcache.controller", "--port", "0", "--monitor-ports", ports],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "LMCACHE_CONTROLLER_TOKEN": TOKEN})
    try:
        line = proc.stdout.readline()
        assert line.startswith("lmcache_controller: HTTP on http://127.0.0.1:"), line + proc.stderr.read()
        base = line.split()[3].rstrip(",")
        status, body = post_json(base + "/lookup", {"tokens": [1, 2]})
        assert (status, body["layout_info"]) == (200, {})
        assert post_json(base + "/clear", {"instance_id": "A", "location": "Hot"}, token=TOKEN)[0] == 404  # token taken
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_two_live_processes_under_one_name_are_told_apart_in_the_log(warnings_log) -> None:
    index = ControllerIndex()
    register(index, "A", boot="b1")
    reply = index.heartbeat(Heartbeat("A", 0, "b2", beat=1, sent_seq=1))  # b1 was heard just now
    assert not reply.registered
    index.heartbeat(Heartbeat("A", 0, "b2", beat=2, sent_seq=1))
    assert sum("two processes report as A worker 0" in w for w in warnings_log()) == 1
