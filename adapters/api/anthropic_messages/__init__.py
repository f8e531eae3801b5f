"""Anthropic Messages: wire types, codec to and from the neutral chat model, the SSE stream, error envelopes."""
