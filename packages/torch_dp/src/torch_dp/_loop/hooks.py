"""Rank 0's callbacks on the whole training state under ``shard=``.

A sharded fit leaves each replica only its own optimizer slots (and with ``"full"`` its own
weights), but a callback may read or write any of them: ``ModelCheckpoint`` saves the model and its
optimizer, ``SwapEMAWeights`` swaps the weights with their moving averages, ``EarlyStopping`` keeps
the best weights. So at each hook a callback acts at, rank 0 gathers the whole state first, and
what the callback changed in it reaches the owners after (``_step.shards``); for a model built in the
scope, whose state may not fit one replica, it reads and writes each variable through its holders
instead, one at a time (``_scope.served``). Hooks no callback acts at (the progress bar's and
History's, or none overridden) cost nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, cast

import keras

from dp_core.keras import internals
from torch_dp._comm.collectives import broadcast_floats
from torch_dp._comm.replica import Replica
from torch_dp._scope.served import served_hook
from torch_dp._step.shards import TrainingState

HOOKS = (
    "on_train_begin",
    "on_epoch_begin",
    "on_train_batch_begin",
    "on_train_batch_end",
    "on_test_begin",
    "on_test_batch_begin",
    "on_test_batch_end",
    "on_test_end",
    "on_epoch_end",
    "on_train_end",
)
_PASSIVE = (keras.callbacks.ProgbarLogger, keras.callbacks.History)  # they read the logs only


def on_whole_state(
    callbacks: keras.callbacks.CallbackList,
    given: Sequence[keras.callbacks.Callback] | None,
    model: keras.Model,
    state: TrainingState,
    replica: Replica,
) -> keras.callbacks.CallbackList:
    """``callbacks`` (rank 0's list, made from the ``given`` ones) with each hook some callback acts
    at run on the whole state of ``model``, when ``state`` is sharded (served variable by variable,
    when held by a scope). Every replica calls it (rank 0's choice of hooks is shared: one small
    broadcast)."""
    if state.mode is None:
        return callbacks
    acting = [
        float(any(internals.overrides_hook(c, hook) for c in given or [] if not isinstance(c, _PASSIVE)))
        for hook in HOOKS
    ]
    hooks = {hook for hook, flag in zip(HOOKS, broadcast_floats(acting, replica), strict=True) if flag}
    if not hooks:
        return callbacks
    internals.dispatch_batch_hooks_inline(callbacks)  # a hook on Keras's thread would run after the state is freed
    return cast(keras.callbacks.CallbackList, _OnWholeState(callbacks, hooks, model, state, replica))


BATCH_HOOKS = tuple(hook for hook in HOOKS if "_batch_" in hook)


def refuse_batch_hooks(callbacks: Sequence[keras.callbacks.Callback] | None) -> None:
    """Before a fit of a model built in a trainer's scope, in the caller: a callback that acts at batch
    hooks would have rank 0 gather the whole state at every batch, which the scope exists to avoid."""
    acting = [c for c in callbacks or [] if not isinstance(c, _PASSIVE) and not _saves_at_epoch_ends_only(c)]
    hooks = [h for h in BATCH_HOOKS if any(internals.overrides_hook(c, h) for c in acting)]
    if not hooks:
        return
    names = sorted({type(c).__name__ for c in acting if any(internals.overrides_hook(c, h) for h in hooks)})
    raise NotImplementedError(
        f"{', '.join(names)} acts at {', '.join(hooks)}, and the model was built in the trainer's scope: rank 0 "
        "would gather the whole state at every batch, which the scope exists to avoid. Act at epoch ends instead "
        "(ModelCheckpoint, EarlyStopping and SwapEMAWeights work there), or build the model outside the scope."
    )


def _saves_at_epoch_ends_only(callback: keras.callbacks.Callback) -> bool:
    """Keras's ``ModelCheckpoint`` with ``save_freq="epoch"``: its batch hook returns at once."""
    return isinstance(callback, keras.callbacks.ModelCheckpoint) and callback.save_freq == "epoch"


class _OnWholeState:
    """A ``CallbackList`` whose ``hooks`` run with rank 0 holding the whole state."""

    def __init__(
        self,
        callbacks: keras.callbacks.CallbackList,
        hooks: set[str],
        model: keras.Model,
        state: TrainingState,
        replica: Replica,
    ) -> None:
        self._callbacks, self._hooks = callbacks, hooks
        self._model, self._state, self._replica = model, state, replica

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._callbacks, name)
        if name not in self._hooks:
            return method

        @functools.wraps(method)
        def on_whole_state(*args: Any, **kwargs: Any) -> Any:
            if self._state.held:
                with self._state.layers_paused(), served_hook(self._model, self._replica):
                    return method(*args, **kwargs)
            with self._state.whole_on_primary(changes_kept=True):
                return method(*args, **kwargs)

        return on_whole_state
