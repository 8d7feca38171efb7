"""Where weights and tokenizers come from: GGUF and safetensors readers, the registry, caches."""
