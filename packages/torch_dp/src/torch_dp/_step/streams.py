"""torch's own random generators: the same on every replica, and in a checkpoint.

Every replica draws a step's noise for the whole global batch and keeps its rows (``_step.steps``:
``dp_core.keras.global_batch_draws``), so every replica's streams must be rank 0's, which are the
caller's. A random layer's seed generator state is a model variable (``same_state_as_primary`` copies
it, a checkpoint holds it); an unseeded ``Dropout`` draws on torch's own generator (Keras's fast path),
copied here at every call, written into each checkpoint (``dp_core.keras.model_checkpoint``'s
``random_streams``) and put back where the resumed fit reaches the checkpoint's place, so a resumed
fit draws the uninterrupted one's masks whatever the new process's generator holds.
"""

from __future__ import annotations

import numpy as np
import torch

from dp_core.keras import Start
from torch_dp._comm.collectives import broadcast_object
from torch_dp._comm.replica import Replica

CPU = "cpu"


def same_random_streams(replica: Replica) -> None:
    """Rank 0's torch generator states on every replica: its CPU generator's and its device's."""
    device = torch.device(replica.device)
    cuda = device.type == "cuda"
    states = None
    if replica.is_primary:
        states = (torch.get_rng_state(), torch.cuda.get_rng_state(device) if cuda else None)
    cpu_state, device_state = broadcast_object(states, replica)
    torch.set_rng_state(cpu_state)
    if cuda and device_state is not None:
        torch.cuda.set_rng_state(device_state, device)


def random_streams(replica: Replica) -> dict[str, str]:
    """This replica's torch generator states as a checkpoint records them: each one's bytes as hex text."""
    device = torch.device(replica.device)
    streams = {CPU: torch.get_rng_state().numpy().tobytes().hex()}
    if device.type == "cuda":
        streams[str(device.type)] = torch.cuda.get_rng_state(device).numpy().tobytes().hex()
    return streams


def put_streams_back(start: Start, replica: Replica) -> None:
    """Rank 0's generators set as ``start``'s checkpoint recorded them, then every replica's as rank 0's
    (every replica calls it, at the same place). A checkpoint that recorded none (written before they
    were) leaves them as they are."""
    if replica.is_primary and start.random_streams:
        device = torch.device(replica.device)
        for name, state in start.random_streams.items():
            value = torch.from_numpy(np.frombuffer(bytes.fromhex(state), dtype=np.uint8).copy())
            if name == CPU:
                torch.set_rng_state(value)
            elif name == device.type == "cuda":
                torch.cuda.set_rng_state(value, device)
    if replica.distributed:
        same_random_streams(replica)
