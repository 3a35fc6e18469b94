"""This process's resident memory: its peak, and what it still holds after handing freed memory back to the OS
(recorded per round as ``peak_rss_mb`` / ``rss_after_round_mb`` by clients and the server; ``fedspear bench``)."""

from __future__ import annotations

import os
import resource

MADV_PAGEOUT = 21  # <linux/mman.h>, Linux ≥ 5.4


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


def status() -> dict[str, float]:
    """This process's resident memory by kind from Linux's ``/proc/self/status``, MiB: ``VmRSS`` (all), ``RssAnon``
    (private memory: tensors, malloc heaps), ``RssFile`` (mapped file pages, such as a checkpoint's; reclaimable, yet
    counted in the resident size and in ``peak_rss_mb``), ``RssShmem`` (shared memory, e.g. Ray's object store) and
    ``VmHWM`` (the peak). Empty where there is no /proc."""
    out = {}
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                key = line.split(":", 1)[0]
                if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
                    out[key] = int(line.split()[1]) / 1024
    except (OSError, ValueError):
        return {}
    return out


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
    return status().get("VmRSS", float("nan"))


def file_mappings() -> list[tuple[int, int]]:
    """The ``(start, end)`` address ranges of this process's file-backed mappings, from /proc/self/maps (empty when
    it cannot be read). A caller paging out many tensors reads them once and passes them to :func:`page_out`."""
    ranges = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) < 6 or not fields[5].startswith("/"):
                    continue  # anonymous memory, heap, stack, [vdso] ...
                start, end = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((start, end))
    except OSError:
        pass
    return ranges


def page_out(tensor, mappings: list[tuple[int, int]] | None = None) -> int:
    """Ask the kernel to reclaim the resident pages under ``tensor`` when its data lie in a file mapping
    (``madvise(MADV_PAGEOUT)``, Linux ≥ 5.4); returns the bytes advised (page-aligned), 0 when the tensor is not
    file-backed, not contiguous, or the kernel offers no such advice. ``mappings``: this process's file mappings
    (:func:`file_mappings`), read afresh when not given.

    A hint, not a release: the tensor's values cannot change — clean file pages are dropped and read again from the
    file if touched, copied-on-write pages are kept; pages another process maps too are left (the kernel pages out
    only pages mapped once). transformers loads a checkpoint as views of the mapped safetensors file, and every file
    page read counts in this process's resident memory until the mapping goes: the bf16 conversion of
    Qwen2.5-Coder-1.5B's fp32 export read 6.7 GiB of them beside the bf16 copies it built
    (``store_linear_weights_bf16`` pages out each weight once it is converted; issue 19 item 3).
    """
    import ctypes

    if not tensor.is_contiguous() or tensor.device.type != "cpu" or tensor.numel() == 0:
        return 0
    address = tensor.data_ptr()
    mapping = next(((start, end) for start, end in (file_mappings() if mappings is None else mappings)
                    if start <= address < end), None)
    if mapping is None:
        return 0
    page = os.sysconf("SC_PAGE_SIZE")
    start = max(mapping[0], address // page * page)
    end = min(mapping[1], -(-(address + tensor.numel() * tensor.element_size()) // page) * page)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return end - start if libc.madvise(start, end - start, MADV_PAGEOUT) == 0 else 0
    except (OSError, AttributeError):
        return 0
