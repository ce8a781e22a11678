"""What one step does: the jitted steps (``steps``) and a model's own (``custom``), how they run
ahead (``ahead``), their recipes and compile-cache keys (``recipes``, ``compile_cache``), the
training state (``state``), what padded rows may not count (``padding``), metrics, optimizers,
gradient accumulation, the scaling report's pieces (``profile``) and the compiled programs'
all-reduces (``hlo``). It imports only the wings below it (``_data``, ``_comm``, ``_mesh``), never
``_loop`` or ``_processes``.
"""
