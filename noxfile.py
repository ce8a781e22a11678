"""Every session a user or CI runs. Bare ``nox`` runs the tests of every package and
backend, the cross-backend suite under the oldest and newest Keras allowed, the Keras parity
matrix, torch-dp inside Ray Train, lint, typecheck, a wheel build of every package and the
example notebooks."""

from __future__ import annotations

import functools
import glob
import importlib.util
import os
import shutil
import subprocess
import sys

import nox
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

# Longest first: bare ``nox`` runs two sessions at a time (below), and the long ones set its end.
nox.options.sessions = [
    "tests_torch",
    "parity(keras='newest')",  # keras='nightly' runs on request
    "tests_jax-3.13",
    "tests_jax-3.11",
    "conformance(keras='newest')",  # keras='nightly' runs on request
    "conformance(keras='oldest')",
    "ray",
    "notebooks",
    "typecheck",
    "tests_core_keras",
    "tests_core",
    "build",
    "site",
    "lint",
]
nox.options.reuse_existing_virtualenvs = True
nox.needs_version = ">=2026.10"  # the first with --parallel
# Bare ``nox`` keeps both cores busy: most sessions are half waits (installs, replicas starting, a
# collective's timeout), so two at a time take it from 41.5 minutes to 29.3 on 2 cores. Two, not one per
# core: two virtualenvs on disk at once. A session named on the command line runs alone, its output
# live (nox buffers a parallel session's output until it ends).
_NAMED = {"-s", "--session", "--sessions", "-e", "-k", "--keywords", "-t", "--tags", "-p", "--python"}
_ARGS = sys.argv[1 : sys.argv.index("--")] if "--" in sys.argv else sys.argv[1:]  # before a session's own
if not any(arg.split("=")[0] in _NAMED for arg in _ARGS):
    nox.options.parallel = 2
nox.options.allow_parallel = True  # but the sessions that measure time run alone (allow_parallel=False)
# pip byte-compiles every file it installs (torch alone has thousands), half of an install's time.
# Instead Python compiles a module when it is first imported, into the session's virtualenv, and
# only those: so it must be let write them (an import of torch and keras from source takes 16 s).
os.environ.setdefault("PIP_COMPILE", "0")  # what --no-compile sets (PIP_NO_COMPILE=1 would turn it on)
os.environ.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
if os.environ.get("PIP_COMPILE") == "0":
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

PYTHONS = ["3.10", "3.11", "3.12", "3.13"]


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in {"", "0", "false", "no"}


def _pyenv_root() -> str:
    if root := os.environ.get("PYENV_ROOT"):
        return root
    if shutil.which("pyenv"):
        try:
            return subprocess.run(["pyenv", "root"], capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            pass
    return os.path.expanduser("~/.pyenv")


def _pyenv_bin(pyenv_root: str, version: str) -> str | None:
    """The bin folder of pyenv's newest 3.X.Y install; -dev, free-threaded and virtualenv names don't count."""
    installs = {}
    for python in glob.glob(os.path.join(pyenv_root, "versions", f"{version}.*", "bin", f"python{version}")):
        bin_dir = os.path.dirname(python)
        patch = os.path.basename(os.path.dirname(bin_dir)).removeprefix(f"{version}.")
        if patch.isdigit():
            installs[int(patch)] = bin_dir
    return installs[max(installs)] if installs else None


def _runs(python: str) -> bool:
    try:
        return subprocess.run([python, "-c", ""], capture_output=True).returncode == 0
    except OSError:
        return False


def _find_interpreters() -> None:
    """Put every matrix interpreter on PATH, pyenv's included, so that bare ``nox`` runs them all.

    A pyenv shim answers only for the versions pyenv has active (usually one), so a shim counts
    as found only when pyenv has no install of that version and the shim runs.
    """
    pyenv_root = _pyenv_root()
    for version in PYTHONS:
        on_path = shutil.which(f"python{version}")
        if on_path and os.path.basename(os.path.dirname(on_path)) != "shims":
            continue
        if pyenv_bin := _pyenv_bin(pyenv_root, version):
            os.environ["PATH"] = pyenv_bin + os.pathsep + os.environ.get("PATH", "")
        elif not (on_path and _runs(on_path)):
            outcome = "fail (CI is set)" if _in_ci() else "are skipped"
            print(
                f"nox: Python {version} not found (no python{version} on PATH or under pyenv); its sessions"
                f" {outcome}. Install it (pyenv install {version}) to run them.",
                file=sys.stderr,
            )


_find_interpreters()
# On a laptop a missing interpreter skips its sessions; CI must run the whole matrix.
nox.options.error_on_missing_interpreters = _in_ci()


def session(*args, **kwargs):
    """``nox.session``; under CI a session's virtualenv is removed when the session ends.

    Bare ``nox`` makes a dozen virtualenvs, most with torch or jax in them, and a CI runner's disk
    holds only a few at once: so CI holds one at a time. Locally they stay, for reuse."""

    def decorate(func):
        @functools.wraps(func)  # keeps nox.parametrize's marks and the docstring nox -l prints
        def run(session: nox.Session, **params: str) -> None:
            try:
                func(session, **params)
            finally:
                if _in_ci():
                    _remove_virtualenv(session)

        return nox.session(*args, **kwargs)(run)

    return decorate


def _remove_virtualenv(session: nox.Session) -> None:
    location = getattr(session.virtualenv, "location", None)
    if location and os.path.isdir(location):
        shutil.rmtree(location, ignore_errors=True)
        free = shutil.disk_usage(os.path.dirname(location)).free
        session.log(f"removed this session's virtualenv (CI): {free / 2**30:.1f} GiB free")


# The CPU wheel. Any other torch spec makes pip fetch a multi-GB CUDA build, so every
# session that installs torch pins it first and constrains it afterwards.
TORCH = "torch==2.13.0"
TEST_TOOLS = ["pytest>=8", "hypothesis>=6.100", "pytest-timeout>=2.3"]
# The getting-started pages' TensorBoard path without tensorflow (test_first_day): torch's own writer
# needs tensorboard, jax's page uses tensorboardX; tensorboard's reader checks both.
TENSORBOARD = ["tensorboard>=2.16", "tensorboardX>=2.6"]
REPORT = "matplotlib>=3.8"  # dp-core[report]: the scaling report's plot, which the tests check
CORE = "packages/core"
TORCH_DP = "packages/torch_dp"
JAX_DP = "packages/jax_dp"
JAX_HOST_DEVICES = "4"


def _install_torch(session: nox.Session) -> None:
    session.install(TORCH)
    constraints = os.path.join(session.virtualenv.location, "torch-constraint.txt")
    with open(constraints, "w") as f:
        f.write(TORCH + "\n")
    session.env["PIP_CONSTRAINT"] = constraints


def _install_everything(session: nox.Session, *extra: str) -> None:
    _install_torch(session)
    session.install("-e", CORE, "-e", TORCH_DP, "-e", JAX_DP, *extra)


def _jax_env(session: nox.Session) -> None:
    session.env["KERAS_BACKEND"] = "jax"
    session.env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={JAX_HOST_DEVICES}"


@session(python=PYTHONS)
def tests_core(session: nox.Session) -> None:
    """dp-core alone, in a venv that holds nothing heavy."""
    session.install(CORE, *TEST_TOOLS)
    # The docstring examples run too. The Keras layer needs keras: it runs in tests_core_keras.
    session.run(
        "pytest",
        f"{CORE}/tests",
        f"--ignore={CORE}/tests/keras",
        "--doctest-modules",
        f"{CORE}/src/dp_core",
        f"--ignore={CORE}/src/dp_core/keras",
        *session.posargs,
    )


@session(python="3.11")
def tests_core_keras(session: nox.Session) -> None:
    """dp_core.keras, the Keras layer both backends share, with jax as Keras's backend."""
    session.install("-e", f"{CORE}[keras]", "jax", REPORT, *TEST_TOOLS)
    session.env["KERAS_BACKEND"] = "jax"
    session.run("pytest", f"{CORE}/tests/keras", "--doctest-modules", f"{CORE}/src/dp_core/keras", *session.posargs)


@session(python="3.11", default=False)
def quick(session: nox.Session) -> None:
    """A newcomer's first check, a few minutes: dp-core's tests and torch-dp's fast ones.

    torch-dp's fast tests are those in this process: not its 2-replica gloo runs (``multiprocess``)
    nor its fault and checkpoint files, whose every test starts replicas and kills some. Not in bare
    ``nox``: tests_core and tests_torch run all of these and the rest. ``-- -x`` stops at the first
    failure."""
    _install_torch(session)
    session.install("-e", CORE, "-e", TORCH_DP, REPORT, *TEST_TOOLS)
    session.run("pytest", f"{CORE}/tests", f"--ignore={CORE}/tests/keras", *session.posargs)
    session.env["KERAS_BACKEND"] = "torch"
    slow = [f"--ignore={TORCH_DP}/tests/{name}" for name in ("test_faults.py", "test_checkpoints.py")]
    session.run("pytest", f"{TORCH_DP}/tests", "-m", "not multiprocess", *slow, *session.posargs)


# The multi-host tests on hosts made of network namespaces (tests/network/hosts.py: root only, else
# skipped with the reason): this lean part runs in bare nox (about a minute), every one in reliability.
HOSTS_LEAN = {
    "torch": ["tests/network/test_hosts_torch.py::test_a_hostname_that_resolves_to_loopback_is_routed_around"],
    "jax": ["tests/network/test_hosts_jax.py"],
}


@session(python="3.11")
def tests_torch(session: nox.Session) -> None:
    """torch-dp on the CPU wheel, 2-process gloo runs included, and two hosts in network namespaces."""
    _install_torch(session)
    session.install("-e", CORE, "-e", TORCH_DP, REPORT, *TEST_TOOLS, *TENSORBOARD)
    session.env["KERAS_BACKEND"] = "torch"
    selection = [] if session.posargs else ["-m", "not heavy"]
    session.run("pytest", "packages/torch_dp/tests", *selection, *session.posargs)
    if not session.posargs:
        session.run("pytest", *HOSTS_LEAN["torch"])


# jax 0.10 is the last for Python 3.11 and the newest (0.12) needs 3.12 or later: the oldest and the
# newest interpreter test different jax releases, so each half of the suite runs once, on one of them.
# The 2-process tests marked every_jax run on both: what they check changed in jax 0.12.
JAX_SPLIT = {"3.11": "multiprocess", "3.13": "(not multiprocess or every_jax)"}


@session(python=list(JAX_SPLIT))
def tests_jax(session: nox.Session) -> None:
    """jax-dp on forced host devices: 2-process and 2-host runs on 3.11, the rest (and ``every_jax``) on 3.13.

    3.11 gets the jax the oldest interpreter gets, which conformance, parity and the notebooks also
    run; 3.13 the newest jax. With arguments (``-s tests_jax-3.13 -- -x``) the whole suite runs."""
    # filelock: the lock of the XLA compile cache the suite shares among its processes (conftest.py)
    session.install("-e", CORE, "-e", JAX_DP, REPORT, "filelock", *TEST_TOOLS, *TENSORBOARD)
    _jax_env(session)
    selection = [] if session.posargs else ["-m", f"{JAX_SPLIT[str(session.python)]} and not heavy"]
    session.run("pytest", "packages/jax_dp/tests", *selection, *session.posargs)
    if not session.posargs and JAX_SPLIT[str(session.python)] == "multiprocess":  # with the 2-process runs
        session.run("pytest", *HOSTS_LEAN["jax"])


@session(python="3.11", default=False)
def heavy(session: nox.Session) -> None:
    """The tests marked ``heavy``, left out of bare nox for its time budget: meshes of 4 processes, long fits.

    Among them the GPU check's CPU rehearsal of every part (bare nox rehearses one part of each kind).

    Both packages, each under its backend, then tests/ (about 7 minutes on 2 cores). Run it before a release,
    and after a change to what they test (``torch_dp/_mesh``, Ctrl-C across processes, benchmarks/gpu_check*)."""
    _install_everything(session, REPORT, "filelock", *TEST_TOOLS)
    session.run("pytest", "packages/torch_dp/tests", "-m", "heavy", *session.posargs, env={"KERAS_BACKEND": "torch"})
    _jax_env(session)
    session.run("pytest", "packages/jax_dp/tests", "-m", "heavy", *session.posargs)
    skip = ["--ignore=tests/parity", "--ignore=tests/ray", "--ignore-glob=tests/network/test_hosts_*"]
    session.run("pytest", "tests", *skip, "-m", "heavy", *session.posargs)


def _keras_range() -> SpecifierSet:
    """The Keras versions every package allows, read from their pyproject files."""
    allowed = SpecifierSet()
    for package in (CORE, TORCH_DP, JAX_DP):
        project = nox.project.load_toml(os.path.join(package, "pyproject.toml"))["project"]
        optional = project.get("optional-dependencies", {}).values()
        for spec in [*project.get("dependencies", []), *(spec for extra in optional for spec in extra)]:
            requirement = Requirement(spec)
            if requirement.name == "keras":
                allowed &= requirement.specifier
    return allowed


def _oldest_keras(allowed: SpecifierSet) -> str:
    floors = [Version(spec.version) for spec in allowed if spec.operator in {">=", "~=", "=="}]
    if not floors:
        raise ValueError(
            f"the packages allow keras{allowed}, with no lower bound: add one (keras>=3.x) to their pyproject.toml"
        )
    return str(max(floors))


@session(python="3.11")
@nox.parametrize("keras", ["oldest", "newest", "nightly"])
def conformance(session: nox.Session, keras: str) -> None:
    """The cross-backend suite (one scenario, every backend, the same answer) under the oldest, newest or nightly Keras.

    A Keras release that moves a private attribute fails here first (``-s "conformance(keras='oldest')"``
    for one): dp_core.keras and every package's imports run under the oldest Keras the packages allow,
    the rest of tests/ (listeners, GPU check, fault matrix, READMEs' numbers, the demo, every Python block of
    the READMEs and docs/ run as pasted) under the newest, where the parity matrix compares the backends.
    ``keras='nightly'``, on request, runs both halves under ``keras-nightly``, the next release."""
    allowed = _keras_range()
    pinned = f"keras=={_oldest_keras(allowed)}" if keras == "oldest" else f"keras{allowed}"
    _install_everything(session, pinned, REPORT, *TEST_TOOLS)
    if keras == "newest":
        # A reused venv keeps the Keras it was made with until told to upgrade.
        session.install("--upgrade", pinned)
    if keras == "nightly":
        _install_keras_nightly(session)
    # Keras imports only with a backend chosen (its default, tensorflow, is not installed).
    version = "import jax, keras; print('keras', keras.__version__, 'on jax', jax.__version__)"
    session.run("python", "-c", version, env={"KERAS_BACKEND": "jax"})
    session.env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={JAX_HOST_DEVICES}"
    if keras in {"oldest", "nightly"}:
        # What a Keras release can break (the scenarios, every public name importing); the listeners,
        # the GPU check's logic and the fault matrix's names do not depend on it: they run under the newest.
        session.run("pytest", "tests/test_conformance.py", "tests/test_packages.py", *session.posargs)
        session.run("pytest", f"{CORE}/tests/keras", *session.posargs, env={"KERAS_BACKEND": "jax"})
        # Keras's own model.fit beside an open torch Trainer, and under torchrun in the user's own default
        # group (3.16 turns to DDP whenever it sees a default process group)
        torch_env = {"KERAS_BACKEND": "torch"}
        session.run("pytest", f"{TORCH_DP}/tests/test_keras_sees_no_group.py", *session.posargs, env=torch_env)
        torchrun = [f"{TORCH_DP}/tests/test_two_replicas.py", "-k", "users_own_default_group"]
        session.run("pytest", *torchrun, *session.posargs, env=torch_env)
        # model parallel on torch (issue 46: Keras 3.10 to 3.16): the (1, 2) mesh's fit against model.fit and the
        # refusals (about 40 s); the rest of the mesh tests run under the newest in tests_torch
        mesh = [f"{TORCH_DP}/tests/test_model_parallel.py", "-m", "not heavy"]
        session.run("pytest", *mesh, *session.posargs, env=torch_env)
    if keras == "nightly":  # torch-dp against Keras's own torch loop with steps_per_execution (3.16 on)
        groups = [f"{TORCH_DP}/tests/test_steps_per_execution.py", "-k", "keras_316"]
        session.run("pytest", *groups, *session.posargs, env={"KERAS_BACKEND": "torch"})
    if keras in {"newest", "nightly"}:  # dp_core.keras under the newest Keras is tests_core_keras's
        # tests/ holds the docs' Python blocks run as pasted (test_doc_snippets.py, 1.3 minutes): both backends are here
        # tests/network's hosts made of network namespaces: their lean part in tests_torch and tests_jax
        # (HOSTS_LEAN), every one in reliability; its listeners' tests run here
        # tests/test_conformance.py: under the oldest Keras here; under the newest, parity compares the backends
        skip = ["--ignore=tests/parity", "--ignore=tests/ray", "--ignore-glob=tests/network/test_hosts_*"]
        if keras == "newest" and not session.posargs:
            skip.append("--ignore=tests/test_conformance.py")
        selection = [] if session.posargs else ["-m", "not heavy"]  # the GPU check's every part: nox -s heavy
        session.run("pytest", "tests", *skip, *selection, *session.posargs)
        if not session.posargs:  # jax-dp reading a torch DataLoader (issue 43, item 10): tests_jax has no torch
            beside_torch = [f"{JAX_DP}/tests/test_keras_surface.py", "-k", "dataloader_over_an_iterable_dataset"]
            session.run("pytest", *beside_torch, env={"KERAS_BACKEND": "jax"})
    if keras == "newest" and not session.posargs:  # Keras's own tests: bare nox runs the fastest passing ones
        for backend in KERAS_SUITE_BACKENDS:  # through each Trainer (nox -s keras_suite runs them all)
            session.run("python", "tests/keras_suite/run.py", "--subset", env={"KERAS_BACKEND": backend})


KERAS_SUITE_BACKENDS = ("torch", "jax")


@session(python="3.11", default=False, allow_parallel=False)
def keras_suite(session: nox.Session) -> None:
    """Keras's own test files (trainer, model, callbacks) with fit/evaluate/predict run by each Trainer.

    tests/keras_suite/run.py runs the test files the Keras wheel ships on plain Keras, then those that
    passed with ``fit``, ``evaluate`` and ``predict`` routed through ``torch_dp.Trainer`` and
    ``jax_dp.Trainer`` of 2 replicas; it writes tests/keras_suite/results/<backend>.json (each test's
    outcome and reason) and the counts and refusals of docs/keras-compatibility.md. Run in full before
    each release; bare ``nox`` runs the fastest passing ones in ``conformance(keras='newest')``."""
    pinned = f"keras{_keras_range()}"
    _install_everything(session, pinned, "requests", *TEST_TOOLS)  # requests: remote_monitor_test.py
    session.install("--upgrade", pinned)
    _install_keras_hub(session)  # the page's generator reads the parity scenarios, some of them keras-hub's
    session.env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={JAX_HOST_DEVICES}"
    for backend in KERAS_SUITE_BACKENDS:
        session.run("python", "tests/keras_suite/run.py", *session.posargs, env={"KERAS_BACKEND": backend})
    session.run("python", "tests/parity/compatibility.py")


@session(python="3.11")
@nox.parametrize("keras", ["newest", "nightly"])
def parity(session: nox.Session, keras: str) -> None:
    """The Keras parity matrix (tests/parity): each scenario under model.fit and each Trainer, compared.

    Every scenario runs under plain Keras and under each backend's Trainer(num_replicas=2), compared
    on weights, History, evaluate and predict, and docs/keras-compatibility.md is checked against the
    scenarios (about 9 minutes on 2 cores; ``-- -k torch`` for one backend, ``-- -k class_weight`` for
    one scenario). ``keras='nightly'``, on request, runs it under ``keras-nightly``, the next release."""
    pinned = f"keras{_keras_range()}"
    _install_everything(session, pinned, "pandas", *TEST_TOOLS)  # pandas: a DataFrame is an input kind
    session.install("--upgrade", pinned)
    _install_keras_hub(session)
    if keras == "nightly":  # and keras-hub's nightly: its release imports names keras-nightly moved
        _install_keras_nightly(session)
        session.run("python", "-m", "pip", "uninstall", "--yes", "keras-hub", "keras-hub-nightly")
        session.install("--pre", "--no-deps", "keras-hub-nightly")
    session.env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={JAX_HOST_DEVICES}"
    selection = [] if session.posargs else ["-m", "not heavy"]  # its heavy scenarios: -- -m heavy
    session.run("pytest", "tests/parity", *selection, *session.posargs)


def _install_keras_hub(session: nox.Session) -> None:
    # keras-hub's models from configs; without its dependencies, which name tensorflow-text
    # (and tensorflow), but with the light ones its import needs
    session.install("--no-deps", "keras-hub>=0.32,<0.33")
    session.install("regex", "kagglehub", "tokenizers")


@session(python="3.11", allow_parallel=False, default=False)
def bench_scope_memory(session: nox.Session) -> None:
    """A 100 M-parameter keras-hub GPT-2 built in each Trainer's scope, from construction to saved file.

    jax-dp on 4 CPU devices (the bytes each device holds), torch-dp on 4 replicas each in a memory
    cgroup capped below the weights + AdamW slots (root and cgroup v1's memory controller needed),
    each against ``model.fit``; results in docs/benchmarks/scope_memory_{jax,torch}.json and the
    numbers of docs/sharding.md (about 15 minutes on 2 cores; ``-- --quick`` writes nothing)."""
    _install_everything(session, f"keras{_keras_range()}", "h5py")
    _install_keras_hub(session)
    session.run("python", "benchmarks/scope_memory_jax.py", *session.posargs, env={"KERAS_BACKEND": "jax"})
    session.run("python", "benchmarks/scope_memory_torch.py", *session.posargs, env={"KERAS_BACKEND": "torch"})
    if "--quick" not in session.posargs:
        session.run("python", "benchmarks/readme_numbers.py")


def _install_keras_nightly(session: nox.Session) -> None:
    """keras-nightly in place of keras: it installs the same ``keras`` module under another name, so
    both go first, or removing one leaves the other's files half gone in a reused venv."""
    session.run("python", "-m", "pip", "uninstall", "--yes", "keras", "keras-nightly")
    session.install("--pre", "keras-nightly")


@session(python="3.11")
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole repo."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@session(python="3.11")
def typecheck(session: nox.Session) -> None:
    """pyright over the sources of every package, with their stacks installed."""
    _install_everything(session, "pyright>=1.1.380")
    session.run("pyright", *session.posargs)


@session(python="3.11")
def build(session: nox.Session) -> None:
    """A wheel and sdist per package, into dist/."""
    session.install("build>=1.2")
    for package in (CORE, TORCH_DP, JAX_DP):
        session.run("python", "-m", "build", "--outdir", "dist", package)


@session(python="3.11")
def notebooks(session: nox.Session) -> None:
    """The example notebooks, each run top to bottom by a Jupyter kernel on this session's Python.

    ``examples/run_notebooks.py`` runs them; ``-- examples/notebook_jax.ipynb`` runs one."""
    _install_everything(session, "scikit-learn>=1.3", "nbclient>=0.10", "nbformat>=5.10", "ipykernel>=6.29")
    notebooks = session.posargs or ["examples/notebook_torch.ipynb", "examples/notebook_jax.ipynb"]
    session.run("python", "examples/run_notebooks.py", "--timeout", "300", *notebooks)


@session(python="3.11", allow_parallel=False)
def demo(session: nox.Session) -> None:
    """The main job: a convnet on scikit-learn's digits, N replicas vs 1 (``-- --backend jax --replicas 4``)."""
    _install_everything(session, "scikit-learn>=1.3", "matplotlib>=3.8")
    session.run("python", "examples/demo.py", *session.posargs)


@session(python="3.11", allow_parallel=False)
def bench(session: nox.Session) -> None:
    """Throughput, weak scaling, start-up and memory against what a user would otherwise write.

    About 23 minutes on 2 idle cores; writes docs/benchmarks/*.json, docs/benchmarks.md and the
    READMEs' numbers. ``-- --quick`` is a smoke run that writes under .nox, not docs/."""
    _install_everything(session, "psutil>=5.9", "matplotlib>=3.8")
    results, page = "docs/benchmarks", "docs/benchmarks.md"
    if "--quick" in session.posargs:
        results = session.create_tmp()
        page = os.path.join(results, "benchmarks.md")
    session.run("python", "benchmarks/bench_torch.py", "--output", f"{results}/torch.json", *session.posargs)
    breakdown = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
    session.run(
        "python",
        *breakdown,
        "benchmarks/torch_step_breakdown.py",
        "--output",
        f"{results}/torch_steps.json",
        env={"OMP_NUM_THREADS": "1"},
    )
    session.run("python", "benchmarks/bench_jax.py", "--output", f"{results}/jax.json", *session.posargs)
    session.run(
        "python", "benchmarks/bench_interactive.py", "--output", f"{results}/interactive.json", *session.posargs
    )
    session.run("python", "benchmarks/report.py", "--results", results, "--output", page)
    if "--quick" not in session.posargs:  # the READMEs and docs state the new numbers (tests/test_readme_numbers.py)
        session.run("python", "benchmarks/readme_numbers.py", "--results", results)


@session(python="3.11", allow_parallel=False)
def bench_features(session: nox.Session) -> None:
    """The benchmarks of what goes beyond a data-parallel ``fit``, each into its section of docs/benchmarks.md.

    Gradient accumulation, the scaling report's overhead, synchronized BatchNorm against torch's,
    model-parallel memory per device (jax) and per process (torch), sharded state's (``shard=``) memory
    and speed on each backend, and torch-dp's ``"full"`` prefetch (about 45 minutes on 2 idle cores;
    ``-- --quick`` is a smoke run of each that writes nothing under docs/)."""
    _install_everything(session, "psutil>=5.9", "matplotlib>=3.8")
    quick = "--quick" in session.posargs
    scratch = session.create_tmp()
    session.run("python", "benchmarks/bench_accumulation.py", *(["--quick"] if quick else []))
    session.run("python", "benchmarks/bench_profile.py", *(["--quick"] if quick else []))
    syncbn = os.path.join(scratch, "syncbn.json") if quick else "docs/benchmarks/syncbn.json"
    session.run("python", "benchmarks/bench_syncbn.py", "--output", syncbn, *(["--quick"] if quick else []))
    memory = ["--output", os.path.join(scratch, "model_parallel.json"), "--no-page"] if quick else []
    session.run("python", "benchmarks/model_parallel_memory.py", *memory, env={"KERAS_BACKEND": "jax"})
    torch_memory = ["--quick", "--output", os.path.join(scratch, "model_parallel_torch.json"), "--no-page"]
    torch_memory = torch_memory if quick else []  # torch's (1, 2) mesh against 2 data-parallel replicas
    session.run("python", "benchmarks/model_parallel_memory_torch.py", *torch_memory, env={"KERAS_BACKEND": "torch"})
    # shard=: memory per replica, a model that fits only sharded, each mode's speed (--quick writes no page)
    for backend in ("torch", "jax"):
        output = ["--quick", "--output", os.path.join(scratch, f"sharding_{backend}.json")] if quick else []
        session.run("python", f"benchmarks/sharding_memory_{backend}.py", *output, env={"KERAS_BACKEND": backend})
    # torch-dp's shard="full" with and without prefetch, against unsharded, on 2 and 4 replicas
    prefetch = ["--quick", "--output", os.path.join(scratch, "prefetch_torch.json")] if quick else []
    session.run("python", "benchmarks/prefetch_torch.py", *prefetch, env={"KERAS_BACKEND": "torch"})
    if not quick:  # the docs pages state some of these numbers (tests/test_readme_numbers.py)
        session.run("python", "benchmarks/readme_numbers.py")


@session(python="3.11", default=False, allow_parallel=False)
def bench_keras_distribution(session: nox.Session) -> None:
    """torch-dp against Keras's own torch DataParallel (keras-nightly), into its section of docs/benchmarks.md.

    Correctness against one-device ``model.fit`` (arrays, a short last batch, weights, BatchNorm
    statistics, predict, evaluate) and speed on the guides' BatchNorm convnet, 2 CPU processes each
    side (about 3 minutes on 2 cores, installs aside; ``-- --quick`` is a smoke run that writes nothing under docs/)."""
    _install_everything(session)
    _install_keras_nightly(session)  # DataParallel on torch is new in Keras 3.16
    session.run("python", "benchmarks/keras_distribution_torch.py", *session.posargs, env={"KERAS_BACKEND": "torch"})
    if "--quick" not in session.posargs:  # docs/migrating.md states its samples/s
        session.run("python", "benchmarks/readme_numbers.py")


@session(python="3.11", allow_parallel=False, default=False)
def bench_steps_per_execution(session: nox.Session) -> None:
    """A one-replica Trainer against model.fit with steps_per_execution 1, 8 and 32, into docs/benchmarks.md.

    Both backends under ``keras-nightly`` (Keras 3.16 runs N > 1 in torch's ``model.fit`` too), the
    small model and the guide's convnet, interleaved rounds in fresh processes (about 18 minutes on 2
    cores; ``-- --quick`` is a smoke run that writes nothing under docs/)."""
    _install_everything(session)
    _install_keras_nightly(session)
    quick = "--quick" in session.posargs
    output = os.path.join(session.create_tmp(), "spe.json") if quick else "docs/benchmarks/steps_per_execution.json"
    session.run("python", "benchmarks/bench_steps_per_execution.py", "--output", output, *session.posargs)
    if not quick:
        session.run("python", "benchmarks/bench_steps_per_execution.py", "--output", output, "--page")


def _fault_tests() -> dict[str, tuple[str, list[str]]]:
    """The tests of the fault matrix (tests/reliability/matrix.py), by group: its Keras backend and node ids."""
    spec = importlib.util.spec_from_file_location("reliability_matrix", "tests/reliability/matrix.py")
    assert spec is not None and spec.loader is not None
    matrix = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = matrix  # dataclasses look their module up there
    spec.loader.exec_module(matrix)
    return {group: (matrix.GROUPS[group][1], ids) for group, ids in matrix.node_ids_by_group().items() if ids}


@session(python="3.11", allow_parallel=False)
def reliability(session: nox.Session) -> None:
    """The fault matrix: every test tests/reliability/matrix.py names, then docs/reliability.md from them.

    Each group runs under its backend, and the page is written from their junit XML (about 20 minutes
    on 2 cores). A row whose test is not named yet stops it before the tests run;
    ``-- --without-pending`` leaves such rows off the page."""
    _install_everything(session, "ray[train]", *TEST_TOOLS)  # ray: the Ray Train row (tests/ray)
    report = ("python", "tests/reliability/report.py", *session.posargs)
    session.run(*report, "--check-rows")
    results = session.create_tmp()
    for stale in glob.glob(os.path.join(results, "*.xml")):
        os.remove(stale)
    junit = ("-o", "junit_family=xunit1", "-o", "junit_duration_report=call")  # the file of each test; call time
    for group, (backend, node_ids) in _fault_tests().items():
        env = {"KERAS_BACKEND": backend}
        if backend == "jax":
            env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={JAX_HOST_DEVICES}"
        # Exit status 1 (tests failed) lets the other groups run: the report names every failed row.
        session.run("pytest", *node_ids, *junit, f"--junitxml={results}/{group}.xml", env=env, success_codes=[0, 1])
    session.run(*report, "--results", results, "--output", "docs/reliability.md")


@session(python="3.11", default=False, allow_parallel=False)
def gpu(session: nox.Session) -> None:
    """Prepares the offline GPU check: the wheels the lent GPU machine lacks, into the ignored .device-wheels/.

    Needs the package index, not a GPU: Keras, keras-hub and what they need for Python 3.12 on
    manylinux x86-64, and wheels of the three packages (benchmarks/fetch_device_wheels.sh, which
    prints the kit's size). On the GPU machine, ``bash benchmarks/device_check.sh`` installs them
    and runs benchmarks/gpu_check.py (docs/benchmarks.md, "GPU check", gives the one call)."""
    session.run("bash", "benchmarks/fetch_device_wheels.sh", *session.posargs, env={"PYTHON": "python"}, external=True)


@session(python="3.11")
def ray(session: nox.Session) -> None:
    """torch-dp inside Ray Train, compared with ``model.fit`` on one process.

    A local Ray cluster of 2 CPU workers runs ``torch_dp.Trainer().fit`` in the process group Ray
    formed (docs/multi-host.md)."""
    _install_torch(session)
    session.install("-e", CORE, "-e", TORCH_DP, "ray[train]", *TEST_TOOLS)
    session.env["KERAS_BACKEND"] = "torch"
    session.run("pytest", "tests/ray", *session.posargs)


DOCS = ["mkdocs-material>=9.5", "mkdocstrings[python]>=0.26"]


@session(python="3.11")
def site(session: nox.Session) -> None:
    """The user guide and API reference built with warnings as errors, alone (under a minute).

    A broken link, anchor or cross-reference fails it. mkdocstrings reads the packages' sources, not
    their imports, so nothing but the docs tools is installed."""
    session.install(*DOCS)
    session.env["NO_MKDOCS_2_WARNING"] = "1"
    session.run("mkdocs", "build", "--strict", "--site-dir", os.path.join(session.create_tmp(), "site"))


@session(python="3.11", default=False)
def docs(session: nox.Session) -> None:
    """The user guide and API reference, built with warnings as errors, and the docs' code run.

    Every Python block of the READMEs and docs/ that is not marked ``<!-- fragment -->`` runs as pasted
    (tests/test_doc_snippets.py, about 1.3 minutes; bare ``nox`` runs it in ``conformance(keras='newest')``);
    ``-- serve`` previews the site instead."""
    _install_everything(session, *DOCS, *TEST_TOOLS)
    session.env["NO_MKDOCS_2_WARNING"] = "1"
    if session.posargs[:1] == ["serve"]:
        session.run("mkdocs", "serve")
    else:
        session.run("mkdocs", "build", "--strict", "--site-dir", "site")
        session.run("pytest", "tests/test_doc_snippets.py", *session.posargs)  # the docs' code


@session(python="3.11", default=False)
def docs_screens(session: nox.Session) -> None:
    """The built docs in a headless Chromium: screenshots, and a failure if any page cuts code off.

    Needs Debian's Chromium (``apt-get install -y chromium``; ``-- --chromium PATH`` for another),
    which playwright drives without downloading a browser. Every page at a desktop and a narrow
    width (``tests/docs_screens.py``); the screenshots of the index and a guide page go to
    docs-screens/ (about a minute once installed)."""
    session.install(*DOCS, "playwright>=1.40")  # mkdocstrings reads the sources from mkdocs.yml's paths
    session.env["NO_MKDOCS_2_WARNING"] = "1"
    site = os.path.join(session.create_tmp(), "site")
    session.run("mkdocs", "build", "--strict", "--site-dir", site)
    session.run("python", "tests/docs_screens.py", "--site", site, "--output", "docs-screens", *session.posargs)
