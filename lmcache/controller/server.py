"""The controller process: its settings, the parts it is made of, and how it starts and stops.

`Controller(settings).start()` binds the HTTP API (`http_api.py`) on `host:port` and the workers'
pull and reply sockets (`receiver.py`) on the same host, all on daemon threads; `close()` stops
them. The host is 127.0.0.1 unless told otherwise: the pull and reply sockets take whatever a
sender says about its holdings, so only hosts that run workers should reach them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lmcache.controller.commands import CommandSender
from lmcache.controller.http_api import ControllerAPI
from lmcache.controller.index import DEFAULT_MISSED_HEARTBEATS, ControllerIndex
from lmcache.controller.receiver import Receiver
from lmcache.logging import init_logger

logger = init_logger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 9000
# Upstream's example ports for the workers' sockets (`--monitor-ports '{"pull": 8300, "reply": 8400}'`).
DEFAULT_PULL_PORT = 8300
DEFAULT_REPLY_PORT = 8400


@dataclass(frozen=True)
class ControllerSettings:
    host: str = DEFAULT_HOST  # where the HTTP API and the workers' sockets listen
    port: int = DEFAULT_PORT  # the HTTP API (0: any free port)
    pull_port: int = DEFAULT_PULL_PORT  # workers' `controller_pull_url`
    reply_port: int = DEFAULT_REPLY_PORT  # workers' `controller_reply_url`
    token: Optional[str] = None  # needed by state-changing calls and sent with commands; None refuses them
    missed_heartbeats: int = DEFAULT_MISSED_HEARTBEATS  # periods of silence before a worker is dropped


class Controller:
    """The index of what every worker holds, fed by the receiver and asked through the API."""

    def __init__(self, settings: ControllerSettings) -> None:
        self.settings = settings
        self.index = ControllerIndex(settings.missed_heartbeats)
        self._commands = CommandSender(self.index, settings.token)
        self.api = ControllerAPI(self.index, self._commands.send, settings.token)
        self._receiver: Optional[Receiver] = None
        self.http_address: Optional[tuple] = None

    def start(self) -> "Controller":
        s = self.settings
        self._receiver = Receiver(self.index, s.host, s.pull_port, s.reply_port).start()
        try:
            self.http_address = self.api.serve(s.host, s.port)
        except OSError:
            self._receiver.close()
            raise
        pull, reply = self._receiver.ports
        logger.info("LMCache controller: HTTP on %s:%d, workers' pull on %d and reply on %d%s",
                    s.host, self.http_address[1], pull, reply,
                    "" if s.token else " (no token: /clear, /pin and /unpin are refused)")
        return self

    @property
    def worker_ports(self) -> tuple:
        """(pull, reply) as bound."""
        assert self._receiver is not None, "not started"
        return self._receiver.ports

    def close(self) -> None:
        self.api.close()
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None
