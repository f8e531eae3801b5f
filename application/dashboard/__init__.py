"""Use cases behind the web dashboard: sessions, per-mode generators, race, model manager, roofline, metrics.

Everything here runs through the same GenerationService and engine thread as the API; the ports the
dashboard needs (session store, telemetry feed, machine probe, hub) are in `ports.py` and wired by bootstrap.
"""
