"""`colibri flash`: a model image into a slot, over the serial protocol or with a debug probe."""
from __future__ import annotations

import subprocess
from pathlib import Path

import click

from ..model.errors import ColibriError
from .app import main, refuse_unused
from .board import port_options


def _slot_payload(data: bytes) -> tuple[bytes, int | None]:
    """(model image, sequence) from a model image or a slot image (32-byte header + image)."""
    from ..target.slots import SLOT_HEADER_SIZE, parse_slot_header

    header = parse_slot_header(data)
    if header is None:
        return data, None
    if not header.image_ok(data[SLOT_HEADER_SIZE:]):
        raise ColibriError("slot image: the image after the header does not match its size and CRC-32")
    return data[SLOT_HEADER_SIZE : SLOT_HEADER_SIZE + header.image_size], header.sequence


def _flash_over_serial(model_path: Path, image: bytes, port: str | None, baud: int, firmware: Path | None,
                       qemu_flash: Path | None) -> None:
    import time
    import zlib

    from ..target.device import Device
    from ..target.firmware import build_runner, check_emulator_elf
    from ..target.qemu import Qemu

    def update(dev: Device) -> str:
        hello = dev.hello()
        from .. import image as cimage

        cimage.check_version(image, hello.formats, reader=f"the firmware on the {hello.board}")
        before = dev.slot_info()
        if len(image) > before.capacity:
            raise ColibriError(f"{model_path.name}: {len(image):,} bytes do not fit a {before.capacity:,}-byte slot "
                               f"of {hello.board}")
        start = time.monotonic()
        after = dev.update(image, progress=True)
        took = time.monotonic() - start
        name = after.running
        slot = after[name] if name in ("A", "B") else None
        if slot is None or not slot.valid or after.active != name or slot.image_size != len(image) \
                or slot.image_crc32 != zlib.crc32(image):
            raise ColibriError(f"the device does not report the new model as committed and running: {after}")
        return (f"flashed {model_path.name} to slot {name} (sequence {slot.sequence}, 0x{slot.address:08x}) "
                f"of {hello.board}: {len(image):,} bytes in {took:.2f} s, CRC-32 {slot.image_crc32:08x} verified, "
                f"running")

    if port is not None:
        with Device(port, baudrate=baud) as dev:
            click.echo(update(dev))
        return
    elf = check_emulator_elf(firmware) if firmware else build_runner()
    load = qemu_flash if qemu_flash is not None and qemu_flash.exists() else None
    with Qemu(elf, qmp=qemu_flash is not None, flash=load) as q, Device(q.url) as dev:
        line = update(dev)
        if qemu_flash is not None:
            q.pause()
            q.save_flash(qemu_flash)
            line += f"; emulated flash saved to {qemu_flash}"
    click.echo(line)


def _probe_check(image: bytes, firmware: Path | None) -> None:
    """The checks the runner makes before it commits a slot over serial, made before the probe writes:
    a valid image, of a format version the target firmware reads (--firmware, else this colibri's engine)."""
    from .. import image as cimage
    from ..target.pack import firmware_formats

    if firmware is not None:
        cimage.check_version(image, firmware_formats(firmware), reader=f"firmware {firmware.name}")
    cimage.read(image)


def _probe_hex_image(path: Path, layout, firmware: Path | None) -> None:
    """A slot .hex (colibri pack --flash-image) at one of the board's slots, holding an image that passes
    _probe_check."""
    from intelhex import IntelHex

    ih = IntelHex(str(path))
    start = ih.minaddr()
    if start not in (layout.address("A"), layout.address("B")):
        raise ColibriError(f"{path.name}: starts at 0x{start:08x}, not at a model slot of the board")
    image, seq = _slot_payload(ih.tobinstr(start=start, end=ih.maxaddr()))
    if seq is None:
        raise ColibriError(f"{path.name}: no slot header at 0x{start:08x} (write it with colibri pack --flash-image)")
    _probe_check(image, firmware)


def _flash_with_probe(model_path: Path, data: bytes, firmware: Path | None, target: str, board: str, slot: str,
                      sequence: int) -> None:
    """Factory programming through an SWD probe: a thin wrapper around the `pyocd` command."""
    import shutil
    import tempfile
    import time

    from ..target.slots import LAYOUTS, slot_image

    layout = LAYOUTS[board]
    address = layout.address(slot)
    other = layout.address("B" if slot == "A" else "A")
    steps: list[tuple[str, list[str]]] = []
    with tempfile.TemporaryDirectory(prefix="colibri-probe-") as tmp:
        if model_path.suffix.lower() == ".hex":
            _probe_hex_image(model_path, layout, firmware)
            slot_file, what = model_path, f"{model_path.name} (Intel HEX, at its own addresses)"
        else:
            image, seq = _slot_payload(data)
            _probe_check(image, firmware)
            if len(image) > layout.capacity:
                raise ColibriError(f"{model_path.name}: {len(image):,} bytes do not fit a {layout.capacity:,}-byte slot")
            slot_file = Path(tmp) / "slot.bin"
            slot_file.write_bytes(slot_image(image, seq if seq is not None else sequence))
            what = f"slot {slot} at 0x{address:08x} ({len(image):,}-byte model, sequence {seq or sequence})"
        pyocd = shutil.which("pyocd")
        if pyocd is None:
            raise ColibriError("--probe needs pyOCD, which is not installed (pip install pyocd; "
                               f"then pyocd pack install {target})")
        base = [pyocd]
        connect = ["-t", target, "-W"]  # -W: fail at once when no probe is connected instead of waiting
        # The other slot's header sector first: a valid older slot there with a higher sequence would win.
        steps.append(("erase the other slot's header sector", base + ["erase", *connect, "--sector", f"0x{other:x}"]))
        if firmware is not None:
            fw = ["--base-address", "0x08000000"] if firmware.suffix.lower() == ".bin" else []
            steps.append((f"program {firmware.name}", base + ["flash", *connect, *fw, str(firmware)]))
        slot_args = [] if slot_file.suffix.lower() == ".hex" else ["--base-address", f"0x{address:x}"]
        steps.append(("program the model slot", base + ["flash", *connect, *slot_args, str(slot_file)]))
        start = time.monotonic()
        for step, cmd in steps:
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                out = (r.stderr + r.stdout).strip()
                if "No connected debug probes" in out or "No available debug probes" in out or "No target device" in out:
                    raise ColibriError("no debug probe found: connect the board's ST-LINK (pyocd list shows probes)")
                last = out.splitlines()[-1] if out else f"exit status {r.returncode}"
                raise ColibriError(f"pyocd failed to {step}: {last}")
    fw_note = f" and {firmware.name}" if firmware is not None else ""
    click.echo(f"programmed {what}{fw_note} with pyOCD ({target}) in {time.monotonic() - start:.1f} s")


@main.command()
@click.argument("model_path", metavar="MODEL", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@port_options
@click.option("--qemu-flash", type=click.Path(dir_okay=False, path_type=Path),
              help="QEMU: load the emulated flash from this file if it exists, save it back afterwards.")
@click.option("--probe", is_flag=True,
              help="Factory-program through an SWD probe with pyOCD (not installed with colibri) instead.")
@click.option("--probe-target", default="stm32h743zitx", show_default=True, help="--probe: pyOCD target type.")
@click.option("--board", type=click.Choice(["nucleo_h743zi"]), default="nucleo_h743zi", show_default=True,
              help="--probe: the board whose flash map to use.")
@click.option("--slot", type=click.Choice(["A", "B"], case_sensitive=False), default="A", show_default=True,
              help="--probe: slot to write (A or B, either case). Over serial the runner picks the slot it "
                   "does not run.")
@click.option("--sequence", default=1, show_default=True, help="--probe: the slot's sequence number.")
def flash(model_path: Path, port: str | None, baud: int, firmware: Path | None, qemu_flash: Path | None, probe: bool,
          probe_target: str, board: str, slot: str, sequence: int) -> None:
    """Write MODEL into the inactive flash slot of a running board and switch to it.

    Over the runner's serial line (--port; default: the runner booted in QEMU): the model goes
    to the slot that does not run, is verified in flash and committed with one header word, so a
    power loss half way leaves the old model. MODEL is a model image or a slot image (.bin with
    the 32-byte slot header).

    With --probe, factory programming through an SWD probe with pyOCD: the model as slot image at
    the slot's address (MODEL may also be a slot .hex), the other slot's header sector erased, and
    --firmware (the runner .elf/.hex/.bin for the board) if given.
    """
    ctx = click.get_current_context()
    if probe:
        refuse_unused(ctx, ["port", "baud", "qemu_flash"], "with --probe (it programs through the SWD probe)")
    else:
        # Over the serial line the runner writes the slot it is not running from and numbers it itself:
        # a --slot asked for here could not be honoured, so it is refused rather than ignored.
        refuse_unused(ctx, ["slot", "sequence", "probe_target", "board"],
                       "without --probe (over serial the runner writes its inactive slot)")
        if port is not None:
            refuse_unused(ctx, ["firmware", "qemu_flash"], "with --port (they are for the runner in QEMU)")
    data = model_path.read_bytes()
    if probe:
        _flash_with_probe(model_path, data, firmware, probe_target, board, slot.upper(), sequence)
        return
    image, _ = _slot_payload(data)
    from .. import image as cimage

    cimage.read(image)  # refuse a file that is no model image before uploading it
    _flash_over_serial(model_path, image, port, baud, firmware, qemu_flash)
