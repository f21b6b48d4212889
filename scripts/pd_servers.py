"""Start a PD deployment on this machine as a user would: a decoder and a prefiller, each an
`lmcache_vllm serve` process configured through `LMCACHE_*` variables, and the proxy.

Used by `tests/test_pd_e2e.py` and `scripts/bench/bench_pd.py`. Every process binds 127.0.0.1 and is
started in its own session, so `stop` ends it with all its children.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_USE_V1": "1",
}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    name: str
    port: int
    log: Path
    proc: subprocess.Popen

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_healthy(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"{self.name} not healthy within {timeout} s:\n{self.log_text()[-4000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _start(name: str, cmd: Sequence[str], env: Mapping[str, str], log: Path, port: int) -> Server:
    with open(log, "w") as out:
        proc = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                cwd=str(ROOT), start_new_session=True)
    return Server(name, port, log, proc)


def start_vllm(name: str, model: str, kv_role: str, lmcache_env: Mapping[str, str], log: Path,
               extra_args: Sequence[str] = (), own_cli: bool = False, max_model_len: int = 4096) -> Server:
    """`lmcache_vllm serve MODEL --kv-transfer-config {LMCacheConnectorV1, kv_role}` (or, with
    `own_cli`, vLLM's own OpenAI server module with the same flags); float32, vLLM's own prefix
    cache off so every reuse is LMCache's."""
    port = free_port()
    if own_cli:
        head = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    else:
        head = [str(Path(sys.executable).parent / "lmcache_vllm"), "serve", model]
    kv_config = json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_role": kv_role})
    cmd = [*head, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--max-model-len", str(max_model_len), "--seed", "0", "--no-enable-prefix-caching",
           "--kv-transfer-config", kv_config, *extra_args]
    return _start(name, cmd, {**VLLM_ENV, **lmcache_env}, log, port)


def pd_env(role: str, init_port: int, buffer_bytes: int = 256 << 20, **extra: str) -> dict[str, str]:
    """The `LMCACHE_*` variables of a PD sender or receiver."""
    return {
        "LMCACHE_ENABLE_PD": "True",
        "LMCACHE_PD_ROLE": role,
        "LMCACHE_PD_PEER_HOST": "127.0.0.1",
        "LMCACHE_PD_PEER_INIT_PORT": str(init_port),
        "LMCACHE_PD_BUFFER_SIZE": str(buffer_bytes),
        **extra,
    }


def start_proxy(prefillers: Sequence[Server], decoders: Sequence[tuple[Server, int]], log: Path,
                extra_args: Sequence[str] = (), prefiller_ports: Optional[Sequence[int]] = None) -> Server:
    """The proxy over these instances (a decoder comes with its receiver's init port)."""
    port = free_port()
    cmd = [sys.executable, "-m", "lmcache.integration.vllm.disagg_proxy", "--port", str(port)]
    for p in prefiller_ports if prefiller_ports is not None else [s.port for s in prefillers]:
        cmd += ["--prefiller-host", "127.0.0.1", "--prefiller-port", str(p)]
    for server, init_port in decoders:
        cmd += ["--decoder-host", "127.0.0.1", "--decoder-port", str(server.port),
                "--decoder-init-port", str(init_port)]
    return _start("proxy", [*cmd, *extra_args], {}, log, port)


def post(url: str, body: dict, timeout: float = 300) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")
