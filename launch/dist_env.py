"""Who am I in the job? Rank discovery for torchrun, Slurm srun, MPI launchers, or a single process.

Each launcher publishes ranks in its own environment variables; `discover(env)` reads them (a pure function
of the mapping, so it is tested with fake environments) and returns one `DistEnv`, whose `torch_env()` is
what `torch.distributed.init_process_group(init_method="env://")` needs.

Order matters: torchrun's per-process variables win (under `srun torchrun`, SLURM_PROCID is the node's
task, not the worker's rank); MPI's come before Slurm's (an `mpirun` inside an sbatch script inherits the
batch step's SLURM_PROCID=0 in every process).
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass
from typing import Callable, Mapping, MutableMapping, Optional

__all__ = ["DistEnv", "DistEnvError", "discover", "expand_nodelist", "from_mpi4py", "from_mpi_env",
           "from_slurm", "from_torchrun", "scontrol_hostnames"]

DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun" | "slurm" | "mpi" | "single"
    local_world_size: Optional[int] = None

    def torch_env(self) -> dict[str, str]:
        """The env:// rendezvous variables torch.distributed reads."""
        env = {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
               "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}
        if self.local_world_size is not None:
            env["LOCAL_WORLD_SIZE"] = str(self.local_world_size)
        return env

    def export(self, environ: Optional[MutableMapping[str, str]] = None) -> None:
        """Set torch_env() in `environ` (default os.environ) before init_process_group."""
        (os.environ if environ is None else environ).update(self.torch_env())


class DistEnvError(RuntimeError):
    """The launcher's variables are inconsistent (e.g. rank >= world size)."""


def _int(env: Mapping[str, str], *names: str) -> Optional[int]:
    for name in names:
        value = env.get(name, "").strip()
        if value:
            try:
                return int(value)
            except ValueError:
                raise DistEnvError(f"{name}={value!r} is not an integer") from None
    return None


def _port(env: Mapping[str, str], default: int) -> int:
    port = _int(env, "MASTER_PORT")
    return default if port is None else port


def _checked(dist: DistEnv) -> DistEnv:
    if dist.world_size < 1 or not 0 <= dist.rank < dist.world_size:
        raise DistEnvError(f"{dist.launcher}: rank {dist.rank} is outside world size {dist.world_size}")
    if dist.local_rank < 0:
        raise DistEnvError(f"{dist.launcher}: negative local rank {dist.local_rank}")
    return dist


# --- compressed Slurm host lists: "node[01-04,07],gpu-a[1-2]-ib" -------------------------------------------

def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in (s.strip() for s in parts) if p]


def _expand_range(spec: str) -> list[str]:
    out = []
    for item in spec.split(","):
        if "-" in item:
            lo, hi = item.split("-", 1)
            width = len(lo) if lo.startswith("0") else 0
            out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
        else:
            out.append(item)
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand Slurm's compressed host list (like `scontrol show hostnames`), keeping zero padding."""
    hosts: list[str] = []
    for part in _split_top_level(nodelist):
        match = re.search(r"\[([^\]]*)\]", part)
        if match is None:
            hosts.append(part)
            continue
        head, tail = part[: match.start()], part[match.end():]
        for value in _expand_range(match.group(1)):
            hosts.extend(expand_nodelist(head + value + tail))  # tail may hold another [..] group
    return hosts


def scontrol_hostnames(nodelist: str) -> list[str]:
    """`scontrol show hostnames` when Slurm's client is installed (authoritative), else our parser."""
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                                 timeout=10, check=True).stdout.split()
            if out:
                return out
        except (subprocess.SubprocessError, OSError):
            pass
    return expand_nodelist(nodelist)


# --- one reader per launcher -------------------------------------------------------------------------------

def from_torchrun(env: Mapping[str, str]) -> Optional[DistEnv]:
    """torchrun (and any env:// launcher) sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT."""
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    if rank is None or world is None:
        return None
    return _checked(DistEnv(rank, world, _int(env, "LOCAL_RANK") or 0, env.get("MASTER_ADDR") or "127.0.0.1",
                            _port(env, DEFAULT_MASTER_PORT), "torchrun", _int(env, "LOCAL_WORLD_SIZE")))


def _slurm_port(env: Mapping[str, str]) -> int:
    """A port derived from the job id, so two jobs sharing a head node do not collide."""
    job_id = _int(env, "SLURM_JOB_ID")
    return _port(env, DEFAULT_MASTER_PORT if job_id is None else 15000 + job_id % 20000)


def from_slurm(env: Mapping[str, str],
               hostnames: Callable[[str], list[str]] = scontrol_hostnames) -> Optional[DistEnv]:
    """An srun task: SLURM_PROCID/SLURM_STEP_NUM_TASKS/SLURM_LOCALID; the master is the job's first node.

    Only job steps count: the batch script itself also has SLURM_PROCID=0 and SLURM_NTASKS (of the whole
    allocation) but no SLURM_STEP_ID; read as a rank it would wait forever for peers that never start.
    """
    if not env.get("SLURM_STEP_ID") and not env.get("SLURM_STEP_NUM_TASKS"):
        return None
    rank = _int(env, "SLURM_PROCID")
    world = _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
    if rank is None or world is None:
        return None
    master = env.get("MASTER_ADDR")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not master:
        hosts = hostnames(nodelist) if nodelist else []
        master = hosts[0] if hosts else "127.0.0.1"
    tasks_per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    local_world = _uniform_tasks_per_node(tasks_per_node)
    return _checked(DistEnv(rank, world, _int(env, "SLURM_LOCALID") or 0, master, _slurm_port(env), "slurm",
                            local_world))


def _uniform_tasks_per_node(tasks_per_node: Optional[str]) -> Optional[int]:
    """'2' or '2(x4)' -> 2; uneven layouts like '2,1' -> None (the local world size is then unknown)."""
    match = re.fullmatch(r"(\d+)(\(x\d+\))?", (tasks_per_node or "").strip())
    return int(match.group(1)) if match else None


def from_mpi_env(env: Mapping[str, str]) -> Optional[DistEnv]:
    """Open MPI (OMPI_COMM_WORLD_*), MPICH/Intel MPI hydra (PMI_*, MPI_LOCALRANKID) and PMIx (PMIX_RANK)."""
    rank = _int(env, "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
    world = _int(env, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MPI_WORLDSIZE")
    if rank is None or world is None:
        return None
    local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK") or 0
    local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE")
    # MPI publishes no master address; single-node unless MASTER_ADDR is given (or mpi4py broadcasts it).
    return _checked(DistEnv(rank, world, local, env.get("MASTER_ADDR") or "127.0.0.1",
                            _port(env, DEFAULT_MASTER_PORT), "mpi", local_world))


def from_mpi4py(env: Mapping[str, str]) -> Optional[DistEnv]:
    """Ask MPI itself (initializes MPI): covers launchers with unknown variables and broadcasts rank 0's host."""
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    comm = MPI.COMM_WORLD
    if comm.Get_size() <= 1:
        return None
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    master = env.get("MASTER_ADDR") or comm.bcast(socket.gethostname(), root=0)
    return _checked(DistEnv(comm.Get_rank(), comm.Get_size(), local.Get_rank(), master,
                            _port(env, DEFAULT_MASTER_PORT), "mpi", local.Get_size()))


def _looks_like_mpi(env: Mapping[str, str]) -> bool:
    return any(k.startswith(("OMPI_", "PMI_", "PMIX_", "HYDRA_", "I_MPI_")) for k in env)


def discover(env: Optional[Mapping[str, str]] = None, use_mpi4py: Optional[bool] = None,
             hostnames: Callable[[str], list[str]] = scontrol_hostnames) -> DistEnv:
    """The process's place in the job: torchrun > MPI > Slurm > single process.

    use_mpi4py: query MPI through mpi4py when the variables are not enough (None = only when the
    environment looks like an MPI launch; mpi4py initializes MPI, so it is not done blindly).
    """
    env = os.environ if env is None else env
    if (dist := from_torchrun(env)) is not None:
        return dist
    dist = from_mpi_env(env)
    if use_mpi4py or (use_mpi4py is None and _looks_like_mpi(env)):
        if (dist is None or (dist.world_size > 1 and not env.get("MASTER_ADDR"))) and (
                probed := from_mpi4py(env)) is not None:
            return probed
    if dist is not None:
        return dist
    if (dist := from_slurm(env, hostnames)) is not None:
        return dist
    return DistEnv(0, 1, 0, env.get("MASTER_ADDR") or "127.0.0.1", _port(env, DEFAULT_MASTER_PORT), "single", 1)


def main() -> None:
    """`python -m megatron_qrl.launch.dist_env`: print the discovered layout as shell exports."""
    dist = discover()
    for key, value in {**dist.torch_env(), "QRL_LAUNCHER": dist.launcher}.items():
        print(f"export {key}={value}")


if __name__ == "__main__":
    main()
