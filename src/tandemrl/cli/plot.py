"""`tandem plot RUN_DIR [--out PATH]`: write a PNG dashboard of a run and print where it went.

RUN_DIR may be `runs/latest` (a symlink the trainer keeps to the newest run) or `runs` itself.
"""

from __future__ import annotations

from pathlib import Path

from tandemrl.cli.args import ArgumentParser


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="tandem plot", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory holding metrics.jsonl, e.g. runs/latest")
    parser.add_argument("--out", default=None, help="where to write the PNG (default: RUN_DIR/dashboard.png)")
    args = parser.parse_args(argv)

    from tandemrl.logging.plot import plot_run

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist; pass one written by `tandem train`, e.g. runs/latest")
    if not (run_dir / "metrics.jsonl").exists() and (run_dir / "latest").is_dir():
        run_dir = run_dir / "latest"
    print(plot_run(run_dir.resolve(), args.out).resolve())
    return 0
