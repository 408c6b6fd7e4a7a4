//! Compiles the engine's C sources (firmware/colibri_core/sources.txt) into a
//! static library with the system C compiler. No `cc` crate: the bindings must
//! build offline with no registry, so this drives the compiler directly.
//!
//! Compiler and archiver: $COLIBRI_CC / $COLIBRI_AR if set, else $CC / $AR,
//! else `cc` / `ar`. Extra flags (a cross target's CPU and float ABI, e.g. the
//! Cortex-M7's `-mcpu=cortex-m7 -mthumb -mfpu=fpv5-d16 -mfloat-abi=hard`):
//! $COLIBRI_CFLAGS, split on whitespace.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

fn tool(primary: &str, fallback: &str, default: &str) -> String {
    println!("cargo:rerun-if-env-changed={primary}");
    println!("cargo:rerun-if-env-changed={fallback}");
    env::var(primary)
        .or_else(|_| env::var(fallback))
        .unwrap_or_else(|_| default.to_string())
}

fn run(cmd: &mut Command) {
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("could not start {:?}: {e}", cmd.get_program()));
    if !status.success() {
        panic!("{cmd:?} failed with {status}");
    }
}

fn main() {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let core = manifest.join("../../../firmware/colibri_core");
    let core = core
        .canonicalize()
        .unwrap_or_else(|e| panic!("engine sources not found at {}: {e}", core.display()));
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    let target_os = env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();

    let cc = tool("COLIBRI_CC", "CC", "cc");
    let ar = tool("COLIBRI_AR", "AR", "ar");
    println!("cargo:rerun-if-env-changed=COLIBRI_CFLAGS");
    let extra: Vec<String> = env::var("COLIBRI_CFLAGS")
        .map(|s| s.split_whitespace().map(String::from).collect())
        .unwrap_or_default();

    println!("cargo:rustc-env=COLIBRI_INCLUDE_DIR={}", core.join("include").display());
    println!("cargo:rustc-env=COLIBRI_BUILD_CC={cc}");
    println!("cargo:include={}", core.join("include").display());
    if target_os == "linux" {
        // sqrtf, expf, ... from the C library's libm; a bare-metal target's
        // toolchain (newlib) links its own libm with the final firmware.
        println!("cargo:rustc-link-lib=m");
    }

    // A native build with no compiler override links the library the
    // engine's Makefile builds (build/host/libcolibri.a: the same sources,
    // flags and kernels), so the C is compiled once for C, Python and Rust.
    let native = env::var("HOST").ok() == env::var("TARGET").ok();
    let overridden = ["COLIBRI_CC", "CC", "COLIBRI_CFLAGS"].iter().any(|v| env::var_os(v).is_some());
    if native && !overridden && target_os == "linux" {
        println!("cargo:rerun-if-changed={}", core.join("Makefile").display());
        rerun_tree(&core.join("posix"));
        let make = env::var("MAKE").unwrap_or_else(|_| "make".to_string());
        run(Command::new(make).arg("-C").arg(&core).arg("host"));
        println!("cargo:rustc-link-search=native={}", core.join("build/host").display());
        println!("cargo:rustc-link-lib=static=colibri");
        return;
    }

    let list = core.join("sources.txt");
    println!("cargo:rerun-if-changed={}", list.display());
    for dir in ["include", "src"] {
        rerun_tree(&core.join(dir));
    }
    let sources: Vec<String> = fs::read_to_string(&list)
        .unwrap()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(String::from)
        .collect();

    // Every source compiles at once (children of this script), then all are waited for.
    let mut objects = Vec::new();
    let mut jobs = Vec::new();
    for src in &sources {
        let stem = Path::new(src).file_stem().unwrap().to_str().unwrap();
        let obj = out.join(format!("{stem}.o"));
        let mut cmd = Command::new(&cc);
        // The engine's numerics contract (docs/model-format.md "Numerics"):
        // no fused multiply-add, and math functions never touch errno, so
        // Rust callers get the same bits as the C and Python callers.
        cmd.args(["-std=c11", "-O2", "-ffp-contract=off", "-fno-math-errno"]);
        if target_os == "linux" {
            // Rust links test and binary executables as PIE on Linux.
            cmd.arg("-fPIC");
        }
        cmd.args(&extra)
            .arg("-I")
            .arg(core.join("include"))
            .arg("-c")
            .arg(core.join(src))
            .arg("-o")
            .arg(&obj);
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("could not start {cc}: {e}"));
        jobs.push((src, child));
        objects.push(obj);
    }
    for (src, mut child) in jobs {
        let status = child.wait().unwrap();
        if !status.success() {
            panic!("{cc} failed on {src} with {status}");
        }
    }

    let lib = out.join("libcolibri.a");
    let _ = fs::remove_file(&lib);
    run(Command::new(&ar).arg("rcs").arg(&lib).args(&objects));

    println!("cargo:rustc-link-search=native={}", out.display());
    println!("cargo:rustc-link-lib=static=colibri");
}

fn rerun_tree(dir: &Path) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rerun_tree(&path);
        } else {
            println!("cargo:rerun-if-changed={}", path.display());
        }
    }
}
