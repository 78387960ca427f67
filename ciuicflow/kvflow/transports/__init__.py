"""How a sender's frames reach a peer's receiver: ``base`` is the seam (Transport, Stream); ``tcp`` (the
receiver's TCP data plane) and ``grpc_stream`` (``KVFlowPeer.Link``) implement it. A new transport is one
module here."""
