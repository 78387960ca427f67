"""Test support for benchmarks and tests: the simulated cluster, fault injection."""
