"""Progress on stderr when it is not a terminal (a log file, CI): a line every few seconds for the
long loops (progress.py), "still compiling" while a compile runs (compile.compiling)."""
import re
import time

import progress
from compile import compiling


def test_lines_when_stderr_is_not_a_terminal(monkeypatch, capsys):
    monkeypatch.setattr(progress, "EVERY_S", 0.0)
    bar = progress.progress(["a", "b", "c"], "quantizing", unit="layer")
    assert isinstance(bar, progress.Lines)  # pytest's captured stderr is no terminal
    assert list(bar) == ["a", "b", "c"]
    lines = capsys.readouterr().err.splitlines()
    assert [re.sub(r" \(\d+ s\)", "", line) for line in lines] == [f"quantizing: {i}/3 layer" for i in (1, 2, 3)]
    with progress.progress(None, "reading weights", total=2, unit="tensor") as bar:
        bar.update()
        bar.set_postfix(perplexity="3.1")
        bar.update()
    assert capsys.readouterr().err.splitlines()[-1].endswith("2/2 tensor (0 s), perplexity 3.1")


def test_still_compiling(capsys):
    with compiling(": then this", every=0.05):
        time.sleep(0.3)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("still compiling (") and len(lines) >= 3
    assert re.fullmatch(r"compiled in \d+\.\d s: then this", lines[-1])
    with compiling(every=5):  # (every=0.05 printed a line once, on a machine busy enough to stall the exit)
        pass
    (line,) = capsys.readouterr().err.splitlines()
    assert re.fullmatch(r"compiled in 0\.\d s", line)
