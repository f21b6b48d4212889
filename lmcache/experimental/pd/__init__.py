"""Prefill/decode disaggregation (`enable_pd`): a prefiller pushes each prompt's KV chunks to a
decoder, which keeps them in a bounded buffer until its own lookup claims them.

- `disagg_spec.py`: the per-request `disagg_spec` (where to push), parsed and checked.
- `wire.py`: the frames of one push and its reply (JSON metadata + `chunk_format` chunk).
- `receiver.py`: the decoder's `PDReceiveBuffer` tier and the ZeroMQ server that fills it.
- `sender.py`: the prefiller's `PDSender`, pushing the chunks a store just wrote.
"""
