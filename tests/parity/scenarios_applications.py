"""Parity scenarios: keras.applications image models with BatchNormalization, built with
`weights=None`.
"""

from __future__ import annotations
