"""The peak anonymous memory (RssAnon) of one `colibri` CLI command, run in a fresh interpreter.

`cli_script(preimports)` is a `python -c` program: it imports `preimports` first (the modules the
command will load, so their own memory counts as the baseline, not as the command's), samples
/proc/self/status's RssAnon on a thread every `interval` seconds while `colibri.cli.main` runs the
arguments it is given, and prints {"before": bytes, "peak": bytes} as one JSON line.
"""

_TEMPLATE = r"""
import json, sys, threading, time

def anon_kib():
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("RssAnon:"))

from colibri.cli import main
{preimports}
peak, done = [anon_kib()], threading.Event()
before = peak[0]

def sample():
    while not done.is_set():
        peak[0] = max(peak[0], anon_kib())
        time.sleep({interval})

sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
try:
    main(sys.argv[1:], standalone_mode=False)
finally:
    done.set()
    sampler.join()
peak[0] = max(peak[0], anon_kib())
print(json.dumps({{"before": before * 1024, "peak": peak[0] * 1024}}))
"""


def cli_script(preimports: str, interval: float) -> str:
    """The sampling program around `colibri.cli.main`, importing `preimports` (Python lines) first."""
    return _TEMPLATE.format(preimports=preimports, interval=interval)
