"""The Mooncake Store client's settings: the `mooncake_*` config fields, or upstream's JSON file.

Upstream LMCache reads the client's settings from the JSON file `MOONCAKE_CONFIG_PATH` names;
a deployment that has one keeps working here: when the variable is set, the file's keys win
over the fields (one log line says so). The master is always the `remote_url`'s host:port; a
file naming another `master_server_address` is refused, so no instance silently joins a
different pool than its URL says.
"""

from __future__ import annotations

import json
import os
import re
import socket
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional, Tuple

from lmcache.experimental.config import MOONCAKE_PROTOCOLS, LMCacheEngineConfig
from lmcache.logging import init_logger

logger = init_logger(__name__)

CONFIG_PATH_ENV = "MOONCAKE_CONFIG_PATH"
# Upstream's JSON keys -> our settings (`device_name` is the RDMA device list).
_FILE_KEYS = {
    "local_hostname": "local_hostname",
    "metadata_server": "metadata_server",
    "protocol": "protocol",
    "device_name": "device_name",
    "global_segment_size": "global_segment_size",
    "local_buffer_size": "local_buffer_size",
}
# The other keys of Mooncake's own `MooncakeConfig` file: accepted, not used (no SSD tier, no
# client HTTP server here; the master is the URL's, checked against `master_server_address`).
_IGNORED_FILE_KEYS = ("master_server_address", "enable_ssd_offload", "ssd_offload_path", "tenant_id",
                      "enable_client_http_server", "client_http_port")
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*", re.IGNORECASE)


@dataclass(frozen=True)
class MooncakeSettings:
    """What `MooncakeDistributedStore.setup` needs besides the master's address."""

    local_hostname: Optional[str] = None  # None: the address this machine uses towards the master
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    device_name: str = ""
    global_segment_size: int = 3355443200
    local_buffer_size: int = 1 << 30

    @staticmethod
    def from_config(config: LMCacheEngineConfig) -> "MooncakeSettings":
        """The `mooncake_*` fields of `config`."""
        return MooncakeSettings(
            local_hostname=config.mooncake_local_hostname,
            metadata_server=config.mooncake_metadata_server,
            protocol=config.mooncake_protocol,
            device_name=config.mooncake_device_name,
            global_segment_size=config.mooncake_global_segment_size,
            local_buffer_size=config.mooncake_local_buffer_size,
        )

    def with_config_file(self, master: Tuple[str, int], environ: Optional[Mapping[str, str]] = None) -> "MooncakeSettings":
        """These settings with `MOONCAKE_CONFIG_PATH`'s keys applied, when the variable is set."""
        env = os.environ if environ is None else environ
        path = env.get(CONFIG_PATH_ENV, "").strip()
        if not path:
            return self
        try:
            with open(path, encoding="utf-8") as handle:
                loaded = json.load(handle)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{CONFIG_PATH_ENV}={path!r}: cannot be read as JSON: {exc}") from exc
        if not isinstance(loaded, dict):
            raise ValueError(f"{CONFIG_PATH_ENV}={path!r}: expected a JSON object, got {type(loaded).__name__}")
        changes = {}
        for key, value in loaded.items():
            if key in _FILE_KEYS:
                changes[_FILE_KEYS[key]] = _file_value(path, key, value)
            elif key not in _IGNORED_FILE_KEYS:
                raise ValueError(f"{CONFIG_PATH_ENV}={path!r}: unknown key {key!r} (known: {sorted(_FILE_KEYS)})")
        named = loaded.get("master_server_address")
        if named is not None and _host_port(str(named)) != master:
            raise ValueError(
                f"{CONFIG_PATH_ENV}={path!r}: master_server_address={named!r} is not remote_url's master "
                f"{master[0]}:{master[1]}; set them to the same master"
            )
        settings = replace(self, **changes)
        if settings.protocol not in MOONCAKE_PROTOCOLS:
            raise ValueError(f"{CONFIG_PATH_ENV}={path!r}: protocol={settings.protocol!r}, expected one of {MOONCAKE_PROTOCOLS}")
        logger.info("Mooncake client settings from %s=%s (they win over the mooncake_* fields)", CONFIG_PATH_ENV, path)
        return settings

    def hostname_towards(self, master: Tuple[str, int]) -> str:
        """`local_hostname`, or the local address of the route to the master (no packet sent):
        127.0.0.1 for a master on loopback, the LAN address for one on another machine."""
        if self.local_hostname:
            return self.local_hostname
        host, port = master
        found = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
        # IPv4 first where the name has both (`localhost`): what Mooncake's own examples use.
        family, _, _, _, address = min(found, key=lambda info: info[0] != socket.AF_INET)
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)
            return probe.getsockname()[0]


def _file_value(path: str, key: str, value: Any) -> Any:
    """One value of the JSON file, as the setting's type; errors name the file and the key."""
    if key.endswith("_size"):
        size = _parse_size(value)
        if size is None or size < 0 or (key == "local_buffer_size" and size == 0):
            raise ValueError(f"{CONFIG_PATH_ENV}={path!r}: {key}={value!r} is not a size in bytes (or like '512MB')")
        return size
    if not isinstance(value, str):
        raise ValueError(f"{CONFIG_PATH_ENV}={path!r}: {key}={value!r} must be a string")
    return value.strip()


def _parse_size(value: Any) -> Optional[int]:
    """Bytes from an int or upstream's size strings (`3355443200`, `512MB`, `3.125 GiB`)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    match = _SIZE.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        return None
    return int(float(match.group(1)) * 1024 ** " kmgt".index(match.group(2).lower() or " "))


def _host_port(text: str) -> Tuple[str, int]:
    host, _, port = text.strip().rpartition(":")
    return host.strip("[]"), int(port) if port.isdigit() else -1
