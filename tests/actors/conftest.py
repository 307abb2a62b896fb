"""Fixtures for the actor tests: one shared Ray instance per session."""
