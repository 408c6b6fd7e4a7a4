"""A colibri command in a fresh interpreter whose import system refuses torch and transformers (a
meta-path finder ahead of the real ones): every refused import is reported on stderr, so a command
that tried one and carried on is seen too."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BLOCKED = ("torch", "transformers")
REFUSED = "refused import of "

# Run as `python -c`: the finder first, then the colibri command with argv from the command line.
LAUNCH = f"""
import sys

class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {BLOCKED!r}:
            print({REFUSED!r} + name, file=sys.stderr)
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, Refuse())
sys.argv = ["colibri", *sys.argv[1:]]
from colibri.cli import main
main()
"""


def colibri_without_torch(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LAUNCH, *args], capture_output=True, text=True, cwd=cwd,
                          timeout=600)
