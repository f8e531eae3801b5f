"""Shared fixtures; the fakes themselves live in tests/fakes."""
