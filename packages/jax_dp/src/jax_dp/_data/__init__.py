"""Rows to global batches on the devices: the epoch's plan and batches (``batches``), where rows
come from (``sources``). It imports only the wings below it (``_comm``, ``_mesh``).
"""
