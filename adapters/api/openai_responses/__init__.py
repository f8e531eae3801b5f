"""OpenAI Responses: wire types, codec, SSE stream state machine and errors."""
