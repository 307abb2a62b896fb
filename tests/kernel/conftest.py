"""Fixtures for the pure kernel tests: fast, deterministic, no Ray."""
