"""``kvstore tune`` says what it searched and where its numbers come from (issue 33): every
capacity and TTL it replayed is printed and plotted (a staged search's DRAM slice is not at the
recommendation's NVMe setting), its budget and block size come from the trace's ``recorded``
field or ``--model-shape`` (an assumption is printed as one), and it refuses to write a YAML
whose NVMe blocks would live in a temporary folder unless asked."""

from __future__ import annotations

import json

from kvstore.config import load_config
from kvstore.tune import searched as S
from kvstore.tune.cli import main as tune_main
from kvstore.tune.recommend import setting
from kvstore.tune.trace_memory import RECORDED_KEY, load_trace, recorded_fields, synth_records, write_records

GRID = ["--dram-ttls", "30,60,5m,none", "--nvme-ttls", "10m,1h,none", "--jobs", "2", "--quiet"]


def trace(tmp_path, recorded: dict | None = None):
    p = tmp_path / "t.jsonl"
    write_records(p, synth_records(sessions=60, turns=6, think=(10.0, 59.0), arrival_s=900, seed=3))
    if recorded is not None:
        lines = p.read_text().splitlines()
        first = json.loads(lines[0])
        first[RECORDED_KEY] = recorded
        p.write_text("\n".join([json.dumps(first)] + lines[1:]) + "\n")
    return p


def run(tmp_path, capsys, *args) -> tuple[int, dict | None, str, str]:
    js = tmp_path / "r.json"
    js.unlink(missing_ok=True)
    rc = tune_main(["--json", str(js), *args])
    cap = capsys.readouterr()
    return rc, (json.loads(js.read_text()) if js.exists() else None), cap.out, cap.err


def test_budget_and_block_from_the_recorded_trace(tmp_path, capsys):
    tiers = {"dram": {"capacity_gb": 0.5, "policy": "lru_shared"}, "nvme": {"capacity_gb": 3, "path": "/srv/kv"}}
    tp = trace(tmp_path, recorded_fields(tiers, 3 << 20, 16, "a test"))
    assert load_trace(tp).recorded["block_bytes"] == 3 << 20
    rc, res, out, err = run(tmp_path, capsys, "--trace", str(tp), "--out", str(tmp_path / "t.yaml"), *GRID)
    assert rc == 0 and err == ""  # nothing assumed, no warning
    assert res["budget"] == {"dram_gb": 0.5, "nvme_gb": 3} and res["block_bytes"] == 3 << 20
    assert res["sources"]["budget"].startswith("the config that recorded the trace (a test)")
    assert "Block: 3 MiB (recorded in the trace by a test)." in out
    cfg = load_config(tmp_path / "t.yaml", environ={})  # the recorded path and policy carry over
    assert cfg.tiers.nvme.path == "/srv/kv" and cfg.tiers.dram.policy == "lru_shared"


def test_without_a_record_the_block_is_an_announced_assumption_or_the_model_shape(tmp_path, capsys):
    tp = trace(tmp_path)
    rc, res, out, err = run(tmp_path, capsys, "--trace", str(tp), "--dram-gb", "0.5", "--nvme-gb", "2", *GRID)
    assert rc == 0 and res["block_bytes"] == 16 * 128 * 1024
    assert "warning: block size assumed" in err and "--model-shape" in err and "Block: 2 MiB (assumed" in out
    rc, res, out, err = run(tmp_path, capsys, "--trace", str(tp), "--dram-gb", "0.5", "--nvme-gb", "2",
                            "--model-shape", "4,2,64,float32", *GRID)
    assert rc == 0 and err == "" and res["block_bytes"] == 2 * 4 * 2 * 64 * 4 * 16
    assert res["sources"]["block_bytes"].startswith("--model-shape: 4 layers x 2 KV heads")
    assert "budget" in res["sources"] and "--dram-gb/--nvme-gb" == res["sources"]["budget"]


def test_no_yaml_without_an_nvme_path_unless_asked(tmp_path, capsys):
    tp, out = trace(tmp_path), tmp_path / "t.yaml"
    rc, res, _, err = run(tmp_path, capsys, "--trace", str(tp), "--out", str(out), *GRID)
    assert rc == 2 and res is None and not out.exists()  # refused before the search: nothing written
    assert err.startswith("kvstore tune: error: --out") and "--nvme-path" in err and "--allow-temp-nvme" in err
    rc, *_ = run(tmp_path, capsys, "--trace", str(tp), "--out", str(out), "--nvme-path", str(tmp_path / "kv"), *GRID)
    assert rc == 0 and load_config(out, environ={}).tiers.nvme.path == str(tmp_path / "kv")
    rc, *_ = run(tmp_path, capsys, "--trace", str(tp), "--out", str(out), "--allow-temp-nvme", *GRID)
    assert rc == 0 and load_config(out, environ={}).tiers.nvme.path is None


def test_every_searched_coordinate_is_printed_and_plotted(tmp_path, capsys):
    tp = trace(tmp_path)
    rc, res, out, _ = run(tmp_path, capsys, "--trace", str(tp), "--dram-gb", "0.5", "--nvme-gb", "2", "--search",
                          "staged", "--plots", str(tmp_path / "p"), *GRID)
    assert rc == 0 and res["search"] == "staged"
    rec, grid = res["recommended"], res["grid"]
    key, dram = S.slice_of(grid, rec, "dram")
    # stage 1 varied DRAM with NVMe at its largest capacity and TTL: every DRAM setting is there
    assert (key[0], key[1]) == (2.0, None) and len(dram) == 3 * 4
    assert {(setting(r)[0], setting(r)[1]) for r in dram} == {(c, t) for c in (0.125, 0.25, 0.5)
                                                             for t in (30, 60, 300, None)}
    section = out[out.index("## Searched"):out.index("## Settings")]
    assert "DRAM: 3 capacities x 4 TTLs = 12 settings, at NVMe 2 GB, TTL none" in section
    assert "| DRAM GB \\ TTL | 30s | 1m | 5m | none |" in section
    for cap in ("0.125", "0.25", "0.5"):
        assert f"\n| {cap} | " in section
    other = 0 if setting(rec)[4] == 2 else 2
    assert f"NVMe with admit_after {other}" in section  # the admission stage too (the pick's is the table above)
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["tune_dram.png", "tune_nvme.png"]
