"""AdamW over the flat parameter buffer, and the learning-rate schedule (SPEC section 5).

`torch.optim.AdamW`, betas (0.9, 0.999), weight decay on matrices only (nanoGPT's
configure_optimizers), its exp_avg (m) and exp_avg_sq (v) pre-created as views into two flat
float32 buffers in checkpoint order, so a checkpoint copies three contiguous arrays. AdamW's
per-parameter step (bias correction) is the checkpoint's header step: nothing else is stored.
"""
from __future__ import annotations

import math

import torch

from shared.config import RunConfig
from worker.model import GPT


def learning_rate(step: int, cfg: RunConfig) -> float:
    """Learning rate of update `step` (1-based): linear warm-up over `warmup_steps`, cosine
    decay to `lr * min_lr_ratio` at `lr_decay_steps`, flat after. A pure function of the step,
    so a resumed run uses exactly the uninterrupted run's rates (SPEC section 5)."""
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return peak * step / cfg.warmup_steps
    if step >= cfg.lr_decay_steps:
        return floor
    span = max(1, cfg.lr_decay_steps - cfg.warmup_steps)
    ratio = (step - cfg.warmup_steps) / span
    return floor + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (peak - floor)


class FlatAdamW:
    """AdamW whose m and v are the flat buffers `m` and `v` (float32, (n_params,)).

    `set_step(S)` sets every parameter's AdamW step to S (the resumed checkpoint's header step).
    `fused=True` (the trainer passes it on CUDA) uses torch's fused AdamW; otherwise foreach.
    """

    def __init__(self, model: GPT, cfg: RunConfig, fused: bool | None = None) -> None:
        self.model = model
        flat = model.flat
        self.m = torch.zeros_like(flat)
        self.v = torch.zeros_like(flat)
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        # fused kernels on CUDA (one launch for all parameters); foreach on CPU (issue 6)
        kw = {"fused": True} if fused else {"foreach": True}
        self.opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                     eps=cfg.eps, **kw)
        self._fused = bool(fused)
        self._bind_state(0)

    def _bind_state(self, step: int) -> None:
        off = 0
        for (name, p), (_, _, table_off) in zip(self.model.named_parameters(), self.model.table):
            n = p.numel()
            self.opt.state[p] = {
                "step": torch.tensor(float(step), dtype=torch.float32,
                                     device=p.device if self._fused else "cpu"),
                "exp_avg": self.m[table_off:table_off + n].view_as(p),
                "exp_avg_sq": self.v[table_off:table_off + n].view_as(p),
            }
            off += n

    def set_step(self, step: int) -> None:
        for st in self.opt.state.values():
            st["step"].fill_(float(step))

    def step(self, lr: float) -> None:
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()

    def check_views(self) -> None:
        """Raise RuntimeError if AdamW replaced its state tensors (they would leave the flat
        buffers and checkpoints would save stale m/v)."""
        for p in self.model.parameters():
            st = self.opt.state[p]
            if st["exp_avg"].untyped_storage().data_ptr() != self.m.untyped_storage().data_ptr():
                raise RuntimeError("AdamW replaced exp_avg; flat m buffer is stale")

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)
