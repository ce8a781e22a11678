"""What one step does on a replica: Keras's train, test and predict steps, a model's own steps,
gradient accumulation and buckets, synchronized BatchNormalization, metric logs, rank 0's state on
every replica, variable placement, and the step timer of the scaling report.

It may import ``_data``, ``_comm`` and ``_internals``, never ``_loop``, ``_processes`` or the
package's face. It re-exports nothing.
"""
