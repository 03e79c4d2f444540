"""Weight-only quantization: packed int4 (group-wise) and int8 (per-channel) weights, the CPU
kernels that multiply by them, and exact decoding of GGUF 4-bit blocks."""
