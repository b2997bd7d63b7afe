"""Tokenized arm data in the run directory, and its index `data/arms.json` (SPEC section 7).

At run creation every arm's text is tokenized once into `data/<arm>.u16` (flat uint16, nanoGPT
style); `tokens` arms point at their own file instead. The last part of each arm's tokens is a
fixed held-out split that is never trained on: it feeds the bandit's probes and the sample audits.

Index entry per arm: name, kind, source, fingerprint (content, "sha256:..."), path, n_tokens,
heldout_start, source_fingerprint (cheap, "stat:...": file list, sizes, mtimes; checked at every
start), retired (null, or {"step", "reason"} while the proxy has the arm retired, as a zombie
or because a restart left it out: the worker then never loads it) and field (jsonl arms). The
top-level "changes" list is the proxy's arm-change log (proxy/arm_changes.py); arms added on a
restart are appended to "arms".
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from shared.arms import ArmSourceError, fingerprint_file, fingerprint_text, read_arm_text, \
    source_fingerprint
from shared.atomic_io import atomic_write_bytes, atomic_write_json
from shared.config import ArmSpec, RunConfig, check_arm_name
from shared.run_layout import RunLayout
from shared.tokenizer import RunTokenizer


@dataclass
class ArmData:
    """Where one arm's tokens are. Tokens [0, heldout_start) train; [heldout_start, n) held out."""

    name: str
    kind: str
    source: str
    fingerprint: str
    path: str           # absolute, or relative to the run directory
    n_tokens: int
    heldout_start: int
    source_fingerprint: str = ""      # "stat:<hex>" at creation ("" in runs made before it)
    retired: dict | None = None       # {"step", "reason"} while retired (zombie or removed)
    field: str = "text"               # the JSON Lines field (jsonl arms)

    def tokens(self, run_dir: Path) -> np.ndarray:
        """All tokens as a read-only uint16 memmap of length n_tokens."""
        p = Path(self.path)
        p = p if p.is_absolute() else Path(run_dir) / p
        return np.memmap(p, dtype=np.uint16, mode="r", shape=(self.n_tokens,))


def heldout_size(n_tokens: int, cfg: RunConfig) -> int:
    """Held-out tokens for an arm of `n_tokens`: 5 %, at least enough for the probe windows."""
    need = cfg.probe_sequences * (cfg.model.block_size + 1) + 1
    return max(n_tokens // 20, need)


def prepare_arm(arm: ArmSpec, tok: RunTokenizer, layout: RunLayout, cfg: RunConfig,
                text: str | None = None) -> ArmData:
    """Tokenize one arm into `data/<name>.u16` (written atomically, only after the checks pass,
    so a refused arm leaves nothing behind). Raises ArmSourceError when it is too small, or a
    token file holds ids outside the vocabulary; ConfigError for an unsafe name."""
    check_arm_name(arm.name)
    if arm.kind == "tokens":
        src = Path(arm.source).expanduser().resolve()
        if not src.is_file():
            raise ArmSourceError(f"arm {arm.name}: token file {src} not found")
        n = src.stat().st_size // 2
        ids = np.memmap(src, dtype=np.uint16, mode="r", shape=(n,))
        if n and int(ids.max()) >= tok.vocab_size:
            raise ArmSourceError(
                f"arm {arm.name}: {src} holds token id {int(ids.max())} but the run's vocabulary "
                f"has {tok.vocab_size}; tokenize it with the run's tokenizer.json")
        path, fp = str(src), fingerprint_file(src)
    else:
        text = read_arm_text(arm) if text is None else text
        ids = tok.encode(text).astype(np.uint16)
        n = len(ids)
        path, fp = str(Path("data") / f"{arm.name}.u16"), fingerprint_text(text)
    try:
        sfp = source_fingerprint(arm)
    except ArmSourceError:
        sfp = ""
    hold = heldout_size(n, cfg)
    if n - hold < cfg.model.block_size + 2:
        raise ArmSourceError(
            f"arm {arm.name}: {n:,} tokens is too small for context {cfg.model.block_size} "
            f"plus {hold:,} held-out tokens; give it more text")
    if arm.kind != "tokens":  # only once it is accepted, and whole (atomic_write_bytes)
        atomic_write_bytes(layout.root / path, ids.tobytes())
    return ArmData(arm.name, arm.kind, arm.source, fp, path, n, n - hold, sfp, field=arm.field)


def write_arm_index(layout: RunLayout, arms: list[ArmData]) -> None:
    atomic_write_json(layout.arms_index, {"arms": [asdict(a) for a in arms]})


def read_arm_index(layout: RunLayout, include_retired: bool = False) -> dict[str, ArmData]:
    """The run's arms by name; retired (zombie) arms only with `include_retired` (the worker
    never loads them, SPEC section 7). Raises ArmSourceError naming the file when missing or
    garbage."""
    try:
        d = json.loads(layout.arms_index.read_text())
        arms = {a["name"]: ArmData(**a) for a in d["arms"]}
        return arms if include_retired else {n: a for n, a in arms.items() if not a.retired}
    except FileNotFoundError:
        raise ArmSourceError(f"{layout.arms_index}: missing; the run directory is incomplete "
                             "(was creation interrupted? remove the directory and start again)") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ArmSourceError(f"{layout.arms_index}: unreadable ({e})") from e
