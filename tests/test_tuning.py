"""`attnperf tune`'s table: "auto" follows it only when valid here, else sdpa first on CPU."""

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from attnperf import cpu_table, dispatch
from attnperf.bench import tune
from attnperf.inputs import prepare
from attnperf.serving import prepare_kvcache


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache directory, the measured machine's 2 threads, no table read yet."""
    monkeypatch.setenv("ATTNPERF_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    cpu_table.load_table.cache_clear()
    cpu_table._mismatch_warned.cache_clear()
    yield tmp_path
    cpu_table.load_table.cache_clear()


def measured_table(**changes):
    """A table as calibrate writes it: numba first from 2048 when causal or training."""
    rules = [
        {"head_dim": head_dim, "gqa": gqa, "causal": causal, "backward": backward,
         "numba_from": 2048 if causal or backward else None, "ratios": {"2048": 1.05}}
        for head_dim, gqa in ((64, False), (128, False), (64, True), (128, True))
        for causal in (False, True)
        for backward in (False, True)
    ]  # fmt: skip
    table = {"schema": cpu_table.SCHEMA, "measured": "today",
             "fingerprint": cpu_table.fingerprint(), "lengths": [1024, 2048], "rounds": 1,
             "rules": rules,
             "decode": [{"numba_from_bytes": 2**20, "ratios": {"1048576": 1.1},
                         "dtype": "float32"}]}  # fmt: skip
    table.update(changes)
    return table


def big(length=2048, head_dim=64, requires_grad=False, kv_heads=8):
    q = torch.empty(1, 8, length, head_dim, requires_grad=requires_grad)
    k, v = (torch.empty(1, kv_heads, length, head_dim, requires_grad=requires_grad)
            for _ in range(2))  # fmt: skip
    return q, k, v


CALLS = {
    "causal-2048": ((big(), {"is_causal": True}), True),
    "training-2048": ((big(requires_grad=True), {}), True),
    "inference-full-2048": ((big(), {}), False),
    "causal-1024": ((big(1024), {"is_causal": True}), False),
    "head-dim-96-as-128": ((big(head_dim=96), {"is_causal": True}), True),
    "head-dim-256-unmeasured": ((big(head_dim=256), {"is_causal": True}), False),
    "masked": ((big(), {"attn_mask": torch.ones(2048, 2048, dtype=torch.bool)}), False),
    "fp16": ((tuple(t.half() for t in big()), {"is_causal": True}), False),
    "bf16-unmeasured": ((tuple(t.bfloat16() for t in big()), {"is_causal": True}), False),
    "gqa-2-kv-heads-training": ((big(requires_grad=True, kv_heads=2), {}), True),
    "gqa-head-dim-128-causal": ((big(head_dim=128, kv_heads=2), {"is_causal": True}), True),
    "gqa-fewer-kv-heads-than-threads": ((big(requires_grad=True, kv_heads=1), {}), False),
}


def order(tensors, options):
    gqa = tensors[1].shape[1] != tensors[0].shape[1]
    return dispatch.priority(prepare(*tensors, **options, enable_gqa=gqa))[:2]


@pytest.mark.parametrize("call, numba_first", CALLS.values(), ids=CALLS.keys())
def test_auto_follows_the_measured_table(call, numba_first, cache):
    tune.write_table(measured_table(), cache / cpu_table.FILE_NAME)
    assert order(*call) == (("numba", "sdpa") if numba_first else ("sdpa", "numba"))


def test_bf16_calls_follow_their_own_rules(cache):
    """bf16 rules (`dtype`) decide bf16 calls only; the fp32 ones stay fp32's."""
    table = measured_table()
    bf16 = [{**rule, "dtype": "bfloat16", "numba_from": 1024} for rule in table["rules"]]
    fp32 = [{**rule, "numba_from": None} for rule in table["rules"]]
    tune.write_table({**table, "rules": fp32 + bf16}, cache / cpu_table.FILE_NAME)
    causal = {"is_causal": True}
    assert order(tuple(t.bfloat16() for t in big()), causal) == ("numba", "sdpa")
    assert order(big(), causal) == ("sdpa", "numba")
    assert order(tuple(t.half() for t in big()), causal) == ("sdpa", "numba")


def test_without_a_table_cpu_calls_go_to_sdpa_first(cache):
    for call, _ in CALLS.values():
        assert order(*call) == ("sdpa", "numba")
    assert "built-in default" in cpu_table.active_rules()[1]


INVALID = {
    "corrupt-json": ("{not json", "ignores the tuning table"),
    "other-schema": (json.dumps(measured_table(schema=0)), "schema 0"),
    "malformed-rules": (json.dumps(measured_table(rules=[{"head_dim": 64}])), "malformed"),
    "malformed-decode": (json.dumps(measured_table(decode=[{"ratios": {}}])), "malformed decode"),
    "decode-of-fp16": (
        json.dumps(measured_table(decode=[{"numba_from_bytes": 0, "ratios": {},
                                           "dtype": "float16"}])),
        "dtype 'float16'",
    ),
    "another-cpu": (
        json.dumps(measured_table(fingerprint={**cpu_table.fingerprint(), "cpu_model": "Other"})),
        "measured with cpu_model 'Other'",
    ),
    "other-threads": (
        json.dumps(measured_table(fingerprint={**cpu_table.fingerprint(), "threads": 64})),
        "measured with threads 64",
    ),
    "stale-versions": (
        json.dumps(measured_table(fingerprint={**cpu_table.fingerprint(),
                                               "versions": {"attnperf": "0.0.1"}})),
        "measured with versions",
    ),
}  # fmt: skip


def decode_step(keys: int, dtype=torch.float32, **options):
    """A one-token step over `keys` cached keys per sequence, B = 2, 8/2 heads, E = 64:
    keys x 2 KiB of fp32 K and V, 1 KiB of bf16."""
    q = torch.empty(2, 1, 8, 64, dtype=dtype)
    cache = torch.empty(2, keys, 2, 64, dtype=dtype)
    return prepare_kvcache(q, cache, cache, keys, **options)


# (the step, numba first with measured_table's decode rule (numba from 1 MiB), without a table)
DECODE_CALLS = {
    "step-2-MiB": (decode_step(1024), True, False),
    "step-half-MiB": (decode_step(256), False, False),
    "step-window": (decode_step(256, window=(64, 0)), True, True),  # sdpa would need a mask
    "step-bf16-unmeasured": (decode_step(1024, torch.bfloat16), False, False),
}


@pytest.mark.parametrize("inputs, with_table, without", DECODE_CALLS.values(),
                         ids=DECODE_CALLS.keys())  # fmt: skip
def test_decoding_follows_the_measured_cache_size(inputs, with_table, without, cache):
    first = {True: ("numba", "sdpa"), False: ("sdpa", "numba")}
    assert dispatch.priority(inputs)[:2] == first[without]
    tune.write_table(measured_table(), cache / cpu_table.FILE_NAME)
    assert dispatch.priority(inputs)[:2] == first[with_table]


def test_bf16_steps_follow_their_own_decode_rule(cache):
    """A bf16 decode rule (`dtype`) decides bf16 steps by their own bytes of K and V (here
    numba from 512 KiB: 512 keys a sequence); the fp32 rule stays fp32's, and fp16 steps
    have none."""
    table = measured_table()
    bf16 = {**table["decode"][0], "numba_from_bytes": 2**19, "dtype": "bfloat16"}
    fp32 = {**table["decode"][0], "numba_from_bytes": None}
    tune.write_table({**table, "decode": [fp32, bf16]}, cache / cpu_table.FILE_NAME)
    first = {True: ("numba", "sdpa"), False: ("sdpa", "numba")}
    steps = [(512, torch.bfloat16, True), (511, torch.bfloat16, False),
             (4096, torch.float32, False), (4096, torch.float16, False)]  # fmt: skip
    for keys, dtype, numba_first in steps:
        assert dispatch.priority(decode_step(keys, dtype))[:2] == first[numba_first]
    lengths = dispatch.step_lengths(decode_step(600, torch.bfloat16), "auto")
    assert lengths == range(512, sys.maxsize)


@pytest.mark.parametrize("keys, window", [(256, None), (1024, None), (1, None), (256, (64, 0))])
def test_a_kept_auto_step_serves_the_lengths_of_its_choice(keys, window, cache):
    """dispatch.step_lengths: at every length it holds, "auto" chooses for a step as it
    chose for the step kept, reading the same features; the decode rule (numba from 1 MiB:
    512 keys a sequence here) bounds it where it decides."""
    tune.write_table(measured_table(), cache / cpu_table.FILE_NAME)
    kept = decode_step(keys, window=window)
    lengths = dispatch.step_lengths(kept, "auto")
    assert keys in lengths
    for length in (0, 1, 2, 255, 511, 512, 513, 4096):
        step = decode_step(length, window=window)
        if length in lengths:
            assert dispatch.select(step) is dispatch.select(kept)
            assert step.features() == kept.features()
    ruled = window is None and keys > 1  # one key, unshifted, holds that length alone
    assert ((511 in lengths) != (512 in lengths)) == ruled
    assert dispatch.step_lengths(kept, "numba") == dispatch.step_lengths(kept, "sdpa")


@pytest.mark.parametrize("text, warning", INVALID.values(), ids=INVALID.keys())
def test_an_invalid_table_is_ignored_with_a_warning(text, warning, cache):
    (cache / cpu_table.FILE_NAME).write_text(text)
    call, _ = CALLS["causal-2048"]
    with pytest.warns(RuntimeWarning, match=warning):
        assert order(*call) == ("sdpa", "numba")
    assert "built-in default" in cpu_table.active_rules()[1]


@pytest.mark.parametrize(
    "ratios, expected",
    [
        ({1024: 0.9, 2048: 1.02, 4096: 1.1}, 2048),
        ({1024: 1.1, 2048: 0.95, 4096: 1.1}, 4096),  # faster only from where it stays faster
        ({1024: 1.1, 2048: 1.2, 4096: 1.0}, 1024),
        ({1024: 0.9, 2048: 0.99, 4096: 0.98}, None),
    ],
)
def test_numba_first_from_the_length_where_it_stays_faster(ratios, expected):
    assert tune.numba_from(ratios) == expected


def test_small_decode_sizes_stand_by_the_slower_of_two_shapes(monkeypatch):
    """Up to SMALL_DECODE_BYTES the rule's ratio is the lower of Llama-3-8B's step and a
    small model's (8/2 heads, head-major) at the same bytes; above, Llama-3-8B's alone."""

    steps = []  # (keys, heads, kv heads, head-major) of each race

    def race(config, calls):  # numba 1.5x sdpa's speed at 32/8 heads, 0.75x at 8/2
        steps.append((*calls["numba"].args[2:5], calls["numba"].args[9]))
        numba_s = 1.0 if calls["numba"].args[3] == 32 else 2.0
        return {"sdpa": SimpleNamespace(median_s=1.5), "numba": SimpleNamespace(median_s=numba_s)}

    monkeypatch.setattr(tune.serving, "race", race)
    rule = tune.calibrate_decode((64, 4096), 1, 2, lambda _: None, "bfloat16")
    assert rule.dtype == "bfloat16" and rule.ratios == {2**18: 0.75, 2**24: 1.5}
    assert rule.numba_from_bytes == 2**24 > tune.SMALL_DECODE_BYTES
    assert steps == [(64, 32, 8, False), (256, 8, 2, True), (4096, 32, 8, False)]


def test_tune_writes_a_table_that_auto_then_reads(tmp_path):
    """End to end at tiny lengths: the command measures, writes, and info reports it."""
    env = {"ATTNPERF_CACHE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    command = [sys.executable, "-m", "attnperf", "tune", "--lengths", "64", "128",
               "--decode-lengths", "32", "--rounds", "1"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600,
                            check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    table = json.loads((tmp_path / cpu_table.FILE_NAME).read_text())
    assert len(table["rules"]) == len(tune.DTYPES) * len(tune.SHAPES) * 4
    assert {rule["dtype"] for rule in table["rules"]} == set(tune.DTYPES)
    assert all(set(rule["ratios"]) == {"64", "128"} for rule in table["rules"])
    assert [rule["dtype"] for rule in table["decode"]] == list(tune.DTYPES)
    assert all(len(rule["ratios"]) == 1 for rule in table["decode"])
    info = subprocess.run([sys.executable, "-m", "attnperf", "info"], capture_output=True,
                          text=True, env=env, timeout=300, check=False)  # fmt: skip
    assert f"measured table {tmp_path / cpu_table.FILE_NAME}" in info.stdout
    for rule in table["decode"]:
        assert f"{rule['dtype']} decoding steps: " in info.stdout
