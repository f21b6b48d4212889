"""The controller's commands to workers, sent to the port each worker registered (`command_url`).

One DEALER socket per command and worker, closed when the reply comes or `COMMAND_TIMEOUT_S`
passes: commands are rare (an operator's `/clear`, `/pin`, `/unpin`), and a fresh socket never
mixes a late reply with the next command's. A worker without a command port (no
`lmcache_worker_ports`), one that does not answer, and one that answers with an error each yield
a failed `CommandResult` saying so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import msgspec
import zmq

from lmcache.controller.index import ControllerIndex
from lmcache.controller.messages import COMMAND_REPLY_DECODER, CommandMessage, encode

# How long a worker has to carry out a command and answer (clearing a big disk tier, or pinning a
# long prefix read from it, takes a while).
COMMAND_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class CommandResult:
    worker_id: int
    ok: bool
    num_chunks: int = 0
    num_tokens: int = 0
    error: str = ""


class CommandSender:
    """Sends the controller's commands to the workers `index` knows, with its token."""

    def __init__(self, index: ControllerIndex, token: Optional[str], timeout_s: float = COMMAND_TIMEOUT_S) -> None:
        self._index = index
        self._token = token
        self._timeout_ms = int(timeout_s * 1000)
        self._ctx = zmq.Context.instance()

    def send(self, instance_id: str, command: CommandMessage) -> List[CommandResult]:
        """Have every worker of `instance_id` carry out `command` (sent with this controller's
        token, whatever `command.token` says); one result per worker, by worker id."""
        frame = encode(msgspec.structs.replace(command, token=self._token))
        return [self._send(worker_id, url, frame, command.event_id)
                for worker_id, url in sorted(self._index.command_urls(instance_id).items())]

    def _send(self, worker_id: int, url: Optional[str], command: bytes, event_id: str) -> CommandResult:
        if url is None:
            return CommandResult(worker_id, False, error="it takes no commands (its config has no lmcache_worker_ports)")
        socket = self._ctx.socket(zmq.DEALER)
        try:
            socket.connect(url)
            socket.send(command)
            if not socket.poll(self._timeout_ms, zmq.POLLIN):
                return CommandResult(worker_id, False, error=f"no answer from {url} within {self._timeout_ms} ms")
            try:
                reply = COMMAND_REPLY_DECODER.decode(socket.recv())
            except msgspec.MsgspecError as err:
                return CommandResult(worker_id, False, error=f"unreadable answer from {url}: {err}")
            if reply.event_id != event_id:
                return CommandResult(worker_id, False, error=f"{url} answered event {reply.event_id!r}, not {event_id!r}")
            return CommandResult(worker_id, reply.ok, reply.num_chunks, reply.num_tokens, reply.error)
        finally:
            socket.close(linger=0)
