"""One log format for every lmcache logger.

`init_logger(__name__)` is the only entry point. The first call for a package tree
(`lmcache`, `lmcache_vllm`) attaches one stream handler to that tree's top logger and
sets its level from `LMCACHE_LOG_LEVEL` (default INFO); later calls reuse it, so
importing many modules never stacks handlers.

The top logger does not propagate to the root logger: vLLM and user programs
configure the root logger in their own ways and lines would otherwise print twice.
A test that wants to capture lmcache records attaches its handler to
`logging.getLogger("lmcache")` directly.
"""

from __future__ import annotations

import logging
import os
import sys

LOG_LEVEL_ENV = "LMCACHE_LOG_LEVEL"
DEFAULT_LEVEL = logging.INFO
LOG_FORMAT = "[%(asctime)s] LMCache %(levelname)s: %(message)s (%(filename)s:%(lineno)d:%(name)s)"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"

# Marker attribute set on the handler we install, so a second call can find it.
_HANDLER_MARK = "_lmcache_handler"

_LEVEL_NAMES = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")


def _level_from_env() -> tuple[int, str | None]:
    """Return (level, bad value or None) from `LMCACHE_LOG_LEVEL`."""
    raw = os.environ.get(LOG_LEVEL_ENV)
    if raw is None or raw.strip() == "":
        return DEFAULT_LEVEL, None
    name = raw.strip().upper()
    if name == "WARN":
        name = "WARNING"
    if name in _LEVEL_NAMES:
        return getattr(logging, name), None
    return DEFAULT_LEVEL, raw


def _configure_tree(top: logging.Logger) -> None:
    """Attach our handler to the top logger of a tree, once."""
    if any(getattr(h, _HANDLER_MARK, False) for h in top.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT, datefmt=DATE_FORMAT))
    setattr(handler, _HANDLER_MARK, True)
    level, bad = _level_from_env()
    top.setLevel(level)
    top.addHandler(handler)
    top.propagate = False
    if bad is not None:
        top.warning(
            "%s=%r is not a log level (one of %s); using INFO",
            LOG_LEVEL_ENV,
            bad,
            ", ".join(_LEVEL_NAMES),
        )


def init_logger(name: str) -> logging.Logger:
    """Return the logger `name`, making sure its package tree has the lmcache handler.

    Names outside a package (no dot, e.g. a script's `__main__`) are placed under
    `lmcache` so they share the format and level.
    """
    if not name:
        raise ValueError("init_logger needs a non-empty logger name")
    top_name = name.split(".", 1)[0]
    if top_name not in ("lmcache", "lmcache_vllm"):
        name = f"lmcache.{name}"
        top_name = "lmcache"
    _configure_tree(logging.getLogger(top_name))
    return logging.getLogger(name)
