"""Every session a user or CI runs. Bare ``nox`` runs the tests of every package and
backend, the cross-backend suite, lint, typecheck and a wheel build of every package."""

from __future__ import annotations

import os

import nox

nox.options.sessions = ["tests_core", "tests_torch", "tests_jax", "conformance", "lint", "typecheck", "build"]
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True

# The CPU wheel. Any other torch spec makes pip fetch a multi-GB CUDA build, so every
# session that installs torch pins it first and constrains it afterwards.
TORCH = "torch==2.13.0"
TEST_TOOLS = ["pytest>=8", "hypothesis>=6.100", "pytest-timeout>=2.3"]
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


@nox.session(python=["3.10", "3.11", "3.12", "3.13"])
def tests_core(session: nox.Session) -> None:
    """dp-core alone, in a venv that holds nothing heavy."""
    session.install(CORE, *TEST_TOOLS)
    # The docstring examples run too; the Keras glue modules need keras, which this venv lacks.
    keras_glue = ["--ignore-glob=*/dp_core/_keras.py", "--ignore-glob=*/dp_core/_resume.py"]
    session.run(
        "pytest", "packages/core/tests", "--doctest-modules", "packages/core/src/dp_core", *keras_glue, *session.posargs
    )


@nox.session(python="3.11")
def tests_torch(session: nox.Session) -> None:
    """torch-dp on the CPU wheel, 2-process gloo runs included."""
    _install_torch(session)
    session.install("-e", CORE, "-e", TORCH_DP, *TEST_TOOLS)
    session.env["KERAS_BACKEND"] = "torch"
    session.run("pytest", "packages/torch_dp/tests", *session.posargs)


@nox.session(python=["3.11", "3.12"])
def tests_jax(session: nox.Session) -> None:
    """jax-dp on forced host devices, 2-process jax.distributed runs included."""
    session.install("-e", CORE, "-e", JAX_DP, *TEST_TOOLS)
    _jax_env(session)
    session.run("pytest", "packages/jax_dp/tests", *session.posargs)


@nox.session(python="3.11")
def conformance(session: nox.Session) -> None:
    """The cross-backend suite: one scenario, every backend, the same answer."""
    _install_everything(session, *TEST_TOOLS)
    session.env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={JAX_HOST_DEVICES}"
    session.run("pytest", "tests", *session.posargs)


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole repo."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python="3.11")
def typecheck(session: nox.Session) -> None:
    """pyright over the sources of every package, with their stacks installed."""
    _install_everything(session, "pyright>=1.1.380")
    session.run("pyright", *session.posargs)


@nox.session(python="3.11")
def build(session: nox.Session) -> None:
    """A wheel and sdist per package, into dist/."""
    session.install("build>=1.2")
    for package in (CORE, TORCH_DP, JAX_DP):
        session.run("python", "-m", "build", "--outdir", "dist", package)


@nox.session(python="3.11")
def demo(session: nox.Session) -> None:
    """The main job: a convnet on scikit-learn's digits, N replicas vs 1 (``-- --backend jax --replicas 4``)."""
    _install_everything(session, "scikit-learn>=1.3", "matplotlib>=3.8")
    session.run("python", "examples/demo.py", *session.posargs)


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    """Throughput, weak scaling, start-up and memory against what a user would otherwise write
    (about 20 minutes on 2 idle cores); ``-- --quick`` is a smoke run that writes under .nox, not docs/."""
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
    session.run("python", "benchmarks/report.py", "--results", results, "--output", page)


@nox.session(python="3.11")
def docs(session: nox.Session) -> None:
    """The user guide and API reference, built with warnings as errors (``-- serve`` to preview)."""
    _install_everything(session, "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26")
    session.env["NO_MKDOCS_2_WARNING"] = "1"
    if session.posargs[:1] == ["serve"]:
        session.run("mkdocs", "serve")
    else:
        session.run("mkdocs", "build", "--strict", "--site-dir", "site")
