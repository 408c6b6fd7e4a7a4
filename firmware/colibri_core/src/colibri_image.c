/*
 * The model image reader: record parsing and full validation
 * (docs/model-format.md "Validation order"), each failure with its own
 * status, the first failure reported, in this order:
 *
 *   1. header: TRUNCATED, BAD_MAGIC, BAD_VERSION (0, 0xFFFF),
 *      UNSUPPORTED_VERSION, BAD_HEADER (header_size, image_size),
 *      TRUNCATED (image_size), in v3 meta_size (BAD_HEADER), BAD_CRC
 *      (v3: over the metadata only), then the header fields the CRC
 *      covers (BAD_HEADER);
 *   2. the four tables' bounds, in v3 inside the metadata, then v3's CRC
 *      table (TABLE_BOUNDS);
 *   3. pass 1, every tensor record in index order: bounds (TENSOR_BOUNDS:
 *      aligned, inside the image, in v3 after the metadata, not before the
 *      end of the previous tensor's payload), in v3 with COLIBRI_CHECK_FULL
 *      the payload's CRC (BAD_PAYLOAD_CRC), then dtype, rank and shape, reserved, aux (NONE
 *      unless I8), nbytes (BAD_TENSOR; a Q8_PARAMS record needs nbytes >= 8
 *      before its header is read; in v2 its parameter dtype, flags and
 *      reserved bits are BAD_QUANT; then the size formula, and cols <= 65536
 *      when nnz > 0, BAD_TENSOR);
 *   4. pass 2, every I8 and I4 tensor in index order: its companion (aux
 *      in range, a Q8_PARAMS, for I4 a Q4_PARAMS, of the same rows and
 *      cols), v1's reserved word, for I4 the unused nibbles of odd rows, its
 *      scales and f16 biases (BAD_QUANT), then its compensation term: padding, row
 *      pointers, columns, values (BAD_COMPENSATION); (a Q4_PARAMS record's
 *      header codes are BAD_QUANT and its size BAD_TENSOR in pass 1, as a
 *      v2 Q8_PARAMS's);
 *   5. the layer program, top to bottom: a layer's fields, flags included
 *      (BAD_LAYER), its tensor references (BAD_REF), then INT8_ACT needs an
 *      I8 weight (BAD_LAYER); a MOE layer names a MoE record (in range and
 *      after the previous MOE layer's, BAD_REF) and validates it where it
 *      stands: fields (BAD_MOE), expert range (inside the table and after
 *      the previous MOE layer's, BAD_REF), expert_map (BAD_REF, then a
 *      tensor after the previous MOE layer's map, BAD_REF, then its entries,
 *      BAD_MOE), router tensors, each routed then shared expert (fields and
 *      flags, page alignment, tensors, then INT8_ACT needs I8 weights), the
 *      shared gate.
 *
 * Non-overlapping payloads and one owning MOE layer per MoE record, expert
 * and expert map make validation linear in the image size: no record or
 * payload is scanned on behalf of many others.
 *
 * This is the order of the Python reader (host_tools/colibri/image/reader.py), so
 * both give the same status for the same image. Everything is read with
 * byte loads, never by casting image bytes to structs, and every offset is
 * checked in 64-bit arithmetic before use. Once colibri_check() has passed,
 * the forward pass reads the same records without checking again.
 */
#include <math.h>

#include "colibri_internal.h"

/* check_tensor and check_quant are not inlined into colibri_check_work,
 * whose frame holds the layer program's checks (the deepest), and the
 * companion layout is inlined into them, its fields kept in registers:
 * validating a q8 image then needs no more stack than an f32 one. */
#if defined(__GNUC__)
#define NOINLINE __attribute__((noinline))
#define ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define NOINLINE
#define ALWAYS_INLINE inline
#endif

/* ---- Record readers ---- */

static int any_set(const uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (p[i])
            return 1;
    return 0;
}

void colibri_read_header(const uint8_t *p, colibri_header *h)
{
    h->magic = colibri_rd_u32(p + 0);
    h->version = colibri_rd_u16(p + 4);
    h->header_size = colibri_rd_u16(p + 6);
    h->crc32 = colibri_rd_u32(p + 8);
    h->image_size = colibri_rd_u32(p + 12);
    h->image_bytes = h->image_size; /* version 7: the u64 at 80, read by check_header */
    h->flags = colibri_rd_u32(p + 16);
    h->input_size = colibri_rd_u32(p + 20);
    h->output_size = colibri_rd_u32(p + 24);
    h->max_batch = colibri_rd_u32(p + 28);
    h->tensor_count = colibri_rd_u32(p + 32);
    h->tensor_offset = colibri_rd_u32(p + 36);
    h->layer_count = colibri_rd_u32(p + 40);
    h->layer_offset = colibri_rd_u32(p + 44);
    h->moe_count = colibri_rd_u32(p + 48);
    h->moe_offset = colibri_rd_u32(p + 52);
    h->expert_count = colibri_rd_u32(p + 56);
    h->expert_offset = colibri_rd_u32(p + 60);
    h->attention_count = h->attention_offset = 0;
    if (h->version >= COLIBRI_LM_VERSION) { /* v4: v3's fields, then the attention table (v5, v7 too) */
        h->meta_size = colibri_rd_u32(p + 64);
        h->crc_offset = colibri_rd_u32(p + 68);
        h->attention_count = colibri_rd_u32(p + 72);
        h->attention_offset = colibri_rd_u32(p + 76);
        h->reserved_set = 0;
    } else if (h->version == COLIBRI_TENSOR_CRC_VERSION) {
        h->meta_size = colibri_rd_u32(p + 64);
        h->crc_offset = colibri_rd_u32(p + 68);
        h->reserved_set = any_set(p + 72, 8);
    } else {
        h->meta_size = h->crc_offset = 0;
        h->reserved_set = any_set(p + 64, 16);
    }
}

void colibri_read_tensor(const uint8_t *image, const colibri_header *h, uint32_t index, colibri_tensor *t)
{
    if (h->version >= COLIBRI_WIDE_VERSION) { /* v7: offset and nbytes u64, then as before */
        const uint8_t *p = image + h->tensor_offset + (size_t)index * COLIBRI_TENSOR_WIDE_SIZE;
        t->offset = colibri_rd_u64(p + 0);
        t->nbytes = colibri_rd_u64(p + 8);
        p += 8;
        t->rows = colibri_rd_u32(p + 8);
        t->cols = colibri_rd_u32(p + 12);
        t->dtype = p[16];
        t->ndim = p[17];
        t->reserved = colibri_rd_u16(p + 18);
        t->aux = colibri_rd_u32(p + 20);
        return;
    }
    const uint8_t *p = image + h->tensor_offset + (size_t)index * COLIBRI_TENSOR_SIZE;
    t->offset = colibri_rd_u32(p + 0);
    t->nbytes = colibri_rd_u32(p + 4);
    t->rows = colibri_rd_u32(p + 8);
    t->cols = colibri_rd_u32(p + 12);
    t->dtype = p[16];
    t->ndim = p[17];
    t->reserved = colibri_rd_u16(p + 18);
    t->aux = colibri_rd_u32(p + 20);
}

void colibri_read_layer(const uint8_t *image, const colibri_header *h, uint32_t index, colibri_layer *l)
{
    const uint8_t *p = image + h->layer_offset + (size_t)index * COLIBRI_LAYER_SIZE;
    l->op = p[0];
    l->kind = p[1];
    l->flags = colibri_rd_u16(p + 2);
    l->in_features = colibri_rd_u32(p + 4);
    l->out_features = colibri_rd_u32(p + 8);
    l->t0 = colibri_rd_u32(p + 12);
    l->t1 = colibri_rd_u32(p + 16);
    l->eps = colibri_rd_f32(p + 20);
    l->reserved_set = any_set(p + 24, 8);
}

void colibri_read_moe(const uint8_t *image, const colibri_header *h, uint32_t index, colibri_moe *m)
{
    const uint8_t *p = image + h->moe_offset + (size_t)index * COLIBRI_MOE_SIZE;
    m->d_model = colibri_rd_u32(p + 0);
    m->route_count = colibri_rd_u32(p + 4);
    m->expert_count = colibri_rd_u32(p + 8);
    m->top_k = colibri_rd_u32(p + 12);
    m->routing = p[16];
    m->flags = p[17];
    m->shared_count = colibri_rd_u16(p + 18);
    m->router_weight = colibri_rd_u32(p + 20);
    m->router_bias = colibri_rd_u32(p + 24);
    m->expert_map = colibri_rd_u32(p + 28);
    m->first_expert = colibri_rd_u32(p + 32);
    m->shared_gate = colibri_rd_u32(p + 36);
    m->reserved_set = any_set(p + 40, 8);
}

void colibri_read_expert(const uint8_t *image, const colibri_header *h, uint32_t index, colibri_expert *e)
{
    const uint8_t *p = image + h->expert_offset + (size_t)index * COLIBRI_EXPERT_SIZE;
    e->kind = p[0];
    e->activation = p[1];
    e->flags = colibri_rd_u16(p + 2);
    e->hidden = colibri_rd_u32(p + 4);
    e->w1 = colibri_rd_u32(p + 8);
    e->b1 = colibri_rd_u32(p + 12);
    e->w2 = colibri_rd_u32(p + 16);
    e->b2 = colibri_rd_u32(p + 20);
    e->w3 = colibri_rd_u32(p + 24);
    e->b3 = colibri_rd_u32(p + 28);
}

void colibri_read_attention(const uint8_t *image, const colibri_header *h, uint32_t index, colibri_attention *a)
{
    const uint8_t *p = image + h->attention_offset + (size_t)index * COLIBRI_ATTENTION_SIZE;
    a->d_model = colibri_rd_u32(p + 0);
    a->n_heads = colibri_rd_u16(p + 4);
    a->n_kv_heads = colibri_rd_u16(p + 6);
    a->head_dim = colibri_rd_u32(p + 8);
    a->q_w = colibri_rd_u32(p + 12);
    a->q_b = colibri_rd_u32(p + 16);
    a->k_w = colibri_rd_u32(p + 20);
    a->k_b = colibri_rd_u32(p + 24);
    a->v_w = colibri_rd_u32(p + 28);
    a->v_b = colibri_rd_u32(p + 32);
    a->o_w = colibri_rd_u32(p + 36);
    a->o_b = colibri_rd_u32(p + 40);
    a->q_norm = colibri_rd_u32(p + 44);
    a->k_norm = colibri_rd_u32(p + 48);
    a->rope_theta = colibri_rd_f32(p + 52);
    a->qk_norm_eps = colibri_rd_f32(p + 56);
    a->max_seq_len = colibri_rd_u32(p + 60);
    a->kv_dtype = p[64];
    a->flags = p[COLIBRI_ATTENTION_FLAGS_OFFSET];
    a->reserved_set = any_set(p + COLIBRI_ATTENTION_RESERVED, COLIBRI_ATTENTION_SIZE - COLIBRI_ATTENTION_RESERVED);
}

/* ---- CRC-32 (IEEE 802.3, reflected, as zlib.crc32) ----
 *
 * Two builds of the same function. A microcontroller (no OS: the Cortex-M
 * firmware, the MicroPython modules) keeps the compact one, a nibble at a time
 * from a 64-byte table: it checks an image once, at boot. Linux and host builds
 * check payloads of hundreds of MB on the first token (verify on use), so they
 * fold eight bytes a step through 8 KiB of tables (slicing-by-8; about 10x the
 * nibble loop, bench/crc_bench.c). -DCOLIBRI_CRC_SLICING=0 or =1 overrides. */

#ifndef COLIBRI_CRC_SLICING
#if defined(__linux__) || defined(__APPLE__) || defined(_WIN32) || defined(__unix__)
#define COLIBRI_CRC_SLICING 1
#else
#define COLIBRI_CRC_SLICING 0
#endif
#endif

#if COLIBRI_CRC_SLICING
#include "colibri_crc_tables.h"

uint32_t colibri_crc32(const uint8_t *p, size_t n)
{
    const uint32_t(*const t)[256] = colibri_crc_slices;
    uint32_t crc = 0xFFFFFFFFu;
    for (; n >= 8u; n -= 8u, p += 8) {
        /* Little-endian loads from bytes: any alignment, any host byte order. */
        const uint32_t lo = crc ^ colibri_rd_u32(p), hi = colibri_rd_u32(p + 4);
        crc = t[7][lo & 0xFFu] ^ t[6][(lo >> 8) & 0xFFu] ^ t[5][(lo >> 16) & 0xFFu] ^ t[4][lo >> 24] ^
              t[3][hi & 0xFFu] ^ t[2][(hi >> 8) & 0xFFu] ^ t[1][(hi >> 16) & 0xFFu] ^ t[0][hi >> 24];
    }
    for (; n; n--, p++)
        crc = (crc >> 8) ^ t[0][(crc ^ *p) & 0xFFu];
    return crc ^ 0xFFFFFFFFu;
}
#else
uint32_t colibri_crc32(const uint8_t *p, size_t n)
{
    static const uint32_t table[16] = {
        0x00000000u, 0x1DB71064u, 0x3B6E20C8u, 0x26D930ACu,
        0x76DC4190u, 0x6B6B51F4u, 0x4DB26158u, 0x5005713Cu,
        0xEDB88320u, 0xF00F9344u, 0xD6D6A3E8u, 0xCB61B38Cu,
        0x9B64C2B0u, 0x86D3D2D4u, 0xA00AE278u, 0xBDBDF21Cu,
    };
    uint32_t crc = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; i++) {
        crc ^= p[i];
        crc = (crc >> 4) ^ table[crc & 15u];
        crc = (crc >> 4) ^ table[crc & 15u];
    }
    return crc ^ 0xFFFFFFFFu;
}
#endif

/* ---- Header, tables ---- */

static int is_activation(uint32_t kind)
{
    return kind >= COLIBRI_ACT_RELU && kind <= COLIBRI_ACT_SIGMOID;
}

/* The largest image this build addresses: SIZE_MAX, or a board's own limit
 * (-DCOLIBRI_MAX_IMAGE_BYTES=..., e.g. its flash slot). A version-7 image
 * past it is IMAGE_TOO_LARGE, not TRUNCATED: no buffer this build can be
 * given would hold it. */
#ifndef COLIBRI_MAX_IMAGE_BYTES
#define COLIBRI_MAX_IMAGE_BYTES ((uint64_t)SIZE_MAX)
#endif

static colibri_status check_header(const uint8_t *image, size_t image_len, colibri_header *h)
{
    if (h->magic != COLIBRI_MAGIC)
        return COLIBRI_E_BAD_MAGIC;
    /* 0 and erased flash are no version; anything else outside the range is an
     * image this engine does not read (docs/model-format.md "Compatibility"). */
    if (h->version == 0u || h->version == 0xFFFFu)
        return COLIBRI_E_BAD_VERSION;
    if (h->version < COLIBRI_FORMAT_VERSION_MIN || h->version > COLIBRI_FORMAT_VERSION_MAX)
        return COLIBRI_E_UNSUPPORTED_VERSION;
    const int wide = h->version >= COLIBRI_WIDE_VERSION;
    if (h->header_size != (wide ? COLIBRI_WIDE_HEADER_SIZE : COLIBRI_HEADER_SIZE))
        return COLIBRI_E_BAD_HEADER;
    if (wide) { /* v7: the 64-bit image_size at 80; the u32 at 12 its value up to 0xFFFFFFFF */
        if (image_len < COLIBRI_WIDE_HEADER_SIZE)
            return COLIBRI_E_TRUNCATED;
        h->image_bytes = colibri_rd_u64(image + COLIBRI_WIDE_FIELDS_OFFSET);
        h->reserved_set |= any_set(image + COLIBRI_WIDE_FIELDS_OFFSET + 8u, 8u);
        const uint64_t low = h->image_bytes > COLIBRI_NARROW_LIMIT ? COLIBRI_NARROW_LIMIT : h->image_bytes;
        if (h->image_size != low)
            return COLIBRI_E_BAD_HEADER;
    }
    if (h->image_bytes < h->header_size)
        return COLIBRI_E_BAD_HEADER;
    if (h->image_bytes > COLIBRI_MAX_IMAGE_BYTES)
        return COLIBRI_E_IMAGE_TOO_LARGE;
    if (image_len < h->image_bytes)
        return COLIBRI_E_TRUNCATED;
    /* v3: the CRC covers the metadata [12, meta_size) (header and tables);
     * the payloads have their own CRCs (the CRC table). */
    if (h->version >= COLIBRI_TENSOR_CRC_VERSION &&
        (h->meta_size % 4u != 0 || h->meta_size < h->header_size || h->meta_size > h->image_bytes))
        return COLIBRI_E_BAD_HEADER;
    /* Below v3 the CRC covers the whole image, which then fits 32 bits. */
    const uint32_t covered = h->version >= COLIBRI_TENSOR_CRC_VERSION ? h->meta_size : h->image_size;
    if (colibri_crc32(image + COLIBRI_CRC_START, covered - COLIBRI_CRC_START) != h->crc32)
        return COLIBRI_E_BAD_CRC;
    if (h->reserved_set || (h->flags & ~COLIBRI_FLAG_PAGE_ALIGNED) ||
        h->input_size == 0 || h->output_size == 0 ||
        h->max_batch == 0 || h->max_batch > COLIBRI_MAX_BATCH_LIMIT || h->layer_count == 0)
        return COLIBRI_E_BAD_HEADER;
    /* A token model (v4, or v5 with attention records): token ids in, one
     * logit per vocabulary entry out. */
    if (colibri_token_model(h) && h->input_size != h->output_size)
        return COLIBRI_E_BAD_HEADER;
    return COLIBRI_OK;
}

/* Where the tables may lie: up to image_size, in v3 up to meta_size (the
 * metadata the header CRC covers). */
static uint64_t meta_end(const colibri_header *h)
{
    return h->version >= COLIBRI_TENSOR_CRC_VERSION ? h->meta_size : h->image_bytes;
}

/* A table of count records of record_size bytes at offset: 4-aligned, after
 * the header, inside the metadata (an empty table too). */
static int table_ok(const colibri_header *h, uint32_t offset, uint32_t count, uint32_t record_size)
{
    return offset % 4u == 0 && offset >= h->header_size &&
           (uint64_t)offset + (uint64_t)count * record_size <= meta_end(h);
}

/* ---- The validator's state ---- */

/* What the checks below share: the image, its header, the model summary
 * being filled, and the work done so far. Validation is linear in the image
 * size: every table record is read a bounded number of times and every
 * payload entry scanned at most once (tensor payloads do not overlap, and
 * each MoE record, expert record and expert map has one owning MOE layer).
 * `work` counts those reads and scans, so a test can bound it. */
typedef struct checker {
    const uint8_t *image;
    const colibri_header *h;
    colibri_model *m;
    uint64_t work;          /* records read + payload entries scanned */
    /* Ownership, in program order: the next MOE layer must name a MoE
     * record from next_moe on, experts from next_expert on, and an expert
     * map tensor from next_map on. */
    uint32_t next_moe, next_expert, next_map;
    /* Likewise each attention record belongs to one ATTENTION layer. */
    uint32_t next_attention;
} checker;

static void read_tensor(checker *c, uint32_t index, colibri_tensor *t)
{
    c->work++;
    colibri_read_tensor(c->image, c->h, index, t);
}

/* ---- Tensors ---- */

/* Q8_PARAMS: where the fields of a companion lie (docs/model-format.md
 * "Quantised weights"). */

typedef struct colibri_q8_layout {
    uint32_t nnz;        /* entries of E */
    uint8_t param;       /* bytes per scale and bias: 4 (f32) or 2 (f16, v2) */
    uint8_t bias;        /* 1: a bias [rows] follows the scales (v2 BIAS flag) */
    uint8_t ptr;         /* bytes per row pointer: 0 (nnz 0), 1, 2 or 4 */
    /* Byte offsets from the payload start, col and val only when nnz > 0;
     * they are meaningful once size (in 64 bits: rows and nnz come from
     * unchecked fields) has been found equal to the record's nbytes. */
    size_t scale, bias_at, row_ptr, col, val;
    uint64_t size;
} colibri_q8_layout;

/* Row pointer i of a layout's row_ptr array at p (any width). */
static inline uint32_t colibri_q8_ptr_at(const uint8_t *p, uint8_t width, uint64_t i)
{
    switch (width) {
    case 1:
        return p[i];
    case 2:
        return colibri_rd_u16(p + 2u * (size_t)i);
    default:
        return colibri_rd_u32(p + 4u * (size_t)i);
    }
}

/* n rounded up to a multiple of a, a power of two (no 64-bit division: none
 * of libgcc's helpers on 32-bit targets). */
static uint64_t colibri_up(uint64_t n, uint64_t a)
{
    return (n + a - 1u) & ~(a - 1u);
}

/* The layout of the companion payload p (at least COLIBRI_Q8_PARAMS_HEADER
 * bytes) of a tensor of `rows` rows in an image of format `version`, as
 * colibri.model.format.q8_layout computes it. Returns 0 if its header codes are
 * invalid (v2: parameter dtype other than F32 or F16, unknown flags,
 * reserved bits); v1's reserved word is left to the second pass. */
static ALWAYS_INLINE int colibri_q8_layout_of(const uint8_t *p, uint16_t version, uint64_t rows, colibri_q8_layout *l)
{
    l->nnz = colibri_rd_u32(p);
    l->param = 4;
    l->bias = 0;
    int ok = 1;
    if (version >= 2u) {
        const uint8_t dtype = p[4], flags = p[5];
        ok = (dtype == COLIBRI_DTYPE_F32 || dtype == COLIBRI_DTYPE_F16) &&
             (flags & ~COLIBRI_Q8_FLAG_BIAS) == 0 && colibri_rd_u16(p + 6) == 0;
        l->param = dtype == COLIBRI_DTYPE_F16 ? 2u : 4u;
        l->bias = (flags & COLIBRI_Q8_FLAG_BIAS) != 0;
    }
    if (l->nnz == 0)
        l->ptr = 0;
    else if (version < 2u || l->nnz > 0xFFFFu)
        l->ptr = 4;
    else
        l->ptr = l->nnz > 0xFFu ? 2u : 1u;
    /* Offsets are stored in size_t; only size, which decides validity,
     * needs all 64 (once it equals nbytes every offset lies inside the image,
     * which fits size_t). */
    uint64_t pos = COLIBRI_Q8_PARAMS_HEADER + (uint64_t)l->param * rows;
    l->scale = COLIBRI_Q8_PARAMS_HEADER;
    l->bias_at = (size_t)pos;
    if (l->bias)
        pos += (uint64_t)l->param * rows;
    l->row_ptr = l->col = l->val = (size_t)pos;
    if (l->ptr) {
        pos = colibri_up(pos, l->ptr);
        l->row_ptr = (size_t)pos;
        pos = colibri_up(pos + (uint64_t)l->ptr * (rows + 1u), 2u);
        l->col = (size_t)pos;
        pos = colibri_up(pos + 2u * (uint64_t)l->nnz, version < 2u ? 4u : 2u); /* v1 pads the columns to 4 bytes */
        l->val = (size_t)pos;
        pos += 2u * (uint64_t)l->nnz;
    }
    l->size = pos;
    return ok;
}


/* The layout of the Q4_PARAMS payload p (at least COLIBRI_Q4_PARAMS_HEADER
 * bytes) of an I4 tensor [rows, cols], as colibri.model.format.q4_layout computes
 * it: f16 scales [rows * G], the f16 bias [rows] with BIAS, then E as a v2
 * Q8_PARAMS holds it (param is 2, scale and bias_at as there). Returns 0 if
 * its header codes are invalid (group_log2 outside 3..8, unknown flags,
 * reserved bits). *groups receives G. */
static ALWAYS_INLINE int colibri_q4_layout_of(const uint8_t *p, uint64_t rows, uint64_t cols, colibri_q8_layout *l,
                                              uint64_t *groups)
{
    const uint8_t g_log2 = p[4], flags = p[5];
    const int ok = g_log2 >= COLIBRI_Q4_GROUP_LOG2_MIN && g_log2 <= COLIBRI_Q4_GROUP_LOG2_MAX &&
                   (flags & ~COLIBRI_Q4_FLAG_BIAS) == 0 && colibri_rd_u16(p + 6) == 0;
    /* An invalid group_log2 still gives a defined shift (< 64) and a size. */
    const unsigned shift = g_log2 & 63u;
    l->nnz = colibri_rd_u32(p);
    l->param = 2;
    l->bias = (flags & COLIBRI_Q4_FLAG_BIAS) != 0;
    l->ptr = l->nnz == 0 ? 0u : l->nnz > 0xFFFFu ? 4u : l->nnz > 0xFFu ? 2u : 1u;
    *groups = (cols + (1ull << shift) - 1u) >> shift;
    uint64_t pos = COLIBRI_Q4_PARAMS_HEADER + 2u * rows * *groups;
    l->scale = COLIBRI_Q4_PARAMS_HEADER;
    l->bias_at = (size_t)pos;
    if (l->bias)
        pos += 2u * rows;
    l->row_ptr = l->col = l->val = (size_t)pos;
    if (l->ptr) {
        pos = colibri_up(pos, l->ptr);
        l->row_ptr = (size_t)pos;
        pos = colibri_up(pos + (uint64_t)l->ptr * (rows + 1u), 2u);
        l->col = (size_t)pos;
        pos += 2u * (uint64_t)l->nnz;
        l->val = (size_t)pos;
        pos += 2u * (uint64_t)l->nnz;
    }
    l->size = pos;
    return ok;
}

/* Pass 1: one tensor record on its own: TENSOR_BOUNDS (inside the image,
 * aligned, at or after the end of the previous tensor's payload, prev_end),
 * then BAD_TENSOR (dtype, rank and shape, reserved, aux, nbytes). */
static NOINLINE colibri_status check_tensor(const uint8_t *image, const colibri_header *h, const colibri_tensor *t,
                                   uint64_t prev_end, uint32_t index, uint32_t level)
{
    /* offset < image_bytes first, so image_bytes - offset cannot wrap (v7's
     * u64 fields would in offset + nbytes). */
    if (t->offset % COLIBRI_PAYLOAD_ALIGN != 0 || t->offset < h->header_size || t->offset < prev_end ||
        t->offset < h->meta_size || /* v3: payloads after the metadata (meta_size 0 before) */
        t->offset >= h->image_bytes || t->nbytes > h->image_bytes - t->offset)
        return COLIBRI_E_TENSOR_BOUNDS;
    /* v3, full check: the payload against its CRC table entry, before
     * anything in it is interpreted. Inside the image, which fits size_t. */
    if (h->version >= COLIBRI_TENSOR_CRC_VERSION && level == COLIBRI_CHECK_FULL &&
        colibri_crc32(image + (size_t)t->offset, (size_t)t->nbytes) !=
            colibri_rd_u32(image + h->crc_offset + 4u * (size_t)index))
        return COLIBRI_E_BAD_PAYLOAD_CRC;

    uint64_t elem = 0; /* bytes per element; Q8_PARAMS has its own layout */
    switch (t->dtype) {
    case COLIBRI_DTYPE_F32:
    case COLIBRI_DTYPE_I32:
        elem = 4;
        break;
    case COLIBRI_DTYPE_F16:
        elem = 2;
        break;
    case COLIBRI_DTYPE_I8:
        elem = 1;
        break;
    case COLIBRI_DTYPE_Q8_PARAMS:
        break;
    case COLIBRI_DTYPE_I4: /* int4 weights and their companions: format v5 */
    case COLIBRI_DTYPE_Q4_PARAMS:
        if (h->version < COLIBRI_Q4_VERSION)
            return COLIBRI_E_BAD_TENSOR;
        break;
    case COLIBRI_DTYPE_TOKENIZER: /* the tokenizer section: format v6 */
        if (h->version < COLIBRI_TOKENIZER_VERSION)
            return COLIBRI_E_BAD_TENSOR;
        break;
    default:
        return COLIBRI_E_BAD_TENSOR;
    }
    if ((t->ndim != 1 && t->ndim != 2) || (t->ndim == 1 && t->cols != 1) || t->rows == 0 ||
        t->cols == 0 || t->reserved != 0)
        return COLIBRI_E_BAD_TENSOR;
    /* Only an I8 or I4 tensor names a companion (checked in pass 2). */
    if (t->dtype != COLIBRI_DTYPE_I8 && t->dtype != COLIBRI_DTYPE_I4 && t->aux != COLIBRI_NONE)
        return COLIBRI_E_BAD_TENSOR;

    if (t->dtype == COLIBRI_DTYPE_TOKENIZER) /* a byte payload; its contents after the program */
        return t->nbytes == t->rows && t->ndim == 1 ? COLIBRI_OK : COLIBRI_E_BAD_TENSOR;
    if (t->dtype == COLIBRI_DTYPE_I4) {
        /* ceil(cols / 2) bytes a row; < 2^63, and above 2^32 it cannot match nbytes. */
        const uint64_t size = (uint64_t)t->rows * (((uint64_t)t->cols + 1u) / 2u);
        return size == t->nbytes ? COLIBRI_OK : COLIBRI_E_BAD_TENSOR;
    }
    if (t->dtype == COLIBRI_DTYPE_Q4_PARAMS) {
        /* As Q8_PARAMS below: the header's codes BAD_QUANT, the size BAD_TENSOR. */
        if (t->nbytes < COLIBRI_Q4_PARAMS_HEADER)
            return COLIBRI_E_BAD_TENSOR;
        colibri_q8_layout l;
        uint64_t groups;
        if (!colibri_q4_layout_of(image + (size_t)t->offset, t->rows, t->cols, &l, &groups))
            return COLIBRI_E_BAD_QUANT;
        if (t->nbytes != l.size || (l.nnz != 0 && t->cols > 65536u))
            return COLIBRI_E_BAD_TENSOR;
        return COLIBRI_OK;
    }
    if (t->dtype != COLIBRI_DTYPE_Q8_PARAMS) {
        /* Exact: rows * cols < 2^64, at most 2^32 - 1 elements (v7's nbytes
         * holds more bytes, not more elements), so count * elem < 2^35. */
        const uint64_t count = (uint64_t)t->rows * t->cols;
        if (count > COLIBRI_MAX_TENSOR_ELEMENTS || count * elem != t->nbytes)
            return COLIBRI_E_BAD_TENSOR;
        return COLIBRI_OK;
    }
    /* Q8_PARAMS: nbytes follows from rows and the payload's header (inside
     * the image: nbytes >= 8 and the bounds above): nnz, and in v2 the
     * parameter dtype and flags, whose codes are BAD_QUANT. */
    if (t->nbytes < COLIBRI_Q8_PARAMS_HEADER)
        return COLIBRI_E_BAD_TENSOR;
    colibri_q8_layout l;
    if (!colibri_q8_layout_of(image + (size_t)t->offset, h->version, t->rows, &l))
        return COLIBRI_E_BAD_QUANT;
    if (t->nbytes != l.size || (l.nnz != 0 && t->cols > 65536u))
        return COLIBRI_E_BAD_TENSOR;
    return COLIBRI_OK;
}

/* An f16 parameter: ±0 or a normal number (not subnormal, inf or NaN). */
static int half_ok(uint16_t h)
{
    const uint16_t exp = h & 0x7C00u;
    return exp != 0x7C00u && (exp != 0 || (h & 0x03FFu) == 0);
}

/* Is the f32 (param 4) scale at p finite and >= 0 (-0 is), or the f16
 * (param 2) one ±0 or a positive normal number? */
static int scale_ok(const uint8_t *p, uint8_t param)
{
    if (param == 2u) {
        const uint16_t h = colibri_rd_u16(p);
        return half_ok(h) && !((h & 0x8000u) && (h & 0x7FFFu));
    }
    const float s = colibri_rd_f32(p);
    return isfinite(s) && s >= 0.0f;
}

/* The sparse term E of a companion at p whose layout l is valid (Q8_PARAMS
 * or Q4_PARAMS, of an int tensor [rows, cols]): BAD_COMPENSATION for nonzero
 * padding before row_ptr, col and val, row pointers not running 0 .. nnz
 * non-decreasing, a column out of range or not increasing within its row, a
 * non-finite value. Inlined into both companions' checks. */
static ALWAYS_INLINE colibri_status check_terms(checker *ck, const uint8_t *p, const colibri_q8_layout *l,
                                                uint32_t rows, uint32_t cols)
{
    const uint32_t nnz = l->nnz;
    if (nnz == 0)
        return COLIBRI_OK;

    const uint8_t *row_ptr = p + (size_t)l->row_ptr, *col = p + (size_t)l->col, *val = p + (size_t)l->val;
    const uint8_t w = l->ptr;

    /* The gaps before row_ptr, col and val (each field starts at a multiple
     * of its element size): zero bytes. */
    const size_t params_end = (size_t)l->bias_at + (l->bias ? (size_t)l->param * rows : 0u);
    const size_t ptr_end = (size_t)l->row_ptr + (size_t)w * ((size_t)rows + 1u);
    const size_t col_end = (size_t)l->col + 2u * (size_t)nnz;
    if (any_set(p + params_end, (size_t)l->row_ptr - params_end) || any_set(p + ptr_end, (size_t)l->col - ptr_end) ||
        any_set(p + col_end, (size_t)l->val - col_end))
        return COLIBRI_E_BAD_COMPENSATION;

    /* row_ptr: 0, non-decreasing, nnz; so every row's range lies in [0, nnz). */
    uint32_t prev = colibri_q8_ptr_at(row_ptr, w, 0);
    if (prev != 0)
        return COLIBRI_E_BAD_COMPENSATION;
    ck->work += (uint64_t)rows + 1u;
    for (uint32_t i = 1; i <= rows; i++) {
        const uint32_t next = colibri_q8_ptr_at(row_ptr, w, i);
        if (next < prev)
            return COLIBRI_E_BAD_COMPENSATION;
        prev = next;
    }
    if (prev != nnz)
        return COLIBRI_E_BAD_COMPENSATION;
    /* Columns: below cols, strictly increasing within each row. */
    for (uint32_t i = 0; i < rows; i++) {
        const uint32_t end = colibri_q8_ptr_at(row_ptr, w, (uint64_t)i + 1u);
        uint32_t k = colibri_q8_ptr_at(row_ptr, w, i);
        for (uint32_t last = 0, first = 1; k < end; k++, first = 0) {
            ck->work++;
            const uint32_t j = colibri_rd_u16(col + 2u * (size_t)k);
            if (j >= cols || (!first && j <= last))
                return COLIBRI_E_BAD_COMPENSATION;
            last = j;
        }
    }
    /* Values finite (f16 exponent not all ones). */
    ck->work += nnz;
    for (uint32_t k = 0; k < nnz; k++)
        if ((colibri_rd_u16(val + 2u * (size_t)k) & 0x7C00u) == 0x7C00u)
            return COLIBRI_E_BAD_COMPENSATION;
    return COLIBRI_OK;
}

/* Pass 2: the Q8_PARAMS companion of I8 tensor t (pass 1 has checked every
 * record, so the companion's header codes are valid and its payload has
 * exactly the size they imply): BAD_QUANT for the reference, v1's reserved
 * word and the scales, then BAD_COMPENSATION for the sparse term E (its
 * padding bytes included). An f32 bias is any value, as an F32 bias tensor;
 * an f16 bias ±0 or normal. Not inlined (see NOINLINE above). */
static NOINLINE colibri_status check_quant(checker *ck, const colibri_tensor *t)
{
    if (t->aux >= ck->h->tensor_count)
        return COLIBRI_E_BAD_QUANT;
    colibri_tensor c;
    read_tensor(ck, t->aux, &c);
    if (c.dtype != COLIBRI_DTYPE_Q8_PARAMS || c.rows != t->rows || c.cols != t->cols)
        return COLIBRI_E_BAD_QUANT;

    /* Each scan below visits at most rows * cols + rows + 1 entries, no more
     * than the I8 tensor's own (non-overlapping) payload holds bytes. */
    const uint8_t *p = ck->image + (size_t)c.offset;
    const uint32_t rows = c.rows;
    colibri_q8_layout l;
    (void)colibri_q8_layout_of(p, ck->h->version, rows, &l);
    if (ck->h->version < 2u && colibri_rd_u32(p + 4) != 0)
        return COLIBRI_E_BAD_QUANT;
    /* Offsets fit size_t even on 32-bit targets: all lie within nbytes. */
    const uint8_t *scale = p + (size_t)l.scale;
    ck->work += rows;
    for (uint32_t i = 0; i < rows; i++)
        if (!scale_ok(scale + (size_t)l.param * i, l.param))
            return COLIBRI_E_BAD_QUANT;
    /* An f16 bias: ±0 or normal (an f32 bias is any value, as an F32 tensor). */
    if (l.bias && l.param == 2u) {
        ck->work += rows;
        for (uint32_t i = 0; i < rows; i++)
            if (!half_ok(colibri_rd_u16(p + (size_t)l.bias_at + 2u * (size_t)i)))
                return COLIBRI_E_BAD_QUANT;
    }
    return check_terms(ck, p, &l, rows, c.cols);
}

/* Pass 2: the Q4_PARAMS companion of I4 tensor t (its header codes and size
 * checked in pass 1): BAD_QUANT for the reference (aux, a Q4_PARAMS of the
 * same rows and cols), the unused high nibble of each row's last byte when
 * cols is odd, the group scales (±0 or positive normal f16) and the f16 bias
 * (±0 or normal), then BAD_COMPENSATION for E as in Q8_PARAMS. */
static NOINLINE colibri_status check_q4(checker *ck, const colibri_tensor *t)
{
    if (t->aux >= ck->h->tensor_count)
        return COLIBRI_E_BAD_QUANT;
    colibri_tensor c;
    read_tensor(ck, t->aux, &c);
    if (c.dtype != COLIBRI_DTYPE_Q4_PARAMS || c.rows != t->rows || c.cols != t->cols)
        return COLIBRI_E_BAD_QUANT;
    const uint32_t rows = c.rows;
    if (t->cols & 1u) {
        const size_t stride = ((size_t)t->cols + 1u) / 2u;
        const uint8_t *last = ck->image + (size_t)t->offset + stride - 1u;
        ck->work += rows;
        for (uint32_t i = 0; i < rows; i++)
            if (last[(size_t)i * stride] & 0xF0u)
                return COLIBRI_E_BAD_QUANT;
    }
    const uint8_t *p = ck->image + (size_t)c.offset;
    colibri_q8_layout l;
    uint64_t groups;
    (void)colibri_q4_layout_of(p, rows, c.cols, &l, &groups);
    /* rows * groups scales lie inside the payload (its size was checked). */
    const size_t n_scales = (size_t)rows * (size_t)groups;
    ck->work += n_scales;
    for (size_t i = 0; i < n_scales; i++)
        if (!scale_ok(p + l.scale + 2u * i, 2u))
            return COLIBRI_E_BAD_QUANT;
    if (l.bias) {
        ck->work += rows;
        for (uint32_t i = 0; i < rows; i++)
            if (!half_ok(colibri_rd_u16(p + (size_t)l.bias_at + 2u * (size_t)i)))
                return COLIBRI_E_BAD_QUANT;
    }
    return check_terms(ck, p, &l, rows, c.cols);
}

/* Bit sets of dtypes a tensor role accepts. */
#define DT(d) (1u << (d))
enum {
    /* Routers, shared gates and embedding tables: no int4 form. */
    WEIGHT_DTYPES = DT(COLIBRI_DTYPE_F32) | DT(COLIBRI_DTYPE_F16) | DT(COLIBRI_DTYPE_I8),
    /* LINEAR weights, experts' w1/w2/w3 and attention projections. */
    MATMUL_DTYPES = WEIGHT_DTYPES | DT(COLIBRI_DTYPE_I4),
    F32_ONLY = DT(COLIBRI_DTYPE_F32),
    I32_ONLY = DT(COLIBRI_DTYPE_I32),
};

typedef enum { REQUIRED, OPTIONAL } ref_need;

/* Tensor reference `index` for a role: present (or NONE if optional), of one
 * of these dtypes and this shape: [rows] when ndim is 1, [rows, cols] when
 * ndim is 2. */
static colibri_status check_ref(checker *c, uint32_t index, ref_need need, unsigned dtypes, uint8_t ndim,
                                uint32_t rows, uint32_t cols)
{
    if (index == COLIBRI_NONE && need == OPTIONAL)
        return COLIBRI_OK;
    if (index >= c->h->tensor_count)
        return COLIBRI_E_BAD_REF;
    colibri_tensor t;
    read_tensor(c, index, &t);
    /* dtype <= COLIBRI_DTYPE_Q4_PARAMS (pass 1), so the shift is defined. */
    if (!(dtypes & DT(t.dtype)) || t.ndim != ndim || t.rows != rows || t.cols != cols)
        return COLIBRI_E_BAD_REF;
    return COLIBRI_OK;
}

/* A weight matrix [rows, cols]: F32, F16 or I8 (a router, shared gate or
 * embedding table). */
static colibri_status check_matrix(checker *c, uint32_t index, ref_need need, uint32_t rows, uint32_t cols)
{
    return check_ref(c, index, need, WEIGHT_DTYPES, 2, rows, cols);
}

/* A weight a matrix product reads [rows, cols]: F32, F16, I8 or I4. */
static colibri_status check_matmul(checker *c, uint32_t index, ref_need need, uint32_t rows, uint32_t cols)
{
    return check_ref(c, index, need, MATMUL_DTYPES, 2, rows, cols);
}

/* A bias or norm parameter [n]: F32. */
static colibri_status check_vector(checker *c, uint32_t index, ref_need need, uint32_t n)
{
    return check_ref(c, index, need, F32_ONLY, 1, n, 1);
}

/* Is tensor `index` (a checked reference) int8? */
static int is_i8(checker *c, uint32_t index)
{
    colibri_tensor t;
    read_tensor(c, index, &t);
    return t.dtype == COLIBRI_DTYPE_I8;
}

/* Is tensor `index` (a checked reference) int8 or int4: may it run with
 * int8 activations (INT8_ACT)? */
static int is_int(checker *c, uint32_t index)
{
    colibri_tensor t;
    read_tensor(c, index, &t);
    return t.dtype == COLIBRI_DTYPE_I8 || t.dtype == COLIBRI_DTYPE_I4;
}

/* Does I8 tensor `index` (checked, its companion too) carry a bias in its
 * Q8_PARAMS companion (v2 BIAS flag)? */
static int has_q8_bias(checker *c, uint32_t index)
{
    colibri_tensor t;
    read_tensor(c, index, &t);
    read_tensor(c, t.aux, &t);
    return c->h->version >= 2u && (c->image[t.offset + 5u] & COLIBRI_Q8_FLAG_BIAS) != 0;
}

static void widen(uint32_t *dim, uint32_t v)
{
    if (v > *dim)
        *dim = v;
}

/* ---- Experts ---- */

/* Expert record `index` of an MoE layer of width d. */
static colibri_status check_expert(checker *c, uint32_t index, uint32_t d)
{
    const colibri_header *h = c->h;
    colibri_expert e;
    c->work++;
    colibri_read_expert(c->image, h, index, &e);
    const int glu = e.kind == COLIBRI_EXPERT_GLU;
    if ((e.kind != COLIBRI_EXPERT_MLP && !glu) || !is_activation(e.activation) ||
        (e.flags & ~(COLIBRI_EXPERT_FLAG_INT8_ACT | COLIBRI_EXPERT_FLAG_INT8_BLOCKS)) ||
        (e.flags & COLIBRI_EXPERT_FLAG_INT8_ACT && e.flags & COLIBRI_EXPERT_FLAG_INT8_BLOCKS) || e.hidden == 0)
        return COLIBRI_E_BAD_MOE;
    if (glu ? e.w3 == COLIBRI_NONE : (e.w3 != COLIBRI_NONE || e.b3 != COLIBRI_NONE))
        return COLIBRI_E_BAD_MOE;

    /* PAGE_ALIGNED: each expert starts on a page, so it is one madvise range. */
    if ((h->flags & COLIBRI_FLAG_PAGE_ALIGNED) && e.w1 < h->tensor_count) {
        colibri_tensor w1;
        read_tensor(c, e.w1, &w1);
        if (w1.offset % COLIBRI_PAGE_SIZE != 0)
            return COLIBRI_E_TENSOR_BOUNDS;
    }

    const uint32_t hid = e.hidden;
    colibri_status st;
    if ((st = check_matmul(c, e.w1, REQUIRED, hid, d)) != COLIBRI_OK ||
        (st = check_vector(c, e.b1, OPTIONAL, hid)) != COLIBRI_OK ||
        (st = check_matmul(c, e.w2, REQUIRED, d, hid)) != COLIBRI_OK ||
        (st = check_vector(c, e.b2, OPTIONAL, d)) != COLIBRI_OK ||
        (st = check_matmul(c, e.w3, OPTIONAL, hid, d)) != COLIBRI_OK || /* present iff GLU, above */
        (st = check_vector(c, e.b3, OPTIONAL, hid)) != COLIBRI_OK)
        return st;

    /* INT8_ACT, INT8_BLOCKS: every weight int8 or int4 (the references are valid by now). */
    if (e.flags & (COLIBRI_EXPERT_FLAG_INT8_ACT | COLIBRI_EXPERT_FLAG_INT8_BLOCKS)) {
        if (!is_int(c, e.w1) || !is_int(c, e.w2) || (glu && !is_int(c, e.w3)))
            return COLIBRI_E_BAD_MOE;
        widen(&c->m->qwidth, d); /* quantised rows: x for w1 (w3), then the hidden for w2 */
        widen(&c->m->qwidth, hid);
        if (e.flags & COLIBRI_EXPERT_FLAG_INT8_BLOCKS) {
            widen(&c->m->qblocks, (uint32_t)colibri_act_blocks(d));
            widen(&c->m->qblocks, (uint32_t)colibri_act_blocks(hid));
        }
    }
    widen(&c->m->hidden, hid);
    return COLIBRI_OK;
}

/* ---- MoE records ---- */

/* expert_map [R] (i32, read by bytes): every entry -1 or a slot below n, and
 * every slot exactly once. With exactly n in-range entries that is the same
 * as every slot appearing, checked in windows of a fixed-size bitmap so the
 * stack use does not grow with n (at most 32 windows: n <= R <= 65535). */
static colibri_status check_expert_map(checker *c, const uint8_t *map, uint32_t routes, uint32_t n)
{
    enum { WINDOW = 2048 };
    uint8_t seen[WINDOW / 8];
    uint32_t kept = 0;

    c->work += routes;
    for (uint32_t r = 0; r < routes; r++) {
        const uint32_t v = colibri_rd_u32(map + 4u * r);
        if (v == COLIBRI_NONE)
            continue;
        if (v >= n)
            return COLIBRI_E_BAD_MOE;
        kept++;
    }
    if (kept != n)
        return COLIBRI_E_BAD_MOE;

    for (uint32_t base = 0; base < n; base += WINDOW) {
        memset(seen, 0, sizeof seen);
        c->work += routes;
        for (uint32_t r = 0; r < routes; r++) {
            const uint32_t v = colibri_rd_u32(map + 4u * r);
            if (v != COLIBRI_NONE && v >= base && v - base < WINDOW)
                seen[(v - base) / 8] |= (uint8_t)(1u << ((v - base) % 8));
        }
        const uint32_t span = n - base < WINDOW ? n - base : WINDOW;
        for (uint32_t i = 0; i < span; i++)
            if (!(seen[i / 8] & (1u << (i % 8))))
                return COLIBRI_E_BAD_MOE;
    }
    return COLIBRI_OK;
}

/* MoE record `index` used by a MOE layer of this width, and its experts. */
static colibri_status check_moe(checker *c, uint32_t index, uint32_t width)
{
    const colibri_header *h = c->h;
    colibri_model *m = c->m;
    colibri_moe moe;
    colibri_router router;
    c->work++;
    colibri_read_moe(c->image, h, index, &moe);
    if (!colibri_router_find(moe.routing, &router))
        return COLIBRI_E_BAD_MOE;
    if (moe.reserved_set || moe.d_model != width ||
        moe.route_count == 0 || moe.route_count > COLIBRI_MAX_ROUTES ||
        moe.expert_count == 0 || moe.expert_count > moe.route_count || moe.shared_count > COLIBRI_MAX_SHARED)
        return COLIBRI_E_BAD_MOE;

    uint32_t k = 0; /* experts chosen per token: K for the arena */
    switch (router.k_rule) {
    case COLIBRI_K_ONE:
        if (moe.top_k != 1)
            return COLIBRI_E_BAD_MOE;
        k = 1;
        break;
    case COLIBRI_K_ANY:
        if (moe.top_k == 0 || moe.top_k > moe.expert_count)
            return COLIBRI_E_BAD_MOE;
        k = moe.top_k;
        break;
    case COLIBRI_K_ALL:
        if (moe.top_k != 0)
            return COLIBRI_E_BAD_MOE;
        k = moe.expert_count;
        break;
    }
    if (moe.flags & ~router.flags)
        return COLIBRI_E_BAD_MOE;

    /* Routed experts first_expert .. +N-1, then the shared ones: inside the
     * table, and after every expert an earlier MOE layer owns. */
    const uint32_t d = moe.d_model, routes = moe.route_count, n = moe.expert_count;
    const uint32_t used = n + moe.shared_count;
    if ((uint64_t)moe.first_expert + used > h->expert_count || moe.first_expert < c->next_expert)
        return COLIBRI_E_BAD_REF;

    /* The expert map: an I32 [R] that no earlier MOE layer owns. */
    colibri_status st = check_ref(c, moe.expert_map, REQUIRED, I32_ONLY, 1, routes, 1);
    if (st != COLIBRI_OK)
        return st;
    if (moe.expert_map < c->next_map)
        return COLIBRI_E_BAD_REF;
    colibri_tensor map;
    read_tensor(c, moe.expert_map, &map);
    if ((st = check_expert_map(c, c->image + map.offset, routes, n)) != COLIBRI_OK ||
        (st = check_matrix(c, moe.router_weight, REQUIRED, routes, d)) != COLIBRI_OK ||
        (st = check_vector(c, moe.router_bias, OPTIONAL, routes)) != COLIBRI_OK)
        return st;
    for (uint32_t i = 0; i < used; i++)
        if ((st = check_expert(c, moe.first_expert + i, d)) != COLIBRI_OK)
            return st;
    if ((st = check_matrix(c, moe.shared_gate, OPTIONAL, 1, d)) != COLIBRI_OK)
        return st;

    c->next_moe = index + 1u; /* index < moe_count, so no wrap */
    c->next_expert = moe.first_expert + used;
    c->next_map = moe.expert_map + 1u;
    if (routes > m->routes)
        m->routes = routes;
    if (k > m->select)
        m->select = k;
    if (n > m->experts)
        m->experts = n;
    m->moe_layers++;
    m->routed_experts += n;
    m->shared_experts += moe.shared_count;
    return COLIBRI_OK;
}

/* ---- Attention records (token models, docs/lm.md) ---- */

/* A q or k norm weight: NONE, or F32 [hd] (each head's hd values, as
 * Qwen3-MoE) or [heads · hd] (the whole projection, as OLMoE). */
static colibri_status check_qk_norm(checker *c, uint32_t index, uint32_t hd, uint32_t heads)
{
    if (index == COLIBRI_NONE || check_vector(c, index, REQUIRED, hd) == COLIBRI_OK)
        return COLIBRI_OK;
    return check_vector(c, index, REQUIRED, heads * hd); /* heads · hd <= UINT32_MAX: checked */
}

/* Attention record `index` used by an ATTENTION layer of this width: its
 * fields, then its tensors, in record order; every failure is
 * BAD_ATTENTION (docs/lm.md), a bad tensor reference included. */
static colibri_status check_attention(checker *c, uint32_t index, uint32_t width)
{
    colibri_model *m = c->m;
    colibri_attention a;
    c->work++;
    colibri_read_attention(c->image, c->h, index, &a);
    const uint32_t heads = a.n_heads, kv_heads = a.n_kv_heads, hd = a.head_dim;
    const int normed = a.q_norm != COLIBRI_NONE || a.k_norm != COLIBRI_NONE;
    if (a.reserved_set || (a.flags & ~COLIBRI_ATTENTION_FLAG_INT8_BLOCKS) || a.d_model != width || heads == 0 || kv_heads == 0 || heads % kv_heads != 0 ||
        hd == 0 || hd % 2u != 0 || (uint64_t)heads * hd > UINT32_MAX ||
        !(isfinite(a.rope_theta) && a.rope_theta >= 1.0f) || /* format.ROPE_THETA_MIN (docs/lm.md) */
        (normed ? !(isfinite(a.qk_norm_eps) && a.qk_norm_eps > 0.0f) : a.qk_norm_eps != 0.0f) ||
        a.max_seq_len == 0 || a.max_seq_len > COLIBRI_MAX_SEQ_LEN ||
        (m->attn_layers && a.max_seq_len != m->max_seq_len) ||
        (a.kv_dtype != COLIBRI_DTYPE_F32 && a.kv_dtype != COLIBRI_DTYPE_F16))
        return COLIBRI_E_BAD_ATTENTION;

    const uint32_t d = a.d_model, qw = heads * hd, kvw = kv_heads * hd;
    colibri_status st;
    if ((st = check_matmul(c, a.q_w, REQUIRED, qw, d)) != COLIBRI_OK ||
        (st = check_vector(c, a.q_b, OPTIONAL, qw)) != COLIBRI_OK ||
        (st = check_matmul(c, a.k_w, REQUIRED, kvw, d)) != COLIBRI_OK ||
        (st = check_vector(c, a.k_b, OPTIONAL, kvw)) != COLIBRI_OK ||
        (st = check_matmul(c, a.v_w, REQUIRED, kvw, d)) != COLIBRI_OK ||
        (st = check_vector(c, a.v_b, OPTIONAL, kvw)) != COLIBRI_OK ||
        (st = check_matmul(c, a.o_w, REQUIRED, d, qw)) != COLIBRI_OK ||
        (st = check_vector(c, a.o_b, OPTIONAL, d)) != COLIBRI_OK ||
        (st = check_qk_norm(c, a.q_norm, hd, heads)) != COLIBRI_OK ||
        (st = check_qk_norm(c, a.k_norm, hd, kv_heads)) != COLIBRI_OK)
        return COLIBRI_E_BAD_ATTENTION;
    /* INT8_BLOCKS: every projection int8 or int4 (the references are valid by now). The quantised
     * rows are x (d columns) for q, k and v, then the heads' output (qw) for o. */
    if (a.flags & COLIBRI_ATTENTION_FLAG_INT8_BLOCKS) {
        const uint32_t projections[4] = {a.q_w, a.k_w, a.v_w, a.o_w};
        for (int i = 0; i < 4; i++)
            if (!is_int(c, projections[i]))
                return COLIBRI_E_BAD_ATTENTION;
        const uint32_t widest = d > qw ? d : qw;
        widen(&m->qwidth, widest);
        widen(&m->qblocks, (uint32_t)colibri_act_blocks(widest));
    }

    c->next_attention = index + 1u; /* index < attention_count, so no wrap */
    m->attn_layers++;
    m->max_seq_len = a.max_seq_len;
    widen(&m->q_width, qw);
    widen(&m->kv_width, kvw);
    widen(&m->head_dim, hd);
    /* K and V, max_seq_len rows of KVH · hd each (< 2^32 · 2^32 · 8: no wrap). */
    m->kv_bytes += 2u * (uint64_t)a.max_seq_len * kvw * (a.kv_dtype == COLIBRI_DTYPE_F16 ? 2u : 4u);
    return COLIBRI_OK;
}

/* ---- The layer program ---- */

/* What each op takes (index: op code; a zero entry is an unknown op). */
enum { KNOWN = 1, TAKES_T0 = 2, TAKES_T1 = 4, IS_NORM = 8, TOKEN_OP = 16 };
static const uint8_t op_rules[] = {
    [COLIBRI_OP_LINEAR] = KNOWN | TAKES_T0 | TAKES_T1,
    [COLIBRI_OP_ACTIVATION] = KNOWN,
    [COLIBRI_OP_LAYERNORM] = KNOWN | IS_NORM | TAKES_T0 | TAKES_T1,
    [COLIBRI_OP_RMSNORM] = KNOWN | IS_NORM | TAKES_T0,
    [COLIBRI_OP_RESIDUAL_PUSH] = KNOWN,
    [COLIBRI_OP_RESIDUAL_ADD] = KNOWN,
    [COLIBRI_OP_MOE] = KNOWN | TAKES_T0,
    [COLIBRI_OP_EMBED] = KNOWN | TAKES_T0 | TOKEN_OP,
    [COLIBRI_OP_ATTENTION] = KNOWN | TAKES_T0 | TOKEN_OP,
};

/* A layer's own fields, against the current width. The token-model ops
 * exist in token models only (colibri_token_model): elsewhere they are unknown. */
static colibri_status check_layer_fields(const colibri_layer *l, uint32_t width, int token_model)
{
    unsigned rules = l->op < sizeof op_rules ? op_rules[l->op] : 0u;
    if ((rules & TOKEN_OP) && !token_model)
        rules = 0;
    const uint32_t int8_flags = COLIBRI_LAYER_FLAG_INT8_ACT | COLIBRI_LAYER_FLAG_INT8_BLOCKS;
    if (!(rules & KNOWN) || l->reserved_set || (l->flags & ~int8_flags) ||
        ((l->flags & int8_flags) && l->op != COLIBRI_OP_LINEAR) || (l->flags & int8_flags) == int8_flags ||
        (l->op == COLIBRI_OP_ACTIVATION ? !is_activation(l->kind) : l->kind != 0))
        return COLIBRI_E_BAD_LAYER;
    if (l->in_features != width)
        return COLIBRI_E_BAD_LAYER;
    /* Only LINEAR and EMBED change the width; their out_features is checked
     * by the weight's shape. */
    if (l->op != COLIBRI_OP_LINEAR && l->op != COLIBRI_OP_EMBED && l->out_features != l->in_features)
        return COLIBRI_E_BAD_LAYER;
    if ((rules & IS_NORM) ? !(isfinite(l->eps) && l->eps > 0.0f) : l->eps != 0.0f)
        return COLIBRI_E_BAD_LAYER;
    if ((!(rules & TAKES_T0) && l->t0 != COLIBRI_NONE) || (!(rules & TAKES_T1) && l->t1 != COLIBRI_NONE))
        return COLIBRI_E_BAD_LAYER;
    return COLIBRI_OK;
}

static colibri_status check_program(checker *c)
{
    const colibri_header *h = c->h;
    colibri_model *m = c->m;
    uint32_t width = h->input_size;
    uint32_t stack[COLIBRI_MAX_RESIDUAL_DEPTH]; /* widths pushed */
    uint32_t depth = 0;
    colibri_status st;
    const int token = colibri_token_model(h);

    m->width = width;
    for (uint32_t i = 0; i < h->layer_count; i++) {
        colibri_layer l;
        c->work++;
        colibri_read_layer(c->image, h, i, &l);
        if ((st = check_layer_fields(&l, width, token)) != COLIBRI_OK)
            return st;
        /* A token model starts with its EMBED layer, its only one. */
        if (token && (i == 0) != (l.op == COLIBRI_OP_EMBED))
            return COLIBRI_E_BAD_LAYER;

        const uint32_t in = l.in_features, out = l.out_features;
        switch (l.op) {
        case COLIBRI_OP_LINEAR:
            if ((st = check_matmul(c, l.t0, REQUIRED, out, in)) != COLIBRI_OK ||
                (st = check_vector(c, l.t1, OPTIONAL, out)) != COLIBRI_OK)
                return st;
            if (l.flags & (COLIBRI_LAYER_FLAG_INT8_ACT | COLIBRI_LAYER_FLAG_INT8_BLOCKS)) {
                if (!is_int(c, l.t0))
                    return COLIBRI_E_BAD_LAYER;
                widen(&m->qwidth, in);
                if (l.flags & COLIBRI_LAYER_FLAG_INT8_BLOCKS)
                    widen(&m->qblocks, (uint32_t)colibri_act_blocks(in));
            }
            break;
        case COLIBRI_OP_LAYERNORM:
        case COLIBRI_OP_RMSNORM: /* RMSNORM's t1 is NONE (checked above) */
            if ((st = check_vector(c, l.t0, OPTIONAL, in)) != COLIBRI_OK ||
                (st = check_vector(c, l.t1, OPTIONAL, in)) != COLIBRI_OK)
                return st;
            break;
        case COLIBRI_OP_RESIDUAL_PUSH:
            if (depth == COLIBRI_MAX_RESIDUAL_DEPTH)
                return COLIBRI_E_BAD_LAYER;
            stack[depth++] = width;
            if (depth > m->depth)
                m->depth = depth;
            break;
        case COLIBRI_OP_RESIDUAL_ADD:
            if (depth == 0 || stack[depth - 1] != width)
                return COLIBRI_E_BAD_LAYER;
            depth--;
            break;
        case COLIBRI_OP_EMBED: /* the table [vocab, d_model], read in place */
            if ((st = check_matrix(c, l.t0, REQUIRED, in, out)) != COLIBRI_OK)
                return st;
            /* An int8 table's rows are Q·s + E: a companion bias (one per
             * row, a LINEAR's output bias) has no meaning for a row lookup. */
            if (is_i8(c, l.t0) && has_q8_bias(c, l.t0))
                return COLIBRI_E_BAD_REF;
            m->vocab = in;
            break;
        case COLIBRI_OP_ATTENTION:
            /* An attention record belongs to one ATTENTION layer, as MoE records. */
            if (l.t0 >= h->attention_count || l.t0 < c->next_attention)
                return COLIBRI_E_BAD_REF;
            if ((st = check_attention(c, l.t0, in)) != COLIBRI_OK)
                return st;
            break;
        case COLIBRI_OP_MOE:
            /* A MoE record belongs to one MOE layer: the layers name records
             * in increasing order. */
            if (l.t0 >= h->moe_count || l.t0 < c->next_moe)
                return COLIBRI_E_BAD_REF;
            if ((st = check_moe(c, l.t0, in)) != COLIBRI_OK)
                return st;
            break;
        default: /* ACTIVATION: nothing beyond its fields */
            break;
        }
        width = out;
        if (width > m->width)
            m->width = width;
    }
    /* A token model attends: without ATTENTION it has no sequence to run over. */
    if (depth != 0 || (token && m->attn_layers == 0) || width != h->output_size)
        return COLIBRI_E_BAD_LAYER;
    return COLIBRI_OK;
}

/* ---- The tokenizer section (format v6, docs/lm.md "Tokenizer section") ---- */

uint32_t colibri_utf8_lead(uint8_t lead, uint8_t *lo, uint8_t *hi)
{
    *lo = 0x80u;
    *hi = 0xBFu;
    if (lead < 0x80u)
        return 1;
    if (lead >= 0xC2u && lead <= 0xDFu)
        return 2;
    if (lead >= 0xE0u && lead <= 0xEFu) {
        *lo = lead == 0xE0u ? 0xA0u : 0x80u;
        *hi = lead == 0xEDu ? 0x9Fu : 0xBFu;
        return 3;
    }
    if (lead >= 0xF0u && lead <= 0xF4u) {
        *lo = lead == 0xF0u ? 0x90u : 0x80u;
        *hi = lead == 0xF4u ? 0x8Fu : 0xBFu;
        return 4;
    }
    return 0;
}

uint32_t colibri_utf8_sequence(const uint8_t *p, size_t n)
{
    uint8_t lo, hi;
    const uint32_t len = colibri_utf8_lead(p[0], &lo, &hi);
    if (len <= 1)
        return len;
    if (n < len || p[1] < lo || p[1] > hi)
        return 0;
    for (uint32_t i = 2; i < len; i++)
        if (p[i] < 0x80u || p[i] > 0xBFu)
            return 0;
    return len;
}

/* An array of `size` bytes at section offset `at`: offset 0 when empty,
 * else 4-aligned, after the header, inside the section. */
static int section_array_ok(uint32_t at, uint64_t size, uint32_t section)
{
    if (size == 0)
        return at == 0;
    return at % 4u == 0 && at >= COLIBRI_TOKENIZER_HEADER_SIZE && (uint64_t)at + size <= section;
}

colibri_status colibri_tokenizer_check(const uint8_t *p, uint32_t size, uint32_t vocab, uint64_t *work)
{
    if (size < COLIBRI_TOKENIZER_HEADER_SIZE)
        return COLIBRI_E_BAD_TOKENIZER;
    (*work)++;
    const uint32_t kind = p[6], flags = p[7], count = colibri_rd_u32(p + 8), merges = colibri_rd_u32(p + 12);
    const uint32_t normalizer = p[32], pre = p[33];
    const uint32_t offsets_at = colibri_rd_u32(p + 36), bytes_at = colibri_rd_u32(p + 40),
                   bytes_size = colibri_rd_u32(p + 44), types_at = colibri_rd_u32(p + 48),
                   scores_at = colibri_rd_u32(p + 52), merges_at = colibri_rd_u32(p + 56),
                   order_at = colibri_rd_u32(p + 60), byte_ids_at = colibri_rd_u32(p + 64),
                   pattern_at = colibri_rd_u32(p + 68), pattern_size = colibri_rd_u32(p + 72),
                   index_at = colibri_rd_u32(p + 76);
    const uint32_t version = colibri_rd_u16(p + 4);
    if (colibri_rd_u32(p) != COLIBRI_TOKENIZER_MAGIC || version < COLIBRI_TOKENIZER_SECTION_VERSION_MIN ||
        version > COLIBRI_TOKENIZER_SECTION_VERSION)
        return COLIBRI_E_BAD_TOKENIZER;
    const int indexed = version >= COLIBRI_TOKENIZER_INDEX_VERSION;
    const int sp = kind == COLIBRI_TOKENIZER_SENTENCEPIECE_BPE || kind == COLIBRI_TOKENIZER_SENTENCEPIECE_UNIGRAM;
    if (!sp && kind != COLIBRI_TOKENIZER_BYTE_BPE)
        return COLIBRI_E_BAD_TOKENIZER;
    const uint32_t allowed =
        sp ? COLIBRI_TOKENIZER_FLAG_ADD_DUMMY_PREFIX | COLIBRI_TOKENIZER_FLAG_BYTE_FALLBACK |
                 COLIBRI_TOKENIZER_FLAG_REMOVE_EXTRA_WHITESPACES
           : COLIBRI_TOKENIZER_FLAG_ADD_PREFIX_SPACE | COLIBRI_TOKENIZER_FLAG_IGNORE_MERGES;
    if (flags & ~allowed)
        return COLIBRI_E_BAD_TOKENIZER;
    if (sp ? (normalizer != COLIBRI_NORMALIZER_NONE || pre != COLIBRI_PRE_TOKENIZER_NONE)
           : (normalizer > COLIBRI_NORMALIZER_NFC ||
              (pre != COLIBRI_PRE_TOKENIZER_BYTE_LEVEL && pre != COLIBRI_PRE_TOKENIZER_SPLIT_BYTE_LEVEL)))
        return COLIBRI_E_BAD_TOKENIZER;
    if (colibri_rd_u16(p + 34) != 0 || (!indexed && index_at != 0))
        return COLIBRI_E_BAD_TOKENIZER;
    if (count != vocab)
        return COLIBRI_E_BAD_TOKENIZER;
    for (uint32_t s = 16; s < 32; s += 4) { /* bos, eos, pad, unk */
        const uint32_t id = colibri_rd_u32(p + s);
        if (id != COLIBRI_NONE && id >= count)
            return COLIBRI_E_BAD_TOKENIZER;
    }
    if ((sp && merges != 0) || ((pattern_size != 0) != (pre == COLIBRI_PRE_TOKENIZER_SPLIT_BYTE_LEVEL)))
        return COLIBRI_E_BAD_TOKENIZER;
    if (!section_array_ok(offsets_at, 4u * ((uint64_t)count + 1u), size) ||
        !section_array_ok(bytes_at, bytes_size, size) || !section_array_ok(types_at, count, size) ||
        !section_array_ok(scores_at, sp ? 4u * (uint64_t)count : 0u, size) ||
        !section_array_ok(merges_at, 12u * (uint64_t)merges, size) ||
        !section_array_ok(order_at, 4u * (uint64_t)merges, size) ||
        !section_array_ok(byte_ids_at, 4u * COLIBRI_TOKENIZER_BYTE_IDS, size) ||
        !section_array_ok(pattern_at, pattern_size, size) ||
        !section_array_ok(index_at, indexed ? 4u * (uint64_t)count : 0u, size))
        return COLIBRI_E_BAD_TOKENIZER;

    const uint8_t *offsets = p + offsets_at, *types = p + types_at, *blob = p + bytes_at;
    *work += (uint64_t)count + 1u;
    if (colibri_rd_u32(offsets) != 0 || colibri_rd_u32(offsets + 4u * (size_t)count) != bytes_size)
        return COLIBRI_E_BAD_TOKENIZER;
    for (uint32_t i = 0; i < count; i++)
        if (colibri_rd_u32(offsets + 4u * (size_t)i + 4u) < colibri_rd_u32(offsets + 4u * (size_t)i))
            return COLIBRI_E_BAD_TOKENIZER;
    *work += count;
    for (uint32_t i = 0; i < count; i++)
        if (types[i] < COLIBRI_TOKEN_NORMAL || types[i] > COLIBRI_TOKEN_UNUSED)
            return COLIBRI_E_BAD_TOKENIZER;
    const int fallback = sp && (flags & COLIBRI_TOKENIZER_FLAG_BYTE_FALLBACK);
    for (uint32_t i = 0; i < count; i++)
        if (types[i] == COLIBRI_TOKEN_BYTE && !fallback)
            return COLIBRI_E_BAD_TOKENIZER;
    for (uint32_t i = 0; i < count; i++)
        if (types[i] == COLIBRI_TOKEN_BYTE &&
            colibri_rd_u32(offsets + 4u * (size_t)i + 4u) - colibri_rd_u32(offsets + 4u * (size_t)i) != 1u)
            return COLIBRI_E_BAD_TOKENIZER;
    if (sp) {
        *work += count;
        for (uint32_t i = 0; i < count; i++)
            if (!isfinite(colibri_rd_f32(p + scores_at + 4u * (size_t)i)))
                return COLIBRI_E_BAD_TOKENIZER;
    }
    if (merges != 0) {
        *work += 2u * (uint64_t)merges;
        for (uint64_t i = 0; i < 3u * (uint64_t)merges; i++)
            if (colibri_rd_u32(p + merges_at + 4u * (size_t)i) >= count)
                return COLIBRI_E_BAD_TOKENIZER;
        for (uint32_t i = 0; i < merges; i++)
            if (colibri_rd_u32(p + order_at + 4u * (size_t)i) >= merges)
                return COLIBRI_E_BAD_TOKENIZER;
        /* Strictly increasing pairs: the order is a permutation, and a pair
         * has one merge (what the encoder's binary search needs). */
        uint64_t prev = 0;
        for (uint32_t i = 0; i < merges; i++) {
            const uint8_t *rec = p + merges_at + 12u * (size_t)colibri_rd_u32(p + order_at + 4u * (size_t)i);
            const uint64_t key = (uint64_t)colibri_rd_u32(rec) << 32 | colibri_rd_u32(rec + 4);
            if (i > 0 && key <= prev)
                return COLIBRI_E_BAD_TOKENIZER;
            prev = key;
        }
    }
    *work += COLIBRI_TOKENIZER_BYTE_IDS;
    for (uint32_t b = 0; b < COLIBRI_TOKENIZER_BYTE_IDS; b++) {
        const uint32_t id = colibri_rd_u32(p + byte_ids_at + 4u * b);
        if (sp && !fallback) {
            if (id != COLIBRI_NONE)
                return COLIBRI_E_BAD_TOKENIZER;
            continue;
        }
        if (id >= count)
            return COLIBRI_E_BAD_TOKENIZER;
        const uint32_t start = colibri_rd_u32(offsets + 4u * (size_t)id);
        if (colibri_rd_u32(offsets + 4u * (size_t)id + 4u) - start != 1u || blob[start] != b ||
            (sp && types[id] != COLIBRI_TOKEN_BYTE))
            return COLIBRI_E_BAD_TOKENIZER;
    }
    if (pattern_size != 0) {
        (*work)++;
        for (uint32_t at = 0; at < pattern_size;) {
            const uint32_t len = colibri_utf8_sequence(p + pattern_at + at, pattern_size - at);
            if (len == 0)
                return COLIBRI_E_BAD_TOKENIZER;
            at += len;
        }
    }
    if (indexed && count != 0) {
        /* Strictly increasing by (bytes, id): a permutation, in the order
         * the encoder's binary search needs. */
        *work += count;
        for (uint32_t i = 0; i < count; i++)
            if (colibri_rd_u32(p + index_at + 4u * (size_t)i) >= count)
                return COLIBRI_E_BAD_TOKENIZER;
        for (uint32_t i = 1; i < count; i++) {
            const uint32_t a = colibri_rd_u32(p + index_at + 4u * (size_t)i - 4u);
            const uint32_t b = colibri_rd_u32(p + index_at + 4u * (size_t)i);
            const uint32_t a_at = colibri_rd_u32(offsets + 4u * (size_t)a), b_at = colibri_rd_u32(offsets + 4u * (size_t)b);
            const uint32_t a_len = colibri_rd_u32(offsets + 4u * (size_t)a + 4u) - a_at;
            const uint32_t b_len = colibri_rd_u32(offsets + 4u * (size_t)b + 4u) - b_at;
            const int order = colibri_bytes_compare(blob + a_at, a_len, blob + b_at, b_len);
            if (order > 0 || (order == 0 && a >= b))
                return COLIBRI_E_BAD_TOKENIZER;
        }
    }
    return COLIBRI_OK;
}

/* ---- Everything, in order ---- */

colibri_status colibri_check_level(const void *image, size_t image_len, colibri_model *m, uint64_t *work,
                                   uint32_t level)
{
    const uint8_t *p = image;
    const colibri_header *h = &m->hdr;
    checker c = {.image = p, .h = h, .m = m};
    colibri_status st;

    *work = 0;
    if (!image)
        return COLIBRI_E_NULL_ARG;
    if (image_len < COLIBRI_HEADER_SIZE)
        return COLIBRI_E_TRUNCATED;
    memset(m, 0, sizeof *m);
    colibri_read_header(p, &m->hdr);
    if ((st = check_header(p, image_len, &m->hdr)) != COLIBRI_OK)
        return st;
    const uint32_t tensor_record = h->version >= COLIBRI_WIDE_VERSION ? COLIBRI_TENSOR_WIDE_SIZE : COLIBRI_TENSOR_SIZE;
    if (!table_ok(h, h->tensor_offset, h->tensor_count, tensor_record) ||
        !table_ok(h, h->layer_offset, h->layer_count, COLIBRI_LAYER_SIZE) ||
        !table_ok(h, h->moe_offset, h->moe_count, COLIBRI_MOE_SIZE) ||
        !table_ok(h, h->expert_offset, h->expert_count, COLIBRI_EXPERT_SIZE) ||
        (h->version >= COLIBRI_TENSOR_CRC_VERSION && !table_ok(h, h->crc_offset, h->tensor_count, 4u)) ||
        (h->version >= COLIBRI_LM_VERSION &&
         !table_ok(h, h->attention_offset, h->attention_count, COLIBRI_ATTENTION_SIZE)))
        return COLIBRI_E_TABLE_BOUNDS;

    /* Pass 1: every tensor record on its own, payloads in table order. */
    uint64_t prev_end = 0;
    for (uint32_t i = 0; i < h->tensor_count; i++) {
        colibri_tensor t;
        read_tensor(&c, i, &t);
        if ((st = check_tensor(p, h, &t, prev_end, i, level)) != COLIBRI_OK)
            break;
        prev_end = (uint64_t)t.offset + t.nbytes;
        if (t.dtype == COLIBRI_DTYPE_TOKENIZER) { /* one, in a token model */
            if (!colibri_token_model(h) || m->tokenizer != 0) {
                st = COLIBRI_E_BAD_TENSOR;
                break;
            }
            m->tokenizer = i + 1u;
        }
        if (t.dtype == COLIBRI_DTYPE_F32 || t.dtype == COLIBRI_DTYPE_F16 || t.dtype == COLIBRI_DTYPE_I8 ||
            t.dtype == COLIBRI_DTYPE_I4)
            m->parameters += (uint64_t)t.rows * t.cols;
        /* A bias held in its weight's companion (v2 Q8_PARAMS, Q4_PARAMS: BIAS) is a parameter as an
         * F32 bias tensor is, so the count is the same whatever the dtype. */
        else if ((t.dtype == COLIBRI_DTYPE_Q8_PARAMS && h->version >= 2u &&
                  (p[(size_t)t.offset + 5u] & COLIBRI_Q8_FLAG_BIAS)) ||
                 (t.dtype == COLIBRI_DTYPE_Q4_PARAMS && (p[(size_t)t.offset + 5u] & COLIBRI_Q4_FLAG_BIAS)))
            m->parameters += t.rows;
    }
    /* Pass 2: every I8 and I4 tensor's companion, in index order. */
    for (uint32_t i = 0; st == COLIBRI_OK && i < h->tensor_count; i++) {
        colibri_tensor t;
        read_tensor(&c, i, &t);
        if (t.dtype == COLIBRI_DTYPE_I8)
            st = check_quant(&c, &t);
        else if (t.dtype == COLIBRI_DTYPE_I4)
            st = check_q4(&c, &t);
    }
    if (st == COLIBRI_OK)
        st = check_program(&c);
    if (st == COLIBRI_OK && m->tokenizer != 0) {
        colibri_tensor t;
        read_tensor(&c, m->tokenizer - 1u, &t);
        /* nbytes == rows (a u32) was checked with the tensor record */
        st = colibri_tokenizer_check(p + t.offset, (uint32_t)t.nbytes, h->input_size, &c.work);
    }
    *work = c.work;
    return st;
}

colibri_status colibri_check_work(const void *image, size_t image_len, colibri_model *m, uint64_t *work)
{
    return colibri_check_level(image, image_len, m, work, COLIBRI_CHECK_FULL);
}

colibri_status colibri_check(const void *image, size_t image_len, colibri_model *m)
{
    uint64_t work;
    return colibri_check_work(image, image_len, m, &work);
}

colibri_status colibri_validate(const void *image, size_t image_len)
{
    colibri_model m;
    return colibri_check(image, image_len, &m);
}

colibri_status colibri_validate_ex(const void *image, size_t image_len, uint32_t level)
{
    colibri_model m;
    uint64_t work;
    if (level != COLIBRI_CHECK_FULL && level != COLIBRI_CHECK_STRUCTURE)
        return COLIBRI_E_UNSUPPORTED;
    return colibri_check_level(image, image_len, &m, &work, level);
}
