"""The training loop (SPEC section 5): one optimizer update per step, decisions at the boundary.

Update k (1-based) draws batch k with the policy of its period (posted by the proxy), trains,
reports loss record k, probes held-out loss every `probe_every` steps and runs a sample audit
every `sample_every`; then, at the step boundary, decides whether to checkpoint (cadence,
SIGUSR1, SIGTERM, pivot, final) and whether to stop. After update S the header step is S; a
resume from S performs update S+1 next, with exactly the data, learning rate and AdamW state
the uninterrupted run had (bit-identical on CPU).
"""
from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

from shared.arm_data import read_arm_index
from shared.checkpoint_format import load_checkpoint
from shared.checkpoint_manifest import read_manifest
from shared.config import RunConfig, load_run_config
from shared.handshake import ReportWriter, policy_period, read_handshake, update_handshake, \
    HandshakeError
from shared.run_layout import RunLayout
from shared.tokenizer import RunTokenizer
from worker.checkpointer import Checkpointer, WriteResult
from worker.data import ArmSampler
from worker.model import GPT
from worker.optim import FlatAdamW, learning_rate
from worker.signals import SignalFlags

log = logging.getLogger("worker.trainer")

EXIT_OK = 0
EXIT_FATAL = 3          # do not restart: the run cannot go on (NaN storm, bad config, disk)
REASON_PRIORITY = ("final", "pivot", "alarm", "sigusr1", "sigterm", "cadence")


@dataclass
class WorkerOptions:
    """Per-incarnation options the proxy passes on the worker's command line."""

    run_dir: Path
    resume_from: Path | None = None
    max_steps: int | None = None     # None: run.json's max_steps
    usr1_at: str = "step"            # "step" or "boundary"
    device: str = "auto"
    parent_pid: int | None = None
    keep_last: int = 3
    keep_every: int = 10000
    policy_timeout: float = 120.0    # seconds to wait for the proxy's policy
    max_nonfinite: int = 5           # consecutive non-finite steps before the run stops
    audit_tokens: int = 48           # tokens generated per arm per sample audit


class Trainer:
    def __init__(self, opts: WorkerOptions, flags: SignalFlags) -> None:
        self.opts, self.flags = opts, flags
        self.layout = RunLayout(opts.run_dir)
        self.cfg: RunConfig = load_run_config(self.layout.run_json)
        self.max_steps = opts.max_steps or self.cfg.max_steps
        self.rank, self.world_size = 0, 1
        self.device = torch.device(
            ("cuda" if torch.cuda.is_available() else "cpu") if opts.device == "auto" else opts.device)
        self.tokenizer = RunTokenizer.load(self.layout.tokenizer)
        self.sampler = ArmSampler(self.layout.root, read_arm_index(self.layout), self.cfg.model.block_size)
        self.model = GPT(self.cfg.model, self.cfg.vocab_size, self.cfg.dropout, seed=self.cfg.seed)
        self.model.to_device(self.device)
        self.opt = FlatAdamW(self.model, self.cfg)
        self.step = 0
        self.resumed_from = 0
        if opts.resume_from is not None:
            self._resume(Path(opts.resume_from))
        self.reports = ReportWriter(self.layout)
        self.ckpt = Checkpointer(self.layout.root, self.model.n_params, opts.keep_last,
                                 opts.keep_every, pin_memory=self.device.type == "cuda",
                                 on_done=self._on_checkpoint_done)
        self.last_written = self.step if opts.resume_from is not None else None
        self.usr1_served = 0
        self.usr1_target: int | None = None
        self.nonfinite_run = 0
        self._probe_cache: dict[str, torch.Tensor] = {}
        self._policy: tuple[int, dict] | None = None

    # ------------------------------------------------------------------ set-up
    def _resume(self, path: Path) -> None:
        t0 = time.perf_counter()
        entries = read_manifest(self.layout.root)
        from shared.checkpoint_format import parse_checkpoint_name
        s = parse_checkpoint_name(path.name)
        checksum = entries[s].checksum if s in entries else None
        step, w, m, v = load_checkpoint(path, self.model.n_params, checksum)
        with torch.no_grad():
            self.model.flat.copy_(torch.from_numpy(w))
            self.opt.m.copy_(torch.from_numpy(m))
            self.opt.v.copy_(torch.from_numpy(v))
        self.opt.set_step(step)  # AdamW bias correction = the header step (SPEC section 4)
        self.step = self.resumed_from = step
        log.info("resumed from %s (step %d) in %.2f s", path.name, step, time.perf_counter() - t0)

    def announce(self) -> None:
        info = {"pid": os.getpid(), "pids": [os.getpid()], "n_params": self.model.n_params,
                "resumed_from": self.resumed_from, "device": str(self.device),
                "world_size": self.world_size, "started_at": time.time()}
        update_handshake(self.layout, lambda d: d.__setitem__("worker", info))
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
                raise HandshakeError(f"{self.layout.handshake}: no policy for period {period} "
                                     f"after {self.opts.policy_timeout:.0f} s; is the proxy alive?")
            time.sleep(0.005)

    def _seq_losses(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.model(x.to(self.device))
        tok = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.to(self.device).reshape(-1),
                              reduction="none")
        return tok.view(y.shape).mean(dim=1)

    def train_step(self, k: int, probs: dict) -> dict:
        t0 = time.perf_counter()
        cfg = self.cfg
        batch = self.sampler.draw(cfg.seed, k, probs, cfg.batch_size, self.rank, self.world_size)
        lr = learning_rate(k, cfg)
        self.model.train()
        seq = self._seq_losses(batch.x, batch.y)
        loss = seq.mean()
        self.opt.zero_grad()
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                               cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
        loss_v, gnorm_v = float(loss.detach()), float(gnorm)
        rec = {"type": "step", "step": k, "loss": loss_v, "lr": lr,
               "tokens": k * cfg.batch_size * cfg.model.block_size,
               "arms": batch.counts, "p": {n: float(probs.get(n, 0.0)) for n in self.sampler.names},
               "period": policy_period(k, cfg.probe_every), "grad_norm": gnorm_v}
        if math.isfinite(loss_v) and math.isfinite(gnorm_v):
            self.opt.step(lr)
            self.nonfinite_run = 0
        else:  # SPEC section 9: the step is not applied, the event is recorded
            self.opt.zero_grad()
            for st in self.opt.opt.state.values():  # keep AdamW's step == header step
                st["step"] += 1
            self.nonfinite_run += 1
            rec["skipped"] = f"non-finite loss {loss_v} / grad norm {gnorm_v}: update not applied"
            log.error("step %d: %s", k, rec["skipped"])
        seq_np = seq.detach().cpu().numpy()
        rec["arm_loss"] = {n: float(seq_np[batch.arm_index == i].mean())
                           for i, n in enumerate(self.sampler.names) if (batch.arm_index == i).any()}
        if k % cfg.probe_every == 0:
            rec["probe"] = self.probe()
        rec["step_time"] = time.perf_counter() - t0
        rec["time"] = time.time()
        return rec

    @torch.no_grad()
    def probe(self) -> dict[str, float]:
        """Mean held-out loss per arm on the fixed probe set (never trained on; BANDIT.md)."""
        self.model.eval()
        out = {}
        for n in self.sampler.names:
            if n not in self._probe_cache:
                self._probe_cache[n] = self.sampler.heldout_windows(n, self.cfg.probe_sequences)
            w = self._probe_cache[n]
            out[n] = float(self._seq_losses(w[:, :-1], w[:, 1:]).mean())
        self.model.train()
        return out

    @torch.no_grad()
    def sample_audit(self, k: int, probe: dict[str, float] | None) -> dict:
        """Text from a fixed prompt per arm (seeded), and held-out loss per arm (SPEC section 5)."""
        self.model.eval()
        probe = probe or self.probe()
        self.model.eval()
        temperature, top_k = 0.8, 40
        arms = {}
        for i, n in enumerate(self.sampler.names):
            prompt = self.sampler.prompt(n)
            g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + k * 101 + i)
            idx = torch.from_numpy(prompt).view(1, -1).to(self.device)
            out = self.model.generate(idx, self.opts.audit_tokens, temperature, top_k, g)
            arms[n] = {"prompt": self.tokenizer.decode(prompt),
                       "text": self.tokenizer.decode(out[0, len(prompt):].tolist()),
                       "loss": probe[n], "temperature": temperature, "top_k": top_k}
        self.model.train()
        return {"type": "audit", "step": k, "arms": arms, "time": time.time()}

    # ------------------------------------------------------------------ boundary
    def _checkpoint_reasons(self, k: int, control: dict) -> tuple[list[str], bool]:
        reasons, stop = [], False
        if k % self.cfg.checkpoint_every == 0:
            reasons.append("cadence")
        if self.flags.usr1_count > self.usr1_served:  # several SIGUSR1 coalesce into one
            self.usr1_served = self.flags.usr1_count
            if self.usr1_target is None:
                every = self.cfg.checkpoint_every
                self.usr1_target = k if self.opts.usr1_at == "step" else -(-k // every) * every
                log.info("SIGUSR1 received: checkpoint at step %d", self.usr1_target)
        if self.usr1_target is not None and k >= self.usr1_target:
            reasons.append("sigusr1")
            self.usr1_target = None
        if control.get("checkpoint_at_step") is not None and k == control["checkpoint_at_step"]:
            reasons.append(control.get("reason") or "sigusr1")
        if control.get("stop_at_step") is not None and k >= control["stop_at_step"]:
            reasons.append(control.get("reason") or "pivot")
            stop = True
        if self.flags.stop_reason:
            reasons.append("sigterm")
            stop = True
        if k >= self.max_steps:
            reasons.append("final")
            stop = True
        if self.nonfinite_run >= self.opts.max_nonfinite:
            reasons.append("alarm")
            stop = True
        return reasons, stop

    def checkpoint(self, k: int, reasons: list[str]) -> None:
        reason = next(r for r in REASON_PRIORITY if r in reasons)
        if self.last_written == k:
            return  # already on disk (e.g. resumed here, or cadence + SIGUSR1 on one step)
        self.reports.write({"type": "checkpoint_started", "step": k, "reason": reason})
        held = self.ckpt.snapshot(k, self.model.flat, self.opt.m, self.opt.v, reason)
        self.last_written = k
        log.debug("checkpoint step %d: training held %.4f s", k, held)

    def _on_checkpoint_done(self, r: WriteResult) -> None:
        if r.error:
            self.reports.write({"type": "checkpoint", "step": r.step, "reason": r.reason,
                                "error": r.error, "time": time.time()})
            return
        log.info("checkpoint step %d (%s) %s %d bytes in %.2f s", r.step, r.reason,
                 Path(r.path).name, r.nbytes, r.seconds)
        self.reports.write({"type": "checkpoint", "step": r.step, "reason": r.reason,
                            "file": Path(r.path).name, "bytes": r.nbytes,
                            "seconds": r.seconds, "time": time.time()})

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        """Train until max_steps or a stop; returns the process exit code."""
        self.announce()
        lost = self.flags.verify()
        if lost:
            log.warning("signal handlers replaced by a library: %s; re-installing", ", ".join(lost))
            self.flags.install()
        code = EXIT_OK
        while True:
            k = self.step + 1
            reasons, stop = [], False
            if k > self.max_steps:
                stop = True
            elif self.flags.stop_reason:
                reasons, stop = ["sigterm"], True
            else:
                probs, control = self._policy_for(k)
                if probs is None:
                    reasons, stop = ["sigterm"], True
                else:
                    rec = self.train_step(k, probs)
                    self.step = k
                    self.reports.write(rec)
                    if k % self.cfg.sample_every == 0:
                        self.reports.write(self.sample_audit(k, rec.get("probe")))
                    reasons, stop = self._checkpoint_reasons(k, control)
            if reasons and self.step > 0:
                self.checkpoint(self.step, reasons)
            if stop:
                why = self.flags.stop_reason or ("non-finite loss" if "alarm" in reasons else
                                                 "max steps" if self.step >= self.max_steps else "control")
                r = self.ckpt.wait()
                if r is not None and r.error:
                    log.error("the last checkpoint failed: %s", r.error)
                    code = EXIT_FATAL
                if "alarm" in reasons:
                    code = EXIT_FATAL
                log.info("stopping at step %d (%s)", self.step, why)
                self.reports.write({"type": "event", "event": "stopped", "step": self.step,
                                    "why": why, "exit_code": code, "time": time.time()})
                return code
