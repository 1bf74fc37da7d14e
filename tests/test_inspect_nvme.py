"""``kvstore inspect DIR`` on a real NVMe tier folder: blocks, bytes, codecs, fingerprints and
ages from the headers only; a foreign file and a writer's leftover temp file are counted, never
read as blocks; the command line prints the same, or JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kvstore.ops.inspect import inspect_folder
from kvstore.store import KVStore

from conftest import BLOCK, FP, blocks_for, make_keys, tiny_config


def test_inspect_a_folder(tmp_path):
    s = KVStore(tiny_config(tmp_path / "n", dram_blocks=0, nvme_blocks=8), block_bytes=BLOCK, fingerprint=FP,
                block_tokens=16)
    keys = make_keys(3, seed=2)
    s.put(keys, blocks_for(keys))
    root = s.nvme.root
    s.close()
    (root / "ab").mkdir(exist_ok=True)
    (root / "ab" / "not-a-block.txt").write_text("x")
    (root / "tmp" / "dead.1.0.tmp").write_bytes(b"half")
    info = inspect_folder(str(tmp_path / "n"), now=None)
    ns = info["namespaces"][root.name]
    assert (info["blocks"], ns["blocks"], ns["codecs"], ns["bad_files"], ns["temp_files"]) == (3, 3, {"none": 3}, 1, 1)
    assert sum(ns["age"].values()) == 3 and ns["age"]["<1m"] == 3
    assert list(ns["fingerprints"].values()) == [3] and ns["payload_bytes"] == 3 * BLOCK
    out = subprocess.run([sys.executable, "-m", "kvstore.ops.cli", "inspect", str(tmp_path / "n"), "--json"],
                         capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert json.loads(out.stdout)["blocks"] == 3
    text = subprocess.run([sys.executable, "-m", "kvstore.ops.cli", "inspect", str(tmp_path / "n")],
                          capture_output=True, text=True, check=True).stdout
    assert "3 blocks" in text and "1 bad file(s)" in text and "age (since last use): <1m 3" in text
