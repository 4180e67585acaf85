"""plugins.quantization.w4a16"""
