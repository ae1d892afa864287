"""Helpers shared by the test modules (and some benchmarks): no tests live here."""
