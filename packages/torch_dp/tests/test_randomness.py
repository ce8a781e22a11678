"""Each replica draws its own dropout masks: no replica's stream repeats another's."""

import types

import keras

from torch_dp._loop.run import decorrelate_randomness


def torch_seeds(rank: int, num_replicas: int, draws: int) -> list[int]:
    """The seeds Keras's torch backend gives torch for ``draws`` dropout calls on replica ``rank``."""
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dropout(0.5)])
    decorrelate_randomness(model, types.SimpleNamespace(rank=rank, num_replicas=num_replicas))
    generator = model.layers[0].seed_generator
    seeds = []
    for _ in range(draws):
        first, second = (int(value) for value in generator.next().tolist())
        seeds.append((first + second) & 0xFFFFFFFF)  # keras.src.backend.torch.random.torch_seed_generator
    return seeds


def test_replica_streams_never_meet_and_rank_0_keeps_the_callers():
    draws = 20_000  # a few epochs of steps; the old offset (7919) made rank 1 repeat rank 0 after 7919
    streams = [torch_seeds(rank, 4, draws) for rank in range(4)]
    for rank in range(1, 4):
        assert not set(streams[0]) & set(streams[rank]), rank
    keras.utils.set_random_seed(1)
    plain = keras.layers.Dropout(0.5)
    keras.Sequential([keras.Input((3,)), plain])
    first, second = (int(value) for value in plain.seed_generator.next().tolist())
    assert streams[0][0] == (first + second) & 0xFFFFFFFF  # what model.fit draws
