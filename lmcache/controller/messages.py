"""What a worker and the controller say over ZeroMQ: typed msgspec structs, msgpack on the wire.

Worker -> controller, on the controller's pull socket (PUSH/PULL: one ordered stream per worker):
- `Register`: who the worker is and what its keys are made of (the hash needs `chunk_size`);
  a new `boot_id` means the instance restarted, so what the controller knew of it is void.
- `Batch`: admits and evictions, numbered by the worker's holdings stream; a batch covers the
  sequence numbers `[first_seq, next_seq)`, so the controller sees a lost batch as a gap.
- `Snapshot`: everything the worker holds, per location, as of `next_seq` (a full resync).
- `Deregister`: the worker is closing.

Worker <-> controller, on the controller's reply socket (DEALER/ROUTER, request and reply):
- `Heartbeat` -> `HeartbeatReply`: the worker is alive; the reply says whether the controller
  knows it (no: register again) and whether it wants a snapshot (a gap, or a lost last batch).

Controller -> worker, on the worker's command port (`lmcache_worker_ports`):
- `ClearCommand` -> `CommandReply`: drop every chunk of one location (and the controller's pins
  of it: clear means empty).
- `PinCommand` -> `CommandReply`: keep the longest prefix of the tokens that the location holds
  from eviction; `num_tokens` says how long a prefix.
- `UnpinCommand` -> `CommandReply`: release what a `PinCommand` of those tokens held.
A command is at most `MAX_COMMAND_BYTES` (a worker's socket drops a peer that sends more).

No pickle: every frame is decoded into these types, and anything else is refused with a reason.
"""

from __future__ import annotations

from typing import Annotated, Dict, List, Optional, Union

import msgspec

# A chunk's hash as keys carry it (`CacheEngineKey.chunk_hash`: BLAKE2b-128, lowercase hex).
ChunkHash = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{1,64}$")]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]

# Largest body the controller's HTTP API takes: a /lookup or /pin of ~1M tokens as JSON.
MAX_BODY_BYTES = 16 << 20
# Largest command: a /pin of the largest body (its tokens take no more room in msgpack than in
# JSON), plus the envelope.
MAX_COMMAND_BYTES = MAX_BODY_BYTES + 4096

ADMIT = "admit"  # the location holds the chunk now
EVICT = "evict"  # it no longer does
CLEAR = "clear"  # it lost every chunk (its key is "")
OP_TYPES = (ADMIT, EVICT, CLEAR)


class Register(msgspec.Struct, frozen=True, tag="register"):
    instance_id: Name
    worker_id: NonNegative
    world_size: Positive
    boot_id: Name  # new per process start
    fmt: Name  # the key fields the controller needs to name this worker's chunks
    model_name: Name
    chunk_size: Positive
    heartbeat_s: Annotated[float, msgspec.Meta(gt=0)]  # the controller drops it after a few silent periods
    command_url: Optional[str] = None  # tcp://HOST:PORT the worker takes commands on; None: it takes none


class Operation(msgspec.Struct, frozen=True, array_like=True):
    op_type: Annotated[str, msgspec.Meta(pattern=r"^(admit|evict|clear)$")]
    location: Name  # the tier's name (`search_range` names: "Hot", "LocalDiskBackend", ...)
    key: Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{0,64}$")]  # the chunk's hash; "" for a clear
    seq_num: Positive


class Batch(msgspec.Struct, frozen=True, tag="batch"):
    instance_id: Name
    worker_id: NonNegative
    boot_id: Name
    first_seq: Positive
    next_seq: Positive
    operations: List[Operation]


class Snapshot(msgspec.Struct, frozen=True, tag="snapshot"):
    instance_id: Name
    worker_id: NonNegative
    boot_id: Name
    next_seq: Positive  # the first event the snapshot does not include
    holdings: Dict[Name, List[ChunkHash]]


class Deregister(msgspec.Struct, frozen=True, tag="deregister"):
    instance_id: Name
    worker_id: NonNegative
    boot_id: Name


class Heartbeat(msgspec.Struct, frozen=True, tag="heartbeat"):
    instance_id: Name
    worker_id: NonNegative
    boot_id: Name
    beat: NonNegative  # numbers the heartbeats, so a late reply is told from the current one
    sent_seq: Positive  # where the worker's batches sent so far end (the next `first_seq`)


class HeartbeatReply(msgspec.Struct, frozen=True, tag="heartbeat_reply"):
    beat: NonNegative
    registered: bool  # False: the controller does not know this worker (it restarted, or dropped it)
    resync: bool  # True: send a snapshot


class ClearCommand(msgspec.Struct, frozen=True, tag="clear"):
    event_id: Name
    location: Name
    token: Optional[str] = None  # the controller's token, checked by a worker that has one


class _TokensCommand(msgspec.Struct, frozen=True):
    """A pin or an unpin: `tokens` name a prefix as a /lookup's do, hashed by the worker."""

    event_id: Name
    location: Name
    tokens: List[TokenId]
    cache_salt: str = ""  # as in /lookup: what else shaped the KV (LoRA, multimodal inputs)
    token: Optional[str] = None


class PinCommand(_TokensCommand, frozen=True, tag="pin"):
    pass


class UnpinCommand(_TokensCommand, frozen=True, tag="unpin"):
    pass


class CommandReply(msgspec.Struct, frozen=True, tag="command_reply"):
    event_id: Name
    ok: bool
    num_chunks: NonNegative = 0  # a clear: the chunks dropped
    num_tokens: NonNegative = 0  # a pin or unpin: the prefix pinned or released
    error: str = ""


PullMessage = Union[Register, Batch, Snapshot, Deregister]
ReplyMessage = Union[Heartbeat]
CommandMessage = Union[ClearCommand, PinCommand, UnpinCommand]

ENCODER = msgspec.msgpack.Encoder()
PULL_DECODER = msgspec.msgpack.Decoder(PullMessage)
HEARTBEAT_DECODER = msgspec.msgpack.Decoder(Heartbeat)
HEARTBEAT_REPLY_DECODER = msgspec.msgpack.Decoder(HeartbeatReply)
COMMAND_DECODER = msgspec.msgpack.Decoder(CommandMessage)
COMMAND_REPLY_DECODER = msgspec.msgpack.Decoder(CommandReply)


def encode(message: msgspec.Struct) -> bytes:
    return ENCODER.encode(message)
