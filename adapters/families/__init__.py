"""Model-family codecs: render conversations through chat templates and parse text, thinking and tool calls."""
