"""How a call's processes start, join and fail: the launchers (this process alone, one of a
cluster's, or a pool of spawned replicas), the pool and its workers' entry point, the process
group, starting and stopping processes, failures and their messages, and what travels to workers.

The top wing: it may import ``_loop``, ``_step``, ``_data``, ``_comm`` and ``_internals``, never
the package's face (``_trainer``, ``_equivalence``). It re-exports nothing.
"""
