"""Protocol of the KV-flow sidecar: kvflow.proto and its generated stubs."""
