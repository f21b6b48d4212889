"""The `disagg_spec` a proxy puts in a request's `kv_transfer_params`: where its KV goes.

`parse_disagg_spec(raw, peer_host)` checks every field (a client or a proxy wrote it) and
returns a `DisaggSpec`, or raises `DisaggSpecError` naming the field and the value. A spec that
names another host than the configured peer is refused: the prefiller pushes only where its
operator said it may.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

DISAGG_SPEC_KEY = "disagg_spec"
MAX_REQ_ID_CHARS = 256


class DisaggSpecError(ValueError):
    """A `disagg_spec` that cannot be followed; the message names the field."""


@dataclass(frozen=True)
class DisaggSpec:
    """Where one request's KV is pushed, and how far the push has come."""

    req_id: str  # the proxy's id of the request (the same on prefiller and decoder)
    receiver_host: str
    receiver_init_port: int  # the receiver's port for worker 0
    receiver_alloc_port: int  # upstream's allocation port; each push's reply allocates here
    is_last_prefill: bool = False  # this step completes the prompt (its partial chunk goes too)
    num_transferred_tokens: int = 0  # leading tokens pushed by earlier steps

    @property
    def receiver_id(self) -> str:
        return f"{self.receiver_host}:{self.receiver_init_port}"


def _port(spec: Mapping[str, Any], name: str) -> int:
    value = spec[name]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= 65535:
        raise DisaggSpecError(f"disagg_spec[{name!r}]={value!r}: expected a port number in 1..65535")
    return value


def parse_disagg_spec(raw: Any, peer_host: str) -> DisaggSpec:
    """A checked `DisaggSpec` from `kv_transfer_params["disagg_spec"]`."""
    if not isinstance(raw, Mapping):
        raise DisaggSpecError(f"disagg_spec={raw!r}: expected an object with req_id, receiver_host, "
                              "receiver_init_port, receiver_alloc_port")
    for name in ("req_id", "receiver_host", "receiver_init_port", "receiver_alloc_port"):
        if name not in raw:
            raise DisaggSpecError(f"disagg_spec[{name!r}] is missing")
    req_id = raw["req_id"]
    if not isinstance(req_id, str) or not req_id or len(req_id) > MAX_REQ_ID_CHARS:
        raise DisaggSpecError(f"disagg_spec['req_id']={req_id!r}: expected a string of 1..{MAX_REQ_ID_CHARS} chars")
    host = raw["receiver_host"]
    if not isinstance(host, str):
        raise DisaggSpecError(f"disagg_spec['receiver_host']={host!r}: expected a string")
    if host != peer_host:
        raise DisaggSpecError(
            f"disagg_spec['receiver_host']={host!r} is not this prefiller's peer (pd_peer_host={peer_host!r})"
        )
    return DisaggSpec(
        req_id=req_id,
        receiver_host=host,
        receiver_init_port=_port(raw, "receiver_init_port"),
        receiver_alloc_port=_port(raw, "receiver_alloc_port"),
    )
