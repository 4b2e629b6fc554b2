"""`prism-select experiment aggregate` under this script's old name (the tables live in
:mod:`prism_select.evaluation.tables`; `prism-select experiment aggregate --help` for the options)."""

import sys

from prism_select.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["experiment", "aggregate", *sys.argv[1:]]))
