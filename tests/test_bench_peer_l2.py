"""``kvstore bench tiers --peer lmcache-l2`` (bench/tiers/peer_l2.py): kvstore's LMCache L2 adapter
beside LMCache's own L2 adapters, through LMCache's L2AdapterInterface, each figure beside the same
run's O_DIRECT limit. A missing peer venv is one line, never a failure; the measuring test is
skipped cleanly without ``.venv-peers`` (make peers). LMCache's fs adapter needs ``aiofiles`` and its
raw_block adapter its Rust extension; where the peer venv lacks them their rows are one line each."""

from __future__ import annotations

import argparse
import math

import pytest

from kvstore.bench import tiers
from kvstore.bench.tiers import peer_l2


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    tiers.add_args(p)
    return p.parse_args(argv)


SMALL = ["--peer", "lmcache-l2", "--total-mb", "8", "--block-tokens", "16", "--layers", "2", "--concurrency", "1",
         "--repeats", "1", "--batch", "8"]


def test_no_peer_venv_is_one_line(tmp_path, monkeypatch, capsys):
    assert peer_l2.L2Peer.start(venv=tmp_path / "nowhere") == peer_l2.MISSING
    monkeypatch.setattr(peer_l2, "VENV", tmp_path / "no-venv")
    data = tiers.run(_args(SMALL + ["--dir", str(tmp_path)]))
    out = capsys.readouterr().out
    assert data["peer"] == peer_l2.MISSING and data["results"] == []
    assert peer_l2.MISSING in out and "Traceback" not in out


def test_the_flag_is_known():
    assert _args(["--peer", "lmcache-l2"]).peer == "lmcache-l2"


def test_small_run_through_lmcaches_interface(tmp_path, capsys):
    if not peer_l2.VENV.joinpath("bin", "python").exists():
        pytest.skip("no .venv-peers (make peers)")
    data = tiers.run(_args(SMALL + ["--dir", str(tmp_path), "--json", str(tmp_path / "l2.json")]))
    if not str(data["peer"]).startswith("lmcache "):
        pytest.skip(f"peer not usable: {data['peer']}")
    rows = data["results"]
    names = {r["adapter"] for r in rows}
    assert "kvstore" in names
    # every adapter is measured or said to be skipped, in one line with its reason
    said = {s["adapter"] for s in data["skipped"]}
    assert set(peer_l2.ADAPTERS) <= names | said
    assert all("error" in s and "\n" not in s["error"] for s in data["skipped"])
    assert not [s for s in data["skipped"] if "block_tokens" in s]  # no measured run failed
    assert not said & names
    for r in rows:
        assert r["verified"] and r["bad"] == 0 and r["n"] == 64  # 8 MiB of 128 KiB chunks, byte for byte
        for k in ("put_gbps", "put_sync_gbps", "get_gbps", "put_ratio", "put_sync_ratio", "get_ratio",
                  "odirect_write_gbps", "odirect_read_gbps"):
            assert math.isfinite(r[k]) and r[k] > 0, (r["adapter"], k, r[k])
        assert r["put_ratio"] == pytest.approx(r["put_gbps"] / r["odirect_write_gbps"])
        assert r["get_ratio"] == pytest.approx(r["get_gbps"] / r["odirect_read_gbps"])
    out = capsys.readouterr().out
    table = [ln for ln in out.splitlines() if ln.startswith("| 0.125 |")]
    assert len(table) == len(names)
    assert all(ln.rstrip().split("|")[-3].strip() == "yes" for ln in table)  # bytes ok
    assert (tmp_path / "l2.json").exists()
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]  # its folders removed


def test_render_without_results_is_the_line():
    text = peer_l2.render({"peer": peer_l2.MISSING, "results": [], "skipped": []})
    assert peer_l2.MISSING in text
