"""The vLLM v1 door, split by job: request policy, per-request state, the scheduler-to-worker
channel, the scheduler side and the worker side. `vllm_v1_adapter.LMCacheConnectorV1Impl` is
the thin front vLLM's own `LMCacheConnectorV1` shell builds."""
