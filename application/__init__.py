"""Use cases, the step engine and its thread, settings, the composition root (bootstrap), and the lab (`lab/`)."""
