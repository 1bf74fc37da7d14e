"""bench/copy/gpu_tax.py runs where CI runs (a CPU, float32, tiny shapes), so the GPU session that
runs it for real finds it working: every design's rounds are timed beside the engine alone, and the
store really took the steps' blocks (stored in DRAM, demoted to files), in both save orders."""

from __future__ import annotations

import json

import pytest

from kvstore.bench.copy import gpu_tax

TINY = ["--device", "cpu", "--dtype", "float32", "--rounds", "2", "--steps", "4", "--tokens", "64",
        "--layers", "2", "--hidden", "128", "--ffn", "256", "--kv-heads", "2", "--head-size", "64",
        "--dram-gb", "0.0005", "--nvme-gb", "0.01"]


@pytest.mark.parametrize("order", [[], ["--save-after-sync"]])
def test_every_design_is_timed_and_the_store_takes_the_blocks(order, tmp_path):
    out = tmp_path / "out"
    assert gpu_tax.main([*TINY, *order, "--dir", str(tmp_path / "d"), "--out", str(out),
                         "--designs", "sync,async,async0,async4"]) == 0
    res = json.loads((out / "gpu_tax.json").read_text())
    assert [r["design"] for r in res["rows"]] == ["sync", "async", "async0", "async4"]
    assert len(res["times_s"]["off"]) == 2
    blocks = 3 * 4 * 4  # warm-up + 2 rounds, 4 steps, 64 tokens / 16 a block
    for r in res["rows"]:
        assert len(r["ratios"]) == 2 and all(x > 0 for x in r["ratios"])
        assert r["stored_blocks"] + sum(r["skipped"].values()) == blocks, r  # every block went somewhere
        assert r["stored_blocks"] > 0 and r["demoted_blocks"] > 0, r  # DRAM holds 8: the rest were demoted
    assert "| async4 |" in (out / "gpu_tax.md").read_text()


def test_a_design_that_does_not_exist_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="allowed: sync, async, asyncN"):
        gpu_tax.main([*TINY, "--dir", str(tmp_path), "--designs", "sync,fast"])
