"""The instance side of the controller: one client per vLLM worker, on a thread of its own.

Every `FLUSH_INTERVAL_S` the client drains its queue of the engine's holdings stream
(`holdings.CONTROLLER`), keeps a mirror of what each location holds, and pushes the admits and
evictions to `controller_pull_url` in batches of at most `OPS_PER_MESSAGE`, numbered by the
stream. Every `lmcache_worker_heartbeat_time` it heartbeats over `controller_reply_url`; the
reply asks it to register again (the controller restarted or dropped it) or to send a snapshot
(the controller saw a gap), which it sends from the mirror. When its own queue overflowed, the
mirror is rebuilt from the tiers that can list their keys (CPU, disk) and a snapshot follows.
With `lmcache_worker_ports`, it also takes the controller's `/clear`, `/pin` and `/unpin` on its
own port (`worker_pins.py` holds the pins).

Never on the request path: the store and the tiers only append to a bounded queue; sends never
block (a full ZeroMQ queue drops the message, which the controller sees as a gap). A controller
that is down costs one log line when it stops answering and one when it is back.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import socket
import threading
import time
import uuid
from typing import Dict, List, Optional, Set

import msgspec
import zmq

from lmcache.background_threads import prepared
from lmcache.controller.messages import (
    ADMIT,
    CLEAR,
    COMMAND_DECODER,
    EVICT,
    HEARTBEAT_REPLY_DECODER,
    MAX_COMMAND_BYTES,
    Batch,
    CommandMessage,
    CommandReply,
    Deregister,
    Heartbeat,
    Operation,
    PinCommand,
    Register,
    Snapshot,
    UnpinCommand,
    encode,
)
from lmcache.controller.worker_pins import WorkerPins
from lmcache.experimental.cache_engine import LMCacheEngine
from lmcache.experimental.holdings import CONTROLLER, Change, HoldingEvent
from lmcache.logging import init_logger
from lmcache.utils import CacheEngineKey

logger = init_logger(__name__)

# Upstream's batching: a batch leaves within 10 ms of the first admit in it, at most 50 operations
# per message.
FLUSH_INTERVAL_S = 0.01
# With nothing admitted or lost, commands and heartbeat replies are read (and a heartbeat sent
# when due) this often: the thread sleeps on the holdings stream instead of a 10 ms timer.
IDLE_TICK_S = 0.1
OPS_PER_MESSAGE = 50
# Messages ZeroMQ queues for a controller that is slow or not there yet; beyond, they are dropped.
PUSH_HWM = 2000
HEARTBEAT_HWM = 2
# How long the last batches and the deregistration may take to leave at close.
CLOSE_LINGER_MS = 500
TOKEN_ENV = "LMCACHE_CONTROLLER_TOKEN"
# At most one log line this often about a round that failed.
ERROR_LOG_EVERY_S = 10


class HoldingsMirror:
    """What each location of this worker holds, as chunk hashes, up to event `next_seq`."""

    def __init__(self) -> None:
        self.held: Dict[str, Set[str]] = {}
        self.next_seq = 1

    def apply(self, event: HoldingEvent) -> Operation:
        hashes = self.held.setdefault(event.tier, set())
        if event.change is Change.CLEARED:
            hashes.clear()
            return Operation(CLEAR, event.tier, "", event.seq)
        assert event.key is not None
        if event.change is Change.ADMITTED:
            hashes.add(event.key.chunk_hash)
            return Operation(ADMIT, event.tier, event.key.chunk_hash, event.seq)
        hashes.discard(event.key.chunk_hash)
        return Operation(EVICT, event.tier, event.key.chunk_hash, event.seq)

    def rebuild(self, listed: Dict[str, List[CacheEngineKey]]) -> None:
        """Replace what the listed tiers hold; a tier that cannot list (a remote store) keeps what
        the stream said of it."""
        for tier, keys in listed.items():
            self.held[tier] = {key.chunk_hash for key in keys}

    def snapshot(self) -> Dict[str, List[str]]:
        return {tier: sorted(hashes) for tier, hashes in self.held.items()}


class _Reachability:
    """Logs when the controller stops answering and when it is back: one line per change."""

    def __init__(self, url: str) -> None:
        self._url = url
        self.reachable = True

    def lost(self, why: str) -> None:
        if self.reachable:
            self.reachable = False
            logger.warning("LMCache controller at %s: %s; this worker goes on serving and reports again "
                           "once it answers", self._url, why)

    def back(self) -> None:
        if not self.reachable:
            self.reachable = True
            logger.info("LMCache controller at %s answers again: registering and resyncing", self._url)


def command_port(ports: Optional[tuple], rank: int) -> Optional[int]:
    """Worker `rank`'s command port: the rank-th of several, or the one port + rank."""
    if not ports:
        return None
    if len(ports) == 1:
        return ports[0] + rank
    if rank >= len(ports):
        raise ValueError(f"lmcache_worker_ports={list(ports)}: no port for worker {rank}")
    return ports[rank]


def local_address_towards(url: str) -> str:
    """The address of this machine that `url`'s host (tcp://HOST:PORT) reaches it on (loopback
    for a local controller): where the command port listens. Sends nothing."""
    host = url[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    try:
        if ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
            return "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return probe.getsockname()[0]
    except (OSError, ValueError):
        return "127.0.0.1"


class ControllerClient:
    """Reports one worker's holdings to the controller and takes its commands (`start`, `close`)."""

    def __init__(self, engine: LMCacheEngine, token: Optional[str] = None) -> None:
        config, meta = engine.config, engine.metadata
        assert engine.holdings is not None and config.controller_pull_url and config.controller_reply_url, \
            "enable_controller is off"
        self._stream = engine.holdings
        self._storage = engine.storage_manager
        self._pins = WorkerPins(engine)
        self._token = token
        self._boot_id = uuid.uuid4().hex
        self._who = dict(instance_id=config.lmcache_instance_id, worker_id=meta.worker_id, boot_id=self._boot_id)
        self._heartbeat_s = config.lmcache_worker_heartbeat_time
        self._mirror = HoldingsMirror()
        self._sent_seq = 1
        self._beat = 0
        self._answered_beat = 0
        self._next_beat_at = time.monotonic() + self._heartbeat_s
        self._want_register = True
        self._want_snapshot = True
        self.dropped_messages = 0  # messages ZeroMQ refused (controller down or slow)
        self._reach = _Reachability(config.controller_pull_url)
        ctx = zmq.Context.instance()
        self._push = ctx.socket(zmq.PUSH)
        self._push.set_hwm(PUSH_HWM)
        self._push.connect(config.controller_pull_url)
        self._dealer = ctx.socket(zmq.DEALER)
        self._dealer.set_hwm(HEARTBEAT_HWM)
        self._dealer.setsockopt(zmq.LINGER, 0)
        self._dealer.connect(config.controller_reply_url)
        self._commands, self._command_url = self._bind_commands(ctx, config.lmcache_worker_ports, meta.worker_id,
                                                                config.controller_pull_url)
        self._register = Register(**self._who, world_size=meta.world_size, fmt=meta.fmt,
                                  model_name=meta.model_name, chunk_size=config.chunk_size,
                                  heartbeat_s=self._heartbeat_s, command_url=self._command_url)
        self._stop = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=prepared(self._run, "lmc-controller", background=False),
                                        name="lmcache-controller-client", daemon=True)

    def _bind_commands(self, ctx: zmq.Context, ports: Optional[tuple], rank: int, controller_url: str):
        """(ROUTER socket, its URL) on this worker's command port, or (None, None) without one.
        A port beyond loopback needs the token, so no stranger can clear this worker's tiers."""
        try:
            port = command_port(ports, rank)
        except ValueError as err:
            logger.error("LMCache controller client: %s; this worker takes no commands", err)
            return None, None
        if port is None:
            return None, None
        host = local_address_towards(controller_url)
        if host != "127.0.0.1" and self._token is None:
            logger.error("LMCache controller client: the command port would listen on %s without a token; set %s "
                         "(the controller's --token) on the instance too. This worker takes no commands", host, TOKEN_ENV)
            return None, None
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_COMMAND_BYTES)  # a peer that sends more is dropped
        url = f"tcp://{host}:{port}"
        try:
            sock.bind(url)
        except zmq.ZMQError as err:
            sock.close()
            logger.error("LMCache controller client: cannot take commands on %s (%s); this worker takes none", url, err)
            return None, None
        return sock, url

    def start(self) -> "ControllerClient":
        self._thread.start()
        return self

    def _run(self) -> None:
        last_warning = -ERROR_LOG_EVERY_S
        while True:
            if self._stream.wait(CONTROLLER, IDLE_TICK_S):
                self._stop.wait(FLUSH_INTERVAL_S)  # the rest of a burst of admits joins this batch
            if self._stop.is_set():
                return
            try:
                self.tick()
            except Exception as err:  # the controller is advisory: serving goes on without it
                if time.monotonic() - last_warning >= ERROR_LOG_EVERY_S:  # a lasting fault: not 100 lines a second
                    last_warning = time.monotonic()
                    logger.warning("LMCache controller client: %r (logged at most every %d s)", err, ERROR_LOG_EVERY_S)

    def tick(self) -> None:
        """One round: commands, heartbeat replies, the stream's news, and a heartbeat when due."""
        self._serve_commands()
        self._read_replies()
        self._drain()
        if time.monotonic() >= self._next_beat_at:
            self._heartbeat()

    # ----- holdings -----------------------------------------------------------------------------

    def _drain(self) -> None:
        batch = self._stream.take(CONTROLLER)
        ops = [self._mirror.apply(event) for event in batch.events]
        self._mirror.next_seq = batch.next_seq
        if batch.resync:
            logger.warning("LMCache controller client: %d events dropped so far (queue full); rebuilding from the "
                           "tiers and resyncing", batch.dropped)
            self._mirror.rebuild(self._storage.listed_keys())
            self._want_snapshot = True
        if self._want_register:
            self._send(self._register)
            self._want_register, self._want_snapshot = False, True
        if self._want_snapshot:
            self._send(Snapshot(**self._who, next_seq=self._mirror.next_seq, holdings=self._mirror.snapshot()))
            self._want_snapshot, self._sent_seq = False, self._mirror.next_seq
            return
        for start in range(0, len(ops), OPS_PER_MESSAGE):
            part = ops[start:start + OPS_PER_MESSAGE]
            last = start + OPS_PER_MESSAGE >= len(ops)
            next_seq = batch.next_seq if last else part[-1].seq_num + 1
            self._send(Batch(**self._who, first_seq=self._sent_seq, next_seq=next_seq, operations=part))
            self._sent_seq = next_seq

    def _send(self, message: msgspec.Struct) -> None:
        try:
            self._push.send(encode(message), zmq.NOBLOCK)
        except zmq.Again:  # the controller is down or slow; it sees the gap and asks for a resync
            self.dropped_messages += 1
            self._reach.lost("it takes no more messages")

    # ----- heartbeats ---------------------------------------------------------------------------

    def _heartbeat(self) -> None:
        if self._answered_beat != self._beat:
            self._reach.lost(f"no answer to a heartbeat within {self._heartbeat_s} s")
        self._beat += 1
        self._next_beat_at = time.monotonic() + self._heartbeat_s
        try:
            self._dealer.send(encode(Heartbeat(**self._who, beat=self._beat, sent_seq=self._sent_seq)), zmq.NOBLOCK)
        except zmq.Again:
            self._reach.lost("it takes no heartbeats")

    def _read_replies(self) -> None:
        while self._dealer.poll(0):
            try:
                reply = HEARTBEAT_REPLY_DECODER.decode(self._dealer.recv())
            except msgspec.MsgspecError as err:
                logger.warning("LMCache controller client: unreadable heartbeat reply: %s", err)
                continue
            if reply.beat != self._beat:
                continue  # the reply to an older heartbeat: the current one's follows
            self._answered_beat = reply.beat
            self._reach.back()
            self._want_register = self._want_register or not reply.registered
            self._want_snapshot = self._want_snapshot or reply.resync

    # ----- commands -----------------------------------------------------------------------------

    def _serve_commands(self) -> None:
        while self._commands is not None and self._commands.poll(0):
            frames = self._commands.recv_multipart()
            if len(frames) != 2:
                continue
            identity, frame = frames
            try:
                command = COMMAND_DECODER.decode(frame)
            except msgspec.MsgspecError as err:
                logger.warning("LMCache controller client: unreadable command on %s: %s", self._command_url, err)
                continue
            if self._token is not None and not hmac.compare_digest((command.token or "").encode(), self._token.encode()):
                reply = CommandReply(command.event_id, False, error="wrong or missing controller token")
            else:
                reply = self._carry_out(command)
            try:
                self._commands.send_multipart((identity, encode(reply)), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # the controller gave up waiting

    def _carry_out(self, command: CommandMessage) -> CommandReply:
        """What `command` does to this worker's tiers and pins; a location that is none of them
        fails it, saying which there are."""
        try:
            if isinstance(command, PinCommand):
                return CommandReply(command.event_id, True,
                                    num_tokens=self._pins.pin(command.location, command.tokens, command.cache_salt))
            if isinstance(command, UnpinCommand):
                return CommandReply(command.event_id, True,
                                    num_tokens=self._pins.unpin(command.location, command.tokens, command.cache_salt))
            removed = self._storage.clear_tier(command.location)
            released = self._pins.release(command.location)  # clear means empty: no pin keeps a chunk of it
            logger.warning("LMCache tier %s cleared by the controller: %d chunks, %d controller pins released",
                           command.location, removed, released)
            return CommandReply(command.event_id, True, num_chunks=removed)
        except ValueError as err:
            return CommandReply(command.event_id, False, error=str(err))

    def close(self) -> None:
        """Report what the tiers said up to now (the engine closed first), deregister, close."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        try:
            self._drain()
            self._send(Deregister(**self._who))
        except Exception as err:
            logger.warning("LMCache controller client: last report failed: %r", err)
        self._push.close(linger=CLOSE_LINGER_MS)
        self._dealer.close()
        if self._commands is not None:
            self._commands.close()
        logger.info("LMCache controller client closed (%d messages dropped)", self.dropped_messages)


def start_controller_client(engine: LMCacheEngine) -> Optional[ControllerClient]:
    """This worker's client when the config turns the controller on (None otherwise, or when its
    sockets cannot be made: logged, and the engine serves without it)."""
    if not engine.config.enable_controller:
        return None
    try:
        client = ControllerClient(engine, token=os.environ.get(TOKEN_ENV) or None).start()
    except zmq.ZMQError as err:
        logger.error("LMCache controller client: cannot reach %s (%s); this worker reports nothing",
                     engine.config.controller_pull_url, err)
        return None
    logger.info("LMCache controller client: reporting to %s as %s worker %d", engine.config.controller_pull_url,
                engine.config.lmcache_instance_id, engine.metadata.worker_id)
    return client
