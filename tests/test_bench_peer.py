"""``kvstore bench tiers --peer lmcache`` (bench/tiers/peer.py): a missing peer is one line, never a
failure; the rows beside the peer give both stores' GB/s, each as a ratio to the same limit, and
kvstore / LMCache. CI never has the peer's venv (make peers): the kvstore side runs for real."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from kvstore.bench import tiers
from kvstore.bench.tiers import peer as tiers_peer
from kvstore.bench.tiers.report import peer_table


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    tiers.add_args(p)
    return p.parse_args(argv)


SMALL = ["--total-mb", "8", "--block-tokens", "16", "--layers", "2", "--concurrency", "1", "--repeats", "1",
         "--batch", "4"]


def test_no_peer_venv_is_one_line(tmp_path):
    assert tiers_peer.Peer.start(venv=tmp_path / "nowhere") == "lmcache peer not installed: run make peers"


def test_a_venv_without_lmcache_is_one_line_too():
    """The test venv has no LMCache: the peer process starts, its hello fails, and that is the line."""
    got = tiers_peer.Peer.start(venv=Path(sys.executable).parent.parent)
    assert isinstance(got, str) and got.startswith("lmcache peer not installed: run make peers")
    assert "lmcache" in got.split("make peers", 1)[1] and "\n" not in got


def test_bench_without_the_peer_prints_one_line_and_measures_the_rest(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tiers_peer, "VENV", tmp_path / "no-venv")
    data = tiers.run(_args(SMALL + ["--tiers", "dram", "--peer", "lmcache", "--dir", str(tmp_path)]))
    out = capsys.readouterr().out
    assert out.count("lmcache peer not installed: run make peers") == 2  # the line, and the report's note
    assert "Traceback" not in out
    assert data["peer"] == "lmcache peer not installed: run make peers" and data["peer_choices"] is None
    assert [r["path"] for r in data["results"]] == ["store", "store"] and all(r["verified"] for r in data["results"])


def test_unknown_peer_is_refused():
    with pytest.raises(SystemExit):
        _args(["--peer", "nonsense"])


def test_rows_beside_the_peer(tmp_path):
    """kvstore's side measured for real; the LMCache rows are what its process would send, at half
    kvstore's speed (formatting only: the peer's own numbers need its venv)."""
    data = tiers.run(_args(SMALL + ["--tiers", "dram,nvme", "--nvme-paths", "store,blockio", "--dir", str(tmp_path)]))
    rows = data["results"]
    assert {r["path"] for r in rows if r["tier"] == "nvme"} == {"store", "blockio"}
    peer_rows = [{**r, "path": "lmcache", "gbps": r["gbps"] / 2, "gbps_runs": [g / 2 for g in r["gbps_runs"]],
                  "ratio": r["ratio"] / 2, "cpu_us_blk": 7.0}
                 for r in rows if r["path"] == "store" and r["op"] != "put_full"]  # the peer: put and get
    table = peer_table(rows + peer_rows)
    lines = [ln for ln in table.splitlines() if ln.startswith("| dram") or ln.startswith("| nvme")]
    assert len(lines) == 4  # (dram, nvme) x (put, get)
    head = table.splitlines()[0]
    for col in ("kvstore GB/s", "blockio GB/s", "LMCache GB/s", "kvstore x", "blockio x", "LMCache CPU us/blk"):
        assert col in head
    cols = [c.strip() for c in head.strip("|").split("|")]
    for ln in lines:
        vals = [c.strip() for c in ln.strip("|").split("|")]
        cells = dict(zip(cols, vals))
        assert float(cells["kvstore x"]) == pytest.approx(2.0, abs=2e-3)
        lim = float(cells["limit GB/s"])
        for store in ("kvstore GB/s", "blockio GB/s", "LMCache GB/s"):  # each followed by its ratio to the limit
            i = cols.index(store)
            if store == "blockio GB/s" and cells["tier"] == "dram":
                assert vals[i] == ""  # no engine on DRAM
                continue
            assert cols[i + 1] == "ratio" and float(vals[i + 1]) == pytest.approx(float(vals[i]) / lim, abs=2e-3)
        assert cells["bytes ok"] == "yes"
    choices = [list(c) for c in tiers_peer.CHOICES]
    text = tiers.render({**data, "results": rows + peer_rows, "peer": "lmcache 0.5.6", "peer_choices": choices})
    assert "kvstore beside lmcache 0.5.6" in text
    said = text.split("How the peer is driven, each choice and the side it favours:\n", 1)[1].splitlines()
    assert said[:len(choices)] == [f"- {what}: favours {whom}" for what, whom in choices]
    assert {"LMCache", "kvstore"} <= {whom.split()[0] for _, whom in choices}  # each side is named
