"""Clusters read from the environment (torchrun, SLURM), each process's GPU chosen and made current
before the model exists, and every variable checked to be on it: in one process, GPUs faked."""

import keras
import pytest
import torch
import torch_dp_testing as testing

import torch_dp
from torch_dp._comm.replica import Replica
from torch_dp._processes.cluster import Cluster, cluster_of
from torch_dp._processes.group import Timeouts, device_for
from torch_dp._processes.launchers import make_local_device_current
from torch_dp._processes.pool import ReplicaPool
from torch_dp._step import placement as _placement
from torch_dp._step.placement import check_placement, misplaced_variable

TORCHRUN = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "node01", "MASTER_PORT": "29500"}
SLURM = {
    "SLURM_JOB_ID": "123456",
    "SLURM_NTASKS": "8",
    "SLURM_PROCID": "6",
    "SLURM_LOCALID": "2",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURM_JOB_NODELIST": "gpu[01-09]",
}
LAUNCH_VARIABLES = {*TORCHRUN, *SLURM, "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE", "SLURM_NODELIST"}


def test_torchrun_variables_are_torchruns_group():
    agent_store = {"TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert cluster_of({**TORCHRUN, **agent_store, "TORCHELASTIC_RESTART_COUNT": "2"}) == Cluster(
        "torchrun", rank=5, num_processes=8, local_rank=1, address="node01", port=29500, attempt="2", agent_store=True
    )
    # rank 0's own store is new each attempt; and a host that joined an elastic job later counts fewer restarts
    assert cluster_of({**TORCHRUN, "TORCHELASTIC_RESTART_COUNT": "2"}).keys == "torch_dp/attempt_0"
    assert cluster_of(TORCHRUN).keys == "torch_dp/attempt_0"  # torchrun's default --rdzv-id is "none"
    assert cluster_of({**TORCHRUN, "TORCHELASTIC_RUN_ID": "exp7"}).keys == "torch_dp/exp7/attempt_0"


def test_srun_tasks_meet_at_the_first_host_of_the_step_on_the_job_id_port():
    expected = Cluster("slurm", rank=6, num_processes=8, local_rank=2, address="gpu07", port=62016, job="123456")
    assert cluster_of(SLURM) == expected and expected.keys == "torch_dp/123456/attempt_0"
    assert cluster_of({**SLURM, "SLURM_STEP_ID": "3"}).keys == "torch_dp/123456.3/attempt_0"  # another step, other keys
    # without the step's list, the job's; MASTER_ADDR/MASTER_PORT, when set, win
    without_step = {name: value for name, value in SLURM.items() if name != "SLURM_STEP_NODELIST"}
    assert cluster_of(without_step).address == "gpu01"
    chosen = cluster_of({**SLURM, "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "4242"})
    assert (chosen.address, chosen.port) == ("10.0.0.7", 4242)


def test_torchrun_inside_slurm_is_torchruns_group_and_one_slurm_task_is_no_cluster():
    assert cluster_of({**SLURM, **TORCHRUN}).launcher == "torchrun"
    # the job's id is the scheduler's whatever formed the group: torchrun's default run id names none
    assert cluster_of({**SLURM, **TORCHRUN, "TORCHELASTIC_RUN_ID": "none"}).keys == "torch_dp/123456/attempt_0"
    # a Ray Train worker joins the env:// group Ray's torch backend describes
    assert cluster_of({**TORCHRUN, "RAY_RAYLET_PID": "4321"}) == cluster_of(TORCHRUN)
    assert cluster_of({**SLURM, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) is None
    assert cluster_of({**SLURM, "RANK": "0", "WORLD_SIZE": "1"}) is None  # a launcher of its own
    assert cluster_of({}) is None


def test_slurm_without_a_host_list_or_job_id_says_what_to_set():
    nowhere = {name: value for name, value in SLURM.items() if not name.endswith("NODELIST")}
    with pytest.raises(ValueError, match="set MASTER_ADDR"):
        cluster_of(nowhere)
    with pytest.raises(ValueError, match="Set MASTER_PORT"):
        cluster_of({name: value for name, value in SLURM.items() if name != "SLURM_JOB_ID"})


@pytest.fixture
def gpus(monkeypatch):
    """Fake ``count`` visible GPUs; returns the list of devices made current, in order."""
    chosen = []

    def fake(count):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
        return chosen

    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return fake


@pytest.mark.parametrize(
    ("visible", "local_rank", "expected"),
    [(1, 0, 0), (2, 1, 1), (4, 3, 3), (4, 6, 2), (1, 3, 0)],  # (1, 3): SLURM --gpus-per-task=1
)
def test_a_cluster_process_makes_its_gpu_current_when_torch_dp_is_imported(
    gpus, monkeypatch, visible, local_rank, expected
):
    chosen = gpus(visible)
    monkeypatch.setenv("SLURM_LOCALID", str(local_rank))
    for name in ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_STEP_NODELIST"):
        monkeypatch.setenv(name, SLURM[name])
    make_local_device_current()  # what `import torch_dp` runs
    assert chosen == [expected]


def test_the_trainer_of_a_cluster_process_takes_its_gpu_before_the_model_is_built(gpus, monkeypatch):
    chosen = gpus(4)
    for name, value in {**TORCHRUN, "LOCAL_RANK": "3", "WORLD_SIZE": "4", "RANK": "3"}.items():
        monkeypatch.setenv(name, value)
    trainer = torch_dp.Trainer()  # joins no group yet: that waits for the first call
    assert trainer.num_replicas == 4
    assert trainer._launcher.device == "cuda:3" and chosen == [3]


def test_a_trainer_asked_for_other_replicas_than_srun_started_says_so(gpus, monkeypatch):
    gpus(1)
    for name, value in SLURM.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=r"num_replicas=2\) but slurm started 8 processes.*--ntasks"):
        torch_dp.Trainer(num_replicas=2)


def test_no_cluster_and_no_gpu_makes_nothing_current(gpus):
    chosen = gpus(0)
    make_local_device_current()
    assert chosen == []


def test_a_variable_off_the_replicas_device_is_named_with_where_it_should_be(monkeypatch):
    monkeypatch.delenv("KERAS_TORCH_DEVICE", raising=False)
    model = testing.dense_batchnorm_model()  # on CPU, like every variable here
    assert misplaced_variable(model, Replica(0, 2, "cpu")) is None
    problem = misplaced_variable(model, Replica(1, 2, "cuda:1"))
    assert problem is not None
    assert f"model variable '{model.variables[0].path}'" in problem
    assert "is on cpu, but replica 1 trains on cuda:1" in problem
    assert "create the torch_dp.Trainer before building the model" in problem
    meta = misplaced_variable(model, Replica(0, 2, "meta"))
    assert meta is not None and "trains on meta" in meta
    # a device pinned for every process is named as the cause
    monkeypatch.setenv("KERAS_TORCH_DEVICE", "cpu")
    pinned = misplaced_variable(model, Replica(1, 2, "cuda:1"))
    assert pinned is not None and "KERAS_TORCH_DEVICE=cpu is set" in pinned and "unset it" in pinned


def test_optimizer_variables_are_checked_too():
    model = testing.dense_batchnorm_model("adam")
    model.optimizer.build(model.trainable_variables)
    with keras.device("meta"):
        stray = keras.Variable(0.0, name="stray")
    model.optimizer._variables.append(stray)  # one optimizer variable built elsewhere
    problem = misplaced_variable(model, Replica(0, 2, "cpu"))
    assert problem is not None and "optimizer variable" in problem and "stray" in problem and "is on meta" in problem


def test_every_replica_stops_when_one_holds_a_misplaced_variable(monkeypatch):
    model = testing.dense_batchnorm_model()
    # rank 1 reports a misplaced variable; rank 0's are in place: rank 0 raises too, naming rank 1
    monkeypatch.setattr(_placement, "all_gather_rows", lambda tensor, replica: [tensor, torch.ones_like(tensor)])
    with pytest.raises(RuntimeError, match=r"replica\(s\) \[1\] hold model variables on another device"):
        check_placement(model, Replica(0, 2, "cpu"))
    # no replica reports one: nothing raised
    monkeypatch.setattr(_placement, "all_gather_rows", lambda tensor, replica: [tensor, torch.zeros_like(tensor)])
    check_placement(model, Replica(0, 2, "cpu"))


@pytest.mark.parametrize(("visible", "expected"), [(4, ["cuda:1", "cuda:2", "cuda:3"]), (0, ["cpu", "cpu", "cpu"])])
def test_each_spawned_worker_starts_with_its_own_device_as_keras_default(gpus, monkeypatch, visible, expected):
    """A caller's KERAS_TORCH_DEVICE=cuda:0 (read by Keras once, at import) must not put every
    worker's variables on GPU 0: each worker's environment names its own device."""
    gpus(visible)
    monkeypatch.setenv("KERAS_TORCH_DEVICE", "cuda:0")
    pool = ReplicaPool(4, threads=1, timeouts=Timeouts())
    assert [pool._environment(rank)["KERAS_TORCH_DEVICE"] for rank in (1, 2, 3)] == expected
    assert [device_for(rank) for rank in (1, 2, 3)] == expected  # the device each worker trains on
