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
 * besides the Model object itself. forward() allocates nothing. A bytearray
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

/* ---- Per-build declarations used by the shared code ---- */

#if defined(MICROPY_ENABLE_DYNRUNTIME) && MICROPY_ENABLE_DYNRUNTIME
extern mp_obj_full_type_t colibri_type_Model; /* in .bss, filled in by mpy_init */
#define MODEL_TYPE ((const mp_obj_type_t *)&colibri_type_Model)
/* The message is copied into the exception (it may be on the stack). */
#define RAISE(exc_type, text) mp_raise_msg_str(&(exc_type), (text))
#else
extern const mp_obj_type_t colibri_type_Model;
#define MODEL_TYPE (&colibri_type_Model)
#define RAISE(exc_type, text) mp_raise_msg_varg(&(exc_type), MP_ERROR_TEXT("%s"), (text))
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

typedef struct colibri_model_obj {
    mp_obj_base_t base;
    mp_obj_t image;       /* the caller's buffer object: referenced so the weights stay alive */
    const void *image_buf; /* where its bytes were at construction: a resized bytearray moves them */
    size_t image_len;
    void *arena;          /* the heap block holding ctx (the GC follows block starts only) */
    colibri_ctx *ctx;     /* inside arena */
    size_t arena_size;    /* bytes the engine asked for */
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

static mp_obj_t model_make_new(const mp_obj_type_t *type, size_t n_args, size_t n_kw, const mp_obj_t *args)
{
    if (n_args != 1 || n_kw != 0)
        RAISE(mp_type_TypeError, "colibri.Model(image) takes one argument: the model image "
                                 "(bytes, bytearray or memoryview)");
    /* str has the buffer protocol too, but a path is not an image */
    mp_buffer_info_t image;
    if (mp_obj_get_type(args[0]) == &mp_type_str || !mp_get_buffer(args[0], &image, MP_BUFFER_READ))
        RAISE(mp_type_TypeError, "colibri.Model: the model image must be bytes, bytearray or memoryview "
                                 "(read the file first: open(path, 'rb').read())");

    /* Full validation (CRC, every table) before anything is allocated. */
    colibri_model_info info;
    colibri_status status = colibri_get_info(image.buf, image.len, &info);
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
        RAISE(mp_type_TypeError, "colibri.Model: a writable memoryview (or other view) cannot be guarded: "
                                 "resizing its bytearray would free the weights under the model; "
                                 "pass the bytearray itself, or bytes(view)");

    colibri_model_obj *self = m_malloc_maybe(sizeof *self);
    /* Over-allocated so the arena can start on COLIBRI_ARENA_ALIGN whatever the heap's block size. */
    void *arena = self ? m_malloc_maybe(info.arena_size + COLIBRI_ARENA_ALIGN - 1) : NULL;
    if (!arena) {
        message m;
        m.len = 0;
        msg_add(&m, "colibri: cannot allocate the model's arena (");
        msg_add_uint(&m, info.arena_size);
        msg_add(&m, " bytes)");
        RAISE(mp_type_MemoryError, m.text);
    }
    void *aligned = (void *)(((uintptr_t)arena + COLIBRI_ARENA_ALIGN - 1) & ~(uintptr_t)(COLIBRI_ARENA_ALIGN - 1));

    colibri_ctx *ctx;
    status = colibri_init(&ctx, aligned, info.arena_size, image.buf, image.len);
    if (status != COLIBRI_OK)
        raise_status(status);

    self->base.type = type;
    self->image = args[0];
    self->image_buf = image.buf;
    self->image_len = image.len;
    self->arena = arena;
    self->ctx = ctx;
    self->arena_size = info.arena_size;
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
              (unsigned)self->max_batch, (unsigned)self->arena_size);
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
        value = self->arena_size;
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
    /* The engine reads the weights in place: if the caller resized a bytearray
     * under the model, its bytes moved and the context points at freed memory. */
    mp_buffer_info_t image;
    if (!mp_get_buffer(model->image, &image, MP_BUFFER_READ) || image.buf != model->image_buf ||
        image.len < model->image_len)
        RAISE(mp_type_ValueError, "colibri.forward: the model image buffer moved or shrank since colibri.Model() "
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
    const colibri_status status = colibri_forward(model->ctx, batch, in.buf, n_in, out.buf, n_out);
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

    mp_store_global(MP_QSTR_Model, MP_OBJ_FROM_PTR(&colibri_type_Model));
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

static const mp_rom_map_elem_t colibri_module_globals_table[] = {
    { MP_ROM_QSTR(MP_QSTR___name__), MP_ROM_QSTR(MP_QSTR_colibri) },
    { MP_ROM_QSTR(MP_QSTR_Model), MP_ROM_PTR(&colibri_type_Model) },
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
