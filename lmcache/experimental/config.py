"""`LMCacheEngineConfig`: the engine's settings, where they come from, and their checks.

Operations:
- `from_defaults(**fields)`: the spec defaults (remote tier `lm://localhost:65432`).
- `from_env()`: `LMCACHE_CONFIG_FILE` if set, else CPU-only defaults overlaid with
  `LMCACHE_<FIELD>` variables; unknown `LMCACHE_*` variables are warned about.
- `from_file(path)`: a YAML mapping over the CPU-only defaults.
- `from_legacy(backend=...)`: the old single-string backend names.
- Old `lmcache_vllm` keys in YAML or `LMCACHE_<KEY>` (`LEGACY_KEYS`) are mapped onto fields by
  `legacy_config.map_legacy_keys`; old serde names by `LEGACY_SERDE_ALIASES`.
- `with_overrides(mapping)`: a copy with some fields replaced (the v1 door's
  `lmcache.`-prefixed extra config, see `prefixed_overrides`).

Every value, whatever its source, goes through `__post_init__`: strings are parsed into the
field's type there and every rule is checked there, so no constructor can skip a check.
"""

import dataclasses
import difflib
import math
import os
import re
import types
import typing
import urllib.parse
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Dict, Mapping, Optional, Tuple

import yaml

from lmcache.logging import init_logger

logger = init_logger(__name__)

ENV_PREFIX = "LMCACHE_"
CONFIG_FILE_ENV = "LMCACHE_CONFIG_FILE"
EXTRA_CONFIG_PREFIX = "lmcache."

# `LMCACHE_*` variables that are ours but are not config fields (docs/configuration.md lists what
# each does; tests/test_docs_configuration.py keeps this list, the code and that page in step).
NON_FIELD_ENV_VARS: Tuple[str, ...] = (
    CONFIG_FILE_ENV,
    "LMCACHE_LOG_LEVEL",
    "LMCACHE_FORCE_SKIP_SAVE",
    "LMCACHE_USE_EXPERIMENTAL",
    "LMCACHE_TRACK_USAGE",
    "LMCACHE_BUILD_CUDA",
    # Read by the CPU kernels (csrc/cpu/transpose.h): caps the transpose ISA (base|avx2|avx512).
    "LMCACHE_CPU_ISA",
    # Secrets and TLS of the remote tier (`remote_secrets`), and the lm:// server's token.
    "LMCACHE_REMOTE_TOKEN",
    "LMCACHE_REMOTE_TLS_CA",
    "LMCACHE_SERVER_TOKEN",
    # The PD push channel's token when `pd_token_file` is not set (`lmcache/experimental/pd/auth.py`).
    "LMCACHE_PD_TOKEN",
    # The peer servers' token when `p2p_token_file` is not set (`lmcache/experimental/p2p/`).
    "LMCACHE_P2P_TOKEN",
    # The controller's token (`lmcache_controller --token`), also what a worker's command port asks for.
    "LMCACHE_CONTROLLER_TOKEN",
    # Where `lmcache server --port N` puts its node pool's socket (`lmcache/server/pool_address.py`).
    "LMCACHE_RUNTIME_DIR",
    # vLLM 0.32's switch to its built-in LMCacheMPConnector copy; we then leave its name alone.
    "LMCACHE_USE_UPSTREAM_MP",
)

# Keys of the old `lmcache_vllm` config, loaded from YAML and `LMCACHE_<KEY>` variables with a
# deprecation warning (mapped in `legacy_config.py`).
LEGACY_KEYS: Tuple[str, ...] = (
    "local_device", "max_local_cache_size", "pipelined_backend",
    # Upstream's older controller keys: `controller_pull_url` and `lmcache_worker_ports` now.
    "controller_url", "lmcache_worker_port",
)

REMOTE_SCHEMES: Tuple[str, ...] = (
    "lm", "lms", "lm+shm", "redis", "rediss", "redis-cluster", "redis-sentinel", "mooncakestore",
)
# The node pool: an `lm://` server's unix socket, named by its path (`lm+shm:///PATH`).
POOL_SCHEME = "lm+shm"
REMOTE_SERDES: Tuple[str, ...] = ("naive", "cachegen", "safetensor")
# Mooncake Store's master (`mooncakestore://HOST:PORT`, upstream's spelling); the client's own
# settings are the `mooncake_*` fields. Mooncake has no authentication: no userinfo in the URL.
MOONCAKE_SCHEME = "mooncakestore"
MOONCAKE_PROTOCOLS: Tuple[str, ...] = ("tcp", "rdma")
# Schemes whose URL lists several host:port pairs (cluster nodes, Sentinels).
MULTI_HOST_SCHEMES: Tuple[str, ...] = ("redis-cluster", "redis-sentinel")

# Legacy backends that keep chunks on disk get this much room when the caller gave none.
LEGACY_DISK_SIZE_GB = 5.0
# Old `remote_serde` names that now mean `naive`: `torch` was pickle-based (never unpickled
# here) and `fast` was its raw-bytes variant.
LEGACY_SERDE_ALIASES: Mapping[str, str] = MappingProxyType({"torch": "naive", "fast": "naive"})

_TRUE_WORDS = ("true", "1", "yes", "on")
_FALSE_WORDS = ("false", "0", "no", "off")
# How an error message lists the words `parse_bool` accepts.
BOOL_WORDS = "/".join(w for pair in zip(_TRUE_WORDS, _FALSE_WORDS) for w in pair)
_NONE_WORDS = ("", "none")


def parse_bool(value: Any) -> Optional[bool]:
    """A bool, or a word meaning one (true/1/yes/on, false/0/no/off, any case); None otherwise.

    The one reading of on/off settings: config fields, `LMCACHE_*` variables and per-request
    settings all go through it, so every switch accepts the same words."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE_WORDS:
            return True
        if word in _FALSE_WORDS:
            return False
    return None


@dataclass(frozen=True)
class RemoteUrl:
    """A parsed `remote_url`: the scheme, one (host, port) per server (several for a cluster or
    the Sentinels), for `redis-sentinel://` the master's service name when the URL names it, the
    userinfo (percent-decoded; for `lm://` the password is the token) and a Redis database number.
    `lm+shm:///PATH` has no hosts, only the unix `socket` path. The password never shows in
    `repr`."""

    scheme: str
    hosts: Tuple[Tuple[str, int], ...]
    service: Optional[str] = None
    username: Optional[str] = None
    password: Optional[str] = dataclasses.field(default=None, repr=False)
    db: Optional[int] = None
    socket: Optional[str] = None  # `lm+shm://`: the unix socket's path

    def display(self) -> str:
        """The URL for log lines and errors: `mask_url` of it (password or token as `***`)."""
        user = urllib.parse.quote(self.username or "", safe="")
        password = urllib.parse.quote(self.password or "", safe="")
        userinfo = f"{user}:{password}@" if password else (f"{user}@" if user else "")
        if self.socket is not None:
            return mask_url(f"{self.scheme}://{userinfo}{self.socket}")
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.hosts)
        tail = f"/{self.service}" if self.service else (f"/{self.db}" if self.db is not None else "")
        return mask_url(f"{self.scheme}://{userinfo}{hosts}{tail}")


MASK = "***"
# Schemes whose URL may end in `/N`, a Redis database number (a cluster has only database 0).
DB_SCHEMES: Tuple[str, ...] = ("redis", "rediss")


def mask_url(url: str) -> str:
    """`url` with the password or token of its userinfo replaced by `***`: the one spelling of a
    URL that log lines, error messages, reprs and config dumps may show. Works on URLs that do
    not parse too (everything between `://` and the last `@` before the host part is hidden,
    except a user name)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    userinfo, at, hosts = rest.rpartition("@")
    if not at:
        return url
    user, colon, _ = userinfo.partition(":")
    return f"{scheme}://{user}{':' + MASK if colon else ''}@{hosts}"


def _parse_host_port(text: str, key: str, whole: str) -> Tuple[str, int]:
    """`host:port` (IPv6 hosts in brackets) -> (host, port), or a ValueError naming `key`."""
    host, sep, port_text = text.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        bare, forbidden = host[1:-1], "[]/@?# "
    else:
        bare, forbidden = host, "[]/@?# :"
    if not sep or not bare or any(ch in bare for ch in forbidden):
        raise ValueError(f"{key}={whole!r}: expected host:port (IPv6 hosts in brackets), got {text!r}")
    return bare, _parse_port(port_text, key, whole)


def _parse_port(text: str, key: str, whole: str) -> int:
    """A port is ASCII digits in 1..65535; `str.isdigit` alone would let `²` or `５` through."""
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= 65535:
        raise ValueError(f"{key}={whole!r}: port {text!r} is not an integer in 1..65535")
    return int(text)


def parse_remote_url(url: str, key: str = "remote_url") -> RemoteUrl:
    """Parse `lm://h:p`, `lms://h:p` (TLS), `lm+shm:///PATH` (the node pool's unix socket), `redis://h:p[/db]`, `rediss://h:p[/db]`,
    `redis-cluster://h1:p1,h2:p2`, `redis-sentinel://h1:p1,h2:p2[/service]` or
    `mooncakestore://master:port`, each but the last optionally
    with `[user][:password]@` before the hosts (percent-encoded). Errors show the URL masked."""
    shown = mask_url(url)
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"{key}={shown!r}: expected scheme://host:port with scheme in {REMOTE_SCHEMES}")
    if scheme not in REMOTE_SCHEMES:
        raise ValueError(f"{key}={shown!r}: unknown scheme {scheme!r}, expected one of {REMOTE_SCHEMES}")
    if scheme == POOL_SCHEME:
        return _parse_pool_url(rest, key, shown)
    userinfo, at, rest = rest.rpartition("@")
    username, password = _split_userinfo(userinfo) if at else (None, None)
    if at and scheme == MOONCAKE_SCHEME:
        raise ValueError(f"{key}={shown!r}: Mooncake Store has no authentication, so its URL takes no user or password")
    rest = rest[:-1] if rest.endswith("/") else rest
    service = db = None
    if scheme == "redis-sentinel":
        rest, service = _split_sentinel_service(rest, key, shown)
    elif scheme in DB_SCHEMES:
        rest, db = _split_db(rest, key, shown)
    parts = rest.split(",")
    if scheme not in MULTI_HOST_SCHEMES and len(parts) != 1:
        raise ValueError(f"{key}={shown!r}: only {' and '.join(MULTI_HOST_SCHEMES)} take several host:port pairs")
    hosts = tuple(_parse_host_port(part, key, shown) for part in parts)
    return RemoteUrl(scheme, hosts, service, username, password, db)


def _parse_pool_url(rest: str, key: str, shown: str) -> RemoteUrl:
    """`/PATH` or `[:TOKEN]@/PATH` (after `lm+shm://`) -> the pool's socket path and token."""
    userinfo, at, path = rest.partition("@") if not rest.startswith("/") else ("", "", rest)
    if not path.startswith("/") or (not at and userinfo) or len(path) < 2:
        raise ValueError(f"{key}={shown!r}: expected lm+shm:///absolute/path/of/the/socket (a token as lm+shm://:TOKEN@/path)")
    username, password = _split_userinfo(userinfo) if at else (None, None)
    return RemoteUrl(POOL_SCHEME, (), username=username, password=password, socket=path)


def _split_userinfo(userinfo: str) -> Tuple[Optional[str], Optional[str]]:
    """`user:pass` / `:pass` / `user` (percent-encoded) -> (user or None, password or None)."""
    user, _, password = userinfo.partition(":")
    return urllib.parse.unquote(user) or None, urllib.parse.unquote(password) or None


def _split_db(rest: str, key: str, shown: str) -> Tuple[str, Optional[int]]:
    """`h:p/3` -> (`h:p`, 3); no `/` -> (rest, None)."""
    hosts, sep, db = rest.partition("/")
    if not sep:
        return rest, None
    if not (db.isascii() and db.isdigit()):
        raise ValueError(f"{key}={shown!r}: Redis database {db!r} must be a number")
    return hosts, int(db)


def _split_sentinel_service(rest: str, key: str, shown: str) -> Tuple[str, Optional[str]]:
    """`h1:p1,h2:p2/mymaster` -> (`h1:p1,h2:p2`, `mymaster`); no `/` -> (rest, None)."""
    hosts, sep, service = rest.partition("/")
    if not sep:
        return rest, None
    if not re.fullmatch(r"[A-Za-z0-9._-]+", service):
        raise ValueError(f"{key}={shown!r}: Sentinel service name {service!r} must be letters, digits, '.', '_' or '-'")
    return hosts, service


def _normalise_local_disk(value: str) -> str:
    """`file:///path`, `~/path` or a plain path -> an absolute path (one spelling for all tiers)."""
    path = value.strip()
    if path.startswith("file://"):
        parsed = urllib.parse.urlparse(path)
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"local_disk={value!r}: file:// URLs must name a local path, not host {parsed.netloc!r}")
        path = urllib.parse.unquote(parsed.path)
    elif "://" in path:
        raise ValueError(f"local_disk={value!r}: expected a directory path or a file:///path URL")
    if not path:
        raise ValueError(f"local_disk={value!r}: the path is empty")
    return os.path.abspath(os.path.expanduser(path))


def _unwrap_optional(hint: Any) -> Tuple[type, bool]:
    """`Optional[X]` -> (X, True); `X` -> (X, False)."""
    if typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return hint, False


def _coerce(name: str, hint: Any, value: Any) -> Any:
    """Turn `value` (a typed value, or a string from env/YAML) into the field's type, or raise."""
    base, optional = _unwrap_optional(hint)
    if optional and isinstance(value, str) and value.strip().lower() in _NONE_WORDS:
        return None
    if value is None:
        if optional:
            return None
        raise ValueError(f"{name}=None: this field needs a {base.__name__}")
    if typing.get_origin(base) is tuple:
        return _parse_int_tuple(name, value)
    if base is str:
        if not isinstance(value, str):
            raise ValueError(f"{name}={value!r}: expected a string, got {type(value).__name__}")
        return value.strip()
    if isinstance(value, str):
        return _parse_string(name, base, value)
    if base is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{name}={value!r}: expected a bool (true/false), got {type(value).__name__}")
        return value
    if base is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name}={value!r}: expected an int, got {type(value).__name__}")
        return value
    if base is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name}={value!r}: expected a number, got {type(value).__name__}")
        if not math.isfinite(value):
            raise ValueError(f"{name}={value!r}: expected a finite number")
        return float(value)
    raise TypeError(f"LMCacheEngineConfig field {name} has unsupported type {hint!r}")


def _parse_int_tuple(name: str, value: Any) -> Tuple[int, ...]:
    """A list of ints (YAML), or a string of them: `8500,8501` or `[8500, 8501]` (variables)."""
    if isinstance(value, str):
        text = value.strip()
        text = text[1:-1] if text[:1] + text[-1:] in ("[]", "()") else text
        parts = [part.strip() for part in text.split(",") if part.strip()]
        if not all(part.isascii() and part.isdigit() for part in parts):
            raise ValueError(f"{name}={value!r}: expected integers separated by commas, e.g. 8500,8501")
        return tuple(int(part) for part in parts)
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(value)
    raise ValueError(f"{name}={value!r}: expected a list of integers")


def shown_value(name: str, value: Any) -> Any:
    """`value` of field `name` as messages may show it: URLs masked, the password hidden."""
    if value is not None and any(word in name.lower() for word in ("password", "token", "secret")):
        return MASK
    return mask_url(value) if isinstance(value, str) and "://" in value else value


def parse_key_value(name: str, hint: Any, value: Any) -> Any:
    """`value` parsed as a field of type `hint` would be, errors naming `name` (for keys that are
    not fields, such as the legacy ones)."""
    return _coerce(name, hint, value)


def _parse_string(name: str, base: type, text: str) -> Any:
    """Parse an env-style string into bool/int/float (bools: `parse_bool`'s words)."""
    word = text.strip().lower()
    if base is bool:
        parsed = parse_bool(word)
        if parsed is None:
            raise ValueError(f"{name}={text!r}: expected a bool ({BOOL_WORDS})")
        return parsed
    try:
        number = int(word) if base is int else float(word)
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected {'an int' if base is int else 'a number'}") from None
    if base is float and not math.isfinite(number):
        raise ValueError(f"{name}={text!r}: expected a finite number")
    return number


def _closest_field(name: str) -> Optional[str]:
    """The field whose name is closest to `name` (difflib), or None if nothing is close."""
    matches = difflib.get_close_matches(name.lower(), field_names(), n=1, cutoff=0.5)
    return matches[0] if matches else None


def _unknown_key_error(key: Any, value: Any, source: str) -> ValueError:
    hint = _closest_field(str(key))
    did_you_mean = f" (did you mean {hint!r}?)" if hint else ""
    shown = shown_value(str(key), shown_value(hint or "", value))  # a misspelt secret too
    return ValueError(f"{source}: unknown config key {key!r} (value {shown!r}){did_you_mean}")


def _check_keys(mapping: Mapping[Any, Any], source: str) -> None:
    """Refuse a key that names no field, naming it and the nearest field."""
    known = set(field_names())
    for key, value in mapping.items():
        if not isinstance(key, str) or key not in known:
            raise _unknown_key_error(key, value, source)


def field_names() -> Tuple[str, ...]:
    """Every config field, in declaration order."""
    return tuple(f.name for f in dataclasses.fields(LMCacheEngineConfig))


def env_var_name(field_name: str) -> str:
    """`chunk_size` -> `LMCACHE_CHUNK_SIZE`."""
    return ENV_PREFIX + field_name.upper()


def prefixed_overrides(extra: Mapping[str, Any], prefix: str = EXTRA_CONFIG_PREFIX) -> Dict[str, Any]:
    """`{"lmcache.chunk_size": 128, "other": 1}` -> `{"chunk_size": 128}`: keys without the prefix
    belong to someone else (vLLM, the door) and are left out; the rest feed `with_overrides`."""
    return {key[len(prefix):]: value for key, value in extra.items() if isinstance(key, str) and key.startswith(prefix)}


# Prefill/decode disaggregation: the roles and the transports `_check_pd` accepts.
PD_ROLES: Tuple[str, ...] = ("sender", "receiver")
PD_TRANSFER_CHANNELS: Tuple[Optional[str], ...] = (None, "zmq")


def default_legacy_disk_path() -> str:
    """Where legacy disk backends keep chunks: `$XDG_CACHE_HOME/lmcache/local_disk` (or ~/.cache)."""
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache_home, "lmcache", "local_disk")


@dataclass(frozen=True)
class LMCacheEngineConfig:
    """The engine's settings. Sizes are GB (floats). Frozen: use `with_overrides` for a variant."""

    chunk_size: int
    local_cpu: bool
    max_local_cpu_size: float
    local_disk: Optional[str]
    max_local_disk_size: float
    remote_url: Optional[str]
    remote_serde: Optional[str]
    save_decode_cache: bool
    enable_blending: bool
    blend_recompute_ratio: float
    blend_min_tokens: int
    enable_p2p: bool
    lookup_url: Optional[str]
    distributed_url: Optional[str]
    error_handling: bool
    use_layerwise: bool = False
    enable_async_loading: bool = False
    save_unfull_chunk: bool = True
    priority_limit: Optional[int] = None
    enable_pd: bool = False
    blend_separator: str = "[BLEND_SEP]"
    blend_add_special_in_precomp: bool = False
    # The remote store's password (Redis) or token (lm://) for those who keep secrets out of
    # `remote_url` (`LMCACHE_REMOTE_PASSWORD`); a password in the URL wins. Never printed.
    remote_password: Optional[str] = None
    # The status API (`api_server.py`): off by default, port start + worker id, 127.0.0.1 only;
    # its state-changing endpoints answer 403 unless this token is set and sent.
    internal_api_server_enabled: bool = False
    internal_api_server_port_start: int = 6999
    internal_api_server_token: Optional[str] = None
    # Prefill/decode disaggregation (`lmcache/experimental/pd/`): checked by `_check_pd`.
    pd_role: Optional[str] = None  # sender (the prefiller) / receiver (the decoder)
    pd_buffer_size: int = 1 << 30  # bytes of the receiver's buffer for pushed KV
    pd_buffer_device: str = "cpu"
    pd_peer_host: Optional[str] = None  # where the receiver listens (the sender's peer)
    pd_peer_init_port: Optional[int] = None  # the receiver's port (plus the worker id)
    pd_peer_alloc_port: Optional[int] = None  # carried in the spec; a push's reply is its allocation
    pd_proxy_host: Optional[str] = None
    pd_proxy_port: Optional[int] = None
    transfer_channel: Optional[str] = None  # None or "zmq" (the one transport here)
    # A file holding the push channel's shared secret (wins over `LMCACHE_PD_TOKEN`); prefiller
    # and decoder need the same one (`pd/auth.py`). The token itself is never a config value.
    pd_token_file: Optional[str] = None
    # A decoder may listen beyond loopback without a token (protected mode off), as `--no-auth`.
    pd_no_auth: bool = False
    # Encrypt the push channel (ZeroMQ CURVE, keys from the token); both sides must set it.
    pd_encrypt: bool = False
    # The Mooncake Store client (`remote_url: mooncakestore://MASTER:PORT`); `MOONCAKE_CONFIG_PATH`,
    # upstream's JSON file, overrides them (`remote/mooncake_settings.py`).
    mooncake_local_hostname: Optional[str] = None  # how other clients reach this one; None: the address facing the master
    mooncake_metadata_server: str = "P2PHANDSHAKE"  # clients exchange addresses directly: no etcd
    mooncake_protocol: str = "tcp"  # or rdma (then mooncake_device_name, e.g. mlx5_0)
    mooncake_device_name: str = ""
    mooncake_global_segment_size: int = 3355443200  # bytes this instance adds to the pool; 0 = a pure client
    mooncake_local_buffer_size: int = 1 << 30  # bytes of the client's registered buffer; bounds one put
    # KV events (`holdings.py`, `integration/vllm/kv_events.py`): what the tiers admit and lose, in
    # vLLM's format, published by LMCache on the endpoint (worker N on its port + N) or, without
    # one, handed to vLLM 0.32's own publisher (`--kv-events-config`): checked by `_check_kv_events`.
    enable_kv_events: bool = False
    kv_events_endpoint: Optional[str] = None  # tcp://*:PORT binds, tcp://HOST:PORT connects, ipc://PATH
    kv_events_topic: str = ""
    # Upstream's controller (`lmcache/controller/`): each worker reports what its tiers admit and
    # lose to `controller_pull_url`, registers and heartbeats over `controller_reply_url`, and takes
    # the controller's commands (`/clear`) on its `lmcache_worker_ports` port: checked by `_check_controller`.
    enable_controller: bool = False
    lmcache_instance_id: str = "lmcache_default_instance"  # the name `/lookup` answers with
    controller_pull_url: Optional[str] = None  # HOST:PORT or tcp://HOST:PORT, kept as tcp://HOST:PORT
    controller_reply_url: Optional[str] = None
    lmcache_worker_ports: Optional[Tuple[int, ...]] = None  # worker N: the N-th port (one port: port + N)
    lmcache_worker_heartbeat_time: float = 5.0  # seconds; the controller drops a worker silent for 3 of them
    # Peer-to-peer sharing (`enable_p2p`, `lmcache/experimental/p2p/`): a file holding the peer
    # servers' shared secret (wins over `LMCACHE_P2P_TOKEN`); every instance needs the same one.
    p2p_token_file: Optional[str] = None
    # A peer server may listen beyond loopback without a token (protected mode off), as `--no-auth`.
    p2p_no_auth: bool = False
    # TLS between peers: the peer server's PEM certificate chain and key (both or neither; every
    # instance alike, since a reader with them set dials its peers over TLS), and the CA file
    # readers check peers' certificates against (else `LMCACHE_REMOTE_TLS_CA`, else the system's).
    p2p_tls_cert_file: Optional[str] = None
    p2p_tls_key_file: Optional[str] = None
    p2p_tls_ca_file: Optional[str] = None

    def shown_fields(self) -> Dict[str, Any]:
        """Every field as logs, dumps and the status API may show it (`shown_value`)."""
        return {f.name: shown_value(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)}

    def __repr__(self) -> str:
        """The fields, URLs masked and secrets hidden (config dumps)."""
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.shown_fields().items())})"

    def __post_init__(self) -> None:
        """The one place values are parsed and checked; errors name the key and the value."""
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _coerce(f.name, hints[f.name], getattr(self, f.name)))
        if self.local_disk is not None:
            object.__setattr__(self, "local_disk", _normalise_local_disk(self.local_disk))
        if self.remote_serde in LEGACY_SERDE_ALIASES:
            object.__setattr__(self, "remote_serde", _legacy_serde(self.remote_serde))

        if self.chunk_size <= 0:
            raise ValueError(f"chunk_size={self.chunk_size!r}: must be a positive int")
        for name in ("max_local_cpu_size", "max_local_disk_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: a size in GB cannot be negative")
        if self.local_disk is not None and self.max_local_disk_size <= 0:
            raise ValueError(
                f"max_local_disk_size={self.max_local_disk_size!r}: local_disk={self.local_disk!r} is set, "
                "so the disk tier needs a size above 0 GB"
            )
        if self.remote_url is not None:
            parse_remote_url(self.remote_url)
            if self.remote_serde is None:
                raise ValueError(f"remote_serde=None: remote_url is set, so pick one of {REMOTE_SERDES}")
        if self.remote_serde is not None and self.remote_serde not in REMOTE_SERDES:
            raise ValueError(f"remote_serde={self.remote_serde!r}: expected one of {REMOTE_SERDES}")
        if not 0.0 <= self.blend_recompute_ratio <= 1.0:
            raise ValueError(f"blend_recompute_ratio={self.blend_recompute_ratio!r}: must be within [0, 1]")
        if self.blend_min_tokens < 0:
            raise ValueError(f"blend_min_tokens={self.blend_min_tokens!r}: cannot be negative")
        if self.enable_blending and not self.use_layerwise:
            raise ValueError("enable_blending=True needs use_layerwise=True (CacheBlend runs layer by layer)")
        if self.enable_blending and not self.blend_separator:
            raise ValueError("blend_separator='': enable_blending=True needs a non-empty separator")
        self._check_p2p()
        if not 0 < self.internal_api_server_port_start <= 65535:
            raise ValueError(
                f"internal_api_server_port_start={self.internal_api_server_port_start!r}: must be in 1..65535"
            )
        if self.internal_api_server_token is not None and len(self.internal_api_server_token) < 8:
            raise ValueError("internal_api_server_token: must be at least 8 characters (value not shown)")
        self._check_pd()
        self._check_mooncake()
        self._check_kv_events()
        self._check_controller()

    def _check_p2p(self) -> None:
        """`lookup_url`: a Redis as host:port or a redis:// / rediss:// URL; `distributed_url`: the
        host:port this instance serves on (a concrete address: peers dial what it says)."""
        if self.lookup_url is not None:
            if "://" in self.lookup_url:
                parsed = parse_remote_url(self.lookup_url, "lookup_url")
                if parsed.scheme not in DB_SCHEMES:
                    raise ValueError(f"lookup_url={mask_url(self.lookup_url)!r}: expected host:port or "
                                     f"a single Redis as one of {[s + '://' for s in DB_SCHEMES]}")
            else:
                _parse_host_port(self.lookup_url, "lookup_url", self.lookup_url)
        if self.distributed_url is not None:
            host, _ = _parse_host_port(self.distributed_url, "distributed_url", self.distributed_url)
            if host in ("0.0.0.0", "::", "*"):
                raise ValueError(f"distributed_url={self.distributed_url!r}: peers dial this address, so "
                                 "name this machine's own address, not a wildcard")
        if self.enable_p2p:
            for name in ("lookup_url", "distributed_url"):
                if getattr(self, name) is None:
                    raise ValueError(f"{name}=None: enable_p2p=True needs {name} as host:port")
        if (self.p2p_tls_cert_file is None) != (self.p2p_tls_key_file is None):
            raise ValueError(f"p2p_tls_cert_file={self.p2p_tls_cert_file!r}, p2p_tls_key_file={self.p2p_tls_key_file!r}: "
                             "TLS between peers needs both the certificate and its key")
        if self.p2p_tls_ca_file is not None and self.p2p_tls_cert_file is None:
            raise ValueError(f"p2p_tls_ca_file={self.p2p_tls_ca_file!r} without p2p_tls_cert_file/p2p_tls_key_file: "
                             "peers speak TLS only when every instance serves it")

    def _check_controller(self) -> None:
        """The controller keys: URLs as tcp://HOST:PORT, ports in range, a positive heartbeat
        period; both URLs needed when `enable_controller`."""
        for name in ("controller_pull_url", "controller_reply_url"):
            value = getattr(self, name)
            if value is not None:
                rest = value[len("tcp://"):] if value.startswith("tcp://") else value
                if "://" in rest:
                    raise ValueError(f"{name}={value!r}: expected HOST:PORT or tcp://HOST:PORT")
                host, port = _parse_host_port(rest, name, value)
                object.__setattr__(self, name, f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}")
            elif self.enable_controller:
                raise ValueError(f"{name}=None: enable_controller=True needs the controller's {name} as HOST:PORT")
        for port in self.lmcache_worker_ports or ():
            if not 0 < port <= 65535:
                raise ValueError(f"lmcache_worker_ports={list(self.lmcache_worker_ports or ())!r}: port {port} is not in 1..65535")
        if not self.lmcache_worker_heartbeat_time > 0:
            raise ValueError(f"lmcache_worker_heartbeat_time={self.lmcache_worker_heartbeat_time!r}: seconds, above 0 "
                             "(the controller drops a worker that stops heartbeating)")
        if not re.fullmatch(r"[A-Za-z0-9._:-]{1,128}", self.lmcache_instance_id):
            raise ValueError(f"lmcache_instance_id={self.lmcache_instance_id!r}: 1 to 128 letters, digits, '.', '_', ':' or '-'")

    def _check_kv_events(self) -> None:
        """`kv_events_endpoint`: a ZeroMQ tcp endpoint with a port, or ipc (vLLM 0.9.2, which has no
        connector events, needs one: `kv_events.connector_kv_events` says so at engine start)."""
        endpoint = self.kv_events_endpoint
        if endpoint is not None:
            scheme, sep, rest = endpoint.partition("://")
            if not sep or scheme not in ("tcp", "ipc") or not rest:
                raise ValueError(f"kv_events_endpoint={endpoint!r}: expected tcp://*:PORT, tcp://HOST:PORT or ipc://PATH")
            if scheme == "tcp":
                _parse_host_port(rest, "kv_events_endpoint", endpoint)

    def _check_mooncake(self) -> None:
        """The `mooncake_*` keys, checked whatever the remote URL (a typo waits for no one)."""
        if self.mooncake_protocol not in MOONCAKE_PROTOCOLS:
            raise ValueError(f"mooncake_protocol={self.mooncake_protocol!r}: expected one of {MOONCAKE_PROTOCOLS}")
        if not self.mooncake_metadata_server:
            raise ValueError("mooncake_metadata_server='': expected P2PHANDSHAKE or an etcd/http metadata address")
        if self.mooncake_global_segment_size < 0:
            raise ValueError(f"mooncake_global_segment_size={self.mooncake_global_segment_size!r}: "
                             "bytes, 0 for a pure client, never negative")
        if self.mooncake_local_buffer_size <= 0:
            raise ValueError(f"mooncake_local_buffer_size={self.mooncake_local_buffer_size!r}: must be a positive number of bytes")

    def _check_pd(self) -> None:
        """The `pd_*` keys: ports in range always, roles and the peer only when `enable_pd`."""
        for name in ("pd_peer_init_port", "pd_peer_alloc_port", "pd_proxy_port"):
            port = getattr(self, name)
            if port is not None and not 0 < port <= 65535:
                raise ValueError(f"{name}={port!r}: must be in 1..65535")
        if self.pd_buffer_size <= 0:
            raise ValueError(f"pd_buffer_size={self.pd_buffer_size!r}: must be a positive number of bytes")
        if self.pd_buffer_device != "cpu":
            raise ValueError(f"pd_buffer_device={self.pd_buffer_device!r}: only 'cpu' is supported (no GPU here)")
        if self.transfer_channel not in PD_TRANSFER_CHANNELS:
            raise ValueError(
                f"transfer_channel={self.transfer_channel!r}: expected one of {PD_TRANSFER_CHANNELS} "
                "(KV moves over ZeroMQ; NIXL and Mooncake do not run on these CPU machines)"
            )
        if self.pd_role is not None and self.pd_role not in PD_ROLES:
            raise ValueError(f"pd_role={self.pd_role!r}: expected one of {PD_ROLES}")
        if not self.enable_pd:
            return
        if self.pd_role is None:
            raise ValueError(f"pd_role=None: enable_pd=True needs pd_role, one of {PD_ROLES}")
        for name in ("pd_peer_host", "pd_peer_init_port"):
            if getattr(self, name) is None:
                raise ValueError(f"{name}=None: enable_pd=True needs the receiver's {name}")
        if self.pd_role == "sender" and self.use_layerwise:
            raise ValueError("use_layerwise=True: a PD sender (pd_role: sender) pushes whole chunks after "
                             "each step's store; set use_layerwise=False on the prefiller")

    # ----- constructors -------------------------------------------------------------------

    @staticmethod
    def from_defaults(
        chunk_size: int = 256,
        local_cpu: bool = True,
        max_local_cpu_size: float = 5.0,
        local_disk: Optional[str] = None,
        max_local_disk_size: float = 0,
        remote_url: Optional[str] = "lm://localhost:65432",
        remote_serde: Optional[str] = "naive",
        save_decode_cache: bool = False,
        enable_blending: bool = False,
        blend_recompute_ratio: float = 0.15,
        blend_min_tokens: int = 256,
        enable_p2p: bool = False,
        lookup_url: Optional[str] = None,
        distributed_url: Optional[str] = None,
        error_handling: bool = False,
        use_layerwise: bool = False,
        enable_async_loading: bool = False,
        save_unfull_chunk: bool = True,
        priority_limit: Optional[int] = None,
        enable_pd: bool = False,
        blend_separator: str = "[BLEND_SEP]",
        blend_add_special_in_precomp: bool = False,
        remote_password: Optional[str] = None,
        internal_api_server_enabled: bool = False,
        internal_api_server_port_start: int = 6999,
        internal_api_server_token: Optional[str] = None,
        pd_role: Optional[str] = None,
        pd_buffer_size: int = 1 << 30,
        pd_buffer_device: str = "cpu",
        pd_peer_host: Optional[str] = None,
        pd_peer_init_port: Optional[int] = None,
        pd_peer_alloc_port: Optional[int] = None,
        pd_proxy_host: Optional[str] = None,
        pd_proxy_port: Optional[int] = None,
        transfer_channel: Optional[str] = None,
        pd_token_file: Optional[str] = None,
        pd_no_auth: bool = False,
        pd_encrypt: bool = False,
        mooncake_local_hostname: Optional[str] = None,
        mooncake_metadata_server: str = "P2PHANDSHAKE",
        mooncake_protocol: str = "tcp",
        mooncake_device_name: str = "",
        mooncake_global_segment_size: int = 3355443200,
        mooncake_local_buffer_size: int = 1 << 30,
        enable_kv_events: bool = False,
        kv_events_endpoint: Optional[str] = None,
        kv_events_topic: str = "",
        enable_controller: bool = False,
        lmcache_instance_id: str = "lmcache_default_instance",
        controller_pull_url: Optional[str] = None,
        controller_reply_url: Optional[str] = None,
        lmcache_worker_ports: Optional[Tuple[int, ...]] = None,
        lmcache_worker_heartbeat_time: float = 5.0,
        p2p_token_file: Optional[str] = None,
        p2p_no_auth: bool = False,
        p2p_tls_cert_file: Optional[str] = None,
        p2p_tls_key_file: Optional[str] = None,
        p2p_tls_ca_file: Optional[str] = None,
        **unknown: Any,
    ) -> "LMCacheEngineConfig":
        """The spec's defaults with some fields replaced; an unknown keyword is a ValueError."""
        if unknown:
            key, value = next(iter(unknown.items()))
            raise _unknown_key_error(key, value, "from_defaults")
        values = dict(locals())
        del values["unknown"]
        return LMCacheEngineConfig(**values)

    @staticmethod
    def cpu_only_defaults() -> "LMCacheEngineConfig":
        """The base of `from_env`/`from_file`: the spec defaults without the remote tier."""
        return LMCacheEngineConfig.from_defaults(remote_url=None, local_disk=None)

    @staticmethod
    def from_env(environ: Optional[Mapping[str, str]] = None) -> "LMCacheEngineConfig":
        """`LMCACHE_CONFIG_FILE` if set; else CPU-only defaults overlaid with `LMCACHE_<FIELD>`
        (and the legacy `LMCACHE_<KEY>` variables, see `legacy_config`).

        `environ` defaults to `os.environ` (tests pass a dict)."""
        from lmcache.experimental.legacy_config import map_legacy_keys

        env = os.environ if environ is None else environ
        _warn_unknown_env_vars(env)
        field_vars = {name: env[env_var_name(name)] for name in (*field_names(), *LEGACY_KEYS)
                      if env_var_name(name) in env}
        config_file = env.get(CONFIG_FILE_ENV, "").strip()
        if config_file:
            if field_vars:
                ignored = ", ".join(env_var_name(name) for name in field_vars)
                logger.warning("%s=%s is set, so the file wins and these are ignored: %s",
                               CONFIG_FILE_ENV, config_file, ignored)
            return LMCacheEngineConfig.from_file(config_file)
        try:
            overrides = map_legacy_keys(field_vars, source="environment")
            return LMCacheEngineConfig.cpu_only_defaults().with_overrides(overrides, source="environment")
        except ValueError as exc:
            # Name the variables as the user typed them, not only the parsed values.
            culprits = [f"{env_var_name(name)}={shown_value(name, raw)!r}" for name, raw in field_vars.items()
                        if re.search(rf"\b{name}\b", str(exc))]
            raise ValueError(f"{exc} (set by {', '.join(culprits)})" if culprits else str(exc)) from exc

    @staticmethod
    def from_file(file_path: str) -> "LMCacheEngineConfig":
        """A YAML mapping `{field: value}` over the CPU-only defaults (legacy keys mapped, see
        `legacy_config`)."""
        from lmcache.experimental.legacy_config import map_legacy_keys

        try:
            with open(file_path, encoding="utf-8") as handle:
                loaded = yaml.safe_load(handle)
        except OSError as exc:
            raise ValueError(f"config file {file_path!r} cannot be read: {exc}") from exc
        except yaml.YAMLError as exc:
            raise ValueError(f"config file {file_path!r} is not valid YAML: {exc}") from exc
        if not isinstance(loaded, dict):
            raise ValueError(
                f"config file {file_path!r} must hold a YAML mapping of config fields, "
                f"got {type(loaded).__name__}"
            )
        source = f"config file {file_path!r}"
        return LMCacheEngineConfig.cpu_only_defaults().with_overrides(map_legacy_keys(loaded, source), source=source)

    @staticmethod
    def from_legacy(
        chunk_size: int = 256,
        backend: str = "cpu",
        remote_url: Optional[str] = "lm://localhost:65432",
        remote_serde: str = "naive",
        save_decode_cache: bool = False,
        enable_blending: bool = False,
        blend_recompute_ratio: float = 0.15,
        blend_min_tokens: int = 256,
        max_local_disk_size: float = 0.0,
        enable_p2p: bool = False,
        lookup_url: Optional[str] = None,
        distributed_url: Optional[str] = None,
        error_handling: bool = False,
    ) -> "LMCacheEngineConfig":
        """Map an old backend name onto tiers (see `legacy_tiers`); other arguments pass through."""
        local_cpu, use_disk, use_remote, url = legacy_tiers(backend, remote_url)
        return LMCacheEngineConfig.from_defaults(
            chunk_size=chunk_size,
            local_cpu=local_cpu,
            local_disk=default_legacy_disk_path() if use_disk else None,
            max_local_disk_size=(max_local_disk_size or LEGACY_DISK_SIZE_GB) if use_disk else max_local_disk_size,
            remote_url=url if use_remote else None,
            remote_serde=remote_serde,
            save_decode_cache=save_decode_cache,
            enable_blending=enable_blending,
            blend_recompute_ratio=blend_recompute_ratio,
            blend_min_tokens=blend_min_tokens,
            enable_p2p=enable_p2p,
            lookup_url=lookup_url,
            distributed_url=distributed_url,
            error_handling=error_handling,
            use_layerwise=enable_blending,  # the legacy wrapper's blending had no separate switch
        )

    # ----- variants -------------------------------------------------------------------------

    def with_overrides(self, overrides: Mapping[str, Any], source: str = "override") -> "LMCacheEngineConfig":
        """A copy with `{field: value}` applied, checked like any other config; `source` names
        where the values came from in error messages."""
        _check_keys(overrides, source)
        try:
            return dataclasses.replace(self, **dict(overrides))
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from exc

    def remote_address(self) -> Optional[RemoteUrl]:
        """The parsed `remote_url`, or None without a remote tier."""
        return None if self.remote_url is None else parse_remote_url(self.remote_url)


# Legacy backend name -> (local_cpu, local disk, remote). Names follow the old LMCache backends.
_LEGACY_BACKENDS: Mapping[str, Tuple[bool, bool, bool]] = types.MappingProxyType({
    "cpu": (True, False, False),
    "local_cpu": (True, False, False),
    "local_disk": (False, True, False),
    "disk": (False, True, False),
    "local_cpu_disk": (True, True, False),
    "remote": (False, False, True),
    "local_cpu_remote": (True, False, True),
    "local_disk_remote": (False, True, True),
    "local_cpu_disk_remote": (True, True, True),
})


def legacy_tiers(backend: str, remote_url: Optional[str]) -> Tuple[bool, bool, bool, Optional[str]]:
    """(local_cpu, local_disk, remote, remote_url) for an old backend name.

    A backend that is itself a URL (`lm://h:p`, `redis://h:p`, ...) means the remote tier at
    that URL, like `remote`. Unknown names are a ValueError listing the accepted ones."""
    if "://" in backend:
        parse_remote_url(backend, key="backend")
        return False, False, True, backend
    if backend not in _LEGACY_BACKENDS:
        raise ValueError(f"backend={backend!r}: unknown legacy backend, expected one of "
                         f"{sorted(_LEGACY_BACKENDS)} or a remote URL")
    local_cpu, use_disk, use_remote = _LEGACY_BACKENDS[backend]
    if use_remote and not remote_url:
        raise ValueError(f"remote_url={remote_url!r}: backend={backend!r} needs a remote URL")
    return local_cpu, use_disk, use_remote, remote_url


def _legacy_serde(name: str) -> str:
    """The serde an old `remote_serde` name means now (see `LEGACY_SERDE_ALIASES`), with a warning."""
    logger.warning(
        "remote_serde=%r is deprecated (the old torch serde pickled chunks, and LMCache never "
        "unpickles): using remote_serde: %s", name, LEGACY_SERDE_ALIASES[name],
    )
    return LEGACY_SERDE_ALIASES[name]


def _warn_unknown_env_vars(env: Mapping[str, str]) -> None:
    """Warn about `LMCACHE_*` variables that are neither a field nor one of ours (likely typos)."""
    known = set(NON_FIELD_ENV_VARS) | {env_var_name(name) for name in (*field_names(), *LEGACY_KEYS)}
    for var in sorted(v for v in env if v.startswith(ENV_PREFIX) and v not in known):
        hint = _closest_field(var[len(ENV_PREFIX):])
        if hint:
            logger.warning("%s is not an LMCache setting; closest field is %s (%s)",
                           var, hint, env_var_name(hint))
        else:
            logger.warning("%s is not an LMCache setting and resembles no config field", var)

