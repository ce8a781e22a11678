"""Rows to global batches on the devices: the epoch's plan and batches (``batches``), where rows
come from (``sources``), and the padding a short last batch carries into the loss (``padding``). It
imports only the wings below it (``_comm``, ``_mesh``).
"""
