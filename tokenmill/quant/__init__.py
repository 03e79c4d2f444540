"""Weight-only quantization: the formats (base.py's interface; int4.py, int8.py, kquant.py), which
format a layer's checkpoint shards become (assembly.py), and the checkpoint encodings they come
from (GGUF blocks: gguf_tensor.py, gguf_blocks.py; AWQ/GPTQ: packed.py)."""
