# NUCLEO-H743ZI: STM32H743ZI, Cortex-M7 at 480 MHz (400 MHz on revision Y
# silicon), double-precision FPv5-D16, console USART3 = ST-LINK virtual COM
# port (/dev/ttyACM0) at 115200 8N1. See README.md in this folder.
# Included by firmware/runner/Makefile (BOARD=nucleo_h743zi). Defines
# variables only, no targets.

NUCLEO_H743ZI_DIR := $(patsubst %/,%,$(dir $(lastword $(MAKEFILE_LIST))))

BOARD_SRCS := $(NUCLEO_H743ZI_DIR)/startup.c $(NUCLEO_H743ZI_DIR)/board.c
BOARD_LDSCRIPT := $(NUCLEO_H743ZI_DIR)/linker.ld
BOARD_CFLAGS := -mcpu=cortex-m7 -mthumb -mfpu=fpv5-d16 -mfloat-abi=hard

# The model buffer and the arena live in the 512 KB AXI SRAM (linker.ld
# section .axisram; it takes runner_model and runner_arena by their
# -fdata-sections names). Model 288 KB + arena 224 KB = the whole 512 KB.
# The image holds the weights, the bulk of a model; the arena holds the
# context and activations at max_batch (the demo model: image 122,208 B,
# arena 21,376 B) and a token model's KV cache: the tiny King James model
# (examples/tiny_lm) needs 210,080 B with its 256-position cache, so the
# arena is 224 KB. A model larger than the RAM buffer runs in place from a
# 512 KB flash slot (the tiny LM's q8 image, 423,552 B) or linked into
# flash bank 1 (make MODEL_C=...); tests/target/test_target_hil_lm.py pins the fit.
# The linker checks that both fit; board.c checks them too.
BOARD_DEFS := -DRUNNER_MODEL_CAPACITY=294912 -DRUNNER_ARENA_CAPACITY=229376
