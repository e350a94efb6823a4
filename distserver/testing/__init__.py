"""Helpers for tests, examples and benchmarks: a local multi-process cluster."""

from distserver.testing.cluster import LocalCluster, free_ports

__all__ = ["LocalCluster", "free_ports"]
