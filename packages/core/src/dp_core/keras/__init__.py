"""dp_core.keras: the Keras layer every keras-dp backend is written on (``pip install dp-core[keras]``).

What makes a trainer Keras-native, written once: the input adapter, model resolution and
building, the learning-rate policy, callbacks and logs, checkpoints and resume, and (in
``internals``) every private Keras attribute keras-dp relies on. A backend package imports
these names and implements ``dp_core.Trainer`` on its own collectives and loop; see
docs/architecture.md. ``import dp_core`` alone never imports this module, nor keras.

The contract, what a backend calls on the way from the user's call to its step:

- the call: ``checked_call`` (every check before anything starts; a ``CheckedCall``; the
  backend's ``CallChecks``, with its ``OwnStepsCheck`` for a model's own steps), then
  ``fit_arguments`` (``FitArguments``);
- the job: ``FitJob``, ``EvaluateJob``, ``PredictJob`` (``Job``), what a trainer hands the
  backend's run, for backend authors (a ``SourceStandIn`` may replace a source where it is not read);
- the inputs: ``Inputs`` (arrays and map-style datasets, read by row), ``BatchSource``
  (batch-yielding sources, each batch a global batch);
- the model: ``build_model``, ``compile_like`` (a copy compiled as the caller's model was, from its
  compile config), ``compile_with`` (from its compile arguments as objects);
- the step's loss: ``replica_losses``, ``check_losses_split``; its random draws: ``global_batch_draws``
  (``GlobalRows``: a replica draws the global batch's noise and keeps its rows);
- the epoch: ``callback_list``, ``needs_every_batch``, ``python_logs``; ``Throughput`` (a callback for users:
  samples/s and step time in an epoch's logs); ``Executions`` (Keras's
  ``steps_per_execution``: which steps the batch hooks surround; ``concatenated`` a group's predictions);
- the memory before training: ``estimate_memory`` (``MemoryEstimate``, ``ShardEstimate``: a replica's
  bytes under each ``shard=`` mode, what ``Trainer.estimate`` returns);
- the learning rate: ``plan_learning_rate``, ``learning_rate_policy_installed``
  (``LearningRatePolicy``);
- checkpoints: ``CheckpointWriter`` (``checkpoints_finished``: its last write waited for),
  ``resumable_checkpoint``, ``restore_model`` (``checkpoint_pairs``: what it assigns), ``start_of``
  (``Start``), ``print_resume`` (the line a resumed fit prints), ``StagedParts`` (a checkpoint whose
  processes each wrote their own parts), ``seed_states_of`` (the random layers' seed states a
  checkpoint records);

Helpers, for what a backend does its own way:

- the checks ``checked_call`` is made of: ``global_batch_size_of``, ``checked_model_and_inputs``,
  ``resolve_model`` (``is_factory``: what it calls), ``require_backend``, ``require_compiled``, ``overrides``;
- inputs: ``validation_inputs``, ``FirstRows``, ``batch_source``, ``is_batch_source``,
  ``replica_part``, ``replica_positions``, ``batch_rows``, ``padded_batch_size``, ``flatten``, ``map_structure``;
- losses and the learning rate: ``ReplicaRows``, ``activity_regularizer_divides_by_batch_size``,
  ``KerasSchedule``;
- callbacks and checkpoints: ``verbosity``, ``model_checkpoint``;
- options: ``BATCH_NORM_MODES``, ``check_batch_norm_mode``, ``SHARD_MODES``, ``check_shard_mode``,
  ``check_nonfinite_mode``, ``nonfinite_action``, ``nonfinite_loss_stopped``, ``skipped_message``;
- tools: ``compare_replica_counts``, ``run_check_command``; ``mark_as_trainers`` (a distribution a
  trainer's ``scope()`` made, which calls may run under);
- model parallel: ``LayoutRules`` (``layout=``'s rules, one meaning on every backend), ``spec_axes``;
- ``internals``: every private Keras attribute, with its reason.
"""

# the contract
from dp_core.keras._arguments import FitArguments as FitArguments
from dp_core.keras._arguments import fit_arguments as fit_arguments
from dp_core.keras._batch_terms import BatchTerms as BatchTerms
from dp_core.keras._batch_terms import adopt_batch_terms as adopt_batch_terms
from dp_core.keras._batch_terms import batch_terms as batch_terms
from dp_core.keras._batch_terms import runs_last_batch_whole as runs_last_batch_whole
from dp_core.keras._call import CallChecks as CallChecks
from dp_core.keras._call import CheckedCall as CheckedCall
from dp_core.keras._call import OwnStepsCheck as OwnStepsCheck
from dp_core.keras._call import checked_call as checked_call
from dp_core.keras._callbacks import Throughput as Throughput
from dp_core.keras._callbacks import callback_list as callback_list
from dp_core.keras._callbacks import needs_every_batch as needs_every_batch
from dp_core.keras._callbacks import nonfinite_action as nonfinite_action
from dp_core.keras._checkpoints import CheckpointWriter as CheckpointWriter
from dp_core.keras._checkpoints import StagedParts as StagedParts
from dp_core.keras._checkpoints import Start as Start
from dp_core.keras._checkpoints import checkpoints_finished as checkpoints_finished
from dp_core.keras._checkpoints import print_resume as print_resume
from dp_core.keras._checkpoints import start_of as start_of
from dp_core.keras._distribution import mark_as_trainers as mark_as_trainers
from dp_core.keras._estimate import MemoryEstimate as MemoryEstimate
from dp_core.keras._estimate import ShardEstimate as ShardEstimate
from dp_core.keras._estimate import estimate_memory as estimate_memory
from dp_core.keras._executions import ONE_STEP as ONE_STEP
from dp_core.keras._executions import Executions as Executions
from dp_core.keras._executions import concatenated as concatenated
from dp_core.keras._inputs import Inputs as Inputs
from dp_core.keras._jobs import EvaluateJob as EvaluateJob
from dp_core.keras._jobs import FitJob as FitJob
from dp_core.keras._jobs import Job as Job
from dp_core.keras._jobs import PredictJob as PredictJob
from dp_core.keras._jobs import SourceStandIn as SourceStandIn
from dp_core.keras._learning_rate import LearningRatePolicy as LearningRatePolicy
from dp_core.keras._learning_rate import learning_rate_policy_installed as learning_rate_policy_installed
from dp_core.keras._learning_rate import plan_learning_rate as plan_learning_rate
from dp_core.keras._logs import python_logs as python_logs
from dp_core.keras._losses import check_losses_split as check_losses_split
from dp_core.keras._losses import replica_losses as replica_losses
from dp_core.keras._model import build_model as build_model
from dp_core.keras._model import compile_like as compile_like
from dp_core.keras._model import compile_with as compile_with
from dp_core.keras._random_rows import GlobalRows as GlobalRows
from dp_core.keras._random_rows import global_batch_draws as global_batch_draws
from dp_core.keras._restore import checkpoint_pairs as checkpoint_pairs
from dp_core.keras._restore import restore_model as restore_model
from dp_core.keras._restore import resumable_checkpoint as resumable_checkpoint
from dp_core.keras._seed_states import seed_states_of as seed_states_of
from dp_core.keras._sources import BatchSource as BatchSource

# isort: split
# helpers
from dp_core._batch import padded_batch_size as padded_batch_size
from dp_core._data import flatten as flatten
from dp_core._data import map_structure as map_structure
from dp_core._nonfinite import check_nonfinite_mode as check_nonfinite_mode
from dp_core._nonfinite import skipped_message as skipped_message
from dp_core._nonfinite import stopped as nonfinite_loss_stopped
from dp_core._options import BATCH_NORM_MODES as BATCH_NORM_MODES
from dp_core._options import SHARD_MODES as SHARD_MODES
from dp_core._options import check_batch_norm_mode as check_batch_norm_mode
from dp_core._options import check_shard_mode as check_shard_mode
from dp_core.keras import _internals as internals
from dp_core.keras._arguments import batch_source as batch_source
from dp_core.keras._arguments import checked_model_and_inputs as checked_model_and_inputs
from dp_core.keras._arguments import global_batch_size_of as global_batch_size_of
from dp_core.keras._callbacks import verbosity as verbosity
from dp_core.keras._check_command import run_check_command as run_check_command
from dp_core.keras._checkpoints import model_checkpoint as model_checkpoint
from dp_core.keras._equivalence import compare_replica_counts as compare_replica_counts
from dp_core.keras._inputs import FirstRows as FirstRows
from dp_core.keras._inputs import validation_inputs as validation_inputs
from dp_core.keras._layout import LayoutRules as LayoutRules
from dp_core.keras._layout import spec_axes as spec_axes
from dp_core.keras._learning_rate import KerasSchedule as KerasSchedule
from dp_core.keras._losses import ReplicaRows as ReplicaRows
from dp_core.keras._losses import (
    activity_regularizer_divides_by_batch_size as activity_regularizer_divides_by_batch_size,
)
from dp_core.keras._model import is_factory as is_factory
from dp_core.keras._model import overrides as overrides
from dp_core.keras._model import require_backend as require_backend
from dp_core.keras._model import require_compiled as require_compiled
from dp_core.keras._model import resolve_model as resolve_model
from dp_core.keras._sources import batch_rows as batch_rows
from dp_core.keras._sources import is_batch_source as is_batch_source
from dp_core.keras._sources import replica_part as replica_part
from dp_core.keras._sources import replica_positions as replica_positions

__all__ = [
    "BATCH_NORM_MODES",
    "ONE_STEP",
    "SHARD_MODES",
    "BatchSource",
    "BatchTerms",
    "CallChecks",
    "CheckedCall",
    "CheckpointWriter",
    "EvaluateJob",
    "Executions",
    "FirstRows",
    "FitArguments",
    "FitJob",
    "GlobalRows",
    "Inputs",
    "Job",
    "KerasSchedule",
    "LayoutRules",
    "LearningRatePolicy",
    "MemoryEstimate",
    "OwnStepsCheck",
    "PredictJob",
    "ReplicaRows",
    "ShardEstimate",
    "SourceStandIn",
    "StagedParts",
    "Start",
    "Throughput",
    "activity_regularizer_divides_by_batch_size",
    "adopt_batch_terms",
    "batch_rows",
    "batch_source",
    "batch_terms",
    "build_model",
    "callback_list",
    "check_batch_norm_mode",
    "check_losses_split",
    "check_nonfinite_mode",
    "check_shard_mode",
    "checked_call",
    "checked_model_and_inputs",
    "checkpoint_pairs",
    "checkpoints_finished",
    "compare_replica_counts",
    "concatenated",
    "estimate_memory",
    "fit_arguments",
    "flatten",
    "global_batch_draws",
    "global_batch_size_of",
    "internals",
    "is_batch_source",
    "is_factory",
    "learning_rate_policy_installed",
    "map_structure",
    "mark_as_trainers",
    "model_checkpoint",
    "needs_every_batch",
    "nonfinite_action",
    "nonfinite_loss_stopped",
    "overrides",
    "padded_batch_size",
    "plan_learning_rate",
    "print_resume",
    "python_logs",
    "replica_losses",
    "replica_part",
    "replica_positions",
    "require_backend",
    "require_compiled",
    "resolve_model",
    "restore_model",
    "resumable_checkpoint",
    "run_check_command",
    "runs_last_batch_whole",
    "seed_states_of",
    "skipped_message",
    "spec_axes",
    "start_of",
    "verbosity",
]
