"""Model resolution and loading: local mlx-lm dirs, Hugging Face repo ids, GGUF files, the embedded default."""
