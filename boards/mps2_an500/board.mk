# QEMU mps2-an500: Cortex-M7 (25 MHz nominal, fpv5-d16 double-precision FPU),
# 4 MB code memory at 0x00000000, 4 MB RAM at 0x20000000, CMSDK UART0.
# Included by firmware/runner/Makefile (BOARD=mps2_an500).

MPS2_AN500_DIR := $(patsubst %/,%,$(dir $(lastword $(MAKEFILE_LIST))))

BOARD_SRCS := $(MPS2_AN500_DIR)/startup.S $(MPS2_AN500_DIR)/board.c
BOARD_LDSCRIPT := $(MPS2_AN500_DIR)/mps2_an500.ld
BOARD_CFLAGS := -mcpu=cortex-m7 -mthumb -mfpu=fpv5-d16 -mfloat-abi=hard

# Model buffer 2 MiB and arena 1 MiB, in RAM (the linker script checks they
# fit with the 64 KiB stack). The host launches QEMU with -icount shift=7:
# the work counter turns SysTick ticks back into instructions with it.
# BOARD_HAS_POWER_CUT: the emulated flash's debug power cut and the runner's
# POWER_CUT_AFTER request (QEMU only; never on a real board).
BOARD_DEFS := -DRUNNER_MODEL_CAPACITY=2097152 -DRUNNER_ARENA_CAPACITY=1048576 \
              -DRUNNER_LOGITS_CAPACITY=16384 \
              -DCOLIBRI_QEMU_ICOUNT_SHIFT=7 -DBOARD_HAS_POWER_CUT
