"""OpenAI Responses: wire types, codec to and from the neutral chat model, the SSE stream, errors."""
