"""This process's resident memory: its peak, and what it still holds after handing freed memory back to the OS
(recorded per round as ``peak_rss_mb`` / ``rss_after_round_mb`` by clients and the server; ``fedspear bench``)."""

from __future__ import annotations

import resource


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (MiB; Linux ``ru_maxrss`` is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak() -> bool:
    """Start this process's peak resident memory (``peak_rss_mb``) afresh from its present size, so a later phase's
    peak is its own: Linux's ``/proc/self/clear_refs`` with ``5`` resets the high-water mark (``VmHWM``, which
    ``ru_maxrss`` reports). ``fedspear bench`` calls it before its rounds, whose server runs in the process that
    measured the throughputs. Returns False where the kernel offers no reset (the peak then stays the lifetime's).
    """
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def release_memory() -> float:
    """Give the memory a finished phase freed back to the OS; return this process's resident memory after (MiB).

    glibc's malloc keeps freed heap pages for reuse, and after the first large tensors are freed it raises its mmap
    threshold (up to 32 MiB), so later activations and logits come from a heap that never shrinks: a SmolLM2 client
    held 4.7 GiB after four default rounds, of which ``malloc_trim(0)`` returned 3.0 GiB (1.7 GiB left; issue 19,
    measured in-process on the Zen 4 machine). Called between rounds, it lowers what an idle client holds, not the
    peak inside a round. No-op (``nan`` without /proc) where libc has no ``malloc_trim``.
    """
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmRSS:"))
    except (OSError, StopIteration, ValueError):
        return float("nan")
