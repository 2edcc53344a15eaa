"""Running `zerotrain` in-process for tests, and the shape of a one-line user error."""

from __future__ import annotations

from zerotrain.cli import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_error(err: str, name: str) -> str:
    """The single error line of `zerotrain <name>` (progress notes aside), checked for shape."""
    assert "Traceback" not in err
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("[zerotrain]")]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"zerotrain {name}: error: "), err
    return lines[0]
