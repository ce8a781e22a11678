"""``python -m torch_dp.check module:factory --data module:function``: ``check_equivalence`` from a shell.

Trains the model for a few steps on 1 replica and on N, prints the report, and exits 0 when
they are equivalent, 1 when they differ (by design or not: the report says which), 2 on bad
arguments. ``python -m torch_dp.check --help`` lists the options.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from dp_core.keras import run_check_command
from torch_dp._equivalence import check_equivalence


def main(argv: Sequence[str] | None = None) -> int:
    """The exit status of the check on ``argv`` (the command line when None)."""
    return run_check_command(check_equivalence, argv, prog="python -m torch_dp.check")


if __name__ == "__main__":
    sys.exit(main())
