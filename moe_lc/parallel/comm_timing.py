"""When a collective is done: real completion stamps, the modelled link, and its handle's wait.

Every counted collective is issued asynchronously and returned as an `IssuedWork` (see comm.py); a
synchronous call is an issue followed at once by `wait()`. Waiting where a result is first used,
not where it was issued, is what lets communication hide behind compute (overlap).

On CPU (gloo) the transfer runs in gloo's own threads whether or not anyone waits, but gloo offers
no completion callback for point-to-point ops or reduce-scatter (`Work.get_future` is not
implemented), so a small pool of daemon threads (`CompletionWatcher`) waits on each issued work and
stamps the moment it really finished. With a modelled link (`parallel.link = "LATENCY_US:GBPS"`, or
two levels, "intra=LATENCY_US:GBPS,inter=LATENCY_US:GBPS": bytes to ranks on other nodes, by
`parallel.ranks_per_node`, take the inter link) an op is done `latency + bytes / bandwidth` after that moment (all its ranks had issued it and
gloo had moved the bytes), and `wait()` sleeps only for what is left: time spent computing after
the issue is hidden for real, so the gloo runs on one host behave like a slow network.

Per mesh group the counter books `time_s` (issue to done: the op's own duration, modelled or
measured) and `exposed_s` (the part this rank spent blocked in `wait`). Hidden = time_s - exposed_s.
On CUDA (NCCL) a wait only orders streams and costs the host nothing: no stamps, nothing booked.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """A modelled network: every op takes at least latency + bytes / bandwidth. With `inter` (a two-level
    link: this one inside a node, `inter` between nodes) the bytes bound for other nodes take `inter`'s
    time, the rest this one's, both at once: the op takes the longer."""

    latency_s: float
    bytes_per_s: float
    inter: "Link | None" = None

    def seconds(self, nbytes: int, inter_nbytes: int = 0) -> float:
        if self.inter is None:
            return self.latency_s + nbytes / self.bytes_per_s
        local = nbytes - inter_nbytes
        t_local = self.latency_s + local / self.bytes_per_s if local > 0 or not inter_nbytes else 0.0
        return max(t_local, self.inter.seconds(inter_nbytes) if inter_nbytes else 0.0)


class CompletionWatcher:
    """Daemon threads that wait on issued works and stamp when each finished (a `Future` of the
    time.perf_counter() value). The pool grows whenever no thread is idle, so an op is never stamped
    late because others are still pending (a pending receive may wait on this rank's own progress)."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def watch(self, work) -> Future:
        done: Future = Future()
        with self._lock:
            if self._idle == 0:
                threading.Thread(target=self._serve, name="comm-watcher", daemon=True).start()
            else:
                self._idle -= 1
        self._queue.put((work, done))
        return done

    def _serve(self) -> None:
        while True:
            work, done = self._queue.get()
            try:
                work.wait()
                done.set_result(time.perf_counter())
            except BaseException as exc:  # re-raised by the waiter as a CollectiveError
                done.set_exception(exc)
            with self._lock:
                self._idle += 1


_WATCHER = CompletionWatcher()  # process-wide: its threads serve every run in the process


class IssuedWork:
    """One issued collective (or one op of a p2p batch). `wait()` returns once it is done; `done()`
    asks without blocking. At the first wait it is booked: `book(issued, done, wait_start, wait_end)`
    (time.perf_counter() values).

    work: the torch Work (None for an op that needed no transfer); timed: stamp completion on a
    watcher thread (CPU groups); link: the modelled link, or None; nbytes: the bytes the link moves, of
    them inter_nbytes to other nodes; instant: done as soon as issued (the dry run's fake process groups
    on the meta device).
    """

    def __init__(self, work, timed: bool, link: Link | None, nbytes: int, book, on_error, instant: bool = False,
                 inter_nbytes: int = 0):
        self.work, self.book, self.on_error, self.instant = work, book, on_error, instant
        self.issued = time.perf_counter()
        self.model_s = link.seconds(nbytes, inter_nbytes) if link is not None else 0.0
        self._stamp = _WATCHER.watch(work) if timed and work is not None else None
        self._waited = False

    def _finished_at(self) -> float:
        """Block until the real op finished; its completion time."""
        try:
            if self._stamp is not None:
                return self._stamp.result()
            if self.work is not None:
                self.work.wait()
        except Exception as exc:
            raise self.on_error(exc) from exc
        return time.perf_counter()

    def wait(self) -> None:
        if self._waited:
            return
        start = time.perf_counter()
        done = self._finished_at() + self.model_s
        left = done - time.perf_counter()
        if left > 0:
            time.sleep(left)
        self._waited = True
        if self._stamp is not None:
            self.book(self.issued, done, start, time.perf_counter())

    def done(self) -> bool:
        """True once wait() would not block."""
        if self._waited:
            return True
        if self._stamp is not None:
            return self._stamp.done() and (self._stamp.exception() is not None or
                                           time.perf_counter() >= self._stamp.result() + self.model_s)
        # the dry run's fake works never say they completed: its meta-device network is instant
        return self.work is None or self.instant or self.work.is_completed()
