"""Replay vs genuine reuse, live: was this exact prompt seen before?

A request is a **replay** when its exact prompt was seen before by this scheduler: the same
model fingerprint, every prompt token (the full blocks *and* the partial last block), the same
extra keys (LoRA, cache salt) and multimodal inputs. Anything else that hits is **genuine**
reuse: a new prompt sharing a stored prefix. This is the benchmark's and the tuner's split
(``bench/agent/``, ``kvstore/tune/trace_memory.py``: the same block-key list seen before), made
exact where the engine knows more than a trace does (the tokens after the last full block).

A prompt is named by a 64-bit digest: the chain key of its last full block (which hashes the
root, every full block's tokens and extra keys) extended by the partial block's tokens, the
extra keys and the partial block's multimodal identifiers. The planner remembers the last
``REPLAY_MEMORY`` digests (LRU: a replay refreshes its prompt), so the memory is bounded
whatever the traffic; a prompt last seen more than that many distinct prompts ago counts as
genuine. The memory is per process: a restarted engine starts empty.

The tokens a request's load actually served are counted by kind on the worker
(:meth:`kvstore.offload.runner.StepRunner._load`): ``kvstore_engine_served_tokens_by_kind_total{tier,kind}``;
a failed load counts nothing. Summed over ``kind`` it equals
``kvstore_engine_served_tokens_total{tier}``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from kvstore.keys import next_key
from kvstore.store.metrics import KINDS


# Distinct prompts remembered. An OrderedDict entry of a 64-bit int key costs about 215 bytes
# (measured with tracemalloc: 21.5 MB for 100,000 entries, full), so the memory stays under 22 MB.
REPLAY_MEMORY = 100_000

REPLAY, GENUINE = KINDS  # "replay", "genuine": the kind label's values


class ReplayMemory:
    """The last ``capacity`` prompt digests seen, least recently seen first."""

    def __init__(self, capacity: int = REPLAY_MEMORY):
        if capacity < 1:
            raise ValueError(f"replay memory capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._seen: OrderedDict[int, None] = OrderedDict()

    def see(self, digest: int) -> bool:
        """Remember ``digest``; True when it was already remembered (a replay)."""
        if digest in self._seen:
            self._seen.move_to_end(digest)
            return True
        self._seen[digest] = None
        if len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
        return False

    def __len__(self) -> int:
        return len(self._seen)


def prompt_digest(parent: bytes, tail: Sequence[int], num_prompt_tokens: int, extra, mm: tuple) -> int:
    """The 64-bit name of an exact prompt (see the module doc): the key of its last full block
    (``parent``; the chain's root for a prompt without one), its tail tokens, its length, its
    extra keys and the multimodal items that reach into the tail (``mm``)."""
    return int.from_bytes(next_key(parent, list(tail), ("prompt", num_prompt_tokens, extra, mm))[:8], "little")
