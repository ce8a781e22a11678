"""Rows to batches on the replicas' devices: where a call's rows come from, each replica's batches
(padded and masked, or split evenly for a model's own step), reading ahead, the ``Sampler`` for a
user's own DataLoader, and predictions put back in input order.

It may import ``_comm`` and ``_internals``, nothing above. It re-exports nothing.
"""
