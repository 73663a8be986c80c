"""The measured CPU table that "auto" reads: numba first for a call class from a length on,
and for decoding steps from a cache size on.

CPU kernels' relative speed depends on the CPU (AVX2 or AVX-512, cache sizes, cores), so the
choice between numba and sdpa is measured where it is made (`attnperf tune`, the tooling's
attnperf.bench.tune) and read here. The file lives in the user's cache directory with what it
was measured on: CPU model, ISA flags, thread count, package versions. "auto" reads it only
where all of these match this process; otherwise, or without a file, CPU calls go to sdpa
first (the conservative default). A file that cannot be read, or was measured elsewhere, is
ignored with a warning, never an error.
"""

from __future__ import annotations

import functools
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from attnperf.inputs import AttentionInputs
from attnperf.machine import cpu_description
from attnperf.serving import KVCacheInputs
from attnperf.version import __version__

SCHEMA = 2  # 2: a decode rule per dtype
MEASURED_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}  # `attnperf tune`'s
FILE_NAME = "cpu-dispatch.json"


def table_path() -> Path:
    """$ATTNPERF_CACHE_DIR, else $XDG_CACHE_HOME/attnperf, else ~/.cache/attnperf; the file."""
    return _table_path(os.environ.get("ATTNPERF_CACHE_DIR"), os.environ.get("XDG_CACHE_HOME"))


@functools.cache  # "auto" asks on every CPU call: building the Path cost a decode step much
def _table_path(folder: str | None, cache: str | None) -> Path:
    if not folder:
        folder = Path(cache or Path.home() / ".cache") / "attnperf"
    return Path(folder) / FILE_NAME


def fingerprint(threads: int | None = None) -> dict:
    """What a measurement is valid for: this CPU, the thread count and the packages."""
    return _fingerprint(threads or torch.get_num_threads())


@functools.cache  # "auto" compares it on every CPU call while a table is in force
def _fingerprint(threads: int) -> dict:
    try:
        import numba

        numba_version = numba.__version__
    except ImportError:
        numba_version = None
    cpu = cpu_description()
    return {
        "cpu_model": cpu["cpu_model"],
        "isa_flags": cpu["isa_flags"],
        "torch_cpu_capability": cpu["torch_cpu_capability"],
        "threads": threads,
        "versions": {"attnperf": __version__, "torch": torch.__version__,
                     "numba": numba_version},
    }  # fmt: skip


@dataclass(frozen=True)
class Rule:
    """One measured class and its decision: numba first from `numba_from` = L = S on (None:
    never, within the lengths measured). A table without a dtype holds fp32 rules."""

    head_dim: int
    gqa: bool
    causal: bool
    backward: bool
    numba_from: int | None
    ratios: dict[int, float]  # numba's speed / sdpa's, same run, per length
    dtype: str = "float32"  # "float32" or "bfloat16"


@dataclass(frozen=True)
class DecodeRule:
    """The measured decoding class (one query token per sequence over its whole cache in
    `dtype`, which SDPA serves with the group packed as rows): numba first from
    `numba_from_bytes` of K and V read per call on (None: never, within the sizes measured)."""

    numba_from_bytes: int | None
    ratios: dict[int, float]  # numba's speed / sdpa's, same run, per bytes of K and V
    dtype: str = "float32"  # "float32" or "bfloat16"


def _decode_rules(table: dict) -> list[DecodeRule]:
    """The table's decode rules, one per measured dtype, or ValueError when malformed."""
    try:
        rules = [DecodeRule(**{**r, "ratios": {int(k): v for k, v in r["ratios"].items()}})
                 for r in table.get("decode", [])]  # fmt: skip
    except (KeyError, TypeError, AttributeError, ValueError) as error:
        raise ValueError(f"malformed decode rule ({type(error).__name__}: {error})") from None
    for rule in rules:
        if rule.numba_from_bytes is not None and not isinstance(rule.numba_from_bytes, int):
            raise ValueError(f"malformed decode rule {rule}")
        if rule.dtype not in MEASURED_DTYPES.values():
            raise ValueError(f"malformed decode rule {rule}: dtype {rule.dtype!r}")
    return rules


def _rules(table: dict) -> list[Rule]:
    """The table's rules, or ValueError when its layout is not this schema's."""
    if table.get("schema") != SCHEMA:
        raise ValueError(f"schema {table.get('schema')!r}, this attnperf reads {SCHEMA}")
    try:
        rules = [Rule(**{**r, "ratios": {int(k): v for k, v in r["ratios"].items()}})
                 for r in table["rules"]]  # fmt: skip
    except (KeyError, TypeError, AttributeError, ValueError) as error:
        raise ValueError(f"malformed rules ({type(error).__name__}: {error})") from None
    for rule in rules:
        if rule.numba_from is not None and not isinstance(rule.numba_from, int):
            raise ValueError(f"malformed rule {rule}")
    return rules


@functools.cache
def load_table(
    path: Path | None = None,
) -> tuple[dict | None, list[Rule], dict[str, DecodeRule], str]:
    """(the table or None, its rules, its decode rules by dtype name, what is in force and
    why); read once per process.

    A file that is corrupt or not of this schema is ignored with a warning."""
    path = path or table_path()
    if not path.exists():
        return None, [], {}, f"built-in default (sdpa first on CPU): no table at {path}"
    try:
        table = json.loads(path.read_text())
        if not isinstance(table, dict):
            raise ValueError("not a JSON object")
        rules = _rules(table)
        decode_rules = {rule.dtype: rule for rule in _decode_rules(table)}
    except (OSError, ValueError) as error:
        message = f"attnperf ignores the tuning table {path}: {error}; run `attnperf tune`"
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        return None, [], {}, f"built-in default (sdpa first on CPU): {message}"
    return table, rules, decode_rules, f"measured table {path} ({table.get('measured', '?')})"


@functools.cache
def _mismatch_warned(path: Path, reason: str) -> None:
    warnings.warn(
        f"attnperf ignores the tuning table {path}: {reason}; run `attnperf tune` again",
        RuntimeWarning,
        stacklevel=3,
    )


def active_rules() -> tuple[list[Rule], str]:
    """The rules "auto" follows now (empty: sdpa first) and a line saying which and why."""
    path = table_path()
    table, rules, _, status = load_table(path)
    if table is None:
        return [], status
    measured, here = table.get("fingerprint", {}), fingerprint()
    for key in ("cpu_model", "isa_flags", "torch_cpu_capability", "threads", "versions"):
        if measured.get(key) != here[key]:
            reason = f"measured with {key} {measured.get(key)!r}, this process has {here[key]!r}"
            _mismatch_warned(path, reason)
            return [], f"built-in default (sdpa first on CPU): table {path} {reason}"
    return rules, status


def active_decode_rule(dtype: torch.dtype) -> DecodeRule | None:
    """The decode rule "auto" follows now for steps in `dtype`: the valid table's, else None
    (sdpa first)."""
    rules, _ = active_rules()
    if not rules or dtype not in MEASURED_DTYPES:
        return None
    return load_table(table_path())[2].get(MEASURED_DTYPES[dtype])


def decode_numba_leads(inputs: KVCacheInputs, rule: DecodeRule) -> bool:
    """Whether the measured decode rule puts numba first for this step: by the bytes of K
    and V it reads (the same bytes ran at the same speed ratio whatever the heads and length:
    8 and 128 MiB, 32/8 and 8/2 heads, fp32, 2-core AVX-512 machine; small steps, whose
    fixed costs differ by heads and layout, are measured in two shapes: `attnperf tune`)."""
    first = decode_numba_from_keys(rule, inputs.key_bytes)
    return first is not None and inputs.kv_keys >= first


def decode_numba_from_keys(rule: DecodeRule, key_bytes: int) -> int | None:
    """The fewest keys (summed over a step's sequences, `key_bytes` of K and V each) from
    which the decode rule puts numba first; None: at none."""
    if rule.numba_from_bytes is None:
        return None
    if key_bytes == 0:
        return 0 if rule.numba_from_bytes <= 0 else None
    return -(-rule.numba_from_bytes // key_bytes)  # the bytes' ceiling division


def numba_leads(inputs: AttentionInputs, rules: list[Rule]) -> bool:
    """Whether the measured rules put numba first for this CPU call.

    Only what was measured counts: fp32 or bf16 without a mask, a head dim up to a measured
    one (the next one up stands for it), grouped-query calls only with a (batch, kv head)
    pair per thread (numba's backward shares its work out by them)."""
    dtype = MEASURED_DTYPES.get(inputs.dtype)
    if dtype is None or inputs.attn_mask is not None:
        return False
    gqa = inputs.q_heads != inputs.kv_heads
    if gqa and inputs.batch * inputs.kv_heads < torch.get_num_threads():
        return False
    head_dim = max(inputs.head_dim, inputs.value_dim)
    fitting = [r for r in rules if r.dtype == dtype and r.gqa == gqa and r.head_dim >= head_dim
               and r.causal == inputs.is_causal and r.backward == inputs.needs_grad]  # fmt: skip
    if not fitting:
        return False
    rule = min(fitting, key=lambda r: r.head_dim)
    return rule.numba_from is not None and min(inputs.q_len, inputs.kv_len) >= rule.numba_from
