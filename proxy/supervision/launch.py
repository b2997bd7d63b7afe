"""Launching the worker, alone or under torchrun, and reaching its ranks
(docs/signals.md#several-ranks, docs/architecture.md#processes). torchrun's agent takes every
signal as "stop everything", so once the ranks announced their pids in the handshake the proxy
signals them directly; restarts are the proxy's job (`--max-restarts 0` for the agent).

What it is not: the supervision loop (proxy/supervision/supervisor.py) or process-group set-up
inside the worker (worker/distributed.py). No torch import here: the proxy stays light.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from proxy.supervision.proc_tree import signal_group, signals_blocked
from shared.processes import alive
from shared.run.handshake import read_handshake
from shared.run.layout import RunLayout

log = logging.getLogger("proxy.supervision.launch")
PROJECT_ROOT = Path(__file__).resolve().parents[2]  # the repository: proxy/supervision/launch.py


@dataclass(frozen=True)
class LaunchOptions:
    """torchrun options passed through from `python -m proxy run` (torchrun's own names)."""

    nproc_per_node: int = 1
    nnodes: str | None = None  # "N" or "MIN:MAX"
    node_rank: int | None = None
    rdzv_endpoint: str | None = None  # host:port of the rendezvous
    rdzv_id: str | None = None
    rdzv_backend: str | None = None  # default c10d when an endpoint is given
    rdzv_timeout: float = 600.0  # seconds the owner waits for every node to join

    @property
    def nodes(self) -> int:
        """Nodes of the job: --nnodes N (MIN:MAX counts MAX); 1 without --nnodes."""
        return int(str(self.nnodes).split(":")[-1]) if self.nnodes else 1

    @property
    def multi_node(self) -> bool:
        """More than one node: the owner/follower split (proxy/supervision/nodes.py) and the static
        rendezvous, whatever --rdzv-backend says."""
        return self.nodes > 1

    @property
    def uses_torchrun(self) -> bool:
        given = (self.nnodes, self.node_rank, self.rdzv_endpoint, self.rdzv_id, self.rdzv_backend)
        return self.nproc_per_node > 1 or any(v is not None for v in given)

    def world_size(self) -> int:
        """Ranks in the whole job (nproc_per_node x the maximum number of nodes)."""
        return self.nproc_per_node * self.nodes


def _agent_argv(python: str, nproc_per_node: int) -> list[str]:
    """torchrun's agent with `nproc_per_node` ranks per node; restarts are the proxy's job."""
    return [
        python,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc_per_node),
        "--max-restarts",
        "0",
        "--monitor-interval",
        "0.5",
    ]


def torchrun_argv(python: str, worker_args: list[str], opts: LaunchOptions) -> list[str]:
    """argv that runs `python -m worker worker_args` under torchrun with `opts`; a single node
    without a rendezvous endpoint gets `--standalone` (a private store on a free port, so several
    runs on one box never collide)."""
    argv = _agent_argv(python, opts.nproc_per_node)
    if opts.rdzv_endpoint is None and opts.nnodes in (None, "1", "1:1"):
        argv.append("--standalone")
    else:
        if opts.nnodes is not None:
            argv += ["--nnodes", str(opts.nnodes)]
        if opts.node_rank is not None:
            argv += ["--node-rank", str(opts.node_rank)]
        argv += ["--rdzv-backend", opts.rdzv_backend or "c10d"]
        if opts.rdzv_endpoint is not None:
            argv += ["--rdzv-endpoint", opts.rdzv_endpoint]
        if opts.rdzv_id is not None:
            argv += ["--rdzv-id", opts.rdzv_id]
    return argv + ["-m", "worker", *worker_args]


def static_argv(
    python: str, worker_args: list[str], job: dict, node_rank: int, timeout: float
) -> list[str]:
    """argv of torchrun with the static rendezvous (docs/architecture.md#several-nodes) for the
    incarnation `job` posts (.nodes/job.json: nproc_per_node, nnodes, the store's addr and port,
    served by node rank 0's agent, and run_id) as node `node_rank`; `timeout` seconds for every
    node's agent to reach the store."""
    return [
        *_agent_argv(python, job["nproc_per_node"]),
        "--nnodes",
        str(job["nnodes"]),
        "--node-rank",
        str(node_rank),
        "--rdzv-backend",
        "static",
        "--master-addr",
        job["addr"],
        "--master-port",
        str(job["port"]),
        "--rdzv-id",
        job["run_id"],
        "--rdzv-conf",
        f"timeout={max(1, int(timeout))}",
        "-m",
        "worker",
        *worker_args,
    ]


def spawn(argv: list[str], torchrun: bool, multi_node: bool) -> subprocess.Popen:
    """Start `argv` (the worker, or torchrun's agent) in its own session, with PROJECT_ROOT on
    PYTHONPATH. The agent dies with the proxy (`die_with_parent`), and a multi-node one gets
    OMP_NUM_THREADS=1 unless the user set it, so that a rank's CPU rounding does not depend on
    how the ranks are spread over nodes (docs/architecture.md#several-nodes, "One mixture"). A
    lone worker starts with its signals blocked (proc_tree.signals_blocked: it unblocks them)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")]))
    if multi_node:
        env.setdefault("OMP_NUM_THREADS", "1")
    with contextlib.nullcontext() if torchrun else signals_blocked():
        return subprocess.Popen(
            argv,
            env=env,
            start_new_session=True,
            close_fds=True,
            preexec_fn=die_with_parent if torchrun else None,
        )


PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """preexec_fn of the torchrun agent: prctl(PR_SET_PDEATHSIG, SIGTERM), so the agent stops
    its ranks and exits when the proxy dies, even by SIGKILL (docs/signals.md#parent-death). The
    kernel sends it when the spawning thread exits: the proxy spawns from its main thread."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def local_ranks(agent_pid: int, run_dir: str) -> list[int]:
    """This node's ranks: the processes below the torchrun agent `agent_pid` that run `-m worker`
    on `run_dir` (the handshake's `worker.pids` holds every node's pids, which mean nothing on
    another host)."""
    return [p for p in agent_descendants(agent_pid) if _is_our_rank(p, run_dir)]


def rank_pids(layout: RunLayout) -> list[int]:
    """The pids the ranks of the current incarnation announced (`worker.pids`), maybe partial
    while ranks are still starting; [] before the first announces."""
    w = read_handshake(layout).get("worker") or {}
    return [int(p) for p in w.get("pids") or [] if isinstance(p, int) and p > 0]


def signal_pids(pids: list[int], sig: int) -> None:
    """Send `sig` to each pid that still exists."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def kill_agent(pgid: int, ranks: list[int]) -> None:
    """SIGKILL the process group `pgid` (a lone worker's, or torchrun's agent's) and `ranks`."""
    signal_group(pgid, signal.SIGKILL)
    kill_ranks(ranks)


def kill_ranks(pids: list[int]) -> None:
    """SIGKILL each rank and its session's process group (torchrun starts each rank as a
    session leader, so the agent's group does not contain them)."""
    for pid in pids:
        for kill in (os.killpg, os.kill):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                kill(pid, signal.SIGKILL)


def agent_descendants(agent_pid: int) -> list[int]:
    """Pids of every process below the torchrun agent (ranks that may not have announced yet)."""
    try:
        return [c.pid for c in psutil.Process(agent_pid).children(recursive=True)]
    except Exception:  # noqa: BLE001 - the agent is gone or psutil cannot see it: nothing to add
        return []


def _is_our_rank(pid: int, run_dir: str) -> bool:
    """Guard against pid reuse: the process's command line names `-m worker` and our run dir."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return b"worker" in argv and os.fsencode(run_dir) in argv


def wait_for_earlier_workers(layout: RunLayout, grace: float) -> None:
    """Wait up to `grace` seconds for every worker the handshake names (this run's only, checked
    by command line), then SIGKILL what is left: a proxy killed by SIGKILL leaves its worker
    checkpointing and exiting by itself (docs/signals.md#kill--9), and a new proxy must not plan
    its resume while that worker may still write."""
    ours = [p for p in rank_pids(layout) if p != os.getpid() and _is_our_rank(p, str(layout.root))]
    if not ours:
        return
    log.warning(
        "worker pid(s) %s of an earlier proxy still run on %s: waiting up to %.0f s for "
        "their checkpoint and exit before resuming",
        ours,
        layout.root,
        grace,
    )
    _wait_then_kill(ours, grace, "worker pid(s) %s did not exit within %.0f s: killing them")


def _wait_then_kill(pids: list[int], grace: float, why: str) -> None:
    """Wait up to `grace` seconds for `pids` to exit, then SIGKILL (and log `why` % (left,
    grace)) those still alive."""
    end = time.monotonic() + grace
    while time.monotonic() < end and any(alive(p) for p in pids):
        time.sleep(0.05)
    left = [p for p in pids if alive(p)]
    if left:
        log.error(why, left, grace)
        kill_ranks(left)


def reap_leftover_ranks(pids: list[int], run_dir: str, grace: float = 10.0) -> None:
    """After the agent exited: wait up to `grace` seconds for ranks still running (this run's
    only), then SIGKILL them, logged: nothing may be left holding a GPU."""
    ours = [p for p in pids if _is_our_rank(p, run_dir)]
    _wait_then_kill(ours, grace, "ranks %s outlived the torchrun agent by %.0f s: killing them")
