"""Run the example notebooks top to bottom in a real Jupyter kernel, as ``nox -s notebooks`` does in CI.

    python examples/run_notebooks.py examples/notebook_jax.ipynb        # execute; each stops at its first error
    python examples/run_notebooks.py --clear examples/notebook_jax.ipynb  # strip outputs before committing

The kernel runs this very interpreter: its kernelspec is written to a temporary folder with
``sys.executable`` as the program, so a ``python3`` kernel registered elsewhere (the system Python,
another virtualenv) is never picked up instead, and the last cell run checks it. The files stay as
committed, without outputs; ``--output DIR`` keeps the executed copies.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError

KERNEL_NAME = "keras-dp-notebooks"
CHECK_CELL_ID = "which-python"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="+")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one cell may run (default 300)")
    parser.add_argument("--output", help="a folder for the executed copies")
    parser.add_argument("--clear", action="store_true", help="remove outputs and execution counts, execute nothing")
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # each line in order with stderr in a CI log
    if args.clear:
        for path in args.notebooks:
            nbformat.write(cleared(nbformat.read(path, as_version=4)), path)
            print(f"cleared {path}")
        return 0
    failed = []
    with tempfile.TemporaryDirectory() as kernels:
        specs = kernelspec_for_this_python(kernels)
        for path in args.notebooks:
            if not run(path, specs, kernels, timeout=args.timeout, output=args.output):
                failed.append(path)
    if failed:
        print(f"\nfailed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def kernelspec_for_this_python(folder: str) -> KernelSpecManager:
    """A kernelspec manager that knows one kernel: ipykernel on ``sys.executable``."""
    os.makedirs(os.path.join(folder, KERNEL_NAME))
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"Python {sys.version_info.major}.{sys.version_info.minor} ({sys.prefix})",
        "language": "python",
    }
    with open(os.path.join(folder, KERNEL_NAME, "kernel.json"), "w") as f:
        json.dump(spec, f)
    return KernelSpecManager(kernel_dirs=[folder], ensure_native_kernel=False)


def run(path: str, specs: KernelSpecManager, sockets: str, *, timeout: float, output: str | None) -> bool:
    """Execute one notebook in a fresh kernel; print what its cells printed; True when every cell ran."""
    print(f"\n=== {path}", flush=True)
    notebook = nbformat.read(path, as_version=4)
    if not_clean := [cell.get("id", "?") for cell in code_cells(notebook) if cell.outputs or cell.execution_count]:
        print(
            f"{path} was saved with outputs (cells {', '.join(not_clean)}): commit it clean, run"
            f" `python {sys.argv[0]} --clear {path}`",
            file=sys.stderr,
        )
        return False
    notebook.cells.append(nbformat.v4.new_code_cell("import sys\nprint(sys.executable)", id=CHECK_CELL_ID))
    # Unix sockets in our temporary folder where there are any: no ports, nothing on the network.
    transport = {"transport": "ipc", "ip": os.path.join(sockets, "kernel")} if os.name == "posix" else {}
    kernel = KernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=specs, **transport)
    folder = os.path.dirname(os.path.abspath(path))
    client = NotebookClient(notebook, km=kernel, timeout=timeout, resources={"metadata": {"path": folder}})
    started = time.perf_counter()
    error: Exception | None = None
    try:
        client.execute(cleanup_kc=True)  # our kernel manager, so shut the kernel down ourselves (nbclient wouldn't)
    except (CellExecutionError, CellTimeoutError) as failure:
        error = failure
    seconds = time.perf_counter() - started
    for cell in code_cells(notebook):
        if cell.get("id") != CHECK_CELL_ID and (text := printed(cell)):
            print(f"--- cell {cell.get('id', '?')}\n{text}")
    if error is not None:
        print(error, file=sys.stderr)
    ok = error is None
    kernel_python = printed(notebook.cells.pop()).strip()
    if ok and kernel_python != sys.executable:
        print(f"{path} ran on {kernel_python!r}, not on {sys.executable!r}", file=sys.stderr)
        ok = False
    if output:
        os.makedirs(output, exist_ok=True)
        nbformat.write(notebook, os.path.join(output, os.path.basename(path)))
    print(f"=== {path}: {'ok' if ok else 'FAILED'} in {seconds:.1f} s, kernel {sys.executable}", flush=True)
    return ok


def code_cells(notebook: nbformat.NotebookNode) -> list[nbformat.NotebookNode]:
    return [cell for cell in notebook.cells if cell.cell_type == "code"]


def printed(cell: nbformat.NotebookNode) -> str:
    """A cell's text output as a terminal would show it: progress bars redraw with \\r and \\b."""
    text = "".join(
        output.get("text", "") if output.output_type == "stream" else output.get("data", {}).get("text/plain", "")
        for output in cell.get("outputs", [])
        if output.output_type in {"stream", "execute_result"}
    )
    lines = []
    for line in text.rstrip("\n").split("\n"):
        drawn = [part.replace("\b", "") for part in line.split("\r")]
        lines.append(next((part for part in reversed(drawn) if part.strip()), ""))
    return "\n".join(lines)


def cleared(notebook: nbformat.NotebookNode) -> nbformat.NotebookNode:
    for cell in code_cells(notebook):
        cell.outputs = []
        cell.execution_count = None
        cell.metadata.pop("execution", None)
    return notebook


if __name__ == "__main__":
    sys.exit(main())
