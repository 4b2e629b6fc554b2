"""The check the hostile-input and hostile-file tests share: a CLI call that ends in a
named error."""

from prism_select import cli


def fails(argv, capsys, *needles) -> str:
    """``prism-select argv`` exits 2 with a named error that holds every ``needle``."""
    assert cli.main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("prism-select: error: "), err
    for needle in needles:
        assert needle in err, err
    return err
