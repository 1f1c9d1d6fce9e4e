"""Model definitions (Llama, Qwen2, Qwen3) and the registry that picks one for a checkpoint."""
