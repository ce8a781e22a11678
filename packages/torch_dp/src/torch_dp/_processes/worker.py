"""A spawned worker replica's entry point (``pool_worker``), kept alive between calls: it joins
the caller's group, then runs each call the caller sends (``_loop.run.run_job``) until told to stop.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from multiprocessing.connection import Connection
from typing import Any

import cloudpickle
import keras
import torch

from torch_dp._comm.collectives import count_collectives_in
from torch_dp._loop.run import run_job
from torch_dp._loop.trainable import set_trainable
from torch_dp._processes.failures import report_failure
from torch_dp._processes.group import Rendezvous, join_group, leave_group
from torch_dp._processes.spawn import caller_gone, exit_with_parent
from torch_dp._processes.transfer import Request, opened, receive_model
from torch_dp._scope.held import serve_only
from torch_dp._scope.replicas import VariableJob, serve


def pool_worker(
    rank: int,
    num_replicas: int,
    rendezvous: Rendezvous,
    connection: Connection,
    parent: int,
    directory: str,
    entered: Any,
) -> None:
    """A worker replica (rank >= 1): joins the group, then runs each call the caller sends until
    told to stop. A failure is reported to the caller with its traceback, then the process ends
    (the caller tears the pool down and starts a new one at the next call)."""
    # Its own session: a kernel manager that signals the caller's process group (a notebook
    # kernel's shutdown) leaves the workers to notice, clean up and exit on their own.
    os.setsid()
    leftovers = directory if rank == 1 else None
    exit_with_parent(parent, leftovers)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's to handle
    # A daemon to its caller's multiprocessing (which ends it at exit), but a DataLoader's workers
    # are its children: multiprocessing refuses children to a process it marks a daemon.
    multiprocessing.current_process().daemon = False
    try:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        serve_only()  # a scoped model's variables read their own parts here, always
        connection.send(("ready",))
        replica = join_group(rank, num_replicas, rendezvous)
        count_collectives_in(entered, rank)  # shared with the caller, which reads it when one falls silent
        current: keras.Model | None = None  # the last model built outside a scope
        scoped: dict[int, keras.Model] = {}  # every scoped model the caller holds, with its parts
        while (message := connection.recv_bytes()) != b"":
            request: Request = cloudpickle.loads(message)
            request.settings.apply()  # before the model is (re)built and rows are read
            for key in request.forget:
                scoped.pop(key, None)
            if request.key is None:
                if request.model is not None:
                    current = receive_model(request.model, request.trainable)
                model = current
            else:
                if request.model is not None:
                    scoped[request.key] = receive_model(request.model, request.trainable, scoped.get(request.key))
                model = scoped.get(request.key)
            assert model is not None, "the caller sends the model with the first call"
            set_trainable(model, request.trainable)
            if isinstance(request.job, VariableJob):  # the caller reads or writes a scoped model's variable
                serve(model, request.job, replica)
            else:
                run_job(model, opened(request.job), replica, sync=request.sync)
            connection.send(("done",))
        leave_group(replica.group)
        os._exit(0)  # nothing left to tear down that the caller should wait for
    except EOFError:  # the caller's end of the pipe closed: it is gone
        caller_gone(leftovers)
    except BaseException as error:
        report_failure(connection, rank, error, parent=parent, leftovers=leftovers)
