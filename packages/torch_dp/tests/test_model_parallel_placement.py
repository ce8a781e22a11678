"""Model parallel on torch: per-layer placement (``model_to_gpu(Dense(64), gpu_id=0)``, a whole layer on one
mesh column) is refused when the Trainer is made, before any process starts, with the reason and the split
that does the job (``_mesh.placement``)."""

import pytest
import torch

import torch_dp


@pytest.mark.parametrize(
    ("layout", "named"),
    [
        ({"dense_1": 0}, "gpu_id=0"),
        ({"dense_1/kernel": "cuda:1"}, "gpu_id='cuda:1'"),
        ({"dense_1": torch.device("cpu")}, "gpu_id=device(type='cpu')"),
        ({"dense_1/kernel": (None, 1)}, "gpu_id=1"),
    ],
)
def test_a_layer_placed_on_one_column_is_refused_with_the_split_that_does_the_job(layout, named):
    with pytest.raises(ValueError, match="places a whole layer on one device or mesh column") as raised:
        torch_dp.Trainer(mesh=(1, 2), layout=layout)
    message = str(raised.value)
    assert named in message
    assert "{'dense_1/kernel': (None, 'model'), 'dense_1/bias': ('model',)}" in message


def test_partition_specs_and_axis_names_are_not_placements():
    """A rule of None, "model" or a tuple of them is a spec; a boolean is not an index."""
    from torch_dp._mesh.placement import refuse_placement

    refuse_placement({"a/kernel": (None, "model"), "b/kernel": "model", "c": None, "d": (True,)})
