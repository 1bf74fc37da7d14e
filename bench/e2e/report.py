"""The tables and plots of ``kvstore bench e2e`` (bench/e2e/): rows and goals from the raw
timings, the markdown report, the PNG plots."""

from __future__ import annotations

import statistics

import numpy as np

from kvstore.bench.common.report import Figures, markdown_table
from kvstore.bench.e2e.cases import GOALS, NR_WORKLOADS, REGIMES, _goal, _label
from kvstore.bench.e2e.two import _render_two_engines


def _paired(by_round: dict, key: tuple, base: tuple) -> list[float]:
    """Each TTFT round's median over the same round's median of ``base``."""
    mine, theirs = by_round.get(key, {}), by_round.get(base, {})
    return [statistics.median(mine[r]) / statistics.median(theirs[r]) for r in sorted(mine) if r in theirs]


def tables(a, lengths: list[int], ttft_runs: list, mt_runs: list, nr_configs: list, times: dict, cached: dict,
           mt: dict, nr: dict, do_mt: bool, by_round: dict | None = None, hook_ms: dict | None = None
           ) -> tuple[list[dict], list[dict], list[dict], list[dict]]:
    """The TTFT, multi-turn and no-reuse rows (medians and ratios) and the goals they meet."""
    goals: list[dict] = []
    rows = []
    by_round, hook_ms = by_round or {}, hook_ms or {}
    for n in lengths:
        base = statistics.median(times[("recompute", None, n)])
        vp = statistics.median(times[("vllm_prefix", None, n)])
        for case, design in ttft_runs:
            key = (case, design, n)
            t = statistics.median(times[key])
            # the ratios: the median of the rounds' paired ratios (a round's engines ran one after another)
            x_rec = _paired(by_round, key, ("recompute", None, n)) or [t / base]
            x_vp = _paired(by_round, key, ("vllm_prefix", None, n)) or [t / vp]
            hk = statistics.median(hook_ms[key]) if hook_ms.get(key) else 0.0
            row = {"prompt_tokens": n, "case": case, "design": design or "", "ttft_ms": t * 1e3,
                   "cached_tokens": cached[key], "vs_recompute": statistics.median(x_rec),
                   "vs_vllm_prefix": statistics.median(x_vp), "vs_vllm_prefix_runs": x_vp, "hook_ms": hk,
                   # kvstore's own cost alone: vLLM's prefix hit plus the hooks' time on the engine thread
                   "own_vs_vllm_prefix": (vp * 1e3 + hk) / (vp * 1e3), "goal": None}
            if case == "kvstore_dram":
                row["goal"] = _goal("dram_hit", row["vs_vllm_prefix"], f"{n} tokens", design)
            elif case == "kvstore_nvme" and n >= GOALS["nvme_hit"]["min_tokens"]:
                row["goal"] = _goal("nvme_hit", row["vs_recompute"], f"{n} tokens", design)
            if row["goal"]:
                goals.append(row["goal"])
            rows.append(row)
    mt_rows = []
    for regime in REGIMES if do_mt else []:
        base = mt[("recompute", None, "hbm_ample")]
        ample = mt.get(("vllm_prefix", None, "hbm_ample"))  # the most a cache can give: everything kept in HBM
        for case, design in mt_runs:
            runs_ = mt[(case, design, regime)]
            # paired: each round's ratio to the same round's run of the baseline, then the median
            ratios = _ratios(runs_, base)
            x = statistics.median(ratios)
            x_ample = statistics.median(_ratios(runs_, ample)) if ample else None
            goal = _goal("multi_turn", x, regime, design) if case == "kvstore" and regime == "hbm_pressure" else None
            if goal:
                goals.append(goal)
            r = runs_[0]
            mt_rows.append({"regime": regime, "case": case, "design": design or "", "turns": a.mt_turns,
                            "hook_share": statistics.median(q.get("hook_s", 0.0) / q["wall_s"] for q in runs_),
                            "bg_cpu_share": statistics.median(q.get("bg_cpu_s", 0.0) / q["wall_s"] for q in runs_),
                            "clients": a.mt_clients, "max_prompt_tokens": r["max_prompt_tokens"],
                            "prompt_tokens": r["prompt_tokens"],
                            "cached_share": min(q["cached_tokens"] for q in runs_) / max(1, r["prompt_tokens"]),
                            "mean_ttft_ms": statistics.median(q["mean_ttft_ms"] for q in runs_),
                            "p90_ttft_ms": statistics.median(q["p90_ttft_ms"] for q in runs_),
                            "wall_s": statistics.median(q["wall_s"] for q in runs_),
                            "throughput_tok_s": statistics.median(q["throughput_tok_s"] for q in runs_),
                            "x_recompute": x, "x_recompute_runs": ratios, "x_vllm_ample": x_ample,
                            "goal": goal, "per_turn": r["per_turn"]})
    nr_rows = []
    for wl in NR_WORKLOADS if nr_configs else []:
        base = nr[(wl, "vllm", None)]
        for case, design in nr_configs:
            runs_ = nr[(wl, case, design)]
            # paired: each round's ratio to vLLM's run of the same round, then the median
            ratios = _ratios(runs_, base)
            x = statistics.median(ratios)
            # the same on CPU time (all the process's threads): what kvstore's work adds, less moved by
            # other tenants of a shared machine than wall time (their time is not this process's)
            x_cpu = statistics.median(b["cpu_s"] / r["cpu_s"] for r, b in zip(runs_, base))
            goal = _goal("no_reuse", x, wl, design) if case == "kvstore" else None
            if goal:
                goals.append(goal)
            first = runs_[0]
            hook = statistics.median(r.get("hook_s", 0.0) / r["wall_s"] for r in runs_)
            bg = statistics.median(r.get("bg_cpu_s", 0.0) / r["wall_s"] for r in runs_)
            nr_rows.append({"workload": wl, "case": case, "design": design or "", "prompts": a.nr_prompts,
                            "hook_share": hook, "bg_cpu_share": bg,
                            # the saves' tail after the last output, in the wall time (bench/e2e/cases.py, no_reuse_once)
                            "save_tail_share": statistics.median(r["save_tail_s"] / r["wall_s"]
                                                                 for r in runs_),
                            # kvstore's own cost alone, each second of its threads' CPU charged to the engine
                            "own_x_vllm": 1.0 - hook - bg,
                            "prompt_tokens": first["prompt_tokens"], "output_tokens": first["output_tokens"],
                            "cached_tokens": max(r["cached_tokens"] for r in runs_),
                            "wall_s": statistics.median(r["wall_s"] for r in runs_),
                            "throughput_tok_s": statistics.median(r["throughput_tok_s"] for r in runs_),
                            "x_vllm": x, "x_vllm_runs": ratios, "x_vllm_cpu": x_cpu,
                            "throughput_runs": [r["throughput_tok_s"] for r in runs_], "goal": goal})
    return rows, mt_rows, nr_rows, goals


def _ratios(runs_: list[dict], base: list[dict]) -> list[float]:
    """Each round's throughput over the same round's baseline."""
    return [r["throughput_tok_s"] / b["throughput_tok_s"] for r, b in zip(runs_, base)]


def _own(r: dict) -> dict:
    """The hooks' and threads' shares of a kvstore row, as text (blank for the baselines)."""
    if r["case"] != "kvstore" or "hook_share" not in r:
        return {"hooks": "", "threads": "", "own": ""}
    return {"hooks": f"{100 * r['hook_share']:.2f}%", "threads": f"{100 * r['bg_cpu_share']:.2f}%",
            "own": f"{r['own_x_vllm']:.3f}" if "own_x_vllm" in r else ""}


def _goal_text(g: dict | None) -> str:
    if not g:
        return ""
    return f"{g['op']} {g['limit']:g}: {'PASS' if g['pass'] else 'FAIL'}"


def render(data: dict) -> str:
    out = []
    p = data["params"]
    designs = p.get("designs") or []
    if designs:
        out.append("Designs: " + "; ".join(f"{d} = io.async_saves {v['async_saves']}, io.async_loads "
                                           f"{v['async_loads']}" for d, v in data.get("designs", {}).items()) + "\n")
    if data["results"]:
        out.append(f"TTFT of one prompt (a 1-token generation): {p.get('ttft_rounds', 1)} rounds of a fresh engine "
                   f"per case, the order rotated, {p['repeats']} prompts per length each; TTFT = the median; x = the "
                   "median of the rounds' paired ratios. Hooks ms = kvstore's connector hooks on the engine's "
                   "thread per hit (kvstore_engine_hook_seconds_total); own x vLLM = (vLLM's prefix hit + hooks "
                   "ms) / vLLM's prefix hit: kvstore's own cost, which the machine's noise does not move. "
                   f"Goals: kvstore_dram x vLLM prefix hit {GOALS['dram_hit']['op']} {GOALS['dram_hit']['limit']:g}; "
                   f"kvstore_nvme x recompute {GOALS['nvme_hit']['op']} {GOALS['nvme_hit']['limit']:g} from "
                   f"{GOALS['nvme_hit']['min_tokens']} tokens.\n")
        rows = [{**r, "goal": _goal_text(r.get("goal")),
                 "per_round": " / ".join(f"{x:.2f}" for x in r.get("vs_vllm_prefix_runs", [])),
                 "hooks": f"{r.get('hook_ms', 0.0):.2f}" if r["case"].startswith("kvstore") else "",
                 "own": f"{r['own_vs_vllm_prefix']:.3f}" if r["case"].startswith("kvstore") else ""}
                for r in data["results"]]
        out.append(markdown_table(rows, ["prompt_tokens", "case", "design", "ttft_ms", "cached_tokens",
                                         "vs_recompute", "vs_vllm_prefix", "per_round", "hooks", "own", "goal"],
                                  ["prompt tokens", "case", "design", "TTFT ms", "cached tokens", "x recompute",
                                   "x vLLM prefix hit", "x vLLM per round", "hooks ms", "own x vLLM", "goal"]))
    if data["multi_turn"]:
        out.append(f"\nMulti-turn: {p['mt_clients']} clients x {p['mt_turns']} turns, shared {p['mt_system']}-token "
                   f"system prompt, prompts growing to ~{p['mt_max_tokens']} tokens, {p['mt_output']} output tokens "
                   "a turn. hbm_pressure = vLLM's prefix cache reset between turns. Throughput = (prompt + output "
                   f"tokens) / wall time. {p.get('mt_repeats', 1)} rounds, a fresh engine per configuration each "
                   "round, the order rotated; medians; x recompute = median of the rounds' paired ratios; x vLLM "
                   "ample = the same against vLLM's own cache with ample HBM (the most a cache can give). Goal: "
                   f"kvstore under hbm_pressure x recompute {GOALS['multi_turn']['op']} "
                   f"{GOALS['multi_turn']['limit']:g}.\n")
        rows = [{**r, "cached": f"{100 * r['cached_share']:.1f}%", "goal": _goal_text(r.get("goal")),
                 "per_round": " / ".join(f"{x:.2f}" for x in r.get("x_recompute_runs", [])),
                 "ample": "" if r.get("x_vllm_ample") is None else f"{r['x_vllm_ample']:.3f}", **_own(r)}
                for r in data["multi_turn"]]
        out.append(markdown_table(rows, ["regime", "case", "design", "max_prompt_tokens", "prompt_tokens", "cached",
                                         "mean_ttft_ms", "p90_ttft_ms", "wall_s", "throughput_tok_s", "x_recompute",
                                         "per_round", "ample", "hooks", "threads", "goal"],
                                  ["regime", "case", "design", "last prompt tokens", "prompt tokens", "from cache",
                                   "mean TTFT ms", "p90 TTFT ms", "wall s", "tokens/s", "x recompute",
                                   "x recompute per round", "x vLLM ample", "hooks", "threads", "goal"]))
    if data.get("no_reuse"):
        out.append(f"\nNo reuse: {p['nr_prompts']} distinct prompts as one batch; prefill_heavy "
                   f"{p['nr_prefill_tokens']} tokens each, 1 output token; decode_heavy {p['nr_decode_prompt']} "
                   f"tokens each, {p['nr_decode_output']} output tokens. {p['nr_repeats']} rounds, a fresh engine "
                   "per configuration each round, the order rotated; medians; x vLLM = median of the rounds' "
                   "paired ratios; x vLLM CPU = the same on the process's CPU seconds (vLLM's over kvstore's: "
                   "kvstore's own work, less moved by other tenants of a shared machine). vllm again = vLLM "
                   "without a connector a second time in each round: the spread of the rounds with no kvstore "
                   "at all. Goal: kvstore x vLLM "
                   f"{GOALS['no_reuse']['op']} {GOALS['no_reuse']['limit']:g}.\n")
        rows = [{**r, "goal": _goal_text(r.get("goal")),
                 "per_round": " / ".join(f"{x:.3f}" for x in r["x_vllm_runs"]),
                 "cpu": "" if r.get("x_vllm_cpu") is None else f"{r['x_vllm_cpu']:.3f}",
                 **_own(r)} for r in data["no_reuse"]]
        out.append("Hooks = kvstore's connector hooks on the engine's thread, threads = its own threads' CPU "
                   "seconds (copies, I/O), each as a share of the batch's wall time; own x vLLM = 1 - both: "
                   "kvstore's own cost, which the machine's noise does not move.\n")
        out.append(markdown_table(rows, ["workload", "case", "design", "prompt_tokens", "output_tokens",
                                         "cached_tokens", "wall_s", "throughput_tok_s", "x_vllm", "per_round", "cpu",
                                         "hooks", "threads", "own", "goal"],
                                  ["workload", "case", "design", "prompt tokens", "output tokens", "cached tokens",
                                   "wall s", "tokens/s", "x vLLM", "x vLLM per round", "x vLLM CPU", "hooks",
                                   "threads", "own x vLLM", "goal"]))
    info = data.get("two_engines_info")
    if info:
        out.append(_render_two_engines(data.get("two_engines") or [], info))
    if data.get("goals"):
        out.append("\nGoals (issue 13), per design:\n")
        keys = list(dict.fromkeys((g["goal"], g["where"]) for g in data["goals"]))
        by = {(g["goal"], g["where"], g["design"]): g for g in data["goals"]}
        rows = []
        for name, where in keys:
            row = {"label": GOALS[name]["label"], "where": where,
                   "limit": f"{GOALS[name]['op']} {GOALS[name]['limit']:g}"}
            for d in designs:
                g = by.get((name, where, d))
                row[d] = "" if g is None else f"{g['value']:.3f} {'PASS' if g['pass'] else 'FAIL'}"
            rows.append(row)
        out.append(markdown_table(rows, ["label", "where", "limit"] + designs, ["goal", "where", "limit"] + designs))
        met = [f"{d} {sum(g['pass'] for g in data['goals'] if g['design'] == d)}/"
               f"{sum(1 for g in data['goals'] if g['design'] == d)}" for d in designs]
        out.append("\nGoals met: " + ", ".join(met))
    notes = [f"- {s['label']}: {'driven in this run' if s['available'] else 'not run: ' + s['why']}"
             for s in data["peers"].values()]
    out.append("\nPeers (device: " + p["device"] + "):\n" + "\n".join(notes))
    if "wall_s" in p:
        load = ""
        if p.get("load_start") is not None:
            load = (f"; 1-min load average {p['load_start']:.1f} at the start, {p['load_end']:.1f} at the end, "
                    f"{p['cpus']} CPUs")
            if max(p["load_start"], p["load_end"]) > p["cpus"] + 0.5:
                load += ": other work was running on this machine, so every figure is skewed"
        out.append(f"\n(bench e2e took {p['wall_s']:.0f} s{load})")
    return "\n".join(out)


def plot(data: dict, folder: str) -> list[str]:
    """TTFT against prompt length, multi-turn throughput and TTFT, the no-reuse tax. Every y axis
    from 0; legends below the panels, never over the data; the block size in each title."""
    figs = Figures(folder)
    plt = figs.plt
    rows = data["results"]
    pr = data["params"]
    model = (f"tiny model, {pr['device'].upper()}" + (f", {pr['block_size']}-token blocks" if pr.get("block_size")
                                                       else ""))
    if rows:
        fig, ax = plt.subplots(figsize=(8, 5))
        for key in dict.fromkeys((r["case"], r.get("design", "")) for r in rows):
            pts = [(r["prompt_tokens"], r["ttft_ms"]) for r in rows if (r["case"], r.get("design", "")) == key]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=_label(*key))
        lengths = sorted({r["prompt_tokens"] for r in rows})
        ax.set_xticks(lengths, [f"{n:,}" for n in lengths])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("TTFT (ms), median of the rounds")
        ax.set_title(f"TTFT: recompute vs. prefix hits ({model})")
        ax.grid(alpha=0.3)
        fig.legend(*ax.get_legend_handles_labels(), loc="lower center", ncol=2, fontsize=8)
        fig.tight_layout(rect=(0, 0.16, 1, 1))
        figs.save(fig, "e2e_ttft.png", layout=False)
    if data["multi_turn"]:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.8))
        regimes = list(dict.fromkeys(r["regime"] for r in data["multi_turn"]))
        cases = list(dict.fromkeys((r["case"], r.get("design", "")) for r in data["multi_turn"]))
        x = np.arange(len(regimes))
        w = 0.8 / max(1, len(cases))
        for k, key in enumerate(cases):
            by = {r["regime"]: r for r in data["multi_turn"] if (r["case"], r.get("design", "")) == key}
            axes[0].bar(x + k * w, [by[g]["throughput_tok_s"] for g in regimes], w, label=_label(*key))
            axes[1].bar(x + k * w, [by[g]["mean_ttft_ms"] for g in regimes], w, label=_label(*key))
        for ax, yl in zip(axes, ("tokens/s (prompt + output)", "mean TTFT (ms)")):
            ax.set_xticks(x + w * (len(cases) - 1) / 2, regimes)
            ax.set_ylabel(yl)
            ax.set_ylim(bottom=0)
            ax.grid(axis="y", alpha=0.3)
        axes[0].set_title(f"multi-turn throughput ({model})")
        axes[1].set_title("multi-turn TTFT")
        fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=min(4, len(cases)), fontsize=8)
        fig.tight_layout(rect=(0, 0.12, 1, 1))
        figs.save(fig, "e2e_multi_turn.png", layout=False)
    if data.get("no_reuse"):
        fig, ax = plt.subplots(figsize=(8, 5))
        wls = list(dict.fromkeys(r["workload"] for r in data["no_reuse"]))
        cases = list(dict.fromkeys((r["case"], r["design"]) for r in data["no_reuse"]))
        x = np.arange(len(wls))
        w = 0.8 / max(1, len(cases))
        for k, key in enumerate(cases):
            by = {r["workload"]: r for r in data["no_reuse"] if (r["case"], r["design"]) == key}
            ax.bar(x + k * w, [by[g]["x_vllm"] for g in wls], w, label=_label(*key))
        ax.axhline(GOALS["no_reuse"]["limit"], color="k", linestyle="--", linewidth=1,
                   label=f"goal: {GOALS['no_reuse']['limit']:g} of vLLM's own")
        ax.set_xticks(x + w * (len(cases) - 1) / 2, wls)
        ax.set_ylim(bottom=0)
        ax.set_ylabel("tokens/s / vLLM's own (no connector)")
        ax.set_title(f"no-reuse tax ({model})")
        ax.grid(axis="y", alpha=0.3)
        fig.legend(*ax.get_legend_handles_labels(), loc="lower center", ncol=min(4, len(cases) + 1), fontsize=8)
        fig.tight_layout(rect=(0, 0.12, 1, 1))
        figs.save(fig, "e2e_no_reuse.png", layout=False)
    return figs.paths
