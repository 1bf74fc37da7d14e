"""Counting one walk through our code (bench/micro/walks.py): a profiler over every thread, and the house's floors.

Definitions: bench/micro/walks.py's docstring.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
import threading

import kvstore


# -- floors ---------------------------------------------------------------------------------------

def our_roots() -> list[str]:
    roots = [os.path.dirname(os.path.abspath(kvstore.__file__))]
    for name in ("connectors", "kvstore.connectors"):  # its import name before and after issue 30
        try:
            spec = importlib.util.find_spec(name)
        except ImportError:
            spec = None
        if spec is not None and spec.origin and not spec.origin.startswith(tuple(r + os.sep for r in roots)):
            roots.append(os.path.dirname(os.path.abspath(spec.origin)))
    return roots


def floors(roots: list[str]) -> dict[str, int]:
    """Path relative to the roots' parent -> floor; faces get none."""
    base = os.path.dirname(roots[0])
    mods = {}
    for root in roots:
        for d, _, files in os.walk(root):
            for f in (f for f in files if f.endswith(".py")):
                rel = os.path.relpath(os.path.join(d, f), base)
                mod = rel[:-3].replace(os.sep, ".")
                mods[mod[:-9] if mod.endswith(".__init__") else mod] = rel
    name_of = {v: k for k, v in mods.items()}
    trees = {p: ast.parse(open(os.path.join(base, p)).read(), p) for p in mods.values()}
    defines = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    faces = {p for p, t in trees.items() if p.endswith("__init__.py") and len(open(os.path.join(base, p)).read()
             .splitlines()) < 40 and not any(isinstance(n, defines) or (isinstance(n, ast.Assign) and any(
                 not (isinstance(x, ast.Name) and x.id == "__all__") for x in n.targets)) for n in t.body)}

    def targets(path, node) -> list[tuple[str, str | None, str | None]]:  # (module, name, as)
        if isinstance(node, ast.Import):
            return [(a.name, None, None) for a in node.names]
        mod = node.module or ""
        if node.level:
            parts = name_of[path].split(".")[:len(name_of[path].split(".")) - node.level
                                              + (1 if path.endswith("__init__.py") else 0)]
            mod = ".".join(parts + ([mod] if mod else []))
        return [(mod, a.name, a.asname) for a in node.names]

    def resolve(mod: str, name: str | None, seen=()) -> list[str]:
        if name and f"{mod}.{name}" in mods:
            mod, name = f"{mod}.{name}", None
        while mod and mod not in mods:
            mod = mod.rpartition(".")[0]
        path = mods.get(mod)
        if path is None or path in seen:
            return []
        if path not in faces:
            return [path]
        return [p for node in ast.walk(trees[path]) if isinstance(node, (ast.Import, ast.ImportFrom))
                for m, n, a in targets(path, node) if name is None or name in (n, a)
                for p in resolve(m, n, seen + (path,))]

    edges = {p: {d for node in ast.walk(t) if isinstance(node, (ast.Import, ast.ImportFrom))
                 for m, n, _ in targets(p, node) for d in resolve(m, n) if d != p}
             for p, t in trees.items() if p not in faces}
    reach = {}  # files each file imports, directly or not

    def down(p, acc):
        for q in edges.get(p, ()):
            if q not in acc:
                acc.add(q)
                down(q, acc)
        return acc

    for p in edges:
        reach[p] = down(p, set())
    floor: dict[str, int] = {}

    def up(p):
        if p not in floor:
            floor[p] = 0
            floor[p] = 1 + max((up(q) for q in reach[p] if p not in reach[q]), default=0)
        return floor[p]

    for p in edges:
        up(p)
    return floor


# -- the profiler ---------------------------------------------------------------------------------

# comprehensions are part of the function that holds them (Python 3.12 inlines them anyway)
INLINE = frozenset({"<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>"})
_CURRENT: list = [None]  # the tracer recording now


def dispatch(frame, event, arg):  # installed once in every thread the rig starts
    t = _CURRENT[0]
    if t is not None:
        t.profile(frame, event, arg)


class ThreadWalk:
    def __init__(self, name: str):
        self.name = name
        self.stack: list[tuple[int, tuple]] = []  # (id(frame), function)
        self.seq: list[str] = []  # files of the stack's top, consecutive repeats collapsed
        self.deepest: list[tuple] = []
        self.calls = 0

    def moved(self) -> None:
        if self.stack and (not self.seq or self.seq[-1] != self.stack[-1][1][0]):
            self.seq.append(self.stack[-1][1][0])

    def returns(self) -> int:
        seen: set[str] = set()
        n = 0
        for f in self.seq:
            n += f in seen
            seen.add(f)
        return n


class Tracer:
    def __init__(self, roots: list[str]):
        self.roots = tuple(r + os.sep for r in roots)
        self.base = os.path.dirname(roots[0])
        self.threads: dict[int, ThreadWalk] = {}
        self.funcs: set[tuple] = set()
        self.crossings: set[tuple] = set()  # (caller, callee) in two files
        self.declared: dict[tuple, str] = {}  # method -> file of the most basic class of ours declaring it
        self.lines: list[tuple[str, list[tuple]]] = []  # (stage or thread, deepest stack)
        self._rel: dict[str, str | None] = {}

    def rel(self, filename: str) -> str | None:
        r = self._rel.get(filename, "?")
        if r == "?":
            ab = os.path.abspath(filename)
            r = self._rel[filename] = os.path.relpath(ab, self.base) if ab.startswith(self.roots) else None
        return r

    def fid(self, code) -> tuple:
        return (self.rel(code.co_filename), code.co_qualname, code.co_firstlineno)

    def declaring_file(self, frame) -> str | None:
        """For a method, the file of the most basic class of ours that has it (an interface such as
        ``Tier.write`` for ``NvmeTier.write``): what the caller's code names."""
        code = frame.f_code
        first = code.co_varnames[0] if code.co_argcount else None
        if first not in ("self", "cls"):
            return None
        obj = frame.f_locals.get(first)
        for k in reversed(getattr(obj if first == "cls" else type(obj), "__mro__", ())):
            d = k.__dict__.get(code.co_name)
            c = getattr(getattr(d, "__func__", d), "__code__", None)
            if c is not None and self.rel(c.co_filename) is not None:
                return self.rel(c.co_filename)
        return None

    def profile(self, frame, event, arg) -> None:
        if ((event != "call" and event != "return") or frame.f_code.co_name in INLINE
                or self.rel(frame.f_code.co_filename) is None):
            return
        i = threading.get_ident()
        tw = self.threads.get(i) or self.threads.setdefault(i, ThreadWalk(threading.current_thread().name))
        if event == "call":
            f = self.fid(frame.f_code)
            if f not in self.declared:
                self.declared[f] = self.declaring_file(frame) or f[0]
            self.funcs.add(f)
            tw.calls += 1
            if tw.stack and tw.stack[-1][1][0] != f[0]:
                self.crossings.add((tw.stack[-1][1], f))
            tw.stack.append((id(frame), f))
            if len(tw.stack) > len(tw.deepest):
                tw.deepest = [g for _, g in tw.stack]
        else:
            k = id(frame)
            for j in range(len(tw.stack) - 1, -1, -1):
                if tw.stack[j][0] == k:
                    del tw.stack[j:]
                    break
            else:
                return
        tw.moved()

    def start(self) -> "Tracer":
        """Seed the threads waiting inside our code with their stacks, then record."""
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            chain = []
            while frame is not None and ident != threading.get_ident():
                if self.rel(frame.f_code.co_filename) is not None and frame.f_code.co_name not in INLINE:
                    chain.append((id(frame), self.fid(frame.f_code)))
                frame = frame.f_back
            if chain:
                tw = self.threads[ident] = ThreadWalk(names.get(ident, str(ident)))
                tw.stack = chain[::-1]
                tw.moved()
        _CURRENT[0] = self
        return self

    def call(self, fn, *args, **kw):
        """One stage on the entry thread, traced; its deepest stack is one part of the main line."""
        tw = self.threads.get(threading.get_ident())
        if tw is not None:
            tw.deepest = []
        sys.setprofile(dispatch)
        try:
            return fn(*args, **kw)
        finally:
            sys.setprofile(None)
            tw = self.threads.get(threading.get_ident())
            if tw is not None and tw.deepest:
                self.lines.append((fn.__qualname__, tw.deepest))

    def report(self, floor: dict[str, int]) -> dict:
        _CURRENT[0] = None
        me = threading.get_ident()
        active = {i: tw for i, tw in self.threads.items() if tw.calls}
        lines = self.lines + [(tw.name, tw.deepest) for i, tw in active.items() if i != me]

        def kind(a, b) -> str:  # b judged by the file that declares it; a base calling its own hook: "hook"
            to = self.declared.get(b, b[0])
            fa, fb = floor.get(a[0]), floor.get(to)
            return ("hook" if to == a[0] else "unknown" if fa is None or fb is None else
                    "down" if fb < fa else "up" if fb > fa else "level")

        def tally(pairs) -> tuple[dict, list[str]]:
            calls = {"down": 0, "hook": 0, "level": 0, "up": 0, "unknown": 0}
            moves = []
            for a, b in pairs:
                k = kind(a, b)
                calls[k] += 1
                to = self.declared.get(b, b[0])
                via = f" declared in {to}" if to != b[0] else ""
                moves.append(f"{a[0]}:{a[1]} -> {b[0]}:{b[1]}{via} ({k}, floor {floor.get(a[0])} -> {floor.get(to)})")
            return calls, moves

        calls, moves = tally([(a, b) for _, chain in lines for a, b in zip(chain, chain[1:]) if a[0] != b[0]])
        xcalls, xmoves = tally(sorted(self.crossings))
        on_line = {f for _, chain in lines for f in chain}
        return {"functions": len(self.funcs), "files": len({f for f, _, _ in self.funcs}), "threads": len(active),
                "thread_names": sorted(tw.name for tw in active.values()),
                "returns": sum(tw.returns() for tw in active.values()),
                "returns_by_thread": {tw.name: tw.returns() for tw in active.values()},
                "main_line": {"functions": len(on_line), "files": len({f for f, _, _ in on_line}), "calls": calls,
                              "downward_only": calls["down"] + calls["hook"] == sum(calls.values()), "moves": moves,
                              "parts": {name: [f"{f}:{q}" for f, q, _ in chain] for name, chain in lines}},
                "crossings": {"calls": len(self.crossings), "functions": len({b for _, b in self.crossings}),
                              "files": len({f for a, b in self.crossings for f in (a[0], b[0])}), "kinds": xcalls,
                              "downward_only": xcalls["down"] + xcalls["hook"] == len(self.crossings), "moves": xmoves},
                "function_list": sorted(f"{f}:{q}" for f, q, _ in self.funcs),
                "file_list": sorted({f for f, _, _ in self.funcs}),
                "sequences": {tw.name: tw.seq for tw in active.values()}}
