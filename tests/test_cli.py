"""The ``kvstore`` command's conventions, run as a user runs it (a real process each time):
help on stdout, ``--version``, an unknown command or a bad value is one line and exit 2, an
expected failure (a refused connection, a missing file, a folder that is not a tier, an empty
trace) is one line ``kvstore <command>: error: ...`` and never a traceback; ``config`` reports
every bad key; ``size`` is the sizing rule of thumb."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading

import pytest

from kvstore.bench.common.ports import free_port
from kvstore.store.sizing import ModelShape, sizing_line
from kvstore.config import load_config


def kv(*args: str, cwd=None, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstore.ops.cli", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env=env)


def one_error(p: subprocess.CompletedProcess, command: str, code: int) -> str:
    """``p`` failed with ``code`` and exactly one line on stderr, prefixed ``kvstore <command>: error:``."""
    lines = p.stderr.strip().splitlines()
    assert p.returncode == code, (p.returncode, p.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"kvstore{' ' + command if command else ''}: error: "), p.stderr
    assert "Traceback" not in p.stderr and p.stdout == ""
    return lines[0]


def closed_port() -> int:
    return free_port()  # nothing listens there: a connect is refused


def test_help_version_and_unknown_commands():
    p = kv("--help")
    assert p.returncode == 0 and p.stderr == "" and "stats [--url U]" in p.stdout and "http://127.0.0.1:9400/metrics" \
        in p.stdout
    p = kv("stats", "--help")  # argparse help: stdout, and it names the default URL
    assert p.returncode == 0 and "http://127.0.0.1:9400/metrics" in p.stdout and "metrics.port" in p.stdout
    p = kv("--version")
    assert p.returncode == 0 and p.stdout.startswith("kvstore ") and p.stdout.split()[1][0].isdigit()
    assert "unknown command 'nope'" in one_error(kv("nope"), "", 2)
    assert "a command is required" in one_error(kv(), "", 2)
    assert "unknown mode 'nope'" in one_error(kv("bench", "nope"), "bench", 2)
    assert "--nope" in one_error(kv("stats", "--nope"), "stats", 2)  # argparse: one line, not the usage
    msg = one_error(kv("bench", "tiers", "--codecs", "none,lz4"), "bench tiers", 2)
    assert "lz4" in msg and "fp8+zstd" in msg  # the bad one and the known ones
    for cmd in (["tune"], ["explain"], ["bench", "agent"], ["bench", "tiers"]):  # help from docstrings: no reST
        p = kv(*cmd, "--help")
        assert p.returncode == 0 and "``" not in p.stdout and ":mod:" not in p.stdout, (cmd, p.stdout[:300])


def test_stats_failures_are_one_line():
    port = closed_port()
    for url in (f"http://127.0.0.1:{port}/metrics", f"127.0.0.1:{port}"):  # a bare HOST:PORT works too
        msg = one_error(kv("stats", "--url", url), "stats", 1)
        assert f"http://127.0.0.1:{port}/metrics" in msg and f"metrics.port set to {port}" in msg
        assert "9400" not in msg  # the port asked about, not the default's
    assert "expected http://" in one_error(kv("stats", "--url", "ftp://x"), "stats", 2)

    class NotKvstore(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's hook
            body = b"# HELP up other\n# TYPE up gauge\nup 1\n" if self.path == "/metrics" else b"nope"
            self.send_response(200 if self.path == "/metrics" else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotKvstore)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        port = srv.server_address[1]
        assert "no kvstore metrics" in one_error(kv("stats", "--url", f"127.0.0.1:{port}"), "stats", 1)
        assert "HTTP 404" in one_error(kv("stats", "--url", f"http://127.0.0.1:{port}/other"), "stats", 1)
    finally:
        srv.shutdown()


def test_stats_prints_a_servers_labels_escaped():
    """Finding 7: a tag with an ESC sequence cleared the operator's screen in ``kvstore stats``;
    ``--url`` may name any server, so every label it sends is printed escaped."""
    body = ("# TYPE kvstore_engine_prompt_tokens counter\nkvstore_engine_prompt_tokens_total 300\n"
            "# TYPE kvstore_engine_tag_prompt_tokens counter\n"
            'kvstore_engine_tag_prompt_tokens_total{tag="\x1b[2J\x1b]0;owned\x07"} 100\n'
            'kvstore_engine_tag_prompt_tokens_total{tag="a\\nINFO forged line"} 100\n'
            'kvstore_engine_tag_prompt_tokens_total{tag="rtl\u202eevil"} 100\n'
            "# TYPE kvstore_engine_unsupplied_tokens counter\n"
            'kvstore_engine_unsupplied_tokens_total{reason="\x1b[31mred"} 5\n').encode()

    class Hostile(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's hook
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        p = kv("stats", "--url", f"127.0.0.1:{srv.server_address[1]}")
    finally:
        srv.shutdown()
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert not any(c in p.stdout for c in "\x1b\x07\u202e"), p.stdout
    assert not any(ln.startswith("INFO") for ln in p.stdout.splitlines())
    assert "\\x1b[2J\\x1b]0;owned\\x07" in p.stdout and "a\\nINFO forged line" in p.stdout
    assert "rtl\\u202eevil" in p.stdout and "\\x1b[31mred" in p.stdout


def test_stats_reads_a_real_store(tmp_path):
    from kvstore import KVStore, ModelFingerprint, chain_keys
    from kvstore.ops.cli import main

    port = closed_port()
    fp = ModelFingerprint(model="m", dtype="float16", block_size=4, num_layers=1, num_kv_heads=1, head_size=8)
    cfg = load_config(overrides={"tiers": {"dram": {"capacity_gb": 0.001}, "nvme": {"path": str(tmp_path / "n"),
                                                                                     "capacity_gb": 0.01}},
                                 "metrics": {"port": port}})
    import numpy as np

    with KVStore(cfg, block_bytes=4096, fingerprint=fp, block_tokens=4) as store:
        keys = chain_keys(fp, list(range(16)), block_size=4)
        store.put(keys, np.zeros((len(keys), 4096), np.uint8))
        store.contains_prefix(keys, record=True)
        p = kv("stats", "--url", f"127.0.0.1:{port}")
        assert p.returncode == 0 and p.stderr == "" and "store lookups (direct callers): 100.0% of 16" in p.stdout
        assert main(["inspect", str(tmp_path / "n")]) == 0


def test_files_folders_and_traces(tmp_path):
    msg = one_error(kv("inspect", str(tmp_path)), "inspect", 2)  # an empty folder is not a tier
    assert "not a kvstore NVMe tier" in msg and str(tmp_path) in msg
    assert "no such folder" in one_error(kv("inspect", str(tmp_path / "none")), "inspect", 2)
    (tmp_path / "empty.jsonl").write_text("\n")
    assert "no requests" in one_error(kv("explain", "--trace", str(tmp_path / "empty.jsonl")), "explain", 2)
    assert "none.jsonl" in one_error(kv("explain", "--trace", str(tmp_path / "none.jsonl")), "explain", 2)
    (tmp_path / "bad.jsonl").write_text('{"t": 1}\n')
    assert "trace line 1" in one_error(kv("explain", "--trace", str(tmp_path / "bad.jsonl")), "explain", 2)
    assert "line 1" in one_error(kv("tune", "--trace", str(tmp_path / "bad.jsonl")), "tune", 2)


def test_config_by_name_from_anywhere_and_every_bad_key(tmp_path):
    p = kv("config", "agent", cwd=tmp_path)  # a shipped config, by name, outside the repository
    assert p.returncode == 0 and "policy: lru_shared" in p.stdout and "/.cache/kvstore" in p.stdout
    assert "/var/cache" not in p.stdout
    msg = one_error(kv("config", "agnet", cwd=tmp_path), "config", 2)
    assert "agent, default" in msg  # names what is shipped
    msg = one_error(kv("config", "configs/agent.yaml", cwd=tmp_path), "config", 2)
    assert f"relative to {tmp_path}" in msg  # a relative path says where it was looked for
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers:\n  dram: {capacity_gb: -1, polcy: lru}\n  nvme: {ttl_s: 0}\n")
    p = kv("config", str(bad))
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 3 and all(x.startswith("kvstore config: error: ") for x in lines)
    assert {k for k in ("tiers.dram.capacity_gb", "tiers.dram.polcy", "tiers.nvme.ttl_s")
            if any(k in x for x in lines)} == {"tiers.dram.capacity_gb", "tiers.dram.polcy", "tiers.nvme.ttl_s"}


def test_size_is_the_rule_of_thumb(tmp_path):
    p = kv("size", "--model-shape", "32,8,128,bfloat16", "--keep-tokens", "65536", "--config", "default",
           "--block-tokens", "16")
    assert p.returncode == 0, p.stderr
    assert "128 KiB per token" in p.stdout and "a block of 16 tokens: 2 MiB" in p.stdout
    assert "dram 4 GiB = 2,048 blocks = 32,768 tokens" in p.stdout and "to keep 65,536 tokens: 8 GiB" in p.stdout
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 4, "num_attention_heads": 4, "hidden_size": 256, '
                                          '"num_key_value_heads": 2, "torch_dtype": "float32"}')
    p = kv("size", "--model", str(tmp_path), "--dtype", "bfloat16", "--block-tokens", "128")
    assert p.returncode == 0 and "4 layers x 2 KV heads x head size 64" in p.stdout and "2 KiB per token" in p.stdout
    # without --dtype and --block-tokens: what vLLM will run here (the quick start's tiny float32 model
    # ran in bfloat16 with 128-token blocks on vLLM's CPU backend; size said float32 and 16)
    import torch

    p = kv("size", "--model", str(tmp_path))
    bt = 16 if torch.cuda.is_available() else 128
    assert p.returncode == 0 and "2 KiB per token" in p.stdout and "bfloat16" in p.stdout, p.stdout
    assert f"a block of {bt} tokens: {bt * 2} KiB (vLLM's default" in p.stdout
    assert "kv_heads" in one_error(kv("size", "--model-shape", "32,8"), "size", 2)
    assert "unknown dtype" in one_error(kv("size", "--model-shape", "32,8,128,fp4"), "size", 2)


def test_the_start_up_sizing_line():
    """The line the connector logs once it knows the engine's block: the issue's example."""
    cfg = load_config(overrides={"tiers": {"dram": {"capacity_gb": 8}, "nvme": {"capacity_gb": 0}}}, environ={})
    bb = ModelShape.parse("32,8,128,bfloat16").block_bytes(16)
    assert sizing_line(cfg, bb, 16) == ("kvstore sizing: dram 8 GiB = 4,096 blocks = 65,536 tokens, nvme off of "
                                        "this model (2 MiB blocks of 16 tokens, 128 KiB of KV per token)")
    with pytest.raises(ValueError, match="layers,kv_heads,head_dim,dtype"):
        ModelShape.parse("32,8,128")
