"""Checkpoint formats: the value types a loader hands to quantization methods and layers (GGUF blocks, layer names)."""
