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

from dataclasses import asdict, dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram

from kvstore.store.metrics import LATENCY_BUCKETS, MISS_REASONS, TIERS
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


MAX_TAGS = 20  # request tags with a label of their own (kvstore_engine_tag_*); the rest are OTHER_TAG
OTHER_TAG = "other"


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
                   str(d.get("tag", ""))[:256])


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
        # per request tag (kv_transfer_params kvstore.tag): the first MAX_TAGS distinct tags get a
        # label of their own, later ones count as "other" (a label set that cannot grow unbounded)
        self.tag_prompt = Counter("kvstore_engine_tag_prompt_tokens", "Prompt tokens of tagged requests, by tag "
                                  "(the first 20 distinct tags; later ones as 'other')", ["tag"], registry=r)
        self.tag_local = Counter("kvstore_engine_tag_local_hit_tokens", "Of those, tokens the engine already had "
                                 "(its own prefix cache), by tag", ["tag"], registry=r)
        self.tag_hit = Counter("kvstore_engine_tag_hit_tokens", "Of those, tokens kvstore pinned to load, by tag "
                               "(a load that then fails is in it)", ["tag"], registry=r)
        self._tags: set[str] = set()
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
            tag = o.tag if o.tag in self._tags or len(self._tags) < MAX_TAGS else OTHER_TAG
            self._tags.add(tag)
            self.tag_prompt.labels(tag).inc(o.prompt)
            self.tag_local.labels(tag).inc(o.local)
            self.tag_hit.labels(tag).inc(o.got)
        self.prompt_tokens.inc(o.prompt)
        self.local_tokens.inc(o.local)
        for t, n in o.held.items():
            if n:
                self.held_tokens.labels(t).inc(n)
        for why, n in o.unsupplied.items():
            if n:
                self.unsupplied_tokens.labels(why).inc(n)

    def summary(self) -> dict:
        """The engine view of :func:`kvstore.offload.readout.summarize` (logged by the connector at shutdown)."""
        from kvstore.offload.readout import summarize, values

        return summarize(values(self.registry))["engine"]
