"""Telemetry sinks: structlog lines and an in-memory ring buffer for the dashboard."""
