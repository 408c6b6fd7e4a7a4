"""The installed `colibri` command run as a user runs it, and what a refusal must look like."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

COLIBRI = str(Path(sys.executable).parent / "colibri")


def cli(*args: str, cwd: Path, pythonpath: Path | None = None, env: dict[str, str] | None = None,
        timeout: float = 300) -> subprocess.CompletedProcess:
    """`colibri ARGS` in `cwd`. A `module:factory` argument is imported from PYTHONPATH: `pythonpath`,
    else `cwd` (the user's folder). `env`, when given, is the whole environment instead."""
    if env is None:
        env = dict(os.environ, PYTHONPATH=str(pythonpath if pythonpath is not None else cwd))
    return subprocess.run([COLIBRI, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


def user_env() -> dict[str, str]:
    """The environment of a user's shell: no PYTHONPATH, no pytest variables, no debug switch."""
    return {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "COLIBRI_DEBUG") and not k.startswith("PYTEST_")}


def assert_one_line_error(r: subprocess.CompletedProcess, *texts: str, pattern: str | None = None) -> None:
    """Exit status 1, nothing on stdout, and on stderr one `colibri: error: ` line and no traceback; the
    line holds each of `texts` and, if given, matches the regular expression `pattern`."""
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert r.stdout == "", r.stdout
    assert r.stderr.startswith("colibri: error: ") and r.stderr.count("\n") == 1, r.stderr
    assert "Traceback" not in r.stderr
    for text in texts:
        assert text in r.stderr, r.stderr
    if pattern is not None:
        assert re.search(pattern, r.stderr.strip()), r.stderr
