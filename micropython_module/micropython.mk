# Colibri as a MicroPython user C module, for make-based ports (unix, stm32, ...).
#
#   cd micropython/ports/stm32
#   make BOARD=NUCLEO_H743ZI USER_C_MODULES=/path/to/colibri
#
# USER_C_MODULES names the folder that *holds* module folders, here the Colibri
# checkout itself: py/py.mk includes every <that folder>/*/micropython.mk, and
# this is the only one. See README.md next to this file.

COLIBRI_MP_DIR := $(USERMOD_DIR)
COLIBRI_CORE_DIR := $(COLIBRI_MP_DIR)/../firmware/colibri_core

# The binding, the same C source as the native .mpy build; scanned for qstrs.
SRC_USERMOD_C += $(COLIBRI_MP_DIR)/colibri_mp.c

# The engine, from the source list every build of it shares. LIB sources are
# compiled and linked but not scanned for qstrs (they use none).
SRC_USERMOD_LIB_C += $(addprefix $(COLIBRI_CORE_DIR)/,$(shell cat $(COLIBRI_CORE_DIR)/sources.txt))

CFLAGS_USERMOD += -I$(COLIBRI_CORE_DIR)/include
# The engine's floating-point contract (firmware/colibri_core/Makefile): no
# fused multiply-add (ports build with gnu99 and would fuse), no errno from
# math functions. CFLAGS_USERMOD reaches the whole firmware build; both flags
# only make its floating point stricter.
CFLAGS_USERMOD += -ffp-contract=off -fno-math-errno
