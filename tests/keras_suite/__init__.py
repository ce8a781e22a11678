"""Keras's own test files, run on plain Keras and with fit/evaluate/predict routed through each Trainer."""
