"""Rank discovery from torchrun, Slurm, MPI environments (fake env dicts) and one real mpiexec launch."""
import json
import re
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_qrl.launch.dist_env import DistEnv, DistEnvError, discover, expand_nodelist


def _discover(env, **kw):
    return discover(env, use_mpi4py=False, hostnames=expand_nodelist, **kw)


def test_single_process_fallback():
    assert _discover({}) == DistEnv(0, 1, 0, "127.0.0.1", 29500, "single", 1)


def test_torchrun():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
           "MASTER_ADDR": "node01", "MASTER_PORT": "29400",
           "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}  # srun -> torchrun: the torchrun worker's ids win
    assert _discover(env) == DistEnv(5, 8, 1, "node01", 29400, "torchrun", 4)


def test_slurm_srun_task_uses_first_node_as_master():
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "gpu[07-08,10]", "SLURM_TASKS_PER_NODE": "2(x2)"}
    dist = _discover(env)
    assert (dist.rank, dist.world_size, dist.local_rank, dist.launcher) == (3, 4, 1, "slurm")
    assert dist.master_addr == "gpu07"
    assert dist.master_port == 15000 + 4242 % 20000
    assert dist.local_world_size == 2
    assert _discover({**env, "MASTER_PORT": "1234", "MASTER_ADDR": "h"}).master_port == 1234
    assert _discover({**env, "SLURM_TASKS_PER_NODE": "2,1"}).local_world_size is None


def test_slurm_step_counts_win_over_job_counts():
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NODELIST": "a"}
    assert _discover(env).world_size == 2


def test_slurm_batch_script_is_a_single_process():
    # `sbatch -n 4 --wrap "python train.py"`: the batch step has PROCID/NTASKS but is not an srun task
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]"}
    assert _discover(env).launcher == "single"


@pytest.mark.parametrize("env, expected", [
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, (2, 4, 0, 2)),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}, (1, 2, 1, 2)),
    ({"PMIX_RANK": "0", "PMI_SIZE": "3"}, (0, 3, 0, None)),
])
def test_mpi_variables(env, expected):
    dist = _discover({**env, "SLURM_PROCID": "0", "SLURM_NTASKS": "1"})  # mpirun inside an sbatch script
    assert (dist.rank, dist.world_size, dist.local_rank, dist.local_world_size) == expected
    assert dist.launcher == "mpi"


@pytest.mark.parametrize("nodelist, hosts", [
    ("node01", ["node01"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("a[8-10],b1", ["a8", "a9", "a10", "b1"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("gpu-[001-002].ib,login", ["gpu-001.ib", "gpu-002.ib", "login"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def test_expand_matches_scontrol_when_present():
    if not shutil.which("scontrol"):
        pytest.skip("no Slurm client here (the parser is checked against fixed cases above)")
    for nodelist in ["node[01-04,07]", "a[8-10],b1", "rack[1-2]-n[01-02]"]:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True)
        if out.returncode == 0:
            assert out.stdout.split() == expand_nodelist(nodelist)


def test_bad_values_fail_clearly():
    with pytest.raises(DistEnvError, match="RANK='x' is not an integer"):
        _discover({"RANK": "x", "WORLD_SIZE": "2"})
    with pytest.raises(DistEnvError, match="rank 4 is outside world size 4"):
        _discover({"SLURM_PROCID": "4", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0"})


def test_export_sets_torch_variables():
    env = {}
    DistEnv(1, 2, 1, "h", 1234, "slurm", 2).export(env)
    assert env == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h",
                   "MASTER_PORT": "1234", "LOCAL_WORLD_SIZE": "2"}


def _mpiexec() -> str:
    found = shutil.which("mpiexec") or shutil.which("mpiexec", path=str(Path(sys.executable).parent))
    if not found:
        pytest.fail("mpiexec not found on PATH or next to the Python interpreter: install the test extra "
                    "(pip install -e '.[test]' brings mpi4py and mpich) so the MPI launch path is tested")
    return found


PROBE = ("import json; from megatron_qrl.launch.dist_env import discover; d = discover(); "
         "print(json.dumps([d.rank, d.world_size, d.local_rank, d.launcher, d.master_addr]), flush=True)")


@pytest.mark.timeout(120)
def test_real_mpiexec_discovers_two_ranks():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    out = subprocess.run([_mpiexec(), "-n", "2", sys.executable, "-c", PROBE], capture_output=True, text=True,
                         timeout=100, env=env)
    assert out.returncode == 0, out.stderr
    # mpiexec forwards both ranks' stdout through one pipe: two records can share a line
    rows = sorted(json.loads(m) for m in re.findall(r"\[[^\[\]]*\]", out.stdout))
    assert [r[:4] for r in rows] == [[0, 2, 0, "mpi"], [1, 2, 1, "mpi"]]
    assert rows[0][4] == rows[1][4]  # every rank agrees on the master address
