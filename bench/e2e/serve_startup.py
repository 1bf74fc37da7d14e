"""Start-up time of vLLM's OpenAI-compatible server, with and without KVStoreConnector.

    python bench/e2e/serve_startup.py [--model DIR] [--config configs/agent.yaml] [--repeat 1] [--json F]

Each sample launches ``python -m vllm.entrypoints.openai.api_server`` (vLLM's default
multiprocess engine) and times launch -> the first ``GET /health`` that answers 200, then stops
it with SIGTERM and times the stop. With the connector the server gets the YAML config
(``--config``) with ``tiers.nvme.path`` moved to a temporary folder. Every line of the server's
log that mentions ``kvstore`` is kept with the time it appeared (seconds since launch), printed,
and written to the JSON report, as are the times of a few vLLM milestones (``MILESTONES``: the
EngineCore starts, the Worker loads weights, sizes its KV cache, engine init ends...), printed
side by side for both variants to show where the connector's time goes. When the DRAM pool is
prepared in the background, the stop waits for its "ready" line (``--pool-wait``), so the
report also has the time until the whole pool is usable.

Without ``--model`` a tiny random Llama is built offline in a temporary folder
(bench/common/tiny_model.py). A warm-up launch without the connector (``--warmup``, default 1; its
time is printed, not counted) brings Python's modules into the page cache first, so no timed
sample is the only cold one; samples alternate without/with the connector.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout

# vLLM log lines whose first appearance is timed (seconds since launch), to see where time goes
MILESTONES = (
    ("api_server_args", "non-default args"),  # the API server has imported vLLM
    ("engine_core_start", "Initializing a V1 LLM engine"),
    ("worker_load_model", "Starting to load model"),
    ("worker_weights_loaded", "Loading weights took"),
    ("kv_cache_sized", "KV cache size"),
    ("dram_pool_background", "kvstore: DRAM pool: preparing"),
    ("connector_worker", "kvstore connector (WORKER)"),
    ("connector_scheduler", "kvstore connector (SCHEDULER)"),
    ("engine_init_done", "init engine (profile, create kv cache, warmup model) took"),
    ("api_server_listening", "Starting vLLM server on"),
    ("dram_pool_ready", "kvstore: DRAM pool ready"),  # may come after /health (background preparation)
)
INIT_RE = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+) s")


from kvstore.bench.common.ports import free_port  # noqa: E402


def launch(model: str, *, connector_cfg: dict | None, server_args: list[str], log_path: str,
           timeout: float, pool_wait: float = 120.0) -> dict:
    """One server launch: seconds to /health 200, seconds to stop, kvstore log lines. A DRAM pool
    prepared in the background is waited for (up to ``pool_wait`` s after /health) before the stop."""
    port = free_port()
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), *server_args]
    if connector_cfg is not None:
        args += ["--kv-transfer-config", json.dumps({"kv_connector": "KVStoreConnector", "kv_role": "kv_both",
                                                     "kv_connector_extra_config": connector_cfg})]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    lines: list[tuple[float, str]] = []
    marks: dict[str, float] = {}
    out: dict = {"connector": connector_cfg is not None, "startup_s": None, "stop_s": None, "rc": None,
                 "error": None, "engine_init_reported_s": None, "milestones_s": marks}
    pos, partial = 0, b""

    def read_log(t: float) -> None:
        nonlocal pos, partial
        with open(log_path, "rb") as f:
            f.seek(pos)
            data = f.read()
        pos += len(data)
        *done, partial = (partial + data).split(b"\n")
        for ln in done:
            s = ln.decode(errors="replace")
            if "kvstore" in s:
                lines.append((round(t, 2), s.rstrip()))
            for name, needle in MILESTONES:
                if name not in marks and needle in s:
                    marks[name] = round(t, 2)
            m = INIT_RE.search(s)
            if m:
                out["engine_init_reported_s"] = float(m.group(1))

    with open(log_path, "wb") as log:
        t0 = time.monotonic()
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)
        try:
            while True:
                t = time.monotonic() - t0
                read_log(t)
                if proc.poll() is not None:
                    out["error"] = f"exited with rc {proc.returncode} before /health answered"
                    break
                if t > timeout:
                    out["error"] = f"not healthy within {timeout:.0f} s"
                    break
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                        if r.status == 200:
                            out["startup_s"] = round(time.monotonic() - t0, 2)
                            break
                except (OSError, urllib.error.URLError):
                    pass
                time.sleep(0.1)
            if out["error"] is None:
                # lines written after /health (e.g. a pool still being prepared in the background)
                t_ready = time.monotonic()
                while True:
                    read_log(time.monotonic() - t0)
                    waited = time.monotonic() - t_ready
                    pending = "dram_pool_background" in marks and "dram_pool_ready" not in marks
                    if waited >= 2.0 and not (pending and waited < pool_wait):
                        break
                    time.sleep(0.2)
                t1 = time.monotonic()
                out["sigterm_at_s"] = round(t1 - t0, 2)
                proc.send_signal(signal.SIGTERM)
                try:
                    out["rc"] = proc.wait(120)
                    out["stop_s"] = round(time.monotonic() - t1, 2)
                except subprocess.TimeoutExpired:
                    out["error"] = "did not stop within 120 s of SIGTERM"
        finally:
            try:  # the whole process group: no EngineCore or Worker outlives a sample
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    read_log(time.monotonic() - t0)
    out["kvstore_lines"] = lines
    if out["error"]:
        with open(log_path, "rb") as f:
            out["log_tail"] = f.read()[-4000:].decode(errors="replace")
    return out


def stats(xs: list[float]) -> dict:
    return {"n": len(xs), "median_s": round(statistics.median(xs), 2), "min_s": round(min(xs), 2),
            "max_s": round(max(xs), 2)} if xs else {"n": 0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model folder (default: a tiny random Llama built in a temp folder)")
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "agent.yaml"),
                    help="kvstore YAML for the runs with the connector (tiers.nvme.path is moved to a temp folder)")
    ap.add_argument("--repeat", type=int, default=1, help="samples per variant")
    ap.add_argument("--warmup", type=int, default=1, help="launches without the connector before timing")
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--timeout", type=float, default=600, help="seconds to wait for /health")
    ap.add_argument("--pool-wait", type=float, default=120,
                    help="seconds to wait after /health for a DRAM pool prepared in the background")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra argument for the server (repeat it), e.g. --server-arg=--dtype=float16")
    a = ap.parse_args(argv)

    work = tempfile.mkdtemp(prefix="serve-startup-")  # no "kvstore" in paths: it would match the log grep
    try:
        model = a.model
        if model is None:
            sys.path.insert(0, ROOT)
            from kvstore.bench.common.tiny_model import build_tiny_llama

            model = build_tiny_llama(os.path.join(work, "tiny-llama"), hidden=256, layers=4, seed=0)
        server_args = ["--enforce-eager", "--max-model-len", "4096", "--seed", "0", *a.server_arg]
        config = os.path.abspath(a.config)
        nvme = os.path.join(work, "nvme")
        cfg = {"config": config, "tiers": {"nvme": {"path": nvme}}}

        runs = []
        for i in range(a.warmup):
            r = launch(model, connector_cfg=None, server_args=server_args,
                       log_path=os.path.join(work, f"warmup{i}.log"), timeout=a.timeout)
            print(f"warm-up {i}: {r['startup_s']} s" + (f" ({r['error']})" if r["error"] else ""), flush=True)
        for i in range(a.repeat):
            order = (False, True) if i % 2 == 0 else (True, False)
            for with_conn in order:
                shutil.rmtree(nvme, ignore_errors=True)  # every sample starts on an empty store
                name = f"{'with' if with_conn else 'without'}{i}"
                r = launch(model, connector_cfg=cfg if with_conn else None, server_args=server_args,
                           log_path=os.path.join(work, f"{name}.log"), timeout=a.timeout, pool_wait=a.pool_wait)
                runs.append(r)
                msg = f"{name}: start {r['startup_s']} s, stop {r['stop_s']} s, rc {r['rc']}"
                print(msg + (f" ERROR {r['error']}\n{r.get('log_tail', '')}" if r["error"] else ""), flush=True)

        ok = [r for r in runs if not r["error"]]
        without = stats([r["startup_s"] for r in ok if not r["connector"]])
        with_ = stats([r["startup_s"] for r in ok if r["connector"]])
        stop_without = stats([r["stop_s"] for r in ok if not r["connector"]])
        stop_with = stats([r["stop_s"] for r in ok if r["connector"]])
        overhead = (round(with_["median_s"] - without["median_s"], 2)
                    if with_.get("n") and without.get("n") else None)

        print()
        print(f"model {model}; connector config {os.path.relpath(config, ROOT)} (nvme path -> temp folder); "
              f"{os.cpu_count()} CPUs")
        print()
        print("| server | start-up to /health 200 (median s) | min | max | stop after SIGTERM (median s) | samples |")
        print("|---|---|---|---|---|---|")
        for label, s, st in (("vLLM", without, stop_without), ("vLLM + KVStoreConnector", with_, stop_with)):
            if s.get("n"):
                print(f"| {label} | {s['median_s']:.2f} | {s['min_s']:.2f} | {s['max_s']:.2f} | "
                      f"{st['median_s']:.2f} | {s['n']} |")
            else:
                print(f"| {label} | failed | | | | 0 |")
        if overhead is not None:
            print(f"\nconnector start-up overhead (median): {overhead:+.2f} s")
        print("\n| milestone (first log line, s since launch; median) | vLLM | vLLM + KVStoreConnector |")
        print("|---|---|---|")
        rows = [(name, needle) for name, needle in MILESTONES] + [("engine init, as vLLM reports it (s)", None),
                                                                  ("/health 200", None)]
        for name, needle in rows:
            cells = []
            for conn in (False, True):
                if name.startswith("engine init"):
                    xs = [r["engine_init_reported_s"] for r in ok if r["connector"] == conn
                          and r["engine_init_reported_s"] is not None]
                elif name == "/health 200":
                    xs = [r["startup_s"] for r in ok if r["connector"] == conn]
                else:
                    xs = [r["milestones_s"][name] for r in ok if r["connector"] == conn and name in r["milestones_s"]]
                cells.append(f"{statistics.median(xs):.2f}" if xs else "-")
            label = f"{name} (`{needle}`)" if needle else name
            print(f"| {label} | {cells[0]} | {cells[1]} |")
        for r in runs:
            if r["connector"]:
                print(f"\nkvstore log lines (seconds since launch; /health at {r['startup_s']} s, "
                      f"SIGTERM at {r.get('sigterm_at_s')} s):")
                for t, ln in r["kvstore_lines"]:
                    stop = r.get("sigterm_at_s") is not None and t > r["sigterm_at_s"]
                    print(f"  +{t:6.2f}{' (stop)' if stop else ''}  {ln}")

        report = {"model": model, "config": config, "server_args": server_args, "milestones": dict(MILESTONES),
                  "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version()},
                  "env": {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")},
                  "startup": {"without": without, "with": with_, "overhead_median_s": overhead},
                  "stop": {"without": stop_without, "with": stop_with}, "runs": runs}
        if a.json:
            os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
            with open(a.json, "w") as f:
                json.dump(report, f, indent=2)
            print(f"\nwrote {a.json}")
        return 0 if len(ok) == len(runs) else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
