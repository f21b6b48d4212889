"""CacheBlend on the v1 door: the scheduler's plan of a blended request (`plan`), the blended
forward of the first layers (`model`), the KV it reads and rotates (`kv`) and the runner that
picks the tokens to recompute (`runner`). The model-independent parts live in
`lmcache.experimental.blend`."""
