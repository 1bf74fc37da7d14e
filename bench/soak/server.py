"""The processes a soak runs (``kvstore bench soak``): vLLM's OpenAI-compatible server with
kvstore, and (node mode) the host's ``kvstore serve``; started, stopped gracefully, killed -9,
started again, and one streamed completion at a time sent to the server.

The server is its own process group (``start_new_session``), so a kill takes its EngineCore with
it, as a crash of the container would; its log is appended to one file across restarts.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import yaml

from kvstore.bench.common.ports import free_port


class Down(Exception):
    """The server did not answer (refused, reset, timed out): it is down or restarting."""


class Server:
    def __init__(self, model: str, *, connector: dict, server_args: list[str], log_path: str, env: dict):
        self.model = model
        self.connector = connector
        self.server_args = server_args
        self.log_path = log_path
        self.env = env
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        # out of rotation: no new request is sent (a load balancer's drain before a restart; vLLM
        # accepts a request that arrives while it drains, and never answers it)
        self.draining = False

    def start(self, timeout: float = 300.0) -> float:
        """Launch and wait for ``/health``; seconds it took. Raises with the log's tail if it never answers."""
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                "--host", "127.0.0.1", "--port", str(self.port), *self.server_args,
                "--kv-transfer-config", json.dumps({"kv_connector": "KVStoreConnector", "kv_role": "kv_both",
                                                    "kv_connector_extra_config": self.connector})]
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== kvstore bench soak: start {self.starts} =====\n".encode())
            log.flush()
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        self.starts += 1
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() - t0 > timeout:
                self.kill()
                raise RuntimeError(f"the vLLM server did not start ({self.log_path}):\n{self.tail()}")
            time.sleep(0.2)
        return time.monotonic() - t0

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def stop(self, timeout: float = 120.0) -> bool:
        """SIGTERM and wait (kvstore writes its DRAM down); True if it exited by itself in time."""
        p = self.proc
        if p is None or p.poll() is not None:
            return True
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout)
            clean = True
        except subprocess.TimeoutExpired:
            clean = False
        self.kill()
        return clean

    def kill(self) -> None:
        """SIGKILL the whole process group (the EngineCore and its worker too)."""
        p = self.proc
        if p is None:
            return
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        p.wait()

    def pids(self) -> dict[str, int | None]:
        """The API server's pid and its EngineCore's (its child that is a Python process)."""
        p = self.proc
        if p is None or p.poll() is not None:
            return {"server": None, "engine": None}
        return {"server": p.pid, "engine": _engine_core(p.pid)}

    def tail(self, n: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - n))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def complete(self, prompt: list[int], max_tokens: int, timeout: float = 120.0
                 ) -> tuple[float | None, list[int], bool]:
        """One greedy streamed completion: (seconds to the first token, the answer's token ids,
        whether it ran to ``max_tokens``: False when a stopping server aborted it)."""
        if self.draining:
            raise Down("out of rotation: restarting")
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "ignore_eos": True, "stream": True, "return_token_ids": True})
        t0 = time.monotonic()
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            try:
                c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
                r = c.getresponse()
            except (OSError, http.client.HTTPException) as e:
                raise Down(str(e)) from None
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {r.read(2000).decode(errors='replace')}")
            ttft, out, finish = None, [], None
            try:
                for line in r:
                    if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                        continue
                    choice = (json.loads(line[6:]).get("choices") or [{}])[0]
                    ids = choice.get("token_ids") or []
                    if ids and ttft is None:
                        ttft = time.monotonic() - t0
                    out += ids
                    finish = choice.get("finish_reason") or finish
            except (OSError, http.client.HTTPException) as e:
                raise Down(f"mid-answer: {e}") from None
            return ttft, out, finish == "length"
        finally:
            c.close()


def _engine_core(pid: int) -> int | None:
    """The EngineCore among ``pid``'s children (vLLM names its process ``VLLM::EngineCore``; the
    others are multiprocessing's resource tracker and the like)."""
    from kvstore.bench.soak.watch import children

    for c in children(pid):
        try:
            with open(f"/proc/{c}/cmdline", "rb") as f:
                if b"EngineCore" in f.read():
                    return c
        except OSError:
            continue
    return None


class Daemon:
    """``kvstore serve`` on ``cfg`` (node mode), killed -9 and started again by the faults."""

    def __init__(self, cfg: dict, folder: str, log_path: str, env: dict):
        self.cfg = cfg
        self.path = os.path.join(folder, "daemon.yaml")
        with open(self.path, "w") as f:
            yaml.safe_dump(cfg, f)
        self.log_path = log_path
        self.env = env
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120.0) -> float:
        from kvstore.config import from_dict
        from kvstore.node.probe import ping

        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvstore.ops.cli", "serve", "--config", self.path],
                                         stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        while ping(from_dict(self.cfg)) != self.proc.pid:
            if self.proc.poll() is not None or time.monotonic() - t0 > timeout:
                self.kill()
                raise RuntimeError(f"kvstore serve did not start ({self.log_path})")
            time.sleep(0.1)
        return time.monotonic() - t0

    def stop(self, timeout: float = 120.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait()

    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None
