"""Tokenized arm data in the run directory, and its index `data/arms.json` (docs/architecture.md#arms,
docs/data.md).

What it is: `prepare_arm`, which makes an arm's token file and its completion record
(`data/<arm>.done.json`, docs/data.md#crash-safe-creation), the fixed held-out split
(`heldout_ranges`: never trained on; it feeds the bandit's probes and the sample audits) and the
index.

An index entry per arm holds the fields of `ArmData`; the top-level "changes" list is the proxy's
arm-change log (proxy/mixture/arm_changes.py); arms added on a restart are appended to "arms".
This module is the file's only reader and writer: the change log is kept by editing the content
`read_arm_index_doc` returns and storing it with `write_arm_index_doc`.

What it is not: the tokenization itself (`shared/data/tokenization.py`) or the readers of the
sources (`shared/data/sources.py`).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from shared.atomic_io import atomic_write_json, fsync_dir, read_json
from shared.data.arms import (
    EMBEDDED_KINDS,
    ArmSourceError,
    content_fingerprint,
    source_fingerprint,
)
from shared.data.embedded import MAX_ARM_BYTES
from shared.data.redundancy import REPETITIVE_RATIO, compression_ratio
from shared.data.tokenization import (
    check_token_files,
    concat_token_files,
    progress_path,
    tokenize_stream,
)
from shared.data.tokenizer import RunTokenizer
from shared.progress import megabytes
from shared.run.config import ArmSpec, RunConfig, check_arm_name
from shared.run.layout import RunLayout
from shared.run.stop_request import StopRequested

# what to do about a token file that changed under a run (ArmData.tokens, worker/data.py)
TOKEN_FILE_REMEDY = (
    "restore it from a backup, or retire the arm: restart with --arm options "
    "that leave it out (docs/operations.md#changing-the-arms)"
)


@dataclass
class ArmData:
    """Where one arm's tokens are. Tokens [0, heldout_start) train; [heldout_start, n) held out."""

    name: str
    kind: str
    source: str
    fingerprint: str  # of the content, "sha256:..."
    path: str  # absolute, or relative to the run directory
    n_tokens: int
    heldout_start: int
    source_fingerprint: str = ""  # "stat:<hex>" of file list, sizes, mtimes; checked every start
    retired: dict | None = None  # {"step", "reason"} while retired: the worker never loads it
    field: str = "text"  # the JSON Lines field / Parquet column
    dtype: str = "uint16"  # of the token file: "uint16" or "uint32"
    heldout: list | None = None  # held-out ranges [[a, b), ...]; None: [heldout_start, n)
    documents: int = 0  # documents read (0 for tokens arms and older runs)
    empty_documents: int = 0  # documents with no text, skipped (empty file, record, row)
    source_bytes: int = 0  # source bytes used of the source's total
    bad_records: int = 0  # records skipped (invalid JSON, missing field, ...)
    first_bad: str = ""  # "file:line: reason" of the first
    compression: float = 0.0  # zstd ratio of its tokens (shared/data/redundancy.py); 0: not
    # measured (older runs)

    def token_path(self, run_dir: Path) -> Path:
        """The token file: `path`, relative to the run directory unless absolute."""
        p = Path(self.path)
        return p if p.is_absolute() else Path(run_dir) / p

    def tokens(self, run_dir: Path) -> np.ndarray:
        """All tokens as a read-only memmap (`dtype`) of length n_tokens.

        Raises ArmSourceError naming the file when it is missing or its size is not n_tokens x
        the width of `dtype` (changed after creation: truncated, appended to, replaced); a file
        that was cut short would otherwise fail deep inside numpy with no name. A token file
        used in place (a `tokens` arm of one file, absolute `path`) may be longer: with
        --arm-max-tokens only its first n_tokens are the arm's."""
        p = self.token_path(run_dir)
        want = self.n_tokens * np.dtype(self.dtype).itemsize
        try:
            have = p.stat().st_size
        except OSError as e:
            raise ArmSourceError(
                f"arm {self.name!r}: token file {p} cannot be read ({e}); {TOKEN_FILE_REMEDY}"
            ) from None
        in_place = Path(self.path).is_absolute()  # a single tokens file used where it lies,
        if have < want or (have != want and not in_place):  # maybe capped: only its head is ours
            raise ArmSourceError(
                f"arm {self.name!r}: token file {p} has {have:,} bytes, but data/arms.json "
                f"records {self.n_tokens:,} {self.dtype} tokens ({want:,} bytes): it was changed "
                f"after the run was created; {TOKEN_FILE_REMEDY}"
            )
        return np.memmap(p, dtype=np.dtype(self.dtype), mode="r", shape=(self.n_tokens,))

    def heldout_ranges(self) -> list[tuple[int, int]]:
        """The held-out token ranges, sorted and disjoint (docs/data.md#the-held-out-split)."""
        if self.heldout is None:
            return [(self.heldout_start, self.n_tokens)]
        return [(int(a), int(b)) for a, b in self.heldout]


def heldout_size(n_tokens: int, cfg: RunConfig) -> int:
    """Held-out tokens for an arm of `n_tokens`: 5 %, at least enough for the probe windows."""
    need = cfg.probe_sequences * (cfg.model.block_size + 1) + 1
    return max(n_tokens // 20, need)


def heldout_ranges(n_tokens: int, cfg: RunConfig) -> list[tuple[int, int]]:
    """The held-out ranges of an arm of `n_tokens` (docs/data.md#the-held-out-split): heldout_size
    tokens in k equal ranges, range j ending at n*(j+1)/k, so they are spread over the whole arm
    and the last ends at the arm's end. k = min(probe_sequences, ranges that each hold a probe
    window, train gaps of at least 4 windows), at least 1; k = 1 is the tail split of older
    runs. A pure function of (n_tokens, block_size, probe_sequences): it never changes for a
    run."""
    hold = heldout_size(n_tokens, cfg)
    win = cfg.model.block_size + 2
    k = max(1, min(cfg.probe_sequences, hold // win, (n_tokens - hold) // (4 * win)))
    out = []
    for j in range(k):
        c = hold * (j + 1) // k - hold * j // k
        end = n_tokens * (j + 1) // k
        out.append((end - c, end))
    return out


_log = logging.getLogger("andrea.data")


def _tokenizer_sha(layout: RunLayout) -> str:
    try:
        return "sha256:" + hashlib.sha256(layout.tokenizer.read_bytes()).hexdigest()
    except FileNotFoundError:
        return ""


def done_marker(layout: RunLayout, name: str) -> Path:
    """`data/<arm>.done.json`: the arm's token file is whole and was made with the stored key."""
    return layout.data / f"{name}.done.json"


def _key(arm: ArmSpec, sfp: str, layout: RunLayout, cfg: RunConfig) -> dict:
    return {
        "spec": asdict(arm),
        "source_fingerprint": sfp,
        "tokenizer": _tokenizer_sha(layout),
        "arm_max_tokens": cfg.arm_max_tokens,
        "block_size": cfg.model.block_size,
        "probe_sequences": cfg.probe_sequences,
    }


def _completed(arm: ArmSpec, key: dict, layout: RunLayout) -> ArmData | None:
    try:
        d = read_json(done_marker(layout, arm.name), expect=dict, missing_ok=False)
        a = ArmData(**d["arm"])
        whole = a.token_path(layout.root).stat().st_size >= a.n_tokens * np.dtype(a.dtype).itemsize
        return a if d.get("key") == key and whole else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def prepare_arm(
    arm: ArmSpec,
    tok: RunTokenizer,
    layout: RunLayout,
    cfg: RunConfig,
    after_batch: Callable[[], None] | None = None,
) -> ArmData:
    """Tokenize one arm whole into `data/<name>.u16` (`.u32` above 65,536 tokens), streamed
    (shared/data/tokenization.py), or check a `tokens` arm's file(s); record completion in
    `data/<name>.done.json`. An arm already complete with the same key is kept as it is (not
    redone). The token file appears under its final name only whole and accepted, so a refused
    or interrupted arm leaves nothing training could read. `after_batch` goes to
    `tokenize_stream`.

    Logs what was used of how much (documents, source bytes, tokens, bad records). Raises
    ArmSourceError (a ConfigError) naming the arm, the file and the fix: a missing or corrupt
    source, an arm too small for the context, a token file with ids outside the vocabulary or a
    size that is not a whole number of tokens; ConfigError for an unsafe name."""
    check_arm_name(arm.name)
    sfp = source_fingerprint(arm)  # a missing source fails here, before any work
    key = _key(arm, sfp, layout, cfg)
    done = _completed(arm, key, layout)
    if done is not None:
        _log.info(
            "arm %s: already complete (%s, fingerprint %s), kept",
            arm.name,
            f"{done.n_tokens:,} tokens",
            done.fingerprint[:19],
        )
        return done
    layout.data.mkdir(parents=True, exist_ok=True)
    cap = cfg.arm_max_tokens
    docs = used = bad = empty = text_bytes = 0
    first_bad, total, capped = "", 0, False
    if arm.kind == "tokens":
        files, dt, n_all = check_token_files(arm, tok)
        total = sum(f.stat().st_size for f in files)
        n = min(n_all, cap) if cap else n_all
        capped = n < n_all
        used = n * dt.itemsize
        fp = content_fingerprint(arm)
    else:
        dt = np.dtype(tok.dtype)
    tmp = final = None
    if arm.kind == "tokens" and len(files) == 1:  # used where it lies
        path = str(files[0])
    else:
        path = str(Path("data") / f"{arm.name}{'.u32' if dt == np.uint32 else '.u16'}")
        final = layout.root / path
        tmp = final.with_name(final.name + ".tmp")
    try:
        if arm.kind == "tokens":
            if tmp is not None:
                n = concat_token_files(files, dt, tmp, n)
        else:
            assert tmp is not None  # set above for every arm that is tokenized
            fp, st = tokenize_stream(arm, tok, tmp, cap, key=key, after_batch=after_batch)
            n, docs, used, total = st.tokens, st.documents, st.bytes_used, st.bytes_total
            capped, empty, text_bytes = st.capped, st.empty, st.text_bytes
            bad, first_bad = st.bad.count, st.bad.first
            if arm.kind in EMBEDDED_KINDS:
                used = st.chars
            if bad or st.bad.replaced:
                _log.warning("arm %s: %s", arm.name, st.bad.summary())
        hold = heldout_size(n, cfg)
        if n - hold < cfg.model.block_size + 2:
            if capped:
                fix = f"raise --arm-max-tokens (now {cap:,}), or leave it out to use the whole arm"
            elif arm.kind != "tokens" and bad and not docs:
                fix = f"every record was skipped ({st.bad.summary()})" + (
                    f"; {st.bad.hint}" if st.bad.hint else ""
                )
            else:
                fix = "give it more text"
            raise ArmSourceError(
                f"arm {arm.name}: {n:,} tokens is too small for context {cfg.model.block_size} "
                f"plus {hold:,} held-out tokens; {fix}"
            )
        if tmp is not None and final is not None:  # set together
            os.replace(tmp, final)  # whole and fsynced: renamed atomically, durably
            fsync_dir(final.parent)
            progress_path(tmp).unlink(missing_ok=True)
    except (StopRequested, KeyboardInterrupt):
        raise  # the partial token file and its progress record are what the next attempt resumes
    except BaseException:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
            progress_path(tmp).unlink(missing_ok=True)
        raise
    ranges = heldout_ranges(n, cfg)
    a = ArmData(
        arm.name,
        arm.kind,
        arm.source,
        fp,
        path,
        n,
        ranges[0][0],
        sfp,
        field=arm.field,
        dtype=dt.name,
        heldout=[list(r) for r in ranges],
        documents=docs,
        source_bytes=used,
        bad_records=bad,
        first_bad=first_bad,
        empty_documents=empty,
    )
    a.compression = compression_ratio(a.tokens(layout.root))
    atomic_write_json(done_marker(layout, arm.name), {"key": key, "arm": asdict(a)})
    if arm.kind in EMBEDDED_KINDS:
        of = (
            f"used {used:,} characters (default arms stop at {MAX_ARM_BYTES:,}) from "
            f"{megabytes(total)} of source files"
        )
    elif arm.kind == "tokens":
        of = f"used {used:,} of {total:,} bytes of {len(files)} token file(s)"
    else:
        # the source's bytes on disk (compressed for .gz/.zst, Parquet's encoded pages) are
        # not its text: the decoded text's size is said beside them
        of = (
            f"{docs:,} documents, used {used:,} of {total:,} source bytes on disk, "
            f"{text_bytes:,} bytes of decoded text"
        )
        if empty:
            of += f" ({empty:,} empty document{'s' if empty != 1 else ''} skipped)"
    if capped:
        of += f" (capped by --arm-max-tokens {cap:,})"
    _log.info(
        "arm %s (%s): %s, %s tokens (%s), %s held out in %d ranges; %s; compresses %.1fx%s",
        arm.name,
        arm.kind,
        of,
        f"{n:,}",
        dt.name,
        f"{sum(b - a for a, b in ranges):,}",
        len(ranges),
        f"{bad:,} bad records (first {first_bad})" if bad else "no bad records",
        a.compression,
        f" (>= {REPETITIVE_RATIO:g}x: repetitive, the bandit will not raise its "
        f"share after the warm-up)"
        if a.compression >= REPETITIVE_RATIO
        else "",
    )
    return a


def arm_compression(layout: RunLayout, arm: ArmData) -> float:
    """The arm's compression ratio (shared/data/redundancy.py): the one recorded at creation, or
    for a run made before it was recorded, measured now from its token file (deterministic, so
    a resume and a replay see the same number). 0.0 (not measured: the guard does not hold it)
    when the token file cannot be read, as for a retired arm whose external file is gone."""
    if arm.compression > 0:
        return arm.compression
    try:
        return compression_ratio(arm.tokens(layout.root))
    except (OSError, ValueError):
        return 0.0


def write_arm_index(layout: RunLayout, arms: list[ArmData]) -> None:
    """A new `data/arms.json` holding `arms` (at creation; no change log yet)."""
    write_arm_index_doc(layout, {"arms": [asdict(a) for a in arms]})


def write_arm_index_doc(layout: RunLayout, d: dict) -> None:
    """Replace `data/arms.json` with `d` (its whole content: "arms" and the proxy's "changes",
    edited from `read_arm_index_doc`: see the module docstring), atomically (shared/atomic_io.py)."""
    atomic_write_json(layout.arms_index, d)


def read_arm_index_doc(layout: RunLayout) -> dict:
    """The whole content of `data/arms.json` as stored ("arms", and "changes" when the run has an
    arm-change log), after checking that every entry of "arms" is a valid ArmData. Raises
    ArmSourceError naming the file when it is missing or garbage."""
    return _read_index(layout)[0]


def read_arm_index(layout: RunLayout, include_retired: bool = False) -> dict[str, ArmData]:
    """The run's arms by name; retired (zombie) arms only with `include_retired` (the worker
    never loads them, docs/architecture.md#arms). Raises ArmSourceError naming the file when
    missing or garbage."""
    arms = _read_index(layout)[1]
    return arms if include_retired else {n: a for n, a in arms.items() if not a.retired}


def _read_index(layout: RunLayout) -> tuple[dict, dict[str, ArmData]]:
    try:
        d = read_json(layout.arms_index, expect=dict, missing_ok=False)
        return d, {a["name"]: ArmData(**a) for a in d["arms"]}
    except FileNotFoundError:
        raise ArmSourceError(
            f"{layout.arms_index}: missing; the run directory is incomplete "
            "(was creation interrupted? remove the directory and start again)"
        ) from None
    except (ValueError, KeyError, TypeError) as e:
        raise ArmSourceError(
            f"{layout.arms_index}: unreadable ({getattr(e, 'reason', e)}); restore it from a backup: "
            "it maps the run's arms to their token files in data/ (docs/data.md)"
        ) from e
