"""An engine's run in a fresh Python process (``bench e2e``'s two engines, ``bench node``'s
embedded and node engines): each engine gets a process of its own, as it would in a deployment.

The parent writes the job as ``FOLDER/NAME.job.json`` and runs
``python -m kvstore.bench.common.engine_job MODULE:FUNCTION FOLDER/NAME.job.json``; the child calls
``FUNCTION(job)`` and writes what it returns to ``FOLDER/NAME.result.json`` (through a temporary
file: a result is whole or absent), its output going to ``FOLDER/NAME.log``. The parent reads the
result back, or raises with the tail of that log.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout


def spawn(function: str, name: str, job: dict, folder: str, *, what: str, env: dict | None = None,
          timeout: float = 3600) -> dict:
    """Run ``function`` (``"module:function"``) on ``job`` in a child process; its result. ``env``
    is added to the child's environment; ``what`` names the bench in the error a failure raises."""
    from kvstore.bench.common.redis_local import die_with_parent

    path, log_path, result = (os.path.join(folder, f"{name}.{x}") for x in ("job.json", "log", "result.json"))
    child_env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1",
                     PYTHONPATH=os.pathsep.join([REPO] + [x for x in [os.environ.get("PYTHONPATH")] if x]))
    child_env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    child_env.update(env or {})
    with open(path, "w") as f:
        json.dump({**job, "result": result}, f)
    with open(log_path, "w") as log:
        p = subprocess.Popen([sys.executable, "-m", "kvstore.bench.common.engine_job", function, path], cwd=REPO,
                             env=child_env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                             preexec_fn=die_with_parent)  # no orphan engine if the bench is killed
        try:
            rc = p.wait(timeout=timeout)
        except BaseException:
            p.kill()
            p.wait()
            raise
    if rc != 0 or not os.path.exists(result):
        with open(log_path, errors="replace") as f:
            tail = f.read()[-4000:]
        raise RuntimeError(f"{what}: engine {name} failed (exit {rc}):\n{tail}")
    with open(result) as f:
        return json.load(f)


def child(function: str, path: str) -> dict:
    """The child's side: run ``function`` on the job at ``path``, write its result beside it."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    module, _, name = function.partition(":")
    with open(path) as f:
        job = json.load(f)
    res = getattr(importlib.import_module(module), name)(job)
    with open(job["result"] + ".tmp", "w") as f:
        json.dump(res, f)
    os.replace(job["result"] + ".tmp", job["result"])
    return res


if __name__ == "__main__":
    child(sys.argv[1], sys.argv[2])
