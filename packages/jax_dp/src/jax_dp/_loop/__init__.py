"""The loops a replica's host runs: running a job (``dp_core.keras``'s ``FitJob``, ``EvaluateJob``,
``PredictJob``) with the trainer's settings (``run``), the fit loop (``fit``), the one epoch skeleton
that Keras's train step and a model's own plug into (``epochs``; the kinds in ``step_kinds``, the
state its hooks see in ``hooked_state``), when batch-end hooks run and the logs they get
(``reporting``), evaluate and predict (``evaluate``), checkpoints (``checkpoints``) and
preemption (``preemption``). It imports only the wings below it (``_step``, ``_data``, ``_comm``,
``_mesh``), never ``_processes`` or the trainer.
"""
