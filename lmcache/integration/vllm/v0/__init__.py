"""The v0 door (vLLM 0.9.2's v0 engine): the connector around a model-runner step (`connector`),
the plan of a step's prefills (`step_plan`) and the rebuilt model input (`model_input`).
vLLM and the wrapper reach it through `lmcache.integration.vllm.vllm_adapter`."""
