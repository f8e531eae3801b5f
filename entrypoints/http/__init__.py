"""The HTTP entrypoint: OpenAI Chat Completions, OpenAI Responses and Anthropic Messages on one port."""
