"""The command line of ``python -m torch_dp.check`` / ``python -m jax_dp.check``, written once.

Exit status: 0 when the runs are equivalent (every layer within the tolerance), 1 when they
are not, whether by design (the report names the cause) or not; 2 for bad arguments,
including a model or data the trainers refuse (their ``ValueError`` or ``TypeError``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

from dp_core._equivalence import DEFAULT_TOLERANCE, EquivalenceReport
from dp_core._options import BATCH_NORM_MODES

Check = Callable[..., EquivalenceReport]


def run_check_command(check: Check, argv: Sequence[str] | None = None, *, prog: str) -> int:
    """Parse ``argv``, run ``check`` (a backend's ``check_equivalence``), print its report; the exit status."""
    parser = _parser(prog)
    arguments = parser.parse_args(argv)
    model = _load(parser, arguments.model, "the model")
    data = _load(parser, arguments.data, "--data")
    if not callable(data):
        parser.error(f"--data {arguments.data} is a {type(data).__name__}; expected a function returning (x, y).")
    loaded = data()
    if not isinstance(loaded, tuple | list) or len(loaded) != 2:
        parser.error(f"--data {arguments.data}() returned a {type(loaded).__name__}; expected a tuple (x, y).")
    x, y = loaded
    try:
        report = check(
            model,
            x,
            y,
            global_batch_size=arguments.global_batch_size,
            steps=arguments.steps,
            num_replicas=arguments.replicas,
            tolerance=arguments.tolerance,
            seed=arguments.seed,
            batch_norm=arguments.batch_norm,
            rounding_baseline=arguments.rounding_baseline,
            verbose=False,
        )
    except (ValueError, TypeError) as error:  # what the trainers say of a model or data they cannot take
        parser.error(f"{type(error).__name__}: {error}")
    print(report)
    return 0 if report.equivalent else 1


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Train a model for a few steps on 1 replica and on N from the same weights and data order, and "
            "report per layer how far the weights differ. Exit status: 0 equivalent, 1 different (by design "
            "or not: the report says which), 2 bad arguments."
        ),
    )
    parser.add_argument("model", help="module:name of a compiled keras.Model or a zero-argument function returning one")
    parser.add_argument("--data", required=True, help="module:function returning (x, y)")
    parser.add_argument("--global-batch-size", type=_positive, default=64, help="global batch size (default 64)")
    parser.add_argument("--steps", type=_positive, default=5, help="global batches to train (default 5)")
    parser.add_argument("--replicas", type=_positive, default=2, help="replicas to compare with 1 (default 2)")
    parser.add_argument(
        "--tolerance",
        type=_non_negative,
        default=DEFAULT_TOLERANCE,
        help=f"largest relative weight difference still equivalent (default {DEFAULT_TOLERANCE:g})",
    )
    parser.add_argument("--seed", type=int, default=0, help="the fit's seed (default 0)")
    parser.add_argument("--batch-norm", choices=BATCH_NORM_MODES, default="global", help="the trainer's batch_norm")
    parser.add_argument(
        "--rounding-baseline",
        action="store_true",
        help="also train 1 replica with each float input times 1 +- 2**-20, and count up to 10 times what that moves "
        "as rounding (for ill-conditioned models)",
    )
    return parser


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def _load(parser: argparse.ArgumentParser, reference: str, what: str) -> Any:
    """The object ``module:name`` (``name`` may be dotted) names, or a usage error saying why not."""
    module_name, _, attribute = reference.partition(":")
    if not module_name or not attribute:
        parser.error(f"{what}: expected module:name (e.g. my_models:make_model), got {reference!r}.")
    if "" not in sys.path:  # like `python -m`, look in the current directory
        sys.path.insert(0, "")
    try:
        value: Any = importlib.import_module(module_name)
    except ImportError as error:
        parser.error(f"{what}: cannot import module {module_name!r}: {error}")
    for part in attribute.split("."):
        if not hasattr(value, part):
            parser.error(f"{what}: module {module_name!r} has no attribute {attribute!r}.")
        value = getattr(value, part)
    return value
