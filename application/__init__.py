"""Use cases, the decode loop, the engine thread, settings and the composition root (bootstrap)."""
