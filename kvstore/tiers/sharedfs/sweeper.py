"""The shared file-system tier's sweeper: one at a time, among every process of every host.

Every ``sweep_s`` each process's sweeper tries the lease, a file ``.sweeper`` in the tier's folder
holding ``<writer> <until>`` (wall-clock seconds). The holder renews it each round (written
aside, renamed over it). A lease past ``until`` (plus ``SKEW_S`` for clocks that disagree) is
taken over: moved aside by one rename (one taker wins; a lease found renewed meanwhile is put
back), then the taker's own is linked into place (a link fails where another came first). A
holder that died, froze or lost the folder is replaced ``lease_s`` after its last renewal.

The holder's round (:meth:`Sweeper.sweep`): every block file past its idle TTL is removed, then,
while the folder holds more than the capacity, the least recent (a hit refreshes a file's time);
a removal is a move into ``tmp/`` instead when a tier below takes the victims (the holder's store
writes them down, then removes them);
temporary files older than ``TMP_MAX_AGE_S`` (a writer that died, on any host) go too. So the
capacity and the TTL hold for every writer together, within a sweep period. Two processes that
both believed they held the lease (a holder frozen past it, then resumed) remove a few more of
the least recent files than needed: never a wrong byte, since a reader checks every file.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time

from kvstore.tiers import fileformat as ff
from kvstore.tiers.nvme.folder import O_CLOEXEC, O_NOFOLLOW

log = logging.getLogger(__name__)

LEASE = ".sweeper"
SKEW_S = 5.0  # clocks of hosts may disagree by this much: a lease is taken over only past it
TMP_MAX_AGE_S = 600.0  # a temporary file this old is a dead writer's (its rename would have come)
STOP_WAIT_S = 2.0  # a close waits this long for a round in progress


class Sweeper:
    def __init__(self, tier, period_s: float, lease_s: float, clock=time.time):
        self.t = tier  # the SharedFsTier: its folder, its capacity and TTL, its counters
        self.period = float(period_s)
        self.lease_s = max(float(lease_s), 2 * self.period)  # renewed every round: outlives a round
        self.clock = clock
        self.me = tier.id
        self.holding = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvstore-sharedfs-sweep", daemon=True)
        self._thread.start()

    def stop(self) -> bool:
        """Stop the rounds; the lease handed on at once (rather than after ``lease_s``), within
        the tier's deadline. False: a round is still stalled in the file system."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=STOP_WAIT_S)
            if self._thread.is_alive():
                return False
        if self.holding:
            self.holding = False
            try:
                self.t._call(self._release)
            except Exception:  # noqa: BLE001 - Down, or closed: the lease runs out on its own
                pass
        return True

    def _release(self) -> None:
        cur = self._read()
        if cur is not None and cur[0] == self.me:
            try:
                os.unlink(LEASE, dir_fd=self.t.root_fd)
            except OSError:
                pass

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.round()
            except Exception as e:  # noqa: BLE001 - a folder gone or unreachable: the next round tries again
                log.warning("kvstore sharedfs: a sweep failed: %s", e)

    def round(self) -> int | None:
        """Take or renew the lease, then sweep: the files removed, or None (another holds it)."""
        if not self.take():
            return None
        return self.sweep()

    # -- the lease ----------------------------------------------------------------------------------
    def _read(self, name: str = LEASE) -> tuple[str, float] | None:
        """(holder, until) of a lease file; a file that does not parse is a lease long past."""
        try:
            fd = os.open(name, os.O_RDONLY | O_NOFOLLOW | O_CLOEXEC, dir_fd=self.t.root_fd)
        except FileNotFoundError:
            return None
        except OSError:  # a symlink or worse where the lease belongs: taken over
            return ("", 0.0)
        try:
            body = os.read(fd, 256).decode("ascii", "replace").split()
            return (body[0], float(body[1])) if len(body) == 2 else ("", 0.0)
        except (OSError, ValueError):
            return ("", 0.0)
        finally:
            os.close(fd)

    def _write(self, name: str, until: float) -> None:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0o600,
                     dir_fd=self.t.root_fd)
        try:
            os.write(fd, f"{self.me} {until:.3f}\n".encode())
        finally:
            os.close(fd)

    def take(self) -> bool:
        """Hold the lease for ``lease_s`` more (renewed, or taken when free or past)."""
        root, now = self.t.root_fd, self.clock()
        cur = self._read()
        tmp = f"{LEASE}.{self.me}.tmp"
        if cur is not None and cur[0] == self.me:  # renew: written aside, renamed over it
            self._write(tmp, now + self.lease_s)
            os.rename(tmp, LEASE, src_dir_fd=root, dst_dir_fd=root)
            self.holding = True
            return True
        self.holding = False
        if cur is not None and now < cur[1] + SKEW_S:
            return False
        if cur is not None:  # past: moved aside by one rename (one taker wins it)
            aside = f"{LEASE}.{self.me}.stale"
            try:
                os.rename(LEASE, aside, src_dir_fd=root, dst_dir_fd=root)
            except FileNotFoundError:
                return False
            if self._read(aside) != cur:  # renewed or taken meanwhile: put back, if nobody came since
                try:
                    os.link(aside, LEASE, src_dir_fd=root, dst_dir_fd=root, follow_symlinks=False)
                except OSError:
                    pass
                os.unlink(aside, dir_fd=root)
                return False
            os.unlink(aside, dir_fd=root)
            self.t.count("leases_taken")
            log.info("kvstore sharedfs: the sweeper's lease of %s (until %.0f) taken over by %s", cur[0], cur[1],
                     self.me)
        self._write(tmp, now + self.lease_s)
        try:
            os.link(tmp, LEASE, src_dir_fd=root, dst_dir_fd=root, follow_symlinks=False)
        except FileExistsError:  # another came first
            return False
        finally:
            os.unlink(tmp, dir_fd=root)
        self.holding = True
        return True

    # -- the round ------------------------------------------------------------------------------------
    def sweep(self) -> int:
        """Remove what is past its TTL, then the least recent past the capacity, and dead writers'
        temporary files. Returns how many files it removed."""
        t, now = self.t, self.clock()
        files: list[tuple[float, int, int, str]] = []  # (time, bytes, leaf fd, name)
        total, expired = 0, 0
        for e in os.scandir(t.root_fd):
            if len(e.name) != 2 or not e.is_dir(follow_symlinks=False):
                continue
            fd = t.leaf(e.name, False)
            if fd < 0:
                continue
            for f in os.scandir(fd):
                if not f.name.endswith(ff.SUFFIX):
                    continue
                try:
                    st = f.stat(follow_symlinks=False)
                except OSError:
                    continue
                if not stat.S_ISREG(st.st_mode):
                    continue
                if t.ttl is not None and st.st_mtime < now - t.ttl:
                    expired += self._drop(fd, f.name, st.st_mtime, "expired")
                    continue
                files.append((st.st_mtime, st.st_size, fd, f.name))
                total += st.st_size
        files.sort()
        evicted = 0
        for mtime, size, fd, name in files:
            if total <= t.capacity:
                break
            evicted += self._drop(fd, name, mtime, "capacity")
            total -= size
        for f in os.scandir(t.tmp_fd):
            try:
                st = f.stat(follow_symlinks=False)
                if st.st_mtime < now - TMP_MAX_AGE_S:  # (a victim set aside: its time is its move's)
                    t.count("tmp_removed", _unlink(t.tmp_fd, f.name))
            except OSError:
                continue
        t.count("expired", expired)
        t.count("evicted", evicted)
        t.count("sweeps")
        t.measured(len(files) - evicted, total)
        if t.on_victims is not None and t.victims_waiting():  # the store takes them (its background
            t.on_victims()  # thread); said every round while any wait (a busy store missed the last)
        return expired + evicted

    def _drop(self, fd: int, name: str, mtime: float, reason: str) -> int:
        """A victim: set aside for the tier below when there is one (:meth:`SharedFsTier.set_aside`),
        else removed. 1 if it left the folder."""
        if self.t.set_aside(fd, name, mtime, reason):
            self.t.count("set_aside")
            return 1
        return _unlink(fd, name)


def _unlink(dir_fd: int, name: str) -> int:
    try:
        os.unlink(name, dir_fd=dir_fd)
        return 1
    except OSError:  # gone already (a reader found it bad, an overwrite): not ours to count
        return 0

