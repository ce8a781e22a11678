import os
import sys

# Worker processes unpickle factories and callbacks from torch_dp_testing: put it on the
# path they inherit (spawn copies sys.path; pytest's importlib mode does not add it).
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("KERAS_BACKEND", "torch")
