"""Model architectures, checkpoint loaders (Hugging Face directories, GGUF) and tokenizers."""
