"""The benchmarks' remote tier (Redis): ``bench/common/redis_local.py``, ``kvstore bench tiers --tiers remote``
(store put/get beside a raw pipelined SET/GETEX on the same server) and ``kvstore bench e2e``'s
``two_engines`` group (engine A stores through Redis, engine B in another process hits it).
Skipped cleanly where ``redis-server`` is not installed (and, for e2e, where vLLM is not)."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics

import pytest

from kvstore.bench import tiers
from kvstore.bench.common import redis_local
from kvstore.tiers.redis.value import MAC_BYTES

pytestmark = pytest.mark.skipif(not redis_local.available(), reason="redis-server is not on PATH")


def _args(mod, argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    mod.add_args(p)
    return p.parse_args(argv)


def test_redis_local_starts_and_stops(tmp_path):
    pw = secrets.token_hex(8)
    with redis_local.start(tmp_path / "r", password=pw) as r:
        assert r.url == f"redis://127.0.0.1:{r.port}" and r.password == pw
        with r.client(socket_timeout=5) as c:
            assert c.ping() and c.config_get("save")["save"] == ""
        proc = r.proc
    assert proc.poll() is not None and r.proc is None  # terminated and waited for
    r.stop()  # twice is harmless
    tmp = redis_local.start()
    folder = tmp.dir
    tmp.stop()
    assert not folder.exists()  # a temp folder made for it is removed


def _check_rows(rows: list[dict], concurrency: list[int]) -> None:
    """Every op twice: without a secret and with one (``remote+mac``: the MAC's cost beside the raw client)."""
    assert {(r["tier"], r["op"], r["concurrency"]) for r in rows} == {
        (tier, op, c) for tier in ("remote", "remote+mac") for op in ("put", "get") for c in concurrency}
    for r in rows:
        assert r["mac"] is (r["tier"] == "remote+mac")
        assert r["verified"] is True, r
        assert r["gbps"] > 0 and r["limit_gbps"] > 0
        assert r["ratio"] == pytest.approx(statistics.median(g / lim for g, lim in zip(r["gbps_runs"], r["limit_runs"])))
        assert r["limit"] == f"redis {'SET' if r['op'] == 'put' else 'GETEX'} x{r['concurrency']}"
        assert r["get_returned_min"] == r["blocks"] and r["limit_bad_values"] == 0
        mac = MAC_BYTES if r["mac"] else 0  # the MAC'd values carry 32 bytes more
        assert r["stored_bytes"] == r["blocks"] * (r["block_bytes"] + tiers.REMOTE_HEADER + mac)  # codec none
        assert r["put_via"] in ("no local tier", "DRAM write-through")
        assert 0 < r["p50_ms"] <= r["p99_ms"]


def test_tiers_remote_private_server(tmp_path, capsys):
    """No --redis-url: the bench starts its own server and stops it after."""
    out = tmp_path / "t.json"
    data = tiers.run(_args(tiers, ["--tiers", "remote", "--total-mb", "4", "--block-tokens", "16", "--layers", "2",
                                   "--concurrency", "1,2", "--repeats", "2", "--batch", "4", "--dir", str(tmp_path),
                                   "--json", str(out)]))
    assert not data["skipped"], data["skipped"]
    _check_rows(data["results"], [1, 2])
    assert data["params"]["redis"] == "private redis-server" and data["params"]["tiers"] == ["remote"]
    assert json.loads(out.read_text())["results"] == json.loads(json.dumps(data["results"]))
    text = capsys.readouterr().out
    assert "| remote | put | none |" in text and "| remote+mac | get | none |" in text
    assert "redis SET x1" in text and "raw pipelined SET" in text


def test_tiers_remote_given_server_with_password(tmp_path, monkeypatch):
    """--redis-url with a password from KVSTORE_REDIS_PASSWORD; the bench leaves no key behind."""
    pw = secrets.token_hex(8)
    with redis_local.start(tmp_path / "r", password=pw) as r:
        monkeypatch.setenv("KVSTORE_REDIS_PASSWORD", pw)
        data = tiers.run(_args(tiers, ["--tiers", "remote", "--redis-url", r.url, "--total-mb", "2",
                                       "--block-tokens", "16", "--layers", "2", "--concurrency", "2", "--repeats",
                                       "1", "--batch", "2", "--dir", str(tmp_path)]))
        assert not data["skipped"], data["skipped"]
        _check_rows(data["results"], [2])
        assert data["params"]["redis"] == "--redis-url"
        with r.client(socket_timeout=5) as c:
            assert c.dbsize() == 0


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_e2e_two_engines_smallest(tmp_path):
    """Engine A (a process) stores through a private Redis; engine B (another process, empty
    folders) gets every full block from it, and its greedy outputs equal A's."""
    pytest.importorskip("vllm")
    from kvstore.bench import e2e

    data = e2e.run(_args(e2e, ["--lengths", "128", "--cases", "two_engines", "--te-repeats", "1", "--hidden", "128",
                               "--layers", "2", "--dir", str(tmp_path), "--json", str(tmp_path / "e2e.json")]))
    assert data["results"] == [] and data["multi_turn"] == [] and data["no_reuse"] == []  # that group alone
    info = data["two_engines_info"]
    assert info["skipped"] is None and info["redis"].startswith("private")
    [row] = data["two_engines"]
    assert row["prompt_tokens"] == 128 and row["full_block_tokens"] == 96  # all but the last token's block
    assert row["cached_tokens"] == 96 and row["cached_ok"] is True and row["cached_runs"] == [96]
    assert row["a_cached"] == [0]  # A computed it (nothing stored anywhere yet)
    assert row["outputs_equal"] is True
    assert row["recompute_source"] == "engine A's process"
    assert row["b_ttft_ms"] > 0 and row["recompute_ttft_ms"] > 0 and row["a_ttft_ms"] > 0
    assert row["x_recompute"] == pytest.approx(row["b_ttft_ms"] / row["recompute_ttft_ms"])
    c = info["counters"]
    assert c["a"]["remote_written_bytes"] > 0
    # B's hits (the warm-up prompt and the measured one) came from Redis: its folders were empty
    assert c["b"]["served_remote_tokens"] == 2 * 96 and c["b"]["remote_read_bytes"] > 0
    assert info["warmup_cached_b"] == [96]
    text = e2e.render(data)
    assert "Two engines, one Redis" in text and "| 128 |" in text and "96/96 ok" in text
    on_disk = json.loads((tmp_path / "e2e.json").read_text())
    assert on_disk["two_engines"][0]["cached_tokens"] == 96
    # its work folder (the Redis folder in it too) is gone
    assert not [f for f in os.listdir(tmp_path) if f.startswith("kvstore-e2e-")]
