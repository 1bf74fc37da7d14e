"""vLLM 0.33's sleep mode (issue 49): vLLM asks the connector's class before it starts with
``--enable-sleep-mode`` and inherits True; kvstore's copy tables hold pointers into the KV cache a
wake-up frees, so until re-registering the new caches has run on a GPU it answers False and the
log says why (vLLM's refusal does not)."""

from __future__ import annotations

import importlib.util
import logging

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

from kvstore.connectors.vllm.connector import KVStoreConnector  # noqa: E402


def test_sleep_mode_is_refused_and_the_log_says_why(caplog):
    with caplog.at_level(logging.WARNING, logger="vllm.kvstore"):
        assert KVStoreConnector.supports_sleep_mode(None) is False
    assert "sleep mode" in caplog.text and "freed" in caplog.text
