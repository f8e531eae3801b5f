"""Model configs shared by tests (the fit estimator's, the fake hub's repos)."""

# A Llama-3-8B-shaped repo: the fit estimate reads only the config and safetensors headers.
LLAMA8B = {
    "model_type": "llama",
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_size": 4096,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
}
