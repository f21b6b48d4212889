"""The old `lmcache_vllm` config keys, mapped onto today's fields with a deprecation warning.

Old configs (the YAML behind `LMCACHE_CONFIG_FILE`, or `LMCACHE_<KEY>` variables) name one local
tier by device and size; today's fields name each tier. `map_legacy_keys(mapping, source)`
returns the mapping with the old keys replaced, logging one line per old key that names the
new one:

    local_device: cpu           -> local_cpu: true
    local_device: cuda          -> local_cpu: true (there is no GPU tier here)
    local_device: file:///dir/  -> local_cpu: false, local_disk: /dir,
                                   max_local_disk_size: max_local_cache_size or 5 GB
    local_device: null          -> local_cpu: false (no local tier)
    max_local_cache_size: N     -> max_local_cpu_size: N (the disk size for a file:// device)
    pipelined_backend: bool     -> dropped: retrieval already reads the next chunk ahead
    controller_url: HOST:PORT   -> controller_pull_url: HOST:PORT (upstream's older name)
    lmcache_worker_port: N      -> lmcache_worker_ports: [N] (worker K uses N + K)

An old key given next to a field it maps to is refused (the two could disagree). The old
`remote_serde` names `torch` and `fast` are values, not keys: the config maps them itself
(`config.LEGACY_SERDE_ALIASES`), whatever the source.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

from lmcache.experimental.config import LEGACY_DISK_SIZE_GB, LEGACY_KEYS, parse_key_value
from lmcache.logging import init_logger

logger = init_logger(__name__)

_NO_DEVICE_WORDS = ("", "none", "null")


def _device(value: Any) -> Optional[str]:
    """`local_device` -> "cpu", "cuda", a `file://` URL, or None (no local tier)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"local_device={value!r}: expected cpu, cuda, file:///dir/ or null")
    text = value.strip()
    word = text.lower()
    if word in _NO_DEVICE_WORDS:
        return None
    if word == "cpu" or word == "cuda" or word.startswith("cuda:"):
        return "cuda" if word.startswith("cuda") else "cpu"
    if text.startswith("file://"):
        return text
    raise ValueError(f"local_device={value!r}: expected cpu, cuda, file:///dir/ or null")


def _local_device_fields(raw: Any, size: Optional[float], source: str) -> Dict[str, Any]:
    """The fields `local_device` (with `max_local_cache_size`, when given) stands for."""
    device = _device(raw)
    if device is None:
        logger.warning("%s: local_device=None is deprecated: use local_cpu: false (no local tier)", source)
        if size is not None:
            logger.warning("%s: max_local_cache_size=%s is ignored: local_device=None has no local tier",
                           source, size)
        return {"local_cpu": False}
    if device.startswith("file://"):
        disk_size = LEGACY_DISK_SIZE_GB if size is None else size
        logger.warning(
            "%s: local_device=%r is deprecated: use local_disk: %r with max_local_disk_size: %s "
            "(and local_cpu: false)", source, raw, device, disk_size,
        )
        return {"local_cpu": False, "local_disk": device, "max_local_disk_size": disk_size}
    if device == "cuda":
        logger.warning(
            "%s: local_device=%r is deprecated, and there is no GPU tier here: using the CPU tier "
            "(local_cpu: true) instead", source, raw,
        )
    else:
        logger.warning("%s: local_device=%r is deprecated: use local_cpu: true", source, raw)
    fields: Dict[str, Any] = {"local_cpu": True}
    if size is not None:
        fields["max_local_cpu_size"] = size
    return fields


def map_legacy_keys(mapping: Mapping[Any, Any], source: str) -> Dict[Any, Any]:
    """`mapping` with the old keys replaced by the fields they mean (see the module docstring).

    Keys that are not old keys pass through untouched (the config checks them). Errors are
    ValueErrors that start with `source` and name the old key."""
    given = {key: mapping[key] for key in LEGACY_KEYS if key in mapping}
    out = {key: value for key, value in mapping.items() if key not in given}
    if not given:
        return out
    try:
        mapped = _map(given, source)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from exc
    for key in mapped:
        if key in out:
            old = " and ".join(repr(k) for k in given if k != "pipelined_backend")
            raise ValueError(
                f"{source}: the old key {old} and the field {key!r} are both given; keep only {key!r}"
            )
    out.update(mapped)
    return out


def _map(given: Mapping[str, Any], source: str) -> Dict[str, Any]:
    """The fields that the old keys in `given` stand for."""
    if "pipelined_backend" in given:
        parse_key_value("pipelined_backend", bool, given["pipelined_backend"])
        logger.warning(
            "%s: pipelined_backend=%r is deprecated and ignored: retrieval already reads the next "
            "chunk ahead while it loads the current one", source, given["pipelined_backend"],
        )
    size = None
    if "max_local_cache_size" in given:
        size = parse_key_value("max_local_cache_size", float, given["max_local_cache_size"])
        if size < 0:
            raise ValueError(f"max_local_cache_size={given['max_local_cache_size']!r}: a size in GB cannot be negative")
    if "local_device" in given:
        mapped = _local_device_fields(given["local_device"], size, source)
    else:
        mapped = {} if size is None else {"max_local_cpu_size": size}
    for target in ("max_local_cpu_size", "max_local_disk_size"):
        if size is not None and target in mapped:
            logger.warning("%s: max_local_cache_size=%s is deprecated: use %s: %s", source, size, target, size)
    mapped.update(_controller_fields(given, source))
    return mapped


def _controller_fields(given: Mapping[str, Any], source: str) -> Dict[str, Any]:
    """Upstream's older controller keys, renamed (the values are checked as the new fields)."""
    mapped: Dict[str, Any] = {}
    if "controller_url" in given:
        logger.warning("%s: controller_url is upstream's older name: use controller_pull_url", source)
        mapped["controller_pull_url"] = given["controller_url"]
    if "lmcache_worker_port" in given:
        port = parse_key_value("lmcache_worker_port", int, given["lmcache_worker_port"])
        logger.warning("%s: lmcache_worker_port is upstream's older name: use lmcache_worker_ports: [%d]", source, port)
        mapped["lmcache_worker_ports"] = (port,)
    return mapped
