"""Run configuration: model presets, the parameter table, and the resolved run config.

This is the contract both sides read from `run.json` (docs/architecture.md#the-run-directory). It
is pure Python (no torch,
no numpy) so that the proxy can compute a model's exact parameter count and checkpoint size
without building the model, and reject a mismatched checkpoint before anything starts.

What it is not: the model itself (`worker/model.py`) or the CLI (`proxy/cli.py`).
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.atomic_io import read_json
from shared.checkpoint.file_format import INT32_MAX, expected_size
from shared.run.layout import missing_run_json

DEFAULT_BPE_VOCAB = 2305  # the published ANDREA-12M vocabulary (docs/architecture.md#the-worker)


class ConfigError(ValueError):
    """A configuration value was refused; the message names the value, the rule and the fix."""


@dataclass(frozen=True)
class ModelShape:
    """Architecture of a GPT: pre-norm, GELU MLP, learned positions, biases on, untied head.

    The output head has no bias (nanoGPT's `lm_head`); that is what makes `andrea-12m` exactly
    12,811,008 parameters with a 2305-token vocabulary (docs/architecture.md#the-worker).
    """

    n_layer: int  # transformer blocks
    n_head: int  # attention heads per block
    n_embd: int  # model width (channels)
    block_size: int  # context length in tokens

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "block_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model {name}={getattr(self, name)} must be >= 1")
        if self.n_embd % self.n_head:
            raise ConfigError(
                f"model n_embd={self.n_embd} is not divisible by n_head={self.n_head}: "
                "pick a width that is a multiple of the head count"
            )


# Published ANDREA shapes (docs/architecture.md#the-worker). `andrea-tiny` is the CPU demo (about a million
# parameters with the BPE vocabulary); `andrea-test` is for the test suite (tens of thousands).
PRESETS: dict[str, ModelShape] = {
    "andrea-test": ModelShape(n_layer=2, n_head=2, n_embd=32, block_size=32),
    "andrea-tiny": ModelShape(n_layer=3, n_head=4, n_embd=128, block_size=128),
    "andrea-12m": ModelShape(n_layer=6, n_head=12, n_embd=384, block_size=1024),
    "andrea-120m": ModelShape(n_layer=12, n_head=12, n_embd=768, block_size=1024),
}


def parameter_table(shape: ModelShape, vocab_size: int) -> list[tuple[str, tuple[int, ...], int]]:
    """The checkpoint's parameter order as (name, shape, offset in elements) rows.

    Order = the model's parameter iterator (docs/checkpoint-format.md): token embedding, position embedding,
    per layer (ln_1, attention c_attn/c_proj, ln_2, MLP c_fc/c_proj, each weight then bias), the
    final norm, then the output head. Linear weights are (out_features, in_features) as torch
    stores them. Offsets count float32 elements from the start of each array region.
    """
    d, V = shape.n_embd, vocab_size
    rows: list[tuple[str, tuple[int, ...]]] = [
        ("transformer.wte.weight", (V, d)),
        ("transformer.wpe.weight", (shape.block_size, d)),
    ]
    for i in range(shape.n_layer):
        p = f"transformer.h.{i}."
        rows += [
            (p + "ln_1.weight", (d,)),
            (p + "ln_1.bias", (d,)),
            (p + "attn.c_attn.weight", (3 * d, d)),
            (p + "attn.c_attn.bias", (3 * d,)),
            (p + "attn.c_proj.weight", (d, d)),
            (p + "attn.c_proj.bias", (d,)),
            (p + "ln_2.weight", (d,)),
            (p + "ln_2.bias", (d,)),
            (p + "mlp.c_fc.weight", (4 * d, d)),
            (p + "mlp.c_fc.bias", (4 * d,)),
            (p + "mlp.c_proj.weight", (d, 4 * d)),
            (p + "mlp.c_proj.bias", (d,)),
        ]
    rows += [
        ("transformer.ln_f.weight", (d,)),
        ("transformer.ln_f.bias", (d,)),
        ("lm_head.weight", (V, d)),
    ]
    table, offset = [], 0
    for name, shp in rows:
        table.append((name, shp, offset))
        offset += math.prod(shp)
    return table


def count_parameters(shape: ModelShape, vocab_size: int) -> int:
    """Exact number of float32 parameters of `shape` with `vocab_size` tokens."""
    name, shp, off = parameter_table(shape, vocab_size)[-1]
    return off + math.prod(shp)


ARM_NAME_RULE = (
    "1-64 characters from letters, digits, '_', '-' and '.', starting with a letter or digit"
)
_ARM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def check_arm_name(name: str, where: str = "arm") -> None:
    """Raise ConfigError unless `name` is a safe arm name: it names the file `data/<name>.u16`
    and keys every statistic, so no '/', no '..', nothing hidden."""
    if not isinstance(name, str) or not _ARM_NAME.fullmatch(name) or ".." in name:
        raise ConfigError(
            f"{where}: arm name {name!r} is not allowed; use {ARM_NAME_RULE} "
            "(the name becomes the file data/<name>.u16)"
        )


@dataclass(frozen=True)
class ArmSpec:
    """One data source (docs/data.md#sources). `kind` is one of:
    python-docstrings, python-code, python-docs (the embedded defaults, read from the running
    Python installation), text (a file, directory or glob of text files), jsonl (JSON Lines with
    a text `field`; .gz/.zst read transparently), parquet (a text column `field`), tokens
    (pre-tokenized uint16/uint32 files, nanoGPT style)."""

    name: str
    kind: str
    source: str = ""  # file, directory or glob for text/jsonl/parquet/tokens; "" for defaults
    field: str = "text"  # JSON Lines field / Parquet column holding the text
    dtype: str = ""  # tokens arms: "uint16" or "uint32"; "" = inferred from the vocabulary


DEFAULT_ARMS: tuple[ArmSpec, ...] = (
    ArmSpec("repo-docstrings", "python-docstrings"),
    ArmSpec("repo-code", "python-code"),
    ArmSpec("python-docs", "python-docs"),
)


@dataclass
class RunConfig:
    """Everything `run.json` holds, resolved at creation (docs/architecture.md#the-run-directory).

    Units: steps are optimizer updates; `batch_size` is sequences per update (global, across
    ranks); `lr` is the peak learning rate; `warmup_steps`/`lr_decay_steps` are steps.
    """

    preset: str = "andrea-tiny"
    model: ModelShape = field(default_factory=lambda: PRESETS["andrea-tiny"])
    tokenizer: str = "bpe"  # "bpe" (trained on the arms), "bytes" (256) or a tokenizer.json path
    bpe_sample_bytes: int = 8_000_000  # BPE training sample, characters over all text arms
    arm_max_tokens: int = 0  # explicit per-arm cap on tokens (0 = every token of every arm)
    vocab_size: int = DEFAULT_BPE_VOCAB
    seed: int = 1337
    batch_size: int = 16  # sequences per optimizer update, all ranks together
    micro_batch_size: int | None = None  # sequences per forward/backward per rank (None: the
    # rank's whole slice in one pass); a start may override it
    lr: float = 3e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # cosine floor, as a fraction of lr
    warmup_steps: int = 50  # linear warm-up, steps
    lr_decay_steps: int = 600  # end of the cosine, steps (the planned total at creation)
    max_steps: int = 600  # planned number of updates (the newest plan's, after a re-plan)
    schedule: str = "cosine"  # "cosine" or "wsd" (warmup-stable-decay), worker/optim.py
    decay_fraction: float = 0.2  # wsd: the share of the plan spent in the final linear decay
    replans: list = field(default_factory=list)  # [{"at", "lr_decay_steps", "decay_at"}], in order
    weight_decay: float = 0.1  # on matrices only
    grad_clip: float = 1.0  # global norm; 0 = off
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    dropout: float = 0.0
    checkpoint_every: int = 100  # cadence, steps
    sample_every: int = 100  # sample audit cadence, steps
    probe_every: int = 25  # held-out probe cadence = bandit policy period, steps
    probe_sequences: int = 8  # held-out sequences per arm per probe
    eval_every: int = 0  # validation cadence, steps (0: none; a new run gets default_eval_every)
    eval_sequences: int = 8  # held-out windows per arm per validation (the same ones each time)
    arms: list[ArmSpec] = field(default_factory=lambda: list(DEFAULT_ARMS))
    caps: dict[str, float] = field(default_factory=dict)
    floors: dict[str, float] = field(default_factory=dict)
    reward: str = "train_slope"  # train_slope (free, conservative) | heldout_progress (reads the probe) | train_loss
    bandit_warmup: int = 200  # steps on the prior before the first bandit update
    config_file: str | None = None  # the --config FILE.toml the run was created with
    sources: dict[str, str] = field(default_factory=dict)  # option -> file/command line/default
    # held-out probes' forward FLOPs / training FLOPs, at most (probe_plan); with the audits'
    # AUDIT_BUDGET, POLICY_BUDGET in all
    probe_budget: float = 0.015

    @property
    def n_params(self) -> int:
        return count_parameters(self.model, self.vocab_size)

    @property
    def decay_end(self) -> int:
        """The step the plan in force reaches the floor rate at: the newest re-plan's end, else
        `lr_decay_steps` (docs/configuration.md#the-schedule)."""
        return int(self.replans[-1]["lr_decay_steps"]) if self.replans else self.lr_decay_steps

    @property
    def checkpoint_bytes(self) -> int:
        return expected_size(self.n_params)

    def validate(self) -> None:
        """Refuse bad numbers before anything starts (docs/architecture.md#bad-input-and-faults). Raises ConfigError."""
        _positive(
            self,
            "batch_size",
            "checkpoint_every",
            "sample_every",
            "probe_every",
            "probe_sequences",
            "max_steps",
            "lr_decay_steps",
        )
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise _bad("lr", self.lr, "must be a positive finite number")
        if not 0 <= self.seed < 2**63:
            raise _bad("seed", self.seed, "must be in [0, 2**63) (numpy seeds are non-negative)")
        if self.warmup_steps < 0:
            raise _bad("warmup_steps", self.warmup_steps, "must be >= 0")
        if self.schedule not in SCHEDULES:
            raise _bad(
                "schedule", repr(self.schedule), f"is unknown: choose {', '.join(SCHEDULES)}"
            )
        if not (isinstance(self.decay_fraction, (int, float)) and 0 < self.decay_fraction <= 1):
            raise _bad("decay_fraction", self.decay_fraction, "must be in (0, 1]")
        last = 0
        for i, r in enumerate(self.replans):
            ok = (
                isinstance(r, dict)
                and isinstance(r.get("at"), int)
                and isinstance(r.get("lr_decay_steps"), int)
                and r["at"] >= last
                and r["lr_decay_steps"] > r["at"]
                and (r.get("decay_at") is None or isinstance(r.get("decay_at"), int))
            )
            if not ok:
                raise ConfigError(
                    f"replans[{i}]={r!r}: a re-plan is {{'at': step, 'lr_decay_steps': a "
                    "later step, 'decay_at': a step or null}, in step order; restore run.json"
                )
            last = r["at"]
        if self.eval_every < 0:
            raise _bad("eval_every", self.eval_every, "must be >= 0 (0 = no validation)")
        if self.eval_sequences < 1:
            raise _bad("eval_sequences", self.eval_sequences, "must be >= 1")
        if not (isinstance(self.probe_budget, (int, float)) and 0 < self.probe_budget <= 1):
            raise _bad("probe_budget", repr(self.probe_budget), "must be in (0, 1] (default 0.015)")
        if not isinstance(self.tokenizer, str) or not self.tokenizer:
            raise ConfigError(
                f"tokenizer={self.tokenizer!r}: choose 'bpe', 'bytes' or the path "
                "of an existing tokenizer.json"
            )
        if self.bpe_sample_bytes < 1 << 16:
            raise ConfigError(f"bpe_sample_bytes={self.bpe_sample_bytes:,} must be >= 65,536")
        if self.arm_max_tokens < 0:
            raise _bad("arm_max_tokens", self.arm_max_tokens, "must be >= 0 (0 = no cap)")
        if self.reward not in REWARDS:
            raise _bad("reward", repr(self.reward), f"is unknown: choose {', '.join(REWARDS)}")
        names = [a.name for a in self.arms]
        if len(set(names)) != len(names) or not names:
            raise ConfigError(f"arm names must be unique and non-empty, got {names}")
        for n in names:
            check_arm_name(n)
        if self.n_params > INT32_MAX:
            raise ConfigError(
                f"{self.preset}: {self.n_params:,} parameters exceed the checkpoint format's "
                f"int32 limit ({INT32_MAX:,}); use a smaller model"
            )
        accumulation_steps(self.batch_size, self.micro_batch_size)
        if self.max_steps > INT32_MAX:
            raise ConfigError(f"max_steps={self.max_steps:,} exceeds int32 ({INT32_MAX:,})")

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["n_params"] = self.n_params
        d["checkpoint_bytes"] = self.checkpoint_bytes
        return d

    @classmethod
    def from_json(cls, d: dict) -> "RunConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        d = {k: v for k, v in d.items() if k in known}  # to_json's n_params, checkpoint_bytes too
        _check_json_types(cls, d, "")
        _check_json_types(ModelShape, d["model"], "model.")
        for i, a in enumerate(d.get("arms", [])):
            _check_json_types(ArmSpec, a, f"arms[{i}].")
        d["model"] = ModelShape(**d["model"])
        d["arms"] = [ArmSpec(**a) for a in d.get("arms", [])]
        return cls(**d)


def _check_json_types(cls, d: Any, prefix: str) -> None:
    """Raise TypeError naming the key and value when a JSON value does not have the type of
    dataclass `cls`'s field (int, float, str, bool, their `| None`; other fields unchecked)."""
    if not isinstance(d, dict):
        raise TypeError(f"{prefix.rstrip('.') or 'the file'} is {type(d).__name__}, not an object")
    hints = typing.get_type_hints(cls)
    simple = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
    for k, v in d.items():
        hint = hints.get(k)
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        args = typing.get_args(hint) if union else ()
        optional = type(None) in args
        rest = [a for a in args if a is not type(None)]
        base = (rest[0] if len(rest) == 1 else None) if union else hint
        if base not in simple or (optional and v is None):
            continue
        if base is bool:
            ok = isinstance(v, bool)
        else:  # an int is a number; a bool is neither
            ok = isinstance(v, (int, float) if base is float else base) and not isinstance(v, bool)
        if not ok:
            raise TypeError(
                f"key {prefix}{k} = {v!r} must be {simple[base]}" + (" or null" if optional else "")
            )


def accumulation_steps(batch_size: int, micro_batch_size: int | None, world_size: int = 1) -> int:
    """Micro-batches per optimizer update on each rank: (batch_size / world_size) /
    micro_batch_size; `micro_batch_size` None means the rank's whole slice in one pass (1).

    `batch_size` is sequences per update over all ranks, `micro_batch_size` sequences per
    forward/backward on one rank (docs/configuration.md#batch-and-accumulation). Raises
    ConfigError naming the numbers and a fix when the world size does not divide the batch,
    the micro-batch is < 1 or larger than a rank's slice, or does not divide the slice."""
    if world_size < 1 or batch_size < 1:
        raise ConfigError(f"batch_size={batch_size} and world size {world_size} must be >= 1")
    if batch_size % world_size:
        raise ConfigError(
            f"batch_size={batch_size} is not divisible by the world size "
            f"{world_size} (--nproc-per-node x --nnodes): each rank takes an equal "
            "slice of the global batch; choose a world size that divides it"
        )
    per_rank = batch_size // world_size
    if micro_batch_size is None:
        return 1
    if micro_batch_size < 1:
        raise ConfigError(
            f"--micro-batch-size {micro_batch_size}: must be >= 1 (sequences per "
            "forward/backward on one rank)"
        )
    if micro_batch_size > per_rank:
        raise ConfigError(
            f"--micro-batch-size {micro_batch_size} is larger than a rank's share "
            f"of the batch ({batch_size} sequences / {world_size} rank(s) = "
            f"{per_rank}); use --micro-batch-size {per_rank} or less, or a larger "
            "--batch-size"
        )
    if per_rank % micro_batch_size:
        fits = [d for d in range(per_rank, 0, -1) if per_rank % d == 0 and d <= micro_batch_size]
        raise ConfigError(
            f"--micro-batch-size {micro_batch_size} does not divide a rank's share "
            f"of the batch ({batch_size} / {world_size} = {per_rank} sequences): "
            f"use --micro-batch-size {fits[0]}, or a --batch-size that is a "
            f"multiple of {micro_batch_size * world_size}"
        )
    return per_rank // micro_batch_size


@dataclass(frozen=True)
class ProbePlan:
    """How the held-out probe runs (docs/bandit.md#probe-cost): `sequences` windows per arm,
    every `every` steps (a multiple of probe_every), and `cost` = its forward FLOPs as a
    fraction of the training FLOPs of the same steps. `active` False: the reward reads no
    probe (the default train_slope), so the worker runs none and `cost` is 0; `sequences` is
    then what a sample audit measures its per-arm loss on."""

    sequences: int
    every: int
    cost: float
    active: bool = True


def probe_plan(cfg: RunConfig, n_arms: int | None = None) -> ProbePlan:
    """The probe's size from the config alone (so a replay sees the same probes): a probe of
    S windows x K arms x block tokens (forward, 1/3 of a training token's FLOPs) every m*P steps
    costs K*S / (3*m*P*B) of the training compute of those steps (B = batch_size, P =
    probe_every). S = min(probe_sequences, floor(probe_budget * 3*P*B / K)), at least 1; m = 1,
    or the smallest multiple of P that brings one window per arm within the budget.
    `n_arms` defaults to len(cfg.arms). docs/bandit.md#probe-cost."""
    _positive(cfg, "batch_size", "probe_every")
    k = max(1, len(cfg.arms) if n_arms is None else int(n_arms))
    per_period = cfg.probe_budget * 3 * cfg.probe_every * cfg.batch_size
    s = max(1, min(cfg.probe_sequences, math.floor(per_period / k + 1e-9)))
    m = max(1, math.ceil(k * s / per_period - 1e-9))
    active = cfg.reward in PROBE_REWARDS
    return ProbePlan(
        s,
        m * cfg.probe_every,
        k * s / (3.0 * m * cfg.probe_every * cfg.batch_size) if active else 0.0,
        active,
    )


SCHEDULES = ("cosine", "wsd")  # learning-rate schedules, worker/optim.py learning_rate
REWARDS = ("train_slope", "heldout_progress", "train_loss")  # proxy/mixture/bandit.py REWARDS
PROBE_REWARDS = ("heldout_progress",)  # rewards that read the held-out probe (the others run none)
AUDIT_TOKENS = 48  # tokens generated per arm by a sample audit
SAMPLE_TEMPERATURE = 0.8  # softmax temperature of audits, `sample` and the HF generation config
SAMPLE_TOP_K = 40  # top-k of the same (0 or None: all tokens)
AUDIT_BUDGET = 0.005  # default sample_every keeps the audits within this share of training
EVAL_BUDGET = 0.01  # the default eval_every keeps validation within this share of training
POLICY_BUDGET = 0.02  # probe (probe_budget 0.015) + audits (AUDIT_BUDGET), by default at most
AUDIT_PROMPT_TOKENS = 16  # the audit prompt per arm: the first tokens of its held-out split


# settings whose command-line flag is the field's name in kebab case (proxy/commands/run_args.py)
_FLAGGED = frozenset(
    {
        "batch_size",
        "checkpoint_every",
        "sample_every",
        "eval_every",
        "schedule",
        "decay_fraction",
        "probe_every",
        "max_steps",
        "lr",
        "seed",
        "warmup_steps",
        "tokenizer",
        "arm_max_tokens",
        "reward",
    }
)


def _bad(name: str, value: object, rule: str) -> ConfigError:
    """'batch_size=0 (--batch-size) must be >= 1': the setting as a config file and the
    command line spell it, its value, and the rule it breaks."""
    flag = f" (--{name.replace('_', '-')})" if name in _FLAGGED else ""
    return ConfigError(f"{name}={value}{flag} {rule}")


def _positive(cfg: RunConfig, *names: str) -> None:
    """ConfigError naming the first of `names` that is not >= 1 (before any division by it)."""
    for name in names:
        if getattr(cfg, name) < 1:
            raise _bad(name, getattr(cfg, name), "must be >= 1")


def audit_cost(cfg: RunConfig) -> float:
    """The sample audits' compute as a fraction of the training FLOPs of the steps between two
    audits (docs/bandit.md#probe-cost), an upper bound: K arms generate AUDIT_TOKENS each as one
    batch, each new token a forward over its context (the prompt and the tokens so far, at most
    block_size), 1/3 of a training token's FLOPs per context token, every sample_every steps:
    K * sum(context) / (3 * B * block * sample_every), K = len(cfg.arms)."""
    _positive(cfg, "batch_size", "sample_every")
    k = max(1, len(cfg.arms))
    t = cfg.model.block_size
    ctx = sum(min(AUDIT_PROMPT_TOKENS + j, t) for j in range(AUDIT_TOKENS))
    return k * ctx / (3.0 * cfg.batch_size * t * cfg.sample_every)


def eval_cost(cfg: RunConfig, n_arms: int | None = None) -> float:
    """Validation's compute as a fraction of training FLOPs: K arms x eval_sequences windows
    forward (1/3 of a training token's FLOPs) every eval_every steps of batch_size windows:
    K * S / (3 * B * eval_every); 0.0 when eval_every is 0. `n_arms` defaults to
    len(cfg.arms)."""
    if cfg.eval_every <= 0:
        return 0.0
    k = max(1, len(cfg.arms) if n_arms is None else int(n_arms))
    return k * cfg.eval_sequences / (3.0 * cfg.batch_size * cfg.eval_every)


def default_eval_every(cfg: RunConfig, n_arms: int | None = None) -> int:
    """The validation cadence of a new run: the smallest multiple of 10 steps whose cost
    (`eval_cost`) is at most EVAL_BUDGET (1 %) of training."""
    _positive(cfg, "batch_size")
    k = max(1, len(cfg.arms) if n_arms is None else int(n_arms))
    need = k * cfg.eval_sequences / (3.0 * cfg.batch_size * EVAL_BUDGET)
    return 10 * max(1, math.ceil(need / 10 - 1e-9))


def default_sample_every(cfg: RunConfig) -> int:
    """The sample audit cadence when none is given: the checkpoint cadence, or the smallest
    multiple of it that keeps `audit_cost` within AUDIT_BUDGET (0.5 %; docs/bandit.md#probe-cost).
    On a small model at a small batch an audit costs many training steps (andrea-test at batch 8:
    about 5), so auditing at every checkpoint would be a large share of the run."""
    _positive(cfg, "batch_size", "checkpoint_every")
    one = audit_cost(dataclasses.replace(cfg, sample_every=1))
    return cfg.checkpoint_every * max(
        1, math.ceil(one / (AUDIT_BUDGET * cfg.checkpoint_every) - 1e-9)
    )


def policy_cost(cfg: RunConfig) -> float:
    """The mixture policy's own compute, probe plus sample audits, as a fraction of training
    FLOPs (docs/bandit.md#probe-cost): probe_plan(cfg).cost + audit_cost(cfg). With the default
    probe_budget and sample cadence it is at most POLICY_BUDGET (2 %) at every preset and batch."""
    return probe_plan(cfg).cost + audit_cost(cfg)


def load_run_config(path: Path) -> RunConfig:
    """Read `run.json`. Raises ConfigError naming the file when it is missing or unreadable."""
    try:
        return RunConfig.from_json(read_json(path, expect=dict, missing_ok=False))
    except FileNotFoundError:
        raise ConfigError(missing_run_json(Path(path).parent)) from None
    except (ValueError, TypeError, KeyError) as e:
        raise ConfigError(
            f"{path}: unreadable run config ({getattr(e, 'reason', e)}); fix that, restore it from a backup "
            "or start a new run directory"
        ) from e


class ArmSourceError(ConfigError):
    """An arm's source is missing or unreadable; the message names the arm and the path."""
