"""The triton backend: fused FlashAttention-2-style GPU kernels, forward and backward.

One program per (query tile, batch x head) loops over key tiles with a running max and sum
in base 2 (log2(e) folded into the scale). Masks are read tile by tile through their
broadcast strides, GQA is index arithmetic, ragged edges are masked. The backward pass is
FlashAttention-2's: a rowsum(dO * O) preprocess, a dK/dV kernel and a dQ kernel,
deterministic (no atomics). Without a GPU the kernels run on CPU tensors through Triton's
interpreter (TRITON_INTERPRET=1, set before attnperf's kernels are first used).

Modules, bottom up: `jit` (triton, guarded; what every launcher passes), `configs` (tile
configurations against the GPU's shared memory), `variant` (a call's variant lowered once;
tile ranges and score modification shared by forward and backward), then one module per
kernel family (`attention`, `kvcache`, `linear`), and `backend`, which declares what they
serve.
"""
