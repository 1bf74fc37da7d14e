"""The engine's forward passes, timed on the worker, for the lookup's "load or recompute?"
decision (:func:`kvstore.store.placement.worth_loading`): each timed step gives its scheduled tokens,
their attention pairs and its seconds to :class:`kvstore.store.stepcost.StepCost`.

A step counts when it is mostly prefill: at least ``min_tokens`` prompt tokens (a few blocks)
and at least 90 % of the step's tokens (a decode-heavy step is bound by other costs). The time
runs from the binding of the step's metadata, right before the forward pass, to
``wait_for_save`` right after it. vLLM calls ``start_load_kv`` before the forward pass only
when the step has synchronous loads, and after it otherwise (``has_sync_kv_loads``), so the
clock cannot start there: it starts at :meth:`start`, and :meth:`loaded` restarts it after a
step's synchronous loads, which are not prefill. On CPU the wall clock; on CUDA a pair of
timing events on the compute stream, read a step later once they completed (the host returns
from the forward pass long before the GPU finishes it, so its clock would make prefill look fast
and cut loads that pay). Nothing is ever waited for.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable


class PrefillRate:
    def __init__(self, observe: Callable[[int, float, int], None], *, min_tokens: int = 64, device: str = "cpu",
                 device_index: int = 0):
        self.observe = observe
        self.min_tokens = min_tokens
        self.cuda = device == "cuda"
        self.device_index = device_index
        self._start: Any = None
        self._tokens = self._pairs = 0
        self._pending: deque = deque(maxlen=64)  # CUDA (tokens, pairs, start, end), not yet read

    def start(self, prefill_tokens: int, total_tokens: int, pairs: int = 0) -> None:
        """When the step's metadata is bound, before its forward pass."""
        self._start = None
        self._poll()
        if prefill_tokens < self.min_tokens or prefill_tokens < 0.9 * total_tokens:
            return
        self._tokens, self._pairs = total_tokens, pairs
        self._start = self._now()

    def loaded(self) -> None:
        """After the step's synchronous loads, which vLLM runs before the forward pass."""
        if self._start is not None:
            self._start = self._now()

    def stop(self) -> None:
        """After the forward pass (``wait_for_save``)."""
        if self._start is None:
            return
        if self.cuda:
            self._pending.append((self._tokens, self._pairs, self._start, self._now()))
        else:
            self.observe(self._tokens, time.perf_counter() - self._start, self._pairs)
        self._start = None

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        import torch

        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device_index))
        return ev

    def _poll(self) -> None:
        while self._pending and self._pending[0][3].query():
            tokens, pairs, a, b = self._pending.popleft()
            self.observe(tokens, a.elapsed_time(b) / 1000.0, pairs)
