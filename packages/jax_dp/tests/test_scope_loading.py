"""``load_weights`` (and keras-hub's ``from_preset``) inside ``Trainer.scope()`` reads each device's
part of a split variable from the file, never the whole variable.

Every read of an h5py dataset is counted (``h5py.Dataset.__getitem__`` wrapped): a split variable is
read as 4 parts of a quarter each, every part once; a whole (replicated) variable once; the loaded
weights equal a plain ``load_weights``'s bitwise and lie where the trainer's rule puts them.
"""

from __future__ import annotations

import collections
from pathlib import Path

import h5py
import keras
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_dp

NUM_DEVICES = 4


class CountedReads:
    """Each read of an h5py dataset while installed: its name and the bytes it returned."""

    def __init__(self) -> None:
        self.reads: list[tuple[str, int]] = []

    def by_dataset(self) -> dict[str, list[int]]:
        found: dict[str, list[int]] = collections.defaultdict(list)
        for name, nbytes in self.reads:
            found[name].append(nbytes)
        return dict(found)


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> CountedReads:
    """Reads by index (``dataset[index]``) and whole (``np.array(dataset)``, Keras's own read)."""
    counter = CountedReads()
    by_index, whole = h5py.Dataset.__getitem__, h5py.Dataset.__array__

    def read(dataset, index):
        value = by_index(dataset, index)
        counter.reads.append((dataset.name, np.asarray(value).nbytes))
        return value

    def read_whole(dataset, *args, **kwargs):
        value = whole(dataset, *args, **kwargs)
        counter.reads.append((dataset.name, value.nbytes))
        return value

    monkeypatch.setattr(h5py.Dataset, "__getitem__", read)
    monkeypatch.setattr(h5py.Dataset, "__array__", read_whole)
    return counter


def build(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((256,))
    hidden = keras.layers.Dense(512, name="wide")(inputs)  # 131,072 elements: split over "batch"
    hidden = keras.layers.Dropout(0.1)(hidden)  # a SeedGenerator's variable, made in the scope too
    return keras.Model(inputs, keras.layers.Dense(128, use_bias=False, name="narrow")(hidden))  # 65,536


@pytest.mark.parametrize("suffix", [".weights.h5", ".keras"])
def test_load_weights_in_the_scope_reads_each_device_s_part_once_and_equals_a_plain_load(
    tmp_path: Path, counted: CountedReads, suffix: str
) -> None:
    saved = build(seed=1)
    path = tmp_path / f"model{suffix}"
    saved.save(path) if suffix == ".keras" else saved.save_weights(path)
    plain = build(seed=2)
    plain.load_weights(path)
    trainer = jax_dp.Trainer(NUM_DEVICES, shard="full")
    with trainer.scope():
        model = build(seed=3)
        counted.reads.clear()
        model.load_weights(path)
    reads = counted.by_dataset()

    wide, narrow = model.get_layer("wide"), model.get_layer("narrow")
    assert wide.kernel.value.sharding.spec == P(None, "batch")  # 256 x 512: the larger dimension split
    assert narrow.kernel.value.sharding.spec == P("batch", None)
    kernel_reads = sorted(reads[name] for name in reads if name.endswith("/vars/0"))
    assert kernel_reads == [[512 * 128 * 4 // NUM_DEVICES] * NUM_DEVICES, [256 * 512 * 4 // NUM_DEVICES] * NUM_DEVICES]
    bias = [reads[name] for name in reads if name.endswith("/vars/1")]
    assert bias == [[512 * 4]]  # replicated: read once, copied device to device
    for want, variable in zip(plain.weights, model.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(variable), keras.ops.convert_to_numpy(want), err_msg=variable.path)
    assert [shard.data.shape for shard in wide.kernel.value.addressable_shards] == [(256, 128)] * NUM_DEVICES


def test_outside_a_scope_keras_reads_each_variable_whole(tmp_path: Path, counted: CountedReads) -> None:
    """The same file loaded by plain Keras (no scope entered for this load): one whole read per variable."""
    build(seed=1).save_weights(tmp_path / "model.weights.h5")
    with jax_dp.Trainer(NUM_DEVICES, shard="full").scope():
        pass  # the hooks are in place from now on; this load is outside any scope
    model = build(seed=2)
    counted.reads.clear()
    model.load_weights(tmp_path / "model.weights.h5")
    assert sorted(counted.by_dataset().values()) == [[512 * 4], [512 * 128 * 4], [256 * 512 * 4]]


def test_a_keras_hub_preset_loads_by_parts_in_the_scope(tmp_path: Path, counted: CountedReads) -> None:
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=512, num_layers=1, num_heads=2, hidden_dim=64, intermediate_dim=256, max_sequence_length=8
    )
    keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None).save_to_preset(str(tmp_path / "preset"))
    plain = keras_hub.models.GPT2CausalLM.from_preset(str(tmp_path / "preset"), preprocessor=None)
    with jax_dp.Trainer(NUM_DEVICES, shard="full").scope():
        counted.reads.clear()
        model = keras_hub.models.GPT2CausalLM.from_preset(str(tmp_path / "preset"), preprocessor=None)
    reads = counted.by_dataset()
    embedding = next(name for name in reads if "token_embedding" in name or "reversible_embedding" in name)
    assert reads[embedding] == [512 * 64 * 4 // NUM_DEVICES] * NUM_DEVICES  # 32,768 elements: split
    assert model.backbone.token_embedding.embeddings.value.sharding.spec == P("batch", None)
    for want, variable in zip(plain.weights, model.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(variable), keras.ops.convert_to_numpy(want), err_msg=variable.path)
