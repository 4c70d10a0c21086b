"""A lost rank or host ends the job in seconds, with one line that names it, instead of a traceback
from deep in a collective (a peer killed) or a wait of the collectives' timeout (a link down).

Under tensor parallelism every rank beats: a thread adds 1 to its own counter in the job's store
(torchrun's, on host 0) every BEAT_S and reads the other ranks' counters. A rank is lost when its
counter has not moved for LOST_S across this rank's own successful reads (so a rank that is slow
but alive, compiling or waiting in a collective, keeps beating from its thread); host 0 is lost when
the store itself has not answered for LOST_S. A second thread only compares times, so a store call
stuck on a dead link cannot stall it. On a loss: the line `error: lost rank R (host H): ...` on
stderr, the callbacks (the server ends its open requests with that error), then exit status 1.

A collective that fails because a peer vanished (its connection closed) calls confirm(): the
watcher then names a rank whose counter stopped SUSPECT_S ago, and the process exits with that
line. A rank that closes normally says so (GONE): the job is ending, and no silence after that is
a loss (the ranks, then torchrun's store, go quiet one by one).
Plain Python: tp.py hands in the store.
"""
import os
import signal
import socket
import sys
import threading
import time
from typing import Callable, Optional

BEAT_S = 1.0  # a rank's counter moves this often
LOST_S = float(os.environ.get("MINILLM_TP_LOST_S", "10"))  # silence after which a rank or the store is lost
SUSPECT_S = 3.0  # after a failed collective: a stopped counter is a lost rank this soon
CONFIRM_S = SUSPECT_S + 3 * BEAT_S  # how long a failed collective waits for the watcher to name the rank
LINGER_S = 1.0  # after the callbacks, for the server to send the errors, before the exit
GONE = 1 << 40  # added to a rank's counter when it closes normally


class Monitor:
    """The heartbeats of one rank and its view of the others; beat() and lost() hold the logic,
    start() runs them on threads. store: add(key, n) -> new value, set(key, value), get(key),
    check([keys]) (torch.distributed.Store's)."""

    def __init__(self, store, rank: int, world: int, store_host: str, prefix: str = "minillm/liveness",
                 clock: Callable[[], float] = time.monotonic):
        self.store, self.rank, self.world, self.store_host = store, rank, world, store_host
        self.prefix, self.clock = prefix, clock
        self.counts: dict[int, int] = {}  # rank -> its counter when last read
        self.moved: dict[int, float] = {}  # rank -> when its counter was last seen to move
        self.hosts: dict[int, tuple] = {}  # rank -> (host name, address), once it has written them
        self.last_read: Optional[float] = None  # this rank's last successful round of reads
        self.silent_since: Optional[float] = None  # the store has not answered since (a call pending or failing)
        self.suspect = False  # a collective failed: name a stopped rank sooner
        self.broken = False  # a store call failed: silent from then on
        self.callbacks: list = []
        self.stopping = threading.Event()
        self.threads: list = []

    def key(self, kind: str, rank: int) -> str:
        return f"{self.prefix}/{kind}/{rank}"

    def beat(self):
        """Bump this rank's counter and read the others'; note when the store stops answering."""
        start = self.clock()
        if self.broken:
            return
        if self.silent_since is None:
            self.silent_since = start  # until this round answers
        try:
            self.store.add(self.key("beat", self.rank), 1)
            counts = {r: self.store.add(self.key("beat", r), 0) for r in range(self.world) if r != self.rank}
            for r in [r for r in counts if r not in self.hosts]:
                if self.store.check([self.key("host", r)]):  # get() would wait for a rank yet to write it
                    self.hosts[r] = tuple(self.store.get(self.key("host", r)).decode().split())
        except Exception:  # noqa: BLE001: an unreachable store is what lost() looks for
            self.broken = True  # its client does not reconnect; each failed call would log a C++ stack
            return
        now = self.clock()
        self.silent_since, self.last_read = None, now
        for r, n in counts.items():
            if self.counts.get(r) != n:
                self.counts[r], self.moved[r] = n, now

    def lost(self, now: float) -> Optional[str]:
        """Why a rank or host is lost, as the error line says it, or None while all are alive."""
        if any(n >= GONE for n in self.counts.values()):
            return None  # the job is ending normally: a rank that closed, then the store's host, go quiet
        limit = SUSPECT_S if self.suspect else LOST_S
        if self.silent_since is not None and now - self.silent_since >= limit:
            on_it = sorted(r for r, (_, address) in self.hosts.items() if address == self.store_host)
            ranks = ", ".join(map(str, on_it or [0]))
            return (f"lost host {self.store_host} (rank {ranks}): the job's store there has not answered "
                    f"for {limit:.0f} s")
        if self.last_read is None:
            return None
        for r, moved in sorted(self.moved.items()):
            if self.last_read - moved >= limit:  # judged by this rank's reads: a stalled reader blames no one
                return f"lost rank {r}{self.host_of(r)}: no heartbeat for {limit:.0f} s"
        return None

    def forgive(self, now: float):
        """This process could not run its threads for a while (another thread held the interpreter):
        a store call's answer may wait unread, so its silence counts from now."""
        if self.silent_since is not None:
            self.silent_since = now

    def host_of(self, r: int) -> str:
        """` (host ADDRESS)`, with its name where it differs from this rank's; "" if unknown."""
        if r not in self.hosts:
            return ""
        name, address = self.hosts[r]
        return f" (host {address})" if name == socket.gethostname() else f" (host {name}, {address})"

    def declare(self, why: str):
        """The one line, the callbacks, exit status 1; never returns."""
        sys.__stderr__.write(f"error: {why}\n")
        sys.__stderr__.flush()
        for callback in self.callbacks:
            try:
                callback(why)
            except Exception:  # noqa: BLE001: the exit below matters more
                pass
        if self.callbacks:
            time.sleep(LINGER_S)  # what they sent (the server's error replies) leaves before the exit
        os._exit(1)

    def start(self, host: str):
        """Write this rank's host, then beat and watch on daemon threads."""
        self.store.set(self.key("host", self.rank), host)

        def beating():
            while not self.stopping.is_set():
                self.beat()
                self.stopping.wait(BEAT_S)

        def watching():
            last = self.clock()
            while not self.stopping.wait(BEAT_S / 2):
                now = self.clock()
                if now - last > 2 * BEAT_S:
                    self.forgive(now)
                last = now
                why = self.lost(now)
                if why is not None:
                    self.declare(why)

        self.threads = [threading.Thread(target=f, name=f"liveness-{f.__name__}", daemon=True)
                        for f in (beating, watching)]
        for t in self.threads:
            t.start()

    def stop(self, normal: bool = True):
        """Stop the threads; normal: tell the others this rank ends on purpose."""
        self.stopping.set()
        for t in self.threads:
            t.join(timeout=2 * BEAT_S)
        if normal:
            try:
                self.store.add(self.key("beat", self.rank), GONE)
            except Exception:  # noqa: BLE001: the store's host has ended first
                pass


_monitor: Optional[Monitor] = None


def start(store, rank: int, world: int, store_host: str, store_port: int, prefix: str):
    """Watch the other ranks of this job until stop(); a lost one ends this process."""
    global _monitor
    _monitor = Monitor(store, rank, world, store_host, prefix)
    _monitor.start(describe_host(store_host, store_port))
    previous = sys.excepthook

    def excepthook(kind, value, tb):  # an uncaught failure: a lost peer is named instead of the traceback
        if _monitor is not None and issubclass(kind, Exception):
            confirm()
            stop(normal=False)  # a crash is no normal end: the others name this rank
        previous(kind, value, tb)

    sys.excepthook = excepthook


def stop(normal: bool = True):
    """Stop watching (tp.close at exit); normal: the others take this rank's silence as its end."""
    global _monitor
    if _monitor is not None:
        _monitor, monitor = None, _monitor
        monitor.stop(normal)


def on_lost(callback: Callable[[str], None]):
    """callback(why) runs on the watcher's thread before the exit (the server answers its requests)."""
    if _monitor is not None:
        _monitor.callbacks.append(callback)


def confirm():
    """A collective failed: if a peer was lost, name it and exit (the watcher does, within
    CONFIRM_S); return when every peer still beats, the failure being something else. Meanwhile a
    SIGTERM waits for the verdict: torchrun on a host that lost host 0 ends its ranks as soon as
    its own store connection fails, before they could say why."""
    monitor = _monitor
    if monitor is None:
        return
    monitor.suspect = True
    held = []  # the SIGTERMs that came meanwhile
    main = threading.current_thread() is threading.main_thread()  # where a signal handler can be set
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: held.append(signum)) if main else None
    try:
        deadline = time.monotonic() + CONFIRM_S
        while time.monotonic() < deadline:
            time.sleep(BEAT_S / 4)
    finally:
        monitor.suspect = False
        if main:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
    if held:  # no loss named: the SIGTERM as it would have ended this process
        os.kill(os.getpid(), signal.SIGTERM)


def describe_host(store_host: str, store_port: int) -> str:
    """This machine's name and the address it reaches the store from: `name 10.0.0.2`."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((store_host, store_port))  # UDP: picks the route, sends nothing
            address = s.getsockname()[0]
    except OSError:
        address = "?"
    return f"{socket.gethostname()} {address}"
