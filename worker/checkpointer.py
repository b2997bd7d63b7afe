"""Checkpoint writing without stalling training (docs/checkpoint-format.md).

At the step boundary `snapshot()` copies weights, m and v (three contiguous flat buffers) into a
preallocated host buffer (pinned memory on CUDA); a background thread then writes the file with
`shared.checkpoint.write.write_checkpoint_image` (atomic), records it in the manifest and applies
retention, deleting only after the new file is durable. One write is in flight at a time: a new
snapshot first waits for the previous write. `wait()` is what SIGTERM and the end of a run call.

What it is not: the format (shared/checkpoint/file_format.py), the write engine
(shared/checkpoint/write.py) or the decision of when to write (worker/trainer.py).
"""

from __future__ import annotations

import contextlib
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

from shared.checkpoint.file_format import CheckpointError, expected_size
from shared.checkpoint.manifest import (
    DEFAULT_KEEP_EVERY,
    DEFAULT_KEEP_LAST,
    ManifestEntry,
    record_checkpoint,
)
from shared.checkpoint.retention import apply_retention
from shared.checkpoint.write import (
    DIRECT_ALIGN,
    RECYCLED_NAME,
    image_offset,
    write_checkpoint_image,
)
from worker import fault_injection

log = logging.getLogger("worker.checkpointer")

PINNED_REASONS = frozenset({"sigusr1", "pivot", "final", "alarm"})
DISK_MARGIN_BYTES = 64 << 20
WRITER_NICE = 10  # the writer's (and its checksum thread's) nice value once the copy is done
_MADV_FREE = 8  # linux/mman.h (Linux 4.5+): pages freed lazily, only under memory pressure
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


_LIBC: ctypes.CDLL | None
try:
    _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
except OSError:  # no C library to call madvise in: the buffer is kept as is
    _LIBC = None


class _CudaCopy:
    """The checkpoint copy of three flat CUDA buffers (w, m, v; float32, n each) into the
    page-locked `host` image, on a side stream so that it overlaps training
    (docs/checkpoint-format.md#writing-without-stalling). When the device has room for a second
    copy of the three (free memory above twice their size), they are first copied on the
    device (a millisecond at device bandwidth) and the optimizer's next step waits only for
    that; the slow device-to-host copy then runs behind the following updates. Otherwise the
    device-to-host copy reads w, m, v directly and the next optimizer step waits for all of it
    on the device. The host never blocks but in `wait_host` (the writer thread)."""

    def __init__(self, host: torch.Tensor, n: int, device: torch.device) -> None:
        self.host, self.n, self.device = host, n, device
        self.stream = torch.cuda.Stream(device)
        free, _ = torch.cuda.mem_get_info(device)
        need = 3 * n * 4
        self.staging = (
            torch.empty(3 * n, dtype=torch.float32, device=device) if free > 2 * need else None
        )
        self.sources_free: torch.cuda.Event | None = None  # w, m, v may change after it
        self.on_host: torch.cuda.Event | None = None  # the host image is complete after it

    def start(self, w: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> None:
        """Queue the copy after everything queued so far on the current stream."""
        n = self.n
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            dst = self.staging if self.staging is not None else self.host
            for i, src in enumerate((w, m, v)):
                dst[i * n : (i + 1) * n].copy_(src.detach().reshape(-1), non_blocking=True)
            self.sources_free = torch.cuda.Event()
            self.sources_free.record(self.stream)
            if self.staging is not None:
                self.host.copy_(self.staging, non_blocking=True)
            self.on_host = torch.cuda.Event()
            self.on_host.record(self.stream)

    def before_change(self) -> None:
        """Make the current stream wait (on the device) until the copy has read w, m, v."""
        if self.sources_free is not None:
            torch.cuda.current_stream(self.device).wait_event(self.sources_free)
            self.sources_free = None

    def wait_host(self) -> None:
        """Block the calling (writer) thread until the host image holds the copy."""
        if self.on_host is not None:
            self.on_host.synchronize()
            self.on_host = None


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
    Host memory: one float32 buffer of 3 * n_params (12 bytes per parameter), marked free after
    each write on CPU (MADV_FREE), kept as is when pinned; after its copy the writer thread runs
    at nice `writer_nice` (docs/checkpoint-format.md#writing-without-stalling).
    """

    def __init__(
        self,
        run_dir: Path,
        n_params: int,
        keep_last: int = DEFAULT_KEEP_LAST,
        keep_every: int = DEFAULT_KEEP_EVERY,
        pin_memory: bool = False,
        on_done: Callable[[WriteResult], None] | None = None,
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
        self._copied = threading.Event()  # set when no deferred copy is pending
        self._copied.set()
        self._on_done = on_done or (lambda r: None)
        self.last_result: WriteResult | None = None
        self.writer_nice = WRITER_NICE
        self.release_after_write = not pin_memory
        self._cuda: _CudaCopy | None = None  # the side stream's copy (CUDA), made on first use

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
        """Block until the write in flight (if any) is durable or failed."""
        if self._thread is not None:
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
        defer_copy: bool = False,
    ) -> float:
        """Copy the three flat buffers to host and start writing `step_{step}.bin` in the
        writer thread.

        w, m, v: float32 tensors of n_params elements each (any device; weights, AdamW
        exp_avg, exp_avg_sq). reason: one of shared.checkpoint.manifest.REASONS. Returns the
        seconds training was held (the wait for a previous write still in flight, plus the
        copy); after it returns the caller may change w, m, v freely.

        defer_copy: the copy overlaps the next forward and backward pass, which only read the
        weights; the caller must call `wait_copied()` before anything changes w, m or v (the
        optimizer step). CPU tensors: the writer thread copies; CUDA tensors: a side stream
        does (`_CudaCopy`), and `wait_copied()` waits for it on the device, not the host. The
        held time is then the wait for a previous write and the queueing."""
        t0 = time.perf_counter()
        self.wait()
        on_cuda = defer_copy and w.is_cuda
        if on_cuda:
            if self._cuda is None:
                self._cuda = _CudaCopy(self._host_t, self.n, w.device)
            self._cuda.start(w, m, v)
        elif not defer_copy:
            self._copy(w, m, v)
        held = time.perf_counter() - t0
        thread_copies = defer_copy and not on_cuda
        if thread_copies:  # the host waits for the writer thread's copy
            self._copied.clear()
        args = (step, reason, (w, m, v) if thread_copies else None)
        self._thread = threading.Thread(
            target=self._write_after_copy, args=args, name=f"ckpt-{step}", daemon=False
        )
        self._thread.start()
        return held

    def _copy(self, w: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> None:
        n = self.n
        for i, src in enumerate((w, m, v)):
            src = src.detach().reshape(-1)
            if src.device.type == "cpu" and src.dtype == torch.float32:
                # one memcpy; about twice as fast as Tensor.copy_ here (scripts/bench_checkpoint.py stall)
                np.copyto(self._host_np[i * n : (i + 1) * n], src.numpy())
            else:
                self._host_t[i * n : (i + 1) * n].copy_(src, non_blocking=True)
        if w.is_cuda:
            torch.cuda.synchronize()

    def wait_copied(self) -> None:
        """Block until a deferred copy (snapshot(defer_copy=True)) has left w, m, v; on CUDA,
        make the current stream wait for it on the device instead."""
        if self._cuda is not None:
            self._cuda.before_change()
        self._copied.wait()

    def _write_after_copy(self, step: int, reason: str, arrays) -> None:
        try:
            if self._cuda is not None:
                self._cuda.wait_host()
            if arrays is not None:
                self._copy(*arrays)
        finally:
            self._copied.set()  # never leave training blocked, even if the copy failed
        # this thread, and the crc thread it starts (Linux: nice is per thread, inherited), from
        # here on: the checksum and the write take the gaps torch's intra-op threads leave
        with contextlib.suppress(AttributeError, OSError):  # unsupported or not permitted
            tid = threading.get_native_id()
            nice = max(self.writer_nice, os.getpriority(os.PRIO_PROCESS, tid))
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        self._write(step, reason)

    def _write(self, step: int, reason: str) -> None:
        t0 = time.perf_counter()
        try:
            fault_injection.write_delay(self.run_dir, step)  # test hook; off unless set
            if shutil.disk_usage(self.run_dir).free < self._bytes_needed():
                self.apply_retention()
                need, free = self._bytes_needed(), shutil.disk_usage(self.run_dir).free
                if free < need:
                    raise CheckpointError(
                        f"{self.run_dir}: {free:,} bytes free, a checkpoint needs "
                        f"{need:,} (with margin); not written, earlier checkpoints intact: "
                        f"free disk space (retention already applied); retried at the next "
                        f"cadence",
                        rule="disk",
                    )
            path, nbytes, checksum = write_checkpoint_image(self.run_dir, step, self._image)
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

    def _bytes_needed(self) -> int:
        """Free bytes the next write needs: the file and a margin, less a retired file of the
        same size that it overwrites in place."""
        try:
            have = (self.run_dir / RECYCLED_NAME).stat().st_size
        except OSError:
            have = 0
        return max(0, expected_size(self.n) - have) + DISK_MARGIN_BYTES

    def apply_retention(self) -> list[int]:
        """``shared.checkpoint.retention.apply_retention`` on this run directory with this
        writer's keep_last and keep_every (docs/checkpoint-format.md#retention): the oldest
        doomed file becomes the next write's, the others are deleted. Returns the doomed
        steps."""
        return apply_retention(self.run_dir, self.n, self.keep_last, self.keep_every)
