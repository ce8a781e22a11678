"""Parity scenarios: Terms computed over a whole batch: metrics of one value per batch, `compute_loss`
overrides, batch-coupled losses.
"""

from __future__ import annotations
