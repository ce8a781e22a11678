"""How processes start, join and fail: where the scheduler started this process (``cluster``),
process 0's admission of the others (``admission``, speaking ``handshake``, with what only this
user reaches on one host in ``local``), and ``jax.distributed.initialize`` with ending together
on a failure (``group``). It imports only the wings below it (``_loop``, ``_step``, ``_data``,
``_comm``, ``_mesh``), and in fact none of them.
"""
