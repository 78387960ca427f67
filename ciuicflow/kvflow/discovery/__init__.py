"""Where a sidecar's peers come from besides the static ``--peer`` list (sidecar/config.py): etcd.

``etcd.py`` a thin client of etcd's v3 gRPC API; ``entry.py`` what one sidecar registers and the checks of
every entry read back (hostile input); ``registry.py`` registration under a lease and the watch;
``identify.py`` the proof of a registered name (a registry entry grants no trust); ``membership.py`` from
entries to peers; ``service.py`` all of it wired to a sidecar; ``settings.py`` the flags' checks.
docs/discovery.md says how to run it and why it is built so.
"""
