"""bench/soak/watch.py against the real sources: /proc of this process and its children, a real
folder, a real redis-server, a real Prometheus endpoint; the growth judgement on known series; the
plot written."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from kvstore.bench.soak import watch as sw
from kvstore.bench.common.ports import free_port
from redis_servers import redis_single  # noqa: F401 (fixture)

FLOOR = {"rss_mb": 64, "threads": 4, "fds": 16, "files": 64, "mb": 64, "keys": 256, "blocks": 64}


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        s = f.read()
    return s[s.rfind(")") + 2]


# --- processes ------------------------------------------------------------------------------

def test_process_numbers_of_this_process_and_a_child():
    child = subprocess.Popen(["sleep", "30"])
    try:
        before = sw.sample({"me": os.getpid(), "child": child.pid, "off": None})
        # 64 MiB of fresh pages, touched: its own mapping (an np.ones could reuse memory an earlier
        # test freed and the allocator kept resident: +0 MB, seen in a full run)
        hold = mmap.mmap(-1, 64 << 20)
        for i in range(0, 64 << 20, mmap.PAGESIZE):
            hold[i] = 1
        files = [open(os.devnull) for _ in range(10)]
        stop = threading.Event()
        threads = [threading.Thread(target=stop.wait) for _ in range(3)]
        for t in threads:
            t.start()
        after = sw.sample({"me": os.getpid()})
        stop.set()
        for t in threads:
            t.join()
        for f in files:
            f.close()
        hold.close()
    finally:
        child.kill()
        child.wait()
    assert not any(k.startswith("off.") for k in before)
    assert 10 < before["me.rss_mb"] < 4096 and before["me.threads"] >= 1 and before["me.fds"] >= 3
    # sleep: one thread, stdin/out/err, and a small fraction of this interpreter's memory
    assert before["child.threads"] == 1 and before["child.fds"] >= 3
    assert 0 < before["child.rss_mb"] < before["me.rss_mb"] / 4
    assert 56 <= after["me.rss_mb"] - before["me.rss_mb"] <= 80  # kB read as MB
    assert 10 <= after["me.fds"] - before["me.fds"] <= 12
    assert after["me.threads"] - before["me.threads"] >= 3


def test_a_dead_or_zombie_pid_leaves_its_numbers_out():
    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: no /proc entry
    zombie = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while _state(zombie.pid) != "Z":  # exited, not yet reaped
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        s = sw.sample({"gone": gone.pid, "zombie": zombie.pid, "me": os.getpid()})
    finally:
        zombie.wait()
    assert not any(k.startswith(("gone.", "zombie.")) for k in s)
    assert {"me.rss_mb", "me.threads", "me.fds"} <= set(s)


def test_children_finds_grandchildren():
    sh = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30 & wait"])
    try:
        deadline = time.monotonic() + 10
        while len(sw.children(sh.pid)) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        kids = sw.children(sh.pid)
        mine = sw.children(os.getpid())
    finally:
        sh.kill()
        sh.wait()
    assert len(kids) == 2
    assert sh.pid in mine and set(kids) <= set(mine)
    assert mine.index(sh.pid) < min(mine.index(k) for k in kids)  # children before grandchildren


# --- the NVMe folder ------------------------------------------------------------------------

def test_nvme_counts_regular_files_without_following_links(tmp_path):
    root = tmp_path / "nvme"
    (root / "a" / "b").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "a" / "one").write_bytes(b"x" * 1000)
    (root / "a" / "b" / "two").write_bytes(b"y" * (3 << 20))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "big").write_bytes(b"z" * (5 << 20))
    (root / "link_file").symlink_to(outside / "big")
    (root / "link_dir").symlink_to(outside)
    os.mkfifo(root / "fifo")
    s = sw.sample({}, nvme_path=str(root))
    assert s["nvme.files"] == 2
    assert s["nvme.mb"] == pytest.approx((1000 + (3 << 20)) / (1 << 20))
    assert "nvme.files" not in sw.sample({}, nvme_path=str(tmp_path / "none"))


CHURN = """
import os, sys
root = sys.argv[1]
print("up", flush=True)
i = 0
while True:  # until killed: folders of block files made and removed
    d = os.path.join(root, f"d{i % 4}")
    os.makedirs(d, exist_ok=True)
    for j in range(50):
        open(os.path.join(d, f"f{j}"), "wb").close()
    for j in range(50):
        os.unlink(os.path.join(d, f"f{j}"))
    os.rmdir(d)
    i += 1
"""


def test_nvme_walk_survives_files_and_folders_coming_and_going(tmp_path):
    root = tmp_path / "nvme"
    root.mkdir()
    (root / "stay").write_bytes(b"s" * 100)
    # another process, so that it runs between the walk's listing and its lstat
    churn = subprocess.Popen([sys.executable, "-c", CHURN, str(root)], stdout=subprocess.PIPE, text=True)
    try:
        assert churn.stdout.readline().strip() == "up"
        # 2 s of walks (here thousands, a folder removed mid-walk about 5 times a second), and
        # until the walks have seen the churn: a shared machine may not run it at once
        seen, t0 = [], time.monotonic()
        while time.monotonic() - t0 < 2 or len({s.get("nvme.files") for s in seen}) < 3:
            assert time.monotonic() - t0 < 30
            seen.append(sw.sample({}, nvme_path=str(root)))
    finally:
        churn.kill()
        churn.wait()
    assert all(s.get("nvme.files", 0) >= 1 for s in seen)


# --- Redis ----------------------------------------------------------------------------------

def test_redis_keys_and_memory(redis_single, monkeypatch):  # noqa: F811
    c = redis_single.client()
    c.mset({f"k{i}": b"v" * 1000 for i in range(300)})
    monkeypatch.delenv("KVSTORE_REDIS_PASSWORD", raising=False)
    # no password anywhere: refused, left out
    assert "redis.keys" not in sw.sample({}, redis_url=redis_single.url)
    # the password in the URL
    port, pw = redis_single.port, redis_single.password
    s = sw.sample({}, redis_url=f"redis://:{pw}@127.0.0.1:{port}/0")
    assert s["redis.keys"] == 300
    used = c.info("memory")["used_memory"] / (1 << 20)
    assert s["redis.used_mb"] == pytest.approx(used, rel=0.2) and s["redis.used_mb"] > 0.3
    # from the environment when the URL has none
    monkeypatch.setenv("KVSTORE_REDIS_PASSWORD", pw)
    assert sw.sample({}, redis_url=redis_single.url)["redis.keys"] == 300
    c.close()


def test_redis_down_is_left_out_quickly():
    t0 = time.monotonic()
    s = sw.sample({}, redis_url=f"redis://127.0.0.1:{free_port()}")
    assert "redis.keys" not in s and time.monotonic() - t0 < 5


# --- kvstore's metrics ----------------------------------------------------------------------

@pytest.fixture(params=["", "vllm:"])  # kvstore's own endpoint, and vLLM's /metrics (vllm:<name>)
def metrics_endpoint(request):
    from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

    pre = request.param
    reg = CollectorRegistry()
    blocks = Gauge(pre + "kvstore_tier_blocks", "blocks", ["tier", "model"], registry=reg)
    blocks.labels("dram", "m1").set(10)
    blocks.labels("dram", "m2").set(5)  # summed over model (a node daemon's several stores)
    blocks.labels("nvme", "m1").set(40)
    served = Counter(pre + "kvstore_engine_served_tokens", "served", ["tier", "engine"], registry=reg)
    served.labels("dram", "e0").inc(300)
    served.labels("dram", "e1").inc(200)
    served.labels("nvme", "e0").inc(64)
    Counter(pre + "kvstore_engine_prompt_tokens", "prompt", registry=reg).inc(2000)
    Counter(pre + "kvstore_engine_local_hit_tokens", "local", registry=reg).inc(400)
    errors = Counter(pre + "kvstore_tier_errors", "errors", ["tier", "op"], registry=reg)
    errors.labels("nvme", "read").inc(3)
    errors.labels("remote", "timeout").inc(1)
    Counter(pre + "kvstore_other_thing", "not ours", ["tier"], registry=reg).labels("dram").inc(99)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=reg)
    yield port
    server.shutdown()
    server.server_close()
    thread.join()


def test_metrics_from_a_prometheus_endpoint(metrics_endpoint):
    want = {"dram.blocks": 15, "nvme.blocks": 40, "served.dram": 500, "served.nvme": 64,
            "prompt_tokens": 2000, "local_hit_tokens": 400, "errors.nvme.read": 3, "errors.remote.timeout": 1}
    for url in (f"http://127.0.0.1:{metrics_endpoint}/metrics", f"127.0.0.1:{metrics_endpoint}"):
        s = sw.sample({}, metrics_url=url)
        assert s == want  # nothing else: no _created timestamps, no other metrics
    assert sw.sample({}, metrics_url=f"http://127.0.0.1:{free_port()}/metrics") == {}


# --- the track and the growth judgement -----------------------------------------------------

def _track(name, ts, vs) -> sw.Track:
    tr = sw.Track()
    for t, v in zip(ts, vs):
        tr.add(t, {name: v})
    return tr


def test_track_round_trips_through_json():
    tr = sw.Track()
    tr.add(0, {"a.rss_mb": 1.5, "ttft.p50_ms": float("nan")})  # NaN: no number
    tr.add(2, {"a.rss_mb": 2.5, "nvme.files": 3})
    back = sw.Track.from_json(json.loads(json.dumps(tr.to_json(), allow_nan=False)))
    for name in ("a.rss_mb", "nvme.files", "ttft.p50_ms"):
        for x, y in zip(tr.series(name), back.series(name)):
            np.testing.assert_array_equal(x, y)
    assert back.series("a.rss_mb")[1].tolist() == [1.5, 2.5] and back.series("ttft.p50_ms")[0].size == 0


RUN = 600.0
TS = np.arange(0, RUN, 2.0)


def test_a_flat_noisy_series_passes():
    rng = np.random.default_rng(1)
    rows = sw.limits(_track("server.rss_mb", TS, 1000 + rng.normal(0, 8, TS.size)), ["server.rss_mb"],
                     run_s=RUN, rel=0.1, floor=FLOOR)
    (r,) = rows
    assert r["ok"] and abs(r["projected"]) < 20 and r["median"] == pytest.approx(1000, abs=3)
    assert r["limit"] == pytest.approx(100, rel=0.02)  # rel x median over the floor of 64


def test_a_growing_series_fails():
    rng = np.random.default_rng(2)
    vs = 200 + 0.2 * TS + rng.normal(0, 3, TS.size)  # 0.2 fds/s: 12 a minute
    (r,) = sw.limits(_track("daemon.fds", TS, vs), ["daemon.fds"], run_s=RUN, rel=0.1, floor=FLOOR)
    assert not r["ok"] and "> limit" in r["reason"]
    assert r["slope_per_min"] == pytest.approx(12, rel=0.1) and r["projected"] == pytest.approx(120, rel=0.1)


def test_growth_under_the_floor_passes():
    vs = 2 + 0.005 * TS  # threads 2 -> 5: triple the median, but 3 threads < floor 4
    (r,) = sw.limits(_track("engine.threads", TS, vs), ["engine.threads"], run_s=RUN, rel=0.1, floor=FLOOR)
    assert r["ok"] and r["limit"] == 4


def test_a_restart_with_since_passes_and_without_would_fail():
    # steady at 1000, the process restarts at 320 s (drops to 0) and warms up again to 1000 by 420
    vs = np.where(TS < 320, 1000.0, np.minimum(1000.0, (TS - 320) * 10))
    tr = _track("redis.keys", TS, vs)
    (fooled,) = sw.limits(tr, ["redis.keys"], run_s=RUN, rel=0.1, floor=FLOOR)
    assert not fooled["ok"]
    (r,) = sw.limits(tr, ["redis.keys"], run_s=RUN, rel=0.1, floor=FLOOR, since={"redis.keys": 320})
    assert r["ok"] and r["projected"] == pytest.approx(0, abs=1)


def test_too_few_samples_is_reported_not_failed():
    tr = _track("server.rss_mb", [0, 2, 4, 6, 8, 10], [100, 200, 300, 400, 500, 600])
    (r, missing) = sw.limits(tr, ["server.rss_mb", "daemon.rss_mb"], run_s=RUN, rel=0.1, floor=FLOOR)
    assert r["ok"] and r["projected"] is None and "too few" in r["reason"] and r["n"] == 3
    assert missing["ok"] and missing["n"] == 0 and missing["reason"] == "no samples"


def test_floor_is_chosen_by_the_longest_matching_suffix():
    assert sw._floor("server.rss_mb", {"mb": 1, "rss_mb": 2}) == 2
    assert sw._floor("redis.used_mb", {"mb": 1, "rss_mb": 2}) == 1
    assert sw._floor("nvme.blocks", {"mb": 1}) == 0


# --- hit rate and the plot ------------------------------------------------------------------

def test_hit_rate_from_counter_deltas_through_a_restart():
    tr = sw.Track()
    p = l_ = d = 0
    for i in range(20):
        if i == 10:
            p = l_ = d = 0  # the engine restarted: its counters start again
        p, l_, d = p + 100, l_ + 20, d + 40  # half of the 80 tokens asked of kvstore each interval
        tr.add(2 * i, {"prompt_tokens": p, "local_hit_tokens": l_, "served.dram": d})
    ts, rate = sw.hit_rate(tr, window=3)["dram"]
    assert ts.tolist() == [2 * i for i in range(1, 20)]
    np.testing.assert_allclose(rate, 50)


def test_plot_writes_a_png(tmp_path):
    rng = np.random.default_rng(3)
    tr = sw.Track()
    for i, t in enumerate(TS):
        s = {f"{r}.{k}": v + rng.normal(0, 1) for r in ("server", "engine", "daemon")
             for k, v in (("rss_mb", 900), ("threads", 40), ("fds", 70))}
        s.update({"nvme.files": i, "nvme.mb": i * 0.5, "redis.keys": 3 * i, "redis.used_mb": 2 + i / 100,
                  "dram.blocks": min(i, 100), "nvme.blocks": i, "prompt_tokens": 100 * i,
                  "local_hit_tokens": 20 * i, "served.dram": 30 * i, "served.nvme": 10 * i,
                  "ttft.p50_ms": 40 + rng.normal(0, 3), "ttft.p99_ms": 120 + rng.normal(0, 10),
                  "errors.nvme.read": i // 50, "requests.failed": i // 100})
        tr.add(t, s)
    path = tmp_path / "soak.png"
    sw.plot(tr, str(path), marks=[(120, "kill daemon"), (300, "redis down")], title="soak test")
    import matplotlib.image

    img = matplotlib.image.imread(path)
    assert img.shape[0] > 800 and img.shape[1] > 1000 and img[..., :3].std() > 0.05
    empty = tmp_path / "empty.png"
    sw.plot(sw.Track(), str(empty))
    assert empty.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
