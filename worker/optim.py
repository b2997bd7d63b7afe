"""AdamW over the flat parameter buffer (docs/architecture.md#the-worker); the learning rate it is
given comes from shared/lr_schedule.py.

AdamW, betas (0.9, 0.999), weight decay on matrices only (nanoGPT's configure_optimizers), its
exp_avg (m) and exp_avg_sq (v) pre-created as views into two flat float32 buffers in checkpoint
order, so a checkpoint copies three contiguous arrays. AdamW's per-parameter step (bias
correction) is the checkpoint's header step: nothing else is stored.

The fused path (CUDA and CPU) calls torch's fused AdamW kernel, `torch._fused_adamw_`, itself,
exactly as `torch.optim.AdamW(fused=True).step()` does (the step tensors incremented with
`torch._foreach_add_`, then one kernel call per parameter group): the same bits, without
constructing `torch.optim.AdamW`, whose methods import `torch._dynamo` on first use (seconds of
a worker's start, docs/operations.md#benchmarks). The foreach path (other devices) uses
`torch.optim.AdamW` itself.
"""

from __future__ import annotations

import torch

from shared.run.config import RunConfig
from worker.model import GPT, is_view_at


class _FusedAdamW:
    """The part of `torch.optim.AdamW(fused=True)` FlatAdamW uses, over the same state layout:
    `state` (parameter -> {"step": float32 scalar, "exp_avg", "exp_avg_sq"}), `param_groups`
    (dicts with "params", "lr", "betas", "eps", "weight_decay", "fused") and `step()`.
    Parameters without a gradient are skipped, as torch does."""

    def __init__(
        self, groups: list[dict], lr: float, betas: tuple[float, float], eps: float
    ) -> None:
        self.state: dict[torch.Tensor, dict] = {}
        self.param_groups = [
            {
                "lr": lr,
                "betas": betas,
                "eps": eps,
                "amsgrad": False,
                "maximize": False,
                "foreach": None,
                "fused": True,
                **g,
            }
            for g in groups
        ]

    @torch.no_grad()
    def step(self, found_inf: torch.Tensor | None = None) -> None:
        """One AdamW update of every parameter with a gradient; `found_inf` (float32 scalar on
        the parameters' device): 1.0 leaves parameters, exp_avg and exp_avg_sq untouched (the
        kernel reads it on the device; the step counters still advance, FlatAdamW.skip_step)."""
        for g in self.param_groups:
            params = [p for p in g["params"] if p.grad is not None]
            if not params:
                continue
            st = [self.state[p] for p in params]
            steps = [s["step"] for s in st]
            torch._foreach_add_(steps, 1)
            torch._fused_adamw_(
                params,
                [p.grad for p in params],
                [s["exp_avg"] for s in st],
                [s["exp_avg_sq"] for s in st],
                [],
                steps,
                amsgrad=False,
                lr=g["lr"],
                beta1=g["betas"][0],
                beta2=g["betas"][1],
                weight_decay=g["weight_decay"],
                eps=g["eps"],
                maximize=False,
                grad_scale=None,
                found_inf=found_inf,
            )


class FlatAdamW:
    """AdamW whose m and v are the flat buffers `m` and `v` (float32, (n_params,)).

    `set_step(S)` sets every parameter's AdamW step to S (the resumed checkpoint's header step).
    `fused=True` (worker.precision.use_fused_adamw) calls torch's fused kernel directly (the module
    docstring), its step tensors on the parameters' device; else torch.optim.AdamW with foreach,
    steps on the host (`step_device`). Both work on CPU (tests/test_optim_fused.py).
    """

    def __init__(self, model: GPT, cfg: RunConfig, fused: bool | None = None) -> None:
        self.model = model
        flat = model.flat
        self.m = torch.zeros_like(flat)
        self.v = torch.zeros_like(flat)
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        self.opt: _FusedAdamW | torch.optim.AdamW
        if fused:
            self.opt = _FusedAdamW(groups, cfg.lr, (cfg.beta1, cfg.beta2), cfg.eps)
        else:
            self.opt = torch.optim.AdamW(
                groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=True
            )
        self.fused = bool(fused)
        if self.fused and flat.device.type not in ("cuda", "cpu"):
            # torch checks this only when it creates the state, which the loop below does
            raise RuntimeError(f"fused AdamW is not available on {flat.device.type}")
        # fused kernels read `step` on the parameters' device; foreach keeps it on the host
        self.step_device = flat.device if self.fused else torch.device("cpu")
        for p, (_, _, off) in zip(model.parameters(), model.table):
            self.opt.state[p] = {
                "step": torch.tensor(0.0, dtype=torch.float32, device=self.step_device),
                "exp_avg": self.m[off : off + p.numel()].view_as(p),
                "exp_avg_sq": self.v[off : off + p.numel()].view_as(p),
            }

    def set_step(self, step: int) -> None:
        for st in self.opt.state.values():
            st["step"].fill_(float(step))

    def step(self, lr: float, found_inf: torch.Tensor | None = None) -> None:
        """The update at learning rate `lr`. `found_inf`: a float32 scalar tensor, 1.0 when the
        update's loss or gradient is not finite; then nothing changes but the AdamW step, as in
        `skip_step` (docs/architecture.md#bad-input-and-faults). The fused kernel decides on the
        device, so the host never waits for the value; the foreach path reads it first."""
        for g in self.opt.param_groups:
            g["lr"] = lr
        if isinstance(self.opt, _FusedAdamW):
            self.opt.step(found_inf)
        elif found_inf is not None and bool(found_inf):
            self.skip_step()
        else:
            self.opt.step()

    def skip_step(self) -> None:
        """Do not apply this update (non-finite loss or gradient, docs/architecture.md#bad-input-and-faults):
        drop the gradients and advance every parameter's AdamW step by one anyway, so AdamW's
        step stays equal to the header step (bias correction) and a resume matches."""
        self.zero_grad()
        for st in self.opt.state.values():
            st["step"] += 1

    def check_views(self) -> None:
        """Raise RuntimeError if AdamW replaced or moved its state: every parameter's exp_avg /
        exp_avg_sq must be the view of `m` / `v` at its checkpoint offset (else checkpoints
        would save stale moments), and its `step` a float32 scalar on `step_device` (the fused
        kernel reads it there). Cheap: a loop over the parameters, no data read."""
        for p, (name, _, off) in zip(self.model.parameters(), self.model.table):
            st = self.opt.state[p]
            for key, flat, buf in (("exp_avg", "m", self.m), ("exp_avg_sq", "v", self.v)):
                t = st[key]
                if not is_view_at(t, buf, off) or t.shape != p.shape:
                    raise RuntimeError(
                        f"AdamW replaced {key} of {name}; the flat {flat} buffer is stale"
                    )
            s = st["step"]
            if s.device != self.step_device or s.dtype != torch.float32 or s.dim() != 0:
                raise RuntimeError(
                    f"AdamW step of {name} is {s.dtype} on {s.device}, expected a "
                    f"float32 scalar on {self.step_device}"
                )

    def steps(self) -> set[float]:
        """The distinct AdamW step values over the parameters (one value when in sync)."""
        return {float(st["step"]) for st in self.opt.state.values()}

    def zero_grad(self) -> None:
        self.model.zero_grad()  # every parameter's .grad = None (set_to_none, the default)
