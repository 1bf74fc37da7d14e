"""Fault family 9, ``engine``: the engine-level fault matrix (``bench/faults/engine_driver.py``, one
driver process per engine) run as a family of ``kvstore bench faults``."""

from __future__ import annotations

import json
import os
import sys

from kvstore.bench.faults.families.common import REPO


def family(work: str, *, quick: bool, advance=lambda n=1: None) -> dict:
    """The matrix as a fault family: a reference run, then in-process (and, unless ``quick``,
    multiprocess) engines with the DRAM tier off and on. Figures: corrupt_served, poisoned_stores."""
    import importlib.util
    import subprocess

    if importlib.util.find_spec("vllm") is None:
        return {"skipped": "vLLM is not installed"}
    from kvstore.bench.common.tiny_model import build_tiny_llama

    model = build_tiny_llama(os.path.join(work, "model"), hidden=256, layers=4, seed=0)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

    def drive(args, extra=None) -> dict:
        p = subprocess.run([sys.executable, "-m", "kvstore.bench.faults.engine_driver", *args], capture_output=True,
                           text=True, env={**env, **(extra or {})}, cwd=REPO, timeout=1800)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        if p.returncode or not lines:
            raise RuntimeError(f"kvstore.bench.faults.engine_driver {' '.join(args)} failed:\n{p.stderr[-3000:]}")
        return json.loads(lines[-1][len("RESULT "):])

    ref, ref_store = os.path.join(work, "ref.json"), os.path.join(work, "ref-store")
    drive(["--reference", "--model", model, "--store", ref_store, "--out", ref])
    advance()
    runs = []
    for mp in ([False] if quick else [False, True]):
        for dram in (0, 1):
            tag = f"{'mp' if mp else 'inproc'}-dram{dram}"
            ctl = os.path.join(work, f"{tag}.failpoints")
            open(ctl, "w").close()
            runs.append(drive(["--model", model, "--store", os.path.join(work, tag), "--ref", ref, "--ref-store",
                               ref_store, "--dram", str(dram), "--out", os.path.join(work, f"{tag}.json")]
                              + (["--mp"] if mp else []), {"KVSTORE_FAILPOINTS": f"@{ctl}"}))
            advance()
    rows = []
    for r in runs:
        for name, f in r["faults"].items():
            rows.append({"mode": r["mode"], "dram": r["dram"], "fault": name, "wrong": f["wrong_outputs"],
                         "healed": f["healed"], "loads_failed": f["loads_failed_blocks"],
                         "recomputed": f["tokens_recomputed"], "stored_again": f["blocks_stored_again"],
                         "skipped": f["stores_skipped_failed_load"], "errors": f["store_errors"],
                         "corrupt_files": f["corrupt_files"]})
    return {"corrupt_served": sum(r["corrupt_served"] for r in runs),
            "poisoned_stores": sum(r["poisoned_stores"] for r in runs),
            "engine_blocks_compared": sum(r["blocks_compared"] for r in runs),
            "engine_follow_ups": sum(f["follow_ups"] for r in runs for f in r["faults"].values()),
            "engine_not_healed": sum(1 for row in rows if row["healed"] is False),
            "engine_runs": len(runs), "rows": rows}
