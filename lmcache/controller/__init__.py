"""Upstream's controller: which instance holds which prefix, by upstream's names.

- `server.py`: the `lmcache_controller` process (settings, start, stop); `__main__.py` its flags.
- `index.py`: what each worker holds per location, kept right by sequence numbers and resyncs.
- `receiver.py`: the workers' pull and reply sockets; `commands.py`: commands to workers.
- `http_api.py`: `/lookup`, `/query_worker_info`, `/health`, `/clear`, `/check_finish`.
- `messages.py`: the typed messages on the wire (msgpack).
- `worker.py`: the instance side, one per vLLM worker (`enable_controller`).
"""
