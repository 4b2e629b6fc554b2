"""`prism-select experiment rows offsets` under this script's old name (the tables live in
:mod:`prism_select.evaluation.tables`; `prism-select experiment rows offsets --help` for the options)."""

import sys

from prism_select.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["experiment", "rows", "offsets", *sys.argv[1:]]))
