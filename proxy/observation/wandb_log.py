"""Weights & Biases from the proxy: `run --wandb` logs the run to one W&B run, resumed on every
start, each step once (docs/operations.md#watching, which says how).

A logger built on the `wandb` package (the `[wandb]` extra), fed by the proxy as it files
records, with the same scalars as TensorBoard (proxy/observation/tensorboard_log.py
`step_scalars`) plus checkpoint events and each sample audit as a table (`audit/samples`: arm,
prompt, continuation, held-out loss), resumed and backfilled at every start from the last step
W&B holds (`logged_through`).

What it is not: the history (`.loss.json` stays the audit trail), nor a reason to stop training.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import struct
import time
from pathlib import Path
from typing import Any, Iterator

from proxy.observation.tensorboard_log import finite_scalars, package_missing, replay_history
from proxy.run_files.sidecars import read_audits
from shared.atomic_io import atomic_write_json, read_json
from shared.run.layout import RunLayout

log = logging.getLogger("proxy")

PROJECT = "andrea"  # the W&B project unless WANDB_PROJECT names another
AUDIT_KEY = "audit/samples"


def check_available() -> str | None:
    """None when the `wandb` package imports, else the message saying how to install it
    (proxy/observation/tensorboard_log.py `package_missing`)."""
    return package_missing("wandb", "wandb")


# -- W&B's transaction log: the leveldb log format (32 KiB blocks of chunks with a 7-byte
# header: crc32 uint32, length uint16, type uint8) after a 7-byte ":W&B" header, each record one
# wandb_internal_pb2.Record. `wandb sync` reads it; the wandb package ships no Python reader.
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def transaction_records(path: Path) -> Iterator[Any]:
    """The `wandb_internal_pb2.Record`s of one `run-<id>.wandb` file, in order; a torn tail (a
    killed writer) ends the iteration. Raises ValueError when the file is not a W&B log."""
    from wandb.proto import wandb_internal_pb2 as pb  # optional extra

    data = Path(path).read_bytes()
    if not data:
        return
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a W&B transaction log (starts {data[:7]!r})")
    i, parts = 7, b""
    while i + 7 <= len(data):
        left = _BLOCK - i % _BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            i += left
            continue
        _, n, kind = struct.unpack_from("<IHB", data, i)
        if kind == 0:  # zeros: the block's (or the preallocated file's) unwritten rest
            i += left
            continue
        chunk, i = data[i + 7 : i + 7 + n], i + 7 + n
        if i > len(data):
            return
        parts = (b"" if kind in (_FULL, _FIRST) else parts) + chunk
        if kind in (_FIRST, _MIDDLE):
            continue
        yield pb.Record.FromString(parts)  # type: ignore[attr-defined]  # protobuf, no stubs
        parts = b""


def history_steps(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(step, {key: value}) of each history row in one transaction log (values JSON-decoded; a
    logged object such as a table is a dict under its key)."""
    for r in transaction_records(path):
        if r.WhichOneof("record_type") != "history":
            continue
        row: dict[str, Any] = {}
        for i in r.history.item:
            *outer, key = list(i.nested_key) or [i.key]
            d = row
            for k in outer:
                d = d.setdefault(k, {})
            d[key] = json.loads(i.value_json)
        yield int(row.get("_step", r.history.step.num)), row


class WandbLog:
    """One W&B run for the ANDREA run at `root`. Call `start(step, ...)` at each worker
    incarnation, then `scalars` and `audit`; `close()` at the end. `config`: run.json's
    settings, logged as the W&B run's config."""

    def __init__(self, root: Path, config: dict) -> None:
        self.root = Path(root)
        self.dir = RunLayout(self.root).wandb
        self.id_file = self.dir / "andrea-run.json"
        self.config = config
        self._run: Any = None
        self.logged = 0  # the last step W&B holds (its history's `_step` goes up only)
        self._failed = False

    def _run_id(self) -> str:
        d = read_json(self.id_file, None, garbage="aside")
        if isinstance(d, dict) and isinstance(d.get("id"), str) and d["id"]:
            return d["id"]
        self.dir.mkdir(parents=True, exist_ok=True)
        run_id = secrets.token_hex(4)  # W&B's own ids are 8 characters of [a-z0-9]
        atomic_write_json(self.id_file, {"id": run_id, "created": time.time()})
        return run_id

    def wait_for_writers(self, timeout: float = 30.0) -> list[int]:
        """Wait (up to `timeout` s) until no W&B service process still holds a file under
        RUN/wandb/ open: a proxy killed with SIGKILL leaves its service (`wandb-core`, in a
        session of its own) writing what it had received for a few seconds, and the steps it
        writes must count before `logged_through` reads. Returns the pids still writing."""
        import psutil

        def writers() -> list[int]:
            out = []
            for p in psutil.process_iter(["name"]):
                with contextlib.suppress(psutil.Error, OSError):
                    if p.info["name"] == "wandb-core" and any(
                        Path(f.path).is_relative_to(self.dir) for f in p.open_files()
                    ):
                        out.append(p.pid)
            return out

        deadline = time.monotonic() + timeout
        while (left := writers()) and time.monotonic() < deadline:
            time.sleep(0.2)
        if left:
            log.warning(
                "wandb: service pids %s still write under %s after %.0f s", left, self.dir, timeout
            )
        return left

    def logged_through(self, run_id: str) -> int:
        """The newest step in this run's transaction logs under RUN/wandb/ (0: none): the
        newest folder that holds a history row decides, as steps only go up across starts."""
        started = re.compile(rf"(?:offline-)?run-(\d{{8}}_\d{{6}})-{re.escape(run_id)}$")
        if not self.dir.is_dir():
            return 0
        folders = sorted(
            (p for p in self.dir.iterdir() if started.match(p.name) and not p.is_symlink()),
            key=lambda p: started.match(p.name).group(1),  # type: ignore[union-attr]
            reverse=True,
        )
        for folder in folders:
            try:
                newest = max(
                    (s for s, _ in history_steps(folder / f"run-{run_id}.wandb")), default=0
                )
            except (OSError, ValueError) as e:
                log.warning("wandb: %s unreadable (%s); looking at the start before it", folder, e)
                continue
            if newest:
                return newest
        return 0

    def start(self, step: int, loss_path: Path, samples_path: Path) -> None:
        """A worker resumes from `step`: open (or resume) the W&B run on the first call, then log
        the history's records and audits after the last step W&B holds, up to `step`."""
        if self._failed or (self._run is None and not self._open()):
            return

        def new(s: int) -> bool:  # read as rows are logged: `logged` grows meanwhile
            return s > self.logged

        audits = read_audits(samples_path)
        backfilled, _, _ = replay_history(self, step, loss_path, audits, new, new)
        if backfilled:
            log.info(
                "wandb: backfilled %d step records up to step %d from the run's history",
                backfilled,
                step,
            )

    def _open(self) -> bool:
        import wandb  # optional extra

        try:
            run_id = self._run_id()
            self.wait_for_writers()  # a killed proxy's service may still be writing
            held = self.logged_through(run_id)
            self._run = wandb.init(
                project=os.environ.get("WANDB_PROJECT") or PROJECT,
                id=run_id,
                name=self.root.name,
                resume="allow",
                dir=str(self.root),
                config=self.config,
                settings=wandb.Settings(console="off", silent=True),
            )
            # online, a resumed run's next step is the server's: steps below it are dropped
            self.logged = max(held, int(getattr(self._run, "step", 0) or 0) - 1)
        except Exception as e:  # no login, no network, a full disk: train on without W&B
            self._fail(f"could not start ({type(e).__name__}: {e})")
            return False
        offline = self._run.settings.mode == "offline" if self._run.settings else False
        log.info(
            "wandb: run %s %s (steps through %d already logged)",
            run_id,
            f"offline under {self.dir}: upload with `wandb sync {self.dir}/offline-run-*`"
            if offline
            else (self._run.url or ""),
            self.logged,
        )
        return True

    def _fail(self, why: str) -> None:
        self._failed = True
        log.warning(
            "wandb: %s; training goes on without W&B, and the next start backfills the steps "
            "it missed",
            why,
        )
        run, self._run = self._run, None
        if run is not None:
            with contextlib.suppress(Exception):
                run.finish(exit_code=1)

    def _log(self, step: int, values: dict) -> None:
        if self._run is None:
            return
        try:
            self._run.log(values, step=max(step, self.logged))
        except Exception as e:
            self._fail(f"logging step {step} failed ({type(e).__name__}: {e})")
            return
        self.logged = max(step, self.logged)

    def scalars(self, step: int, values: dict, wall_time: float | None = None) -> None:
        """One history row at `step` holding every finite number in `values` (key -> value);
        others (None, NaN, strings) are skipped. A step at or below the last logged one (a
        checkpoint reported after later steps, a step trained again after a rewind) goes to the
        last logged step, where W&B still accepts it; `wall_time` is kept as `time`."""
        vals = finite_scalars(values)
        if vals and wall_time:
            vals["time"] = float(wall_time)
        if vals and (step > self.logged or any(k.startswith("checkpoint/") for k in vals)):
            self._log(step, vals)

    def audit(self, a: dict) -> None:
        """One sample audit (`{"step", "arms": {name: {"prompt", "text", "loss", ...}}}`): the
        held-out losses as `heldout/<arm>` and the samples as a table under `audit/samples`."""
        import wandb  # optional extra

        if self._run is None or a["step"] < self.logged:
            return
        arms = {n: v for n, v in (a.get("arms") or {}).items() if isinstance(v, dict)}
        values: dict[str, Any] = finite_scalars(
            {f"heldout/{n}": v.get("loss") for n, v in arms.items()}
        )
        if arms:
            values[AUDIT_KEY] = wandb.Table(
                columns=["arm", "prompt", "text", "heldout_loss"],
                data=[
                    [n, str(v.get("prompt", "")), str(v.get("text", "")), v.get("loss")]
                    for n, v in arms.items()
                ],
            )
        if values:
            self._log(a["step"], values)

    def close(self) -> None:
        """Finish the W&B run (its service writes what it holds)."""
        run, self._run = self._run, None
        if run is not None:
            try:
                run.finish()
            except Exception as e:
                log.warning("wandb: finishing the run failed (%s: %s)", type(e).__name__, e)
