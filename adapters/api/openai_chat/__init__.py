"""OpenAI Chat Completions: wire types, codec, SSE stream state machine and errors."""
