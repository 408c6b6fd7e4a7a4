/*
 * `colibri`: the Colibri engine as a MicroPython module.
 *
 *   import colibri
 *   from array import array
 *   m = colibri.Model(open("model.clb", "rb").read())   # or a memoryview of flash
 *   x = array("f", [0.0] * (2 * m.input_size))           # a batch of 2 tokens
 *   y = array("f", [0.0] * (2 * m.output_size))
 *   m.forward(x, y)                                     # or colibri.forward(m, x, y)
 *
 *   lm = colibri.LM(open("lm.clb", "rb").read())        # a token model (docs/lm.md)
 *   lm.generate(b"Once", 32, temperature=0.8, seed=1)   # new ids; out=bytearray(32) allocates nothing
 *   lm.forward_tokens([1, 2], logits)                   # logits: array('f') of 2 * lm.vocab_size
 *
 * One source, two builds:
 *  - a native module (colibri.mpy, `colibri natmod build`), compiled with
 *    -DMICROPY_ENABLE_DYNRUNTIME against natmod/mp_natmod.h;
 *  - a user C module compiled into a firmware (micropython.mk /
 *    micropython.cmake), against MicroPython's own py/ headers.
 * Everything but the registration of the names (the two blocks at the end)
 * is shared, and written with MicroPython's own API names, which the native
 * module header provides too.
 *
 * Memory: Model() reads the image in place (zero copy: the buffer object is
 * referenced so it stays alive) and makes one allocation, the engine's arena,
 * besides the Model object itself (LM: the arena block also holds its token
 * and logit rows). forward() allocates nothing, nor do LM's calls given
 * their output buffers. A bytearray
 * holding the image must not be changed while a Model uses it; resizing it
 * moves the bytes, which forward() detects and refuses.
 *
 * That check re-reads the buffer of the object the Model references, so it
 * only works for objects that own their bytes. Read-only buffers (bytes, a
 * memoryview of bytes or of ROM) cannot move; bytearray and array own their
 * bytes. A writable memoryview (of a bytearray or array) keeps the address it
 * saw at creation and no reference to its base object, so a resize of the
 * base is invisible through it: Model() refuses those, and any other writable
 * buffer type it cannot re-check.
 */
#if defined(MICROPY_ENABLE_DYNRUNTIME) && MICROPY_ENABLE_DYNRUNTIME
#include "mp_natmod.h"
#else
#include "py/obj.h"
#include "py/runtime.h"
#endif

#include "colibri.h"
#include "colibri_tokenizer.h"

/* ---- Per-build declarations used by the shared code ---- */

#if defined(MICROPY_ENABLE_DYNRUNTIME) && MICROPY_ENABLE_DYNRUNTIME
extern mp_obj_full_type_t colibri_type_Model; /* in .bss, filled in by mpy_init */
#define MODEL_TYPE ((const mp_obj_type_t *)&colibri_type_Model)
/* The message is copied into the exception (it may be on the stack). */
#define RAISE(exc_type, text) mp_raise_msg_str(&(exc_type), (text))
#define GET_FLOAT(obj) mp_obj_get_float_to_f(obj)
#else
extern const mp_obj_type_t colibri_type_Model;
#define MODEL_TYPE (&colibri_type_Model)
#define RAISE(exc_type, text) mp_raise_msg_varg(&(exc_type), MP_ERROR_TEXT("%s"), (text))
#define GET_FLOAT(obj) ((float)mp_obj_get_float(obj))
#endif

/* ---- Error messages, built on the stack (no allocation until the raise) ---- */

typedef struct message {
    char text[200];
    size_t len;
} message;

static void msg_add(message *m, const char *s)
{
    while (*s && m->len + 1 < sizeof m->text)
        m->text[m->len++] = *s++;
    m->text[m->len] = '\0';
}

static void msg_add_uint(message *m, size_t value)
{
    char digits[24];
    size_t n = 0;
    do {
        digits[n++] = (char)('0' + value % 10u);
        value /= 10u;
    } while (value);
    while (n) {
        const char one[2] = {digits[--n], '\0'};
        msg_add(m, one);
    }
}

/* "colibri: <the engine's text for status>", then the caller adds details. */
static void msg_status(message *m, colibri_status status)
{
    m->len = 0;
    msg_add(m, "colibri: ");
    msg_add(m, colibri_strerror(status));
}

NORETURN static void raise_status(colibri_status status)
{
    message m;
    msg_status(&m, status);
    RAISE(mp_type_ValueError, m.text);
}

/* ---- colibri.Model ---- */

/* What Model and LM share: the image they read in place and the engine context. */
typedef struct engine_ref {
    mp_obj_t image;       /* the caller's buffer object: referenced so the weights stay alive */
    const void *image_buf; /* where its bytes were at construction: a resized bytearray moves them */
    size_t image_len;
    void *arena;          /* the heap block holding ctx (the GC follows block starts only) */
    colibri_ctx *ctx;     /* inside arena */
    size_t arena_size;    /* bytes the engine asked for */
} engine_ref;

typedef struct colibri_model_obj {
    mp_obj_base_t base;
    engine_ref engine;
    uint32_t input_size, output_size, max_batch, num_experts;
} colibri_model_obj;

/* bytearray and array: forward() re-reads their buffer, so a resize that moved
 * the bytes is caught. Compared by type name, which both builds have whether
 * or not the port enables memoryview. */
static bool owns_its_bytes(mp_obj_t obj)
{
    const qstr name = mp_obj_get_type(obj)->name;
    return name == MP_QSTR_bytearray || name == MP_QSTR_array;
}

/* Checks the image buffer, validates the image (everything before any
 * allocation) and fills *info. `who` names the class in messages. */
static mp_buffer_info_t image_buffer(size_t n_args, size_t n_kw, const mp_obj_t *args, const char *usage,
                                     const char *not_a_buffer, const char *writable_view,
                                     colibri_model_info *info)
{
    if (n_args != 1 || n_kw != 0)
        RAISE(mp_type_TypeError, usage);
    /* str has the buffer protocol too, but a path is not an image */
    mp_buffer_info_t image;
    if (mp_obj_get_type(args[0]) == &mp_type_str || !mp_get_buffer(args[0], &image, MP_BUFFER_READ))
        RAISE(mp_type_TypeError, not_a_buffer);

    colibri_status status = colibri_get_info(image.buf, image.len, info);
    if (status != COLIBRI_OK)
        raise_status(status);
    if ((uintptr_t)image.buf % 4u != 0) {
        message m;
        msg_status(&m, COLIBRI_E_IMAGE_ALIGN);
        msg_add(&m, " (this buffer starts at an address ");
        msg_add_uint(&m, (uintptr_t)image.buf % 4u);
        msg_add(&m, " mod 4; bytes(buffer) makes an aligned copy)");
        RAISE(mp_type_ValueError, m.text);
    }

    mp_buffer_info_t writable;
    if (mp_get_buffer(args[0], &writable, MP_BUFFER_WRITE) && !owns_its_bytes(args[0]))
        RAISE(mp_type_TypeError, writable_view);
    return image;
}

/* Allocates the object (obj_size bytes, an engine_ref at engine_offset) and
 * one block holding the arena and then `extra` bytes (8-byte aligned, at
 * *extra_out), and builds the context. The two allocations are the only ones
 * an object ever makes. */
static void *open_engine(mp_obj_t image_obj, const mp_buffer_info_t *image, const colibri_model_info *info,
                         size_t obj_size, size_t engine_offset, size_t extra, void **extra_out)
{
    const size_t arena_end = (info->arena_size + 7u) & ~(size_t)7u;
    const size_t block = arena_end + extra + COLIBRI_ARENA_ALIGN - 1;
    void *self = block > extra ? m_malloc_maybe(obj_size) : NULL;
    /* Over-allocated so the arena can start on COLIBRI_ARENA_ALIGN whatever the heap's block size. */
    void *arena = self ? m_malloc_maybe(block) : NULL;
    if (!arena) {
        message m;
        m.len = 0;
        msg_add(&m, "colibri: cannot allocate the model's arena (");
        msg_add_uint(&m, info->arena_size);
        msg_add(&m, " bytes");
        if (extra) {
            msg_add(&m, " + ");
            msg_add_uint(&m, extra);
            msg_add(&m, " for token and logit rows");
        }
        msg_add(&m, ")");
        RAISE(mp_type_MemoryError, m.text);
    }
    void *aligned = (void *)(((uintptr_t)arena + COLIBRI_ARENA_ALIGN - 1) & ~(uintptr_t)(COLIBRI_ARENA_ALIGN - 1));

    colibri_ctx *ctx;
    const colibri_status status = colibri_init(&ctx, aligned, info->arena_size, image->buf, image->len);
    if (status != COLIBRI_OK)
        raise_status(status);

    engine_ref *ref = (engine_ref *)((char *)self + engine_offset);
    ref->image = image_obj;
    ref->image_buf = image->buf;
    ref->image_len = image->len;
    ref->arena = arena;
    ref->ctx = ctx;
    ref->arena_size = info->arena_size;
    if (extra_out)
        *extra_out = (char *)aligned + arena_end;
    return self;
}

/* The engine reads the weights in place: if the caller resized a bytearray
 * under the object, its bytes moved and the context points at freed memory. */
static void check_image_in_place(const engine_ref *ref, const char *text)
{
    mp_buffer_info_t image;
    if (!mp_get_buffer(ref->image, &image, MP_BUFFER_READ) || image.buf != ref->image_buf ||
        image.len < ref->image_len)
        RAISE(mp_type_ValueError, text);
}

static mp_obj_t model_make_new(const mp_obj_type_t *type, size_t n_args, size_t n_kw, const mp_obj_t *args)
{
    colibri_model_info info;
    const mp_buffer_info_t image = image_buffer(
        n_args, n_kw, args,
        "colibri.Model(image) takes one argument: the model image (bytes, bytearray or memoryview)",
        "colibri.Model: the model image must be bytes, bytearray or memoryview "
        "(read the file first: open(path, 'rb').read())",
        "colibri.Model: a writable memoryview (or other view) cannot be guarded: "
        "resizing its bytearray would free the weights under the model; pass the bytearray itself, or bytes(view)",
        &info);
    if (info.vocab_size) {
        message m;
        msg_status(&m, COLIBRI_E_MODEL_KIND);
        msg_add(&m, " (a token model, token ids in and logits out: open it with colibri.LM)");
        RAISE(mp_type_ValueError, m.text);
    }
    colibri_model_obj *self = open_engine(args[0], &image, &info, sizeof(colibri_model_obj),
                                          offsetof(colibri_model_obj, engine), 0, NULL);
    self->base.type = type;
    self->input_size = info.input_size;
    self->output_size = info.output_size;
    self->max_batch = info.max_batch;
    self->num_experts = info.num_experts;
    return MP_OBJ_FROM_PTR(self);
}

static void model_print(const mp_print_t *print, mp_obj_t self_in, mp_print_kind_t kind)
{
    (void)kind;
    const colibri_model_obj *self = MP_OBJ_TO_PTR(self_in);
    mp_printf(print, "<colibri.Model input_size=%u output_size=%u num_experts=%u max_batch=%u arena_size=%u>",
              (unsigned)self->input_size, (unsigned)self->output_size, (unsigned)self->num_experts,
              (unsigned)self->max_batch, (unsigned)self->engine.arena_size);
}

/* The int attributes (read-only); anything else goes on to locals_dict (forward). */
static void model_attr(mp_obj_t self_in, qstr attr, mp_obj_t *dest)
{
    if (dest[0] != MP_OBJ_NULL)
        return; /* store or delete: not handled, so AttributeError */
    const colibri_model_obj *self = MP_OBJ_TO_PTR(self_in);
    size_t value;
    if (attr == MP_QSTR_input_size)
        value = self->input_size;
    else if (attr == MP_QSTR_output_size)
        value = self->output_size;
    else if (attr == MP_QSTR_max_batch)
        value = self->max_batch;
    else if (attr == MP_QSTR_num_experts)
        value = self->num_experts;
    else if (attr == MP_QSTR_arena_size)
        value = self->engine.arena_size;
    else {
        dest[1] = MP_OBJ_SENTINEL;
        return;
    }
    dest[0] = mp_obj_new_int_from_uint(value);
}

/* ---- forward(model, input, output) ---- */

/* An array('f') (or a memoryview of one): float32 elements, 4-byte aligned. */
static size_t float_array(mp_obj_t obj, mp_buffer_info_t *info, mp_uint_t flags, const char *type_error)
{
    if (!mp_get_buffer(obj, info, flags) || info->typecode != 'f')
        RAISE(mp_type_TypeError, type_error);
    if ((uintptr_t)info->buf % 4u != 0)
        RAISE(mp_type_ValueError, "colibri.forward: the float array is not 4-byte aligned");
    return info->len / 4u;
}

/* Batch from the lengths: len(input) = batch · input_size, len(output) = batch · output_size. */
static mp_obj_t colibri_mp_forward(mp_obj_t model_in, mp_obj_t input_in, mp_obj_t output_in)
{
    if (mp_obj_get_type(model_in) != MODEL_TYPE)
        RAISE(mp_type_TypeError, "colibri.forward(model, input, output): model must be a colibri.Model");
    const colibri_model_obj *model = MP_OBJ_TO_PTR(model_in);
    mp_buffer_info_t in, out;
    const size_t n_in = float_array(input_in, &in, MP_BUFFER_READ,
                                    "colibri.forward: the input must be an array('f') (float32)");
    const size_t n_out = float_array(output_in, &out, MP_BUFFER_WRITE,
                                     "colibri.forward: the output must be a writable array('f') (float32)");

    message m;
    if (n_in == 0 || n_in % model->input_size != 0) {
        msg_status(&m, COLIBRI_E_BUFFER_SIZE);
        msg_add(&m, ": len(input) = ");
        msg_add_uint(&m, n_in);
        msg_add(&m, " is not a positive multiple of input_size ");
        msg_add_uint(&m, model->input_size);
        RAISE(mp_type_ValueError, m.text);
    }
    check_image_in_place(&model->engine,
                         "colibri.forward: the model image buffer moved or shrank since colibri.Model() "
                         "(was a bytearray resized?); build a new colibri.Model");
    const size_t batch = n_in / model->input_size;
    if (batch > model->max_batch) {
        msg_status(&m, COLIBRI_E_BAD_BATCH);
        msg_add(&m, ": len(input) = ");
        msg_add_uint(&m, n_in);
        msg_add(&m, " is a batch of ");
        msg_add_uint(&m, batch);
        msg_add(&m, ", max_batch is ");
        msg_add_uint(&m, model->max_batch);
        RAISE(mp_type_ValueError, m.text);
    }
    if (n_out != batch * model->output_size) {
        msg_status(&m, COLIBRI_E_BUFFER_SIZE);
        msg_add(&m, ": len(output) = ");
        msg_add_uint(&m, n_out);
        msg_add(&m, ", a batch of ");
        msg_add_uint(&m, batch);
        msg_add(&m, " needs ");
        msg_add_uint(&m, batch * model->output_size);
        RAISE(mp_type_ValueError, m.text);
    }
    const colibri_status status = colibri_forward(model->engine.ctx, batch, in.buf, n_in, out.buf, n_out);
    if (status != COLIBRI_OK)
        raise_status(status);
    return mp_const_none;
}

static mp_obj_t colibri_mp_version(void)
{
    const char *v = colibri_version();
    size_t len = 0;
    while (v[len])
        len++;
    return mp_obj_new_str(v, len);
}

/* ---- colibri.LM: token models (docs/lm.md) ----
 *
 * The arena block also holds max_batch token ids and max_batch rows of
 * logits: the prompt is fed in chunks of max_batch, as the host's LM does, so
 * the logits are the same bits, and generate() samples from those rows. Once
 * constructed, forward_tokens(ids, out) and generate(..., out=buf) allocate
 * nothing. */

typedef struct colibri_lm_obj {
    mp_obj_base_t base;
    engine_ref engine;
    int32_t *tokens;  /* [max_batch], after the arena */
    float *logits;    /* [max_batch * vocab_size], after tokens */
    uint32_t vocab_size, max_seq_len, max_batch;
    size_t kv_cache_bytes;
    colibri_status tokenizer_status; /* COLIBRI_OK: `tok` reads the image's tokenizer section */
    colibri_tokenizer tok;
} colibri_lm_obj;

#if defined(MICROPY_ENABLE_DYNRUNTIME) && MICROPY_ENABLE_DYNRUNTIME
extern mp_obj_full_type_t colibri_type_LM;
#define LM_TYPE ((const mp_obj_type_t *)&colibri_type_LM)
#else
extern const mp_obj_type_t colibri_type_LM;
#define LM_TYPE (&colibri_type_LM)
#endif

static mp_obj_t lm_make_new(const mp_obj_type_t *type, size_t n_args, size_t n_kw, const mp_obj_t *args)
{
    colibri_model_info info;
    const mp_buffer_info_t image = image_buffer(
        n_args, n_kw, args,
        "colibri.LM(image) takes one argument: the token model's image (bytes, bytearray or memoryview)",
        "colibri.LM: the model image must be bytes, bytearray or memoryview "
        "(read the file first: open(path, 'rb').read())",
        "colibri.LM: a writable memoryview (or other view) cannot be guarded: "
        "resizing its bytearray would free the weights under the model; pass the bytearray itself, or bytes(view)",
        &info);
    if (!info.vocab_size) {
        message m;
        msg_status(&m, COLIBRI_E_MODEL_KIND);
        msg_add(&m, " (a feature model, float rows in: open it with colibri.Model)");
        RAISE(mp_type_ValueError, m.text);
    }
    /* max_batch < 2^16 and vocab < 2^31 (the format's limits), but their product can pass a 32-bit size_t */
    const size_t rows = info.max_batch, vocab = info.vocab_size;
    if (vocab > (SIZE_MAX / 8u - 8u) / rows) {
        message m;
        m.len = 0;
        msg_add(&m, "colibri: max_batch x vocab_size logits do not fit this machine's memory");
        RAISE(mp_type_MemoryError, m.text);
    }
    const size_t token_bytes = (rows * sizeof(int32_t) + 7u) & ~(size_t)7u;
    void *extra;
    colibri_lm_obj *self = open_engine(args[0], &image, &info, sizeof(colibri_lm_obj),
                                       offsetof(colibri_lm_obj, engine),
                                       token_bytes + rows * vocab * sizeof(float), &extra);
    self->base.type = type;
    self->tokens = extra;
    self->logits = (float *)((char *)extra + token_bytes);
    self->vocab_size = info.vocab_size;
    self->max_seq_len = info.max_seq_len;
    self->max_batch = info.max_batch;
    self->kv_cache_bytes = info.kv_cache_bytes;
    self->tokenizer_status = colibri_tokenizer_open(&self->tok, image.buf, image.len);
    return MP_OBJ_FROM_PTR(self);
}

static uint32_t lm_position(const colibri_lm_obj *self)
{
    uint32_t position = 0;
    const colibri_status status = colibri_lm_position(self->engine.ctx, &position);
    if (status != COLIBRI_OK)
        raise_status(status);
    return position;
}

static void lm_print(const mp_print_t *print, mp_obj_t self_in, mp_print_kind_t kind)
{
    (void)kind;
    const colibri_lm_obj *self = MP_OBJ_TO_PTR(self_in);
    mp_printf(print, "<colibri.LM vocab_size=%u max_seq_len=%u max_batch=%u arena_size=%u kv_cache_bytes=%u position=%u>",
              (unsigned)self->vocab_size, (unsigned)self->max_seq_len, (unsigned)self->max_batch,
              (unsigned)self->engine.arena_size, (unsigned)self->kv_cache_bytes, (unsigned)lm_position(self));
}

static void lm_attr(mp_obj_t self_in, qstr attr, mp_obj_t *dest)
{
    if (dest[0] != MP_OBJ_NULL)
        return; /* store or delete: not handled, so AttributeError */
    const colibri_lm_obj *self = MP_OBJ_TO_PTR(self_in);
    size_t value;
    if (attr == MP_QSTR_vocab_size)
        value = self->vocab_size;
    else if (attr == MP_QSTR_max_seq_len)
        value = self->max_seq_len;
    else if (attr == MP_QSTR_max_batch)
        value = self->max_batch;
    else if (attr == MP_QSTR_arena_size)
        value = self->engine.arena_size;
    else if (attr == MP_QSTR_kv_cache_bytes)
        value = self->kv_cache_bytes;
    else if (attr == MP_QSTR_position)
        value = lm_position(self);
    else if (attr == MP_QSTR_eos || attr == MP_QSTR_bos) { /* None without a tokenizer or without the id */
        const int32_t id = self->tokenizer_status != COLIBRI_OK ? -1 : attr == MP_QSTR_eos ? self->tok.eos : self->tok.bos;
        dest[0] = id < 0 ? mp_const_none : MP_OBJ_NEW_SMALL_INT(id);
        return;
    } else {
        dest[1] = MP_OBJ_SENTINEL;
        return;
    }
    dest[0] = mp_obj_new_int_from_uint(value);
}

static colibri_lm_obj *lm_self(mp_obj_t obj, const char *what)
{
    if (mp_obj_get_type(obj) != LM_TYPE)
        RAISE(mp_type_TypeError, what);
    colibri_lm_obj *self = MP_OBJ_TO_PTR(obj);
    check_image_in_place(&self->engine, "colibri.LM: the model image buffer moved or shrank since colibri.LM() "
                                        "(was a bytearray resized?); build a new colibri.LM");
    return self;
}

static mp_obj_t lm_reset(mp_obj_t self_in)
{
    colibri_lm_obj *self = lm_self(self_in, "colibri.LM.reset: not a colibri.LM");
    const colibri_status status = colibri_lm_reset(self->engine.ctx);
    if (status != COLIBRI_OK)
        raise_status(status);
    return mp_const_none;
}

/* -- token id sequences: a list or tuple of ints, or an integer buffer (bytes, bytearray, array) -- */

typedef struct token_seq {
    const mp_obj_t *items; /* list or tuple items, or NULL */
    const void *buf;       /* buffer elements, when items is NULL */
    size_t len;
    size_t elem_size;
    char typecode;
} token_seq;

/* A bytearray's buffer reports typecode 1 (MicroPython's BYTEARRAY_TYPECODE): its bytes are 'B'. */
#ifndef BYTEARRAY_TYPECODE
#define BYTEARRAY_TYPECODE 1
#endif

/* Bytes per element of the integer array typecodes a token id fits; 0 for any other. */
static size_t int_typecode_size(int typecode)
{
    switch (typecode == BYTEARRAY_TYPECODE ? 'B' : typecode) {
    case 'b': case 'B': return 1;
    case 'h': case 'H': return 2;
    case 'i': case 'I': return 4; /* int is 32 bits on every port MicroPython runs on */
    case 'l': case 'L': return sizeof(long);
    default: return 0;
    }
}

/* The list and tuple layouts are MicroPython's (py/objlist.h, py/objtuple.h), unchanged
 * since v1.0; reading them in place takes no allocation and no runtime call. */
typedef struct list_layout {
    mp_obj_base_t base;
    size_t alloc;
    size_t len;
    mp_obj_t *items;
} list_layout;

typedef struct tuple_layout {
    mp_obj_base_t base;
    size_t len;
    mp_obj_t items[];
} tuple_layout;

static token_seq token_sequence(mp_obj_t obj, const char *type_error)
{
    token_seq seq = {NULL, NULL, 0, 0, 0};
    const qstr name = mp_obj_get_type(obj)->name;
    if (name == MP_QSTR_list) {
        const list_layout *list = MP_OBJ_TO_PTR(obj);
        seq.items = list->items;
        seq.len = list->len;
        return seq;
    }
    if (name == MP_QSTR_tuple) {
        const tuple_layout *tuple = MP_OBJ_TO_PTR(obj);
        seq.items = tuple->items;
        seq.len = tuple->len;
        return seq;
    }
    mp_buffer_info_t info;
    if (mp_obj_get_type(obj) == &mp_type_str || !mp_get_buffer(obj, &info, MP_BUFFER_READ) ||
        !int_typecode_size(info.typecode))
        RAISE(mp_type_TypeError, type_error);
    seq.buf = info.buf;
    seq.elem_size = int_typecode_size(info.typecode);
    seq.len = info.len / seq.elem_size;
    seq.typecode = info.typecode == BYTEARRAY_TYPECODE ? 'B' : (char)info.typecode;
    return seq;
}

/* An int token id, or -1 for an int no token can be (negative or past int32);
 * TypeError for anything that is not an int. */
static int64_t int_object(mp_obj_t obj)
{
    if (mp_obj_is_small_int(obj))
        return MP_OBJ_SMALL_INT_VALUE(obj) < 0 || MP_OBJ_SMALL_INT_VALUE(obj) > INT32_MAX ? -1
                                                                                         : MP_OBJ_SMALL_INT_VALUE(obj);
    if (mp_obj_get_type(obj)->name == MP_QSTR_int)
        return -1; /* a big int: past every vocabulary */
#if defined(MICROPY_ENABLE_DYNRUNTIME) && MICROPY_ENABLE_DYNRUNTIME
    return (int64_t)(mp_int_t)mp_native_from_obj(obj, MP_NATIVE_TYPE_INT); /* bool, or TypeError */
#else
    return mp_obj_get_int(obj);
#endif
}

/* A byte copy: the native module has no libc, and the element may be unaligned. */
static void copy_bytes(void *to, const void *from, size_t n)
{
    for (size_t i = 0; i < n; i++)
        ((unsigned char *)to)[i] = ((const unsigned char *)from)[i];
}

static int64_t token_at(const token_seq *seq, size_t i)
{
    if (seq->items)
        return int_object(seq->items[i]);
    const char *p = (const char *)seq->buf + i * seq->elem_size;
    switch (seq->typecode) {
    case 'b': return *(const int8_t *)p;
    case 'B': return *(const uint8_t *)p;
    case 'h': { int16_t v; copy_bytes(&v, p, 2); return v; }
    case 'H': { uint16_t v; copy_bytes(&v, p, 2); return v; }
    case 'i': { int32_t v; copy_bytes(&v, p, 4); return v; }
    case 'I': { uint32_t v; copy_bytes(&v, p, 4); return v; }
    default: {
        long v;
        copy_bytes(&v, p, sizeof v);
        return seq->typecode == 'L' && v < 0 ? -1 : (int64_t)v;
    }
    }
}

/* Every id below vocab_size before anything runs (the engine checks each chunk,
 * but an earlier chunk would already be in the cache). */
static void check_tokens(const colibri_lm_obj *self, const token_seq *seq, const char *what)
{
    for (size_t i = 0; i < seq->len; i++) {
        const int64_t id = token_at(seq, i);
        if (id < 0 || id >= (int64_t)self->vocab_size) {
            message m;
            msg_status(&m, COLIBRI_E_BAD_TOKEN);
            msg_add(&m, ": ");
            msg_add(&m, what);
            msg_add(&m, "[");
            msg_add_uint(&m, i);
            msg_add(&m, "] is outside the vocabulary 0..");
            msg_add_uint(&m, self->vocab_size - 1u);
            RAISE(mp_type_ValueError, m.text);
        }
    }
}

static void raise_cache_full(uint32_t position, size_t needed, uint32_t max_seq_len)
{
    message m;
    msg_status(&m, COLIBRI_E_CACHE_FULL);
    msg_add(&m, ": ");
    msg_add_uint(&m, position);
    msg_add(&m, " positions cached + ");
    msg_add_uint(&m, needed);
    msg_add(&m, " > max_seq_len ");
    msg_add_uint(&m, max_seq_len);
    msg_add(&m, " (reset() starts a new sequence)");
    RAISE(mp_type_ValueError, m.text);
}

/* Runs tokens [first, first + n) (n <= max_batch) into logits [n, vocab]. */
static void lm_chunk(colibri_lm_obj *self, const token_seq *seq, size_t first, size_t n, float *logits)
{
    for (size_t i = 0; i < n; i++)
        self->tokens[i] = (int32_t)token_at(seq, first + i);
    const colibri_status status =
        colibri_lm_forward(self->engine.ctx, self->tokens, (uint32_t)n, logits, n * self->vocab_size);
    if (status != COLIBRI_OK)
        raise_status(status);
}

/* The one keyword argument of a function, or MP_OBJ_NULL; TypeError for any other keyword. */
static void keywords(const mp_map_t *kw, const qstr *names, mp_obj_t *values, size_t count, const char *usage)
{
    for (size_t i = 0; i < count; i++)
        values[i] = MP_OBJ_NULL;
    if (!kw)
        return;
    for (size_t e = 0; e < kw->alloc; e++) {
        const mp_obj_t key = kw->table[e].key;
        if (key == MP_OBJ_NULL || key == MP_OBJ_SENTINEL)
            continue;
        size_t i = 0;
        while (i < count && key != MP_OBJ_NEW_QSTR(names[i]))
            i++;
        if (i == count)
            RAISE(mp_type_TypeError, usage);
        values[i] = kw->table[e].value;
    }
}

/* forward_tokens(ids, out=None): appends ids to the sequence and writes their
 * logits [len(ids), vocab_size] into out, an array('f') of len(ids) * vocab_size
 * (returned), or into a new array('f') when out is None. */
static mp_obj_t lm_forward_tokens(size_t n_args, const mp_obj_t *args, mp_map_t *kw)
{
    static const char usage[] = "colibri.LM.forward_tokens(ids, out=None): ids a list, tuple, bytes or integer array "
                                "of token ids; out an array('f') of len(ids) * vocab_size";
    const qstr names[1] = {MP_QSTR_out};
    mp_obj_t out_kw;
    keywords(kw, names, &out_kw, 1, usage);
    if (n_args < 2 || n_args > 3 || (n_args > 2 && out_kw != MP_OBJ_NULL))
        RAISE(mp_type_TypeError, usage);
    colibri_lm_obj *self = lm_self(args[0], usage);
    const token_seq seq = token_sequence(args[1], usage);
    check_tokens(self, &seq, "ids");
    const uint32_t position = lm_position(self);
    if (seq.len > self->max_seq_len - position)
        raise_cache_full(position, seq.len, self->max_seq_len);
    const size_t count = seq.len * self->vocab_size;

    mp_obj_t out = n_args > 2 ? args[2] : out_kw;
    if (out == MP_OBJ_NULL || out == mp_const_none) {
        /* array('f', bytearray(4 * count)): the array module's own constructor, zero-filled */
        mp_obj_t array_type = mp_load_attr(mp_import_name(MP_QSTR_array, mp_const_none, MP_OBJ_NEW_SMALL_INT(0)),
                                           MP_QSTR_array);
        mp_obj_t size = mp_obj_new_int_from_uint(count * sizeof(float));
        mp_obj_t array_args[2] = {MP_OBJ_NEW_QSTR(MP_QSTR_f),
                                  mp_call_function_n_kw(mp_load_global(MP_QSTR_bytearray), 1, 0, &size)};
        out = mp_call_function_n_kw(array_type, 2, 0, array_args);
    }
    mp_buffer_info_t logits;
    if (!mp_get_buffer(out, &logits, MP_BUFFER_WRITE) || logits.typecode != 'f')
        RAISE(mp_type_TypeError, "colibri.LM.forward_tokens: out must be a writable array('f') (float32)");
    if ((uintptr_t)logits.buf % 4u != 0)
        RAISE(mp_type_ValueError, "colibri.LM.forward_tokens: the float array is not 4-byte aligned");
    if (logits.len / 4u != count) {
        message m;
        msg_status(&m, COLIBRI_E_BUFFER_SIZE);
        msg_add(&m, ": len(out) = ");
        msg_add_uint(&m, logits.len / 4u);
        msg_add(&m, ", ");
        msg_add_uint(&m, seq.len);
        msg_add(&m, " ids x vocab_size ");
        msg_add_uint(&m, self->vocab_size);
        msg_add(&m, " needs ");
        msg_add_uint(&m, count);
        RAISE(mp_type_ValueError, m.text);
    }
    for (size_t at = 0; at < seq.len; at += self->max_batch) {
        const size_t n = seq.len - at < self->max_batch ? seq.len - at : self->max_batch;
        lm_chunk(self, &seq, at, n, (float *)logits.buf + at * self->vocab_size);
    }
    return out;
}

/* Writes id at out[i] for an integer buffer; the typecode was checked to hold every id. */
static void store_token(const mp_buffer_info_t *out, size_t i, int32_t id)
{
    char *p = (char *)out->buf + i * int_typecode_size(out->typecode);
    switch (out->typecode) {
    case 'b': *(int8_t *)p = (int8_t)id; break;
    case 'B': *(uint8_t *)p = (uint8_t)id; break;
    case 'h': case 'H': { const uint16_t v = (uint16_t)id; copy_bytes(p, &v, 2); break; }
    case 'i': case 'I': copy_bytes(p, &id, 4); break;
    default: { const long v = id; copy_bytes(p, &v, sizeof v); break; }
    }
}

/* The largest id an integer typecode holds. */
static uint32_t typecode_max(int typecode)
{
    switch (typecode) {
    case 'b': return 127u;
    case 'B': return 255u;
    case 'h': return 32767u;
    case 'H': return 65535u;
    default: return (uint32_t)INT32_MAX;
    }
}

/* generate(prompt_ids, max_new_tokens, temperature=0.0, top_k=0, top_p=1.0, seed=0, out=None):
 * resets, feeds the prompt in chunks of max_batch, then draws max_new_tokens ids,
 * each fed back but the last (the host's LM.generate, the same checks in the
 * same order and the same draws). Returns the new ids as a list, or with out (a
 * writable integer buffer of at least max_new_tokens elements) writes them
 * there and returns their count, allocating nothing. */
static mp_obj_t generate_ids(colibri_lm_obj *self, mp_obj_t prompt_obj, mp_obj_t max_new_obj, mp_obj_t *opt,
                             int32_t stop);

static mp_obj_t lm_generate(size_t n_args, const mp_obj_t *args, mp_map_t *kw)
{
    static const char usage[] = "colibri.LM.generate(prompt_ids, max_new_tokens, temperature=0.0, top_k=0, "
                                "top_p=1.0, seed=0, out=None)";
    enum { TEMPERATURE, TOP_K, TOP_P, SEED, OUT, N_KW };
    const qstr names[N_KW] = {MP_QSTR_temperature, MP_QSTR_top_k, MP_QSTR_top_p, MP_QSTR_seed, MP_QSTR_out};
    mp_obj_t opt[N_KW];
    keywords(kw, names, opt, N_KW, usage);
    if (n_args < 3 || n_args > 3 + N_KW)
        RAISE(mp_type_TypeError, usage);
    for (size_t i = 3; i < n_args; i++) { /* the options may come positionally too, in their order */
        if (opt[i - 3] != MP_OBJ_NULL)
            RAISE(mp_type_TypeError, usage);
        opt[i - 3] = args[i];
    }
    colibri_lm_obj *self = lm_self(args[0], usage);
    return generate_ids(self, args[1], args[2], opt, -1);
}

/* generate()'s work after its arguments are parsed: opt[] holds the sampler
 * options and out (MP_OBJ_NULL when not given); a drawn `stop` id (>= 0)
 * ends the run, as the last id. */
static mp_obj_t generate_ids(colibri_lm_obj *self, mp_obj_t prompt_obj, mp_obj_t max_new_obj, mp_obj_t *opt,
                             int32_t stop)
{
    enum { TEMPERATURE, TOP_K, TOP_P, SEED, OUT };
    /* int_object: -1 for a negative top_k, or one past int32 (more than any vocabulary: no limit either way) */
    const bool negative_top_k = opt[TOP_K] && mp_obj_is_small_int(opt[TOP_K]) && MP_OBJ_SMALL_INT_VALUE(opt[TOP_K]) < 0;
    const int64_t top_k = opt[TOP_K] ? int_object(opt[TOP_K]) : 0;
    colibri_sampler sampler = {(uint32_t)sizeof(colibri_sampler),
                               opt[TEMPERATURE] ? GET_FLOAT(opt[TEMPERATURE]) : 0.0f,
                               top_k < 0 ? 0u : (uint32_t)top_k,
                               opt[TOP_P] ? GET_FLOAT(opt[TOP_P]) : 1.0f};
    if (negative_top_k) {
        message m;
        msg_status(&m, COLIBRI_E_BAD_SAMPLER);
        msg_add(&m, ": top_k must be >= 0 (0: no limit)");
        RAISE(mp_type_ValueError, m.text);
    }
    uint64_t seed = 0;
    if (opt[SEED]) {
        /* seed % 2**64, as the host: small ints only (2**62 on 64-bit ports, 2**30 on 32-bit ones) */
        if (!mp_obj_is_small_int(opt[SEED]))
            RAISE(mp_type_TypeError, "colibri.LM.generate: seed must be a small int");
        seed = (uint64_t)(int64_t)MP_OBJ_SMALL_INT_VALUE(opt[SEED]);
    }
    /* The sampler's settings checked by the engine itself before anything changes:
     * one greedy-safe draw from a row of zeros, on a copy of the generator. */
    for (uint32_t v = 0; v < self->vocab_size; v++)
        self->logits[v] = 0.0f;
    colibri_rng probe_rng;
    colibri_rng_seed(&probe_rng, seed);
    int32_t probe;
    colibri_status status =
        colibri_lm_sample(self->engine.ctx, &sampler, self->logits, self->vocab_size, &probe_rng, &probe);
    if (status != COLIBRI_OK) {
        message m;
        msg_status(&m, status);
        msg_add(&m, ": temperature >= 0 and finite, top_k >= 0, 0 < top_p <= 1");
        RAISE(mp_type_ValueError, m.text);
    }

    const token_seq prompt = token_sequence(prompt_obj, "colibri.LM.generate: prompt_ids must be a list, tuple, bytes "
                                                     "or integer array of token ids");
    check_tokens(self, &prompt, "prompt_ids");
    if (prompt.len == 0) {
        message m;
        msg_status(&m, COLIBRI_E_BAD_BATCH);
        msg_add(&m, ": an empty prompt: give at least one token");
        RAISE(mp_type_ValueError, m.text);
    }
    const int64_t max_new = int_object(max_new_obj);
    if (max_new < 0)
        RAISE(mp_type_ValueError, "colibri.LM.generate: max_new_tokens must be >= 0");
    if (prompt.len > self->max_seq_len || (uint64_t)max_new > self->max_seq_len - prompt.len + 1u) {
        message m;
        msg_status(&m, COLIBRI_E_CACHE_FULL);
        msg_add(&m, ": ");
        msg_add_uint(&m, prompt.len);
        msg_add(&m, " prompt tokens + ");
        msg_add_uint(&m, (size_t)max_new);
        msg_add(&m, " new ones need more than max_seq_len ");
        msg_add_uint(&m, self->max_seq_len);
        msg_add(&m, " positions");
        RAISE(mp_type_ValueError, m.text);
    }

    mp_buffer_info_t out;
    const bool into_buffer = opt[OUT] && opt[OUT] != mp_const_none;
    mp_obj_t ids = MP_OBJ_NULL;
    if (into_buffer) {
        if (mp_obj_get_type(opt[OUT]) == &mp_type_str || !mp_get_buffer(opt[OUT], &out, MP_BUFFER_WRITE) ||
            !int_typecode_size(out.typecode))
            RAISE(mp_type_TypeError, "colibri.LM.generate: out must be a writable integer buffer "
                                     "(bytearray or array of 'b', 'B', 'h', 'H', 'i', 'I', 'l', 'L')");
        if (out.typecode == BYTEARRAY_TYPECODE)
            out.typecode = 'B';
        if (self->vocab_size - 1u > typecode_max(out.typecode)) {
            message m;
            msg_status(&m, COLIBRI_E_BUFFER_SIZE);
            msg_add(&m, ": out's elements hold ids up to ");
            msg_add_uint(&m, typecode_max(out.typecode));
            msg_add(&m, ", vocab_size is ");
            msg_add_uint(&m, self->vocab_size);
            RAISE(mp_type_ValueError, m.text);
        }
        if (out.len / int_typecode_size(out.typecode) < (size_t)max_new) {
            message m;
            msg_status(&m, COLIBRI_E_BUFFER_SIZE);
            msg_add(&m, ": len(out) = ");
            msg_add_uint(&m, out.len / int_typecode_size(out.typecode));
            msg_add(&m, " < max_new_tokens ");
            msg_add_uint(&m, (size_t)max_new);
            RAISE(mp_type_ValueError, m.text);
        }
    } else {
        ids = mp_obj_new_list(0, NULL);
    }

    status = colibri_lm_reset(self->engine.ctx);
    if (status != COLIBRI_OK)
        raise_status(status);
    if (max_new == 0)
        return into_buffer ? MP_OBJ_NEW_SMALL_INT(0) : ids;
    size_t last = 0; /* the row of the latest token's logits */
    for (size_t at = 0; at < prompt.len; at += self->max_batch) {
        const size_t n = prompt.len - at < self->max_batch ? prompt.len - at : self->max_batch;
        lm_chunk(self, &prompt, at, n, self->logits);
        last = n - 1;
    }
    colibri_rng rng;
    colibri_rng_seed(&rng, seed);
    for (size_t made = 0; made < (size_t)max_new; made++) {
        int32_t token;
        status = colibri_lm_sample(self->engine.ctx, &sampler, self->logits + last * self->vocab_size,
                                   self->vocab_size, &rng, &token);
        if (status != COLIBRI_OK)
            raise_status(status);
        if (into_buffer)
            store_token(&out, made, token);
        else
            mp_obj_list_append(ids, MP_OBJ_NEW_SMALL_INT(token));
        if (token == stop)
            return into_buffer ? mp_obj_new_int_from_uint(made + 1u) : ids;
        /* The last new token needs no forward: nothing reads its logits. */
        if (made + 1 < (size_t)max_new) {
            self->tokens[0] = token;
            status = colibri_lm_forward(self->engine.ctx, self->tokens, 1, self->logits, self->vocab_size);
            if (status != COLIBRI_OK)
                raise_status(status);
            last = 0;
        }
    }
    return into_buffer ? mp_obj_new_int_from_uint((size_t)max_new) : ids;
}

/* -- text: the image's tokenizer section (docs/lm.md "Encoding", "Decoding") -- */

static void need_tokenizer(const colibri_lm_obj *self)
{
    if (self->tokenizer_status != COLIBRI_OK) {
        message m;
        msg_status(&m, self->tokenizer_status);
        msg_add(&m, " (export the model with its tokenizer)");
        RAISE(mp_type_ValueError, m.text);
    }
}

static void *heap_block(size_t bytes, const char *what)
{
    void *p = m_malloc_maybe(bytes ? bytes : 1u);
    if (!p)
        RAISE(mp_type_MemoryError, what);
    return p;
}

/* Text (str or bytes, UTF-8) to a list of ids by colibri_tokenizer_encode. */
static mp_obj_t encode_text(colibri_lm_obj *self, mp_obj_t text_obj)
{
    need_tokenizer(self);
    mp_buffer_info_t text;
    if (!mp_get_buffer(text_obj, &text, MP_BUFFER_READ))
        RAISE(mp_type_TypeError, "colibri.LM.encode: text must be str or bytes");
    const size_t cap = COLIBRI_TOKENIZER_ENCODE_MAX_IDS(text.len), work = COLIBRI_TOKENIZER_ENCODE_WORK_BYTES(text.len);
    int32_t *ids = heap_block(cap * sizeof(int32_t), "colibri.LM.encode: no memory for the ids");
    void *scratch = heap_block(work, "colibri.LM.encode: no memory for the encoder's work");
    size_t n = 0;
    const colibri_status status = colibri_tokenizer_encode(&self->tok, text.buf, text.len, ids, cap, &n, scratch, work);
    if (status != COLIBRI_OK) {
        message m;
        msg_status(&m, status);
        RAISE(mp_type_ValueError, m.text);
    }
    mp_obj_t out = mp_obj_new_list(0, NULL);
    for (size_t i = 0; i < n; i++)
        mp_obj_list_append(out, MP_OBJ_NEW_SMALL_INT(ids[i]));
    return out;
}

static mp_obj_t lm_encode(mp_obj_t self_in, mp_obj_t text_in)
{
    return encode_text(lm_self(self_in, "colibri.LM.encode: not a colibri.LM"), text_in);
}

/* Ids to str by the streaming decoder (whole characters, the end flushed):
 * once to size the text, once to write it. */
static mp_obj_t decode_ids(colibri_lm_obj *self, mp_obj_t ids_obj)
{
    need_tokenizer(self);
    const token_seq ids = token_sequence(ids_obj, "colibri.LM.decode: ids must be a list, tuple, bytes or integer "
                                                  "array of token ids");
    check_tokens(self, &ids, "ids");
    const size_t piece_cap = COLIBRI_TOKENIZER_DECODE_BYTES(self->tok.max_piece);
    uint8_t *piece = heap_block(piece_cap, "colibri.LM.decode: no memory for a token's text");
    uint8_t *text = NULL;
    size_t total = 0;
    for (int pass = 0; pass < 2; pass++) {
        colibri_text_stream stream;
        colibri_text_stream_init(&stream);
        size_t at = 0;
        for (size_t i = 0; i <= ids.len; i++) {
            size_t n = 0;
            const colibri_status status =
                i < ids.len ? colibri_tokenizer_decode(&self->tok, &stream, (int32_t)token_at(&ids, i), piece,
                                                       piece_cap, &n)
                            : colibri_tokenizer_flush(&stream, piece, piece_cap, &n);
            if (status != COLIBRI_OK)
                raise_status(status);
            if (text)
                for (size_t k = 0; k < n; k++)
                    text[at + k] = piece[k];
            at += n;
        }
        total = at;
        if (!text)
            text = heap_block(total, "colibri.LM.decode: no memory for the text");
    }
    return mp_obj_new_str((const char *)text, total);
}

static mp_obj_t lm_decode(mp_obj_t self_in, mp_obj_t ids_in)
{
    return decode_ids(lm_self(self_in, "colibri.LM.decode: not a colibri.LM"), ids_in);
}

/* generate_text(prompt, max_new_tokens, temperature=0.0, top_k=0, top_p=1.0,
 * seed=0): the prompt encoded, generate() to the tokenizer's EOS, the new ids
 * decoded, all by the image's tokenizer: the host's LM.generate_text. */
static mp_obj_t lm_generate_text(size_t n_args, const mp_obj_t *args, mp_map_t *kw)
{
    static const char usage[] = "colibri.LM.generate_text(prompt, max_new_tokens, temperature=0.0, top_k=0, "
                                "top_p=1.0, seed=0)";
    enum { TEMPERATURE, TOP_K, TOP_P, SEED, OUT, N_KW };
    const qstr names[N_KW - 1] = {MP_QSTR_temperature, MP_QSTR_top_k, MP_QSTR_top_p, MP_QSTR_seed};
    mp_obj_t opt[N_KW];
    keywords(kw, names, opt, N_KW - 1, usage);
    opt[OUT] = MP_OBJ_NULL;
    if (n_args < 3 || n_args > 3 + N_KW - 1)
        RAISE(mp_type_TypeError, usage);
    for (size_t i = 3; i < n_args; i++) {
        if (opt[i - 3] != MP_OBJ_NULL)
            RAISE(mp_type_TypeError, usage);
        opt[i - 3] = args[i];
    }
    colibri_lm_obj *self = lm_self(args[0], usage);
    const mp_obj_t prompt = encode_text(self, args[1]);
    return decode_ids(self, generate_ids(self, prompt, args[2], opt, self->tok.eos));
}

/* ---- Registration: native module ---- */

#if defined(MICROPY_ENABLE_DYNRUNTIME) && MICROPY_ENABLE_DYNRUNTIME

/* The objects the interpreter sees hold pointers it only knows at load time,
 * so they live in .bss and are filled in here. They are global on purpose:
 * the linker accepts .bss only when it is reached through the GOT. */
mp_obj_full_type_t colibri_type_Model;
mp_obj_fun_builtin_fixed_t colibri_forward_obj;
mp_obj_fun_builtin_fixed_t colibri_version_obj;
mp_map_elem_t colibri_model_locals_forward; /* the table's one entry (not an array: arrays get 16-byte alignment) */
mp_obj_dict_t colibri_model_locals_dict;
mp_obj_full_type_t colibri_type_LM;
mp_obj_fun_builtin_fixed_t colibri_lm_reset_obj;
mp_obj_fun_builtin_var_t colibri_lm_forward_tokens_obj;
mp_obj_fun_builtin_var_t colibri_lm_generate_obj;
mp_obj_fun_builtin_fixed_t colibri_lm_encode_obj;
mp_obj_fun_builtin_fixed_t colibri_lm_decode_obj;
mp_obj_fun_builtin_var_t colibri_lm_generate_text_obj;
/* Word alignment stated, so the compiler does not raise it to 16 (x86-64's rule for arrays) and store
 * pairs of entries with aligned vector instructions: the loader places .bss on a word boundary only. */
mp_map_elem_t colibri_lm_locals[6] __attribute__((aligned(sizeof(void *))));
mp_obj_dict_t colibri_lm_locals_dict;

mp_obj_t mpy_init(mp_obj_fun_bc_t *self, size_t n_args, size_t n_kw, mp_obj_t *args)
{
    (void)n_args, (void)n_kw, (void)args;
    MP_NATMOD_INIT_ENTRY;

    colibri_forward_obj.base.type = &mp_type_fun_builtin_3;
    colibri_forward_obj.fun._3 = colibri_mp_forward;
    colibri_version_obj.base.type = &mp_type_fun_builtin_0;
    colibri_version_obj.fun._0 = colibri_mp_version;

    colibri_model_locals_forward.key = MP_OBJ_NEW_QSTR(MP_QSTR_forward);
    colibri_model_locals_forward.value = MP_OBJ_FROM_PTR(&colibri_forward_obj);
    colibri_model_locals_dict.base.type = &mp_type_dict;
    colibri_model_locals_dict.map.all_keys_are_qstrs = 1;
    colibri_model_locals_dict.map.is_fixed = 1;
    colibri_model_locals_dict.map.is_ordered = 1;
    colibri_model_locals_dict.map.used = 1;
    colibri_model_locals_dict.map.alloc = 1;
    colibri_model_locals_dict.map.table = &colibri_model_locals_forward;

    colibri_type_Model.base.type = &mp_type_type;
    colibri_type_Model.flags = MP_TYPE_FLAG_NONE;
    colibri_type_Model.name = (uint16_t)MP_QSTR_Model;
    MP_OBJ_TYPE_SET_SLOT(&colibri_type_Model, make_new, model_make_new, 0);
    MP_OBJ_TYPE_SET_SLOT(&colibri_type_Model, print, model_print, 1);
    MP_OBJ_TYPE_SET_SLOT(&colibri_type_Model, attr, model_attr, 2);
    MP_OBJ_TYPE_SET_SLOT(&colibri_type_Model, locals_dict, &colibri_model_locals_dict, 3);

    colibri_lm_reset_obj.base.type = &mp_type_fun_builtin_1;
    colibri_lm_reset_obj.fun._1 = lm_reset;
    colibri_lm_forward_tokens_obj.base.type = &mp_type_fun_builtin_var;
    colibri_lm_forward_tokens_obj.sig = MP_OBJ_FUN_MAKE_SIG(2, 3, true);
    colibri_lm_forward_tokens_obj.fun.kw = lm_forward_tokens;
    colibri_lm_generate_obj.base.type = &mp_type_fun_builtin_var;
    colibri_lm_generate_obj.sig = MP_OBJ_FUN_MAKE_SIG(3, 8, true);
    colibri_lm_generate_obj.fun.kw = lm_generate;
    colibri_lm_encode_obj.base.type = &mp_type_fun_builtin_2;
    colibri_lm_encode_obj.fun._2 = lm_encode;
    colibri_lm_decode_obj.base.type = &mp_type_fun_builtin_2;
    colibri_lm_decode_obj.fun._2 = lm_decode;
    colibri_lm_generate_text_obj.base.type = &mp_type_fun_builtin_var;
    colibri_lm_generate_text_obj.sig = MP_OBJ_FUN_MAKE_SIG(3, 7, true);
    colibri_lm_generate_text_obj.fun.kw = lm_generate_text;

    colibri_lm_locals[0].key = MP_OBJ_NEW_QSTR(MP_QSTR_reset);
    colibri_lm_locals[0].value = MP_OBJ_FROM_PTR(&colibri_lm_reset_obj);
    colibri_lm_locals[1].key = MP_OBJ_NEW_QSTR(MP_QSTR_forward_tokens);
    colibri_lm_locals[1].value = MP_OBJ_FROM_PTR(&colibri_lm_forward_tokens_obj);
    colibri_lm_locals[2].key = MP_OBJ_NEW_QSTR(MP_QSTR_generate);
    colibri_lm_locals[2].value = MP_OBJ_FROM_PTR(&colibri_lm_generate_obj);
    colibri_lm_locals[3].key = MP_OBJ_NEW_QSTR(MP_QSTR_encode);
    colibri_lm_locals[3].value = MP_OBJ_FROM_PTR(&colibri_lm_encode_obj);
    colibri_lm_locals[4].key = MP_OBJ_NEW_QSTR(MP_QSTR_decode);
    colibri_lm_locals[4].value = MP_OBJ_FROM_PTR(&colibri_lm_decode_obj);
    colibri_lm_locals[5].key = MP_OBJ_NEW_QSTR(MP_QSTR_generate_text);
    colibri_lm_locals[5].value = MP_OBJ_FROM_PTR(&colibri_lm_generate_text_obj);
    colibri_lm_locals_dict.base.type = &mp_type_dict;
    colibri_lm_locals_dict.map.all_keys_are_qstrs = 1;
    colibri_lm_locals_dict.map.is_fixed = 1;
    colibri_lm_locals_dict.map.is_ordered = 1;
    colibri_lm_locals_dict.map.used = 6;
    colibri_lm_locals_dict.map.alloc = 6;
    colibri_lm_locals_dict.map.table = colibri_lm_locals;

    colibri_type_LM.base.type = &mp_type_type;
    colibri_type_LM.flags = MP_TYPE_FLAG_NONE;
    colibri_type_LM.name = (uint16_t)MP_QSTR_LM;
    MP_OBJ_TYPE_SET_SLOT(&colibri_type_LM, make_new, lm_make_new, 0);
    MP_OBJ_TYPE_SET_SLOT(&colibri_type_LM, print, lm_print, 1);
    MP_OBJ_TYPE_SET_SLOT(&colibri_type_LM, attr, lm_attr, 2);
    MP_OBJ_TYPE_SET_SLOT(&colibri_type_LM, locals_dict, &colibri_lm_locals_dict, 3);

    mp_store_global(MP_QSTR_Model, MP_OBJ_FROM_PTR(&colibri_type_Model));
    mp_store_global(MP_QSTR_LM, MP_OBJ_FROM_PTR(&colibri_type_LM));
    mp_store_global(MP_QSTR_forward, MP_OBJ_FROM_PTR(&colibri_forward_obj));
    mp_store_global(MP_QSTR_version, MP_OBJ_FROM_PTR(&colibri_version_obj));

    MP_NATMOD_INIT_EXIT;
}

/* ---- Registration: user C module (firmware build) ---- */

#else

static MP_DEFINE_CONST_FUN_OBJ_3(colibri_forward_obj, colibri_mp_forward);
static MP_DEFINE_CONST_FUN_OBJ_0(colibri_version_obj, colibri_mp_version);

static const mp_rom_map_elem_t colibri_model_locals_table[] = {
    { MP_ROM_QSTR(MP_QSTR_forward), MP_ROM_PTR(&colibri_forward_obj) },
};
static MP_DEFINE_CONST_DICT(colibri_model_locals_dict, colibri_model_locals_table);

MP_DEFINE_CONST_OBJ_TYPE(
    colibri_type_Model,
    MP_QSTR_Model,
    MP_TYPE_FLAG_NONE,
    make_new, model_make_new,
    print, model_print,
    attr, model_attr,
    locals_dict, &colibri_model_locals_dict
    );

static MP_DEFINE_CONST_FUN_OBJ_1(colibri_lm_reset_obj, lm_reset);
static MP_DEFINE_CONST_FUN_OBJ_KW(colibri_lm_forward_tokens_obj, 2, lm_forward_tokens);
static MP_DEFINE_CONST_FUN_OBJ_KW(colibri_lm_generate_obj, 3, lm_generate);
static MP_DEFINE_CONST_FUN_OBJ_2(colibri_lm_encode_obj, lm_encode);
static MP_DEFINE_CONST_FUN_OBJ_2(colibri_lm_decode_obj, lm_decode);
static MP_DEFINE_CONST_FUN_OBJ_KW(colibri_lm_generate_text_obj, 3, lm_generate_text);

static const mp_rom_map_elem_t colibri_lm_locals_table[] = {
    { MP_ROM_QSTR(MP_QSTR_reset), MP_ROM_PTR(&colibri_lm_reset_obj) },
    { MP_ROM_QSTR(MP_QSTR_forward_tokens), MP_ROM_PTR(&colibri_lm_forward_tokens_obj) },
    { MP_ROM_QSTR(MP_QSTR_generate), MP_ROM_PTR(&colibri_lm_generate_obj) },
    { MP_ROM_QSTR(MP_QSTR_encode), MP_ROM_PTR(&colibri_lm_encode_obj) },
    { MP_ROM_QSTR(MP_QSTR_decode), MP_ROM_PTR(&colibri_lm_decode_obj) },
    { MP_ROM_QSTR(MP_QSTR_generate_text), MP_ROM_PTR(&colibri_lm_generate_text_obj) },
};
static MP_DEFINE_CONST_DICT(colibri_lm_locals_dict, colibri_lm_locals_table);

MP_DEFINE_CONST_OBJ_TYPE(
    colibri_type_LM,
    MP_QSTR_LM,
    MP_TYPE_FLAG_NONE,
    make_new, lm_make_new,
    print, lm_print,
    attr, lm_attr,
    locals_dict, &colibri_lm_locals_dict
    );

static const mp_rom_map_elem_t colibri_module_globals_table[] = {
    { MP_ROM_QSTR(MP_QSTR___name__), MP_ROM_QSTR(MP_QSTR_colibri) },
    { MP_ROM_QSTR(MP_QSTR_Model), MP_ROM_PTR(&colibri_type_Model) },
    { MP_ROM_QSTR(MP_QSTR_LM), MP_ROM_PTR(&colibri_type_LM) },
    { MP_ROM_QSTR(MP_QSTR_forward), MP_ROM_PTR(&colibri_forward_obj) },
    { MP_ROM_QSTR(MP_QSTR_version), MP_ROM_PTR(&colibri_version_obj) },
};
static MP_DEFINE_CONST_DICT(colibri_module_globals, colibri_module_globals_table);

const mp_obj_module_t colibri_user_cmodule = {
    .base = { &mp_type_module },
    .globals = (mp_obj_dict_t *)&colibri_module_globals,
};

MP_REGISTER_MODULE(MP_QSTR_colibri, colibri_user_cmodule);

#endif
