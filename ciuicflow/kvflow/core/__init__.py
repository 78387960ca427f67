"""Pure logic of the sidecar, clock injected, no I/O: the per-destination scheduler, the per-peer congestion
controller, each outgoing transfer's state machine, chunk cutting, and the memory budget."""
