"""`prism-select experiment rows shares` under this script's old name (the tables live in
:mod:`prism_select.evaluation.tables`; `prism-select experiment rows shares --help` for the options)."""

import sys

from prism_select.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["experiment", "rows", "shares", *sys.argv[1:]]))
