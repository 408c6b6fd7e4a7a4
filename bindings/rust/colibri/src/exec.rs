//! `colibri_forward_ex`'s options in Rust: the accelerator hook, the routing
//! callback and a caller's thread pool, all borrowed for the call (no
//! allocation, no std).
//!
//! Panics. The callbacks run inside the C engine, called through
//! `extern "C"` trampolines. Rust (1.81 on) aborts the process when a panic
//! tries to unwind out of an `extern "C"` function, so a panicking hook never
//! unwinds through the engine's frames (which would leave the context half
//! updated and is undefined behaviour): it aborts, whatever the panic
//! strategy. On a `no_std` target (`panic = "abort"`, a `#[panic_handler]`)
//! that is the only behaviour there is; a `std` caller that wants to survive
//! a panic in its own device code catches it inside the hook
//! (`std::panic::catch_unwind`) and returns `ExpertOutcome::Failed`.

use core::ffi::c_void;
use core::marker::PhantomData;
use core::ptr;
use core::slice;

use crate::expert::{expert_call, ExpertCall, ExpertOutcome};
use crate::{sys, Status};

/// One MoE layer's routing (`colibri_route`), shown to the `on_route`
/// callback after the router ran and before any of the layer's experts runs.
pub struct Route<'r> {
    raw: &'r sys::colibri_route,
    tokens: &'r [u32],
    token: &'r [u16],
    gate: &'r [f32],
}

impl<'r> Route<'r> {
    /// The MoE layer, 0-based in program order.
    pub fn layer(&self) -> u32 {
        self.raw.layer
    }
    /// The expert record of routed slot 0: slot `s` is record `first_expert() + s`.
    pub fn first_expert(&self) -> u32 {
        self.raw.first_expert
    }
    /// Routed slots of the layer.
    pub fn experts(&self) -> usize {
        self.raw.experts as usize
    }
    /// Shared experts (records after the routed ones), which run for every token.
    pub fn shared(&self) -> usize {
        self.raw.shared as usize
    }
    /// Tokens in this forward pass (chunk).
    pub fn batch(&self) -> usize {
        self.raw.batch
    }
    /// The token indices routed to slot `s` (empty: the slot will not run).
    pub fn tokens(&self, s: usize) -> &'r [u16] {
        let at = s * self.batch();
        &self.token[at..at + self.tokens[s] as usize]
    }
    /// Their gate weights.
    pub fn gates(&self, s: usize) -> &'r [f32] {
        let at = s * self.batch();
        &self.gate[at..at + self.tokens[s] as usize]
    }
}

/// A caller's pool of workers for `colibri_forward_ex`'s `parallel_for`: the
/// experts of each MoE layer then run as parallel tasks, with bit for bit
/// the results of the single-threaded pass. The engine starts no thread:
/// a host implements this with threads, a dual-core microcontroller with its
/// second core, an RTOS with its tasks.
///
/// # Safety
///
/// The engine hands every task scratch memory chosen by its worker index
/// and reads the results after `run` returns, so an implementation must:
/// call `task(t, worker)` exactly once for every `t` in `0..tasks`, with
/// `worker < self.workers()`, never run two tasks with the same worker
/// index at once, and return only when every task has finished, its writes
/// visible to the calling thread (a join, or a release/acquire handshake).
/// Returning `Err` is allowed only once no task is running.
pub unsafe trait ParallelFor {
    /// Workers `run` spreads tasks over (the calling thread may be one).
    /// The model's arena must hold them: [`crate::Model::arena_size_for`].
    fn workers(&self) -> usize;

    /// Runs `task(t, worker)` for `t` in `0..tasks` as the trait's contract says.
    fn run(&self, tasks: usize, task: &(dyn Fn(usize, usize) + Sync)) -> Result<(), Status>;
}

/// A single-threaded accelerator hook ([`Exec::expert`] without a pool).
pub type ExpertFn<'h> = dyn FnMut(&mut ExpertCall<'_>) -> ExpertOutcome + 'h;
/// An accelerator hook the workers of a [`ParallelFor`] pool call, several at once.
pub type SharedExpertFn<'h> = dyn Fn(&mut ExpertCall<'_>) -> ExpertOutcome + Sync + 'h;
/// The routing callback ([`Exec::on_route`]).
pub type RouteFn<'h> = dyn FnMut(&Route<'_>) -> Result<(), Status> + 'h;

/// The hook's form in each threading mode.
enum Hook<'h> {
    None,
    /// Single-threaded: calls come one at a time on the calling thread.
    Serial(&'h mut ExpertFn<'h>),
    /// With a pool: several experts at once, on the workers.
    Shared(&'h SharedExpertFn<'h>),
}

/// Marker: single-threaded options (the hook may be `FnMut`).
pub enum Serial {}
/// Marker: options with a [`ParallelFor`] pool (the hook must be `Fn + Sync`).
pub enum Parallel {}

/// The options of [`crate::Model::forward_ex`] (`colibri_exec`), built from
/// borrowed callbacks: nothing is allocated, and the borrows (`'h`) keep
/// every callback alive and unaliased for as long as the options exist.
///
/// ```no_run
/// # use colibri::{Exec, ExpertCall, ExpertOutcome};
/// # fn demo(model: &mut colibri::Model, x: &[f32], y: &mut [f32]) -> Result<(), colibri::Status> {
/// let mut offered = 0;
/// let mut device = |call: &mut ExpertCall<'_>| {
///     offered += 1;
///     if call.int8_act() { ExpertOutcome::Declined } else { /* run it, accumulate */ ExpertOutcome::Computed }
/// };
/// model.forward_ex(&mut Exec::new().expert(&mut device), x, y, 1)?;
/// # Ok(()) }
/// ```
pub struct Exec<'h, M = Serial> {
    hook: Hook<'h>,
    on_route: Option<&'h mut RouteFn<'h>>,
    pool: Option<&'h (dyn ParallelFor + 'h)>,
    _mode: PhantomData<M>,
}

impl<'h> Exec<'h, Serial> {
    /// No options: exactly `forward`.
    pub fn new() -> Self {
        Exec { hook: Hook::None, on_route: None, pool: None, _mode: PhantomData }
    }

    /// The accelerator hook: offered every expert that has tokens in a pass
    /// (routed experts over their ring, then the shared ones over the batch).
    pub fn expert(mut self, hook: &'h mut ExpertFn<'h>) -> Self {
        self.hook = Hook::Serial(hook);
        self
    }
}

impl Default for Exec<'_, Serial> {
    fn default() -> Self {
        Self::new()
    }
}

impl<'h> Exec<'h, Parallel> {
    /// Options that run each MoE layer's experts on `pool`'s workers.
    pub fn parallel(pool: &'h (dyn ParallelFor + 'h)) -> Self {
        Exec { hook: Hook::None, on_route: None, pool: Some(pool), _mode: PhantomData }
    }

    /// The accelerator hook, called from the workers (several at once).
    pub fn expert(mut self, hook: &'h SharedExpertFn<'h>) -> Self {
        self.hook = Hook::Shared(hook);
        self
    }
}

impl<'h, M> Exec<'h, M> {
    /// Called once per MoE layer on the calling thread, after routing and
    /// before the layer's experts run; an `Err` stops the pass with it.
    pub fn on_route(mut self, f: &'h mut RouteFn<'h>) -> Self {
        self.on_route = Some(f);
        self
    }
}

/// What `user` points at for the expert trampolines: the image the weights
/// are typed from and the hook.
struct HookState<'s, F: ?Sized> {
    image: &'s [u8],
    hook: F,
}

fn offer(image: &[u8], call: *const sys::colibri_expert_call, run: impl FnOnce(&mut ExpertCall<'_>) -> ExpertOutcome) -> sys::colibri_status {
    // SAFETY: the engine passes a valid call for the duration of the hook,
    // over the context's image.
    match unsafe { expert_call(image, &*call) } {
        Ok(mut view) => run(&mut view).code(),
        Err(status) => status.code(),
    }
}

unsafe extern "C" fn expert_serial(user: *mut c_void, call: *const sys::colibri_expert_call) -> sys::colibri_status {
    // SAFETY: `user` is the HookState forward_ex built for this call; without
    // parallel_for the engine calls the hook on this thread, one call at a
    // time, so the &mut is unique.
    type Serial<'a> = HookState<'a, &'a mut ExpertFn<'a>>;
    let state = unsafe { &mut *user.cast::<Serial<'_>>() };
    offer(state.image, call, |view| (state.hook)(view))
}

unsafe extern "C" fn expert_shared(user: *mut c_void, call: *const sys::colibri_expert_call) -> sys::colibri_status {
    // SAFETY: as above, shared: the hook is Fn + Sync, called from any worker.
    type Shared<'a> = HookState<'a, &'a SharedExpertFn<'a>>;
    let state = unsafe { &*user.cast::<Shared<'_>>() };
    offer(state.image, call, |view| (state.hook)(view))
}

/// A C array as a slice: empty for a NULL pointer (which only an empty
/// array may have: the caller compares the length).
///
/// SAFETY: a non-NULL `p` is valid for `len` reads for `'r`.
unsafe fn c_slice<'r, T>(p: *const T, len: usize) -> &'r [T] {
    if p.is_null() { &[] } else { unsafe { slice::from_raw_parts(p, len) } }
}

unsafe extern "C" fn on_route(user: *mut c_void, route: *const sys::colibri_route) -> sys::colibri_status {
    type Callback<'a> = &'a mut RouteFn<'a>;
    // SAFETY: `user` is the callback forward_ex passed; the engine calls it
    // on this thread. The route's arrays have the lengths colibri.h gives:
    // tokens [experts], token and gate [experts * batch].
    unsafe {
        let f = &mut *user.cast::<Callback<'_>>();
        let raw = &*route;
        let slots = raw.experts as usize;
        let all = slots * raw.batch;
        let view = Route {
            raw,
            tokens: c_slice(raw.tokens, slots),
            token: c_slice(raw.token, all),
            gate: c_slice(raw.gate, all),
        };
        if view.tokens.len() != slots || view.token.len() != all || view.gate.len() != all {
            return sys::COLIBRI_E_NULL_ARG;
        }
        match f(&view) {
            Ok(()) => sys::COLIBRI_OK,
            Err(status) => status.code(),
        }
    }
}

/// The engine's task function and argument, shared with the pool's workers.
struct Task {
    f: unsafe extern "C" fn(*mut c_void, usize, usize),
    arg: *mut c_void,
}

// SAFETY: the engine's parallel tasks are written to run on any worker at
// once (each writes only its own staging rows and scratch); that is what
// parallel_for is for.
unsafe impl Sync for Task {}

impl Task {
    /// SAFETY: within a `ParallelFor::run` that keeps the trait's contract.
    unsafe fn run(&self, t: usize, worker: usize) {
        unsafe { (self.f)(self.arg, t, worker) }
    }
}

unsafe extern "C" fn parallel_for(
    user: *mut c_void,
    f: sys::colibri_task_fn,
    arg: *mut c_void,
    tasks: usize,
) -> sys::colibri_status {
    let Some(f) = f else { return sys::COLIBRI_E_NULL_ARG };
    // SAFETY: `user` is the &dyn ParallelFor forward_ex passed.
    let pool = unsafe { &*user.cast::<&dyn ParallelFor>() };
    let task = Task { f, arg };
    // SAFETY: the pool's contract (ParallelFor) is what the engine's
    // parallel_for requires of the tasks' worker indices and completion.
    let run = |t: usize, worker: usize| unsafe { task.run(t, worker) };
    match pool.run(tasks, &run) {
        Ok(()) => sys::COLIBRI_OK,
        Err(status) => status.code(),
    }
}

/// Builds the `colibri_exec` of `exec`'s callbacks and runs `call` with it;
/// every callback's state lives on this frame for the whole C call.
///
/// SAFETY: `call` passes the exec to one engine call on a live context over
/// `image`, borrowed exclusively.
unsafe fn with_exec<M>(
    image: &[u8],
    exec: &mut Exec<'_, M>,
    call: impl FnOnce(&sys::colibri_exec) -> sys::colibri_status,
) -> sys::colibri_status {
    let mut raw = sys::colibri_exec::INIT;
    let mut serial;
    let shared;
    match &mut exec.hook {
        Hook::None => {}
        Hook::Serial(hook) => {
            serial = HookState { image, hook: &mut **hook };
            raw.expert = Some(expert_serial);
            raw.expert_user = ptr::addr_of_mut!(serial).cast();
        }
        Hook::Shared(hook) => {
            shared = HookState { image, hook: *hook };
            raw.expert = Some(expert_shared);
            raw.expert_user = ptr::addr_of!(shared).cast_mut().cast();
        }
    }
    let mut route;
    if let Some(f) = exec.on_route.as_mut() {
        route = &mut **f;
        raw.on_route = Some(on_route);
        raw.on_route_user = ptr::addr_of_mut!(route).cast();
    }
    let pool;
    if let Some(p) = exec.pool {
        pool = p;
        raw.parallel_for = Some(parallel_for);
        raw.parallel_for_user = ptr::addr_of!(pool).cast_mut().cast();
        raw.workers = u32::try_from(p.workers()).unwrap_or(u32::MAX);
    }
    call(&raw)
}

/// Runs `colibri_forward_ex` with `exec`'s callbacks (see Model::forward_ex).
///
/// SAFETY: `ctx` is a live context over `image`, borrowed exclusively.
pub(crate) unsafe fn forward_ex<M>(
    ctx: *mut sys::colibri_ctx,
    image: &[u8],
    exec: &mut Exec<'_, M>,
    input: &[f32],
    output: &mut [f32],
    batch: usize,
) -> sys::colibri_status {
    // SAFETY: the caller's context; the engine checks the lengths against
    // batch, and every user pointer outlives the call (with_exec's frame).
    unsafe {
        with_exec(image, exec, |raw| {
            sys::colibri_forward_ex(ctx, raw, batch, input.as_ptr(), input.len(), output.as_mut_ptr(), output.len())
        })
    }
}

/// Runs `colibri_lm_forward_ex` with `exec`'s callbacks (see Model::lm_forward_ex).
///
/// SAFETY: `ctx` is a live context over `image`, borrowed exclusively.
pub(crate) unsafe fn lm_forward_ex<M>(
    ctx: *mut sys::colibri_ctx,
    image: &[u8],
    exec: &mut Exec<'_, M>,
    tokens: &[i32],
    n: u32,
    logits: &mut [f32],
) -> sys::colibri_status {
    // SAFETY: as forward_ex; the engine checks n and logits.len() first.
    unsafe {
        with_exec(image, exec, |raw| {
            sys::colibri_lm_forward_ex(ctx, raw, tokens.as_ptr(), n, logits.as_mut_ptr(), logits.len())
        })
    }
}
