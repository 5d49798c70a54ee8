"""PyTorch layers of the GLM-4.5 model: one small file per layer type."""
