"""Models built in ``torch_dp.Trainer.scope()``: variables created without a value, each replica's
part made at the first call, and the parts held by the replicas between calls."""
