"""Writing the training state back into the caller's model (epoch ends, mid-epoch checkpoints,
batch callbacks) never hands Keras a buffer that the next, donating, step deletes."""

from __future__ import annotations

import jax
import keras
import numpy as np
from jax_dp_helpers import dense_bn_model

from dp_core.keras import Inputs, build_model
from jax_dp._mesh.layout import Placement
from jax_dp._mesh.mesh import make_mesh
from jax_dp._step.optimizers import KerasOptimizer
from jax_dp._step.state import train_state_on_mesh, write_back


def test_variables_written_back_outlive_the_next_donating_step(data):
    x, y, _, _ = data
    model = dense_bn_model("adam")
    build_model(model, Inputs(x, y))
    optimizer = KerasOptimizer(model)
    state = train_state_on_mesh(
        model, optimizer, Placement(make_mesh(2)), previous_optimizer_state=None, metric_sums=None
    )
    written = jax.tree.map(lambda array: np.asarray(array.addressable_data(0)).copy(), state)

    write_back(model, optimizer, state)
    jax.jit(lambda s: jax.tree.map(lambda array: array + 1, s), donate_argnums=0)(state)  # as the next step does

    variables = [*model.trainable_variables, *model.non_trainable_variables, *model.optimizer.variables]
    values = [*written.trainable, *written.non_trainable, *written.optimizer]
    for variable, value in zip(variables, values, strict=True):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(variable), value, err_msg=variable.path)
