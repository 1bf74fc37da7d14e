"""The engine's prefill throughput, measured around the forward pass on the worker, for the
lookup's "load or recompute?" decision (:func:`kvstore.placement.worth_loading`).

A step counts when it is mostly prefill: at least ``min_tokens`` prompt tokens (a few blocks)
and at least 90 % of the step's tokens (a decode-heavy step runs far fewer tokens per second,
which would make recomputing look dearer than it is). The time is from the end of the step's
loads (``start_load_kv``) to ``wait_for_save``: on CPU the wall clock; on CUDA a pair of timing
events on the compute stream, read a step later once they completed (the host returns from the
forward pass long before the GPU finishes it, so its clock would make prefill look fast and cut
loads that pay). Nothing is ever waited for.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable


class PrefillRate:
    def __init__(self, observe: Callable[[int, float], None], *, min_tokens: int = 64, device: str = "cpu",
                 device_index: int = 0):
        self.observe = observe
        self.min_tokens = min_tokens
        self.cuda = device == "cuda"
        self.device_index = device_index
        self._start: Any = None
        self._tokens = 0
        self._pending: deque = deque(maxlen=64)  # CUDA (tokens, start, end) events not yet read

    def start(self, prefill_tokens: int, total_tokens: int) -> None:
        """After the step's loads, before its forward pass."""
        self._start = None
        self._poll()
        if prefill_tokens < self.min_tokens or prefill_tokens < 0.9 * total_tokens:
            return
        self._tokens = prefill_tokens
        self._start = self._now()

    def stop(self) -> None:
        """After the forward pass (``wait_for_save``)."""
        if self._start is None:
            return
        if self.cuda:
            self._pending.append((self._tokens, self._start, self._now()))
        else:
            self.observe(self._tokens, time.perf_counter() - self._start)
        self._start = None

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        import torch

        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device_index))
        return ev

    def _poll(self) -> None:
        while self._pending and self._pending[0][2].query():
            tokens, a, b = self._pending.popleft()
            self.observe(tokens, a.elapsed_time(b) / 1000.0)
