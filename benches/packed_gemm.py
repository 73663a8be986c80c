"""MKL's packed GEMM as numba's attention tiles would use it: one K and one V tile packed
once and reused by every query tile of a head (S = Q K^T, then O += P V), against the plain
product that packs them inside every call. x86-64 torch builds only (MKL inside
libtorch_cpu).

    python benches/packed_gemm.py [--tiles 64] [--rounds 5]

One thread, as inside numba's kernels; the two ways take turns; medians. The outputs are
compared first.
"""

import argparse
import ctypes
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from attnperf.machine import cpu_description

ROW_MAJOR, NO_TRANS, TRANS, PACKED, B_MATRIX = 101, 111, 112, 151, 162
SHAPES = [(64, 512, 64), (64, 512, 128), (128, 256, 64), (128, 256, 128)]  # (rows, keys, E)


def mkl() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.cblas_sgemm_pack_get_size.argtypes = [i, i, i, i]
    lib.cblas_sgemm_pack_get_size.restype = ctypes.c_size_t
    lib.cblas_sgemm_pack.argtypes = [i, i, i, i, i, i, f, p, i, p]
    lib.cblas_sgemm_compute.argtypes = [i, i, i, i, i, i, p, i, p, i, f, p, i]
    return lib


def tile_walks(lib, rows: int, keys: int, dim: int, tiles: int):
    """(plain, packed): each walks `tiles` query tiles over one K and one V tile."""
    gen = np.random.default_rng(0)
    q = gen.random((tiles, rows, dim), np.float32)
    k, v = gen.random((keys, dim), np.float32), gen.random((keys, dim), np.float32)
    s, out = np.empty((rows, keys), np.float32), np.zeros((rows, dim), np.float32)
    k_packed = np.empty(lib.cblas_sgemm_pack_get_size(B_MATRIX, rows, keys, dim) // 4, np.float32)
    v_packed = np.empty(lib.cblas_sgemm_pack_get_size(B_MATRIX, rows, dim, keys) // 4, np.float32)

    def at(array: np.ndarray) -> int:
        return array.ctypes.data

    def plain():
        for t in range(tiles):
            lib.cblas_sgemm_compute(ROW_MAJOR, NO_TRANS, TRANS, rows, keys, dim, at(q[t]), dim,
                                    at(k), dim, 0.0, at(s), keys)  # fmt: skip
            lib.cblas_sgemm_compute(ROW_MAJOR, NO_TRANS, NO_TRANS, rows, dim, keys, at(s), keys,
                                    at(v), dim, 1.0, at(out), dim)  # fmt: skip

    def packed():
        lib.cblas_sgemm_pack(ROW_MAJOR, B_MATRIX, TRANS, rows, keys, dim, 1.0, at(k), dim,
                             at(k_packed))  # fmt: skip
        lib.cblas_sgemm_pack(ROW_MAJOR, B_MATRIX, NO_TRANS, rows, dim, keys, 1.0, at(v), dim,
                             at(v_packed))  # fmt: skip
        for t in range(tiles):
            lib.cblas_sgemm_compute(ROW_MAJOR, NO_TRANS, PACKED, rows, keys, dim, at(q[t]), dim,
                                    at(k_packed), keys, 0.0, at(s), keys)  # fmt: skip
            lib.cblas_sgemm_compute(ROW_MAJOR, NO_TRANS, PACKED, rows, dim, keys, at(s), keys,
                                    at(v_packed), dim, 1.0, at(out), dim)  # fmt: skip

    results = []
    for walk in (plain, packed):
        out[:] = 0.0
        walk()
        results.append(out.copy())
    np.testing.assert_allclose(results[1], results[0], rtol=1e-5)
    return plain, packed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiles", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)  # MKL's threads follow torch's
    lib = mkl()
    cpu = cpu_description()
    print(f"{cpu['cpu_model']} ({cpu['vector_isa']}), 1 thread, fp32, {args.tiles} query tiles "
          "per K/V tile")  # fmt: skip
    for rows, keys, dim in SHAPES:
        walks = tile_walks(lib, rows, keys, dim, args.tiles)
        times: list[list[float]] = [[], []]
        for round_ in range(args.rounds):
            for index in (0, 1) if round_ % 2 == 0 else (1, 0):
                for _ in range(5):
                    start = time.perf_counter()
                    walks[index]()
                    times[index].append(time.perf_counter() - start)
        flops = args.tiles * 4 * rows * keys * dim
        plain, packed = (flops / statistics.median(t) / 1e9 for t in times)
        print(f"{rows} rows x {keys} keys, E = {dim}: plain {plain:.0f} GFLOP/s, packed once "
              f"{packed:.0f} GFLOP/s ({packed / plain:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
