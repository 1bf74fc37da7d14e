"""``metrics.port`` with several ranks or engines on one host (issue 32): the first store exports,
the others (other processes) warn and go on, never "address in use"; a port another program holds
is still refused (tests/test_config_trust.py)."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import time

from kvstore.bench.ports import free_port
from kvstore.store import machine
from kvstore.store.metrics import StoreMetrics

HOLD = """
import sys, time
from kvstore.store.metrics import StoreMetrics
m = StoreMetrics(port=int(sys.argv[1]))
print("up", flush=True)
time.sleep(60)
"""


def _free_port() -> int:
    return free_port(host="0.0.0.0")


def test_a_port_another_kvstore_process_exports_is_shared_with_a_warning(caplog):
    port = _free_port()
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "up"
        assert machine.kvstore_exports(port)
        assert machine.port_error(port) is None  # the plugin's check and `kvstore config` let it pass
        with caplog.at_level(logging.WARNING, logger="kvstore"):
            m = StoreMetrics(port=port)  # another rank's store: not refused
        m.close()
        assert "exports another kvstore store of this host" in caplog.text
    finally:
        p.kill()
        p.wait()
    t = time.monotonic()
    while machine.port_error(port) is not None and time.monotonic() - t < 5:
        time.sleep(0.05)
    assert not machine.kvstore_exports(port)


def test_a_listener_that_is_not_kvstore_is_not_taken_for_one():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    try:
        assert not machine.kvstore_exports(s.getsockname()[1], timeout=0.2)
    finally:
        s.close()
