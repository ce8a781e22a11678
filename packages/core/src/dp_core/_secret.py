"""A job's secret: one value every process of the job holds, and no one else (standard library only).

Set once for the whole job, before its processes start, in ``KERAS_DP_JOB_SECRET``; a process
proves it belongs to the job by answering a challenge with it (an HMAC), never by sending it.
``SET_JOB_SECRET`` is the shell line that sets one (for an sbatch script, before ``srun``; before
``torchrun``; in Ray's ``runtime_env``, see docs/multi-host.md).

>>> job_secret_of({"KERAS_DP_JOB_SECRET": "0123456789abcdef0123456789abcdef"})
b'0123456789abcdef0123456789abcdef'
>>> job_secret_of({}) is None
True
"""

from __future__ import annotations

import os
from collections.abc import Mapping

JOB_SECRET_VARIABLE = "KERAS_DP_JOB_SECRET"
SET_JOB_SECRET = f'export {JOB_SECRET_VARIABLE}=$(python -c "import secrets; print(secrets.token_hex(16))")'
_MIN_CHARACTERS = 16  # secrets.token_hex(16) gives 32


def job_secret_of(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The job's secret from ``KERAS_DP_JOB_SECRET`` (of ``environ``, else this process's
    environment), or ``None`` when it is not set. A value set but too short to be a secret
    (an empty one, as a failed ``$(...)`` leaves) is an error, not "no secret"."""
    value = (os.environ if environ is None else environ).get(JOB_SECRET_VARIABLE)
    if value is None:
        return None
    value = value.strip()
    if len(value) < _MIN_CHARACTERS:
        raise ValueError(
            f"{JOB_SECRET_VARIABLE} is set but holds {len(value)} characters: a job's secret needs at least "
            f"{_MIN_CHARACTERS} (unguessable ones). Set one for the whole job before starting its processes: "
            f"{SET_JOB_SECRET}"
        )
    return value.encode()
