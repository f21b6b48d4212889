"""Where the node pool of `lmcache server --port PORT` listens, so that a vLLM instance told only
upstream's host and port (`lmcache.mp.host`, `lmcache.mp.port`) finds it without a path; and who
besides its owner may use a pool (`--socket-group`).

The socket is `<runtime dir>/pool-<PORT>.sock`. The runtime dir is `LMCACHE_RUNTIME_DIR` when set
(server and vLLM must then see the same value, e.g. a directory mounted into both containers),
else `<tmp>/lmcache-<uid>` (`tempfile.gettempdir()`, so `TMPDIR` counts too). A port names one
server per machine already, so it names its pool as well; the per-user directory keeps another
user's server from posing as ours, since only its owner can create a socket inside it.

Operations:
- `runtime_dir(environ)`: the directory (not created).
- `pool_socket_path(port, environ)`: the socket for a port.
- `socket_group_id(group)`, `share_with_group(path, group, mode)`: `--socket-group`, the group
  (name or gid) whose members may use the pool besides its owner.
- `ensure_runtime_dir(path, group)`: create it owner-only (0700), or check that an existing one
  is a directory of ours that nobody else may write; with `group` (`--socket-group`), give it to
  that group as 0750, so its members can reach the socket inside. A client of another user
  finds the directory through `LMCACHE_RUNTIME_DIR`, since its default names the client's uid.
"""

from __future__ import annotations

import grp
import os
import stat
import tempfile
from typing import Mapping, Optional

RUNTIME_DIR_ENV = "LMCACHE_RUNTIME_DIR"
# sun_path is 108 bytes on Linux, the terminating NUL included.
MAX_SOCKET_PATH = 107


def runtime_dir(environ: Optional[Mapping[str, str]] = None) -> str:
    """`LMCACHE_RUNTIME_DIR`, else `<tmp>/lmcache-<uid>`."""
    env = os.environ if environ is None else environ
    configured = env.get(RUNTIME_DIR_ENV, "").strip()
    if configured:
        if not os.path.isabs(configured):
            raise ValueError(f"{RUNTIME_DIR_ENV}={configured!r}: expected an absolute path")
        return configured
    return os.path.join(tempfile.gettempdir(), f"lmcache-{os.getuid()}")


def pool_socket_path(port: int, environ: Optional[Mapping[str, str]] = None) -> str:
    """The node pool's unix socket of the server on TCP port `port` of this machine."""
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"port={port!r}: expected an integer in 1..65535")
    path = os.path.join(runtime_dir(environ), f"pool-{port}.sock")
    if len(path.encode()) > MAX_SOCKET_PATH:
        raise ValueError(
            f"node pool socket {path!r} is longer than {MAX_SOCKET_PATH} bytes: "
            f"set {RUNTIME_DIR_ENV} to a shorter directory"
        )
    return path


def socket_group_id(group: str) -> int:
    """The gid of `--socket-group` (a group name, or a number); ValueError naming it if unknown."""
    if group.isascii() and group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ValueError(f"socket group {group!r}: no such group on this machine") from None


def share_with_group(path: str, group: str, mode: int) -> None:
    """Give `path` to `group` (name or gid) with `mode`; an OSError naming both if that is not
    allowed (a user may only give a file to a group it is in)."""
    try:
        os.chown(path, -1, socket_group_id(group))
    except PermissionError as err:
        raise OSError(err.errno, f"cannot give {path} to group {group!r}: this user is not in it") from err
    os.chmod(path, mode)


def ensure_runtime_dir(path: str, group: Optional[str] = None) -> None:
    """Create `path` owner-only, or refuse one that is not a directory of this user's, or that
    others may write (they could replace the socket with their own); with `group`, open it to
    that group for reading (0750)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise OSError(f"runtime dir {path} is not a directory (a link or a file is there)")
    if info.st_uid != os.getuid():
        raise OSError(f"runtime dir {path} belongs to uid {info.st_uid}, not to this user ({os.getuid()})")
    if info.st_mode & 0o022:
        raise OSError(f"runtime dir {path} is writable by others (mode {stat.S_IMODE(info.st_mode):o}); make it 0700")
    if group is not None:
        share_with_group(path, group, 0o750)
