//! Safe bindings to Colibri, the static-allocation MoE inference engine.
//!
//! `no_std` and allocation-free, like the engine: a [`Model`] borrows its
//! image (`&[u8]`: flash, a `static`, a mapped file) and runs in an arena the
//! caller provides (`&mut [u8]`, at least [`Model::arena_size`] bytes, 8-byte
//! aligned: [`Arena`] gives one). Both borrows last as long as the model.
//!
//! ```no_run
//! # fn demo(image: &[u8]) -> Result<(), colibri::Status> {
//! static mut ARENA: colibri::Arena<65536> = colibri::Arena::new();
//! let arena = unsafe { &mut *core::ptr::addr_of_mut!(ARENA) };
//! let mut model = colibri::Model::new(image, arena.as_mut_slice())?;
//! let (input, mut output) = ([0.0f32; 8], [0.0f32; 4]);
//! model.forward(&input, &mut output, 1)?;
//! # Ok(()) }
//! ```
//!
//! [`Model::forward_ex`] takes [`Exec`] options: an accelerator hook that may
//! run any expert on the caller's device ([`ExpertCall`], [`ExpertOutcome`]),
//! a routing callback ([`Route`]) and a caller's pool of workers
//! ([`ParallelFor`]), all borrowed for the call.
#![no_std]

use core::ffi::{c_void, CStr};
use core::fmt;
use core::marker::PhantomData;
use core::ptr;

pub use colibri_sys as sys;
pub use sys::colibri_model_info as ModelInfo;

mod exec;
mod expert;

pub use exec::{Exec, ExpertFn, Parallel, ParallelFor, Route, RouteFn, Serial, SharedExpertFn};
pub use expert::layout;
pub use expert::{
    f16_to_f32, Activation, Compensation, ExpertCall, ExpertKind, ExpertOutcome, Matrix, Params, Q4Matrix, Q8Matrix, Weight,
};

/// A failed call: every negative `colibri_status` of `colibri_format.h`.
/// `Display` is the engine's own text (`colibri_strerror`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum Status {
    NullArg = sys::COLIBRI_E_NULL_ARG,
    Truncated = sys::COLIBRI_E_TRUNCATED,
    BadMagic = sys::COLIBRI_E_BAD_MAGIC,
    BadVersion = sys::COLIBRI_E_BAD_VERSION,
    BadHeader = sys::COLIBRI_E_BAD_HEADER,
    BadCrc = sys::COLIBRI_E_BAD_CRC,
    TableBounds = sys::COLIBRI_E_TABLE_BOUNDS,
    TensorBounds = sys::COLIBRI_E_TENSOR_BOUNDS,
    BadTensor = sys::COLIBRI_E_BAD_TENSOR,
    BadRef = sys::COLIBRI_E_BAD_REF,
    BadLayer = sys::COLIBRI_E_BAD_LAYER,
    BadMoe = sys::COLIBRI_E_BAD_MOE,
    Unsupported = sys::COLIBRI_E_UNSUPPORTED,
    ArenaTooSmall = sys::COLIBRI_E_ARENA_TOO_SMALL,
    ArenaAlign = sys::COLIBRI_E_ARENA_ALIGN,
    ImageAlign = sys::COLIBRI_E_IMAGE_ALIGN,
    BadBatch = sys::COLIBRI_E_BAD_BATCH,
    BufferSize = sys::COLIBRI_E_BUFFER_SIZE,
    BadContext = sys::COLIBRI_E_BAD_CONTEXT,
    BadQuant = sys::COLIBRI_E_BAD_QUANT,
    BadCompensation = sys::COLIBRI_E_BAD_COMPENSATION,
    UnsupportedVersion = sys::COLIBRI_E_UNSUPPORTED_VERSION,
    BadExec = sys::COLIBRI_E_BAD_EXEC,
    BadPayloadCrc = sys::COLIBRI_E_BAD_PAYLOAD_CRC,
    FileNotFound = sys::COLIBRI_E_FILE_NOT_FOUND,
    FileOpen = sys::COLIBRI_E_FILE_OPEN,
    MmapFailed = sys::COLIBRI_E_MMAP_FAILED,
    MlockFailed = sys::COLIBRI_E_MLOCK_FAILED,
    FileChanged = sys::COLIBRI_E_FILE_CHANGED,
    NoSuchExpert = sys::COLIBRI_E_NO_SUCH_EXPERT,
    BadAttention = sys::COLIBRI_E_BAD_ATTENTION,
    CacheFull = sys::COLIBRI_E_CACHE_FULL,
    BadToken = sys::COLIBRI_E_BAD_TOKEN,
    ModelKind = sys::COLIBRI_E_MODEL_KIND,
    BadSampler = sys::COLIBRI_E_BAD_SAMPLER,
    NanLogits = sys::COLIBRI_E_NAN_LOGITS,
    ImageTooLarge = sys::COLIBRI_E_IMAGE_TOO_LARGE,
    BadTokenizer = sys::COLIBRI_E_BAD_TOKENIZER,
    NoTokenizer = sys::COLIBRI_E_NO_TOKENIZER,
    BadText = sys::COLIBRI_E_BAD_TEXT,
    TextNotNormalized = sys::COLIBRI_E_TEXT_NOT_NORMALIZED,
}

impl Status {
    /// Every failure status, in the header's order.
    pub const ALL: [Status; 41] = [Status::NullArg, Status::Truncated, Status::BadMagic, Status::BadVersion, Status::BadHeader, Status::BadCrc, Status::TableBounds, Status::TensorBounds, Status::BadTensor, Status::BadRef, Status::BadLayer, Status::BadMoe, Status::Unsupported, Status::ArenaTooSmall, Status::ArenaAlign, Status::ImageAlign, Status::BadBatch, Status::BufferSize, Status::BadContext, Status::BadQuant, Status::BadCompensation, Status::UnsupportedVersion, Status::BadExec, Status::BadPayloadCrc, Status::FileNotFound, Status::FileOpen, Status::MmapFailed, Status::MlockFailed, Status::FileChanged, Status::NoSuchExpert, Status::BadAttention, Status::CacheFull, Status::BadToken, Status::ModelKind, Status::BadSampler, Status::NanLogits, Status::ImageTooLarge, Status::BadTokenizer, Status::NoTokenizer, Status::BadText, Status::TextNotNormalized];

    /// The C value.
    pub const fn code(self) -> i32 {
        self as i32
    }

    /// The status for a C value; `None` for `COLIBRI_OK` and for any value
    /// this crate does not know (see [`check`]).
    pub const fn from_code(code: i32) -> Option<Status> {
        Some(match code {
            sys::COLIBRI_E_NULL_ARG => Status::NullArg,
            sys::COLIBRI_E_TRUNCATED => Status::Truncated,
            sys::COLIBRI_E_BAD_MAGIC => Status::BadMagic,
            sys::COLIBRI_E_BAD_VERSION => Status::BadVersion,
            sys::COLIBRI_E_BAD_HEADER => Status::BadHeader,
            sys::COLIBRI_E_BAD_CRC => Status::BadCrc,
            sys::COLIBRI_E_TABLE_BOUNDS => Status::TableBounds,
            sys::COLIBRI_E_TENSOR_BOUNDS => Status::TensorBounds,
            sys::COLIBRI_E_BAD_TENSOR => Status::BadTensor,
            sys::COLIBRI_E_BAD_REF => Status::BadRef,
            sys::COLIBRI_E_BAD_LAYER => Status::BadLayer,
            sys::COLIBRI_E_BAD_MOE => Status::BadMoe,
            sys::COLIBRI_E_UNSUPPORTED => Status::Unsupported,
            sys::COLIBRI_E_ARENA_TOO_SMALL => Status::ArenaTooSmall,
            sys::COLIBRI_E_ARENA_ALIGN => Status::ArenaAlign,
            sys::COLIBRI_E_IMAGE_ALIGN => Status::ImageAlign,
            sys::COLIBRI_E_BAD_BATCH => Status::BadBatch,
            sys::COLIBRI_E_BUFFER_SIZE => Status::BufferSize,
            sys::COLIBRI_E_BAD_CONTEXT => Status::BadContext,
            sys::COLIBRI_E_BAD_QUANT => Status::BadQuant,
            sys::COLIBRI_E_BAD_COMPENSATION => Status::BadCompensation,
            sys::COLIBRI_E_UNSUPPORTED_VERSION => Status::UnsupportedVersion,
            sys::COLIBRI_E_BAD_EXEC => Status::BadExec,
            sys::COLIBRI_E_BAD_PAYLOAD_CRC => Status::BadPayloadCrc,
            sys::COLIBRI_E_FILE_NOT_FOUND => Status::FileNotFound,
            sys::COLIBRI_E_FILE_OPEN => Status::FileOpen,
            sys::COLIBRI_E_MMAP_FAILED => Status::MmapFailed,
            sys::COLIBRI_E_MLOCK_FAILED => Status::MlockFailed,
            sys::COLIBRI_E_FILE_CHANGED => Status::FileChanged,
            sys::COLIBRI_E_NO_SUCH_EXPERT => Status::NoSuchExpert,
            sys::COLIBRI_E_BAD_ATTENTION => Status::BadAttention,
            sys::COLIBRI_E_CACHE_FULL => Status::CacheFull,
            sys::COLIBRI_E_BAD_TOKEN => Status::BadToken,
            sys::COLIBRI_E_MODEL_KIND => Status::ModelKind,
            sys::COLIBRI_E_BAD_SAMPLER => Status::BadSampler,
            sys::COLIBRI_E_NAN_LOGITS => Status::NanLogits,
            sys::COLIBRI_E_IMAGE_TOO_LARGE => Status::ImageTooLarge,
            sys::COLIBRI_E_BAD_TOKENIZER => Status::BadTokenizer,
            sys::COLIBRI_E_NO_TOKENIZER => Status::NoTokenizer,
            sys::COLIBRI_E_BAD_TEXT => Status::BadText,
            sys::COLIBRI_E_TEXT_NOT_NORMALIZED => Status::TextNotNormalized,
            _ => return None,
        })
    }
}

/// The engine's text for a status code (`colibri_strerror`): static, never NULL.
fn strerror(code: i32) -> &'static str {
    // SAFETY: colibri_strerror returns a static NUL-terminated ASCII string for any int.
    let text = unsafe { CStr::from_ptr(sys::colibri_strerror(code)) };
    text.to_str().unwrap_or("(status text is not UTF-8)")
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(strerror(self.code()))
    }
}

impl core::error::Error for Status {}

/// Maps a C status to a `Result`. A value the header does not list (a newer
/// engine than these bindings) can only come from a mismatched build, so it
/// panics rather than being folded into an unrelated variant.
pub fn check(code: sys::colibri_status) -> Result<(), Status> {
    if code == sys::COLIBRI_OK {
        return Ok(());
    }
    match Status::from_code(code) {
        Some(status) => Err(status),
        None => panic!("colibri returned status {code}, unknown to these bindings ({})", strerror(code)),
    }
}

/// The engine's version string (`colibri_version`).
pub fn version() -> &'static str {
    // SAFETY: a static NUL-terminated string.
    unsafe { CStr::from_ptr(sys::colibri_version()) }.to_str().unwrap_or("")
}

/// An arena with the alignment the engine requires ([`sys::COLIBRI_ARENA_ALIGN`]),
/// for a `static` or a stack buffer of a size known at compile time.
#[repr(C, align(8))]
pub struct Arena<const N: usize>([u8; N]);

impl<const N: usize> Arena<N> {
    pub const fn new() -> Self {
        Arena([0; N])
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.0
    }
}

impl<const N: usize> Default for Arena<N> {
    fn default() -> Self {
        Self::new()
    }
}

/// Full validation of an image (`colibri_validate`): header, CRCs, every table and reference.
pub fn validate(image: &[u8]) -> Result<(), Status> {
    // SAFETY: the engine reads at most image.len() bytes.
    check(unsafe { sys::colibri_validate(image.as_ptr().cast(), image.len()) })
}

/// A model ready to run: a context in the caller's arena over the caller's image.
///
/// `'a` covers both borrows: the engine reads the image in place and keeps
/// its context and activations in the arena until the model is dropped
/// (`colibri_free`), after which the arena is the caller's again.
pub struct Model<'a> {
    ctx: *mut sys::colibri_ctx,
    info: ModelInfo,
    /// The accelerator hook types each expert's weights from the image.
    image: &'a [u8],
    _arena: PhantomData<&'a mut [u8]>,
}

// SAFETY: a context has no tie to the thread that built it (no thread-local
// state, no OS handles): moving a model to another thread, with its borrows,
// is sound. Calls that write the context take &mut self, so one thread at a
// time runs them, as colibri.h requires. The &self calls (model_info,
// kernels_name, lm_position) only read the context, so sharing &Model
// between threads is sound too.
unsafe impl Send for Model<'_> {}
unsafe impl Sync for Model<'_> {}

impl<'a> Model<'a> {
    /// The exact arena bytes [`Model::new`] needs for this image (`colibri_model_size`).
    pub fn arena_size(image: &[u8]) -> Result<usize, Status> {
        let mut size = 0usize;
        // SAFETY: reads at most image.len() bytes, writes one usize.
        check(unsafe { sys::colibri_model_size(image.as_ptr().cast(), image.len(), &mut size) })?;
        Ok(size)
    }

    /// The image's description (`colibri_get_info`), without building a context.
    pub fn info(image: &[u8]) -> Result<ModelInfo, Status> {
        let mut info = ModelInfo::default();
        // SAFETY: reads at most image.len() bytes, writes one colibri_model_info.
        check(unsafe { sys::colibri_get_info(image.as_ptr().cast(), image.len(), &mut info) })?;
        Ok(info)
    }

    /// Validates the image fully and builds the context in `arena`
    /// (`colibri_init`). The image must be 4-byte aligned
    /// ([`Status::ImageAlign`]) and the arena 8-byte aligned
    /// ([`Status::ArenaAlign`]) and at least [`Model::arena_size`] bytes
    /// ([`Status::ArenaTooSmall`]).
    pub fn new(image: &'a [u8], arena: &'a mut [u8]) -> Result<Model<'a>, Status> {
        let info = Self::info(image)?;
        let mut ctx = ptr::null_mut();
        // SAFETY: both slices outlive the context (the lifetime 'a on Model),
        // the arena is borrowed exclusively, and the engine stays within both lengths.
        check(unsafe {
            sys::colibri_init(
                &mut ctx,
                arena.as_mut_ptr().cast::<c_void>(),
                arena.len(),
                image.as_ptr().cast(),
                image.len(),
            )
        })?;
        Ok(Model { ctx, info, image, _arena: PhantomData })
    }

    /// Runs `batch` tokens: `input` is `[batch, input_size]`, `output`
    /// `[batch, output_size]`, row-major. [`Status::BadBatch`] for a batch
    /// outside 1..=max_batch, [`Status::BufferSize`] for slices of any other length.
    pub fn forward(&mut self, input: &[f32], output: &mut [f32], batch: usize) -> Result<(), Status> {
        // SAFETY: the context is live (self), the engine checks both lengths
        // against batch before reading or writing.
        check(unsafe {
            sys::colibri_forward(self.ctx, batch, input.as_ptr(), input.len(), output.as_mut_ptr(), output.len())
        })
    }

    /// The exact arena bytes for running this image with up to `workers`
    /// workers of a [`ParallelFor`] pool (`colibri_model_size_ex`): the
    /// single-threaded size plus each extra worker's scratch.
    pub fn arena_size_for(image: &[u8], workers: usize) -> Result<usize, Status> {
        let mut size = 0usize;
        // SAFETY: reads at most image.len() bytes, writes one usize.
        check(unsafe { sys::colibri_model_size_ex(image.as_ptr().cast(), image.len(), workers, &mut size) })?;
        Ok(size)
    }

    /// [`Model::forward`] with caller-supplied options (`colibri_forward_ex`):
    /// an accelerator hook that may run any expert on the caller's device,
    /// a routing callback, a pool of workers. [`Status::BadExec`] for more
    /// workers than the arena holds; a hook's `Failed(status)` or a
    /// callback's `Err(status)` stops the pass and is returned here.
    /// `Exec::new()` with nothing set is exactly `forward`.
    pub fn forward_ex<M>(
        &mut self,
        exec: &mut Exec<'_, M>,
        input: &[f32],
        output: &mut [f32],
        batch: usize,
    ) -> Result<(), Status> {
        // SAFETY: the live context over self.image, borrowed exclusively.
        check(unsafe { exec::forward_ex(self.ctx, self.image, exec, input, output, batch) })
    }

    /// The model's description, as [`Model::info`] on its image.
    pub fn model_info(&self) -> &ModelInfo {
        &self.info
    }

    /// Switches to the reference kernels (the specification: plain C in
    /// index order) or back to the build's optimised ones.
    pub fn use_reference_kernels(&mut self, reference: bool) -> Result<(), Status> {
        let set = if reference { sys::COLIBRI_KERNELS_REFERENCE } else { sys::COLIBRI_KERNELS_OPTIMISED };
        // SAFETY: live context.
        check(unsafe { sys::colibri_set_kernels(self.ctx, set) })
    }

    /// The kernels this model runs, e.g. "reference" or "x86-64 avx2+fma+f16c".
    pub fn kernels_name(&self) -> &'static str {
        // SAFETY: a static NUL-terminated string for any context.
        unsafe { CStr::from_ptr(sys::colibri_kernels_name(self.ctx)) }.to_str().unwrap_or("")
    }
}

/// The sampler's random numbers (SplitMix64), seeded by the caller so a
/// generation is reproducible: the same seed draws the same tokens as the
/// C, Python and MicroPython callers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rng(sys::colibri_rng);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        let mut rng = sys::colibri_rng::default();
        // SAFETY: writes one colibri_rng.
        unsafe { sys::colibri_rng_seed(&mut rng, seed) };
        Rng(rng)
    }
}

/// How [`Model::lm_sample`] draws a token (docs/lm.md "Sampling").
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampler {
    /// 0: greedy (no draw from the rng); else > 0 and finite.
    pub temperature: f32,
    /// 0: no limit.
    pub top_k: u32,
    /// In (0, 1]; 1: no limit.
    pub top_p: f32,
}

impl Sampler {
    pub const GREEDY: Sampler = Sampler { temperature: 0.0, top_k: 0, top_p: 1.0 };

    fn raw(&self) -> sys::colibri_sampler {
        sys::colibri_sampler {
            struct_size: core::mem::size_of::<sys::colibri_sampler>() as u32,
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
        }
    }
}

/// Token models (docs/lm.md). On a feature model each call is [`Status::ModelKind`].
impl Model<'_> {
    /// Empties the KV cache: the next token is at position 0.
    pub fn lm_reset(&mut self) -> Result<(), Status> {
        // SAFETY: live context.
        check(unsafe { sys::colibri_lm_reset(self.ctx) })
    }

    /// The positions the cache holds: the next token's position.
    pub fn lm_position(&self) -> Result<u32, Status> {
        let mut position = 0;
        // SAFETY: live context, writes one u32.
        check(unsafe { sys::colibri_lm_position(self.ctx, &mut position) })?;
        Ok(position)
    }

    /// Runs `tokens` (1..=max_batch of them) at the next positions and writes
    /// their logits, `[tokens.len(), vocab]`, or the last token's only when
    /// `logits` holds `vocab` (the same bits; the layers after the last
    /// attention then run for that token alone). Nothing changes on an error:
    /// [`Status::BadBatch`], [`Status::BufferSize`], [`Status::BadToken`],
    /// [`Status::CacheFull`].
    pub fn lm_forward(&mut self, tokens: &[i32], logits: &mut [f32]) -> Result<(), Status> {
        let n = u32::try_from(tokens.len()).map_err(|_| Status::BadBatch)?;
        // SAFETY: live context; the engine checks n against max_batch and
        // logits.len() against n * vocab (or vocab) before touching either.
        check(unsafe { sys::colibri_lm_forward(self.ctx, tokens.as_ptr(), n, logits.as_mut_ptr(), logits.len()) })
    }

    /// [`Model::lm_forward`] with caller-supplied options
    /// (`colibri_lm_forward_ex`): with a [`ParallelFor`] pool, one token's
    /// large matrices run in row blocks on its workers, the experts and
    /// attention heads side by side, and the logits are bit for bit those
    /// of `lm_forward`. The arena must hold the workers
    /// ([`Model::arena_size_for`], else [`Status::BadExec`]); a hook's or
    /// callback's failure stops the pass and is returned here, the cache as it was.
    pub fn lm_forward_ex<M>(&mut self, exec: &mut Exec<'_, M>, tokens: &[i32], logits: &mut [f32]) -> Result<(), Status> {
        let n = u32::try_from(tokens.len()).map_err(|_| Status::BadBatch)?;
        // SAFETY: the live context over self.image, borrowed exclusively.
        check(unsafe { exec::lm_forward_ex(self.ctx, self.image, exec, tokens, n, logits) })
    }

    /// Draws one token from one row of logits (`[vocab]`) with scratch in the arena.
    pub fn lm_sample(&mut self, sampler: &Sampler, logits: &[f32], rng: &mut Rng) -> Result<i32, Status> {
        let raw = sampler.raw();
        let mut token = 0;
        // SAFETY: live context; the engine checks logits.len() against vocab.
        check(unsafe { sys::colibri_lm_sample(self.ctx, &raw, logits.as_ptr(), logits.len(), &mut rng.0, &mut token) })?;
        Ok(token)
    }

    /// Resets the cache, runs the prompt (in chunks of as many rows as
    /// `logits` holds, at most max_batch), then draws `out.len()` tokens into
    /// `out`, feeding each back but the last: the loop of the Python
    /// binding's `LM.generate`, so the same seed gives the same tokens.
    /// `logits` is the caller's scratch, at least one row (`vocab` floats).
    /// Checked before anything runs: an empty prompt is [`Status::BadBatch`],
    /// a `logits` shorter than a row [`Status::BufferSize`], a generation
    /// past max_seq_len [`Status::CacheFull`].
    pub fn lm_generate(
        &mut self,
        prompt: &[i32],
        sampler: &Sampler,
        rng: &mut Rng,
        logits: &mut [f32],
        out: &mut [i32],
    ) -> Result<(), Status> {
        self.lm_generate_ex(&mut Exec::new(), prompt, sampler, rng, logits, out)
    }

    /// [`Model::lm_generate`] with every forward pass run with `exec`
    /// ([`Model::lm_forward_ex`]): with a pool, the same tokens.
    pub fn lm_generate_ex<M>(
        &mut self,
        exec: &mut Exec<'_, M>,
        prompt: &[i32],
        sampler: &Sampler,
        rng: &mut Rng,
        logits: &mut [f32],
        out: &mut [i32],
    ) -> Result<(), Status> {
        let vocab = self.info.vocab_size as usize;
        if vocab == 0 {
            return Err(Status::ModelKind);
        }
        if prompt.is_empty() {
            return Err(Status::BadBatch);
        }
        let rows = (logits.len() / vocab).min(self.info.max_batch as usize);
        if rows == 0 {
            return Err(Status::BufferSize);
        }
        if prompt.len() + out.len().saturating_sub(1) > self.info.max_seq_len as usize {
            return Err(Status::CacheFull);
        }
        self.lm_reset()?;
        if out.is_empty() {
            return Ok(());
        }
        let mut last = 0;
        for chunk in prompt.chunks(rows) {
            self.lm_forward_ex(exec, chunk, &mut logits[..chunk.len() * vocab])?;
            last = chunk.len() - 1;
        }
        out[0] = self.lm_sample(sampler, &logits[last * vocab..(last + 1) * vocab], rng)?;
        for made in 1..out.len() {
            self.lm_forward_ex(exec, &out[made - 1..made], &mut logits[..vocab])?;
            out[made] = self.lm_sample(sampler, &logits[..vocab], rng)?;
        }
        Ok(())
    }
}

/// The tokenizer section of a token model's image (format v6, docs/lm.md "Tokenizer section"),
/// read in place: text to ids ([`Tokenizer::encode`]) and ids to text ([`TextDecoder`]) on the
/// device, as the library the tokenizer came from does. Nothing is allocated: the caller gives
/// every buffer, sized by [`encode_max_ids`], [`encode_work_bytes`] and [`Tokenizer::decode_bytes`].
pub struct Tokenizer<'a> {
    raw: sys::colibri_tokenizer,
    _image: PhantomData<&'a [u8]>,
}

/// Ids [`Tokenizer::encode`] gives at most for `text_len` bytes of text, whatever the tokenizer.
pub const fn encode_max_ids(text_len: usize) -> usize {
    sys::colibri_tokenizer_encode_max_ids(text_len)
}

/// Work bytes [`Tokenizer::encode`] needs for `text_len` bytes of text.
pub const fn encode_work_bytes(text_len: usize) -> usize {
    sys::colibri_tokenizer_encode_work_bytes(text_len)
}

impl<'a> Tokenizer<'a> {
    /// Checks the image's structure and finds its section: [`Status::NoTokenizer`] without one.
    pub fn open(image: &'a [u8]) -> Result<Tokenizer<'a>, Status> {
        let mut raw = core::mem::MaybeUninit::<sys::colibri_tokenizer>::uninit();
        // SAFETY: the image outlives the tokenizer ('a); open fills raw on success.
        check(unsafe { sys::colibri_tokenizer_open(raw.as_mut_ptr(), image.as_ptr().cast(), image.len()) })?;
        // SAFETY: initialised by the successful call.
        Ok(Tokenizer { raw: unsafe { raw.assume_init() }, _image: PhantomData })
    }

    pub fn vocab_size(&self) -> u32 {
        self.raw.vocab
    }

    /// The end-of-sequence id, if the tokenizer names one.
    pub fn eos(&self) -> Option<i32> {
        (self.raw.eos >= 0).then_some(self.raw.eos)
    }

    /// The beginning-of-sequence id, if the tokenizer names one.
    pub fn bos(&self) -> Option<i32> {
        (self.raw.bos >= 0).then_some(self.raw.bos)
    }

    /// Output bytes that always suffice for one [`TextDecoder::push`].
    pub fn decode_bytes(&self) -> usize {
        sys::colibri_tokenizer_decode_bytes(self.raw.max_piece as usize)
    }

    /// `text` to ids in `ids` (no BOS or EOS added): their count. `ids` shorter than the count is
    /// `Err((Status::BufferSize, count))`; a `work` below [`encode_work_bytes`] is
    /// [`Status::ArenaTooSmall`]; ill-formed UTF-8 [`Status::BadText`]; text an NFC tokenizer would
    /// change [`Status::TextNotNormalized`] (encode it on a host).
    pub fn encode(&self, text: &[u8], ids: &mut [i32], work: &mut [u8]) -> Result<usize, (Status, usize)> {
        let mut n = 0usize;
        // SAFETY: every pointer with its length; the section lives as long as 'a.
        let code = unsafe {
            sys::colibri_tokenizer_encode(&self.raw, text.as_ptr(), text.len(), ids.as_mut_ptr(), ids.len(), &mut n,
                                          work.as_mut_ptr().cast(), work.len())
        };
        check(code).map(|()| n).map_err(|status| (status, n))
    }

    /// A new streaming decoder over this tokenizer.
    pub fn decoder(&self) -> TextDecoder<'_, 'a> {
        let mut stream = sys::colibri_text_stream::default();
        // SAFETY: a valid stream to initialise.
        unsafe { sys::colibri_text_stream_init(&mut stream) };
        TextDecoder { tok: self, stream }
    }
}

/// Ids to text, one token at a time: each push gives only whole UTF-8 characters (a character split
/// across tokens comes out with its last byte), ill-formed bytes as U+FFFD; [`TextDecoder::flush`]
/// ends the stream.
pub struct TextDecoder<'t, 'a> {
    tok: &'t Tokenizer<'a>,
    stream: sys::colibri_text_stream,
}

impl TextDecoder<'_, '_> {
    /// The text token `id` completes, written into `out` (at least [`Tokenizer::decode_bytes`] bytes
    /// always suffice; a shorter one may be [`Status::BufferSize`], the stream as before).
    pub fn push<'o>(&mut self, id: i32, out: &'o mut [u8]) -> Result<&'o str, Status> {
        let mut n = 0usize;
        // SAFETY: out with its length; the tokenizer's section is alive.
        check(unsafe {
            sys::colibri_tokenizer_decode(&self.tok.raw, &mut self.stream, id, out.as_mut_ptr(), out.len(), &mut n)
        })?;
        core::str::from_utf8(&out[..n]).map_err(|_| Status::BadTokenizer)
    }

    /// What the stream still holds (an incomplete character, as U+FFFD: at most 3 bytes); it then
    /// starts afresh.
    pub fn flush<'o>(&mut self, out: &'o mut [u8]) -> Result<&'o str, Status> {
        let mut n = 0usize;
        // SAFETY: out with its length.
        check(unsafe { sys::colibri_tokenizer_flush(&mut self.stream, out.as_mut_ptr(), out.len(), &mut n) })?;
        core::str::from_utf8(&out[..n]).map_err(|_| Status::BadTokenizer)
    }
}

impl Drop for Model<'_> {
    fn drop(&mut self) {
        // SAFETY: the context is live until here; free only marks it invalid,
        // and cannot fail for a context init built.
        unsafe { sys::colibri_free(self.ctx) };
    }
}
