"""Targets: boards and emulators (protocol, device, qemu, firmware builds), what fits a board (budget,
footprint, slots, pack) and MicroPython native modules (natmod); the pytest plugin."""
