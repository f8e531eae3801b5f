"""Driven adapters: MLX compute, loading, storage, model-family codecs, API dialect codecs, telemetry."""
