"""Quantized checkpoints: weights kept as stored (FP8 blocks, compressed-tensors' packings), dequantized per layer in forward."""
