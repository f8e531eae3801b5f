"""The web dashboard: pages (Jinja templates), static files and the JSON/SSE routes behind them.

A thin client of the engine: chat and race run as engine-thread jobs on the same GenerationService as
the API; telemetry comes from the broadcasting TelemetrySink. Guarded by the API key (header or cookie).
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).parent
TEMPLATES = HERE / "templates"
STATIC = HERE / "static"
