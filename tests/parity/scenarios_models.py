"""Parity scenarios: Models no one here wrote: keras-hub backbones from small configs, LoRA, Lambda
layers and plain Python functions.
"""

from __future__ import annotations
