"""What crosses from the caller (rank 0) to the worker replicas: a call's ``Request`` (by value,
with cloudpickle: ``shippable``), how to rebuild the model (Keras's own ``.keras`` format, its
objects by value where that format cannot rebuild it, or the user's factory), the caller's Keras
settings, and the job made ready for the workers (``for_workers``, its arrays shared as
``_processes.shared_arrays`` writes them) and opened in one (``opened``). State (weights,
optimizer) is rank 0's, taken by broadcast (a model sent by value carries weights, overwritten)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import cloudpickle
import keras
import torch

from dp_core import ShardMode
from dp_core.keras import BatchSource, EvaluateJob, FitJob, Inputs, Job
from torch_dp._data.loaders import LoaderOnReplicas, read_on_replicas
from torch_dp._data.sources import Readable, SourceOnPrimary
from torch_dp._loop.trainable import TrainableFlags, set_trainable, trainable_flags
from torch_dp._processes.by_value import pickled_model, unpicklable_attribute, unpickled_model
from torch_dp._processes.compile_arguments import CompileArguments
from torch_dp._processes.custom_objects import custom_objects, lambda_functions, lambdas_by_name, uncompiled_config
from torch_dp._processes.out_of_memory import ran_out_of_memory, rebuild_out_of_memory
from torch_dp._processes.shared_arrays import open_shared
from torch_dp._scope.deferred import deferring
from torch_dp._scope.held import install
from torch_dp._scope.replicas import VariableJob


@dataclass(frozen=True)
class KerasSettings:
    """The caller's global Keras settings, which a spawned worker (a fresh interpreter) would
    otherwise read from its defaults: the dtype policy (``mixed_float16`` set with
    ``keras.mixed_precision.set_global_policy``), ``floatx``, ``epsilon`` and the image format.
    A factory builds the model, and ``Inputs.rows`` casts floats, under them."""

    dtype_policy: str
    floatx: str
    epsilon: float
    image_data_format: str

    @classmethod
    def of_this_process(cls) -> KerasSettings:
        return cls(
            keras.config.dtype_policy().name,
            keras.config.floatx(),
            keras.config.epsilon(),
            keras.config.image_data_format(),
        )

    def apply(self) -> None:
        """Make them this process's settings (before any model is built)."""
        keras.config.set_floatx(self.floatx)
        keras.config.set_dtype_policy(self.dtype_policy)
        keras.config.set_epsilon(self.epsilon)
        keras.config.set_image_data_format(self.image_data_format)


@dataclass(frozen=True)
class ModelSource:
    """How a worker rebuilds the caller's model (its weights come after, by broadcast from
    rank 0): a ``.keras`` file plus the custom classes and functions its config names, the
    model's objects themselves (``pickled``) where Keras's format cannot rebuild it, or the
    user's factory; and what it compiles it with (``compiled``: compile()'s arguments). All
    travel by value (cloudpickle), so classes and factories defined in ``__main__`` or a
    notebook cell reach the workers."""

    keras_file: str | None = None
    custom_objects: dict[str, Any] = field(default_factory=dict)
    factory: Callable[[], keras.Model] | None = None
    compiled: CompileArguments | None = None  # None when not compiled
    loss_scaled: bool = False  # compiled under mixed_float16: its optimizer is a LossScaleOptimizer
    # built in a trainer's scope: the file holds no weights, the worker builds it deferred (``_scope``)
    scoped: bool = False
    mode: ShardMode | None = None
    recompile: bool = False  # the worker's model stays (a scoped one holds its parts): compile it again only
    pickled: bytes | None = None  # the model by value (``_processes.by_value``), not compiled: no file could rebuild it


def ship_model(
    model_argument: Any,
    model: keras.Model,
    directory: str,
    *,
    trains: bool = False,
    scoped: bool = False,
    mode: ShardMode | None = None,
) -> ModelSource:
    """What a worker needs to rebuild ``model``, written to ``directory`` and checked here: a
    model that cannot be saved or loaded back (or, when the call ``trains``, whose optimizer
    comes back with other variables) fails in the caller, before a worker sees it. A ``scoped``
    model travels as its config alone (its parts are made on the replicas)."""
    if not isinstance(model_argument, keras.layers.Layer):  # a factory (a model may be a layer with a trainer)
        return ModelSource(factory=model_argument, scoped=scoped, mode=mode)
    path = os.path.join(directory, "model.json" if scoped else "model.keras")
    loss_scaled = isinstance(getattr(model, "optimizer", None), keras.optimizers.LossScaleOptimizer)
    compiled = CompileArguments.of(model)
    try:
        with lambdas_by_name(model) as lambdas:
            objects = {**custom_objects(model), **lambda_functions(model), **lambdas}
            if scoped:
                with open(path, "w") as f:
                    json.dump(uncompiled_config(model), f)
            else:
                model.save(path)
        source = ModelSource(path, objects, compiled=compiled, loss_scaled=loss_scaled, scoped=scoped, mode=mode)
        with deferring(mode) if scoped else contextlib.nullcontext():  # a scoped model's check makes nothing
            loaded = _loaded(source)
        _check_outputs_kept(model, loaded)
    except Exception as error:
        if ran_out_of_memory(error):  # not the model's format: this process's memory
            raise rebuild_out_of_memory(model.name, error) from error
        if scoped:  # its parts are made on the replicas from its config: it cannot go by value
            raise _not_rebuilt(model, error) from error
        source, loaded = _sent_by_value(model, error, compiled, loss_scaled=loss_scaled, mode=mode)
    set_trainable(loaded, trainable_flags(model))  # a file that loses weights fails here, clearly
    try:
        with deferring(mode) if scoped else contextlib.nullcontext():
            _compiled(loaded, source)
    except Exception as error:
        raise _not_rebuilt(model, error) from error
    if trains:
        with deferring(mode) if scoped else contextlib.nullcontext():
            _check_optimizer_rebuilt(model, loaded)
    return source


def recompiled(model: keras.Model, mode: ShardMode | None) -> ModelSource:
    """A scoped model compiled again since the workers built it: they compile theirs again, keeping its parts."""
    optimizer = getattr(model, "optimizer", None)
    compiled = CompileArguments.of(model)
    return ModelSource(
        custom_objects=custom_objects(model),
        compiled=compiled,
        loss_scaled=isinstance(optimizer, keras.optimizers.LossScaleOptimizer),
        scoped=True,
        mode=mode,
        recompile=True,
    )


def _sent_by_value(
    model: keras.Model,
    saving_error: Exception,
    compiled: CompileArguments | None,
    *,
    loss_scaled: bool,
    mode: ShardMode | None,
) -> tuple[ModelSource, keras.Model]:
    """``model`` by value (``_processes.by_value``) where Keras's format cannot rebuild it, read back
    here as a worker reads it; else a ``TypeError`` naming both failures and the attribute at fault."""
    try:
        source = ModelSource(
            custom_objects={**custom_objects(model, model_config=False), **lambda_functions(model)},
            compiled=compiled,
            loss_scaled=loss_scaled,
            mode=mode,
            pickled=pickled_model(model),
        )
        return source, _loaded(source)
    except Exception as error:
        if ran_out_of_memory(error):
            raise rebuild_out_of_memory(model.name, error) from error
        where = unpicklable_attribute(model)
        raise TypeError(
            f"torch_dp rebuilds the model in its worker processes. Keras's format cannot rebuild '{model.name}' "
            f"({_last_line(saving_error)}), and sending its Python objects by value (cloudpickle) failed too"
            f"{f': {where} cannot be pickled' if where else ''} ({_last_line(error)}). Pass a zero-argument function "
            "that builds and compiles the model instead (trainer.fit(make_model, ...)); it may be defined anywhere, "
            "a notebook cell included."
        ) from error


def _check_outputs_kept(model: keras.Model, loaded: keras.Model) -> None:
    """A ``ValueError`` where Keras's format changed the structure of the model's outputs (a tuple of
    outputs comes back a list, a namedtuple a list): a loss given for that structure would not fit it."""
    try:
        mine = model.output
    except (AttributeError, ValueError):  # a subclassed model never called on Keras inputs: no structure recorded
        return
    try:
        keras.tree.assert_same_structure(mine, loaded.output)
    except (TypeError, ValueError) as error:
        raise ValueError(f"Keras's format gives the model's outputs another structure: {error}") from error


def _last_line(error: Exception) -> str:
    """An error's type and its last line of text (Keras's deserializing errors end with the innermost cause)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[-1][:300] if lines else ''}"


def _not_rebuilt(model: keras.Model, error: Exception) -> TypeError:
    return TypeError(
        f"torch_dp rebuilds the model in its worker processes from model.save(), and saving or loading "
        f"'{model.name}' failed: {type(error).__name__}: {error}. Pass a zero-argument function that builds "
        "and compiles the model instead (trainer.fit(make_model, ...)); it may be defined anywhere, a notebook "
        "cell included. Or give custom layers a get_config() that returns their constructor arguments."
    )


def _check_optimizer_rebuilt(model: keras.Model, loaded: keras.Model) -> None:
    """Keras's loader builds ``model.optimizer`` over every trainable variable: an optimizer
    the caller built over some of them (a GAN's, applied to the discriminator only) comes back
    with other variables, and rank 0's state could not be copied to the workers."""

    def layout(optimizer: Any) -> list[tuple[tuple[int, ...], str]]:
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):  # the file does not say (see receive_model)
            optimizer = optimizer.inner_optimizer
        return [(tuple(v.shape), str(v.dtype)) for v in optimizer.variables]

    mine, theirs = getattr(model, "optimizer", None), getattr(loaded, "optimizer", None)
    if mine is not None and theirs is not None and mine.built and not theirs.built:  # a file without weights
        theirs.build(loaded.trainable_variables)
    if mine is None or theirs is None or not mine.built or layout(mine) == layout(theirs):
        return
    raise TypeError(
        f"torch_dp rebuilds the model in its worker processes from model.save(), and Keras's loader builds "
        f"model.optimizer over all of '{model.name}''s trainable variables: {len(layout(theirs))} optimizer variables "
        f"there against {len(layout(mine))} here (built over some of the variables, as a GAN's optimizer for its "
        "discriminator is). Pass a zero-argument function that builds, compiles and builds the optimizer as you "
        "do (trainer.fit(make_model, ...)); it may be defined anywhere, a notebook cell included."
    )


def receive_model(source: ModelSource, trainable: TrainableFlags, held: keras.Model | None = None) -> keras.Model:
    """The worker's copy of the caller's model (its weights are rank 0's broadcast, later; a scoped
    one's are made by parts at the call). A ``recompile`` compiles the ``held`` one again."""
    if source.scoped:
        install()  # its build may read and set its variables' first values (a factory's set_weights)
    with deferring(source.mode) if source.scoped else contextlib.nullcontext():
        if source.recompile:
            assert held is not None, "a recompile follows the model's first call"
            _compiled(held, source)
            return held
        if source.keras_file is None and source.pickled is None:
            assert source.factory is not None
            return source.factory()
        model = _loaded(source)
        set_trainable(model, trainable)
        _compiled(model, source)
        return model


@contextlib.contextmanager
def _policy_of(source: ModelSource) -> Iterator[None]:
    """compile() wraps the optimizer in a LossScaleOptimizer only under a mixed_float16 policy,
    which the file does not record: the model is loaded and compiled under it when the caller's was."""
    policy = keras.config.dtype_policy()
    if source.loss_scaled:
        keras.config.set_dtype_policy("mixed_float16")
    try:
        yield
    finally:
        keras.config.set_dtype_policy(policy)


def _loaded(source: ModelSource) -> keras.Model:
    """The model of the file, not compiled yet: its optimizer is built over the trainable weights
    when it is, so the caller's trainable choices come first (``set_trainable``). The file is
    the caller's own, written in the user's own folder: its Lambda code is the user's."""
    with _policy_of(source):
        if source.pickled is not None:
            return unpickled_model(source.pickled)
        assert source.keras_file is not None
        if source.scoped:  # its config alone, built deferred (the caller's check too: nothing is made)
            with open(source.keras_file) as f, deferring(source.mode):
                config = json.load(f)
                loaded = keras.saving.deserialize_keras_object(
                    config, custom_objects=source.custom_objects, safe_mode=False
                )
        else:
            loaded = keras.saving.load_model(
                source.keras_file, custom_objects=source.custom_objects, compile=False, safe_mode=False
            )
    return cast(keras.Model, loaded)


def _compiled(model: keras.Model, source: ModelSource) -> None:
    """``model`` compiled as the caller's was, with its compile() arguments."""
    if source.compiled is None:
        return
    # compile(auto_scale_loss=False), which Keras does not record: no LossScaleOptimizer under mixed_float16
    auto_scale_loss = model.dtype_policy.name != "mixed_float16" or source.loss_scaled
    with _policy_of(source), keras.saving.custom_object_scope(source.custom_objects):
        source.compiled.compile(model, auto_scale_loss=auto_scale_loss)


@dataclass(frozen=True)
class Request:
    """One call, as a worker replica receives it: the caller's Keras settings, the model to
    build when it changed (``None``: keep the one from the last call), the layers' trainable
    flags, the job, and whether to take rank 0's state first."""

    settings: KerasSettings
    model: ModelSource | None
    trainable: TrainableFlags
    job: Job | VariableJob
    sync: bool
    key: int | None = None  # a scoped model's key: the workers keep it, with its parts, under it
    forget: tuple[int, ...] = ()  # scoped models the caller let go


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, with ``torch.ops`` saved by name. A function sent by value (a ``train_step``
    defined in ``__main__`` or a notebook) whose code names ``ops`` (``keras.ops.mean``) and uses
    a global ``torch`` makes cloudpickle save ``torch.ops`` as a submodule it needs, but
    ``torch.ops`` is no module and cannot be pickled."""

    def reducer_override(self, obj: Any) -> Any:
        if obj is torch.ops:
            return getattr, (torch, "ops")
        return super().reducer_override(obj)


def _pickled(obj: Any) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer).dump(obj)
    return buffer.getvalue()


def shippable(request: Request) -> bytes:
    """``request`` pickled for the workers; refused, saying why, where they could not run it."""
    compiled = request.model.compiled if request.model is not None else None
    unsent = compiled.unsent if compiled is not None else None
    if unsent is not None and isinstance(request.job, FitJob | EvaluateJob):
        raise TypeError(unsent)
    try:
        return _pickled(request)
    except Exception as error:
        raise TypeError(
            f"torch_dp sends the call's inputs and the model factory to its worker processes by value (cloudpickle), "
            f"and that failed: {type(error).__name__}: {error}. A dataset or factory that holds an open file, a "
            "lock or a connection cannot travel; open such things inside __getitem__ or the factory instead."
        ) from error


def for_workers(job: Job, share: Callable[[Inputs], Inputs]) -> Job:
    """What the worker replicas get of ``job``: its arrays shared (``share``), a batch-yielding
    input as its stand-in (rank 0 reads it and broadcasts each batch; a DataLoader's dataset, which
    each replica reads its own rows of: ``_data.loaders``) and no callbacks (rank 0 runs them, in
    the caller; the loops broadcast what they decide)."""

    def stand_in(inputs: Readable) -> Readable:
        if isinstance(inputs, BatchSource) and read_on_replicas(inputs):
            return LoaderOnReplicas.of(inputs).for_workers()
        if isinstance(inputs, BatchSource):
            return SourceOnPrimary(inputs.first_rows(2), inputs.num_batches)
        return share(inputs) if isinstance(inputs, Inputs) else inputs

    if isinstance(job, FitJob):
        # a stand-in does not know its batches' size: the workers are told rank 0's
        validation_batch_size = job.arguments.validation_global_batch_size if job.validation is not None else None
        arguments = dataclasses.replace(job.arguments, callbacks=(), validation_batch_size=validation_batch_size)
        return _map_inputs(dataclasses.replace(job, arguments=arguments), stand_in)
    job = _map_inputs(job, stand_in)
    return dataclasses.replace(job, callbacks=())


def opened(job: Job) -> Job:
    """A shared job (in a worker) with its arrays memory-mapped."""
    return _map_inputs(job, lambda inputs: open_shared(inputs) if isinstance(inputs, Inputs) else inputs)


def _map_inputs(job: Job, fn: Callable[[Readable], Readable]) -> Job:
    if not isinstance(job, FitJob):
        return dataclasses.replace(job, inputs=fn(job.inputs))
    validation = None if job.validation is None else fn(job.validation)
    arguments = dataclasses.replace(job.arguments, inputs=fn(job.inputs), validation=validation)
    return dataclasses.replace(job, arguments=arguments)
