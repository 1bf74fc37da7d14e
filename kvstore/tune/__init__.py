"""``kvstore tune``: replay a request trace through the store's own policy and tier accounting
(:class:`kvstore.tune.simulate.Simulator`) over a grid of TTLs, capacities and NVMe admission
(``tiers.nvme.admit_after``), and recommend a config. See docs/tuning.md."""

from kvstore.tune.simulate import Simulator, simulate
from kvstore.tune.trace_memory import Trace, from_records, load_trace, synth_records

__all__ = ["Simulator", "simulate", "Trace", "from_records", "load_trace", "synth_records"]
