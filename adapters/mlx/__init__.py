"""MLX compute: the target adapter, drafter modules, acceptance fast path, kernels and device probes."""
