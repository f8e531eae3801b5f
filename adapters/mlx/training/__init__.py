"""MLX compute for drafter distillation: batched target generation, on-the-fly feature capture, the
anchor/block-mask recipe and its losses, AdamW with warmup + cosine, atomic checkpoints (`MlxDrafterTrainer`).
"""

from mlx_dspark.adapters.mlx.training.trainer import MlxDrafterTrainer

__all__ = ["MlxDrafterTrainer"]
