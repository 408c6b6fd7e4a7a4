# PlatformIO extra script for Colibri's environments (platformio.ini at the
# repository root). It is listed twice, as pre: and as post:, and does the part
# of its work that belongs to each phase:
#
# pre:  (before the platform's builder)
#   - with `custom_model_c`: stop early, with the command to run, if the
#     packed model is missing;
#   - the CPU and FPU flags of `custom_cpu_flags` on compiling, assembling and
#     linking. build_flags would reach the C compiler only: .S files are
#     assembled with ASFLAGS and the link uses LINKFLAGS, and a hard-float
#     program needs -mfloat-abi=hard / -mfpu on all three (otherwise startup.S
#     or the libraries come out soft-float and the link fails, or the wrong
#     libc is picked);
#   - newlib-nano, no startup files (the board's own startup code and linker
#     script do what crt0 would), a link map.
#
# post: (after the platform's builder has declared the program)
#   - no libstdc++ in the link (C only);
#   - with `custom_freertos_port`: the FreeRTOS kernel, built from exactly
#     tasks.c, queue.c, list.c, timers.c and that port, no heap_x.c (the
#     example allocates statically). The kernel comes from FREERTOS_KERNEL_PATH
#     if set, else from the lib_deps download (lib_ignore keeps PlatformIO from
#     building the whole repository, every port and heap, as a library);
#   - fails the build if the program references malloc, free or _sbrk, as the
#     Makefiles do: nothing in Colibri's firmware may allocate.
import os
import subprocess
import sys

Import("env")  # noqa: F821 (SCons)

FORBIDDEN = {"malloc", "free", "calloc", "realloc", "_malloc_r", "_free_r", "_calloc_r", "_realloc_r",
             "_sbrk", "_sbrk_r", "pvPortMalloc", "vPortFree"}
KERNEL_SOURCES = ("tasks.c", "queue.c", "list.c", "timers.c")


def option(name, default=""):
    return env.GetProjectOption(name, default)


def pre():
    model_c = option("custom_model_c")
    if model_c and not os.path.isfile(os.path.join(env.subst("$PROJECT_DIR"), model_c)):
        sys.stderr.write(
            "Error: %s not found: pack the model first, e.g.\n"
            "    .venv/bin/colibri pack build/smart_meter/meter_q8.clb --c-array %s\n"
            % (model_c, os.path.dirname(model_c)))
        env.Exit(1)
    cpu = option("custom_cpu_flags").split()
    if not cpu:
        sys.stderr.write("Error: platformio.ini sets no custom_cpu_flags for %s\n" % env["PIOENV"])
        env.Exit(1)
    env.Append(
        CCFLAGS=cpu,
        ASFLAGS=cpu,
        LINKFLAGS=cpu + [
            "-specs=nano.specs",
            "-nostartfiles",
            "-Wl,-Map,${BUILD_DIR}/${PROGNAME}.map",
            "-Wl,--no-warn-rwx-segments",
        ],
    )


def find_kernel():
    """The FreeRTOS-Kernel tree: FREERTOS_KERNEL_PATH, else the one lib_deps installed."""
    candidates = []
    if os.environ.get("FREERTOS_KERNEL_PATH"):
        candidates.append(os.path.abspath(os.environ["FREERTOS_KERNEL_PATH"]))
    libdeps = env.subst(os.path.join("$PROJECT_LIBDEPS_DIR", "$PIOENV"))
    if os.path.isdir(libdeps):
        candidates += [os.path.join(libdeps, d) for d in sorted(os.listdir(libdeps))]
    for path in candidates:
        if os.path.isfile(os.path.join(path, "tasks.c")) and os.path.isfile(
                os.path.join(path, "include", "FreeRTOS.h")):
            return path
    return None


def add_freertos(port, projenv):
    kernel = find_kernel()
    if kernel is None:
        sys.stderr.write(
            "Error: no FreeRTOS kernel. lib_deps could not install freertos/FreeRTOS-Kernel (offline?); "
            "point FREERTOS_KERNEL_PATH at a FreeRTOS-Kernel checkout and run again.\n")
        env.Exit(1)
    port_dir = os.path.join(kernel, "portable", *port.split("/"))
    if not os.path.isfile(os.path.join(port_dir, "port.c")):
        sys.stderr.write("Error: custom_freertos_port = %s: no %s/port.c\n" % (port, port_dir))
        env.Exit(1)
    includes = [os.path.join(kernel, "include"), port_dir]
    projenv.Append(CPPPATH=includes)
    kenv = projenv.Clone()  # build_flags, FreeRTOSConfig.h's folder and the kernel includes
    src_filter = ["-<*>"] + ["+<%s>" % s for s in KERNEL_SOURCES] + ["+<portable/%s/port.c>" % port]
    lib = kenv.BuildLibrary(os.path.join("$BUILD_DIR", "FreeRTOS-Kernel"), kernel, src_filter)
    env.Prepend(LIBS=[lib])
    print("FreeRTOS kernel: %s, port %s" % (kernel, port))


def check_no_heap(target, source, env):
    nm = env.subst("$CC").replace("gcc", "nm")
    out = subprocess.run([nm, str(target[0])], env=env["ENV"], capture_output=True, text=True, check=True).stdout
    bad = sorted({line.split()[-1] for line in out.splitlines() if line.split()} & FORBIDDEN)
    if bad:
        sys.stderr.write("Error: %s references heap functions: %s\n" % (target[0], " ".join(bad)))
        return 1
    return 0


def post(projenv):
    # The bare-metal builder links libstdc++ too; Colibri's firmware is C, and
    # not every arm-none-eabi toolchain ships libstdc++ (Debian's needs an
    # extra 1.5 GB package for it).
    env.Replace(LIBS=[lib for lib in env.get("LIBS", []) if lib != "stdc++"])
    port = option("custom_freertos_port")
    if port:
        add_freertos(port, projenv)
    env.AddPostAction(env["PIOMAINPROG"], env.VerboseAction(check_no_heap, "Checking for heap functions"))


if env.get("PIOMAINPROG"):
    Import("projenv")  # noqa: F821 (SCons): the environment the project's sources build in
    post(projenv)  # noqa: F821
else:
    pre()
