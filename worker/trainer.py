"""The training loop (docs/architecture.md#the-worker): one optimizer update per step, decisions at the boundary.

Update k (1-based) draws batch k with the policy of its period (posted by the proxy), trains,
reports loss record k, probes held-out loss every `probe_every` steps and runs a sample audit
every `sample_every`; then, at the step boundary, decides whether to checkpoint (cadence,
SIGUSR1, SIGTERM, pivot, final) and whether to stop. After update S the header step is S; a
resume from S performs update S+1 next, with exactly the data, learning rate and AdamW state
the uninterrupted run had (bit-identical on CPU).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

from shared.activation_memory import check_micro_batch_fits
from shared.checkpoint.file_format import CheckpointError, parse_checkpoint_name
from shared.checkpoint.manifest import read_manifest
from shared.checkpoint.read import load_checkpoint
from shared.data.embedded import cache_dir
from shared.data.token_files import read_arm_index
from shared.data.tokenizer import RunTokenizer
from shared.exit_codes import EXIT_FATAL, EXIT_OK
from shared.lr_schedule import learning_rate
from shared.processes import seconds_since_start
from shared.run.config import (
    SAMPLE_TEMPERATURE,
    SAMPLE_TOP_K,
    ConfigError,
    RunConfig,
    accumulation_steps,
    load_run_config,
    probe_plan,
)
from shared.run.handshake import (
    HandshakeError,
    ReportWriter,
    control_stops_at,
    policy_period,
    read_handshake,
    update_handshake,
)
from shared.run.layout import RunLayout
from shared.run.worker_options import COMPILE
from shared.run.worker_options import WorkerOptions as WorkerOptions  # also named here
from worker import distributed as wdist
from worker import fault_injection
from worker import precision as wprec
from worker.checkpointer import Checkpointer, WriteResult
from worker.data import ArmSampler, dropout_seed
from worker.model import GPT
from worker.optim import FlatAdamW
from worker.perf import PeakFlops, mfu
from worker.sampling import generate_batched
from worker.signals import SignalFlags, Usr1Requests

log = logging.getLogger("worker.trainer")

REASON_PRIORITY = ("final", "pivot", "alarm", "sigusr1", "sigterm", "cadence")


def resolve_compile(requested: str, device: torch.device) -> bool:
    """Whether the training step is torch.compile'd for `--compile requested` on `device`:
    auto is on for CUDA and off elsewhere (on the CPU, compiling takes longer than most runs
    there gain from it). Raises ValueError for a value not in COMPILE."""
    if requested not in COMPILE:
        raise ValueError(f"--compile {requested!r}: choose one of {', '.join(COMPILE)}")
    return requested == "on" or (requested == "auto" and device.type == "cuda")


class ResumeLoadError(CheckpointError):
    """The checkpoint the proxy chose to resume from failed a rule when the worker read it: it
    changed after the proxy's scan (truncated, overwritten, bit rot). Not fatal: the worker
    exits EXIT_FAILED, so that the proxy restarts it, scans again, moves the file to rejected/
    and resumes from the newest valid one (docs/checkpoint-format.md#validity)."""


class _NoReports:
    """Ranks other than 0 report nothing: rank 0 writes the (global) records."""

    def write(self, report: dict) -> None:
        pass


class _NoCheckpointer:
    """Ranks other than 0 write no checkpoint: rank 0 writes the file (docs/architecture.md#the-worker)."""

    def snapshot(self, *a, **kw) -> float:
        return 0.0

    def busy(self) -> bool:
        return False

    def wait(self) -> None:
        return None

    def wait_copied(self) -> None:
        return None


@dataclass(frozen=True)
class Boundary:
    """The decision at the end of an update (docs/signals.md): the checkpoint's reasons (none:
    no checkpoint), whether the worker stops there, and why (a sentence for the log and the
    "stopped" event)."""

    reasons: tuple[str, ...] = ()
    stop: bool = False
    why: str = ""


@dataclass
class QueuedUpdate:
    """Update k queued on the device, its values not yet read (docs/architecture.md#the-step-loop).

    values: float64 (3 + 2 arms,) on the host, page-locked on CUDA: [loss sum over the global
    batch, per-arm loss sums (sorted arm names), per-arm unigram loss sums, gradient norm, 1.0 if
    not applied (non-finite) else 0.0]; valid once `events[1]` has completed (CUDA; None elsewhere: valid at once).
    events: the update's start and end timing events (CUDA). t0: perf_counter at its start;
    queued_s: host seconds to queue it (its whole time on the CPU, where work is synchronous);
    step_s: wall seconds from the end of queueing the previous update (the first of a worker:
    from its own start) to the end of queueing this one, the loop's whole cadence (boundary,
    reports, probe and checkpoint holds included): on a GPU the host waits once per update for
    the device, so this is the device's pace."""

    k: int
    probs: dict
    counts: dict[str, int]
    lr: float
    values: torch.Tensor
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None
    t0: float
    queued_s: float
    step_s: float
    probe: dict[str, float] | None = None
    eval: dict[str, float] | None = None


class SequenceLoss(torch.nn.Module):
    """Mean next-token loss per sequence of `module` (GPT, DDP of it): forward(x, y: int64
    (b, T)) -> float32 (b,). The forward runs under worker/precision.py `autocast` (bf16 for
    --precision bf16, and auto on CUDA); weights, m and v stay fp32; the loss is computed in
    fp32. The unit torch.compile compiles: the model and its loss in one graph."""

    def __init__(self, module: torch.nn.Module, device: torch.device, precision: str) -> None:
        super().__init__()
        self.module, self.device_, self.precision = module, device, precision

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with wprec.autocast(self.device_, self.precision):
            logits = self.module(x)
        tok = F.cross_entropy(
            logits.float().reshape(-1, logits.size(-1)), y.reshape(-1), reduction="none"
        )
        return tok.view(y.shape).mean(dim=1)


class Trainer:
    def __init__(
        self, opts: WorkerOptions, flags: SignalFlags, hooks: fault_injection.NoHooks | None = None
    ) -> None:
        """`hooks`: test hooks (worker/fault_injection.py); the default does nothing."""
        t_init = time.perf_counter()
        self.opts, self.flags = opts, flags
        self.hooks = hooks if hooks is not None else fault_injection.NoHooks()
        self.layout = RunLayout(opts.run_dir)
        self.cfg: RunConfig = load_run_config(self.layout.run_json)
        self.max_steps = opts.max_steps or self.cfg.max_steps
        self.dist, self.device = wdist.init_distributed(opts.device)
        self.rank, self.world_size = self.dist.rank, self.dist.world_size
        per_rank = self.cfg.batch_size // max(1, self.world_size)
        micro = opts.micro_batch_size or self.cfg.micro_batch_size or per_rank
        try:  # sequences per forward/backward on this rank, and micro-batches per update
            self.accum = accumulation_steps(self.cfg.batch_size, micro, self.world_size)
        except ConfigError as e:
            raise wdist.DistributedError(f"{self.layout.run_json}: {e}") from None
        self.micro = micro
        self.micro_scale = micro / per_rank  # each micro-batch's share of the rank's mean loss
        self.precision = wprec.resolve_precision(opts.precision, self.device)  # "bf16" / "fp32"
        self.compiled = resolve_compile(opts.compile, self.device)
        check_micro_batch_fits(
            self.cfg.model,
            self.cfg.vocab_size,
            micro,
            per_rank,
            self.precision,
            wprec.device_memory_bytes(self.device),
            str(self.device),
            compiled=self.compiled,
        )
        if self.device.type == "cuda":  # TF32 for fp32 matmuls left outside bf16 autocast only:
            tf32 = self.precision == "bf16"  # --precision fp32 means true fp32 matmuls
            torch.backends.cuda.matmul.allow_tf32 = tf32
            torch.backends.cudnn.allow_tf32 = tf32
        self.tokenizer = RunTokenizer.load(self.layout.tokenizer)
        self.sampler = ArmSampler(
            self.layout.root,
            read_arm_index(self.layout),
            self.cfg.model.block_size,
            self.cfg.vocab_size,
        )
        t_setup = time.perf_counter()
        self.model = GPT(
            self.cfg.model,
            self.cfg.vocab_size,
            self.cfg.dropout,
            seed=self.cfg.seed,
            init_weights=opts.resume_from is None,  # a resume reads the weights at once
        )
        self.model.to(self.device)  # parameters stay views of model.flat (GPT._apply)
        t_model = time.perf_counter()
        self.opt = FlatAdamW(self.model, self.cfg, fused=wprec.use_fused_adamw(self.device))
        t_opt = time.perf_counter()
        self.step = 0
        self.resumed_from = 0
        if opts.resume_from is not None:
            self._resume(Path(opts.resume_from))
        log.debug(
            "start-up: config, tokenizer and data %.3f s, model %.3f s, optimizer %.3f s, "
            "checkpoint load %.3f s",
            t_setup - t_init,
            t_model - t_setup,
            t_opt - t_model,
            time.perf_counter() - t_opt,
        )
        self.eval_loss = SequenceLoss(self.model, self.device, self.precision)
        self.train_loss = self._wrap_for_training()
        self.flops_per_token = self.model.flops_per_token()
        self.peak = PeakFlops(self.device, cache_dir() / "cpu-peak-flops.json")  # no wait here
        if self.device.type == "cuda" and self.precision == "fp32" and self.peak.value:
            self.peak.source += " (training in fp32: MFU is against the bf16 peak)"
        self.reports = ReportWriter(self.layout) if self.rank == 0 else _NoReports()
        self.ckpt = (
            Checkpointer(
                self.layout.root,
                self.model.n_params,
                opts.keep_last,
                opts.keep_every,
                pin_memory=self.device.type == "cuda",
                on_done=self._on_checkpoint_done,
            )
            if self.rank == 0
            else _NoCheckpointer()
        )
        self.last_written = self.step if opts.resume_from is not None else None
        self.usr1 = Usr1Requests(flags, opts.usr1_at, self.cfg.checkpoint_every)
        self._last_reason: str | None = None  # reason of the newest snapshot
        self.nonfinite_run = 0
        self._heldout_cache: dict[tuple[str, int], torch.Tensor] = {}  # (arm, n) -> windows
        # the held-out probes' plan: at most probe_budget of the compute
        self.probe_plan = probe_plan(self.cfg, len(self.sampler.names))
        self._views_checked = False  # check_flat / check_views after this incarnation's 1st update
        self._pending: QueuedUpdate | None = None  # queued, its report not yet written
        self._last_queued: float | None = None  # perf_counter when an update was last queued
        self.policy_waits, self.policy_wait_s = 0, 0.0  # times (and seconds) a policy was late
        if self.rank == 0:
            log.info(
                "training on %s: %d micro-batch(es) of %d sequences per rank per update, "
                "precision %s (%s), AdamW %s, torch.compile %s",
                self.device,
                self.accum,
                self.micro,
                self.precision,
                "bf16 autocast, fp32 weights/m/v/file"
                if self.precision == "bf16"
                else "no autocast",
                "fused" if self.opt.fused else "foreach",
                f"{'on' if self.compiled else 'off'} (--compile {opts.compile})",
            )

    # ------------------------------------------------------------------ set-up
    def _wrap_for_training(self) -> torch.nn.Module:
        """The per-sequence loss the training step runs: of DDP over the ranks (gradients
        averaged in buckets that the .grad tensors view), torch.compile'd when `self.compiled`
        (static shapes; one graph without DDP). Probes, audits and checkpoints use the
        unwrapped `self.model`, whose parameters stay views of `model.flat` (checked after the
        first update, compiled or not)."""
        module: torch.nn.Module = self.model
        self._ddp = None  # the DDP wrapper, for no_sync between micro-batches
        if self.dist.enabled:
            from torch.nn.parallel import DistributedDataParallel as DDP

            module = DDP(
                self.model,
                device_ids=[self.device] if self.device.type == "cuda" else None,
                gradient_as_bucket_view=True,
            )
            self._ddp = module
            self.model.check_flat()  # DDP must not move a parameter out of model.flat
        loss = SequenceLoss(module, self.device, self.precision)
        if not self.compiled:
            return loss
        # the compile cache in the run directory, where every resume (any node) finds it
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(self.layout.compile_cache))
        if self.device.type == "cpu":
            # inductor lowers the embedding's backward (index_put with accumulate) to atomic
            # adds across threads unless deterministic algorithms are on; then aten's serial
            # kernel: bit-identical runs and resumes on the CPU (tests/test_compile.py)
            torch.use_deterministic_algorithms(True, warn_only=True)
        return torch.compile(loss, dynamic=False, fullgraph=self._ddp is None)  # type: ignore[return-value]

    def _resume(self, path: Path) -> None:
        """Read checkpoint `path` into the model and AdamW's state, checked against the
        checksum the proxy's scan verified (or the manifest's): the file may have changed
        since the scan. Without a checksum, rule 8 (finite values, v >= 0) is checked
        instead. Raises ResumeLoadError (a CheckpointError) when a rule fails
        (docs/checkpoint-format.md#validity)."""
        t0 = time.perf_counter()
        checksum = self.opts.resume_verified
        if not checksum:
            entries = read_manifest(self.layout.root)
            s = parse_checkpoint_name(path.name)
            checksum = entries[s].checksum if s in entries else None
        self.hooks.before_resume(path)
        own = (self.model.flat, self.opt.m, self.opt.v)
        # on the CPU (little-endian), read straight into them: no second buffer, no copy
        direct = all(t.device.type == "cpu" for t in own) and sys.byteorder == "little"
        out = (own[0].numpy(), own[1].numpy(), own[2].numpy()) if direct else None
        try:
            step, *arrays = load_checkpoint(path, self.model.n_params, checksum, out=out)
        except CheckpointError as e:
            raise ResumeLoadError(str(e), path=e.path or path, rule=e.rule) from e
        if not direct:  # device memory (or a big-endian host): copy from the host
            with torch.no_grad():
                for t, a in zip(own, arrays):
                    t.copy_(torch.from_numpy(a))
        # AdamW bias correction = the header step (docs/checkpoint-format.md)
        self.opt.set_step(step)
        self.step = self.resumed_from = step
        log.info(
            "resumed from %s (step %d) in %.2f s (%s)",
            path.name,
            step,
            time.perf_counter() - t0,
            f"checksum {checksum} verified on load"
            if checksum
            else "not in the manifest: size, header and values checked",
        )

    def announce(self) -> None:
        """Rank 0 announces the worker; every rank adds its pid to `worker.pids` under the lock
        (the proxy sends SIGUSR1/SIGTERM to the ranks directly, never through torchrun)."""
        pid = os.getpid()
        info = {
            "pid": pid,
            "n_params": self.model.n_params,
            "resumed_from": self.resumed_from,
            "device": str(self.device),
            "world_size": self.world_size,
            "started_at": time.time(),
            "peak_flops": self.peak.value,
            "peak_source": self.peak.source,
            "precision": self.precision,
            "fused_adamw": self.opt.fused,
            "compile": self.compiled,
            "micro_batch_size": self.micro,
            "accumulation_steps": self.accum,
        }

        def change(d: dict) -> None:
            w = d.get("worker") or {}
            pids = [p for p in w.get("pids", []) if p != pid] + [pid]
            if self.rank == 0:
                w.update(info)
            w["pids"] = sorted(pids)
            d["worker"] = w

        update_handshake(self.layout, change)
        info["pids"] = [pid]
        self.reports.write({"type": "hello", **info})

    # ------------------------------------------------------------------ one update
    def _policy_for(self, step: int) -> tuple[dict | None, dict]:
        """(probabilities for update `step`, control requests), waiting for the proxy. A late
        policy is counted (`policy_waits`, `policy_wait_s`, reported when the worker stops);
        before waiting, the pending report is written: the proxy may need it."""
        period = policy_period(step, self.cfg.probe_every)
        deadline = time.monotonic() + self.opts.policy_timeout
        waited_since = None
        while True:
            d = read_handshake(self.layout)
            pol = d["policies"].get(str(period))
            control = d.get("control") or {}
            if pol is not None or self.flags.stop_reason:
                if waited_since is not None:
                    self.policy_waits += 1
                    self.policy_wait_s += time.monotonic() - waited_since
                return (pol["p"] if pol is not None else None), control
            if waited_since is None:
                waited_since = time.monotonic()
                self._write_pending()
            if time.monotonic() > deadline:
                raise HandshakeError(
                    f"{self.layout.handshake}: no policy for period {period} "
                    f"after {self.opts.policy_timeout:.0f} s; is the proxy alive?"
                )
            time.sleep(0.005)

    def _to_device(self, a: np.ndarray | torch.Tensor) -> torch.Tensor:
        """Host array `a` on the training device. On CUDA it is first copied into page-locked
        memory (torch's caching host allocator reuses the block once its copy has completed),
        so the upload is asynchronous and overlaps the device's work; elsewhere a no-op."""
        t = torch.from_numpy(a) if isinstance(a, np.ndarray) else a
        if self.device.type != "cuda":
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    def _queue_update(self, k: int, probs: dict) -> QueuedUpdate:
        """Queue optimizer update k (probabilities `probs` {arm: p}) on the device without
        reading any of its values on the host, its statistics over the GLOBAL batch as one
        float64 vector (`QueuedUpdate.values`; docs/architecture.md#the-step-loop).
        `_read_update` turns it into the step report."""
        t0 = time.perf_counter()
        cfg = self.cfg
        events = None
        if self.device.type == "cuda":
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        batch = self.sampler.draw(cfg.seed, k, probs, cfg.batch_size, self.rank, self.world_size)
        a = len(self.sampler.names)
        weights = np.zeros((a + 1, batch.arm_index.size), dtype=np.float64)
        weights[0] = 1.0  # row 0: the loss sum; row 1 + i: the sum over arm i's rows
        weights[1 + batch.arm_index, np.arange(batch.arm_index.size)] = 1.0
        tokens, weights_d = self._to_device(batch.tokens), self._to_device(weights)
        lr = learning_rate(k, cfg)
        seq = self._forward_backward(k, tokens)
        clip = cfg.grad_clip
        gnorm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), clip if clip > 0 else float("inf")
        )
        unigram = np.bincount(batch.arm_index, weights=batch.unigram_loss, minlength=a)
        # (1 + 2 arms,), this rank's rows: the loss sum, each arm's, each arm's unigram loss
        sums = torch.cat([weights_d @ seq.double(), self._to_device(unigram)])
        wdist.sum_(self.dist, sums)  # over the ranks: every rank sees the same values
        gnorm = gnorm.double().reshape(1)
        bad = (~(torch.isfinite(sums[:1]) & torch.isfinite(gnorm))).double()
        self.ckpt.wait_copied()  # a deferred checkpoint copy must not see this update
        self.opt.step(lr, found_inf=bad.float().reshape(()))
        if not self._views_checked:  # still the flat buffers the checkpoints copy, compiled too
            self.model.check_flat()
            self.opt.check_views()
            self._views_checked = True
        values = torch.cat([sums, gnorm, bad])
        if events is not None:  # to page-locked host memory, read once the event has passed
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            values = host
            events[1].record()
        now = time.perf_counter()
        step_s = now - (self._last_queued if self._last_queued is not None else t0)
        self._last_queued = now
        return QueuedUpdate(k, probs, batch.counts, lr, values, events, t0, now - t0, step_s)

    def _read_update(self, q: QueuedUpdate) -> dict:
        """The step report of queued update `q` (docs/handshake.md#reports): its one read of
        device values (waiting for the update's event on CUDA), the non-finite bookkeeping,
        the probe attached to it and the timing."""
        if q.events is not None:
            q.events[1].synchronize()
        values = q.values.tolist()  # the one host read of the update
        names = self.sampler.names
        a = len(names)
        cfg = self.cfg
        loss_v, gnorm_v, bad = values[0] / cfg.batch_size, values[1 + 2 * a], values[2 + 2 * a]
        arm_loss = {n: values[1 + i] / q.counts[n] for i, n in enumerate(names) if q.counts[n]}
        unigram = {n: values[1 + a + i] / q.counts[n] for i, n in enumerate(names) if q.counts[n]}
        rec = {
            "type": "step",
            "step": q.k,
            "loss": loss_v,
            "lr": q.lr,
            "tokens": q.k * cfg.batch_size * cfg.model.block_size,
            "arms": q.counts,
            "p": {n: float(q.probs.get(n, 0.0)) for n in names},
            "period": policy_period(q.k, cfg.probe_every),
            "grad_norm": gnorm_v,
            "arm_loss": arm_loss,
            "arm_unigram_loss": unigram,
        }
        if bad:  # docs/architecture.md#bad-input-and-faults: not applied, and recorded
            self.nonfinite_run += 1
            why = f"non-finite loss {loss_v} / grad norm {gnorm_v}: update not applied"
            log.error("step %d: %s", q.k, why)
            rec["skipped"] = why
        else:
            self.nonfinite_run = 0
        if q.probe is not None:
            rec["probe"] = q.probe
        if q.eval is not None:
            rec["eval"] = q.eval
        rec["step_time"] = q.step_s
        train_s = (
            q.events[0].elapsed_time(q.events[1]) / 1e3 if q.events is not None else q.queued_s
        )
        tokens_per_s = cfg.batch_size * cfg.model.block_size / max(train_s, 1e-9)
        rec["tokens_per_s"] = tokens_per_s  # global (all ranks), the update alone (no probe)
        rec["mfu"] = mfu(self.flops_per_token, tokens_per_s, self.peak.value, self.world_size)
        if self.rank == 0:
            self.peak.measure_later()  # CPU, first update of a machine without a cached peak
        rec["time"] = time.time()
        return rec

    def train_step(self, k: int, probs: dict) -> dict:
        """Optimizer update k with the proxy's probabilities `probs` {arm: p}, read at once:
        its step report, with the probe when one is due (benchmarks and tests; the loop in
        `run` reads each update's values while the next one runs)."""
        q = self._queue_update(k, probs)
        q.probe = self._probe(k)
        return self._read_update(q)

    def _probe(self, k: int) -> dict[str, float] | None:
        """Mean held-out loss per arm on the fixed probe set when update `k` probes (never
        trained on; docs/bandit.md#rewards), else None."""
        due = self.probe_plan.active and k % self.probe_plan.every == 0 and self.rank == 0
        return self.heldout_losses(self.probe_plan.sequences) if due else None

    def _forward_backward(self, k: int, tokens: torch.Tensor) -> torch.Tensor:
        """Zeroed gradients, then forward and backward of this rank's slice of update k's batch
        (`tokens` int64 (rows, T + 1) on the device) in `self.accum` consecutive micro-batches
        of `self.micro` rows (docs/configuration.md#batch-and-accumulation), every backward but
        the last under DDP's `no_sync` (the last all-reduces the gradients once); returns the
        per-sequence losses, float32 (rows,), in row order (detached)."""
        self.model.train()
        self.opt.zero_grad()
        seqs, m = [], self.micro
        for i, r in enumerate(range(0, tokens.size(0), m)):
            x, y = tokens[r : r + m, :-1], tokens[r : r + m, 1:]
            if self.cfg.dropout > 0:  # the masks follow from (seed, k, rank, i): exact resume
                torch.manual_seed(dropout_seed(self.cfg.seed, k, self.rank, i))
            ddp = self._ddp if i < self.accum - 1 else None  # gradients accumulate locally
            with ddp.no_sync() if ddp is not None else contextlib.nullcontext():
                seq = self.train_loss(x, y)
                seq = self.hooks.on_loss(k, seq)
                (seq.mean() * self.micro_scale).backward()  # sum = the slice's mean gradient
            seqs.append(seq.detach())
            self.hooks.after_micro_batch(k, i + 1, self.reports.write)
        return torch.cat(seqs)

    @torch.no_grad()
    def heldout_losses(self, sequences: int) -> dict[str, float]:
        """Mean loss per arm, in nats, over the first `sequences` held-out windows of each arm
        (the same windows every time, never trained on), of the model after the update just
        queued; read from the device at once for every arm. Draws no random numbers, so the
        training batches never depend on it (docs/history.md#record)."""
        self.model.eval()
        means = []
        for n in self.sampler.names:
            if (n, sequences) not in self._heldout_cache:
                self._heldout_cache[n, sequences] = self.sampler.heldout_windows(n, sequences)
            w = self._heldout_cache[n, sequences]  # the unwrapped model: eager, no collective
            x, y = w[:, :-1].to(self.device, non_blocking=True), w[:, 1:].to(self.device)
            means.append(self.eval_loss(x, y).mean())
        self.model.train()
        return dict(zip(self.sampler.names, torch.stack(means).tolist()))

    @torch.no_grad()
    def sample_audit(self, k: int, probe: dict[str, float] | None) -> dict:
        """Text from a fixed prompt per arm (each arm its own seed; the arms generated as one
        batch), and held-out loss per arm (docs/architecture.md#the-worker)."""
        probe = probe or self.heldout_losses(self.probe_plan.sequences)
        self.model.eval()
        names = self.sampler.names
        prompts = [self.sampler.prompt(n) for n in names]
        gens = [
            torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + k * 101 + i)
            for i in range(len(names))
        ]
        if len({len(p) for p in prompts}) == 1:  # one batched generation for every arm
            batches = [(np.stack(prompts), gens)]
        else:  # an arm whose held-out split is shorter than the prompt: one row at a time
            batches = [(p.reshape(1, -1), [g]) for p, g in zip(prompts, gens)]
        outs = [
            row
            for idx, g in batches
            for row in generate_batched(
                self.model,
                torch.from_numpy(idx).to(self.device),
                self.opts.audit_tokens,
                SAMPLE_TEMPERATURE,
                SAMPLE_TOP_K,
                g,
            )
        ]
        arms = {
            n: {
                "prompt": self.tokenizer.decode(prompt),
                "text": self.tokenizer.decode(out[len(prompt) :].tolist()),
                "loss": probe[n],
                "temperature": SAMPLE_TEMPERATURE,
                "top_k": SAMPLE_TOP_K,
            }
            for n, prompt, out in zip(names, prompts, outs)
        }
        self.model.train()
        return {"type": "audit", "step": k, "arms": arms, "time": time.time()}

    # ------------------------------------------------------------------ boundary
    def _decide_boundary(self, k: int, control: dict) -> Boundary:
        """The boundary of update k: checkpoint? stop? why? The events (SIGUSR1 seen, control
        checkpoint, control stop, stop signal, non-finite alarm) are first agreed by all ranks
        with a collective, the element-wise MAX (worker/distributed.py `agree`), so an event one
        rank saw is acted on by all and every rank decides the same. Every rank must call it
        at every boundary."""
        busy = self.ckpt.busy()  # several SIGUSR1 coalesce into one
        usr1_new = self.usr1.arrived(writing_usr1=busy and self._last_reason == "sigusr1")
        ctl_ckpt = k == control.get("checkpoint_at_step")
        events = [
            int(usr1_new),
            int(ctl_ckpt),
            int(control_stops_at(control, k, self.cfg.checkpoint_every)),
            int(bool(self.flags.stop_reason)),
            int(self.nonfinite_run >= self.opts.max_nonfinite),
        ]
        if self.dist.enabled:
            events = wdist.agree(self.dist, events)
            if events[3] and not self.flags.stop_reason:
                self.flags.stop_reason = "SIGTERM (another rank)"
        usr1_new, ctl_ckpt, ctl_stop, sig_stop, alarm = (bool(e) for e in events)
        reasons = ["cadence"] if k % self.cfg.checkpoint_every == 0 else []
        if usr1_new:
            self.usr1.start(k)  # worker/signals.py Usr1Requests: coalescing, usr1_at
        if self.usr1.due(k):
            reasons.append("sigusr1")
        if ctl_ckpt:
            reasons.append(control.get("reason") or "sigusr1")
        stops = [
            (ctl_stop, control.get("reason") or "pivot"),
            (sig_stop, "sigterm"),
            (k >= self.max_steps, "final"),
            (alarm, "alarm"),
        ]
        reasons += [reason for stop, reason in stops if stop]
        return self._boundary(reasons, any(stop for stop, _ in stops), control)

    def _boundary(self, reasons: list[str], stop: bool, control: dict) -> Boundary:
        """A Boundary with the reason for a stop, in order of precedence: a signal, repeated
        non-finite losses, a collapse alarm, the last step, the proxy's control request."""
        if not stop:
            return Boundary(tuple(reasons))
        why = self.flags.stop_reason or (
            "non-finite loss"
            if self.nonfinite_run >= self.opts.max_nonfinite
            else "collapse alarm from the proxy"
            if "alarm" in reasons
            else "max steps"
            if self.step >= self.max_steps
            else f"{control.get('reason') or 'control'} requested by the proxy"
        )
        return Boundary(tuple(reasons), True, why)

    def checkpoint(self, k: int, reasons: list[str]) -> None:
        reason = next(r for r in REASON_PRIORITY if r in reasons)
        if self.last_written == k:
            return  # already on disk (e.g. resumed here, or cadence + SIGUSR1 on one step)
        self.reports.write({"type": "checkpoint_started", "step": k, "reason": reason})
        held = self.ckpt.snapshot(
            k, self.model.flat, self.opt.m, self.opt.v, reason, defer_copy=True
        )  # copy overlaps the next forward/backward
        self.last_written, self._last_reason = k, reason
        log.debug("checkpoint step %d: training held %.4f s", k, held)

    def _on_checkpoint_done(self, r: WriteResult) -> None:
        report = {"type": "checkpoint", "step": r.step, "reason": r.reason}
        if r.error:
            report["error"] = r.error
        else:
            assert r.path is not None  # set for every write that did not fail
            name = Path(r.path).name
            log.info(
                "checkpoint step %d (%s) %s %d bytes in %.2f s",
                r.step,
                r.reason,
                name,
                r.nbytes,
                r.seconds,
            )
            report.update(file=name, bytes=r.nbytes, seconds=r.seconds)
        self.reports.write({**report, "time": time.time()})

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        """Train until max_steps or a stop; returns the process exit code. Each update's report
        is written while the next update runs, or at once where something needs it
        (`_train_and_report`, `_policy_for`, docs/architecture.md#the-step-loop)."""
        self.announce()
        self.hooks.at_start()  # a test may replace a signal handler here
        if lost := self.flags.verify_and_repair():  # after library start-up (NCCL takes SIGUSR1)
            self.reports.write(
                {
                    "type": "event",
                    "event": "signal-handlers-replaced",
                    "signals": lost,
                    "time": time.time(),
                }
            )
        while True:
            b = self._one_update()
            if b.reasons or b.stop:
                self._write_pending()  # the checkpoint's and the stop's step is on record
            if b.reasons and self.step > 0:
                self.checkpoint(self.step, list(b.reasons))
            if b.stop:
                return self._stop(b)

    def _write_pending(self) -> None:
        """Read the queued update's values (waiting for the device) and write its report."""
        q, self._pending = self._pending, None
        if q is None:
            return
        rec = self._read_update(q)
        if q.k == self.resumed_from + 1:
            log.debug(
                "start-up: first step %d of this worker done %.3f s since its launch (the step "
                "%.3f s)",
                q.k,
                seconds_since_start() or 0.0,
                rec["step_time"],
            )
        self.reports.write(rec)

    def _one_update(self) -> Boundary:
        """Update k = step + 1 unless the run is over or stopping, then the boundary decision."""
        k = self.step + 1
        if k > self.max_steps:
            return self._boundary([], True, {})
        if self.flags.stop_reason and not self.dist.enabled:
            return self._boundary(["sigterm"], True, {})
        probs, control = self._policy_for(k)
        stopping = probs is None or bool(self.flags.stop_reason)
        # on several ranks, when any rank stops no rank starts the update, so none waits in DDP
        # for one that never comes
        if self.dist.enabled and wdist.agree(self.dist, [int(stopping)])[0]:
            self.flags.stop_reason = self.flags.stop_reason or "SIGTERM (another rank)"
            probs = None
        if probs is None:
            return self._boundary(["sigterm"], True, control)
        self._train_and_report(k, probs)
        return self._decide_boundary(k, control)

    def _train_and_report(self, k: int, probs: dict) -> None:
        """Queue update k, then write update k-1's report while k runs; k's own report is written
        at once when its probe, validation or audit is due, or while updates are not finite (the
        stop after `max_nonfinite` of them needs their values), else with update k+1."""
        q = self._queue_update(k, probs)
        self._write_pending()
        self.hooks.after_step(k, self.reports.write)
        self.step, self._pending = k, q
        q.probe = self._probe(k)
        if self.cfg.eval_every and k % self.cfg.eval_every == 0 and self.rank == 0:
            q.eval = self.heldout_losses(self.cfg.eval_sequences)  # the validation curve
        audit = k % self.cfg.sample_every == 0 and self.rank == 0
        if audit or q.probe is not None or q.eval is not None or self.nonfinite_run:
            self._write_pending()
        if audit:
            self.reports.write(self.sample_audit(k, q.probe))

    def _stop(self, b: Boundary) -> int:
        """The stop at boundary `b`: wait for the last checkpoint write, report "stopped", leave
        the process group; returns the exit code (docs/architecture.md#exit-codes)."""
        code = EXIT_OK
        r = self.ckpt.wait()
        if r is not None and r.error:
            code = EXIT_FATAL  # docs/checkpoint-format.md#disk: the stop path exits non-zero
            log.error(
                "stopping (%s) but the checkpoint of step %d (%s) FAILED: %s; "
                "exiting with code %d: steps after the newest durable checkpoint "
                "will be trained again on resume",
                b.why,
                r.step,
                r.reason,
                r.error,
                code,
            )
        if "alarm" in b.reasons:
            code = EXIT_FATAL
        log.info("stopping at step %d (%s)", self.step, b.why)
        self.reports.write(
            {
                "type": "event",
                "event": "stopped",
                "step": self.step,
                "why": b.why,
                "exit_code": code,
                "policy_waits": self.policy_waits,
                "policy_wait_s": round(self.policy_wait_s, 6),
                "time": time.time(),
            }
        )
        self._ddp, self.train_loss = None, self.eval_loss  # DDP's Reducer holds the group
        wdist.shutdown(self.dist)
        return code
