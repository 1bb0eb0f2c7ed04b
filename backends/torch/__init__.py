"""The PyTorch + transformers backend (CUDA and CPU), its row-invariant attention, int8
layers and the HF reference comparison.
"""
