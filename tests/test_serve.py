"""KVStoreConnector behind vLLM's OpenAI-compatible server, as an operator runs it.

One test, two server runs on the same NVMe folder (vLLM's default multiprocess engine: API
server -> EngineCore -> Worker; the store lives in the Worker, which also serves
``metrics.port``):

1. the same ~3,000-token prompt twice: the second is vLLM's own prefix-cache hit, and the
   Prometheus text must not show it as a kvstore hit (served 0, "held" > 0); then a clean stop
   writes every DRAM block down to NVMe (no temp files left, 0700 folders, 0600 files);
2. a restart on that folder: the prompt is served from NVMe with the same greedy output.

Shutdown, as found on vLLM 0.32: SIGTERM and SIGINT to the API server both run its graceful
path, and it exits 0. With ``--shutdown-timeout N`` ("drain") it sends SIGTERM to the EngineCore
and waits up to N s; the EngineCore stops its executor, whose Worker runs the connector's
shutdown (the store is closed and persisted) within ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS``
(default 5) before it is sent SIGTERM, then SIGKILL 4 s later. With the default
``--shutdown-timeout 0`` ("abort") the API server sends SIGTERM to the EngineCore and at once
SIGKILLs it and the Worker: the connector's shutdown may start but is killed within
milliseconds and atexit never runs, so blocks only in DRAM are lost (README: serve with
``--shutdown-timeout``). Both runs stop in drain mode, as the README says to serve.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvstore.tiers import fileformat as ff  # noqa: E402
from kvstore.trace import read_trace  # noqa: E402
from kvstore.keys import chain_keys  # noqa: E402
from conftest import prompt  # noqa: E402
from test_metrics_port import answers, other_address  # noqa: E402

pytestmark = [pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 32
N_PROMPT = 3000
FULL = (N_PROMPT - 1) // BLOCK  # full blocks kvstore can offer: never the prompt's last token
DRAIN_S = 30  # --shutdown-timeout of run 1
HEALTH_TIMEOUT_S = float(os.environ.get("KVSTORE_TEST_SERVE_TIMEOUT", "240"))  # launch -> /health 200


from kvstore.bench.common.ports import free_ports  # noqa: E402


class Server:
    """``python -m vllm.entrypoints.openai.api_server`` with KVStoreConnector, in its own process
    group (killed whole if anything goes wrong: no server outlives a test)."""

    def __init__(self, model: str, store: Path, log: Path, *, shutdown_timeout: int | None = None,
                 dram_gb: float = 0.05, extra: dict | None = None):
        self.model, self.log_path = model, log
        self.port, self.metrics_port = free_ports(2)
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                "--dtype", "float32", "--enforce-eager", "--block-size", str(BLOCK), "--max-model-len", "4096",
                "--host", "127.0.0.1", "--port", str(self.port), "--seed", "0", "--enable-prompt-tokens-details"]
        if shutdown_timeout is not None:
            args += ["--shutdown-timeout", str(shutdown_timeout)]
        cfg = {"tiers": {"dram": {"capacity_gb": dram_gb, "ttl_s": None},
                         "nvme": {"path": str(store), "capacity_gb": 1, "ttl_s": None}},
               "metrics": {"port": self.metrics_port}, **(extra or {})}
        self.args = args + ["--kv-transfer-config", json.dumps({"kv_connector": "KVStoreConnector",
                                                                "kv_role": "kv_both",
                                                                "kv_connector_extra_config": cfg})]
        self.env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                        HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="1", PYTHONUNBUFFERED="1")
        if shutdown_timeout:
            # in drain mode the EngineCore gives its Worker VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS
            # (default 5) to exit, then SIGTERM, 4 s, SIGKILL: the persist at close must fit in it
            self.env["VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"] = str(shutdown_timeout)
        self.proc: subprocess.Popen | None = None
        self.started_s = self.stopped_s = None

    # -- life cycle ----------------------------------------------------------------------------
    def start(self, timeout: float = HEALTH_TIMEOUT_S) -> "Server":
        self._log = open(self.log_path, "ab")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     cwd=str(ROOT), start_new_session=True)
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with rc {self.proc.returncode} before it was healthy\n"
                                     + self.log_tail())
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (OSError, urllib.error.URLError):
                pass
            if time.monotonic() - t0 > timeout:
                self.kill()
                raise AssertionError(f"the server was not healthy within {timeout:.0f} s\n" + self.log_tail())
            time.sleep(0.5)
        self.started_s = time.monotonic() - t0
        return self

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 90.0) -> int:
        """Signal the API server only (as systemd or Kubernetes would) and wait for it."""
        assert self.proc is not None
        t0 = time.monotonic()
        self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the server did not exit within {timeout:.0f} s of {signal.Signals(sig).name}\n"
                                 + self.log_tail()) from None
        self.stopped_s = time.monotonic() - t0
        deadline = time.monotonic() + 15  # the EngineCore and Worker are gone too
        while self._group_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not self._group_alive(), "server processes outlived the API server\n" + self.log_tail()
        return rc

    def _group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def kill(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.kill()  # a no-op after a clean stop; else nothing is left running
        if getattr(self, "_log", None) is not None:
            self._log.close()

    def log_tail(self, n: int = 6000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def log_lines(self, needle: str) -> list[str]:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return []
        return [ln for ln in text.splitlines() if needle in ln]

    # -- requests ------------------------------------------------------------------------------
    def complete(self, ids: list[int], max_tokens: int = 16) -> dict:
        body = {"model": self.model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())

    def metrics(self) -> dict[tuple[str, frozenset], float]:
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            text = r.read().decode()
        return {(s.name, frozenset(s.labels.items())): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(m: dict, name: str, **labels) -> float:
    """One sample (0 if absent: a labelled counter appears on its first increment)."""
    return m.get((name, frozenset(labels.items())), 0.0)


def total(m: dict, name: str) -> float:
    return sum(v for (n, _), v in m.items() if n == name)


def labels_of(m: dict, name: str) -> dict:
    return next(dict(lab) for (n, lab), _ in m.items() if n == name)


def cached_tokens(resp: dict) -> int | None:
    d = (resp.get("usage") or {}).get("prompt_tokens_details") or {}
    return d.get("cached_tokens")


def block_path(store: Path, namespace: str, key: bytes) -> Path:
    folders = [p for p in store.iterdir() if p.name.startswith(f"kvstore-{namespace[:16]}")]
    assert len(folders) == 1, folders  # kvstore-<ns16> or kvstore-<ns16>-x (headers in xattrs)
    h = key.hex()
    return folders[0] / h[:2] / (h + ff.SUFFIX)


def temp_files(store: Path) -> list[Path]:
    return [p for p in store.rglob("*") if p.is_file() and (p.parent.name == "tmp" or ".tmp" in p.name
                                                             or p.name.startswith(".odirect-probe"))]


def check_store_folder(store: Path, namespace: str, keys: list[bytes]) -> None:
    """Every key's block file is there under its own key, private modes, nothing half-written."""
    from kvstore.tiers.nvme.folder import read_header

    assert temp_files(store) == [], f"temporary files left behind: {temp_files(store)[:5]}"
    missing = [k.hex() for k in keys if not block_path(store, namespace, k).is_file()]
    assert missing == [], f"{len(missing)} of {len(keys)} blocks are not on NVMe, e.g. {missing[:3]}"
    for k in keys:
        assert read_header(block_path(store, namespace, k)).key == k
    for p in [store, *store.rglob("*")]:
        mode = stat.S_IMODE(p.lstat().st_mode)
        if p.is_dir():
            assert mode == 0o700, f"{p}: folder mode {mode:04o}"
        else:
            assert p.is_file() and not p.is_symlink(), p
            assert mode == 0o600, f"{p}: file mode {mode:04o}"


@pytest.mark.slow
def test_server_prefix_cache_is_not_a_hit_and_a_restart_serves_from_nvme(tiny_model, tmp_path):
    store = tmp_path / "store"
    ids = prompt(N_PROMPT, 0)
    full_tokens = FULL * BLOCK  # 2976

    # -- run 1: the engine's own prefix cache answers the repeat; kvstore must not claim it ----
    with Server(tiny_model, store, tmp_path / "run1.log", shutdown_timeout=DRAIN_S) as srv:
        first = srv.complete(ids)
        second = srv.complete(ids)
        assert first["usage"]["prompt_tokens"] == N_PROMPT
        t_local = second["choices"][0]["text"]
        assert t_local == first["choices"][0]["text"] and t_local.strip()
        # vLLM's own count (--enable-prompt-tokens-details): the repeat is a full-block hit
        assert cached_tokens(first) == 0 and cached_tokens(second) == full_tokens
        m = srv.metrics()
        assert value(m, "kvstore_engine_prompt_tokens_total") == 2 * N_PROMPT
        assert value(m, "kvstore_engine_local_hit_tokens_total") == full_tokens
        assert value(m, "kvstore_engine_served_tokens_total", tier="dram") == 0
        assert value(m, "kvstore_engine_served_tokens_total", tier="nvme") == 0
        assert value(m, "kvstore_engine_held_tokens_total", tier="dram") == full_tokens
        # every prompt token is counted once: engine-local, served, or computed for a reason
        assert total(m, "kvstore_engine_unsupplied_tokens_total") == 2 * N_PROMPT - full_tokens
        assert value(m, "kvstore_engine_unsupplied_tokens_total", reason="never_stored") == full_tokens
        info = labels_of(m, "kvstore_store_info")
        root, namespace = bytes.fromhex(info["root"]), info["namespace"]
        assert value(m, "kvstore_tier_blocks", tier="dram") >= FULL
        rc = srv.stop(signal.SIGTERM, timeout=DRAIN_S + 60)
        assert rc == 0, srv.log_tail()
        assert srv.log_lines("kvstore connector summary"), "the Worker's connector shutdown did not run"

    keys = chain_keys(root, ids, BLOCK)[:FULL]
    check_store_folder(store, namespace, keys)  # every block was written down at the close

    # -- run 2: a restart on the same folder serves the prompt from NVMe -------------------------
    other = prompt(300, 1)
    with Server(tiny_model, store, tmp_path / "run2.log", shutdown_timeout=DRAIN_S) as srv:
        again = srv.complete(ids)
        assert again["choices"][0]["text"] == t_local
        assert cached_tokens(again) == full_tokens  # loaded by the connector this time
        m = srv.metrics()
        assert labels_of(m, "kvstore_store_info") == info  # same model, root and namespace
        assert value(m, "kvstore_engine_local_hit_tokens_total") == 0
        assert value(m, "kvstore_engine_served_tokens_total", tier="nvme") == full_tokens
        assert value(m, "kvstore_engine_served_tokens_total", tier="dram") == 0
        assert total(m, "kvstore_engine_unsupplied_tokens_total") == N_PROMPT - full_tokens
        srv.complete(other)  # 9 new blocks, in DRAM only (write-back)
        rc = srv.stop(signal.SIGTERM, timeout=DRAIN_S + 60)
        assert rc == 0, srv.log_tail()

    # the NVMe blocks are intact and the new DRAM-only ones were written down at the close
    check_store_folder(store, namespace, keys + chain_keys(root, other, BLOCK)[:(300 - 1) // BLOCK])


@pytest.mark.slow
def test_a_plain_stop_keeps_every_finished_requests_trace_line(tiny_model, tmp_path):
    """Issue 45, finding 10, as an operator stops the server: SIGTERM with vLLM's default
    ``--shutdown-timeout 0``, which SIGTERMs the EngineCore (the scheduler's connector and its
    trace writer live there) and SIGKILLs it at once: no close, no atexit. The lines were buffered
    until a close (27 requests left a 0-byte trace); now the planner writes them when its last
    request in flight finishes, before vLLM answers it. And finding 4 end to end: the Worker's
    store serves metrics.port on 127.0.0.1 only. About 31 s here (2 shared cores), nearly all start-up."""
    trace = tmp_path / "trace" / "t.jsonl"
    prompts = [prompt(100, seed) for seed in (11, 12, 13)]
    with Server(tiny_model, tmp_path / "store", tmp_path / "run.log", extra={"trace_path": str(trace)}) as srv:
        for ids in prompts:
            srv.complete(ids, max_tokens=4)
        assert value(srv.metrics(), "kvstore_engine_prompt_tokens_total") == 300  # served on 127.0.0.1
        assert not answers(other_address(), srv.metrics_port)
        rc = srv.stop(signal.SIGTERM)
        assert rc == 0, srv.log_tail()
        assert srv.log_lines("force killing"), "the EngineCore was not killed: not the stop this test is about"
    got = list(read_trace(trace))
    assert sorted(r.prompt_tokens for r in got) == [100, 100, 100], trace.read_bytes()[:500]
    assert stat.S_IMODE(trace.stat().st_mode) == 0o600 and stat.S_IMODE(trace.parent.stat().st_mode) == 0o700
