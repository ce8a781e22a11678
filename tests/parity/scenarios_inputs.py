"""Parity scenarios: Input kinds and ways of reading them that Keras accepts: pandas, bfloat16,
`steps_per_epoch` with arrays, `shuffle="batch"`.
"""

from __future__ import annotations
