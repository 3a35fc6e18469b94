"""This process's resident memory: its peak, and what it still holds after handing freed memory back to the OS
(recorded per round as ``peak_rss_mb`` / ``rss_after_round_mb`` by clients and the server; ``fedspear bench``); and
the peak of a process tree taken together (``TreePeak``: ``peak_tree_mb`` in a simulation's records)."""

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


FULL_COLLECTION_EVERY = 10  # release_memory calls: every 10th scans all objects, the others only the new ones
_releases = 0  # release_memory calls so far in this process


def release_memory(full: bool = False) -> float:
    """Give the memory a finished phase freed back to the OS; return this process's resident memory after (MiB).

    glibc's malloc keeps freed heap pages for reuse, and after the first large tensors are freed it raises its mmap
    threshold (up to 32 MiB), so later activations and logits come from a heap that never shrinks: a SmolLM2 client
    held 4.7 GiB after four default rounds, of which ``malloc_trim(0)`` returned 3.0 GiB (1.7 GiB left; issue 19,
    measured in-process on the Zen 4 machine). Called between rounds, it lowers what an idle client holds, not the
    peak inside a round. No-op (``nan`` without /proc) where libc has no ``malloc_trim``.

    Python's cycle collector runs first (``gc.collect``). A full pass costs time in proportion to every object
    Python tracks, and almost all of them live as long as the process (libraries, the model, a compiled decode's
    graphs): on the Zen 4 machine 0.2–0.3 s per round for a SmolLM2 client, ≈ 0.5 s once the decode of a
    28-layer model (Qwen2.5-1.5B's depth) is compiled, ≈ 0.9 M objects. So what survives a pass is frozen
    (``gc.freeze``: later passes skip it) and the next call scans only what was allocated since; every
    ``FULL_COLLECTION_EVERY``-th call unfreezes first (``gc.unfreeze``) and scans everything, so a reference cycle
    among objects that were alive at an earlier call is freed within that many calls (docs/performance.md). A caller
    that has just dropped such an object, a model above all (a peft model is a reference cycle), passes ``full=True``
    to scan everything at once. Frozen objects are out of ``gc.get_objects()`` and ``gc.get_referrers()`` until
    the next full pass (debugging aids; nothing in fedspear uses them).
    """
    import ctypes
    import ctypes.util
    import gc

    global _releases
    _releases += 1
    if full or _releases % FULL_COLLECTION_EVERY == 0:
        gc.unfreeze()
    gc.collect()
    gc.freeze()
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


class TreePeak:
    """The peak memory of this process and every process it started (Ray's raylet, GCS and client actor in a
    simulation), sampled every ``interval`` seconds in a daemon thread: the largest **sum over the tree** of each
    process's RSS and of its PSS (Linux's proportional set size: a page ``n`` processes map counts ``1/n`` in each,
    so the sum is the memory the tree occupies; the RSS sum counts a shared page, such as a memory-mapped model copy
    read by the server and the client actor, once per process). MiB.

    A sample reads each process's RSS and its file-backed and shared-memory part (``/proc/<pid>/statm`` through
    psutil's ``memory_info``: microseconds). PSS needs ``/proc/<pid>/smaps_rollup`` (``memory_full_info``), for which
    the kernel walks the process's page tables: ≈ 25 ms for a client actor holding SmolLM2-135M, ≈ 60 ms for a
    simulation's whole tree, of CPU taken at the server's priority from the client actor, which Ray runs at nice 15
    (docs/performance.md measures what that cost a round). So the tree's PSS is read in full only when a process
    has appeared, when a process's file-backed or shared pages moved by more than ``SHARED_MOVE`` bytes since the
    last full reading (a model mapped or dropped, which also changes the other processes' shares of those pages), and
    every ``refresh`` seconds. In between, a process's PSS is its anonymous RSS now plus its file-backed and shared
    PSS at the last full reading — exact where its anonymous pages are its own, as in every process Ray or fedspear
    starts (started by exec, not as a forked copy), and where nothing else has mapped or dropped more than
    ``SHARED_MOVE`` of the pages it shares.

    ``peak(reset=True)`` returns ``{"rss": …, "pss": …}`` since the last reset (or the start) and starts afresh;
    empty before the first sample (or where psutil cannot read memory). A sample misses what lives shorter than
    ``interval`` (0.5 s by default): a peak between two samples is not seen. ``full_readings`` counts the samples
    that read every PSS.

    Use as a context manager or ``start()`` / ``stop()``.
    """

    SHARED_MOVE = 8 * 2**20  # bytes of a process's file-backed + shared-memory RSS that call for a full reading

    def __init__(self, interval: float = 0.5, pid: int | None = None, refresh: float = 10.0):
        import threading

        self.interval = interval
        self.refresh = refresh
        self.pid = os.getpid() if pid is None else pid
        self.full_readings = 0
        self._lock = threading.Lock()
        self._peak: dict[str, float] = {}
        self._shared_pss: dict[int, tuple[int, int | None] | None] = {}  # pid → file+shmem (RSS, PSS) at last full
        self._last_full = float("-inf")
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> dict[str, float]:
        """One reading of the tree: ``{"rss", "pss", "processes"}`` summed over the processes that could be read
        (MiB), folded into the peak."""
        import time

        import psutil

        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return {}
        infos = {}
        for proc in procs:
            try:
                infos[proc.pid] = (proc, proc.memory_info())
            except psutil.Error:  # gone, or not ours to read
                continue
        now = time.monotonic()
        if self._full_reading_due(infos, now):
            self._full_reading(infos)
            self._last_full = now
        rss = pss = seen = 0
        for pid, (_, info) in infos.items():
            if pid in self._shared_pss and self._shared_pss[pid] is None:
                continue  # its full reading failed: left out until the next one
            rss += info.rss
            seen += 1
            shared = self._shared_pss.get(pid, (0, None))[1]
            pss += info.rss if shared is None else info.rss - info.shared + shared  # None: no PSS here (not Linux)
        reading = {"rss": rss / 2**20, "pss": pss / 2**20, "processes": seen}
        with self._lock:
            for key in ("rss", "pss"):
                self._peak[key] = max(self._peak.get(key, 0.0), reading[key])
        return reading

    def _full_reading_due(self, infos: dict, now: float) -> bool:
        """Whether this sample reads every PSS: ``refresh`` seconds have passed since the last full reading, or a
        process was not there then, or a process's file-backed + shared RSS moved by more than ``SHARED_MOVE``."""
        if now - self._last_full >= self.refresh:
            return True
        for pid, (_, info) in infos.items():
            if pid not in self._shared_pss:
                return True
            last = self._shared_pss[pid]
            if last is not None and abs(getattr(info, "shared", 0) - last[0]) > self.SHARED_MOVE:
                return True
        return False

    def _full_reading(self, infos: dict) -> None:
        """Read every process's PSS (``smaps_rollup``); ``infos`` (pid → (process, memory_info)) takes the same
        reading's RSS. A process whose PSS cannot be read counts its RSS; one that cannot be read in full at all is
        left out until the next full reading."""
        import psutil

        self.full_readings += 1
        shared_pss = {}
        for pid, (proc, _) in list(infos.items()):
            try:
                full = proc.memory_full_info()
            except psutil.Error:  # gone, or not ours to read
                shared_pss[pid] = None
                continue
            infos[pid] = (proc, full)
            pss = getattr(full, "pss", None)
            shared = getattr(full, "shared", None)  # Linux's statm; psutil has no such field elsewhere
            shared_pss[pid] = ((0, None) if pss is None or shared is None
                               else (shared, pss - (full.rss - shared)))
        self._shared_pss = shared_pss

    def peak(self, reset: bool = False) -> dict[str, float]:
        """The largest sums seen (MiB, rounded to 1); with ``reset`` the next peak starts from the next sample."""
        with self._lock:
            out = {key: round(value, 1) for key, value in self._peak.items()}
            if reset:
                self._peak = {}
        return out

    def _run(self) -> None:
        while not self._done.is_set():
            self.sample()
            self._done.wait(self.interval)

    def start(self) -> "TreePeak":
        import threading

        self._done.clear()
        self._thread = threading.Thread(target=self._run, name="fedspear-tree-peak", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict[str, float]:
        """Stop sampling (one last sample first); returns ``peak()``."""
        self._done.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.sample()
        return self.peak()

    def __enter__(self) -> "TreePeak":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


_TREE: TreePeak | None = None


def watch_tree(interval: float = 0.5) -> TreePeak:
    """Start (or return the running) process-tree sampler of this process (:class:`TreePeak`); ``fedspear.fl.
    simulation`` starts it for a simulation, whose ServerApp records ``tree_peak()`` per round."""
    global _TREE
    if _TREE is None:
        _TREE = TreePeak(interval).start()
    return _TREE


def unwatch_tree() -> None:
    """Stop the sampler :func:`watch_tree` started (no-op when none runs)."""
    global _TREE
    if _TREE is not None:
        _TREE.stop()
        _TREE = None


def tree_peak(reset: bool = True) -> dict[str, float]:
    """The process tree's peak since the last call (:class:`TreePeak`), ``{"rss", "pss"}`` MiB; empty when no
    sampler runs here (a deployed ServerApp, whose clients are other machines)."""
    return _TREE.peak(reset=reset) if _TREE is not None else {}
