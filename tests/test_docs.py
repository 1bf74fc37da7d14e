"""Docs that run: every fenced ``bash`` or ``python`` block placed right after a line
``<!-- doc-test: run -->`` in README.md or docs/*.md is run, the blocks of one file in order as one
bash script (a python block through ``python - <<EOF``), from a folder outside the repository with
a fresh HOME and this environment's ``python`` and ``kvstore`` first on PATH. A doc that drifts
(a renamed option, a config that no longer loads, an example that no longer runs) fails here.

The README's quick start starts a real vLLM server (the tiny model, its shipped ``agent`` config),
sends its requests and reads ``kvstore stats``; the only change made to its text is the two ports
(8000, 9400), replaced by free ones so that a run never meets another server. Also checked: the
README stays within 150 lines, and every repository path and relative link the docs name exists.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARK = "<!-- doc-test: run -->"
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
BIN = str(Path(sys.executable).parent)


def blocks(path: Path) -> list[tuple[str, str, int]]:
    """(language, code, line) of every marked block; a mark not followed by a bash/python fence fails."""
    lines = path.read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        if line.strip() != MARK:
            continue
        fence = lines[i + 1].strip() if i + 1 < len(lines) else ""
        assert fence in ("```bash", "```python"), f"{path.name}:{i + 1}: {MARK} must precede a ```bash or ```python block"
        end = next(j for j in range(i + 2, len(lines)) if lines[j].strip() == "```")
        out.append((fence[3:], "\n".join(lines[i + 2:end]), i + 1))
    return out


def script(path: Path, subst: dict[str, str] | None = None) -> str:
    parts = ["set -euo pipefail"]
    for lang, code, line in blocks(path):
        for a, b in (subst or {}).items():
            code = code.replace(a, b)
        parts.append(f"echo '### {path.name}:{line}'")
        parts.append(code if lang == "bash" else f"python - <<'KVSTORE_DOC_EOF'\n{code}\nKVSTORE_DOC_EOF")
    return "\n".join(parts) + "\n"


def run(path: Path, home: Path, timeout: float, subst: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The file's marked blocks as one bash script in its own process group (killed whole after)."""
    home.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE")}
    env.update(HOME=str(home), PATH=f"{BIN}:{env.get('PATH', '')}", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    p = subprocess.Popen(["bash", "-c", script(path, subst)], cwd=home, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        pytest.fail(f"{path.name}: its blocks ran past {timeout:.0f} s\n{out[-4000:]}")
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # a server a failed script left behind
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(p.args, p.returncode, out, "")


def test_the_readme_is_short_and_every_mark_precedes_a_block():
    readme = (ROOT / "README.md").read_text().splitlines()
    assert len(readme) <= 150, f"README.md has {len(readme)} lines (at most 150: the rest goes to docs/)"
    for path in DOCS:
        blocks(path)  # fails on a dangling mark
    assert len(blocks(ROOT / "README.md")) >= 3 and sum(len(blocks(p)) for p in DOCS) >= 6


def test_every_path_and_link_the_docs_name_exists():
    missing = []
    for path in DOCS:
        text = path.read_text()
        for m in re.finditer(r"`((?:kvstore|bench|tests|csrc|connectors|configs|docs)/[A-Za-z0-9_./-]*)`", text):
            if not (ROOT / m[1]).exists():
                missing.append(f"{path.name}: `{m[1]}`")
        for m in re.finditer(r"\]\(([^)#:]+\.md)(#[\w-]+)?\)", text):
            target = (path.parent / m[1]).resolve()
            if not target.exists():
                missing.append(f"{path.name}: link {m[1]}")
            elif m[2] and f'id="{m[2][1:]}"' not in target.read_text() and \
                    not re.search(rf"^#+ .*{m[2][1:]}", target.read_text(), re.M | re.I):
                missing.append(f"{path.name}: anchor {m[1]}{m[2]}")
    assert not missing, missing


@pytest.mark.parametrize("name,expect", [("python.md", "PrefixMatch(num_blocks=6"),
                                         ("cli.md", "to keep 65,536 tokens: 8 GiB"),
                                         ("tuning.md", "tuned.yaml is a valid config")])
def test_docs_blocks_run(tmp_path, name, expect):
    p = run(ROOT / "docs" / name, tmp_path / "home", timeout=600)
    assert p.returncode == 0, p.stdout[-4000:]
    assert expect in p.stdout, p.stdout[-4000:]


def _free_ports(n: int) -> list[str]:
    from kvstore.bench.common.ports import free_ports

    return [str(p) for p in free_ports(n)]


@pytest.mark.vllm
@pytest.mark.slow
def test_the_readme_quick_start(tmp_path):
    pytest.importorskip("vllm")
    api, metrics = _free_ports(2)
    home = tmp_path / "home"
    p = run(ROOT / "README.md", home, timeout=900, subst={"8000": api, "9400": metrics})
    log = home / "kvstore-demo" / "server.log"
    tail = log.read_text()[-6000:] if log.exists() else "(no server log)"
    assert p.returncode == 0, p.stdout[-4000:] + "\n--- server.log ---\n" + tail
    served = [int(n) for n in re.findall(r"served from dram\s+[\d.]+%\s+\((\d+) tokens\)", p.stdout)]
    assert len(served) == 2, p.stdout[-4000:]
    assert served[0] == 0 and "held by kvstore but already in the engine's prefix cache" in p.stdout  # vLLM answered
    assert served[1] >= 768, p.stdout[-4000:]  # after vLLM's reset: the prompt's full blocks came from kvstore
    assert "kvstore sizing" in p.stdout  # the sizing block ran too
