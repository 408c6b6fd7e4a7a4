//! The accelerator hook's view of one expert call (`colibri_expert_call`):
//! the engine's pointers turned into slices whose lengths come from the call
//! and the image, and the expert's weights typed by the dtype the image
//! stores them in.
//!
//! The C struct carries the weights as `const void *`; their dtype, shape and
//! (for int8) quantisation parameters are in the image, which the model
//! borrows. The expert record the call names (`call.expert`) gives the tensor
//! records; each weight pointer is checked to be that tensor's payload in
//! this image before any slice is made over it.

use core::slice;

use crate::{sys, Status};

/// Where the hook's view reads the image: byte offsets of the fields it uses
/// in the header, tensor and expert records (docs/model-format.md; the
/// record sizes are colibri_format.h's). colibri/tests/hook.rs holds them to
/// host_tools/colibri/model/format.py's struct formats.
#[doc(hidden)]
pub mod layout {
    pub const HEADER_VERSION: usize = 4;
    pub const HEADER_TENSOR_COUNT: usize = 32;
    pub const HEADER_TENSOR_TABLE_OFFSET: usize = 36;
    pub const HEADER_EXPERT_COUNT: usize = 56;
    pub const HEADER_EXPERT_TABLE_OFFSET: usize = 60;
    pub const TENSOR_OFFSET: usize = 0;
    pub const TENSOR_NBYTES: usize = 4;
    pub const TENSOR_ROWS: usize = 8;
    pub const TENSOR_COLS: usize = 12;
    pub const TENSOR_DTYPE: usize = 16;
    pub const TENSOR_AUX: usize = 20;
    pub const EXPERT_FLAGS: usize = 2;
    pub const EXPERT_W1: usize = 8;
    pub const EXPERT_W2: usize = 16;
    pub const EXPERT_W3: usize = 24;
    pub const Q4_PARAMS_NNZ: usize = 0;
    pub const Q4_PARAMS_GROUP_LOG2: usize = 4;
    pub const Q4_PARAMS_FLAGS: usize = 5;
    /// (record, field, offset) of every constant above, for the drift test.
    pub const ALL: [(&str, &str, usize); 18] = [
        ("header", "version", HEADER_VERSION),
        ("header", "tensor_count", HEADER_TENSOR_COUNT),
        ("header", "tensor_table_offset", HEADER_TENSOR_TABLE_OFFSET),
        ("header", "expert_count", HEADER_EXPERT_COUNT),
        ("header", "expert_table_offset", HEADER_EXPERT_TABLE_OFFSET),
        ("tensor", "offset", TENSOR_OFFSET),
        ("tensor", "nbytes", TENSOR_NBYTES),
        ("tensor", "rows", TENSOR_ROWS),
        ("tensor", "cols", TENSOR_COLS),
        ("tensor", "dtype", TENSOR_DTYPE),
        ("tensor", "aux", TENSOR_AUX),
        ("expert", "flags", EXPERT_FLAGS),
        ("expert", "w1", EXPERT_W1),
        ("expert", "w2", EXPERT_W2),
        ("expert", "w3", EXPERT_W3),
        ("q4_params", "nnz", Q4_PARAMS_NNZ),
        ("q4_params", "group_log2", Q4_PARAMS_GROUP_LOG2),
        ("q4_params", "flags", Q4_PARAMS_FLAGS),
    ];

    /// Byte offsets of the fields of a `Q4_PARAMS` payload (format.py's
    /// `q4_layout`): f16 scales `[rows · G]` after the 8-byte header, the f16
    /// bias `[rows]` with `BIAS`, then, with `nnz > 0`, E exactly as a
    /// version-2 `Q8_PARAMS` lays it out.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Q4Payload {
        pub scale: usize,
        pub bias: Option<usize>,
        /// (row_ptr, row pointer width in bytes, col, val), with nnz > 0 only.
        pub compensation: Option<(usize, usize, usize, usize)>,
        pub size: usize,
    }

    /// Scales per row: `G = ceil(cols / 2^group_log2)`.
    pub fn q4_groups(cols: usize, group_log2: u32) -> usize {
        cols.div_ceil(1 << group_log2)
    }

    /// The layout of a `Q4_PARAMS` payload; `None` if a size overflows.
    pub fn q4_payload(rows: usize, cols: usize, nnz: usize, group_log2: u32, bias: bool) -> Option<Q4Payload> {
        let scale = crate::sys::COLIBRI_Q4_PARAMS_HEADER as usize;
        let mut pos = scale.checked_add(rows.checked_mul(q4_groups(cols, group_log2))?.checked_mul(2)?)?;
        let bias = if bias {
            let at = pos;
            pos = pos.checked_add(rows.checked_mul(2)?)?;
            Some(at)
        } else {
            None
        };
        let compensation = if nnz == 0 {
            None
        } else {
            let (at, end) = super::compensation_layout(pos, rows, nnz, 2)?;
            pos = end;
            Some(at)
        };
        Some(Q4Payload { scale, bias, compensation, size: pos })
    }
}
use layout::*;

/// Reads a little-endian u32 at `at`, `None` past the end.
fn u32_at(bytes: &[u8], at: usize) -> Option<u32> {
    let b = bytes.get(at..at.checked_add(4)?)?;
    Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

fn u16_at(bytes: &[u8], at: usize) -> Option<u16> {
    let b = bytes.get(at..at.checked_add(2)?)?;
    Some(u16::from_le_bytes([b[0], b[1]]))
}

/// Plain-old-data element types a payload may be viewed as: every bit
/// pattern is a value, so a byte range of the right length and alignment is
/// a valid slice of them.
trait Pod: Copy {}
impl Pod for f32 {}
impl Pod for u16 {}
impl Pod for u32 {}
impl Pod for u8 {}
impl Pod for i8 {}

/// `count` elements of `T` at byte `at` of `bytes`; `None` if out of bounds
/// or misaligned (never for a validated image, whose payloads are aligned
/// for their dtype: the format's layout rules).
fn view<T: Pod>(bytes: &[u8], at: usize, count: usize) -> Option<&[T]> {
    let len = count.checked_mul(core::mem::size_of::<T>())?;
    let range = bytes.get(at..at.checked_add(len)?)?;
    if !(range.as_ptr() as usize).is_multiple_of(core::mem::align_of::<T>()) {
        return None;
    }
    // SAFETY: in bounds, aligned, T is plain old data, and the bytes are
    // borrowed shared for the returned lifetime.
    Some(unsafe { slice::from_raw_parts(range.as_ptr().cast::<T>(), count) })
}

/// IEEE 754 binary16 (as stored, little-endian bits) to f32, exactly (every
/// f16 is an f32): the widening the engine does before computing.
pub fn f16_to_f32(bits: u16) -> f32 {
    let sign = ((bits as u32) & 0x8000) << 16;
    let exp = ((bits >> 10) & 0x1F) as u32;
    let man = (bits & 0x3FF) as u32;
    let magnitude = match exp {
        0 if man == 0 => 0,
        // Subnormal: man · 2^-24, normalised for f32.
        0 => {
            let shift = man.leading_zeros() - 21; // brings the top set bit to bit 10
            let man = (man << shift) & 0x3FF;
            ((127 - 15 + 1 - shift) << 23) | (man << 13)
        }
        0x1F => 0x7F80_0000 | (man << 13), // inf, NaN (payload kept)
        _ => ((exp + 127 - 15) << 23) | (man << 13),
    };
    f32::from_bits(sign | magnitude)
}

/// A dense matrix of the image, `[rows, cols]` row-major.
#[derive(Clone, Copy, Debug)]
pub struct Matrix<'c, T> {
    pub rows: usize,
    pub cols: usize,
    /// `rows * cols` elements.
    pub data: &'c [T],
}

impl<'c, T> Matrix<'c, T> {
    pub fn row(&self, i: usize) -> &'c [T] {
        &self.data[i * self.cols..(i + 1) * self.cols]
    }
}

/// Per-row f32 or f16 parameters of an int8 matrix (scales, biases).
#[derive(Clone, Copy, Debug)]
pub enum Params<'c> {
    F32(&'c [f32]),
    /// f16 bits; see [`f16_to_f32`].
    F16(&'c [u16]),
}

impl Params<'_> {
    pub fn get(&self, i: usize) -> f32 {
        match self {
            Params::F32(v) => v[i],
            Params::F16(v) => f16_to_f32(v[i]),
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum RowPtr<'c> {
    U8(&'c [u8]),
    U16(&'c [u16]),
    U32(&'c [u32]),
}

impl RowPtr<'_> {
    fn get(&self, i: usize) -> usize {
        match self {
            RowPtr::U8(p) => p[i] as usize,
            RowPtr::U16(p) => p[i] as usize,
            RowPtr::U32(p) => p[i] as usize,
        }
    }
}

/// Where the CSR arrays of E start, the first at or after `pos`: the row
/// pointers (`rows + 1` of them, 4 bytes wide in version 1, else the narrowest
/// of 1/2/4 that holds `nnz`), the u16 columns and the f16 values, each at a
/// multiple of its element size (a version-1 `Q8_PARAMS` puts the values at a
/// multiple of 4). Returns ((row_ptr, width, col, val), end).
fn compensation_layout(pos: usize, rows: usize, nnz: usize, version: u32) -> Option<((usize, usize, usize, usize), usize)> {
    let width = if version < 2 || nnz > 0xFFFF { 4 } else if nnz > 0xFF { 2 } else { 1 };
    let row_ptr = pos.checked_next_multiple_of(width)?;
    let col = row_ptr.checked_add(width.checked_mul(rows.checked_add(1)?)?)?.checked_next_multiple_of(2)?;
    let val = col.checked_add(nnz.checked_mul(2)?)?.checked_next_multiple_of(if version < 2 { 4 } else { 2 })?;
    Some(((row_ptr, width, col, val), val.checked_add(nnz.checked_mul(2)?)?))
}

/// The sparse f16 compensation term E of an int8 or int4 matrix (CSR by rows).
#[derive(Clone, Copy, Debug)]
pub struct Compensation<'c> {
    row_ptr: RowPtr<'c>,
    col: &'c [u16],
    value: &'c [u16],
}

impl<'c> Compensation<'c> {
    /// E of a `rows`-row matrix with `nnz` entries in `params`, its arrays
    /// where [`compensation_layout`] put them.
    fn parse(params: &'c [u8], (ptr, width, col, val): (usize, usize, usize, usize), rows: usize, nnz: usize)
        -> Option<Compensation<'c>> {
        let row_ptr = match width {
            1 => RowPtr::U8(view(params, ptr, rows + 1)?),
            2 => RowPtr::U16(view(params, ptr, rows + 1)?),
            _ => RowPtr::U32(view(params, ptr, rows + 1)?),
        };
        Some(Compensation { row_ptr, col: view(params, col, nnz)?, value: view(params, val, nnz)? })
    }

    /// Row `i`'s entries as (column, value), in storage order.
    pub fn row(&self, i: usize) -> impl Iterator<Item = (usize, f32)> + 'c {
        let (start, end) = (self.row_ptr.get(i), self.row_ptr.get(i + 1));
        let (col, value) = (&self.col[start..end], &self.value[start..end]);
        col.iter().zip(value).map(|(&c, &v)| (c as usize, f16_to_f32(v)))
    }
}

/// An int8 matrix with its `Q8_PARAMS` companion (docs/model-format.md
/// "Quantised weights"): `W ≈ Q·diag(scale) + E`, and for f32 activations
/// `y_i = scale_i · Σ_j Q_ij x_j + Σ_(j,e)∈E_i e·x_j + bias_i`.
#[derive(Clone, Copy, Debug)]
pub struct Q8Matrix<'c> {
    pub q: Matrix<'c, i8>,
    pub scale: Params<'c>,
    /// The bias carried by the companion (format version 2), if any; the
    /// expert's own bias (`b1`, `b2`, `b3`) is separate and also added.
    pub bias: Option<Params<'c>>,
    pub compensation: Option<Compensation<'c>>,
}

impl Q8Matrix<'_> {
    /// Row `i` of `Q·scale + E` in f32 (its length must be `cols`): the
    /// dequantised weights, for a device that computes in floating point.
    pub fn dequantise_row(&self, i: usize, out: &mut [f32]) {
        let s = self.scale.get(i);
        for (o, &q) in out.iter_mut().zip(self.q.row(i)) {
            *o = q as f32 * s;
        }
        if let Some(e) = &self.compensation {
            for (j, v) in e.row(i) {
                out[j] += v;
            }
        }
    }

    /// Parses the companion payload `params` for an int8 matrix of
    /// `rows × cols`, as an image of format `version` lays it out.
    fn parse<'a>(q: Matrix<'a, i8>, params: &'a [u8], version: u32) -> Option<Q8Matrix<'a>> {
        let header = sys::COLIBRI_Q8_PARAMS_HEADER as usize;
        let nnz = u32_at(params, 0)? as usize;
        let rows = q.rows;
        // Version 1: f32 scales, no bias, 4-byte row pointers, values 4-aligned.
        let (f16_params, has_bias) = if version < 2 {
            (false, false)
        } else {
            let dtype = *params.get(4)? as u32;
            (dtype == sys::COLIBRI_DTYPE_F16, params.get(5)? & sys::COLIBRI_Q8_FLAG_BIAS as u8 != 0)
        };
        let p = if f16_params { 2 } else { 4 };
        let vector = |at: usize| -> Option<Params<'a>> {
            Some(if f16_params { Params::F16(view(params, at, rows)?) } else { Params::F32(view(params, at, rows)?) })
        };
        let scale = vector(header)?;
        let mut pos = header + p * rows;
        let bias = if has_bias {
            let b = vector(pos)?;
            pos += p * rows;
            Some(b)
        } else {
            None
        };
        let compensation = if nnz == 0 { None } else { Some(Compensation::parse(params, compensation_layout(pos, rows, nnz, version)?.0, rows, nnz)?) };
        Some(Q8Matrix { q, scale, bias, compensation })
    }
}

/// Column `c` of a packed int4 row, sign-extended: the nibble is moved into
/// the high half of an i8 and shifted back arithmetically.
fn nibble(row: &[u8], c: usize) -> i8 {
    (((row[c >> 1] >> ((c & 1) * 4)) << 4) as i8) >> 4
}

/// An int4 matrix with its `Q4_PARAMS` companion (docs/model-format.md
/// "Quantised weights: I4 with Q4_PARAMS"): `W ≈ Q·S + E`, each row's columns
/// in groups of `2^group_log2` sharing one f16 scale, so for f32 activations
/// `y_o = Σ_g s_(o,g) · Σ_(c∈g) Q_oc x_c + Σ_(c,e)∈E_o e·x_c + bias_o`.
#[derive(Clone, Copy, Debug)]
pub struct Q4Matrix<'c> {
    pub rows: usize,
    pub cols: usize,
    /// `rows · ceil(cols/2)` bytes, row-major: column c of a row in byte
    /// `c >> 1`, the low nibble for even c; a nibble is a signed int4 (−8..7).
    pub packed: &'c [u8],
    /// 3..=8: `1 << group_log2` columns share a scale.
    pub group_log2: u32,
    /// f16 bits `[rows · groups()]`, row o's scales contiguous.
    pub scale: &'c [u16],
    /// The f16 bias carried by the companion, if any; the expert's own bias
    /// (`b1`, `b2`, `b3`) is separate and also added.
    pub bias: Option<Params<'c>>,
    pub compensation: Option<Compensation<'c>>,
}

impl<'c> Q4Matrix<'c> {
    /// Scales per row, `ceil(cols / group)`.
    pub fn groups(&self) -> usize {
        q4_groups(self.cols, self.group_log2)
    }

    /// Row `i`'s packed bytes, `ceil(cols/2)` of them.
    pub fn packed_row(&self, i: usize) -> &'c [u8] {
        let stride = self.cols.div_ceil(2);
        &self.packed[i * stride..(i + 1) * stride]
    }

    /// The int4 value of column `c` in row `i`.
    pub fn q(&self, i: usize, c: usize) -> i8 {
        nibble(self.packed_row(i), c)
    }

    /// The scale of group `g` of row `i`, widened exactly.
    pub fn scale(&self, i: usize, g: usize) -> f32 {
        f16_to_f32(self.scale[i * self.groups() + g])
    }

    /// Row `i` of `Q·S + E` in f32 (its length must be `cols`): the
    /// dequantised weights, for a device that computes in floating point.
    /// Each `q·s` is exact in f32 (a 4-bit integer times an f16).
    pub fn dequantise_row(&self, i: usize, out: &mut [f32]) {
        let row = self.packed_row(i);
        let group = 1usize << self.group_log2;
        let scales = &self.scale[i * self.groups()..(i + 1) * self.groups()];
        for (g, (chunk, &s)) in out[..self.cols].chunks_mut(group).zip(scales).enumerate() {
            let s = f16_to_f32(s);
            for (k, o) in chunk.iter_mut().enumerate() {
                *o = nibble(row, g * group + k) as f32 * s;
            }
        }
        if let Some(e) = &self.compensation {
            for (j, v) in e.row(i) {
                out[j] += v;
            }
        }
    }

    /// Parses the companion payload `params` of the packed int4 matrix
    /// `packed` of `rows × cols`. `None` if the header's codes are outside
    /// the format's or a field does not fit the payload.
    fn parse(rows: usize, cols: usize, packed: &'c [u8], params: &'c [u8]) -> Option<Q4Matrix<'c>> {
        let nnz = u32_at(params, Q4_PARAMS_NNZ)? as usize;
        let group_log2 = *params.get(Q4_PARAMS_GROUP_LOG2)? as u32;
        let flags = *params.get(Q4_PARAMS_FLAGS)? as u32;
        if !(sys::COLIBRI_Q4_GROUP_LOG2_MIN..=sys::COLIBRI_Q4_GROUP_LOG2_MAX).contains(&group_log2)
            || flags & !sys::COLIBRI_Q4_FLAG_BIAS != 0
            || packed.len() != rows.checked_mul(cols.div_ceil(2))?
        {
            return None;
        }
        let at = q4_payload(rows, cols, nnz, group_log2, flags & sys::COLIBRI_Q4_FLAG_BIAS != 0)?;
        let scale = view(params, at.scale, rows.checked_mul(q4_groups(cols, group_log2))?)?;
        let bias = match at.bias {
            Some(b) => Some(Params::F16(view(params, b, rows)?)),
            None => None,
        };
        let compensation = match at.compensation {
            Some(arrays) => Some(Compensation::parse(params, arrays, rows, nnz)?),
            None => None,
        };
        Some(Q4Matrix { rows, cols, packed, group_log2, scale, bias, compensation })
    }
}

/// An expert weight as the image stores it.
#[derive(Clone, Copy, Debug)]
pub enum Weight<'c> {
    F32(Matrix<'c, f32>),
    /// f16 bits; see [`f16_to_f32`].
    F16(Matrix<'c, u16>),
    I8(Q8Matrix<'c>),
    I4(Q4Matrix<'c>),
}

impl Weight<'_> {
    pub fn rows(&self) -> usize {
        match self {
            Weight::F32(m) => m.rows,
            Weight::F16(m) => m.rows,
            Weight::I8(m) => m.q.rows,
            Weight::I4(m) => m.rows,
        }
    }

    pub fn cols(&self) -> usize {
        match self {
            Weight::F32(m) => m.cols,
            Weight::F16(m) => m.cols,
            Weight::I8(m) => m.q.cols,
            Weight::I4(m) => m.cols,
        }
    }

    /// Row `i` in f32 (`out.len()` must be `cols`): copied, widened, or
    /// dequantised with the compensation term (not the companion's bias).
    pub fn row_f32(&self, i: usize, out: &mut [f32]) {
        match self {
            Weight::F32(m) => out.copy_from_slice(m.row(i)),
            Weight::F16(m) => {
                for (o, &h) in out.iter_mut().zip(m.row(i)) {
                    *o = f16_to_f32(h);
                }
            }
            Weight::I8(m) => m.dequantise_row(i, out),
            Weight::I4(m) => m.dequantise_row(i, out),
        }
    }

    /// The bias this weight carries itself (an int8 or int4 companion's), for row `i`.
    pub fn own_bias(&self, i: usize) -> Option<f32> {
        match self {
            Weight::I8(Q8Matrix { bias: Some(b), .. }) | Weight::I4(Q4Matrix { bias: Some(b), .. }) => Some(b.get(i)),
            _ => None,
        }
    }
}

/// The expert's structure (`COLIBRI_EXPERT_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertKind {
    /// `act(x W1ᵀ + b1) W2ᵀ + b2`
    Mlp,
    /// `(act(x W1ᵀ + b1) ⊙ (x W3ᵀ + b3)) W2ᵀ + b2`
    Glu,
}

/// The activation after W1 (`COLIBRI_ACT_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    Relu,
    GeluErf,
    GeluTanh,
    Silu,
    Tanh,
    Sigmoid,
}

impl Activation {
    fn from_code(code: u32) -> Option<Activation> {
        Some(match code {
            sys::COLIBRI_ACT_RELU => Activation::Relu,
            sys::COLIBRI_ACT_GELU_ERF => Activation::GeluErf,
            sys::COLIBRI_ACT_GELU_TANH => Activation::GeluTanh,
            sys::COLIBRI_ACT_SILU => Activation::Silu,
            sys::COLIBRI_ACT_TANH => Activation::Tanh,
            sys::COLIBRI_ACT_SIGMOID => Activation::Sigmoid,
            _ => return None,
        })
    }
}

/// What the hook did with an expert.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertOutcome {
    /// The output rows hold the expert's gated contribution.
    Computed,
    /// Not taken, the output rows untouched: the engine runs the expert itself.
    Declined,
    /// The forward pass stops and returns this status.
    Failed(Status),
}

impl ExpertOutcome {
    pub(crate) fn code(self) -> sys::colibri_status {
        match self {
            ExpertOutcome::Computed => sys::COLIBRI_OK,
            ExpertOutcome::Declined => sys::COLIBRI_EXPERT_DECLINED,
            ExpertOutcome::Failed(status) => status.code(),
        }
    }
}

/// One expert over a ring of tokens, offered to the hook: for `i < rows()`,
/// `y[y_row(i)] += gate(i) · expert(x[x_row(i)])`, where
/// `expert(v) = act(v W1ᵀ + b1) (⊙ (v W3ᵀ + b3) if GLU) W2ᵀ + b2`
/// (an int8 or int4 weight adds its companion's bias too: [`Weight::own_bias`]).
///
/// `x` and `y` are the engine's rows in place (the layer input, the layer
/// output or a worker's staging rows), the weights the image's payloads in
/// place; nothing was copied. The view lives for the call only.
pub struct ExpertCall<'c> {
    layer: u32,
    expert: u32,
    d: usize,
    hidden: usize,
    kind: ExpertKind,
    activation: Activation,
    int8_act: bool,
    worker: usize,
    w1: Weight<'c>,
    w2: Weight<'c>,
    w3: Option<Weight<'c>>,
    b1: Option<&'c [f32]>,
    b2: Option<&'c [f32]>,
    b3: Option<&'c [f32]>,
    n: usize,
    x: &'c [f32],
    x_rows: Option<&'c [u16]>,
    gate: Option<&'c [f32]>,
    y: &'c mut [f32],
    y_rows: Option<&'c [u16]>,
}

impl<'c> ExpertCall<'c> {
    /// The MoE layer, 0-based in program order.
    pub fn layer(&self) -> u32 {
        self.layer
    }
    /// The expert record in the image's expert table.
    pub fn expert(&self) -> u32 {
        self.expert
    }
    /// Features per row, in and out.
    pub fn d(&self) -> usize {
        self.d
    }
    pub fn hidden(&self) -> usize {
        self.hidden
    }
    pub fn kind(&self) -> ExpertKind {
        self.kind
    }
    pub fn activation(&self) -> Activation {
        self.activation
    }
    /// The engine runs this expert with int8 activations (quantising each
    /// row before W1 and before W2); a float device should decline it, or
    /// reproduce that quantisation.
    pub fn int8_act(&self) -> bool {
        self.int8_act
    }
    /// The worker running the call: 0 without a pool, else `< workers`.
    pub fn worker(&self) -> usize {
        self.worker
    }
    /// W1 `[hidden, d]`.
    pub fn w1(&self) -> &Weight<'c> {
        &self.w1
    }
    /// W2 `[d, hidden]`.
    pub fn w2(&self) -> &Weight<'c> {
        &self.w2
    }
    /// W3 `[hidden, d]`, GLU only.
    pub fn w3(&self) -> Option<&Weight<'c>> {
        self.w3.as_ref()
    }
    /// `[hidden]`
    pub fn b1(&self) -> Option<&'c [f32]> {
        self.b1
    }
    /// `[d]`
    pub fn b2(&self) -> Option<&'c [f32]> {
        self.b2
    }
    /// `[hidden]`, GLU only.
    pub fn b3(&self) -> Option<&'c [f32]> {
        self.b3
    }
    /// Rows (tokens) this call covers.
    pub fn rows(&self) -> usize {
        self.n
    }
    /// The input row of token `i < rows()`: `d` floats of the layer input.
    pub fn x_row(&self, i: usize) -> &'c [f32] {
        let r = self.x_rows.map_or(i, |rows| rows[i] as usize);
        &self.x[r * self.d..(r + 1) * self.d]
    }
    /// The gate weight of token `i` (1 when the engine passes none).
    pub fn gate(&self, i: usize) -> f32 {
        self.gate.map_or(1.0, |g| g[i])
    }
    /// The output row of token `i`, to accumulate into.
    pub fn y_row(&mut self, i: usize) -> &mut [f32] {
        let r = self.y_rows.map_or(i, |rows| rows[i] as usize);
        &mut self.y[r * self.d..(r + 1) * self.d]
    }
    /// `y[y_row(i)] += gate(i) · out` for token `i`'s expert output `out` (`d` floats).
    pub fn accumulate(&mut self, i: usize, out: &[f32]) {
        let g = self.gate(i);
        for (y, &v) in self.y_row(i).iter_mut().zip(out) {
            *y += g * v;
        }
    }
    /// The raw views, for a device doing its own gather and scatter: the
    /// input rows (`[*, d]`, as many as the highest row index needs), the
    /// ring's token indices (`None`: rows `0..rows()`), the gates, the output
    /// rows and their indices.
    #[allow(clippy::type_complexity)]
    pub fn raw(&mut self) -> (&[f32], Option<&[u16]>, Option<&[f32]>, &mut [f32], Option<&[u16]>) {
        (self.x, self.x_rows, self.gate, self.y, self.y_rows)
    }
}

/// A slice over a C array; a NULL pointer is `None`.
///
/// SAFETY: a non-NULL `p` must be valid for `len` reads for `'c`.
unsafe fn opt_slice<'c, T>(p: *const T, len: usize) -> Option<&'c [T]> {
    (!p.is_null()).then(|| unsafe { slice::from_raw_parts(p, len) })
}

/// The payload of the companion that the tensor record at byte `rec` names
/// in its `aux`, which must be of `dtype`.
fn companion(image: &[u8], rec: usize, dtype: u32) -> Option<&[u8]> {
    let table = u32_at(image, HEADER_TENSOR_TABLE_OFFSET)? as usize;
    let aux = u32_at(image, rec + TENSOR_AUX)?;
    if aux >= u32_at(image, HEADER_TENSOR_COUNT)? {
        return None;
    }
    let prec = table + aux as usize * sys::COLIBRI_TENSOR_SIZE as usize;
    if *image.get(prec + TENSOR_DTYPE)? as u32 != dtype {
        return None;
    }
    let (poff, plen) = (u32_at(image, prec + TENSOR_OFFSET)? as usize, u32_at(image, prec + TENSOR_NBYTES)? as usize);
    image.get(poff..poff.checked_add(plen)?)
}

/// The image's tensor record `index` as a weight of `rows × cols`, whose
/// payload must be at `ptr`.
fn weight<'c>(image: &'c [u8], version: u32, index: u32, ptr: *const core::ffi::c_void) -> Option<Weight<'c>> {
    let table = u32_at(image, HEADER_TENSOR_TABLE_OFFSET)? as usize;
    let count = u32_at(image, HEADER_TENSOR_COUNT)?;
    if index >= count {
        return None;
    }
    let rec = table + index as usize * sys::COLIBRI_TENSOR_SIZE as usize;
    let (offset, nbytes) = (u32_at(image, rec + TENSOR_OFFSET)? as usize, u32_at(image, rec + TENSOR_NBYTES)? as usize);
    let (rows, cols) = (u32_at(image, rec + TENSOR_ROWS)? as usize, u32_at(image, rec + TENSOR_COLS)? as usize);
    let dtype = *image.get(rec + TENSOR_DTYPE)? as u32;
    let payload = image.get(offset..offset.checked_add(nbytes)?)?;
    if payload.as_ptr().cast() != ptr {
        return None; // not this image's tensor: the call and the image disagree
    }
    let n = rows.checked_mul(cols)?;
    Some(match dtype {
        sys::COLIBRI_DTYPE_F32 => Weight::F32(Matrix { rows, cols, data: view(payload, 0, n)? }),
        sys::COLIBRI_DTYPE_F16 => Weight::F16(Matrix { rows, cols, data: view(payload, 0, n)? }),
        sys::COLIBRI_DTYPE_I8 => {
            let q = Matrix { rows, cols, data: view(payload, 0, n)? };
            let params = companion(image, rec, sys::COLIBRI_DTYPE_Q8_PARAMS)?;
            Weight::I8(Q8Matrix::parse(q, params, version)?)
        }
        sys::COLIBRI_DTYPE_I4 => {
            let params = companion(image, rec, sys::COLIBRI_DTYPE_Q4_PARAMS)?;
            Weight::I4(Q4Matrix::parse(rows, cols, payload, params)?)
        }
        _ => return None,
    })
}

/// Builds the safe view of a C call over `image`. `Err` (a status for the
/// engine) if the call does not describe an expert of this image or its
/// input and output rows overlap: the engine never does either, but the
/// view's `&`/`&mut` slices must not be made over anything else.
///
/// SAFETY: `call` is a `colibri_expert_call` the engine passed for a context
/// over `image`, valid for `'c` (the duration of the hook).
pub(crate) unsafe fn expert_call<'c>(
    image: &'c [u8],
    call: &'c sys::colibri_expert_call,
) -> Result<ExpertCall<'c>, Status> {
    let bad = Status::BadExec;
    let version = u16_at(image, HEADER_VERSION).ok_or(bad)? as u32;
    let experts = u32_at(image, HEADER_EXPERT_COUNT).ok_or(bad)?;
    if call.expert >= experts {
        return Err(bad);
    }
    let rec = u32_at(image, HEADER_EXPERT_TABLE_OFFSET).ok_or(bad)? as usize
        + call.expert as usize * sys::COLIBRI_EXPERT_SIZE as usize;
    let flags = u16_at(image, rec + EXPERT_FLAGS).ok_or(bad)? as u32;
    let t = |at: usize| u32_at(image, rec + at).ok_or(bad);
    let (d, hidden, n) = (call.d as usize, call.hidden as usize, call.n);
    let kind = match call.kind as u32 {
        sys::COLIBRI_EXPERT_MLP => ExpertKind::Mlp,
        sys::COLIBRI_EXPERT_GLU => ExpertKind::Glu,
        _ => return Err(bad),
    };
    let activation = Activation::from_code(call.activation as u32).ok_or(bad)?;
    let w1 = weight(image, version, t(EXPERT_W1)?, call.w1).ok_or(bad)?;
    let w2 = weight(image, version, t(EXPERT_W2)?, call.w2).ok_or(bad)?;
    let w3 = match kind {
        ExpertKind::Glu => Some(weight(image, version, t(EXPERT_W3)?, call.w3).ok_or(bad)?),
        ExpertKind::Mlp => None,
    };
    if (w1.rows(), w1.cols(), w2.rows(), w2.cols()) != (hidden, d, d, hidden)
        || w3.is_some_and(|w| (w.rows(), w.cols()) != (hidden, d))
    {
        return Err(bad);
    }
    // SAFETY (all the slices below): the engine's pointers, valid for the
    // call, with the lengths colibri.h gives them: biases [hidden] / [d],
    // indices and gates [n], x and y [*, d] up to the highest row named.
    unsafe {
        let x_rows = opt_slice(call.x_rows, n);
        let y_rows = opt_slice(call.y_rows, n);
        let span = |rows: Option<&[u16]>| rows.map_or(n, |r| r.iter().map(|&v| v as usize + 1).max().unwrap_or(0)) * d;
        let (x_len, y_len) = (span(x_rows), span(y_rows));
        if call.x.is_null() && x_len > 0 || call.y.is_null() && y_len > 0 {
            return Err(Status::NullArg);
        }
        let (x0, y0) = (call.x as usize, call.y as usize);
        if x_len > 0 && y_len > 0 && x0 < y0 + y_len * 4 && y0 < x0 + x_len * 4 {
            return Err(bad); // y is written while x is read: they must not alias
        }
        Ok(ExpertCall {
            layer: call.layer,
            expert: call.expert,
            d,
            hidden,
            kind,
            activation,
            int8_act: flags & sys::COLIBRI_EXPERT_FLAG_INT8_ACT != 0,
            worker: call.worker as usize,
            w1,
            w2,
            w3,
            b1: opt_slice(call.b1, hidden),
            b2: opt_slice(call.b2, d),
            b3: opt_slice(call.b3, hidden),
            n,
            x: opt_slice(call.x, x_len).unwrap_or(&[]),
            x_rows,
            gate: opt_slice(call.gate, n),
            y: if y_len == 0 { &mut [] } else { slice::from_raw_parts_mut(call.y, y_len) },
            y_rows,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::nibble;

    /// Every byte's two nibbles read as the two's-complement int4 the format stores: the low one
    /// for even columns.
    #[test]
    fn nibbles_are_signed_int4() {
        for byte in 0..=255u8 {
            let int4 = |n: u8| if n >= 8 { n as i8 - 16 } else { n as i8 };
            assert_eq!(nibble(&[0, byte], 2), int4(byte & 0xF), "{byte:#04x}");
            assert_eq!(nibble(&[0, byte], 3), int4(byte >> 4), "{byte:#04x}");
        }
    }
}
