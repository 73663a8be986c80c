"""The numba backend: fused, tiled FlashAttention-style CPU kernels (forward and backward).

Query tiles x key tiles, scores from BLAS sgemm on tiles, softmax kept online in base 2
(running max and sum, the accumulator rescaled as the max grows), logsumexp saved for the
backward pass, which recomputes the probabilities tile by tile. Extra memory is O(tile)
per thread, never O(L x S) (except the float mask's own gradient, which is L x S by nature).

Modules, bottom up: `jit` (numba, guarded), `blas` (the sgemm the tiles call), `fastmath`
(vectorisable exp2 and tanh), `launch` (running a parallel kernel, arrays over tensors),
`variant` (a call's variant lowered once; tile ranges and score modification shared by
forward and backward), then one module per kernel family (`attention`, `kvcache`,
`linear`), and `backend`, which declares what they serve.
"""
