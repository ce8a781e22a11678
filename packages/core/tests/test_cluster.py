"""Which launcher started a process, read from each scheduler's variables: pure, every
environment passed as a dict."""

import re

import pytest

from dp_core import JobId, Launch, job_id_of, launch_of, slurm_hosts, slurm_port

TORCHRUN = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "node01", "MASTER_PORT": "29500"}
SLURM = {
    "SLURM_JOB_ID": "123456",
    "SLURM_NTASKS": "8",
    "SLURM_PROCID": "6",
    "SLURM_LOCALID": "2",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURM_JOB_NODELIST": "gpu[01-09]",
}
NO_JOB = JobId(None, "no scheduler's job id")
# what Ray Train's torch backend sets in each worker (ray/train/torch/config.py), in a raylet's worker
RAY_TRAIN = {
    "RAY_RAYLET_PID": "4242",
    "RAY_JOB_ID": "01000000",
    "RANK": "2",
    "LOCAL_RANK": "0",
    "WORLD_SIZE": "4",
    "LOCAL_WORLD_SIZE": "1",
    "NODE_RANK": "2",
    "MASTER_ADDR": "10.0.0.9",
    "MASTER_PORT": "41000",
}


@pytest.mark.parametrize(
    ("node_list", "hosts"),
    [
        ("node01", ["node01"]),
        ("127.0.0.1", ["127.0.0.1"]),
        ("node[01-03,7],gpu5", ["node01", "node02", "node03", "node7", "gpu5"]),
        ("a[8-10]", ["a8", "a9", "a10"]),
        ("gpu5,node[001-002]", ["gpu5", "node001", "node002"]),
        ("rack[1-2]-n[1,3]", ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]),
    ],
)
def test_slurm_host_lists_expand_as_slurm_writes_them(node_list, hosts):
    assert slurm_hosts(node_list) == hosts


@pytest.mark.parametrize(
    ("node_list", "said"),
    [
        ("node[01-03", r"Cannot read the SLURM host list 'node\[01-03': expected e\.g\. 'node\[01-03,7\],gpu5'\."),
        ("a,,b", r"Cannot read the SLURM host list 'a,,b'"),
        ("node[a-3]", r"Cannot read the SLURM host list entry 'node\[a-3\]': 'a-3' is not a number or a range\."),
        ("node[1-x]", r"entry 'node\[1-x\]': '1-x' is not a number or a range"),
    ],
)
def test_a_malformed_slurm_host_list_is_an_error_that_shows_it(node_list, said):
    with pytest.raises(ValueError, match=said):
        slurm_hosts(node_list)


def test_the_slurm_port_is_derived_from_the_job_id_as_jax_does():
    assert slurm_port(123456) == 123456 % 4096 + 61440 == 62016
    assert 61440 <= slurm_port(4095) == 65535


def test_torchrun_variables_are_torchruns_group_with_its_attempt_and_run_id():
    assert launch_of({**TORCHRUN, "TORCHELASTIC_RESTART_COUNT": "2"}) == Launch(
        "torchrun", rank=5, local_rank=1, num_processes=8, address="node01", port=29500, attempt=2, job=NO_JOB
    )
    assert launch_of(TORCHRUN).attempt == 0
    assert launch_of({**TORCHRUN, "TORCHELASTIC_RUN_ID": "none"}).job == NO_JOB  # torchrun's default: no id
    assert launch_of({**TORCHRUN, "TORCHELASTIC_RUN_ID": "exp7"}).job == JobId("exp7", "TORCHELASTIC_RUN_ID")


def test_an_env_launcher_without_a_local_rank_is_read_with_none_there():
    """Kubernetes' PyTorchJob sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT only."""
    pytorch_job = {name: value for name, value in TORCHRUN.items() if name != "LOCAL_RANK"}
    assert launch_of(pytorch_job) == Launch(
        "torchrun", rank=5, local_rank=None, num_processes=8, address="node01", port=29500
    )


def test_srun_tasks_meet_at_the_first_host_of_the_step_on_the_job_id_port():
    expected = Launch(
        "slurm", rank=6, local_rank=2, num_processes=8, address="gpu07", port=62016, job=JobId("123456", "SLURM_JOB_ID")
    )
    assert launch_of(SLURM) == expected
    assert launch_of({**SLURM, "SLURM_STEP_ID": "3"}).job == JobId("123456.3", "SLURM_JOB_ID.SLURM_STEP_ID")
    without_step = {name: value for name, value in SLURM.items() if name != "SLURM_STEP_NODELIST"}
    assert launch_of(without_step).address == "gpu01"
    only_old_name = {**without_step, "SLURM_NODELIST": "old[3-4]"}
    del only_old_name["SLURM_JOB_NODELIST"]
    assert launch_of(only_old_name).address == "old3"
    chosen = launch_of({**SLURM, "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "4242"})
    assert (chosen.launcher, chosen.address, chosen.port) == ("slurm", "10.0.0.7", 4242)
    assert launch_of({**SLURM, "MASTER_PORT": ""}).port == 62016  # an empty MASTER_PORT is none


def test_torchrun_inside_slurm_is_torchruns_group_with_slurms_job_id():
    """One job-id rule whatever formed the group: every process of the job shares SLURM's."""
    launch = launch_of({**SLURM, **TORCHRUN, "TORCHELASTIC_RUN_ID": "none"})
    assert (launch.launcher, launch.rank, launch.address, launch.port) == ("torchrun", 5, "node01", 29500)
    assert launch.job == JobId("123456", "SLURM_JOB_ID")
    assert launch_of({**SLURM, **TORCHRUN, "TORCHELASTIC_RUN_ID": "r1"}).job == JobId("r1", "TORCHELASTIC_RUN_ID")


def test_one_slurm_task_is_no_group_and_a_launcher_of_its_own_is_none():
    single = launch_of({**SLURM, "SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"})
    assert single == Launch("slurm", rank=0, local_rank=0, num_processes=1, job=JobId("123456", "SLURM_JOB_ID"))
    # a SLURM batch script that names no tasks: SLURM's job, no rank
    assert launch_of({"SLURM_JOB_ID": "9"}) == Launch("slurm", job=JobId("9", "SLURM_JOB_ID"))
    own = launch_of({**SLURM, "RANK": "0", "WORLD_SIZE": "1"})  # a launcher of its own set torch's variables
    assert own == Launch("none", job=JobId("123456", "SLURM_JOB_ID"))
    assert launch_of({"WORLD_SIZE": "4"}) == Launch("none")
    assert launch_of({}) == Launch("none", job=NO_JOB)


def test_slurm_without_a_host_list_or_job_id_says_what_to_set():
    nowhere = {name: value for name, value in SLURM.items() if "NODELIST" not in name}
    with pytest.raises(ValueError, match=r"^SLURM started 8 tasks, but neither SLURM_STEP_NODELIST nor") as raised:
        launch_of(nowhere)
    assert str(raised.value).endswith(
        "so keras-dp cannot tell where rank 0 runs. Launch the script with `srun`, or set MASTER_ADDR (and "
        "MASTER_PORT) to rank 0's host."
    )
    assert launch_of({**nowhere, "MASTER_ADDR": "10.0.0.7"}).address == "10.0.0.7"
    no_job = {name: value for name, value in SLURM.items() if name != "SLURM_JOB_ID"}
    with pytest.raises(ValueError, match="SLURM started 8 tasks but SLURM_JOB_ID is not set") as raised:
        launch_of(no_job)
    assert str(raised.value).endswith(
        "so keras-dp cannot derive a rendezvous port. Set MASTER_PORT to a free port, the same for every task."
    )
    assert launch_of({**no_job, "MASTER_PORT": "4242"}).port == 4242


@pytest.mark.parametrize(
    ("environment", "name", "value"),
    [
        ({**TORCHRUN, "RANK": "five"}, "RANK", "five"),
        ({**TORCHRUN, "LOCAL_RANK": "1.0"}, "LOCAL_RANK", "1.0"),
        ({**TORCHRUN, "MASTER_PORT": "http"}, "MASTER_PORT", "http"),
        ({**TORCHRUN, "TORCHELASTIC_RESTART_COUNT": "x"}, "TORCHELASTIC_RESTART_COUNT", "x"),
        ({**SLURM, "SLURM_NTASKS": "eight"}, "SLURM_NTASKS", "eight"),
        ({**SLURM, "SLURM_JOB_ID": "12a"}, "SLURM_JOB_ID", "12a"),
        ({"LSB_JOBID": "5", "JSM_NAMESPACE_RANK": "?"}, "JSM_NAMESPACE_RANK", "?"),
    ],
)
def test_a_variable_that_is_not_an_integer_is_named_with_its_value(environment, name, value):
    with pytest.raises(
        ValueError, match=rf"^The environment variable {name}='{re.escape(value)}' should be an integer\.$"
    ):
        launch_of(environment)


def test_a_ray_train_worker_reads_as_ray_with_the_torch_variables_ray_sets():
    assert launch_of(RAY_TRAIN) == Launch("ray", rank=2, local_rank=0, num_processes=4, address="10.0.0.9", port=41000)
    # Ray Train's tcp:// set-up leaves MASTER_ADDR and MASTER_PORT out: ranks, but nowhere to meet
    tcp = {name: value for name, value in RAY_TRAIN.items() if not name.startswith("MASTER_")}
    assert launch_of(tcp) == Launch("ray", rank=2, local_rank=0, num_processes=4)
    # any other Ray worker (a task, an actor, Ray Train's jax backend): Ray, no rank
    assert launch_of({"RAY_RAYLET_PID": "4242", "RAY_JOB_ID": "01000000"}) == Launch("ray")
    # torchrun started inside a Ray worker is torchrun's group
    assert launch_of({**RAY_TRAIN, "TORCHELASTIC_RUN_ID": "r"}).launcher == "torchrun"


def test_ray_under_slurm_is_ray_unless_slurm_runs_several_tasks():
    """SLURM's tasks keep their group (as before Ray was read); one SLURM task running a raylet
    starts Ray workers, which read as Ray with SLURM's job id."""
    ray_worker = {"RAY_RAYLET_PID": "4242"}
    assert launch_of({**SLURM, **ray_worker}).launcher == "slurm"
    single = launch_of({**SLURM, **ray_worker, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"})
    assert single == Launch("ray", job=JobId("123456", "SLURM_JOB_ID"))


def test_pbs_gives_its_job_id_and_no_rank():
    torque = {"PBS_JOBID": "1672.mgt1", "PBS_TASKNUM": "146", "PBS_NODENUM": "0", "PBS_VNODENUM": "0"}
    assert launch_of(torque) == Launch("pbs", job=JobId("1672.mgt1", "PBS_JOBID"))


def test_lsf_gives_its_job_id_and_jsruns_ranks_where_it_sets_them():
    assert launch_of({"LSB_JOBID": "8080", "LSF_PM_TASKID": "1"}) == Launch("lsf", job=JobId("8080", "LSB_JOBID"))
    jsrun = {"JSM_NAMESPACE_RANK": "3", "JSM_NAMESPACE_LOCAL_RANK": "1", "JSM_NAMESPACE_SIZE": "12"}
    assert launch_of({"LSB_JOBID": "8080", **jsrun}) == Launch(
        "lsf", rank=3, local_rank=1, num_processes=12, job=JobId("8080", "LSB_JOBID")
    )


def test_the_job_id_is_torchruns_run_id_then_slurms_then_pbss_then_lsfs():
    every = {
        "TORCHELASTIC_RUN_ID": "run-7",
        "SLURM_JOB_ID": "1",
        "SLURM_STEP_ID": "2",
        "PBS_JOBID": "p",
        "LSB_JOBID": "l",
    }
    assert job_id_of(every) == JobId("run-7", "TORCHELASTIC_RUN_ID")
    assert job_id_of({**every, "TORCHELASTIC_RUN_ID": "none"}) == JobId("1.2", "SLURM_JOB_ID.SLURM_STEP_ID")
    assert job_id_of({**every, "TORCHELASTIC_RUN_ID": "", "SLURM_STEP_ID": ""}) == JobId("1", "SLURM_JOB_ID")
    assert job_id_of({"SLURM_JOB_ID": "", "SLURM_STEP_ID": "3", "PBS_JOBID": "p"}) == JobId("p", "PBS_JOBID")
    assert job_id_of({"LSB_JOBID": "l"}) == JobId("l", "LSB_JOBID")
    assert job_id_of({}) == NO_JOB
    assert launch_of({"PBS_JOBID": "p", "LSB_JOBID": "l"}).launcher == "pbs"


def test_the_process_environment_is_read_when_none_is_given(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "RAY_RAYLET_PID", "TORCHELASTIC_RUN_ID", "SLURM_STEP_ID", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in SLURM.items():
        monkeypatch.setenv(name, value)
    assert launch_of().address == "gpu07"
    assert job_id_of() == JobId("123456", "SLURM_JOB_ID")
