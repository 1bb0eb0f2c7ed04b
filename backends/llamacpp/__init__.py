"""The llama.cpp adapter: GGUF files run on llama.cpp's own CPU kernels under specdeck's engine."""
