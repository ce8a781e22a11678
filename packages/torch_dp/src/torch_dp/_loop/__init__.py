"""The loops a replica runs: the jobs (plain data), running one on a replica, the fit loop, the one
epoch skeleton both kinds of train step plug into, evaluate and predict, and checkpoints.

It may import ``_step``, ``_data``, ``_comm`` and ``_internals``, never ``_processes`` or the
package's face. It re-exports nothing.
"""
