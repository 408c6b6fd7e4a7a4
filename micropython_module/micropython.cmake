# Colibri as a MicroPython user C module, for CMake ports (esp32, rp2, ...).
#
#   cd micropython/ports/rp2
#   make BOARD=RPI_PICO2 USER_C_MODULES=/path/to/colibri/micropython_module/micropython.cmake
#
# (the same path as -DUSER_C_MODULES=... when calling CMake directly). To add
# further modules, list them in your own micropython.cmake that include()s
# this file. See README.md next to this file.

add_library(usermod_colibri INTERFACE)

set(COLIBRI_CORE_DIR ${CMAKE_CURRENT_LIST_DIR}/../firmware/colibri_core)

# The engine, from the source list every build of it shares.
file(STRINGS ${COLIBRI_CORE_DIR}/sources.txt COLIBRI_CORE_SOURCES)
list(TRANSFORM COLIBRI_CORE_SOURCES PREPEND ${COLIBRI_CORE_DIR}/)
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${COLIBRI_CORE_DIR}/sources.txt)

# The binding (the same C source as the native .mpy build) and the engine.
target_sources(usermod_colibri INTERFACE
    ${CMAKE_CURRENT_LIST_DIR}/colibri_mp.c
    ${COLIBRI_CORE_SOURCES}
)

target_include_directories(usermod_colibri INTERFACE
    ${COLIBRI_CORE_DIR}/include
)

# The engine's floating-point contract (firmware/colibri_core/Makefile): no
# fused multiply-add, no errno from math functions. Interface options reach
# the whole firmware build; both only make its floating point stricter.
target_compile_options(usermod_colibri INTERFACE -ffp-contract=off -fno-math-errno)

target_link_libraries(usermod INTERFACE usermod_colibri)
