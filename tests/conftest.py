"""Shared pytest setup for every test tree.
tests/ has no __init__.py: discovery is rootdir-based (see pyproject.toml)."""


def pytest_configure(config):
    """Nothing to configure yet."""
