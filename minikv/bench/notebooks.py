"""`python -m minikv bench notebooks`: how long each notebook takes, top to bottom, on this machine.

Instructors plan a session around these seconds, so they are printed by a command, not typed into
INSTRUCTORS.md. Each notebook runs in a fresh kernel through `nbclient` (as nbval runs it), without
writing its outputs back (`--save DIR` writes the executed copies there, so the figures behind a time can be
read); `--cells` adds the slowest cells of each. The load average before and after
is printed too: six busy neighbours double these figures, so say which kind of moment they are from.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_notebook(path: Path, timeout: float,
                 save: Path | None = None) -> tuple[float, list[tuple[float, int, str]], str | None]:
    """(seconds, [(cell seconds, cell index, first line)], error or None) for one notebook; with `save`, the
    executed notebook (outputs included) is written into that folder."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    nb = nbformat.read(str(path), as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    cells, error = [], None
    t0 = time.perf_counter()
    with client.setup_kernel():
        for i, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            c0 = time.perf_counter()
            try:
                client.execute_cell(cell, i)
            except CellExecutionError as err:
                error = f"cell {i}: {str(err).strip().splitlines()[-1][:200]}"
                break
            except CellTimeoutError:
                error = f"cell {i}: over the {timeout:g} s limit (--timeout)"
                break
            except DeadKernelError:
                error = f"cell {i}: the kernel died (out of memory?)"
                break
            finally:
                cells.append((time.perf_counter() - c0, i, (cell.source.splitlines() or [""])[0][:60]))
    seconds = time.perf_counter() - t0
    if save is not None:
        save.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, str(save / path.name))
    return seconds, cells, error


def cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m minikv bench notebooks", description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="*", help="notebooks or folders (default: notebooks/)")
    p.add_argument("--cells", type=int, default=0, metavar="N", help="also print each notebook's N slowest cells")
    p.add_argument("--timeout", type=float, default=600, help="seconds per cell at most (default 600)")
    p.add_argument("--save", type=Path, metavar="DIR", help="write each executed notebook, outputs and all, into DIR")
    args = p.parse_args(argv)
    paths = []
    for given in args.paths or [str(REPO / "notebooks")]:
        q = Path(given)
        paths += sorted(q.glob("*.ipynb")) if q.is_dir() else [q]
    if not paths:
        print("no notebooks found; give notebook files or folders", file=sys.stderr)
        return 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")
    failed, total = 0, 0.0
    for path in paths:
        seconds, cells, error = run_notebook(path, args.timeout, args.save)
        total += seconds
        print(f"{seconds:7.1f} s  {path.name}" + (f"   FAILED at {error}" if error else ""), flush=True)
        for s, i, first in sorted(cells, reverse=True)[:args.cells]:
            print(f"           {s:6.1f} s  cell {i:2d}: {first}")
        failed += error is not None
    print(f"{total:7.1f} s  in all; load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 1 if failed else 0
