"""The soak's traffic (``kvstore bench soak``, issue 47) and vLLM's own answer to every request.

Three kinds of request, all token ids (the completions API takes them as the prompt):

* **agent**: ``agents`` sessions share one system prompt and one block of tool schemas; each turn
  is the previous prompt, its answer and a new tool result (``user_tokens``), a short think time
  after the answer; after ``turns`` turns the session starts over on the same tokens (an agent
  rerun: its whole history is a prefix hit, if the store still holds it).
* **chat**: ``chats`` sessions with an opening of their own; a turn comes back ``chat_pause_s``
  after the answer, longer than the DRAM tier's TTL, so the history must come from NVMe or Redis.
* **once**: ``once`` distinct prompts, sent when no session turn is due: no reuse; they keep the
  engine busy and push the sessions' blocks out of every small tier.

The expected output of each request is vLLM's greedy answer on the same tokens with its own
prefix cache and no kvstore, computed before the soak by an offline engine in a child process
(:func:`reference`), turn by turn, since a turn's prompt holds the previous turn's answer.
"""

from __future__ import annotations

import heapq
import json
import os
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass

import numpy as np

VOCAB = (4, 500)  # token ids drawn from here (the tiny model's vocabulary is 512)


@dataclass(frozen=True)
class Spec:
    seed: int = 0
    agents: int = 6
    turns: int = 5
    system_tokens: int = 512
    tool_tokens: int = 256
    user_tokens: int = 96
    chats: int = 4
    chat_open_tokens: int = 384
    chat_pause_s: float = 25.0
    think_s: float = 0.5
    rerun_pause_s: float = 5.0
    once: int = 200
    once_tokens: int = 512
    output_tokens: int = 16

    def max_len(self) -> int:
        """The longest prompt plus its answer, rounded up to a whole 256."""
        agent = self.system_tokens + self.tool_tokens + self.turns * (self.user_tokens + self.output_tokens)
        chat = self.chat_open_tokens + self.turns * (self.user_tokens + self.output_tokens)
        return (max(agent, chat, self.once_tokens + self.output_tokens) + 255) // 256 * 256


@dataclass
class Item:
    """One request: its prompt and the answer vLLM alone gives."""
    kind: str  # agent | chat | once
    sid: int
    turn: int
    prompt: list[int]
    expect: list[int]

    @property
    def name(self) -> str:
        return f"{self.kind}{self.sid}" + (f".t{self.turn}" if self.kind != "once" else "")


def _tokens(rng: np.random.Generator, n: int) -> list[int]:
    return [int(x) for x in rng.integers(*VOCAB, size=n)]


def openings(spec: Spec) -> dict:
    """Every session's turn-0 prompt and every turn's new tokens (the answers come from vLLM)."""
    rng = np.random.default_rng(spec.seed)
    shared = _tokens(rng, spec.system_tokens) + _tokens(rng, spec.tool_tokens)
    return {
        "agent": [[shared + _tokens(rng, spec.user_tokens)] + [_tokens(rng, spec.user_tokens)
                                                               for _ in range(spec.turns - 1)]
                  for _ in range(spec.agents)],
        "chat": [[_tokens(rng, spec.chat_open_tokens)] + [_tokens(rng, spec.user_tokens) for _ in range(spec.turns - 1)]
                 for _ in range(spec.chats)],
        "once": [_tokens(rng, spec.once_tokens) for _ in range(spec.once)],
    }


def _answer(model: str, spec: Spec) -> dict:
    """In the child: vLLM's answers, turn by turn (kind -> session -> turn -> [prompt, answer])."""
    from vllm import LLM, SamplingParams

    llm = LLM(model, enforce_eager=True, block_size=32, max_model_len=spec.max_len(), dtype="float32", seed=0,
              enable_prefix_caching=True)
    sp = SamplingParams(max_tokens=spec.output_tokens, temperature=0, ignore_eos=True)

    def run(prompts: list[list[int]]) -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    o = openings(spec)
    got: dict = {"once": [[p, a] for p, a in zip(o["once"], run(o["once"]))]}
    for kind in ("agent", "chat"):
        sessions = o[kind]
        prompts = [s[0] for s in sessions]
        got[kind] = [[] for _ in sessions]
        for t in range(spec.turns):
            if t:
                prompts = [got[kind][i][-1][0] + got[kind][i][-1][1] + s[t] for i, s in enumerate(sessions)]
            for i, a in enumerate(run(prompts)):
                got[kind][i].append([prompts[i], a])
    return got


def reference(model: str, spec: Spec, path: str, log=None) -> dict:
    """vLLM's answers (computed once per spec and model in ``path``, a JSON file)."""
    key = {"spec": asdict(spec), "model": os.path.abspath(model)}
    if os.path.exists(path):
        with open(path) as f:
            d = json.load(f)
        if d.get("key") == key:
            return d["answers"]
    spec_path = path + ".spec.json"
    with open(spec_path, "w") as f:
        json.dump(key, f)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    # -c, not -m: the soak package imports this module before -m would run it (a second copy, a warning)
    subprocess.run([sys.executable, "-c", "from kvstore.bench.soak.workload import main; main()", spec_path, path],
                   check=True, env=env, stdout=log or sys.stderr, stderr=subprocess.STDOUT if log else None,
                   timeout=1800)
    with open(path) as f:
        return json.load(f)["answers"]


class Traffic:
    """What to send next: the session turns that are due, earliest first, else a one-off prompt.
    Thread-safe; the clock is passed in."""

    def __init__(self, spec: Spec, answers: dict, now: float):
        self.spec = spec
        self.answers = answers
        self._lock = threading.Lock()
        self._due: list[tuple[float, str, int, int]] = []  # (when, kind, session, turn)
        self._busy: set[tuple[str, int]] = set()
        self._once = 0
        starts = [(kind, i) for kind, n in (("agent", spec.agents), ("chat", spec.chats)) for i in range(n)]
        for j, (kind, i) in enumerate(starts):  # the sessions' starts spread over the first seconds
            heapq.heappush(self._due, (now + 0.5 * j, kind, i, 0))

    def _item(self, kind: str, sid: int, turn: int) -> Item:
        prompt, expect = self.answers[kind][sid][turn] if kind != "once" else self.answers["once"][sid]
        return Item(kind, sid, turn, prompt, expect)

    def next(self, now: float, fill: bool = True) -> Item | None:
        """The earliest turn due by ``now``; else (``fill``) the next one-off prompt."""
        with self._lock:
            if self._due and self._due[0][0] <= now:
                _, kind, sid, turn = heapq.heappop(self._due)
                self._busy.add((kind, sid))
                return self._item(kind, sid, turn)
            if not fill or not self.spec.once:
                return None
            i, self._once = self._once % self.spec.once, self._once + 1
            return self._item("once", i, 0)

    def done(self, item: Item, now: float) -> None:
        """``item`` answered (or failed: the session goes on all the same): its next turn's time."""
        if item.kind == "once":
            return
        s = self.spec
        with self._lock:
            self._busy.discard((item.kind, item.sid))
            turn = item.turn + 1
            if turn >= s.turns:
                heapq.heappush(self._due, (now + s.rerun_pause_s, item.kind, item.sid, 0))
            else:
                pause = s.chat_pause_s if item.kind == "chat" else s.think_s
                heapq.heappush(self._due, (now + pause, item.kind, item.sid, turn))


def main() -> None:
    """The child of :func:`reference`: ``SPEC.json OUT.json`` (its argv) to vLLM's answers in OUT.json."""
    spec_path, out = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        key = json.load(f)
    answers = _answer(key["model"], Spec(**key["spec"]))
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"key": key, "answers": answers}, f)
    os.replace(tmp, out)
