"""The client of the sidecar's local API: ``Client`` (client.py), the transfers it sees (streams.py), its
payloads (payload.py) and its side of the shared-memory rings (rings.py)."""
