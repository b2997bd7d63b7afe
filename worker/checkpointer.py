"""Checkpoint writing without stalling training (docs/checkpoint-format.md).

At the step boundary `snapshot()` copies weights, m and v (three contiguous flat buffers) into a
preallocated host buffer (pinned memory on CUDA); a background thread then writes the file with
`shared.checkpoint_write.write_checkpoint_image` (atomic), records it in the manifest and applies
retention, deleting only after the new file is durable. One write is in flight at a time: a new
snapshot first waits for the previous write. `wait()` is what SIGTERM and the end of a run call.

On CPU the copy is cut into chunks (`_CopyJob`), each checksummed while it is still in cache, and
the writer thread runs at the lowest priority (nice `WRITER_NICE`) from its start, so that it takes
the cores when torch's threads leave them; whatever of the copy it has not done when training
needs it (`wait_copied()`, `wait()`), the caller does itself at its own priority, so a starved
writer never holds training (docs/checkpoint-format.md#writing-without-stalling).

What it is not: the format (shared/checkpoint_format.py), the write engine
(shared/checkpoint_write.py) or the decision of when to write
(worker/trainer.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from worker import fault_injection
from shared.checkpoint_format import _HEADER, CheckpointError, crc32, expected_size
from shared.checkpoint_write import DIRECT_ALIGN, image_offset, write_checkpoint_image
from shared.checkpoint_dir import list_checkpoints
from shared.checkpoint_manifest import (
    DEFAULT_KEEP_EVERY,
    DEFAULT_KEEP_LAST,
    ManifestEntry,
    plan_retention,
    read_manifest,
    record_checkpoint,
    remove_entries,
)

log = logging.getLogger("worker.checkpointer")

PINNED_REASONS = frozenset({"sigusr1", "pivot", "final", "alarm"})
DISK_MARGIN_BYTES = 64 << 20
WRITER_NICE = 19  # the writer thread's nice value (Linux: per thread), from its start
COPY_CHUNK_BYTES = 1 << 20  # one piece of the copy: L2-sized, checksummed while in cache
_MADV_FREE = 8  # linux/mman.h (Linux 4.5+): pages freed lazily, only under memory pressure
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _lower_thread_priority(nice: int) -> None:
    """Give the calling thread (Linux: nice is per thread, inherited by the threads it starts)
    the nice value `nice`, so that on a machine whose cores torch's intra-op threads keep busy
    the checksum and the write run in the gaps instead of taking a core from a parallel
    region that then waits for it. A no-op where it is not supported or not permitted."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
    except (AttributeError, OSError):
        pass


class _CopyJob:
    """The copy of w, m, v (CPU float32, n elements each) into a checkpoint file image, in
    pieces of COPY_CHUNK_BYTES, shared by a low-priority writer and the training thread
    without the training thread ever waiting for the writer
    (docs/checkpoint-format.md#writing-without-stalling).

    `run_low()` (the writer) copies pieces in order, each outside the lock; `take_over()` (the
    training thread, before it changes w, m or v) claims every piece not yet started and
    copies it at once, and copies the piece the writer is in the middle of (if any) into a
    side buffer, since the writer may still be reading its source when training changes it;
    the writer puts the side copy in place when it gets the CPU back. `checksum()` (the writer,
    afterwards) waits for take_over's copies, fixes that piece and returns the crc32 of the
    whole image, header first: pieces the writer copied in order are checksummed right after
    their copy, while in cache, the rest in one pass. A failing copy is kept in `error`
    (raised by nothing: the writer reports it); training is never left waiting.
    """

    def __init__(self, image: np.ndarray, step: int, n: int, srcs) -> None:
        image[:8] = np.frombuffer(_HEADER.pack(step, n), dtype=np.uint8)
        self._crc = crc32(image[:8])
        dst = image[8:].view(np.float32)
        per = max(1, COPY_CHUNK_BYTES // 4)
        self._pieces = [
            (dst[i * n + a : i * n + min(a + per, n)], src[a : a + per])
            for i, src in enumerate(srcs)
            for a in range(0, n, per)
        ]
        self._lock = threading.Lock()
        self._next = 0  # the first piece nobody has started
        self._inflight: int | None = None  # the piece the writer is copying
        self._stolen: int | None = None  # that piece, when training took over during it
        self._side = np.empty(min(per, n), dtype=np.float32)
        self._taken_over = False
        self._complete = threading.Event()  # take_over's copies are done
        self._crc_next = 0  # the first piece not yet in self._crc
        self.error: BaseException | None = None

    def _copy_piece(self, i: int, into: np.ndarray | None = None) -> None:
        dst, src = self._pieces[i]
        try:
            np.copyto(dst if into is None else into[: len(src)], src)  # releases the GIL
        except BaseException as e:  # reported by the writer; never blocks training
            self.error = e

    def run_low(self) -> None:
        """The writer: copy pieces in order until none is left or training has taken over;
        each piece copied in order is checksummed at once, while it is in cache."""
        while True:
            with self._lock:
                i = self._next
                if i >= len(self._pieces) or self._taken_over:
                    return
                self._next += 1
                self._inflight = i
            self._copy_piece(i)
            with self._lock:
                self._inflight = None
                if self._stolen == i:  # training took over during it: checksum() fixes it
                    return
            if i == self._crc_next and self.error is None:
                self._crc = crc32(self._pieces[i][0].view(np.uint8), self._crc)
                self._crc_next += 1

    def take_over(self) -> None:
        """The training thread: copy every piece not copied yet, now; return without waiting
        for the writer. Afterwards w, m, v may change."""
        with self._lock:
            if self._taken_over:
                return
            self._taken_over = True
            start, self._next = self._next, len(self._pieces)
            self._stolen = self._inflight
        try:
            if self._stolen is not None:
                self._copy_piece(self._stolen, into=self._side)
            for i in range(start, len(self._pieces)):
                self._copy_piece(i)
        finally:
            self._complete.set()

    def checksum(self) -> int:
        """The writer, after run_low(): the crc32 of the whole image once every piece is in
        place (waits for take_over's copies; puts the side copy of a stolen piece in place)."""
        if self._taken_over:
            self._complete.wait()
            if self._stolen is not None:
                dst = self._pieces[self._stolen][0]
                np.copyto(dst, self._side[: len(dst)])
                self._stolen = None
        for dst, _ in self._pieces[self._crc_next :]:
            self._crc = crc32(dst.view(np.uint8), self._crc)
        self._crc_next = len(self._pieces)
        return self._crc


def _set_thread_nice(tid: int, nice: int) -> None:
    """Set thread `tid`'s nice value to `nice`; raising a priority needs privilege (root,
    CAP_SYS_NICE or RLIMIT_NICE): a no-op where it is not permitted."""
    try:
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except (AttributeError, OSError):
        pass


def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


_LIBC = _libc() if os.name == "posix" else None


@dataclass
class WriteResult:
    """Outcome of one checkpoint write attempt (docs/checkpoint-format.md).

    step, reason: what was asked; path: the durable file (None on failure); nbytes: its size
    (0 on failure); seconds: wall time of the write in the writer thread (disk check, file,
    manifest, retention); error: the operator message when the write failed (free space short:
    "... bytes free ..."; a write failing midway: CheckpointError text naming errno), else None.
    """

    step: int
    reason: str
    path: str | None
    nbytes: int
    seconds: float
    error: str | None = None


class Checkpointer:
    """Background checkpoint writer for a flat model of `n_params` float32 parameters (docs/checkpoint-format.md).

    run_dir: where step_NNNNNN.bin and checkpoints.json live. keep_last (>= 2) / keep_every
    (0 = off): retention, applied after each durable write; pinned reasons (PINNED_REASONS)
    are never deleted, nor files without a manifest entry. pin_memory: page-locked host buffer
    (CUDA). on_done(WriteResult) is called from the writer thread after each attempt; a failed
    write never raises into training: it is logged, reported and retried at the next cadence.
    Host memory: one float32 buffer of 3 * n_params (12 bytes per parameter). On CPU it is
    marked free after each write (madvise MADV_FREE): the kernel takes its pages back when it
    needs memory, and until then the next copy reuses them without a fault. Releasing them at
    once (MADV_DONTNEED) made the next copy fault every page in again: 0.22 s of CPU per
    andrea-12m checkpoint instead of 0.10 s (thread CPU time, docs/checkpoint-format.md#writing-without-stalling),
    CPU taken from training on 2 cores. A pinned (CUDA) buffer is kept as is.
    writer_nice: the nice value of the writer thread, copy included
    (docs/checkpoint-format.md#writing-without-stalling).
    """

    def __init__(
        self,
        run_dir: Path,
        n_params: int,
        keep_last: int = DEFAULT_KEEP_LAST,
        keep_every: int = DEFAULT_KEEP_EVERY,
        pin_memory: bool = False,
        on_done: Callable[[WriteResult], None] | None = None,
        writer_nice: int = WRITER_NICE,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.n = n_params
        self.keep_last, self.keep_every = keep_last, keep_every
        # The host buffer is the file image itself (header + weights + m + v), 4096-byte
        # aligned, so the writer issues one sequential (O_DIRECT where possible) write of it.
        size = expected_size(n_params)
        raw = torch.empty(size + DIRECT_ALIGN, dtype=torch.uint8, pin_memory=pin_memory)
        off = image_offset(raw.data_ptr())
        self._raw = raw
        self._host_t = raw[off + 8 : off + size].view(torch.float32)  # w, m, v back to back
        self._image = raw.numpy()[off : off + size]
        self._host_np = self._image[8:].view(np.float32)  # the same bytes, numpy
        self._thread: threading.Thread | None = None
        self._job: _CopyJob | None = None  # the copy of the write in flight (CPU)
        self._prio_lock = threading.Lock()
        self._boosted = False  # a wait() has asked for the write in flight at full priority
        self._on_done = on_done or (lambda r: None)
        self.last_result: WriteResult | None = None
        self.writer_nice = writer_nice
        self._pinned = pin_memory
        self.release_after_write = not pin_memory

    def _release_host_buffer(self) -> None:
        """Let the kernel reclaim the host buffer's pages when it needs memory (CPU buffers
        only; MADV_FREE, ignored by kernels before 4.5): the bytes are on disk, and the next
        snapshot overwrites every byte it reads before the write."""
        if not self.release_after_write or _LIBC is None:
            return
        start = self._raw.data_ptr()
        end = start + self._raw.numel()
        start += -start % _PAGE
        end -= end % _PAGE
        if end > start:
            _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_FREE)

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> WriteResult | None:
        """Block until the write in flight (if any) is durable or failed; the copy's pieces the
        writer has not taken yet are done here first, at the caller's priority, and the writer
        is given the caller's priority back where the system permits it (root, or an
        RLIMIT_NICE that allows it): whoever waits for the write wants it now."""
        self.wait_copied()
        if self._thread is not None:
            with self._prio_lock:
                self._boosted = True
                tid = self._thread.native_id
                if tid is not None and self._thread.is_alive():
                    _set_thread_nice(
                        tid, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
                    )
            self._thread.join()
            self._thread = None
        return self.last_result

    def snapshot(
        self,
        step: int,
        w: torch.Tensor,
        m: torch.Tensor,
        v: torch.Tensor,
        reason: str,
        background: bool = True,
        defer_copy: bool = False,
    ) -> float:
        """Copy the three flat buffers to host and start writing `step_{step}.bin`.

        w, m, v: float32 tensors of n_params elements each (any device; weights, AdamW
        exp_avg, exp_avg_sq). reason: one of shared.checkpoint_manifest.REASONS. background:
        False writes in this thread (benchmarks, tests). Returns the seconds training was held
        (the wait for a previous write still in flight, plus the copy); after it returns the
        caller may change w, m, v freely.

        defer_copy (CPU tensors, background only): the copy itself runs in the writer thread
        at its low priority, overlapping the next forward and backward pass, which only read
        the weights; the caller must call `wait_copied()` before anything changes w, m or v
        (the optimizer step), which does the pieces not yet copied itself. The held time is
        then only the wait for a previous write."""
        t0 = time.perf_counter()
        self.wait()
        job = self._copy(step, w, m, v)
        defer = defer_copy and background and job is not None
        if job is not None and not defer:
            job.take_over()
        held = time.perf_counter() - t0
        if background:
            self._job = job
            self._boosted = False
            self._thread = threading.Thread(
                target=self._write_after_copy,
                args=(step, reason, job),
                name=f"ckpt-{step}",
                daemon=False,
            )
            self._thread.start()
        else:
            self._write(step, reason, job)
        return held

    def _copy(self, step: int, w: torch.Tensor, m: torch.Tensor, v: torch.Tensor):
        """CPU float32 sources: a `_CopyJob` (not yet run) that copies them into the image and
        checksums it. Others (CUDA): copied here at once (device-to-host into the pinned
        buffer, then a synchronize); None, and the writer computes the checksum."""
        srcs = [x.detach().reshape(-1) for x in (w, m, v)]
        if all(x.device.type == "cpu" and x.dtype == torch.float32 for x in srcs):
            return _CopyJob(self._image, step, self.n, [x.numpy() for x in srcs])
        n = self.n
        for i, src in enumerate(srcs):
            self._host_t[i * n : (i + 1) * n].copy_(src, non_blocking=True)
        if w.is_cuda:
            torch.cuda.synchronize()
        return None

    def wait_copied(self) -> None:
        """Return once a deferred copy (snapshot(defer_copy=True)) has left w, m, v: the
        pieces the writer has not copied are copied here, at the caller's priority, without
        waiting for the writer (`_CopyJob.take_over`)."""
        job = self._job
        if job is not None:
            job.take_over()

    def _write_after_copy(self, step: int, reason: str, job: _CopyJob | None) -> None:
        with self._prio_lock:  # the copy too: it runs in training's gaps
            if not self._boosted:  # unless someone already waits for this write
                _lower_thread_priority(self.writer_nice)
        if job is not None:
            job.run_low()
        self._write(step, reason, job)

    def _free_bytes(self) -> int:
        return shutil.disk_usage(self.run_dir).free

    def _write(self, step: int, reason: str, job: _CopyJob | None) -> None:
        t0 = time.perf_counter()
        need = 8 + 12 * self.n + DISK_MARGIN_BYTES
        try:
            crc = None if job is None else job.checksum()  # every piece in place first
            if job is not None and job.error is not None:
                raise CheckpointError(
                    f"step {step}: copying the state into the host buffer failed: "
                    f"{job.error!r}; not written, earlier checkpoints intact",
                    rule="io",
                ) from job.error
            fault_injection.write_delay(self.run_dir, step)  # test hook; off unless set
            if self._free_bytes() < need:
                self.apply_retention(exclude_newest=False)
                if self._free_bytes() < need:
                    raise CheckpointError(
                        f"{self.run_dir}: {self._free_bytes():,} bytes free, a checkpoint needs "
                        f"{need:,} (with margin); not written, earlier checkpoints intact: "
                        f"free disk space (retention already applied); retried at the next "
                        f"cadence",
                        rule="disk",
                    )
            path, nbytes, checksum = write_checkpoint_image(
                self.run_dir, step, self._image, crc=crc
            )
            record_checkpoint(
                self.run_dir,
                ManifestEntry(
                    step=step,
                    file=path.name,
                    nbytes=nbytes,
                    checksum=checksum,
                    reason=reason,
                    pinned=reason in PINNED_REASONS,
                    time=time.time(),
                ),
            )
            self.apply_retention()
            res = WriteResult(step, reason, str(path), nbytes, time.perf_counter() - t0)
        except Exception as e:  # the writer must never die silently: report the failure
            log.error("checkpoint step %d (%s) FAILED: %s", step, reason, e)
            res = WriteResult(step, reason, None, 0, time.perf_counter() - t0, error=str(e))
        self._release_host_buffer()
        self.last_result = res
        self._on_done(res)

    def apply_retention(self, exclude_newest: bool = True) -> list[int]:
        """Delete checkpoints retention allows (docs/checkpoint-format.md#retention); never pinned ones, never a file
        without a manifest entry (another writer's). Returns the deleted steps."""
        entries = read_manifest(self.run_dir)
        present = {s for s, _ in list_checkpoints(self.run_dir)}
        known = [s for s in present if s in entries]
        pinned = {s for s, e in entries.items() if e.pinned}
        doomed = plan_retention(known, pinned, self.keep_last, self.keep_every)
        for s in doomed:
            try:
                (self.run_dir / entries[s].file).unlink()
                log.info("retention: deleted %s", entries[s].file)
            except FileNotFoundError:
                pass
        if doomed:
            remove_entries(self.run_dir, doomed)
        return doomed
