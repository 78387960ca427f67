"""The KV-flow sidecar process: ``app`` builds its parts (local API, ingest, peer senders, peer service,
store) and runs them; ``python -m ciuicflow.kvflow.sidecar`` starts it."""
