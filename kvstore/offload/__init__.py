"""Engine-facing offload logic, free of any engine import.

* :mod:`~kvstore.offload.planner` (scheduler side, no tensors): per-request keys, the longest
  stored prefix, pins for loads, which newly full blocks to store each step.
* :mod:`~kvstore.offload.runner` (worker side): executes plans with the copy extension; moves
  bytes and nothing else.
* :mod:`~kvstore.offload.shared`: one store per process and model, shared by both sides.

Connectors (``connectors/``) translate an engine's objects into these calls and stay thin.
"""

from kvstore.offload.metrics import OffloadMetrics
from kvstore.offload.runner import StepRunner
from kvstore.offload.planner import LoadPlan, Planner, RequestState, StepPlan, StorePlan
from kvstore.offload.client import LocalClient, StoreClient
from kvstore.offload.rpc import RemoteClient, StoreServer
from kvstore.offload.shared import SharedStore, acquire_shared, find, release_shared

__all__ = ["Planner", "StepRunner", "RequestState", "StepPlan", "LoadPlan", "StorePlan", "OffloadMetrics",
           "SharedStore", "acquire_shared", "release_shared", "find", "StoreClient", "LocalClient", "RemoteClient",
           "StoreServer"]
