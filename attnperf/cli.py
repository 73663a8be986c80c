"""`attnperf` command line: `info` (the capability table), `smoke` and `bench`."""

from __future__ import annotations

import argparse
import sys

import torch

import attnperf


def info_table() -> str:
    rows = [("backend", "status", "devices", "dtypes", "max head dim", "features")]
    for entry in attnperf.backends():
        status = (
            "available" if entry["available"] else f"unavailable: {entry['unavailable_reason']}"
        )
        rows.append(
            (
                str(entry["name"]),
                status,
                ",".join(entry["devices"]),
                ",".join(entry["dtypes"]),
                str(entry["max_head_dim"] or "any"),
                ",".join(entry["features"]),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows)
    return "\n".join(line.rstrip() for line in lines)


def smoke(device: str) -> int:
    """Run one small call on every available backend and compare it with sdpa."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 128, 64, device=device) for _ in range(3))
    expected = attnperf.attention(q, k, v, is_causal=True, backend="sdpa")
    failures = 0
    for entry in attnperf.backends():
        name = str(entry["name"])
        try:
            out = attnperf.attention(q, k, v, is_causal=True, backend=name)
        except attnperf.BackendNotSupportedError as error:
            print(f"{name:10s} skipped: {error}")
            continue
        err = (out - expected).abs().max().item()
        ok = err < 1e-4
        failures += not ok
        print(f"{name:10s} max |out - sdpa| = {err:.2e}  {'ok' if ok else 'MISMATCH'}")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="attnperf", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="print every backend's capabilities and availability")
    smoke_parser = commands.add_parser("smoke", help="one small call on every available backend")
    smoke_parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    if args.command == "info":
        print(f"attnperf {attnperf.__version__}, torch {torch.__version__}")
        print(info_table())
        return 0
    return smoke(args.device)


if __name__ == "__main__":
    sys.exit(main())
