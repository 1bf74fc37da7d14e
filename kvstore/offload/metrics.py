"""Metrics in an engine's terms, registered in the store's Prometheus registry.

Every prompt token of a request the engine schedules is counted exactly once, as one of:

* ``kvstore_engine_local_hit_tokens_total``: the engine already had it (its own prefix cache);
* ``kvstore_engine_served_tokens_total{tier}``: kvstore loaded it into the engine;
* ``kvstore_engine_unsupplied_tokens_total{reason}``: the engine computed it, because kvstore
  could not supply it (``UNSUPPLIED_REASONS``).

So served + unsupplied = prompt - engine-local, and the hit rate kvstore can claim is
**served / (prompt - engine-local)**. Tokens kvstore held but the engine already had are
counted apart (``kvstore_engine_held_tokens_total{tier}``): no work was saved by them, and a
lookup that counted them as hits would show a hit rate where kvstore saved nothing.

A request is counted when the engine schedules it (a preempted request counts again when it is
scheduled again); served and load-failed tokens when the worker has copied (or failed to copy)
them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram

from kvstore.store.metrics import LATENCY_BUCKETS, MISS_REASONS, TIERS
from kvstore.offload import hints
from kvstore.offload.hooktime import HookTotals

# Why a prompt token the engine needed was not served: the store's miss reasons for the first
# block it lacked (kvstore.store.metrics.MISS_REASONS), and
#   partial_block  the tokens after the last full block, and the prompt's last token (the engine
#                  must compute at least one token, so a block ending on it is never offered);
#   load_failed    promised, but the load failed (a bad file, a read or copy error): recomputed;
#   not_loaded     stored, but the engine did not take it (it allocated fewer tokens);
#   uncacheable    the request has no token ids (prompt embeddings);
#   store_error    the store could not be asked (its calls failed: a miss).
UNSUPPLIED_REASONS = tuple(r for r in MISS_REASONS if r != "below_min") + (
    "partial_block", "load_failed", "not_loaded", "uncacheable", "store_error")


MAX_TAGS = 20  # request tags with a label of their own (kvstore_engine_tag_*): the most recently used
OTHER_TAG = "other"  # the tokens of tags that aged out of a label (and of a tag named "other")


@dataclass
class RequestOutcome:
    """What the scheduler decided for one request, in tokens (computed by the planner)."""

    req_id: str
    prompt: int  # prompt tokens
    local: int  # the engine's own prefix-cache hit
    promised: int  # tokens kvstore said it would load
    got: int  # of those, pinned (the rest fail at the worker)
    tiers: tuple[str, ...] = ()  # tier of each promised block
    held: dict[str, int] = field(default_factory=dict)  # tier -> tokens kvstore held under ``local``
    unsupplied: dict[str, int] = field(default_factory=dict)  # reason -> tokens (load failures: worker)
    errors: int = 0  # scheduler-side store calls that failed since the last report
    tag: str = ""  # the request's tag (kv_transfer_params kvstore.tag), "" without one

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "RequestOutcome":
        """From the scheduler's socket message (validated by :meth:`OffloadMetrics.record`)."""
        return cls(str(d["req_id"]), int(d["prompt"]), int(d["local"]), int(d["promised"]), int(d["got"]),
                   tuple(str(t) for t in d.get("tiers", ())),
                   {str(k): int(v) for k, v in dict(d.get("held", {})).items()},
                   {str(k): int(v) for k, v in dict(d.get("unsupplied", {})).items()}, int(d.get("errors", 0)),
                   hints.checked(d.get("tag") or None, "tag", str(d["req_id"])) or "")  # as the hint was


class OffloadMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.registry = r = registry
        self.requests = Counter("kvstore_engine_requests", "Requests the engine scheduled with a kvstore lookup "
                                "(a preempted request counts again when rescheduled)", registry=r)
        self.prompt_tokens = Counter("kvstore_engine_prompt_tokens", "Prompt tokens of those requests", registry=r)
        self.local_tokens = Counter("kvstore_engine_local_hit_tokens",
                                    "Prompt tokens the engine already had in its own prefix cache", registry=r)
        self.served_tokens = Counter("kvstore_engine_served_tokens",
                                     "Prompt tokens kvstore loaded into the engine (prefill skipped), by tier",
                                     ["tier"], registry=r)
        self.held_tokens = Counter("kvstore_engine_held_tokens",
                                   "Prompt tokens kvstore held that the engine already had (no work saved), by tier",
                                   ["tier"], registry=r)
        self.unsupplied_tokens = Counter("kvstore_engine_unsupplied_tokens",
                                         "Prompt tokens the engine needed and computed because kvstore could not "
                                         "supply them, by reason", ["reason"], registry=r)
        self.store_errors = Counter("kvstore_engine_store_errors",
                                    "Store calls that failed (a miss, a recompute or a skipped store), by op", ["op"],
                                    registry=r)
        self.skipped_blocks = Counter("kvstore_engine_store_skipped_blocks",
                                      "Blocks not stored, by reason (failed_load: computed over a failed load)",
                                      ["reason"], registry=r)
        self.stored_blocks = Counter("kvstore_engine_stored_blocks", "Blocks saved from the engine", registry=r)
        self.load_seconds = Histogram("kvstore_engine_load_seconds", "Worker time to load one step's blocks",
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.save_seconds = Histogram("kvstore_engine_save_seconds", "Worker time to save one step's blocks",
                                      buckets=LATENCY_BUCKETS, registry=r)
        # per request tag (kv_transfer_params kvstore.tag): the MAX_TAGS most recently used tags
        # have a label each; a new one takes the slot of the least recently used, whose series go
        # (their tokens move to "other", so the sum over tags stays every tagged token). A label set
        # that cannot grow, and that no 20 early tags hold for good.
        doc = "(the 20 most recently used tags; the tokens of those that aged out as 'other')"
        self.tag_prompt = Counter("kvstore_engine_tag_prompt_tokens", f"Prompt tokens of tagged requests, by tag "
                                  f"{doc}", ["tag"], registry=r)
        self.tag_local = Counter("kvstore_engine_tag_local_hit_tokens", "Of those, tokens the engine already had "
                                 f"(its own prefix cache), by tag {doc}", ["tag"], registry=r)
        self.tag_hit = Counter("kvstore_engine_tag_hit_tokens", "Of those, tokens kvstore pinned to load, by tag "
                               f"(a load that then fails is in it) {doc}", ["tag"], registry=r)
        self._tags: OrderedDict[str, list[float]] = OrderedDict()  # tag -> its series' values, least recent first
        self._tags_lock = threading.Lock()  # the scheduler's socket and the local client may both record
        self.hooks = HookTotals()  # kvstore_engine_hook_{seconds,calls}_total{side,hook} (offload.hooktime)
        r.register(self.hooks)

    def record(self, o: RequestOutcome) -> None:
        """A request's scheduler-side outcome (served and load failures come from the worker)."""
        bad = [t for t in (*o.held, *o.tiers) if t not in TIERS] + [r for r in o.unsupplied if r not in
                                                                     UNSUPPLIED_REASONS]
        counts = [o.prompt, o.local, o.promised, o.got, o.errors, *o.held.values(), *o.unsupplied.values()]
        if any(n < 0 for n in counts):
            raise ValueError(f"request outcome {o.req_id!r}: negative count in {counts}")
        if bad:  # labels come from the scheduler: never let them grow the metric's label set
            raise ValueError(f"request outcome: unknown tier or reason {bad}; tiers {TIERS}, "
                             f"reasons {UNSUPPLIED_REASONS}")
        if o.errors:
            self.store_errors.labels("scheduler").inc(o.errors)
        self.requests.inc()
        if o.tag:
            self._count_tag(o.tag, (o.prompt, o.local, o.got))
        self.prompt_tokens.inc(o.prompt)
        self.local_tokens.inc(o.local)
        for t, n in o.held.items():
            if n:
                self.held_tokens.labels(t).inc(n)
        for why, n in o.unsupplied.items():
            if n:
                self.unsupplied_tokens.labels(why).inc(n)

    def _count_tag(self, tag: str, counts: tuple[int, int, int]) -> None:
        """O(1) a request: a dict move, and at most one eviction (3 series removed, 3 added to)."""
        series = (self.tag_prompt, self.tag_local, self.tag_hit)
        with self._tags_lock:  # a series is never made again for a tag another thread just evicted
            if tag != OTHER_TAG:
                if tag in self._tags:
                    self._tags.move_to_end(tag)
                elif len(self._tags) >= MAX_TAGS:
                    old, held = self._tags.popitem(last=False)
                    for c, n in zip(series, held):
                        c.remove(old)
                        c.labels(OTHER_TAG).inc(n)
                totals = self._tags.setdefault(tag, [0.0, 0.0, 0.0])
                for i, n in enumerate(counts):
                    totals[i] += n
            for c, n in zip(series, counts):
                c.labels(tag).inc(n)

    def summary(self) -> dict:
        """The engine view of :func:`kvstore.offload.readout.summarize` (logged by the connector at shutdown)."""
        from kvstore.offload.readout import summarize, values

        return summarize(values(self.registry))["engine"]
