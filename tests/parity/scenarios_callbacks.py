"""Parity scenarios: What callbacks change in the model or optimizer, at any hook, and how they stop
training.
"""

from __future__ import annotations
