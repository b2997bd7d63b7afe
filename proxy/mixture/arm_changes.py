"""Changes to a run's set of arms: the log in `data/arms.json` and `run --arm ...` on a restart.

Arms are keyed by NAME, never by position (docs/architecture.md#arms): a restart may list them in
any order (nothing changes), leave some out (retired from the resume step on, their statistics
kept in `.state.json` under "retired") or name new ones (tokenized into `data/` and joining with
no statistics, or re-joining with them: Bandit.add_arm). Zombie arms, whose source is gone or
changed (`check_source`), are retired through the same log at the start of every incarnation
(`handle_zombies`).

The log: `data/arms.json` key "changes", a list of {"id", "step", "action": "add"|"retire",
"arm", "reason"} in the order they were made. `step` is the checkpoint step S the change takes
effect at (the arm set changes between updates S and S+1); it is null while pending: the proxy
writes the request before it knows which checkpoint it resumes from, and stamps it at the start
of the incarnation (`stamp_changes`). Replays apply the log at the same steps, so replaying
`.loss.json` still reproduces `.state.json` exactly (docs/bandit.md#determinism). Runs made before
the log existed have per-arm "retired" entries only; they are read as retire changes.

What it is not: the bandit arithmetic of joining or leaving (proxy/mixture/bandit.py), tokenizing an
arm, or reading and writing `data/arms.json` (shared/data/token_files.py, the file's one owner: this
module edits the content it reads and hands it back).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

from proxy.fault_injection import tokenize_pause
from proxy.mixture.bandit import BanditConfigError, resolve_bounds
from proxy.run_files.phases import phase_at
from shared.atomic_io import atomic_write_json
from shared.data.arms import ArmSourceError, content_fingerprint, source_fingerprint
from shared.data.checks import check_arms
from shared.data.token_files import (
    ArmData,
    prepare_arm,
    read_arm_index,
    read_arm_index_doc,
    write_arm_index_doc,
)
from shared.data.tokenizer import RunTokenizer
from shared.run.config import ArmSpec, ConfigError, RunConfig
from shared.run.layout import RunLayout
from shared.run.stop_request import StopRequested

log = logging.getLogger("proxy.mixture.arm_changes")

ACTIONS = ("add", "retire")


@dataclass(frozen=True)
class ArmChange:
    """One entry of the arm-change log: arm `arm` joins ("add") or leaves ("retire") the bandit
    once every record up to `step` (a checkpoint step; None while pending) is folded."""

    id: int
    step: int | None
    action: str
    arm: str
    reason: str


def _changes_of(d: dict) -> list[ArmChange]:
    if "changes" in d:
        return [
            ArmChange(
                int(c["id"]),
                None if c["step"] is None else int(c["step"]),
                str(c["action"]),
                str(c["arm"]),
                str(c.get("reason", "")),
            )
            for c in d["changes"]
        ]
    legacy = sorted(
        (int(a["retired"]["step"]), a["name"], str(a["retired"]["reason"]))
        for a in d["arms"]
        if a.get("retired")
    )
    return [ArmChange(i, s, "retire", n, r) for i, (s, n, r) in enumerate(legacy)]


def _store(d: dict, changes: list[ArmChange]) -> None:
    d["changes"] = [dataclasses.asdict(c) for c in changes]


def read_changes(layout: RunLayout) -> list[ArmChange]:
    """The run's arm-change log, oldest first. Raises ArmSourceError naming `data/arms.json`
    when it is missing or unreadable."""
    try:
        return _changes_of(read_arm_index_doc(layout))
    except (KeyError, TypeError, ValueError) as e:
        raise ArmSourceError(
            f"{layout.arms_index}: arm-change log unreadable ({e}); restore the file from a backup"
        ) from e


def append_changes(
    layout: RunLayout, new: Sequence[tuple[int | None, str, str, str]], d: dict | None = None
) -> list[ArmChange]:
    """Append changes (step, action, arm, reason) to the log, keeping the per-arm "retired"
    status the worker reads in step with it; one atomic rewrite of `data/arms.json` (with `d`,
    an already-edited copy of it, when given). Returns the whole log."""
    d = read_arm_index_doc(layout) if d is None else d
    changes = _changes_of(d)
    nxt = max((c.id for c in changes), default=-1) + 1
    by_name = {a["name"]: a for a in d["arms"]}
    for i, (step, action, arm, reason) in enumerate(new):
        if action not in ACTIONS or arm not in by_name:
            raise ValueError(f"arm change {action!r} of {arm!r}: unknown action or arm")
        changes.append(ArmChange(nxt + i, step, action, arm, reason))
        by_name[arm]["retired"] = {"step": step, "reason": reason} if action == "retire" else None
    _store(d, changes)
    write_arm_index_doc(layout, d)
    return changes


def stamp_changes(layout: RunLayout, resume_step: int) -> list[ArmChange]:
    """Pending changes (step null) take effect at `resume_step`; changes recorded past it are
    moved back to it (a resume from an older checkpoint must not train on a removed arm, nor
    without an added one, past that checkpoint). Written back when anything moved, so every
    later replay agrees. Returns the whole log."""
    d = read_arm_index_doc(layout)
    changes = _changes_of(d)
    fixed = [
        c
        if c.step is not None and c.step <= resume_step
        else dataclasses.replace(c, step=resume_step)
        for c in changes
    ]
    if fixed != changes or "changes" not in d:
        for a in d["arms"]:
            if (r := a.get("retired")) and (r["step"] is None or r["step"] > resume_step):
                r["step"] = resume_step
        _store(d, fixed)
        write_arm_index_doc(layout, d)
    return fixed


def arms_present_at(index_names: list[str], changes: list[ArmChange], step: int) -> list[str]:
    """Arms a bandit built at `step` starts with, before the changes up to `step` are applied:
    every arm of the index except those whose first change is an "add" after `step`."""
    first = {c.arm: c for c in reversed(changes)}  # each arm's first change
    return sorted(
        n
        for n in index_names
        if not (
            n in first and first[n].action == "add" and ((s := first[n].step) is None or s > step)
        )
    )


# ------------------------------------------------------------------- run --arm on a restart


@dataclass
class ArmSetPlan:
    """What `--arm ...` on a restart changes: names added (new, or re-joining after a removal),
    removed, and the new configured list (run.json's "arms", in the order given)."""

    new_specs: list[ArmSpec]
    added: list[ArmSpec]
    rejoining: list[str]
    removed: list[str]

    @property
    def changes_anything(self) -> bool:
        return bool(self.added or self.rejoining or self.removed)


def _norm_source(source: str) -> str:
    return os.path.abspath(os.path.expanduser(source)) if source else ""


def _same_source(a: ArmSpec, kind: str, source: str, field: str) -> bool:
    return (
        a.kind == kind
        and _norm_source(a.source) == _norm_source(source)
        and (a.kind != "jsonl" or a.field == field)
    )


def plan_arm_set(
    layout: RunLayout,
    cfg: RunConfig,
    new_specs: list[ArmSpec],
    caps: dict[str, float],
    floors: dict[str, float],
) -> ArmSetPlan:
    """Compare `--arm` given on a restart with the run's configured arms (run.json) by NAME.

    `caps`/`floors`: the bounds of the run's newest phase. Raises ConfigError, before anything
    is written, when: a name is listed twice; a kept name points at a different source (its
    statistics belong to the old one: give the new source a new name); a re-joining arm's source
    no longer matches the fingerprint taken when it was tokenized; or the arms left cannot hold
    a batch under the phase's floors and caps (BanditConfigError's reason, with the fix).
    """
    names = [s.name for s in new_specs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"--arm: name(s) {', '.join(dup)} given more than once")
    old = {s.name: s for s in cfg.arms}
    index = read_arm_index(layout, include_retired=True)
    for s in new_specs:
        o = old.get(s.name)
        if o is not None and o != s and not _same_source(s, o.kind, o.source, o.field):
            raise ConfigError(
                f"--arm {s.name}={s.kind}:{s.source}: {layout.run_json} has arm {s.name} as "
                f"{o.kind}:{o.source or '(embedded)'}; an arm's statistics belong to its source, "
                f"so the source cannot change under the same name: give the new source a new "
                f"name (e.g. --arm {s.name}-2={s.kind}:{s.source}) and leave {s.name} out to "
                "retire it"
            )
    added = [s for s in new_specs if s.name not in old and s.name not in index]
    problems = check_arms(added)  # every new arm, all at once, before any work
    if problems:
        raise ConfigError(
            f"{len(problems)} of the {len(added)} new arms cannot be used; nothing "
            "was changed:\n" + "\n".join(f"  - {m}" for m in problems)
        )
    rejoining = []
    for s in new_specs:
        if s.name in old or s.name not in index:
            continue
        a: ArmData = index[s.name]
        if not _same_source(s, a.kind, a.source, getattr(a, "field", "text")):
            raise ConfigError(
                f"--arm {s.name}={s.kind}:{s.source}: this run already had an arm {s.name} "
                f"({a.kind}:{a.source or '(embedded)'}, retired); reuse its source to bring it "
                f"back with its statistics, or give the new source a new name"
            )
        why = check_source(s, a.fingerprint, a.source_fingerprint)
        if why:
            raise ConfigError(
                f"--arm {s.name}: cannot bring arm {s.name} back: {why}; restore "
                f"the source it had, or train on the new one under a new name"
            )
        rejoining.append(s.name)
    active_now = {n for n, a in index.items() if not a.retired}
    # what is left out: the configured arms, and any arm active in the index that run.json does
    # not list (a proxy killed between the two writes of commit_arm_set)
    removed = [n for n in list(old) + sorted(active_now - set(old)) if n not in set(names)]
    active = sorted((active_now - set(removed)) | {s.name for s in added} | set(rejoining))
    if not active:
        raise ConfigError("--arm: no arm would be left to train on; keep at least one")
    try:
        _resolve_for(active, caps, floors)
    except BanditConfigError as e:
        raise ConfigError(
            f"--arm: with arms {', '.join(active)} the phase's bounds do not "
            f"work: {e}; keep more arms, or pivot to new caps/floors first"
        ) from None
    return ArmSetPlan(list(new_specs), added, rejoining, removed)


def _resolve_for(names: list[str], caps: dict[str, float], floors: dict[str, float]) -> None:
    """`resolve_bounds` of arms `names` under the bounds `caps`/`floors` given for them or more."""
    resolve_bounds(
        names,
        {n: v for n, v in caps.items() if n in names},
        {n: v for n, v in floors.items() if n in names},
    )


def commit_arm_set(layout: RunLayout, cfg: RunConfig, plan: ArmSetPlan) -> RunConfig:
    """Carry out `plan`: tokenize new arms into `data/` with the run's tokenizer (ArmSourceError
    for a missing or too small source, before anything is recorded), record pending add/retire
    changes in `data/arms.json` (stamped with the resume step by the supervisor), then rewrite
    run.json's arm list. Returns the updated RunConfig."""
    prepared: list[ArmData] = []
    if plan.added:
        tok = RunTokenizer.load(layout.tokenizer)
        try:
            for s in plan.added:
                prepared.append(prepare_arm(s, tok, layout, cfg, after_batch=tokenize_pause()))
        except StopRequested:
            raise  # a stop, not a refusal: complete new arms are kept for the same command
        except Exception:
            for a in prepared:  # a later arm was refused: leave no token file of this attempt
                if a.kind != "tokens":
                    (layout.root / a.path).unlink(missing_ok=True)
                (layout.data / f"{a.name}.done.json").unlink(missing_ok=True)
            raise
    d = read_arm_index_doc(layout)
    d["arms"] += [dataclasses.asdict(a) for a in prepared]
    retired_now = {a["name"] for a in d["arms"] if a.get("retired")}
    leaving = [n for n in plan.removed if n not in retired_now]
    new = [(None, "add", a.name, "added to --arm on a restart") for a in prepared]
    new += [(None, "add", n, "listed in --arm again on a restart") for n in plan.rejoining]
    new += [(None, "retire", n, "left out of --arm on a restart") for n in leaving]
    append_changes(layout, new, d)
    for a in prepared:
        log.info(
            "arm %s added (%s:%s, %s tokens); it joins the bandit at the resume step",
            a.name,
            a.kind,
            a.source,
            f"{a.n_tokens:,}",
        )
    for n in plan.rejoining:
        log.info("arm %s re-joins with its statistics", n)
    for n in leaving:
        log.info(
            "arm %s removed: retired at the resume step (statistics kept in .state.json "
            "under 'retired')",
            n,
        )
    for n in sorted(set(plan.removed) - set(leaving)):
        log.info("arm %s (already retired) dropped from the arm list", n)
    cfg.arms = list(plan.new_specs)
    atomic_write_json(layout.run_json, cfg.to_json())
    return cfg


def arms_as_of(d: dict, step: int) -> dict:
    """`data/arms.json` content `d` as it was when the run reached checkpoint `step` (for an
    audit fork from it): changes at or after `step` (a restart from `step` makes them at
    `step`) and pending ones are dropped, arms that joined then are dropped, and each arm's
    "retired" status follows its last remaining change."""
    every = _changes_of(d)
    changes = [c for c in every if c.step is not None and c.step < step]
    present = set(arms_present_at([a["name"] for a in d["arms"]], every, step - 1))
    out = {k: v for k, v in d.items() if k not in ("arms", "changes")}
    out["arms"] = []
    for a in d["arms"]:
        if a["name"] not in present:
            continue  # joined at or after `step`
        a = dict(a)
        last = [c for c in changes if c.arm == a["name"]]
        a["retired"] = (
            {"step": last[-1].step, "reason": last[-1].reason}
            if last and last[-1].action == "retire"
            else None
        )
        out["arms"].append(a)
    _store(out, changes)
    return out


def specs_of(d: dict, configured: list[ArmSpec]) -> list[ArmSpec]:
    """The configured arm list for `data/arms.json` content `d`: its active arms, in the order
    of `configured` (a run.json list) first, then the rest by name, rebuilt from the index when
    `configured` no longer has them."""
    active = {a["name"]: a for a in d["arms"] if not a.get("retired")}
    out = [s for s in configured if s.name in active]
    for n in sorted(set(active) - {s.name for s in out}):
        a = active[n]
        out.append(ArmSpec(n, a["kind"], a.get("source", ""), a.get("field", "text")))
    return out


# ------------------------------------------------------------------------------ zombie arms


def check_source(spec: ArmSpec, fingerprint: str, source_fp: str) -> str | None:
    """Why the arm's source no longer matches (a sentence naming the arm), or None when it does.

    `fingerprint`: the content fingerprint stored at creation; `source_fp`: the stored cheap one
    ("" when the run predates it: then the content fingerprint is checked every time)."""
    try:
        if source_fp and source_fingerprint(spec) == source_fp:
            return None
        now = content_fingerprint(spec)
    except ArmSourceError as e:
        return f"source gone ({e})"
    except OSError as e:
        return f"source unreadable ({e})"
    if now != fingerprint:
        return f"source changed (fingerprint {fingerprint[:19]} at creation, now {now[:19]})"
    return None


def handle_zombies(layout: RunLayout, specs: list[ArmSpec], resume_step: int) -> list[ArmChange]:
    """The start-of-incarnation check: stamp pending arm changes with `resume_step`, find new
    zombies (active arms whose source is gone or changed; retired ones are not checked again),
    report each by name (a warning), retire them at `resume_step`; returns the whole arm-change
    log for the MixtureController. Raises ArmSourceError when `data/arms.json` is missing."""
    changes = stamp_changes(layout, resume_step)
    index = read_arm_index(layout, include_retired=True)
    checked = {
        s.name: check_source(s, index[s.name].fingerprint, index[s.name].source_fingerprint)
        for s in specs
        if s.name in index and not index[s.name].retired
    }
    zombies = {n: why for n, why in sorted(checked.items()) if why}
    left = sorted(n for n, a in index.items() if not a.retired and n not in zombies)
    if zombies and not left:
        raise ConfigError(
            "every arm this run trains on has lost its source ("
            + "; ".join(f"{n}: {why}" for n, why in zombies.items())
            + f"); nothing was retired. Is {os.getcwd()} the directory the run was made from "
            "(older runs keep relative source paths, resolved against the current directory)? "
            "Restore the sources, or start from that directory"
        )
    for name, why in zombies.items():
        log.warning(
            "arm %s is a zombie: %s; it is retired from step %d on (kept in .state.json "
            "under 'retired', never pulled again); restore its source and list it in "
            "--arm again to bring it back with its statistics",
            name,
            why,
            resume_step,
        )
    back = restored_zombies(layout, specs, index, set(left), resume_step)
    for name in back:
        log.info(
            "arm %s re-joins with its statistics: its source is back as it was when it was "
            "tokenized (it was retired as a zombie)",
            name,
        )
    if zombies or back:
        changes = append_changes(
            layout,
            [(resume_step, "retire", n, why) for n, why in zombies.items()]
            + [(resume_step, "add", n, "source restored") for n in back],
        )
    return changes


def restored_zombies(
    layout: RunLayout,
    specs: list[ArmSpec],
    index: dict[str, ArmData],
    active: set[str],
    resume_step: int,
) -> list[str]:
    """Zombies whose source is back: arms retired while still configured (`specs`, run.json's
    list; an arm left out of `--arm` is dropped from it) whose source matches its fingerprint
    again, and which the phase in force at `resume_step` can hold next to the `active` arms (a
    pivot made while it was away may leave no room: it then stays retired, with a warning).
    A source unplugged for a while (an unmounted disk) so costs those steps, not the arm."""
    back = []
    for s in specs:
        a = index.get(s.name)
        if a is None or not a.retired or s.name in active:
            continue
        if check_source(s, a.fingerprint, a.source_fingerprint) is None:
            back.append(s.name)
    if not back:
        return back
    phase = phase_at(layout, resume_step)
    try:
        _resolve_for(sorted(active | set(back)), phase.caps, phase.floors)
    except BanditConfigError as e:
        log.warning(
            "arm(s) %s: the source is back, but the phase's bounds cannot hold them "
            "(%s); they stay retired; pivot to bounds that fit them",
            ", ".join(back),
            e,
        )
        return []
    return back
