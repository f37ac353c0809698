"""Quantized linear layers: msModelSlim's W8A8 (AscendV1 layout), its parser, kernels and writer."""
