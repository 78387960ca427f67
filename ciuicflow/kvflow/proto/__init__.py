"""What the client, the sidecar and the transports share: ``kvflow.proto`` and its generated stubs,
the messages' names and checks (``messages``), the frame codec (``codec``) and the shared-memory ring
format (``shm``)."""
