"""Expert copies done by C: on the calling thread in one call, or on a native copy thread.

Expert staging copies a few hundred KB per missing expert between a host-memory
source (the memory-mapped model file) and a CPU device's expert cache. From
Python each copy is a NumPy slice assignment per tensor behind a row writer,
and a background copy on a Python thread holds the GIL between copies, so the
compute thread waits for it whenever it comes back from C. Here:

- `copy_here(segments)`: all of a staging call's (dst, src, bytes) segments
  copied by one C call on the calling thread (cffi releases the GIL).
- `submit(segments)` / `take_back()` / `wait(ticket)`: background copies (a
  prefetch) on one POSIX thread, started in C, that never runs Python: it takes
  jobs from a ring in FIFO order while the caller computes; `take_back` drops
  the jobs not started and returns the ticket below which every job was
  started, so `wait(ticket)` then waits only for the one in flight.

Threads: one `Copier` is driven by one thread at a time (its owner serialises
its calls; the C side takes its own mutex for the hand-over to the copy
thread). `close()` takes back what is pending, waits for the job in flight and
joins the thread; a `Copier` dropped without `close()` is closed by its
finalizer. The caller keeps the memory of submitted jobs alive until they are
done (`wait`), which the expert stager does by draining before a graph's
buffers are released (`flare.core.expert_staging.release_staged`).

The module is compiled once with cffi into the cache folder (`cache_dir("cffi")`);
where there is no compiler `available()` is False and callers copy with NumPy.
FLARE_NATIVE_COPY=0 turns it off.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import threading
import weakref
from pathlib import Path
from types import ModuleType
from typing import Sequence

import numpy as np

from .cache import cache_dir
from .errors import FlareError

CDEF = """
typedef struct flare_copier flare_copier;
flare_copier *flare_copier_new(size_t capacity, double spin_us);
int64_t flare_copier_submit(flare_copier *c, const uint64_t *segments, size_t count);
int64_t flare_copier_take_back(flare_copier *c);
void flare_copier_wait(flare_copier *c, int64_t ticket);
int64_t flare_copier_done(flare_copier *c);
void flare_copier_free(flare_copier *c);
void flare_copy_here(const uint64_t *segments, size_t count);
"""

SOURCE = r"""
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define WAIT_SPIN_US 200.0

/* Jobs are numbered by submission (their ticket); jobs[t % capacity] holds job t while
   started <= t < submitted. The copy thread runs them in order, so `done` (jobs finished)
   is also the ticket below which every job is finished. */
typedef struct { char *dst; const char *src; size_t n; } job;

typedef struct flare_copier {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t work, progress;
    job *jobs;
    size_t capacity;
    int64_t submitted, started, done;
    int stop, sleeping, waiters;
    double spin_us;      /* how long the idle copy thread spins for the next job before sleeping */
} flare_copier;

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Spin up to `us` microseconds for *value to reach `target`: a futex sleep and wake-up costs
   tens of microseconds on a virtual machine, as much as the copy of an expert. */
static int spin_until(flare_copier *c, const int64_t *value, int64_t target, double us) {
    double end = now_us() + us;
    for (int i = 0;; i++) {
        if (__atomic_load_n(value, __ATOMIC_ACQUIRE) >= target) return 1;
        if (__atomic_load_n(&c->stop, __ATOMIC_ACQUIRE)) return 0;
        if ((i & 63) == 63 && now_us() > end) return 0;
        relax();
    }
}

static void *loop(void *arg) {
    flare_copier *c = arg;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        if (!c->stop && c->started == c->submitted && c->spin_us > 0) {
            int64_t want = c->started + 1;
            pthread_mutex_unlock(&c->mu);
            spin_until(c, &c->submitted, want, c->spin_us);
            pthread_mutex_lock(&c->mu);
        }
        while (!c->stop && c->started == c->submitted) {
            c->sleeping = 1;
            pthread_cond_wait(&c->work, &c->mu);
            c->sleeping = 0;
        }
        if (c->started == c->submitted) break;          /* stop, nothing pending */
        job j = c->jobs[c->started % c->capacity];
        c->started++;
        pthread_mutex_unlock(&c->mu);
        memcpy(j.dst, j.src, j.n);
        pthread_mutex_lock(&c->mu);
        __atomic_store_n(&c->done, c->done + 1, __ATOMIC_RELEASE);
        if (c->waiters) pthread_cond_broadcast(&c->progress);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

flare_copier *flare_copier_new(size_t capacity, double spin_us) {
    flare_copier *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->spin_us = spin_us;
    c->jobs = calloc(capacity ? capacity : 1, sizeof(job));
    c->capacity = capacity ? capacity : 1;
    if (!c->jobs || pthread_mutex_init(&c->mu, NULL)) { free(c->jobs); free(c); return NULL; }
    pthread_cond_init(&c->work, NULL);
    pthread_cond_init(&c->progress, NULL);
    if (pthread_create(&c->thread, NULL, loop, c)) {
        pthread_cond_destroy(&c->work); pthread_cond_destroy(&c->progress);
        pthread_mutex_destroy(&c->mu); free(c->jobs); free(c);
        return NULL;
    }
    return c;
}

/* segments: count triples (dst, src, bytes). Returns the ticket after the last one (wait on
   it), or -1 when the ring has no room (nothing is queued then). */
int64_t flare_copier_submit(flare_copier *c, const uint64_t *segments, size_t count) {
    pthread_mutex_lock(&c->mu);
    if ((size_t)(c->submitted - c->started) + count > c->capacity) {
        pthread_mutex_unlock(&c->mu);
        return -1;
    }
    for (size_t i = 0; i < count; i++) {
        job *j = &c->jobs[(c->submitted + (int64_t)i) % c->capacity];
        j->dst = (char *)(uintptr_t)segments[3 * i];
        j->src = (const char *)(uintptr_t)segments[3 * i + 1];
        j->n = (size_t)segments[3 * i + 2];
    }
    __atomic_store_n(&c->submitted, c->submitted + (int64_t)count, __ATOMIC_RELEASE);
    int64_t ticket = c->submitted;
    if (c->sleeping) pthread_cond_signal(&c->work);
    pthread_mutex_unlock(&c->mu);
    return ticket;
}

/* Drop the jobs not started; returns the ticket below which every job was started. */
int64_t flare_copier_take_back(flare_copier *c) {
    pthread_mutex_lock(&c->mu);
    __atomic_store_n(&c->submitted, c->started, __ATOMIC_RELEASE);
    int64_t t = c->started;
    pthread_mutex_unlock(&c->mu);
    return t;
}

void flare_copier_wait(flare_copier *c, int64_t ticket) {
    pthread_mutex_lock(&c->mu);
    int64_t target = ticket < c->submitted ? ticket : c->submitted;
    if (c->done < target) {     /* at most the job in flight after a take-back: spin a little first */
        pthread_mutex_unlock(&c->mu);
        spin_until(c, &c->done, target, WAIT_SPIN_US);
        pthread_mutex_lock(&c->mu);
    }
    c->waiters++;
    while (c->done < ticket && c->done < c->submitted)
        pthread_cond_wait(&c->progress, &c->mu);
    c->waiters--;
    pthread_mutex_unlock(&c->mu);
}

int64_t flare_copier_done(flare_copier *c) {
    pthread_mutex_lock(&c->mu);
    int64_t d = c->done;
    pthread_mutex_unlock(&c->mu);
    return d;
}

/* Copy every segment on the calling thread (cffi releases the GIL around it). */
void flare_copy_here(const uint64_t *segments, size_t count) {
    for (size_t i = 0; i < count; i++)
        memcpy((char *)(uintptr_t)segments[3 * i], (const char *)(uintptr_t)segments[3 * i + 1],
               (size_t)segments[3 * i + 2]);
}

void flare_copier_free(flare_copier *c) {
    if (!c) return;
    pthread_mutex_lock(&c->mu);
    c->submitted = c->started;    /* take back what is pending */
    __atomic_store_n(&c->stop, 1, __ATOMIC_RELEASE);
    pthread_cond_signal(&c->work);
    pthread_mutex_unlock(&c->mu);
    pthread_join(c->thread, NULL);
    pthread_cond_destroy(&c->work);
    pthread_cond_destroy(&c->progress);
    pthread_mutex_destroy(&c->mu);
    free(c->jobs);
    free(c);
}
"""

FLAGS = ("-O2", "-std=gnu11", "-pthread")
CAPACITY = 1024          # jobs queued at once (a layer's prefetch is a few runs x 3 tensors)
# how long the idle copy thread spins for its next job before sleeping (0: sleep at once). Spinning
# saves the ~50 us wake-up of these virtual machines, but holds a core that, on a shared machine,
# another process (or the compute thread's own memory traffic) would use: off by default. A caller
# waiting for the job in flight spins up to 200 us (WAIT_SPIN_US) before sleeping.
SPIN_US = 0.0

_module: ModuleType | None = None
_reason = "not loaded yet"
_lock = threading.Lock()


class CopierError(FlareError):
    """The native copy thread could not be started."""


def _build() -> ModuleType:
    """Compile (once, into the cache folder) and load the cffi module."""
    import cffi

    key = chr(0).join([SOURCE, CDEF, " ".join(FLAGS), sys.version])
    name = f"_flare_copier_{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    folder = cache_dir("cffi")
    built = sorted(folder.glob(f"{name}*.so"))
    if not built:
        ffi = cffi.FFI()
        ffi.cdef(CDEF)
        ffi.set_source(name, SOURCE, extra_compile_args=list(FLAGS), libraries=["pthread"])
        tmp = folder / f"build-{name}-{os.getpid()}"
        try:
            path = ffi.compile(tmpdir=str(tmp), verbose=False)
            final = folder / Path(path).name
            os.replace(path, final)   # atomic: a concurrent builder replaces an identical file
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        built = [final]
    spec = importlib.util.spec_from_file_location(name, built[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load() -> ModuleType | None:
    """The compiled module, or None (no cffi or compiler; `reason()` says why). FLARE_NATIVE_COPY=0
    turns it off (callers then copy with NumPy)."""
    global _module, _reason
    with _lock:
        if _module is None and _reason == "not loaded yet":
            if os.environ.get("FLARE_NATIVE_COPY", "1").strip() == "0":
                _reason = "off (FLARE_NATIVE_COPY=0)"
            else:
                try:
                    _module = _build()
                    _reason = "native"
                except Exception as exc:   # no compiler, read-only cache: NumPy copies still work
                    _reason = f"unavailable ({type(exc).__name__}: {exc})"
        return _module


def available() -> bool:
    return load() is not None


def reason() -> str:
    load()
    return _reason


def second_core() -> bool:
    """Whether this process may run on more than one core (a copy thread then has one of its own)."""
    try:
        return len(os.sched_getaffinity(0)) > 1
    except (AttributeError, OSError):
        return (os.cpu_count() or 1) > 1


class Copier:
    """One native copy thread (see the module docstring). Segments are (dst address, src address,
    bytes) triples the caller keeps valid until copied."""

    def __init__(self, capacity: int = CAPACITY, spin_us: float = SPIN_US):
        mod = load()
        if mod is None:
            raise CopierError(f"native copy thread {reason()}")
        self._ffi, self._lib = mod.ffi, mod.lib
        handle = self._lib.flare_copier_new(capacity, float(spin_us))
        if handle == self._ffi.NULL:
            raise CopierError("native copy thread: could not start a thread")
        self._handle = handle
        self._finalize = weakref.finalize(self, self._lib.flare_copier_free, handle)

    @property
    def closed(self) -> bool:
        return not self._finalize.alive

    def _segments(self, segments: np.ndarray | Sequence[tuple[int, int, int]]) -> tuple[object, int]:
        arr = np.ascontiguousarray(segments, np.uint64).reshape(-1, 3)
        return self._ffi.from_buffer("uint64_t[]", arr), arr.shape[0]

    def submit(self, segments: np.ndarray | Sequence[tuple[int, int, int]]) -> int:
        """Queue background copies; returns the ticket to `wait` for, or -1 if the ring is full
        (nothing queued: the caller copies itself)."""
        self._check()
        buf, n = self._segments(segments)
        return int(self._lib.flare_copier_submit(self._handle, buf, n)) if n else self.done()

    def copy_here(self, segments: np.ndarray | Sequence[tuple[int, int, int]]) -> None:
        """Copy every segment on the calling thread, in C (one call for all of them, the GIL
        released), leaving the copy thread to its queue."""
        self._check()
        buf, n = self._segments(segments)
        if n:
            self._lib.flare_copy_here(buf, n)

    def take_back(self) -> int:
        """Drop the queued copies not started; returns the ticket below which all were started."""
        self._check()
        return int(self._lib.flare_copier_take_back(self._handle))

    def wait(self, ticket: int) -> None:
        """Wait until every job below `ticket` (and not taken back) is finished."""
        self._check()
        self._lib.flare_copier_wait(self._handle, ticket)

    def done(self) -> int:
        """How many jobs are finished (all jobs below this ticket)."""
        self._check()
        return int(self._lib.flare_copier_done(self._handle))

    def close(self) -> None:
        """Take back the pending copies, wait for the one in flight, join the thread (idempotent)."""
        self._finalize()

    def _check(self) -> None:
        if not self._finalize.alive:
            raise CopierError("native copy thread was closed")
