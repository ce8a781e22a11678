"""Model parallel (``Trainer(mesh=..., layout=...)``): a ``("batch", "model")`` grid of processes, each
mesh row one data-parallel replica whose Dense layers are split along the row."""
