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
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

from shared.activation_memory import check_micro_batch_fits
from shared.arm_data import read_arm_index
from shared.checkpoint_format import CheckpointError, load_checkpoint, parse_checkpoint_name
from shared.embedded_arms import cache_dir
from shared.checkpoint_manifest import read_manifest
from shared.exit_codes import EXIT_FATAL, EXIT_OK
from shared.config import (
    ConfigError,
    RunConfig,
    SAMPLE_TEMPERATURE,
    SAMPLE_TOP_K,
    accumulation_steps,
    load_run_config,
    probe_plan,
)
from shared.handshake import (
    ReportWriter,
    control_stops_at,
    policy_period,
    read_handshake,
    update_handshake,
    HandshakeError,
)
from shared.procfs import seconds_since_start
from shared.run_layout import RunLayout
from shared.worker_options import WorkerOptions as WorkerOptions  # also named here
from shared.tokenizer import RunTokenizer
from worker import distributed as wdist
from worker.checkpointer import Checkpointer, WriteResult
from worker.data import ArmSampler, dropout_seed
from worker.model import GPT
from worker.optim import FlatAdamW, learning_rate
from worker.sampling import generate_batched
from worker.perf import PeakFlops, mfu
from worker import precision as wprec
from worker import fault_injection
from worker.signals import SignalFlags, Usr1Requests

log = logging.getLogger("worker.trainer")

REASON_PRIORITY = ("final", "pivot", "alarm", "sigusr1", "sigterm", "cadence")


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
        check_micro_batch_fits(
            self.cfg.model,
            self.cfg.vocab_size,
            micro,
            per_rank,
            self.precision,
            wprec.device_memory_bytes(self.device),
            str(self.device),
            compiled=bool(opts.compile),
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
        self.model.to_device(self.device)
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
        self.train_module = self._wrap_for_training()
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
        self._probe_cache: dict[str, torch.Tensor] = {}
        self.probe_plan = probe_plan(
            self.cfg, len(self.sampler.names)
        )  # <= probe_budget of compute
        self._policy: tuple[int, dict] | None = None
        self._views_checked = False  # FlatAdamW.check_views after this incarnation's 1st update
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
                "on" if opts.compile else "off",
            )

    # ------------------------------------------------------------------ set-up
    def _wrap_for_training(self) -> torch.nn.Module:
        """The module the training step runs: DDP over the ranks (gradients averaged in buckets
        that the .grad tensors view), optionally torch.compile'd. Probes, audits and checkpoints
        use the unwrapped `self.model`, whose parameters stay views of `model.flat`."""
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
            flat = self.model.flat.untyped_storage().data_ptr()
            if any(p.untyped_storage().data_ptr() != flat for p in self.model.parameters()):
                raise RuntimeError(
                    "DDP moved a parameter out of model.flat; checkpoints would save stale weights"
                )
        if self.opts.compile:
            module = torch.compile(module)  # type: ignore[assignment]  # called like the module
        return module

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
        try:
            step = self._read_checkpoint(path, checksum)
        except CheckpointError as e:
            raise ResumeLoadError(str(e), path=e.path or path, rule=e.rule) from e
        self.opt.set_step(
            step
        )  # AdamW bias correction = the header step (docs/checkpoint-format.md)
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

    def _read_checkpoint(self, path: Path, checksum: str | None) -> int:
        """Read `path` straight into model.flat, opt.m and opt.v; returns the header step."""
        own = (self.model.flat, self.opt.m, self.opt.v)
        if all(t.device.type == "cpu" for t in own) and sys.byteorder == "little":
            # read straight into the weights and AdamW's state: no second buffer, no copy
            step, *_ = load_checkpoint(
                path,
                self.model.n_params,
                checksum,
                out=(own[0].numpy(), own[1].numpy(), own[2].numpy()),
            )
        else:  # device memory (or a big-endian host): read to the host, then copy
            step, w, m, v = load_checkpoint(path, self.model.n_params, checksum)
            with torch.no_grad():
                for t, a in zip(own, (w, m, v)):
                    t.copy_(torch.from_numpy(a))
        return step

    def announce(self) -> None:
        """Rank 0 announces the worker; every rank adds its pid to `worker.pids` under the lock
        (the proxy sends SIGUSR1/SIGTERM to the ranks directly, never through torchrun)."""
        info = {
            "pid": os.getpid(),
            "n_params": self.model.n_params,
            "resumed_from": self.resumed_from,
            "device": str(self.device),
            "world_size": self.world_size,
            "started_at": time.time(),
            "peak_flops": self.peak.value,
            "peak_source": self.peak.source,
            "precision": self.precision,
            "fused_adamw": self.opt.fused,
            "compile": self.opts.compile,
            "micro_batch_size": self.micro,
            "accumulation_steps": self.accum,
        }
        pid = os.getpid()

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
        """(probabilities for update `step`, control requests), waiting for the proxy."""
        period = policy_period(step, self.cfg.probe_every)
        deadline = time.monotonic() + self.opts.policy_timeout
        while True:
            d = read_handshake(self.layout)
            pol = d["policies"].get(str(period))
            control = d.get("control") or {}
            if pol is not None:
                return pol["p"], control
            if self.flags.stop_reason:
                return None, control
            if time.monotonic() > deadline:
                raise HandshakeError(
                    f"{self.layout.handshake}: no policy for period {period} "
                    f"after {self.opts.policy_timeout:.0f} s; is the proxy alive?"
                )
            time.sleep(0.005)

    def _seq_losses(
        self, x: torch.Tensor, y: torch.Tensor, module: torch.nn.Module | None = None
    ) -> torch.Tensor:
        """Mean next-token loss per sequence, float32 (b,). `module`: the training module (DDP /
        compiled) or, by default, the unwrapped model (probes: no collective). The forward
        runs under worker/precision.py `autocast` (bf16 for --precision bf16, and auto on
        CUDA); weights, m and v stay fp32. The loss is computed in fp32."""
        module = self.model if module is None else module
        with wprec.autocast(self.device, self.precision):
            logits = module(x.to(self.device, non_blocking=True))
        tok = F.cross_entropy(
            logits.float().reshape(-1, logits.size(-1)),
            y.to(self.device, non_blocking=True).reshape(-1),
            reduction="none",
        )
        return tok.view(y.shape).mean(dim=1)

    def _update_losses(self, seq: torch.Tensor, arm_index: np.ndarray) -> tuple[float, dict]:
        """(loss over the update's GLOBAL batch, per-arm mean loss over the global batch) from
        this rank's per-sequence losses `seq` (float32 (b,), all its micro-batches in order):
        one sum of [sum, per-arm sums, per-arm counts] over the ranks (worker/distributed.py
        `sum_floats`; a no-op on one rank), in float64. One code path for every world size."""
        seq_np = seq.detach().float().cpu().numpy().astype(np.float64)
        names = self.sampler.names
        local = [float(seq_np.sum())]
        local += [float(seq_np[arm_index == i].sum()) for i in range(len(names))]
        local += [float((arm_index == i).sum()) for i in range(len(names))]
        tot = wdist.sum_floats(self.dist, local)
        a = len(names)
        arm_loss = {
            n: tot[1 + i] / tot[1 + a + i] for i, n in enumerate(names) if tot[1 + a + i] > 0
        }
        return tot[0] / self.cfg.batch_size, arm_loss

    def _micro_batches(self, batch) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's slice of the update's batch as `self.accum` consecutive (x, y) micro-batches
        of `self.micro` rows, in row order (docs/configuration.md#batch-and-accumulation)."""
        m = self.micro
        return [(batch.x[i : i + m], batch.y[i : i + m]) for i in range(0, batch.x.size(0), m)]

    def _grad_sync(self, last: bool):
        """Context of one micro-batch's backward: DDP's `no_sync` (gradients accumulate locally)
        on every micro-batch but the update's last, whose backward all-reduces them once."""
        if self._ddp is None or last:
            return contextlib.nullcontext()
        return self._ddp.no_sync()

    def _apply_update(self, lr: float) -> None:
        self.ckpt.wait_copied()  # a deferred checkpoint copy must not see this update
        self.opt.step(lr)
        if not self._views_checked:  # m/v still the flat buffers the checkpoints copy
            self.opt.check_views()
            self._views_checked = True
        self.nonfinite_run = 0

    def _skip_update(self, k: int, loss_v: float, gnorm_v: float) -> str:
        """docs/architecture.md#bad-input-and-faults: a non-finite update is not applied, and the event is recorded."""
        self.opt.skip_step()
        self.nonfinite_run += 1
        why = f"non-finite loss {loss_v} / grad norm {gnorm_v}: update not applied"
        log.error("step %d: %s", k, why)
        return why

    def train_step(self, k: int, probs: dict) -> dict:
        """Optimizer update k with the proxy's probabilities `probs` {arm: p}; returns its step
        report (docs/handshake.md#reports). The maths (`_forward_backward`, `_clip`,
        `_update_losses`, `_apply_or_skip`), then the record (`_step_record`), the probe when
        one is due, and the timing (`_add_timing`: the update alone, without the probe)."""
        t0 = time.perf_counter()
        cfg = self.cfg
        batch = self.sampler.draw(cfg.seed, k, probs, cfg.batch_size, self.rank, self.world_size)
        lr = learning_rate(k, cfg)
        seq = self._forward_backward(k, batch)
        gnorm_v = self._clip()
        loss_v, arm_loss = self._update_losses(seq, batch.arm_index)
        skipped = self._apply_or_skip(k, lr, loss_v, gnorm_v)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        train_time = time.perf_counter() - t0
        rec = self._step_record(k, probs, batch, lr, loss_v, gnorm_v, arm_loss, skipped)
        if self.probe_plan.active and k % self.probe_plan.every == 0 and self.rank == 0:
            rec["probe"] = self.probe()
        self._add_timing(rec, t0, train_time)
        return rec

    def _forward_backward(self, k: int, batch) -> torch.Tensor:
        """Zeroed gradients, then forward and backward of this rank's slice of update k's batch
        in `self.accum` micro-batches; returns the per-sequence losses, float32 (rows,), in row
        order (detached)."""
        self.model.train()
        self.opt.zero_grad()
        seqs = []
        for i, (x, y) in enumerate(self._micro_batches(batch)):
            if self.cfg.dropout > 0:  # the masks follow from (seed, k, rank, i): exact resume
                torch.manual_seed(dropout_seed(self.cfg.seed, k, self.rank, i))
            with self._grad_sync(last=i == self.accum - 1):
                seq = self._seq_losses(x, y, self.train_module)
                seq = self.hooks.on_loss(k, seq)
                (seq.mean() * self.micro_scale).backward()  # sum = the slice's mean gradient
            seqs.append(seq.detach())
            self.hooks.after_micro_batch(k, i + 1, self.reports.write)
        return torch.cat(seqs)

    def _clip(self) -> float:
        """Clip the gradients to `grad_clip` (0: no clipping); returns their norm before."""
        clip = self.cfg.grad_clip
        gnorm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), clip if clip > 0 else float("inf")
        )
        return float(gnorm)

    def _apply_or_skip(self, k: int, lr: float, loss_v: float, gnorm_v: float) -> str | None:
        """AdamW at `lr` when the loss and the gradient norm are finite; else the update is not
        applied and the reason is returned (the record's "skipped")."""
        if math.isfinite(loss_v) and math.isfinite(gnorm_v):
            self._apply_update(lr)
            return None
        return self._skip_update(k, loss_v, gnorm_v)

    def _step_record(
        self,
        k: int,
        probs: dict,
        batch,
        lr: float,
        loss_v: float,
        gnorm_v: float,
        arm_loss: dict,
        skipped: str | None,
    ) -> dict:
        """The step report of update k without its probe and timing (docs/history.md)."""
        cfg = self.cfg
        rec = {
            "type": "step",
            "step": k,
            "loss": loss_v,
            "lr": lr,
            "tokens": k * cfg.batch_size * cfg.model.block_size,
            "arms": batch.counts,
            "p": {n: float(probs.get(n, 0.0)) for n in self.sampler.names},
            "period": policy_period(k, cfg.probe_every),
            "grad_norm": gnorm_v,
            "arm_loss": arm_loss,
        }
        if skipped is not None:
            rec["skipped"] = skipped
        return rec

    def _add_timing(self, rec: dict, t0: float, train_time: float) -> None:
        """The record's step_time (s, since `t0`, probe included), tokens_per_s (global, over
        `train_time`: the update alone), mfu and wall-clock time."""
        cfg = self.cfg
        rec["step_time"] = time.perf_counter() - t0
        tokens_per_s = cfg.batch_size * cfg.model.block_size / max(train_time, 1e-9)
        rec["tokens_per_s"] = tokens_per_s  # global (all ranks), the update alone (no probe)
        rec["mfu"] = mfu(self.flops_per_token, tokens_per_s, self.peak.value, self.world_size)
        if self.rank == 0:
            self.peak.measure_later()  # CPU, first update of a machine without a cached peak
        rec["time"] = time.time()

    @torch.no_grad()
    def probe(self) -> dict[str, float]:
        """Mean held-out loss per arm on the fixed probe set (never trained on; docs/bandit.md#rewards)."""
        self.model.eval()
        out = {}
        for n in self.sampler.names:
            if n not in self._probe_cache:
                self._probe_cache[n] = self.sampler.heldout_windows(n, self.probe_plan.sequences)
            w = self._probe_cache[n]
            out[n] = float(self._seq_losses(w[:, :-1], w[:, 1:]).mean())
        self.model.train()
        return out

    @torch.no_grad()
    def sample_audit(self, k: int, probe: dict[str, float] | None) -> dict:
        """Text from a fixed prompt per arm (each arm its own seed; the arms generated as one
        batch), and held-out loss per arm (docs/architecture.md#the-worker)."""
        self.model.eval()
        probe = probe or self.probe()
        self.model.eval()
        temperature, top_k = SAMPLE_TEMPERATURE, SAMPLE_TOP_K
        names = self.sampler.names
        prompts = [self.sampler.prompt(n) for n in names]
        gens = [
            torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + k * 101 + i)
            for i in range(len(names))
        ]
        arms = {}
        outs: torch.Tensor | list[torch.Tensor]
        if len({len(p) for p in prompts}) == 1:  # one batched generation for every arm
            idx = torch.from_numpy(np.stack(prompts)).to(self.device)
            outs = generate_batched(
                self.model, idx, self.opts.audit_tokens, temperature, top_k, gens
            )
        else:  # an arm whose held-out split is shorter than the prompt: one row at a time
            outs = [
                generate_batched(
                    self.model,
                    torch.from_numpy(p).view(1, -1).to(self.device),
                    self.opts.audit_tokens,
                    temperature,
                    top_k,
                    [g],
                )[0]
                for p, g in zip(prompts, gens)
            ]
        for n, prompt, out in zip(names, prompts, outs):
            arms[n] = {
                "prompt": self.tokenizer.decode(prompt),
                "text": self.tokenizer.decode(out[len(prompt) :].tolist()),
                "loss": probe[n],
                "temperature": temperature,
                "top_k": top_k,
            }
        self.model.train()
        return {"type": "audit", "step": k, "arms": arms, "time": time.time()}

    # ------------------------------------------------------------------ boundary
    def _agree_on_events(self, k: int, control: dict) -> tuple[bool, bool, bool, bool, bool]:
        """(SIGUSR1 seen, control checkpoint, control stop, stop signal, non-finite alarm) for
        the boundary of update k, agreed by all ranks with a collective: the element-wise MAX
        over the ranks (worker/distributed.py `agree`), so an event one rank saw is acted on by
        all. Every rank must call it at every boundary."""
        busy = getattr(self.ckpt, "busy", lambda: False)()  # several SIGUSR1 coalesce into one
        usr1_new = self.usr1.arrived(writing_usr1=busy and self._last_reason == "sigusr1")
        ctl_ckpt = (
            control.get("checkpoint_at_step") is not None and k == control["checkpoint_at_step"]
        )
        ctl_stop = control_stops_at(control, k, self.cfg.checkpoint_every)
        events = [
            int(usr1_new),
            int(ctl_ckpt),
            int(ctl_stop),
            int(bool(self.flags.stop_reason)),
            int(self.nonfinite_run >= self.opts.max_nonfinite),
        ]
        if self.dist.enabled:
            events = wdist.agree(self.dist, events)
            if events[3] and not self.flags.stop_reason:
                self.flags.stop_reason = "SIGTERM (another rank)"
        usr1, ckpt, stop, term, nonfinite = (bool(e) for e in events)
        return usr1, ckpt, stop, term, nonfinite

    def _decide_boundary(self, k: int, control: dict) -> Boundary:
        """The boundary of update k: checkpoint? stop? why? Agrees the events with the other
        ranks first (a collective), so every rank decides the same."""
        reasons, stop = [], False
        usr1_new, ctl_ckpt, ctl_stop, sig_stop, alarm = self._agree_on_events(k, control)
        if k % self.cfg.checkpoint_every == 0:
            reasons.append("cadence")
        if usr1_new:
            self.usr1.start(k)  # worker/signals.py Usr1Requests: coalescing, usr1_at
        if self.usr1.due(k):
            reasons.append("sigusr1")
        if ctl_ckpt:
            reasons.append(control.get("reason") or "sigusr1")
        if ctl_stop:
            reasons.append(control.get("reason") or "pivot")
            stop = True
        if sig_stop:
            reasons.append("sigterm")
            stop = True
        if k >= self.max_steps:
            reasons.append("final")
            stop = True
        if alarm:
            reasons.append("alarm")
            stop = True
        return self._boundary(reasons, stop, control)

    def _boundary(self, reasons: list[str], stop: bool, control: dict) -> Boundary:
        """A Boundary with the reason for a stop, in order of precedence: a signal, repeated
        non-finite losses, a collapse alarm, the last step, the proxy's control request."""
        if not stop:
            return Boundary(tuple(reasons))
        nan_storm = self.nonfinite_run >= self.opts.max_nonfinite
        why = self.flags.stop_reason or (
            "non-finite loss"
            if nan_storm
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
        if r.error:
            self.reports.write(
                {
                    "type": "checkpoint",
                    "step": r.step,
                    "reason": r.reason,
                    "error": r.error,
                    "time": time.time(),
                }
            )
            return
        assert r.path is not None  # set for every write that did not fail
        log.info(
            "checkpoint step %d (%s) %s %d bytes in %.2f s",
            r.step,
            r.reason,
            Path(r.path).name,
            r.nbytes,
            r.seconds,
        )
        self.reports.write(
            {
                "type": "checkpoint",
                "step": r.step,
                "reason": r.reason,
                "file": Path(r.path).name,
                "bytes": r.nbytes,
                "seconds": r.seconds,
                "time": time.time(),
            }
        )

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        """Train until max_steps or a stop; returns the process exit code."""
        self._start()
        while True:
            b = self._one_update()
            if b.reasons and self.step > 0:
                self.checkpoint(self.step, list(b.reasons))
            if b.stop:
                return self._stop(b)

    def _start(self) -> None:
        """Announce the worker, then check that its signal handlers survived library start-up."""
        self.announce()
        self.hooks.at_start()  # a test may replace a signal handler here
        lost = self.flags.verify_and_repair()  # after library start-up (NCCL takes SIGUSR1)
        if lost:
            self.reports.write(
                {
                    "type": "event",
                    "event": "signal-handlers-replaced",
                    "signals": lost,
                    "time": time.time(),
                }
            )

    def _one_update(self) -> Boundary:
        """Update k = step + 1 unless the run is over or stopping, then the boundary decision."""
        k = self.step + 1
        if k > self.max_steps:
            return self._boundary([], True, {})
        if self.flags.stop_reason and not self.dist.enabled:
            return self._boundary(["sigterm"], True, {})
        probs, control = self._policy_for(k)
        probs = self._unless_a_rank_stops(probs)
        if probs is None:
            return self._boundary(["sigterm"], True, control)
        self._train_and_report(k, probs)
        return self._decide_boundary(k, control)

    def _unless_a_rank_stops(self, probs: dict | None) -> dict | None:
        """`probs`, or None when any rank is stopping (a collective on several ranks): then no
        rank starts the update, so none waits in DDP for one that never comes."""
        if (
            self.dist.enabled
            and wdist.agree(self.dist, [int(probs is None or bool(self.flags.stop_reason))])[0]
        ):
            self.flags.stop_reason = self.flags.stop_reason or "SIGTERM (another rank)"
            return None
        return probs

    def _train_and_report(self, k: int, probs: dict) -> None:
        """Update k, then its step report and, when due, its sample audit."""
        rec = self.train_step(k, probs)
        if k == self.resumed_from + 1:
            log.debug(
                "start-up: first step %d of this worker done %.3f s since its launch (the step "
                "%.3f s)",
                k,
                seconds_since_start() or 0.0,
                rec["step_time"],
            )
        self.hooks.after_step(k, self.reports.write)
        self.step = k
        self.reports.write(rec)
        if k % self.cfg.sample_every == 0 and self.rank == 0:
            self.reports.write(self.sample_audit(k, rec.get("probe")))

    def _stop(self, b: Boundary) -> int:
        """The stop at boundary `b`: wait for the last checkpoint write, report "stopped", leave
        the process group; returns the exit code (docs/architecture.md#exit-codes)."""
        code = EXIT_OK
        why = b.why
        r = self.ckpt.wait()
        if r is not None and r.error:
            code = EXIT_FATAL  # docs/checkpoint-format.md#disk: the stop path exits non-zero
            log.error(
                "stopping (%s) but the checkpoint of step %d (%s) FAILED: %s; "
                "exiting with code %d: steps after the newest durable checkpoint "
                "will be trained again on resume",
                why,
                r.step,
                r.reason,
                r.error,
                code,
            )
        if "alarm" in b.reasons:
            code = EXIT_FATAL
        log.info("stopping at step %d (%s)", self.step, why)
        self.reports.write(
            {
                "type": "event",
                "event": "stopped",
                "step": self.step,
                "why": why,
                "exit_code": code,
                "time": time.time(),
            }
        )
        self._ddp, self.train_module = None, self.model  # DDP's Reducer holds the group
        wdist.shutdown(self.dist)
        return code
