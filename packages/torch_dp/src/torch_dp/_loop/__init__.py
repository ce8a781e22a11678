"""The loops a replica runs: running a job (``dp_core.keras``'s ``FitJob``, ``EvaluateJob``,
``PredictJob``) on a replica (``run``), the fit loop, the one epoch skeleton both kinds of train
step plug into, evaluate and predict, and checkpoints.

It may import ``_step``, ``_data``, ``_comm`` and ``_internals``, never ``_processes`` or the
package's face. It re-exports nothing.
"""
