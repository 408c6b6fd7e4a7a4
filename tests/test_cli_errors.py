"""Every `colibri` failure is one line on stderr and exit status 1, and each command does what it says.

The commands run as a user runs them: the installed `colibri` script in a fresh process, in a folder
of its own, without PYTHONPATH tricks (the factory module sits in the current folder).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import colibri
from colibri import cli as colibri_cli
from colibri.cli import flash as cli_flash, info as cli_info
from colibri import nn as cnn
from colibri.frontends.exporter import export

from conftest import ROOT, make

COLIBRI = str(Path(sys.executable).parent / "colibri")
RUNNER_ELF = ROOT / "firmware" / "runner" / "build" / "mps2_an500" / "runner.elf"

FACTORIES = '''
import torch
from colibri import nn as cnn

def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 12), cnn.MoE(12, 4, 16, top_k=2), torch.nn.Linear(12, 4))

def build_sized(n):
    return torch.nn.Sequential(torch.nn.Linear(n, 4))

def boom():
    raise RuntimeError("the factory's own bug")

def slow():
    import pathlib, time
    pathlib.Path("started").write_text("")
    time.sleep(60)
'''

SAVE_FROM_MAIN = '''
import torch

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x)

torch.save(Net(), "main.pt")
'''


def user_env() -> dict[str, str]:
    """The environment of a user's shell: no PYTHONPATH, no pytest variables, no debug switch."""
    return {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "COLIBRI_DEBUG") and not k.startswith("PYTEST_")}


def colibri_cmd(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([COLIBRI, *args], capture_output=True, text=True, cwd=cwd, env=env or user_env(),
                          timeout=300)


def assert_one_line_error(r: subprocess.CompletedProcess, *texts: str) -> None:
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert r.stdout == "", r.stdout
    assert r.stderr.startswith("colibri: error: ") and r.stderr.count("\n") == 1, r.stderr
    assert "Traceback" not in r.stderr
    for text in texts:
        assert text in r.stderr, r.stderr


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A user's folder: a factory module, a model image, and files that are no PyTorch module."""
    d = tmp_path_factory.mktemp("cli-errors")
    (d / "mymodels.py").write_text(FACTORIES)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 12), cnn.MoE(12, 4, 16, top_k=2), torch.nn.Linear(12, 4))
    (d / "model.clb").write_bytes(export(m, None, max_batch=2).image)
    (d / "photo.jpg").write_bytes(b"\xff\xd8\xff\xe0\x00\x10JFIF\x00\x01" + bytes(range(256)) * 8)
    (d / "empty.pt").write_bytes(b"")
    torch.save(m.state_dict(), d / "weights.pt")
    (d / "save_from_main.py").write_text(SAVE_FROM_MAIN)
    r = subprocess.run([sys.executable, "save_from_main.py"], cwd=d, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    program = torch.export.export(torch.nn.Sequential(torch.nn.Linear(8, 4)), (torch.randn(1, 8),))
    torch.export.save(program, d / "model.pt2")
    np.save(d / "calib_wrong.npy", np.zeros((3, 60), np.float32))  # 180 values, the model takes 8
    np.save(d / "x.npy", np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32))
    return d


@pytest.mark.parametrize("args, texts", [
    (["model.clb"], ["model.clb is a Colibri model image already"]),
    (["photo.jpg"], ["photo.jpg is not a file torch.save writes"]),
    (["empty.pt"], ["empty.pt is empty"]),
    (["weights.pt"], ["weights.pt holds a collections.OrderedDict object, not a torch.nn.Module", "state_dict"]),
    (["main.pt"], ["main.pt holds a Net defined in the __main__ script", "move class Net into a module"]),
    (["model.pt2"], ["model.pt2 is a torch.export program (.pt2)"]),
    (["mymodels:missing"], ["mymodels:missing: module mymodels", "has no 'missing'"]),
    (["nomodule:build"], ["no module named 'nomodule' in the current folder or on PYTHONPATH"]),
    (["mymodels:build_sized"], ["mymodels:build_sized needs arguments (n)"]),
    (["mymodels:boom"], ["mymodels:boom() raised RuntimeError: the factory's own bug"]),
    (["mymodels:build", "--input-size", "-5"], ["'--input-size': -5 is not in the range x>=1"]),
    (["mymodels:build", "--max-batch", "0"], ["'--max-batch': 0 is not in the range x>=1"]),
    (["mymodels:build", "--calibration", "calib_wrong.npy"],
     ["calib_wrong.npy: 60 features per token, the model takes 8"]),
])
def test_export_failure_is_one_line_and_writes_nothing(work: Path, args: list[str], texts: list[str]) -> None:
    r = colibri_cmd("export", args[0], "out/model.clb", *args[1:], cwd=work)
    assert_one_line_error(r, *texts)
    assert not (work / "out").exists()


def test_export_finds_a_factory_in_the_current_folder_and_makes_the_output_folder(work: Path) -> None:
    r = colibri_cmd("export", "mymodels:build", "new/folder/m.clb", "--max-batch", "2", cwd=work)
    assert r.returncode == 0, r.stderr
    assert (work / "new/folder/m.clb").read_bytes() == (work / "model.clb").read_bytes()
    help_text = " ".join(colibri_cmd("export", "--help", cwd=work).stdout.split())
    assert "As with `python -m`, the current folder comes first on the module search path" in help_text


def test_quantize_bad_calibration_writes_nothing(work: Path) -> None:
    r = colibri_cmd("quantize", "model.clb", "q/q8.clb", "--dtype", "q8", "--calibration", "calib_wrong.npy",
                    cwd=work)
    assert_one_line_error(r, "calib_wrong.npy: 60 features per token, the model takes 8")
    assert not (work / "q").exists()


def test_quantize_needs_dtype(work: Path) -> None:
    r = colibri_cmd("quantize", "model.clb", "copy.clb", cwd=work)
    assert_one_line_error(r, "give either --dtype or --target (which chooses a dtype per weight)")
    assert not (work / "copy.clb").exists()


def test_run_writes_what_the_extension_says(work: Path) -> None:
    want = colibri.Model(work / "model.clb").forward(np.load(work / "x.npy"))
    r = colibri_cmd("run", "model.clb", "-i", "x.npy", "-o", "y/out.csv", cwd=work)
    assert r.returncode == 0, r.stderr
    assert r.stderr == "wrote y/out.csv: 3 x 4\n"
    assert sorted(p.name for p in (work / "y").iterdir()) == ["out.csv"]
    np.testing.assert_allclose(np.loadtxt(work / "y/out.csv", delimiter=",", ndmin=2), want, rtol=1e-6)
    r = colibri_cmd("run", "model.clb", "-i", "x.npy", "-o", "y/out.npy", cwd=work)
    assert r.returncode == 0, r.stderr
    np.testing.assert_array_equal(np.load(work / "y/out.npy"), want)
    r = colibri_cmd("run", "model.clb", "-i", "x.npy", "-o", "y/out.txt", cwd=work)
    assert_one_line_error(r, "y/out.txt: outputs are written as .npy or .csv, not .txt")
    assert sorted(p.name for p in (work / "y").iterdir()) == ["out.csv", "out.npy"]


def test_slot_letters_in_either_case(work: Path, monkeypatch) -> None:
    for letter in ("a", "b", "A", "B"):
        r = colibri_cmd("pack", "model.clb", "--flash-image", f"slot_{letter}", "--slot", letter, cwd=work)
        assert r.returncode == 0, r.stderr
        assert f"slot {letter.upper()} of nucleo_h743zi" in r.stdout
    assert (work / "slot_a.hex").read_text() == (work / "slot_A.hex").read_text()
    assert (work / "slot_a.hex").read_text() != (work / "slot_b.hex").read_text()
    asked = []
    monkeypatch.setattr(cli_flash, "_flash_with_probe", lambda *args: asked.append(args[5]))
    for letter in ("a", "b", "A", "B"):
        result = CliRunner().invoke(colibri_cli.main, ["flash", str(work / "model.clb"), "--probe", "--slot",
                                                       letter])
        assert result.exit_code == 0, result.output
    assert asked == ["A", "B", "A", "B"]


@pytest.mark.parametrize("args, texts", [
    (["flash", "model.clb", "--slot", "B"], ["--slot has no effect without --probe"]),
    (["flash", "model.clb", "--sequence", "3"], ["--sequence has no effect without --probe"]),
    (["flash", "model.clb", "--probe", "--port", "/dev/ttyACM0"], ["--port has no effect with --probe"]),
    (["flash", "model.clb", "--port", "/dev/ttyACM0", "--firmware", "model.clb"],
     ["--firmware has no effect with --port"]),
    (["hil", "model.clb", "--port", "/dev/ttyACM0", "--firmware", "model.clb"],
     ["--firmware has no effect with --port"]),
    (["pack", "model.clb", "--c-array", "c", "--slot", "b"], ["--slot has no effect without --flash-image"]),
])
def test_options_that_would_be_ignored_are_refused(work: Path, args: list[str], texts: list[str]) -> None:
    assert_one_line_error(colibri_cmd(*args, cwd=work), *texts)


def test_help_lists_user_commands_in_full(work: Path) -> None:
    r = colibri_cmd("--help", cwd=work)
    assert r.returncode == 0, r.stderr
    listing = " ".join(r.stdout.split("Commands:")[1].split())
    assert "..." not in listing
    for name, cmd in colibri_cli.main.commands.items():
        if name == "gen-header":
            assert not cmd.hidden or name not in listing.split()
            continue
        first = " ".join(cmd.help.split("\n\n")[0].split())
        assert f"{name} {first}" in listing, (name, listing)
    assert "gen-header" not in r.stdout  # a maintainer's command: hidden, but `make header` still runs it
    for bare in (["natmod"], []):  # a group named alone shows its help, not a one-line "error" holding it
        r = colibri_cmd(*bare, cwd=work)
        assert r.returncode == 0 and r.stderr == "" and r.stdout.startswith("Usage: colibri"), r
    check = colibri_cmd("gen-header", "--check", cwd=work)
    assert check.returncode == 0, check.stderr


def test_unexpected_error_is_one_line_with_a_hint(monkeypatch, work: Path) -> None:
    def broken(data: bytes) -> dict:
        raise KeyError("layers")

    monkeypatch.setattr(cli_info, "describe", broken)
    monkeypatch.delenv("COLIBRI_DEBUG", raising=False)
    result = CliRunner().invoke(colibri_cli.main, ["info", str(work / "model.clb")])
    assert result.exit_code == 1
    assert result.stderr == ("colibri: error: unexpected KeyError: 'layers' "
                             "(run with COLIBRI_DEBUG=1 for the traceback)\n")
    monkeypatch.setenv("COLIBRI_DEBUG", "1")
    result = CliRunner().invoke(colibri_cli.main, ["info", str(work / "model.clb")])
    assert isinstance(result.exception, KeyError)  # the traceback is the user's (or the bug report's) to see


def test_ctrl_c_is_one_line(work: Path) -> None:
    marker = work / "started"
    marker.unlink(missing_ok=True)
    # Files, not pipes: the exit of colibri itself is what counts, and a pipe would also wait for
    # any process that inherited it.
    with open(work / "ctrl_c.out", "w+") as out_f, open(work / "ctrl_c.err", "w+") as err_f:
        # Ctrl-C in a terminal: SIGINT at its default disposition. A test process may have inherited it
        # ignored (then Python installs no KeyboardInterrupt handler and the signal does nothing).
        proc = subprocess.Popen([COLIBRI, "export", "mymodels:slow", "slow.clb"], cwd=work, env=user_env(),
                                stdout=out_f, stderr=err_f, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            deadline = time.monotonic() + 120
            while not marker.exists():
                assert proc.poll() is None and time.monotonic() < deadline, (work / "ctrl_c.err").read_text()
                time.sleep(0.05)
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        out_f.seek(0)
        err_f.seek(0)
        out, err = out_f.read(), err_f.read()
    assert proc.returncode == 130 and err == "colibri: interrupted\n" and out == "", (proc.returncode, err)


# -- the emulated target ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runner_elf() -> Path:
    from colibri.target.firmware import build_runner

    return build_runner()


def test_hil_with_firmware_for_another_board_reports_qemu_reason(work: Path) -> None:
    r = make("-C", str(ROOT / "firmware" / "runner"), "BOARD=nucleo_h743zi")  # the real board's runner
    assert r.returncode == 0, r.stdout + r.stderr
    firmware = ROOT / "firmware" / "runner" / "build" / "nucleo_h743zi" / "runner.elf"
    r = colibri_cmd("hil", "model.clb", "--firmware", str(firmware), cwd=work)
    assert_one_line_error(r, f"QEMU stopped (killed by signal 6) running {firmware}: qemu: fatal: Lockup")
    assert "Connection reset" not in r.stderr


@pytest.mark.parametrize("command", ["hil", "flash", "footprint"])
@pytest.mark.parametrize("firmware, text", [
    ("/bin/ls", "/bin/ls is an ELF for X86_64, not for Arm"),
    ("mymodels.py", "mymodels.py is not an ELF file"),  # QEMU would run it as raw bytes: silence, then a timeout
])
def test_firmware_that_is_no_arm_elf_is_refused(work: Path, command: str, firmware: str, text: str) -> None:
    start = time.monotonic()
    assert_one_line_error(colibri_cmd(command, "model.clb", "--firmware", firmware, cwd=work), text)
    assert time.monotonic() - start < 60  # refused up front, not after the 10 s serial timeout


def test_qemu_reports_why_it_stopped(no_qemu_left_behind) -> None:
    from colibri.target.device import Device
    from colibri.target.qemu import Qemu, QemuError

    with pytest.raises(QemuError, match=r"QEMU stopped \(killed by signal 6\) running /bin/ls: qemu: fatal: Lockup"):
        with Qemu("/bin/ls") as q, Device(q.url, timeout=5) as dev:
            dev.hello()


BLOCK_PYTEST = textwrap.dedent('''
    import sys

    class NoPytest:
        """A machine without the test extra: importing pytest fails."""

        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in ("pytest", "_pytest", "pluggy"):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoPytest())
    for name in [m for m in sys.modules if m.partition(".")[0] in ("pytest", "_pytest", "pluggy")]:
        del sys.modules[name]
    from colibri.cli import main

    main(sys.argv[1:], prog_name="colibri")
''')


def test_cli_does_not_need_pytest(work: Path, runner_elf: Path) -> None:
    def no_pytest(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", BLOCK_PYTEST, *args], capture_output=True, text=True,
                              cwd=work, env=user_env(), timeout=300)

    blocked = no_pytest("info", "model.clb")
    assert blocked.returncode == 0, blocked.stderr
    r = no_pytest("hil", "model.clb")  # builds (make: up to date) and boots the runner in QEMU
    assert r.returncode == 0, r.stderr
    assert "device agrees with the host engine" in r.stdout
    r = no_pytest("footprint", "model.clb")
    assert r.returncode == 0, r.stderr
    assert "stack high-water" in r.stdout
    r = no_pytest("flash", "model.clb")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("flashed model.clb to slot ")


PLUGIN_TEST = '''
def test_fixtures_and_options(request, colibri_target):
    assert colibri_target.emulated
    assert request.config.getoption("--colibri-port") is None
'''


@pytest.mark.parametrize("spelling", ["entry point", "-p", "pytest_plugins"])
def test_plugin_loads_under_every_spelling(tmp_path: Path, spelling: str) -> None:
    (tmp_path / "test_plugin_use.py").write_text(PLUGIN_TEST)
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "test_plugin_use.py"]
    if spelling == "-p":
        args[3:3] = ["-p", "colibri.pytest_plugin"]
    elif spelling == "pytest_plugins":
        (tmp_path / "conftest.py").write_text('pytest_plugins = ["colibri.pytest_plugin"]\n')
    r = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, env=user_env(), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 passed" in r.stdout
