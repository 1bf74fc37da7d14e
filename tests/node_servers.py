"""A ``kvstore serve`` process for the node tests (tests/test_node.py, tests/test_node_vllm.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid

import yaml

from kvstore.config import from_dict
from kvstore.node.probe import ping


class Served:
    """A ``kvstore serve`` process on a config file."""

    def __init__(self, tmp_path, cfg: dict):
        self.cfg = cfg
        self.file = tmp_path / f"node-{uuid.uuid4().hex[:6]}.yaml"
        self.file.write_text(yaml.safe_dump(cfg))
        self.proc = None
        self.start()

    def start(self) -> "Served":
        self.proc = subprocess.Popen([sys.executable, "-m", "kvstore.ops.cli", "serve", "--config", str(self.file)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        t = time.monotonic()
        while ping(from_dict(self.cfg)) != self.proc.pid:
            assert self.proc.poll() is None, self.proc.stdout.read()
            assert time.monotonic() - t < 60, "kvstore serve did not answer"
            time.sleep(0.05)
        return self

    def stop(self, sig=signal.SIGTERM) -> str:
        self.proc.send_signal(sig)
        out, _ = self.proc.communicate(timeout=60)
        return out

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()
