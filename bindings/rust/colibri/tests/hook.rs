//! The accelerator hook from Rust (`Model::forward_ex` with `Exec::expert`), on the models
//! tests/bindings/test_bindings_rust.py exports (cases.txt lines `hook NAME BATCH TOLERANCE`: NAME.bin, NAME.in.f32, and
//! the Python engine's NAME.opt.f32 / NAME.ref.f32), with genuine implementations:
//!
//! - a "device" in this file that runs every expert with its own code (f64 sums over weights widened
//!   or dequantised from the image's payloads through the crate's typed views) and must match the
//!   engine within the tolerance tests/engine/test_engine_hook.py holds its numpy and C devices to;
//! - hooks that decline every or chosen experts (the plain forward's bits, or the engine's result);
//! - a hook that fails on a chosen expert (its status comes back as the `Status` enum);
//! - the same over a thread pool (`ParallelFor`), where the hook runs on the workers;
//! - a panicking hook, which aborts the process rather than unwinding through the engine.
use colibri::{
    Activation, Exec, ExpertCall, ExpertKind, ExpertOutcome, Model, ParallelFor, Rng, Route, Sampler, Status, Weight,
};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

mod common;
use common::*;

extern "C" {
    // The C library's erf (libm, which colibri-sys links on Linux): Rust's std has no erf.
    fn erf(x: f64) -> f64;
}

fn activation(a: Activation, v: f64) -> f64 {
    match a {
        Activation::Relu => v.max(0.0),
        Activation::GeluErf => 0.5 * v * (1.0 + unsafe { erf(v / std::f64::consts::SQRT_2) }),
        Activation::GeluTanh => {
            0.5 * v * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v * v * v)).tanh())
        }
        Activation::Silu => v / (1.0 + (-v).exp()),
        Activation::Tanh => v.tanh(),
        Activation::Sigmoid => 1.0 / (1.0 + (-v).exp()),
    }
}

/// A weight as f64 `[rows * cols]` and its own (int8 companion) bias per row, if any.
fn dense(w: &Weight<'_>) -> (Vec<f64>, Vec<f64>) {
    let (rows, cols) = (w.rows(), w.cols());
    let mut row = vec![0f32; cols];
    let mut out = Vec::with_capacity(rows * cols);
    let mut bias = Vec::with_capacity(rows);
    for i in 0..rows {
        w.row_f32(i, &mut row);
        out.extend(row.iter().map(|&v| v as f64));
        bias.push(w.own_bias(i).unwrap_or(0.0) as f64);
    }
    (out, bias)
}

/// `W v + b + own bias`, row by row, in f64.
fn linear(w: &(Vec<f64>, Vec<f64>), b: Option<&[f32]>, v: &[f64], rows: usize) -> Vec<f64> {
    let cols = v.len();
    (0..rows)
        .map(|k| {
            let dot: f64 = w.0[k * cols..(k + 1) * cols].iter().zip(v).map(|(a, b)| a * b).sum();
            dot + w.1[k] + b.map_or(0.0, |b| b[k] as f64)
        })
        .collect()
}

/// Runs the expert as a device would, with nothing of the engine's kernels:
/// y[y_row(i)] += gate(i) · expert(x[x_row(i)]). Int8-activation experts (whose
/// rounding this f64 device does not reproduce) go back to the engine.
fn device(call: &mut ExpertCall<'_>) -> ExpertOutcome {
    if call.int8_act() {
        return ExpertOutcome::Declined;
    }
    let (d, hidden) = (call.d(), call.hidden());
    let w1 = dense(call.w1());
    let w2 = dense(call.w2());
    let w3 = call.w3().map(dense);
    assert_eq!(call.kind() == ExpertKind::Glu, w3.is_some());
    for i in 0..call.rows() {
        let x: Vec<f64> = call.x_row(i).iter().map(|&v| v as f64).collect();
        let mut h: Vec<f64> = linear(&w1, call.b1(), &x, hidden).into_iter().map(|v| activation(call.activation(), v)).collect();
        if let Some(w3) = &w3 {
            for (h, g) in h.iter_mut().zip(linear(w3, call.b3(), &x, hidden)) {
                *h *= g;
            }
        }
        let out: Vec<f32> = linear(&w2, call.b2(), &h, d).into_iter().map(|v| v as f32).collect();
        call.accumulate(i, &out);
    }
    ExpertOutcome::Computed
}

struct Case {
    name: String,
    image: (Vec<u32>, usize),
    input: Vec<f32>,
    batch: usize,
    tolerance: f32,
}

fn hook_cases() -> Vec<Case> {
    cases("hook")
        .into_iter()
        .map(|c| Case {
            image: image(&c[1]),
            input: f32s(fixtures().join(format!("{}.in.f32", c[1]))),
            batch: c[2].parse().unwrap(),
            tolerance: c[3].parse().unwrap(),
            name: c[1].clone(),
        })
        .collect()
}

impl Case {
    fn image(&self) -> &[u8] {
        bytes(&self.image.0, self.image.1)
    }
    fn output(&self) -> Vec<f32> {
        vec![f32::NAN; self.batch * Model::info(self.image()).unwrap().output_size as usize]
    }
    /// The error of `got` in units of the tolerance's scale, 1 + max|want|.
    fn error(&self, got: &[f32], want: &[f32]) -> f32 {
        assert_eq!(got.len(), want.len());
        let scale = 1.0 + want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max) / scale
    }
}

/// Builds a model of `case` in a fresh arena for `workers` and runs `f` on it.
fn with_model<R>(case: &Case, workers: usize, f: impl FnOnce(&mut Model<'_>) -> R) -> R {
    let need = Model::arena_size_for(case.image(), workers).unwrap();
    let mut a = arena(need);
    let mut model = Model::new(case.image(), arena_bytes(&mut a, need)).unwrap();
    f(&mut model)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn a_rust_device_matches_the_engine() {
    for case in hook_cases() {
        with_model(&case, 1, |model| {
            for reference in [false, true] {
                model.use_reference_kernels(reference).unwrap();
                let mut plain = case.output();
                model.forward(&case.input, &mut plain, case.batch).unwrap();
                let python = f32s(fixtures().join(format!("{}.{}.f32", case.name, if reference { "ref" } else { "opt" })));
                assert!(case.error(&plain, &python) <= 1e-5, "{}: the plain forward vs Python", case.name);

                let (mut ran, mut declined) = (0, 0);
                let mut counting = |call: &mut ExpertCall<'_>| {
                    let outcome = device(call);
                    *if outcome == ExpertOutcome::Computed { &mut ran } else { &mut declined } += 1;
                    outcome
                };
                let mut out = case.output();
                model.forward_ex(&mut Exec::new().expert(&mut counting), &case.input, &mut out, case.batch).unwrap();
                let err = case.error(&out, &plain);
                println!("{} ({}): Rust device vs engine {err:.3e}, {ran} ran, {declined} declined",
                         case.name, model.kernels_name());
                assert!(err <= case.tolerance, "{}: {err} > {}", case.name, case.tolerance);
                // And against the Python engine's output on the same image.
                assert!(case.error(&out, &python) <= case.tolerance + 1e-5, "{}: vs Python", case.name);
                assert!(ran > 0, "{}: the device ran nothing", case.name);
                // Only the int8-activation experts go back to the engine.
                assert_eq!(declined > 0, case.name.contains("int8act"), "{}", case.name);
                assert_ne!(bits(&out), bits(&plain), "{}: the device's rounding should differ somewhere", case.name);
            }
        });
    }
}

#[test]
fn exec_without_options_is_forward() {
    for case in hook_cases() {
        with_model(&case, 1, |model| {
            let (mut plain, mut ex) = (case.output(), case.output());
            model.forward(&case.input, &mut plain, case.batch).unwrap();
            model.forward_ex(&mut Exec::new(), &case.input, &mut ex, case.batch).unwrap();
            assert_eq!(bits(&ex), bits(&plain), "{}", case.name);
        });
    }
}

#[test]
fn declining_every_expert_is_the_plain_forward() {
    for case in hook_cases() {
        with_model(&case, 1, |model| {
            let mut plain = case.output();
            model.forward(&case.input, &mut plain, case.batch).unwrap();
            let mut offered = Vec::new();
            let mut decline = |call: &mut ExpertCall<'_>| {
                offered.push((call.layer(), call.expert()));
                ExpertOutcome::Declined
            };
            let mut out = case.output();
            model.forward_ex(&mut Exec::new().expert(&mut decline), &case.input, &mut out, case.batch).unwrap();
            assert_eq!(bits(&out), bits(&plain), "{}", case.name);
            let unique: BTreeSet<_> = offered.iter().collect();
            assert!(!offered.is_empty() && unique.len() == offered.len(), "{}: each expert offered once", case.name);
        });
    }
}

#[test]
fn declining_chosen_experts() {
    for case in hook_cases() {
        with_model(&case, 1, |model| {
            let mut plain = case.output();
            model.forward(&case.input, &mut plain, case.batch).unwrap();
            let (mut declined, mut ran) = (BTreeSet::new(), BTreeSet::new());
            // Odd expert records go back to the engine, the device runs the rest.
            let mut half = |call: &mut ExpertCall<'_>| {
                if call.expert() % 2 == 1 {
                    declined.insert(call.expert());
                    return ExpertOutcome::Declined;
                }
                ran.insert(call.expert());
                device(call)
            };
            let mut out = case.output();
            model.forward_ex(&mut Exec::new().expert(&mut half), &case.input, &mut out, case.batch).unwrap();
            assert!(case.error(&out, &plain) <= case.tolerance, "{}", case.name);
            assert!(!declined.is_empty() && !ran.is_empty(), "{}", case.name);

            // The declined experts did count: claiming them without adding anything changes the output.
            let mut drop_odd = |call: &mut ExpertCall<'_>| {
                if call.expert() % 2 == 1 { ExpertOutcome::Computed } else { device(call) }
            };
            model.forward_ex(&mut Exec::new().expert(&mut drop_odd), &case.input, &mut out, case.batch).unwrap();
            assert!(case.error(&out, &plain) > 100.0 * case.tolerance, "{}", case.name);
        });
    }
}

#[test]
fn a_failing_expert_stops_the_pass_with_its_status() {
    for case in hook_cases() {
        with_model(&case, 1, |model| {
            let mut plain = case.output();
            model.forward(&case.input, &mut plain, case.batch).unwrap();
            // Fails on the second expert offered, whichever layer it is in.
            let mut offered = Vec::new();
            let mut faulty = |call: &mut ExpertCall<'_>| {
                offered.push(call.expert());
                if offered.len() == 2 {
                    return ExpertOutcome::Failed(Status::Unsupported);
                }
                device(call)
            };
            let mut out = case.output();
            let got = model.forward_ex(&mut Exec::new().expert(&mut faulty), &case.input, &mut out, case.batch);
            assert_eq!(got, Err(Status::Unsupported), "{}", case.name);
            assert_eq!(offered.len(), 2, "{}: nothing is offered after the failure", case.name);
            // The context is intact: the next pass gives the same bits.
            model.forward(&case.input, &mut out, case.batch).unwrap();
            assert_eq!(bits(&out), bits(&plain), "{}", case.name);
        });
    }
}

#[test]
fn on_route_announces_what_the_hook_gets() {
    for case in hook_cases() {
        with_model(&case, 1, |model| {
            // (layer, expert record) -> rows announced by on_route; the shared experts get the batch.
            let mut announced = BTreeMap::new();
            let mut route = |r: &Route<'_>| {
                for s in 0..r.experts() {
                    let tokens = r.tokens(s);
                    assert_eq!(tokens.len(), r.gates(s).len());
                    assert!(tokens.windows(2).all(|w| w[0] < w[1]) && tokens.iter().all(|&t| (t as usize) < r.batch()));
                    if !tokens.is_empty() {
                        announced.insert((r.layer(), r.first_expert() + s as u32), tokens.len());
                    }
                }
                for s in 0..r.shared() {
                    announced.insert((r.layer(), r.first_expert() + (r.experts() + s) as u32), r.batch());
                }
                Ok(())
            };
            let mut seen = BTreeMap::new();
            let mut look = |call: &mut ExpertCall<'_>| {
                seen.insert((call.layer(), call.expert()), call.rows());
                assert!(call.gate(0).is_finite() && call.worker() == 0);
                assert_eq!(call.x_row(call.rows() - 1).len(), call.d());
                ExpertOutcome::Declined
            };
            let mut out = case.output();
            let mut exec = Exec::new().expert(&mut look).on_route(&mut route);
            model.forward_ex(&mut exec, &case.input, &mut out, case.batch).unwrap();
            assert_eq!(seen, announced, "{}", case.name);

            // An Err from on_route stops the pass before any expert runs.
            let mut offered = 0;
            let mut count = |_: &mut ExpertCall<'_>| {
                offered += 1;
                ExpertOutcome::Declined
            };
            let mut refuse = |_: &Route<'_>| Err(Status::BadPayloadCrc);
            let mut exec = Exec::new().expert(&mut count).on_route(&mut refuse);
            assert_eq!(model.forward_ex(&mut exec, &case.input, &mut out, case.batch), Err(Status::BadPayloadCrc));
            assert_eq!(offered, 0);
        });
    }
}

/// A host pool: the calling thread is worker 0, scoped threads the others, tasks handed out by an
/// atomic counter; the scope's join makes every task's writes visible before `run` returns.
struct Threads(usize);

// SAFETY: each task index is taken once from the counter, worker w runs on one thread only, and the
// scope joins every thread before run returns.
unsafe impl ParallelFor for Threads {
    fn workers(&self) -> usize {
        self.0
    }

    fn run(&self, tasks: usize, task: &(dyn Fn(usize, usize) + Sync)) -> Result<(), Status> {
        let next = AtomicUsize::new(0);
        let work = |worker: usize| loop {
            let t = next.fetch_add(1, Ordering::Relaxed);
            if t >= tasks {
                break;
            }
            task(t, worker);
        };
        std::thread::scope(|s| {
            for worker in 1..self.0 {
                let work = &work;
                s.spawn(move || work(worker));
            }
            work(0);
        });
        Ok(())
    }
}

/// Token models on the pool (`lm_forward_ex`, `lm_generate_ex`): prefill and each decode step give
/// `lm_forward`'s logits bit for bit, with the optimised and the reference kernels, and the same
/// generated tokens as the Python engine; one byte short of the pool's arena is `BadExec`.
#[test]
fn a_thread_pool_runs_token_models_bit_identically() {
    let pool = Threads(2);
    for case in cases("lm") {
        let name = case[1].as_str();
        let sampler = Sampler { temperature: case[2].parse().unwrap(), top_k: case[3].parse().unwrap(),
                                top_p: case[4].parse().unwrap() };
        let (seed, new): (u64, usize) = (case[5].parse().unwrap(), case[6].parse().unwrap());
        let (words, len) = image(name);
        let image = bytes(&words, len);
        let info = Model::info(image).unwrap();
        let vocab = info.vocab_size as usize;
        let prompt = i32s(fixtures().join(format!("{name}.prompt.i32")));
        let one = Model::arena_size(image).unwrap();
        let need = Model::arena_size_for(image, 2).unwrap();
        assert!(need > one, "{name}: the pool's arena");
        let (mut a1, mut a2) = (arena(one), arena(need));
        let mut single = Model::new(image, arena_bytes(&mut a1, one)).unwrap();
        let mut model = Model::new(image, arena_bytes(&mut a2, need)).unwrap();
        for reference in [false, true] {
            single.use_reference_kernels(reference).unwrap();
            model.use_reference_kernels(reference).unwrap();
            single.lm_reset().unwrap();
            model.lm_reset().unwrap();
            let (mut want, mut got) = (vec![0f32; prompt.len() * vocab], vec![0f32; prompt.len() * vocab]);
            single.lm_forward(&prompt, &mut want).unwrap();
            model.lm_forward_ex(&mut Exec::parallel(&pool), &prompt, &mut got).unwrap();
            assert_eq!(bits(&got), bits(&want), "{name}: prefill on the pool");
            for step in 0..(info.max_seq_len as usize - prompt.len()).min(24) {
                let token = [(step * 7 % vocab) as i32];
                single.lm_forward(&token, &mut want[..vocab]).unwrap();
                model.lm_forward_ex(&mut Exec::parallel(&pool), &token, &mut got[..vocab]).unwrap();
                assert_eq!(bits(&got[..vocab]), bits(&want[..vocab]), "{name}: decode step {step} on the pool");
            }
        }
        model.use_reference_kernels(true).unwrap();
        let mut logits = vec![0f32; info.max_batch as usize * vocab];
        let mut out = vec![-1i32; new];
        model.lm_generate_ex(&mut Exec::parallel(&pool), &prompt, &sampler, &mut Rng::new(seed), &mut logits, &mut out)
            .unwrap();
        assert_eq!(out, i32s(fixtures().join(format!("{name}.gen.i32"))), "{name}: generated on the pool");

        let mut short = arena(need);
        let mut small = Model::new(image, arena_bytes(&mut short, need - 1)).unwrap();
        assert_eq!(small.lm_forward_ex(&mut Exec::parallel(&pool), &prompt[..1], &mut logits[..vocab]),
                   Err(Status::BadExec), "{name}: one byte short of two workers");
        assert_eq!(small.lm_position(), Ok(0));
    }
}

#[test]
fn a_thread_pool_runs_the_hook_on_its_workers() {
    let pool = Threads(2);
    for case in hook_cases() {
        with_model(&case, 2, |model| {
            let mut plain = case.output();
            model.forward(&case.input, &mut plain, case.batch).unwrap();
            let mut out = case.output();

            // Parallel experts give the single-threaded bits (colibri.h).
            model.forward_ex(&mut Exec::parallel(&pool), &case.input, &mut out, case.batch).unwrap();
            assert_eq!(bits(&out), bits(&plain), "{}: pool, no hook", case.name);

            let workers = Mutex::new(BTreeSet::new());
            let ran = AtomicUsize::new(0);
            let shared_device = |call: &mut ExpertCall<'_>| {
                workers.lock().unwrap().insert(call.worker());
                let outcome = device(call);
                if outcome == ExpertOutcome::Computed {
                    ran.fetch_add(1, Ordering::Relaxed);
                }
                outcome
            };
            model.forward_ex(&mut Exec::parallel(&pool).expert(&shared_device), &case.input, &mut out, case.batch)
                .unwrap();
            assert!(case.error(&out, &plain) <= case.tolerance, "{}: pool with the device", case.name);
            assert!(ran.load(Ordering::Relaxed) > 0);
            assert!(workers.lock().unwrap().iter().all(|&w| w < 2));

            let declined = |_: &mut ExpertCall<'_>| ExpertOutcome::Declined;
            model.forward_ex(&mut Exec::parallel(&pool).expert(&declined), &case.input, &mut out, case.batch)
                .unwrap();
            assert_eq!(bits(&out), bits(&plain), "{}: pool, every expert declined", case.name);

            let failing = |call: &mut ExpertCall<'_>| {
                if call.layer() == 0 { ExpertOutcome::Failed(Status::NoSuchExpert) } else { device(call) }
            };
            let got = model.forward_ex(&mut Exec::parallel(&pool).expert(&failing), &case.input, &mut out, case.batch);
            assert_eq!(got, Err(Status::NoSuchExpert), "{}", case.name);
        });
        // A context whose arena holds one worker refuses a pool of two.
        with_model(&case, 1, |model| {
            let mut out = case.output();
            assert_eq!(model.forward_ex(&mut Exec::parallel(&pool), &case.input, &mut out, case.batch),
                       Err(Status::BadExec));
        });
    }
}

/// The weights the hook sees are the image's own bytes, typed as the image stores them.
#[test]
fn weights_are_typed_by_the_images_dtype() {
    for case in hook_cases() {
        let want = ["f16", "q8", "q4"].into_iter().find(|d| case.name.contains(d)).unwrap_or("f32");
        let image = case.image();
        let span = image.as_ptr_range();
        with_model(&case, 1, |model| {
            let mut kinds = BTreeSet::new();
            let mut look = |call: &mut ExpertCall<'_>| {
                for w in [Some(call.w1()), Some(call.w2()), call.w3()].into_iter().flatten() {
                    let (kind, start) = match w {
                        Weight::F32(m) => ("f32", m.data.as_ptr().cast::<u8>()),
                        Weight::F16(m) => ("f16", m.data.as_ptr().cast()),
                        Weight::I8(m) => ("q8", m.q.data.as_ptr().cast()),
                        Weight::I4(m) => ("q4", m.packed.as_ptr()),
                    };
                    assert!(span.contains(&start), "weights in place in the image");
                    kinds.insert(kind);
                }
                ExpertOutcome::Declined
            };
            let mut out = case.output();
            model.forward_ex(&mut Exec::new().expert(&mut look), &case.input, &mut out, case.batch).unwrap();
            assert_eq!(kinds, BTreeSet::from([want]), "{}", case.name);
        });
    }
}

#[test]
fn f16_widening_is_exact() {
    for bits in 0..=u16::MAX {
        let (sign, exp, man) = (bits >> 15, (bits >> 10) & 0x1F, (bits & 0x3FF) as f64);
        let got = colibri::f16_to_f32(bits);
        let magnitude = match exp {
            0 => man * 2f64.powi(-24),
            0x1F if man == 0.0 => f64::INFINITY,
            0x1F => {
                assert!(got.is_nan(), "{bits:#06x}");
                continue;
            }
            _ => (1.0 + man / 1024.0) * 2f64.powi(exp as i32 - 15),
        };
        let want = if sign == 1 { -magnitude } else { magnitude };
        assert_eq!(got as f64, want, "{bits:#06x}");
        assert_eq!(got.is_sign_negative(), sign == 1, "{bits:#06x}");
    }
}

/// A panic in a hook must not unwind through the engine's C frames: the trampoline is `extern "C"`,
/// so the process aborts. Checked in a child process (this test binary, re-run on this test alone).
#[test]
fn a_panicking_hook_aborts_instead_of_unwinding() {
    const CHILD: &str = "COLIBRI_HOOK_PANIC_CHILD";
    let case = &hook_cases()[0];
    if std::env::var_os(CHILD).is_some() {
        with_model(case, 1, |model| {
            let mut boom = |call: &mut ExpertCall<'_>| -> ExpertOutcome { panic!("device fault on expert {}", call.expert()) };
            let mut out = case.output();
            let _ = model.forward_ex(&mut Exec::new().expert(&mut boom), &case.input, &mut out, case.batch);
        });
        println!("CHILD SURVIVED");
        return;
    }
    let child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["a_panicking_hook_aborts_instead_of_unwinding", "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&child.stdout), String::from_utf8_lossy(&child.stderr));
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(child.status.signal(), Some(6), "the child should abort (SIGABRT): {stdout}\n{stderr}");
    assert!(stderr.contains("device fault on expert"), "{stderr}");
    assert!(stderr.contains("panic in a function that cannot unwind"), "{stderr}");
    assert!(!stdout.contains("CHILD SURVIVED"));
}

/// A model can move to another thread (with its borrows) and be shared read-only: the context has
/// no tie to the thread that built it, and every call that writes it takes `&mut self`.
#[test]
fn a_model_moves_to_another_thread() {
    fn send_and_sync<T: Send + Sync>() {}
    send_and_sync::<Model<'static>>();
    let case = &hook_cases()[0];
    with_model(case, 1, |model| {
        let mut here = case.output();
        model.forward(&case.input, &mut here, case.batch).unwrap();
        let name = model.kernels_name();
        let shared: &Model<'_> = model;
        std::thread::scope(|s| {
            s.spawn(|| assert_eq!(shared.kernels_name(), name));
            s.spawn(|| assert_eq!(shared.model_info().max_batch as usize, case.batch));
        });
        let moved: &mut Model<'_> = model;
        let there = std::thread::scope(|s| {
            s.spawn(move || {
                let mut out = case.output();
                moved.forward(&case.input, &mut out, case.batch).unwrap();
                out
            })
            .join()
            .unwrap()
        });
        assert_eq!(bits(&there), bits(&here));
    });
}

#[test]
fn forward_ex_on_a_token_model_is_model_kind() {
    let (words, len) = image(&cases("lm")[0][1]);
    let image = bytes(&words, len);
    let need = Model::arena_size(image).unwrap();
    let mut a = arena(need);
    let mut model = Model::new(image, arena_bytes(&mut a, need)).unwrap();
    let mut never = |_: &mut ExpertCall<'_>| -> ExpertOutcome { unreachable!() };
    let mut out = vec![0f32; model.model_info().output_size as usize];
    assert_eq!(model.forward_ex(&mut Exec::new().expert(&mut never), &[0.0], &mut out, 1), Err(Status::ModelKind));
}

/// The image offsets the hook's view reads are format.py's (layout.txt, from its struct formats).
#[test]
fn image_layout_matches_format_py() {
    let text = std::fs::read_to_string(fixtures().join("layout.txt")).unwrap();
    let python: BTreeMap<(String, String), usize> = text
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            ((f[0].to_string(), f[1].to_string()), f[2].parse().unwrap())
        })
        .collect();
    assert!(python.len() > 30, "layout.txt: only {} fields", python.len());
    for (record, field, offset) in colibri::layout::ALL {
        assert_eq!(python.get(&(record.to_string(), field.to_string())), Some(&offset), "{record}.{field}");
    }
}

/// The Rust view places a Q4_PARAMS payload's fields where format.py's q4_layout does
/// (q4_layout.txt: rows cols nnz group_log2 bias, then scale bias row_ptr col val size, -1 for none).
#[test]
fn q4_payload_layout_matches_format_py() {
    let text = std::fs::read_to_string(fixtures().join("q4_layout.txt")).unwrap();
    let mut checked = 0;
    for line in text.lines() {
        let f: Vec<i64> = line.split_whitespace().map(|v| v.parse().unwrap()).collect();
        let [rows, cols, nnz, g, bias] = [f[0], f[1], f[2], f[3], f[4]].map(|v| v as usize);
        let at = colibri::layout::q4_payload(rows, cols, nnz, g as u32, bias == 1).unwrap();
        let opt = |v: Option<usize>| v.map_or(-1, |v| v as i64);
        let e = at.compensation;
        let got = [at.scale as i64, opt(at.bias), opt(e.map(|e| e.0)), opt(e.map(|e| e.2)), opt(e.map(|e| e.3)),
                   at.size as i64];
        assert_eq!(got[..], f[5..], "{line}");
        if let Some((_, width, _, _)) = e {
            assert_eq!(width, if nnz > 0xFFFF { 4 } else if nnz > 0xFF { 2 } else { 1 }, "{line}");
        }
        checked += 1;
    }
    assert!(checked >= 100, "q4_layout.txt: only {checked} layouts");
}
