"""Anthropic Messages: wire types, codec, SSE stream state machine and errors."""
