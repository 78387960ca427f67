"""Compression methods: one module per compressor, one registry (``registry``) naming them all.

- ``base``: the ``Compressor`` protocol, the exchange ``Context``, the accuracy guard;
- ``quantized_exchange``, ``quantized``: quantisation with error feedback over a route, and its
  compressor (shared by 1-bit and int8, which add a codec and defaults);
- ``onebit``, ``int8``, ``powersgd``: the compressors.
"""
