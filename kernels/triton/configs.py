"""Tile configurations: the forward's autotune space pruned, and the backward's tile chosen,
against the GPU's shared memory."""

from __future__ import annotations

import functools

from attnperf.inputs import AttentionInputs
from attnperf.kernels.triton.jit import INTERPRET, MASK_NONE, next_power_of_2, triton


def forward_configs() -> list:
    """Autotune space of the forward kernel; one small config under the interpreter."""
    if triton is None:
        return []
    if INTERPRET:
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32}, num_warps=4, num_stages=1)]
    # (BLOCK_M, BLOCK_N, warps, stages): few enough that tuning every key stays in seconds;
    # the last ones are small enough for fp32 at head dim 256 (and a last resort).
    shapes = (
        (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 4), (64, 64, 4, 3), (64, 32, 4, 4),
        (32, 32, 4, 2), (32, 16, 4, 1),
    )  # fmt: skip
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
        for bm, bn, w, s in shapes
    ]


@functools.cache
def shared_memory_limit(device_index: int) -> int:
    """Bytes of shared memory one block may use on this GPU (what Triton checks at launch).
    Kept: Triton's query is slow, half the backward's host time."""
    properties = triton.runtime.driver.active.utils.get_device_properties(device_index)
    return properties["max_shared_mem"]


def forward_shared_bytes(config, head_dim: int, value_dim: int, element: int, masked: bool):
    """Shared memory of the forward kernel: K and V tiles per pipeline stage, the Q tile, a
    mask tile. Never below what the compiler took for sm_90 in
    `python benches/triton_compile_check.py` (fp16, bf16, fp32; head dims 64 to 256)."""
    m, n, stages = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_stages
    kv_tiles = stages * n * (head_dim + value_dim) * element
    return kv_tiles + m * head_dim * element + (m * n * 4 if masked else 0) + 1024


def prune_forward_configs(configs, named_args, **kwargs):
    """Keep the tiles that fit this GPU's shared memory, are not too large for the registers
    at large head dims, and do not dwarf short sequences; at worst the smallest tile."""
    args = {**named_args, **kwargs}
    head_dim, value_dim = args["BLOCK_D"], args["BLOCK_DV"]
    query = args["Q"]
    limit = shared_memory_limit(query.device.index)
    masked = args["MASK_KIND"] != MASK_NONE
    kept = [
        c
        for c in configs
        if c.kwargs["BLOCK_N"] * max(head_dim, value_dim) <= 128 * 128
        and c.kwargs["BLOCK_M"] * max(head_dim, value_dim) <= 128 * 256
        and c.kwargs["BLOCK_M"] <= max(args["q_len_class"], 64)
        and forward_shared_bytes(c, head_dim, value_dim, query.element_size(), masked) <= limit
    ]
    return kept or configs[-1:]


# Backward (BLOCK_M = BLOCK_N, pipeline stages, shared bytes per padded head-dim element per
# input byte), fastest first. The bytes are the most that the dK/dV or the dQ kernel took
# compiled for sm_90 (`python benches/triton_compile_check.py`, fp16 and fp32, head dims 64
# to 256); a mask adds a tile.
BACKWARD_CONFIGS = (
    (64, 3, 704),
    (64, 2, 512),
    (32, 3, 264),
    (32, 2, 168),
    (64, 1, 288),
    (32, 1, 136),
)


def backward_config(inputs: AttentionInputs, device_index: int) -> tuple[int, int]:
    """(block, stages) of the backward kernels: the fastest that fits the GPU's shared memory."""
    if INTERPRET:
        return 32, 1
    dim = max(next_power_of_2(inputs.head_dim), next_power_of_2(inputs.value_dim), 16)
    element = inputs.query.element_size()
    limit = shared_memory_limit(device_index)
    for block, stages, per_element in BACKWARD_CONFIGS:
        mask_tile = block * block * 4 if inputs.attn_mask is not None else 0
        if per_element * dim * element + mask_tile + 1024 <= limit:
            return block, stages
    raise RuntimeError(
        f"triton backward: head dim {inputs.head_dim} in {inputs.dtype} needs more shared "
        f"memory per block than this GPU's {limit} bytes"
    )
