"""The MoE expert path in the masked layout: gate_up GEMM, SwiGLU with fp8
quantization, and the down GEMM with the combine fused into its epilogue."""
