"""`prism-select experiment rows composition` under this script's old name (the tables live in
:mod:`prism_select.evaluation.tables`; `prism-select experiment rows composition --help` for the options)."""

import sys

from prism_select.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["experiment", "rows", "composition", *sys.argv[1:]]))
