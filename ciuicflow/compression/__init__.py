"""Compression methods: one module per compressor, one registry (``registry``) naming them all.

- ``base``: the ``Compressor`` protocol, the exchange ``Context``, the accuracy guard;
- ``quantized``: quantisation with error feedback over a route (shared by 1-bit and int8);
- ``onebit``, ``int8``, ``powersgd``: the compressors.
"""
