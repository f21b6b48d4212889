"""Peer-to-peer sharing (`enable_p2p`): every instance serves its own tiers to the others.

- `records.py`: the lookup records in Redis (`lookup_url`): chunk -> the peer server holding
  it, under that server's run (epoch), and a live key per server.
- `recorder.py`: keeps this instance's records true from the holdings stream, in the background.
- `peer_server.py`: serves the local tiers read-only at `distributed_url` (port + worker id).
- `service.py`: starts and stops the two above for one engine.
- The read side is a tier, `storage_backend/p2p_backend.py`: a local miss asks Redis who holds
  the chunks and reads them from that peer, several per round trip.
"""
