"""dp-core: the backend-neutral protocols of keras-dp (numpy only).

The Keras layer the backends share is ``dp_core.keras`` (``pip install dp-core[keras]``),
never imported from here.
"""

from importlib.metadata import version as _version

from dp_core._batch import padded_batch_size as padded_batch_size
from dp_core._batch import per_replica_batch_size as per_replica_batch_size
from dp_core._checkpoint import PartsWritten as PartsWritten
from dp_core._checkpoint import commit_checkpoint as commit_checkpoint
from dp_core._checkpoint import save_checkpoint as save_checkpoint
from dp_core._checkpoint import stage_checkpoint as stage_checkpoint
from dp_core._checkpoint import write_process_parts as write_process_parts
from dp_core._checkpoint_format import Checkpoint as Checkpoint
from dp_core._checkpoint_format import CheckpointError as CheckpointError
from dp_core._checkpoint_format import CheckpointVersionError as CheckpointVersionError
from dp_core._checkpoint_format import check_compatible as check_compatible
from dp_core._checkpoint_lock import CheckpointDirError as CheckpointDirError
from dp_core._checkpoint_lock import CheckpointDirInUseError as CheckpointDirInUseError
from dp_core._checkpoint_lock import check_checkpoint_dir as check_checkpoint_dir
from dp_core._checkpoint_lock import claim_checkpoint_dir as claim_checkpoint_dir
from dp_core._checkpoint_read import latest_checkpoint as latest_checkpoint
from dp_core._checkpoint_read import list_checkpoints as list_checkpoints
from dp_core._checkpoint_read import load_checkpoint as load_checkpoint
from dp_core._checkpoint_shards import Part as Part
from dp_core._checkpoint_shards import Parts as Parts
from dp_core._cluster import JobId as JobId
from dp_core._cluster import Launch as Launch
from dp_core._cluster import job_id_of as job_id_of
from dp_core._cluster import launch_of as launch_of
from dp_core._cluster import slurm_hosts as slurm_hosts
from dp_core._cluster import slurm_port as slurm_port
from dp_core._doctor import DoctorLine as DoctorLine
from dp_core._doctor import DoctorSection as DoctorSection
from dp_core._doctor import doctor_sections as doctor_sections
from dp_core._doctor import format_doctor as format_doctor
from dp_core._equivalence import EquivalenceReport as EquivalenceReport
from dp_core._flops import PEAK_FLOPS as PEAK_FLOPS
from dp_core._flops import PeakFlops as PeakFlops
from dp_core._flops import datasheet_peak_flops as datasheet_peak_flops
from dp_core._flops import measure_peak_flops as measure_peak_flops
from dp_core._flops import peak_flops as peak_flops
from dp_core._keras_backend import select_keras_backend as select_keras_backend
from dp_core._layout import ReplicaLayout as ReplicaLayout
from dp_core._lr import Constant as Constant
from dp_core._lr import CosineDecay as CosineDecay
from dp_core._lr import LearningRateScaling as LearningRateScaling
from dp_core._lr import Schedule as Schedule
from dp_core._lr import Warmup as Warmup
from dp_core._lr import learning_rate_policy as learning_rate_policy
from dp_core._lr import linear_scaling as linear_scaling
from dp_core._lr import scale_learning_rate as scale_learning_rate
from dp_core._lr import schedule_from_config as schedule_from_config
from dp_core._lr import sqrt_scaling as sqrt_scaling
from dp_core._nonfinite import NonFiniteAction as NonFiniteAction
from dp_core._nonfinite import NonFiniteLoss as NonFiniteLoss
from dp_core._nonfinite import NonFiniteLossError as NonFiniteLossError
from dp_core._one_call import OneCall as OneCall
from dp_core._one_call import TrainerBusy as TrainerBusy
from dp_core._one_call import one_call_at_a_time as one_call_at_a_time
from dp_core._options import BatchNormMode as BatchNormMode
from dp_core._options import ShardMode as ShardMode
from dp_core._preemption import Preempted as Preempted
from dp_core._preemption import PreemptionWatch as PreemptionWatch
from dp_core._scaling import ESTIMATED_FROM_PARTS as ESTIMATED_FROM_PARTS
from dp_core._scaling import NO_STEP_TIMER as NO_STEP_TIMER
from dp_core._scaling import SCALING_PHASES as SCALING_PHASES
from dp_core._scaling import BatchNormSync as BatchNormSync
from dp_core._scaling import FitMeasurements as FitMeasurements
from dp_core._scaling import NoStepTimer as NoStepTimer
from dp_core._scaling import Phase as Phase
from dp_core._scaling import ScalingReport as ScalingReport
from dp_core._scaling import StepTimer as StepTimer
from dp_core._scaling import all_reduce_bound as all_reduce_bound
from dp_core._scaling import bus_bandwidth as bus_bandwidth
from dp_core._scaling import scaling_summary as scaling_summary
from dp_core._scaling_checks import ReplicasOverCoresWarning as ReplicasOverCoresWarning
from dp_core._scaling_checks import available_cores as available_cores
from dp_core._scaling_checks import oversubscription as oversubscription
from dp_core._scaling_checks import slow_speedup as slow_speedup
from dp_core._scaling_checks import suspect_speedup as suspect_speedup
from dp_core._scaling_checks import threads_per_replica as threads_per_replica
from dp_core._scaling_checks import warn_oversubscribed as warn_oversubscribed
from dp_core._scaling_files import publish_scaling_report as publish_scaling_report
from dp_core._scaling_files import read_scaling_reports as read_scaling_reports
from dp_core._scaling_files import scaling_report_folder as scaling_report_folder
from dp_core._scaling_files import write_scaling_report as write_scaling_report
from dp_core._secret import JOB_SECRET_VARIABLE as JOB_SECRET_VARIABLE
from dp_core._secret import SET_JOB_SECRET as SET_JOB_SECRET
from dp_core._secret import job_secret_of as job_secret_of
from dp_core._split import EpochOrder as EpochOrder
from dp_core._split import Shard as Shard
from dp_core._split import Shuffle as Shuffle
from dp_core._split import epoch_order as epoch_order
from dp_core._split import epoch_rows as epoch_rows
from dp_core._split import epoch_steps as epoch_steps
from dp_core._split import num_steps as num_steps
from dp_core._split import split_indices as split_indices
from dp_core._trainer import ModelFactory as ModelFactory
from dp_core._trainer import Trainer as Trainer
from dp_core._trainer import Verbose as Verbose

__version__ = _version("dp-core")

__all__ = [
    "ESTIMATED_FROM_PARTS",
    "JOB_SECRET_VARIABLE",
    "NO_STEP_TIMER",
    "PEAK_FLOPS",
    "SCALING_PHASES",
    "SET_JOB_SECRET",
    "BatchNormMode",
    "BatchNormSync",
    "Checkpoint",
    "CheckpointDirError",
    "CheckpointDirInUseError",
    "CheckpointError",
    "CheckpointVersionError",
    "Constant",
    "CosineDecay",
    "DoctorLine",
    "DoctorSection",
    "EpochOrder",
    "EquivalenceReport",
    "FitMeasurements",
    "JobId",
    "Launch",
    "LearningRateScaling",
    "ModelFactory",
    "NoStepTimer",
    "NonFiniteAction",
    "NonFiniteLoss",
    "NonFiniteLossError",
    "OneCall",
    "Part",
    "Parts",
    "PartsWritten",
    "PeakFlops",
    "Phase",
    "Preempted",
    "PreemptionWatch",
    "ReplicaLayout",
    "ReplicasOverCoresWarning",
    "ScalingReport",
    "Schedule",
    "Shard",
    "ShardMode",
    "Shuffle",
    "StepTimer",
    "Trainer",
    "TrainerBusy",
    "Verbose",
    "Warmup",
    "all_reduce_bound",
    "available_cores",
    "bus_bandwidth",
    "check_checkpoint_dir",
    "check_compatible",
    "claim_checkpoint_dir",
    "commit_checkpoint",
    "datasheet_peak_flops",
    "doctor_sections",
    "epoch_order",
    "epoch_rows",
    "epoch_steps",
    "format_doctor",
    "job_id_of",
    "job_secret_of",
    "latest_checkpoint",
    "launch_of",
    "learning_rate_policy",
    "linear_scaling",
    "list_checkpoints",
    "load_checkpoint",
    "measure_peak_flops",
    "num_steps",
    "one_call_at_a_time",
    "oversubscription",
    "padded_batch_size",
    "peak_flops",
    "per_replica_batch_size",
    "publish_scaling_report",
    "read_scaling_reports",
    "save_checkpoint",
    "scale_learning_rate",
    "scaling_report_folder",
    "scaling_summary",
    "schedule_from_config",
    "select_keras_backend",
    "slow_speedup",
    "slurm_hosts",
    "slurm_port",
    "split_indices",
    "sqrt_scaling",
    "stage_checkpoint",
    "suspect_speedup",
    "threads_per_replica",
    "warn_oversubscribed",
    "write_process_parts",
    "write_scaling_report",
]
