"""The numba backend's own tile products: every remainder of rows, columns and depth, both
precisions, the packings, and the forward that runs on them at realistic sizes."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from cases import softmax_score_tile

import attnperf
from attnperf import dispatch
from attnperf.testing import assert_agrees, float64_reference, same_precision_reference

pytest.importorskip("numba")
from attnperf.kernels.numba import blas, microkernels, tiles, vector_ops
from attnperf.kernels.numba.amx import amx_permitted
from attnperf.kernels.numba.jit import njit
from attnperf.kernels.numba.key_dots import scores_by_dots
from attnperf.kernels.numba.microkernels import tile_product
from attnperf.kernels.numba.packing import (
    gemm_fp32,
    pack_key_panels,
    pack_vnni,
    transpose_bf16,
    transpose_tile,
)
from attnperf.kernels.numba.softmax import round_probabilities
from attnperf.kernels.numba.vector_ops import add_block, exp2_columns

if dispatch.registry()["numba"].unavailable_reason():
    pytest.skip(dispatch.registry()["numba"].unavailable_reason(), allow_module_level=True)

# Rows cover every micro-kernel height (6) and remainder; columns every vector count and
# masked tail; depths E = 1, 40, 59, 100, 256 and an empty product.
ROWS = (1, 5, 6, 13)
COLS = (1, 15, 16, 17, 59, 64, 100, 130)
DEPTHS = (0, 1, 40, 59, 100, 256)


def bits(tensor: torch.Tensor) -> np.ndarray:
    return tensor.contiguous().view(torch.int16).numpy().view(np.uint16)


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
def test_fp32_products_match_float64(trans_a, trans_b):
    gen = torch.Generator().manual_seed(0)
    for rows in ROWS:
        for cols in COLS:
            for depth in DEPTHS:
                a = torch.randn((depth, rows) if trans_a else (rows, depth), generator=gen)
                b = torch.randn((cols, depth) if trans_b else (depth, cols), generator=gen)
                c = torch.randn(rows, cols, generator=gen)
                op_a, op_b = (a.T if trans_a else a), (b.T if trans_b else b)
                exact = 0.5 * op_a.double() @ op_b.double() + 2.0 * c.double()
                out = c.numpy().copy()
                gemm_fp32(a.numpy(), b.numpy(), out, np.float32(0.5), np.float32(2.0),
                          trans_a, trans_b)  # fmt: skip
                bound = 1e-5 * (depth + 2) * (op_a.abs().double() @ op_b.abs().double() + 2)
                error = (torch.from_numpy(out).double() - exact).abs()
                assert bool((error <= bound).all()), (rows, cols, depth)


def test_fp32_product_with_beta_zero_never_reads_c():
    a, b = np.ones((7, 3), np.float32), np.ones((3, 20), np.float32)
    c = np.full((7, 20), np.nan, np.float32)
    gemm_fp32(a, b, c, np.float32(1.0), np.float32(0.0), False, False)
    assert np.array_equal(c, np.full((7, 20), 3.0, np.float32))


def test_fp32_product_writes_only_its_columns():
    """The masked last vector: columns past `cols` in a wider buffer stay as they were."""
    a, b = np.ones((7, 4), np.float32), np.ones((4, 40), np.float32)
    c = np.full((7, 48), -1.0, np.float32)
    gemm_fp32(a, b, c[:, :37], np.float32(1.0), np.float32(0.0), False, False)
    assert np.all(c[:, :37] == 4.0) and np.all(c[:, 37:] == -1.0)


@njit()
def products_of_every_type(a, a_c, b, out):
    """tiles.product called as the kernels call it: contiguous and strided views (a's
    columns two apart, transposes), literal flags, float64 or float32 scalars."""
    tiles.product(a, b, out[0], 1.0, 0.0, False, False, tiles.OWN_TILES)
    tiles.product(a_c, b, out[1], np.float32(1.0), 0.0, False, False, tiles.OWN_TILES)
    tiles.product(a_c, b, out[2], 1.0, np.float32(0.0), False, True, tiles.OWN_TILES)
    tiles.product(a_c, b.T, out[3], 1.0, 0.0, False, True, tiles.OWN_TILES)
    tiles.product(a_c.T, b, out[4], 1.0, 0.0, True, False, tiles.OWN_TILES)


def test_a_product_compiles_its_micro_kernels_once_whatever_its_operands():
    """Every call of tiles.product reaches gemm_fp32 as one type of call (views of any
    strides, flags and scalars not literal): one signature, not one per combination (the
    linear kernels compiled 16, 3-7 s each); and each product is still right."""
    blas.setup()  # product's BLAS side links sgemm, though it is not taken here
    gen = torch.Generator().manual_seed(0)
    a_c, b = torch.randn(6, 6, generator=gen).numpy(), torch.randn(6, 6, generator=gen).numpy()
    a = torch.randn(6, 12, generator=gen).numpy()[:, ::2]
    before = set(gemm_fp32.signatures)
    out = np.zeros((5, 6, 6), np.float32)
    products_of_every_type(a, a_c, b, out)
    added = set(gemm_fp32.signatures) - before
    assert len(added) <= 1 and all(sig[0].layout == "A" for sig in added), added
    expected = (a @ b, a_c @ b, a_c @ b.T, a_c @ b, a_c @ b)
    for got, product in zip(out, expected, strict=True):
        np.testing.assert_allclose(got, product, rtol=1e-5, atol=1e-5)


def test_bf16_products_match_float64():
    """bf16 A (pairs along the depth) and B in the VNNI layout, fp32 accumulation."""
    gen = torch.Generator().manual_seed(1)
    for rows in ROWS:
        for cols in COLS:
            for depth in (2, 40, 60, 100, 256):
                a = torch.randn(rows, depth, generator=gen).bfloat16()
                b = torch.randn(depth, cols, generator=gen).bfloat16()
                b_pairs = np.empty((depth // 2, 2 * cols), np.uint16)
                pack_vnni(bits(b), b_pairs)
                out = np.zeros((rows, cols), np.float32)
                a_view, b_view = (bits(a), 0, depth, 1), (b_pairs, 0, 2 * cols, 32)
                product_into(depth // 2, a_view, b_view, (out, 0, cols), rows, cols)
                exact = a.double() @ b.double()
                bound = 1e-6 * depth * (a.double().abs() @ b.double().abs()) + 1e-30
                error = (torch.from_numpy(out).double() - exact).abs()
                assert bool((error <= bound).all()), (rows, cols, depth)


def test_widened_bf16_products_match_float64():
    """fp32 A against a bf16 B as it lies (a cache's values, row-major), widened in
    registers: exact products, fp32 accumulation."""
    gen = torch.Generator().manual_seed(2)
    for rows in ROWS:
        for cols in COLS:
            for depth in DEPTHS:
                a = torch.randn(rows, depth, generator=gen)
                b = torch.randn(depth, cols, generator=gen).bfloat16()
                out = np.zeros((rows, cols), np.float32)
                a_view, b_view = (a.numpy(), 0, depth, 1), (bits(b), 0, cols, 16)
                product_into(depth, a_view, b_view, (out, 0, cols), rows, cols)
                exact = a.double() @ b.double()
                bound = 1e-6 * (depth + 1) * (a.double().abs() @ b.double().abs()) + 1e-30
                error = (torch.from_numpy(out).double() - exact).abs()
                assert bool((error <= bound).all()), (rows, cols, depth)


def test_paired_bf16_products_match_float64_and_write_only_their_columns():
    """bf16 A in pairs along the depth (uint32) against B's bf16 rows as they lie (a cache's
    values), each two rows paired in registers (vdpbf16ps, or two FMAs without it): every
    row block, columns off the vectors (odd counts of 16, a lone last vector), fp32
    accumulation onto C; columns past `cols` in a wider C stay as they were."""
    gen = torch.Generator().manual_seed(5)
    for rows in ROWS:
        for cols in (*COLS, 31, 33, 48):
            for depth in (2, 40, 60, 256):
                a = torch.randn(rows, depth, generator=gen).bfloat16()
                b = torch.randn(depth, cols, generator=gen).bfloat16()
                c = torch.randn(rows, cols + 5, generator=gen)
                out = c.numpy().copy()
                a_view, b_view = (bits(a).view(np.uint32), 0, depth // 2, 1), (bits(b), 0, cols, 16)
                tile_product(depth // 2, np.float32(0.5), np.float32(2.0), a_view, b_view,
                             (out, 0, cols + 5), rows, cols)  # fmt: skip
                exact = 0.5 * a.double() @ b.double() + 2.0 * c[:, :cols].double()
                bound = 1e-6 * depth * (a.double().abs() @ b.double().abs() + 2) + 1e-30
                error = (torch.from_numpy(out[:, :cols]).double() - exact).abs()
                assert bool((error <= bound).all()), (rows, cols, depth)
                assert np.array_equal(out[:, cols:], c[:, cols:].numpy()), (rows, cols, depth)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scores_by_dots_match_float64_and_stay_in_their_keys(dtype):
    """Query rows against key rows as they lie, every block shape (4 x 4, 2 x 8, 1 x 16)
    and remainder: rows 1-9, keys 1-16, E = 1, 40, 59, 100, 256 (bf16: even E, in pairs).
    Key rows past `keys` hold NaN and must never be read; columns past them stay as they
    were."""
    gen = torch.Generator().manual_seed(3)
    dims = (1, 40, 59, 100, 256) if dtype == torch.float32 else (2, 40, 100, 256)
    for dim in dims:
        for rows in (1, 2, 3, 4, 5, 7, 9):
            for keys in (1, 3, 4, 9, 16):
                q = torch.randn(rows, dim, generator=gen).to(dtype)
                k = torch.randn(keys + 3, dim, generator=gen).to(dtype)
                k[keys:] = float("nan")
                arrays = (q.numpy(), k.numpy()) if dtype == torch.float32 else (bits(q), bits(k))
                s = np.full((rows, 20), -7.0, np.float32)
                depth = dim if dtype == torch.float32 else dim // 2
                scores_by_dots(depth, np.float32(0.5), (arrays[0], 0, dim), (arrays[1], 0, dim),
                               (s, 0, 20), rows, keys)  # fmt: skip
                exact = 0.5 * q.double() @ k[:keys].double().T
                bound = 1e-6 * (dim + 1) * (q.double().abs() @ k[:keys].double().abs().T)
                error = (torch.from_numpy(s[:, :keys]).double() - exact).abs()
                assert bool((error <= bound + 1e-30).all()), (dim, rows, keys)
                assert np.all(s[:, keys:] == -7.0), (dim, rows, keys)


@pytest.mark.parametrize(
    "kind", ["fp32", "bf16", "widened", "paired", "scores fp32", "scores bf16"]
)
def test_prefetching_ahead_changes_no_bit(kind):
    """`ahead` (the KV-cache walk's prefetch into L2 as each B or key row loads) runs
    a loop of its own: every micro-kernel kind and the scores' dot products give the same
    bits with it as without, at rows, columns and depths off the blocks, and with
    prefetched lines past the array's end (a prefetch never faults)."""
    gen = torch.Generator().manual_seed(4)
    dtype = torch.float32 if kind in ("fp32", "scores fp32") else torch.bfloat16
    for rows in ROWS:
        for cols in COLS:
            for depth in (2, 40, 100):
                a = torch.randn(rows, depth, generator=gen).to(dtype)
                b = torch.randn(depth, cols, generator=gen).to(dtype)
                if kind == "widened":
                    a = a.float()
                array = {torch.float32: lambda t: t.numpy(), torch.bfloat16: bits}
                a_np, b_np = array[a.dtype](a), array[b.dtype](b)
                outs = []
                for ahead in (0, depth * cols):
                    out = np.zeros((rows, cols), np.float32)
                    if kind.startswith("scores"):  # b's columns as the keys' rows
                        k = array[dtype](b.T.contiguous())
                        steps = depth if dtype == torch.float32 else depth // 2
                        scores_by_dots(steps, np.float32(0.5), (a_np, 0, depth), (k, 0, depth),
                                       (out, 0, cols), rows, min(cols, 16), ahead)  # fmt: skip
                    elif kind == "paired":
                        a_pairs = a_np.view(np.uint32)
                        product_into(depth // 2, (a_pairs, 0, depth // 2, 1), (b_np, 0, cols, 16),
                                     (out, 0, cols), rows, cols, ahead)  # fmt: skip
                    elif kind == "bf16":
                        b_pairs = np.empty((depth // 2, 2 * cols), np.uint16)
                        pack_vnni(b_np, b_pairs)
                        product_into(depth // 2, (a_np, 0, depth, 1), (b_pairs, 0, 2 * cols, 32),
                                     (out, 0, cols), rows, cols, ahead)  # fmt: skip
                    else:
                        product_into(depth, (a_np, 0, depth, 1), (b_np, 0, cols, 16),
                                     (out, 0, cols), rows, cols, ahead)  # fmt: skip
                    outs.append(out)
                assert np.array_equal(outs[0], outs[1]), (rows, cols, depth)
                assert np.any(outs[0] != 0), (rows, cols, depth)


def product_into(depth, a_view, b_view, c_view, rows, cols, ahead=0):
    tile_product(depth, np.float32(1.0), np.float32(0.0), a_view, b_view, c_view, rows, cols,
                 ahead)  # fmt: skip


def test_to_bf16_rounds_to_nearest_even_as_torch():
    values = torch.cat([
        torch.randn(9_999) * 1e3,  # an odd count in all
        torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -0.0, float("inf"), 3.0e38, 1e-40]),
    ])  # fmt: skip
    expected = bits(values.bfloat16())
    # vcvtneps2bf16 flushes fp32 subnormals to zero (a probability under 1e-38 of a row
    # whose sum is at least 1); torch keeps them, as the integer rounding elsewhere does.
    if "avx512bf16" in microkernels.target_features():
        subnormal = (values.abs() < torch.finfo(torch.float32).tiny) & (values != 0)
        expected[subnormal.numpy()] = 0
    p = values.numpy()[None, :]
    rounded = np.full((1, p.shape[1] + 1), 7, np.uint16)
    round_probabilities(p, rounded, 1, p.shape[1])  # the forward's loop over to_bf16
    assert np.array_equal(rounded[0, :-1], expected)
    assert rounded[0, -1] == 0  # an odd count: a zero after, so that pairs are whole


@pytest.mark.parametrize("keys", [1, 15, 16, 17, 37])
@pytest.mark.parametrize("dim", [1, 5, 16, 40, 59, 100, 130])
def test_pack_key_panels_lays_out_k_transposed_by_sixteen_keys(keys, dim):
    rows = np.arange(keys * (dim + 3), dtype=np.float32).reshape(keys, dim + 3) + 1
    expected = np.zeros((16 * (keys // 16 + 2), dim), np.float32)  # a panel past the keys
    expected[:keys] = rows[:, :dim]
    expected = expected.reshape(-1, 16, dim).transpose(0, 2, 1)
    # In registers (rows of unit stride, here a row stride past dim), and element by element.
    for k in (rows[:, :dim], np.asfortranarray(rows[:, :dim])):
        packed = np.full(expected.shape, np.nan, np.float32)
        pack_key_panels(k, packed)
        assert np.array_equal(packed, expected)


@pytest.mark.parametrize("keys", [1, 17, 37])
@pytest.mark.parametrize("dim", [1, 2, 3, 40, 59, 66])
def test_pack_key_panels_pairs_bf16_keys(keys, dim):
    rows = np.arange(keys * (dim + 3), dtype=np.uint16).reshape(keys, dim + 3) + 1
    depth, panels = (dim + 1) // 2, keys // 16 + 2  # a panel past the keys
    wide = np.zeros((16 * panels, 2 * depth), np.uint16)
    wide[:keys, :dim] = rows[:, :dim]
    expected = wide.reshape(panels, 16, depth, 2).transpose(0, 2, 1, 3).reshape(panels, depth, 32)
    for k in (rows[:, :dim], np.asfortranarray(rows[:, :dim])):  # in registers (even E), or not
        pairs = np.full(expected.shape, 7, np.uint16)
        pack_key_panels(k, pairs)
        assert np.array_equal(pairs, expected)


@pytest.mark.parametrize("depth", [1, 4, 5])
def test_pack_vnni_pairs_rows_and_never_reads_past_them(depth):
    """A shorter sequence than the packing holds (varlen): zeros past its rows, whatever
    lies after them in memory (here NaN)."""
    rows = np.full((depth + 8, 3), 0x7FC0, np.uint16)  # bf16 NaN after the sequence
    rows[:depth] = np.arange(depth * 3, dtype=np.uint16).reshape(depth, 3) + 1
    pairs = np.full((4, 6), 7, np.uint16)
    pack_vnni(rows[:depth], pairs)
    wide = np.zeros((8, 3), np.uint16)
    wide[:depth] = rows[:depth]
    assert np.array_equal(pairs, wide.reshape(4, 2, 3).transpose(0, 2, 1).reshape(4, 6))


@pytest.mark.parametrize("keys", [1, 15, 16, 17, 100])
@pytest.mark.parametrize("dim", [2, 32, 66])
def test_transpose_bf16_transposes_and_zeros_past_the_rows(keys, dim):
    """In registers (pairs of unit stride) and element by element (a strided view); dst's
    columns past the rows zeros, whatever they held."""
    rows = np.arange(keys * 2 * dim, dtype=np.uint16).reshape(keys, 2 * dim) + 1
    for src in (rows[:, :dim], rows[:, ::2]):
        expected = np.zeros((dim, keys + 20), np.uint16)
        expected[:, :keys] = src.T
        dst = np.full(expected.shape, 7, np.uint16)
        pairs_t = np.zeros((dim // 2, 2 * (-(-keys // 16) * 16)), np.uint16)
        transpose_bf16(src, dst, pairs_t)
        assert np.array_equal(dst, expected)


def test_transpose_tile_transposes_whole_sixteens_and_leaves_the_rest():
    src = np.arange(32 * 50, dtype=np.float32).reshape(32, 50)
    dst = np.full((50, 40), -1.0, np.float32)
    transpose_tile(src, dst, 32, 48)
    expected = np.full((50, 40), -1.0, np.float32)
    expected[:48, :32] = src[:, :48].T
    assert np.array_equal(dst, expected)


@njit()
def _exp2_columns(s_t, cols, shift, factor, total):
    for r in range(0, s_t.shape[1], 16):
        exp2_columns(s_t, cols, r, shift, factor, total)


@pytest.mark.skipif("avx512f" not in microkernels.target_features(),
                    reason="exp2_columns is AVX-512F code (the fp32 forward's softmax by "
                    "rows serves AVX2)")  # fmt: skip
@pytest.mark.parametrize("cols", [0, 1, 7, 400])
def test_exp2_columns_as_exact_as_exp2_in_place_and_sum_in_fp32(cols):
    """p = 2 ** (factor s - shift) in place for the keys below cols, within 1e-7 relative
    of float64's 2 ** t (t as its fma rounds it; `fastmath.exp2`'s bound, 7.9e-8: the
    degree-5 fit for bf16 misses it), the keys past cols left alone; the sums added
    to the rows' totals; -inf and scores far below the shift exactly 0 (no subnormal
    results: each cost a microcode assist); NaN stays."""
    s_t, shift, factor = softmax_score_tile(400, seed=8)
    before, total = s_t.copy(), np.full(32, 0.5, np.float32)
    _exp2_columns(s_t, cols, shift, factor, total)
    assert np.array_equal(s_t[cols:], before[cols:], equal_nan=True)
    t = (np.float64(factor) * before[:cols] - shift).astype(np.float32)
    exact, got = np.exp2(t.astype(np.float64)), s_t[:cols]
    if cols:
        assert got[0, 0] == 0 and np.isnan(got[0, 1]) and got[0, 2] == 0 and got[0, 3] == 1
    finite = np.isfinite(exact)
    finite[:1, :4] = False
    floor = 2.0**vector_ops.EXP2_FLOOR  # below it, 0
    assert np.all(np.abs(got[finite] - exact[finite]) <= 1e-7 * exact[finite] + floor)
    sums = 0.5 + np.nansum(exact, axis=0)
    assert total[8] == 0.5 and (np.isnan(total[1]) if cols else total[1] == 0.5)
    rest = [r for r in range(32) if r != 1]
    assert np.allclose(total[rest], sums[rest], rtol=1e-6, atol=0)


@njit()
def _add_block(s, s_at, values, v_at, shut, transposed):
    if transposed:
        add_block(s, s_at, values, v_at, shut, True)
    else:
        add_block(s, s_at, values, v_at, shut, False)


@pytest.mark.skipif(
    "avx512f" not in microkernels.target_features(),
    reason="add_block is AVX-512F code (masks go by LLVM's loops without it)",
)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("shut", [False, True])
@pytest.mark.parametrize("row_stride", [48, 64])
def test_add_block_adds_a_mask_block_by_rows_or_transposed(transposed, shut, row_stride):
    """A 16 x 16 block added at any corner of a wider tile (its rows, or its columns where
    transposed; -inf where shut), the tile's rows contiguous or a wider array's, nothing
    else touched; a NaN score stays NaN."""
    gen = torch.Generator().manual_seed(9)
    wide = torch.randn(40, row_stride, generator=gen).numpy()
    s = wide[:, :48]
    s[6, 9] = np.nan
    values = torch.randn(3, 16, 16, generator=gen).numpy()
    values[2, 3, 4] = -np.inf
    expected = s.copy()
    block = np.full((16, 16), -np.inf, np.float32) if shut else values[2]
    expected[5:21, 7:23] += block.T if transposed else block
    untouched = wide[:, 48:].copy()
    _add_block(s, 5 * row_stride + 7, values, 2 * 256, shut, transposed)
    assert np.array_equal(s, expected, equal_nan=True) and np.isnan(s[6, 9])
    assert np.array_equal(wide[:, 48:], untouched)


def test_route_follows_numba_target(monkeypatch):
    monkeypatch.delenv("ATTNPERF_NUMBA_TILES", raising=False)
    monkeypatch.setenv("NUMBA_CPU_NAME", "haswell")
    monkeypatch.setenv("NUMBA_CPU_FEATURES", "+avx,+sse4.2")
    assert microkernels.tile_route("fp32")[0] == "blas"
    assert microkernels.tile_route("bf16")[0] == "blas"
    monkeypatch.setenv("NUMBA_CPU_FEATURES", "+avx2,+fma")
    assert microkernels.tile_route("fp32")[0] == "avx2"
    assert microkernels.tile_route("bf16")[0] == "avx2"
    assert microkernels.panel_vectors() == 1  # 6 x 16 blocks: 12 of the 16 ymm registers
    monkeypatch.setenv("NUMBA_CPU_FEATURES", "+avx2,+avx512f,+avx512bf16")
    assert microkernels.tile_route("fp32")[0] == "avx512"
    assert microkernels.tile_route("bf16")[0] == "avx512-bf16"
    assert microkernels.panel_vectors() == 4
    monkeypatch.setenv("NUMBA_CPU_FEATURES", "+avx2,+avx512f,+avx512bf16,+amx-tile,+amx-bf16")
    granted, refusal = amx_permitted()  # Linux grants AMX's tiles only where the CPU has them
    route, why = microkernels.tile_route("bf16")
    assert (route, granted) in (("amx", True), ("avx512-bf16", False)) and refusal in why
    monkeypatch.setenv("ATTNPERF_NUMBA_AMX", "0")
    assert microkernels.tile_route("bf16")[0] == "avx512-bf16"


def test_route_under_a_named_cpu_alone_is_the_hosts(monkeypatch):
    """NUMBA_CPU_NAME alone leaves numba on the host's features, so the routes stay the
    host's; "generic" alone means none; "-avx512f" takes every AVX-512 extension with it."""
    for name in ("ATTNPERF_NUMBA_TILES", "ATTNPERF_NUMBA_AMX", "NUMBA_CPU_NAME",
                 "NUMBA_CPU_FEATURES"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    host = {kind: microkernels.tile_route(kind)[0] for kind in ("fp32", "bf16")}
    monkeypatch.setenv("NUMBA_CPU_NAME", "haswell")
    assert microkernels.target_features() == microkernels._host_features()
    assert {kind: microkernels.tile_route(kind)[0] for kind in host} == host
    monkeypatch.setenv("NUMBA_CPU_NAME", "generic")
    assert microkernels.target_features() == frozenset()
    assert microkernels.tile_route("bf16")[0] == "blas"
    monkeypatch.delenv("NUMBA_CPU_NAME")
    monkeypatch.setenv("NUMBA_CPU_FEATURES", "+avx2,+fma,+avx512bf16,-avx512f")
    features = microkernels.target_features()
    assert {"avx2", "fma"} <= features and not any(f.startswith("avx512") for f in features)
    assert microkernels.tile_route("bf16")[0] == "avx2"


def test_tiles_choice_is_checked(monkeypatch):
    monkeypatch.setenv("ATTNPERF_NUMBA_TILES", "fast")
    tiles.tiles_flag.cache_clear()
    try:
        with pytest.raises(ValueError, match="ATTNPERF_NUMBA_TILES"):
            tiles.tiles_flag()
    finally:
        monkeypatch.delenv("ATTNPERF_NUMBA_TILES")
        tiles.tiles_flag.cache_clear()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_and_gradients_at_realistic_size_keep_the_2x_rule(dtype, causal):
    """L = 2048 (whole 128 x 512 tiles, many key tiles per row), GQA, E = 64."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 2048, 64, generator=gen).to(dtype)
    k, v = (torch.randn(1, 2, 2048, 64, generator=gen).to(dtype) for _ in range(2))
    call = {"query": q, "key": k, "value": v, "is_causal": causal, "enable_gqa": True}
    assert_results_and_gradients_agree(call)


def _realistic_mask(kind, dtype, length):
    """transformers' masks at a realistic size: causal bool; causal with batch 0's first
    300 keys padded (float, -inf: its first 300 rows see no key; finfo.min: they average
    every key); causal of finfo.min."""
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    if kind == "causal bool":
        return causal
    if kind.startswith("padded causal"):
        keep = causal.expand(2, 1, length, length).clone()
        keep[0, ..., :300] = False
        low = float("-inf") if kind.endswith("-inf") else torch.finfo(dtype).min
        return torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, low)
    return torch.zeros(length, length, dtype=dtype).masked_fill(~causal, torch.finfo(dtype).min)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "mask", ["causal bool", "padded causal -inf", "causal finfo.min", "padded causal finfo.min"]
)
def test_masks_at_realistic_size_keep_the_2x_rule(dtype, mask):
    """L = 1024, GQA: tiles that the mask shuts (skipped: -inf, and finfo.min where each row
    sees a key), opens, sieves and adds values to (finfo.min where a row sees none, and
    fp16's), forward and gradients."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 1024, 64, generator=gen).to(dtype)
    k, v = (torch.randn(2, 2, 1024, 64, generator=gen).to(dtype) for _ in range(2))
    call = {"query": q, "key": k, "value": v, "enable_gqa": True,
            "attn_mask": _realistic_mask(mask, dtype, 1024)}  # fmt: skip
    assert_results_and_gradients_agree(call)


@pytest.mark.parametrize("head_dim", [1, 40, 59, 100, 256])
def test_bf16_forward_and_gradients_keep_the_2x_rule_at_odd_head_dims(head_dim):
    """E not a multiple of the vector width (odd E runs on a zero column more); odd query
    rows and keys (a last pair of rows or keys half zero)."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, 301, head_dim, generator=gen).bfloat16()
    k, v = (torch.randn(2, 3, 299, head_dim, generator=gen).bfloat16() for _ in range(2))
    assert_results_and_gradients_agree({"query": q, "key": k, "value": v, "is_causal": True})


def assert_results_and_gradients_agree(call):
    """numba's output and gradients (of sum(out * g)) against the float64 reference's, by
    the 2x rule against PyTorch's same-precision computation."""
    runs = {
        "numba": lambda **c: attnperf.attention(**c, backend="numba"),
        "exact": float64_reference,
        "baseline": same_precision_reference,
    }
    results = {}
    for name, run in runs.items():
        args = {key: value.clone().requires_grad_() for key, value in call.items()
                if isinstance(value, torch.Tensor) and key != "attn_mask"}  # fmt: skip
        cast = {key: value.double() if name == "exact" else value for key, value in args.items()}
        out = run(**{**call, **cast})
        assert out.shape == call["query"].shape[:-1] + call["value"].shape[-1:]
        gen = torch.Generator().manual_seed(1)
        (out * torch.randn(out.shape, generator=gen).to(out)).sum().backward()
        grads = {f"grad of {arg}": tensor.grad for arg, tensor in args.items()}
        results[name] = {"output": out, **grads}
    for what, actual in results["numba"].items():
        assert_agrees(actual, results["exact"][what], results["baseline"][what], what=what)


def run_for_target(script: str, cpu_name: str, features: str | None, tmp_path) -> list[str]:
    """The words `script` prints, run in a fresh process whose numba target is `cpu_name`
    with `features` (None: NUMBA_CPU_FEATURES unset; numba reads its target at start-up)."""
    env = {**os.environ, "NUMBA_CPU_NAME": cpu_name, "NUMBA_CPU_FEATURES": features,
           "NUMBA_CACHE_DIR": str(tmp_path)}  # fmt: skip
    env = {name: value for name, value in env.items() if value is not None}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.split()


@pytest.mark.parametrize(
    "cpu_name, features, avx",
    [("haswell", None, "1"), ("haswell", None, "0"), ("generic", None, "1"),
     ("haswell", "+avx2,+fma", "1"), ("haswell", "", "1")],
)  # fmt: skip
def test_target_features_are_what_numba_compiles_for(cpu_name, features, avx, tmp_path):
    """The features the routes follow are those numba's code generator is given: the host's
    under a named CPU unless NUMBA_CPU_FEATURES lists others (NUMBA_ENABLE_AVX=0: less
    AVX's), none for "generic"."""
    script = (
        f"import os; os.environ['NUMBA_ENABLE_AVX'] = '{avx}'\n"
        "from numba.core.registry import cpu_target\n"
        "from attnperf.kernels.numba.microkernels import target_features\n"
        "given = cpu_target.target_context.codegen()._get_host_cpu_features().split(',')\n"
        "print(sorted(target_features()) == sorted(f[1:] for f in given if f[:1] == '+'))\n"
    )
    assert run_for_target(script, cpu_name, features, tmp_path) == ["True"]


def test_peaks_follow_the_target(tmp_path):
    """On AVX2 code paths the fp32 peak loop is 8 lanes wide (16 would spill) and there is
    no bf16 dot peak; a fresh process, since numba reads its target at start-up."""
    script = (
        "from attnperf.kernels.numba.peaks import fma_lanes, peak_flops\n"
        "print(fma_lanes(), peak_flops('fp32', 0.05) > 1e9, peak_flops('bf16'))\n"
    )
    assert run_for_target(script, "haswell", "+avx2,+fma", tmp_path) == ["8", "True", "None"]


def test_amx_branches_compile_on_targets_without_amx(tmp_path):
    """A kernel's AMX branch decided at run time (the bf16 backward's `amx`) compiles on every
    CPU; where numba's target has no AMX, LLVM has no instruction for it (it aborted the
    process), so the branch compiles to a trap. Compiled, not run, for an AVX512-BF16 CPU
    without AMX, in a fresh process: numba reads its target at start-up."""
    script = (
        "import numba\n"
        "from attnperf.kernels.numba.amx import tile_zero\n"
        "@numba.njit('void(boolean)')\n"
        "def maybe_zero(amx):\n"
        "    if amx:\n"
        "        tile_zero(0)\n"
        "asm = maybe_zero.inspect_asm(maybe_zero.signatures[0])\n"
        "print('tilezero' in asm, 'ud2' in asm)\n"
    )
    features = "+avx2,+fma,+avx512f,+avx512bw,+avx512vl,+avx512bf16"
    assert run_for_target(script, "cooperlake", features, tmp_path) == ["False", "True"]


def test_paired_bf16_products_without_the_bf16_dot_product(tmp_path):
    """Where the CPU has AVX-512 but no vdpbf16ps, a PAIRED product's pairs multiply in two
    fp32 FMAs, the even depth (the first row of a pair) from the low halves: checked
    against float64 in a fresh process for such a target (numba reads it at start-up)."""
    script = (
        "import numpy as np, torch\n"
        "from attnperf.kernels.numba.microkernels import target_features, tile_product\n"
        "assert 'avx512bf16' not in target_features()\n"
        "gen = torch.Generator().manual_seed(6)\n"
        "a = torch.randn(5, 40, generator=gen).bfloat16()\n"
        "b = torch.randn(40, 59, generator=gen).bfloat16()\n"
        "bits = lambda t: t.view(torch.int16).numpy().view(np.uint16)\n"
        "out = np.zeros((5, 59), np.float32)\n"
        "tile_product(20, np.float32(1.0), np.float32(0.0), (bits(a).view(np.uint32), 0, 20, 1),\n"
        "             (bits(b), 0, 59, 16), (out, 0, 59), 5, 59)\n"
        "exact = a.double() @ b.double()\n"
        "bound = 1e-6 * 40 * (a.double().abs() @ b.double().abs()) + 1e-30\n"
        "print(bool(((torch.from_numpy(out).double() - exact).abs() <= bound).all()))\n"
    )
    features = "+avx2,+fma,+avx512f,+avx512bw,+avx512vl,+avx512dq"
    assert run_for_target(script, "skylake-avx512", features, tmp_path) == ["True"]
