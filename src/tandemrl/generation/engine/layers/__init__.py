"""The engine's device plane, one file per kernel family: attention (with its Triton decode kernel),
sampling (with its Triton kernel), RMSNorm, RoPE + cache write, and the MLP's activation. The torch
path of each runs anywhere (CPU CI); a Triton file is imported only on CUDA."""
