"""Built-in models and model loading (Hugging Face ids, local folders, GGUF files)."""
