/*
 * A stand-in for MicroPython's .mpy loader on a bare Cortex-M7 (QEMU
 * mps2-an500), to run an ARM colibri.mpy where no MicroPython firmware is
 * available (run.py builds and starts it): parses the .mpy, copies the text
 * to RAM, allocates .bss, applies the relocation stream as MicroPython's
 * mp_native_relocate does (word += base), provides the mp_fun_table slots the
 * module calls with fake objects (any other slot fails the run), then imports
 * the module and drives Model / forward / version through the objects it
 * registered. Output goes to the host through semihosting; the exit code is
 * 0 on success. The object layouts below are the ones mp_natmod.h declares.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

extern const unsigned char mpy_blob[];
extern const unsigned int mpy_blob_len;
extern const unsigned char model_blob[];
extern const unsigned int model_blob_len;
extern const float input_blob[];
extern const unsigned int input_count;
extern const unsigned int output_count;

/* ---- semihosting ---- */
static int semihost(int op, const void *arg)
{
    register int r0 __asm__("r0") = op;
    register const void *r1 __asm__("r1") = arg;
    __asm__ volatile("bkpt 0xAB" : "+r"(r0) : "r"(r1) : "memory");
    return r0;
}
static void out(const char *s) { semihost(0x04, s); }
static void outf(const char *fmt, ...)
{
    char buf[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    out(buf);
}
__attribute__((noreturn)) static void finish(int code)
{
    const uint32_t block[2] = {0x20026, (uint32_t)code};
    semihost(0x20, block);
    for (;;) {
    }
}

/* ---- fake objects ---- */
typedef void *obj_t;
typedef struct { const void *type; } base_t;
typedef struct { const void *type; const char *name; } type_t;
static const type_t t_type = {0, "type"}, t_str = {0, "str"}, t_dict = {0, "dict"}, t_list = {0, "list"},
    t_fun0 = {0, "fun0"}, t_fun1 = {0, "fun1"}, t_fun2 = {0, "fun2"}, t_fun3 = {0, "fun3"}, t_funvar = {0, "funvar"},
    t_exc = {0, "Exception"}, t_int = {0, "int"}, t_none = {0, "NoneType"}, t_buffer = {0, "buffer"},
    t_TypeError = {0, "TypeError"}, t_ValueError = {0, "ValueError"}, t_MemoryError = {0, "MemoryError"};
static const base_t none_obj = {&t_none}, false_obj = {&t_none}, true_obj = {&t_none};

typedef struct { const void *type; void *buf; size_t len; int typecode; int writable; } buffer_obj;
typedef struct { void *buf; size_t len; int typecode; } buffer_info;
typedef struct { const void *type; size_t len; const char *data; } str_obj;
typedef struct { const void *type; const str_obj *msg; } exc_obj;

static _Alignas(16) uint8_t heap[256 * 1024];
static size_t heap_used;
static void *fake_realloc(void *ptr, size_t n, bool allow_move)
{
    (void)allow_move;
    if (ptr || heap_used + n > sizeof heap)
        return NULL;
    void *p = heap + heap_used;
    heap_used += (n + 15u) & ~15u;
    memset(p, 0xA5, n); /* not zeroed, like a real heap block may not be */
    return p;
}

/* qstrs: the module's table, ids 200 + index, names kept for load_global */
#define MAX_QSTR 64
static uint16_t qstr_ids[MAX_QSTR];
static char qstr_names[MAX_QSTR][32];
static unsigned n_qstr;
static const char *qstr_name(size_t q) { return q >= 200 && q - 200 < n_qstr ? qstr_names[q - 200] : "?"; }
static size_t qstr_find(const char *name)
{
    for (unsigned i = 0; i < n_qstr; i++)
        if (!strcmp(qstr_names[i], name))
            return qstr_ids[i];
    return 0;
}

static struct { size_t q; obj_t obj; } globals[16];
static unsigned n_globals;
static obj_t global(const char *name)
{
    for (unsigned i = 0; i < n_globals; i++)
        if (!strcmp(qstr_name(globals[i].q), name))
            return globals[i].obj;
    return NULL;
}

static jmp_buf raise_env;
static exc_obj *raised;

static obj_t f_native_to_obj(uintptr_t val, uintptr_t type) { (void)type; return (obj_t)((val << 1) | 1u); }
static void *f_swap_globals(void *d) { static void *cur; void *old = cur; cur = d; return old; }
static obj_t f_load_global(size_t q)
{
    const char *n = qstr_name(q);
    if (!strcmp(n, "TypeError")) return (obj_t)&t_TypeError;
    if (!strcmp(n, "ValueError")) return (obj_t)&t_ValueError;
    if (!strcmp(n, "MemoryError")) return (obj_t)&t_MemoryError;
    outf("FAIL load_global(%s)\n", n);
    finish(3);
}
static void f_store_global(size_t q, obj_t o) { globals[n_globals].q = q; globals[n_globals++].obj = o; }
static obj_t f_call_function_n_kw(obj_t fun, size_t n_args_kw, const obj_t *args)
{
    if (n_args_kw != 1 || (fun != &t_TypeError && fun != &t_ValueError && fun != &t_MemoryError)) {
        outf("FAIL call_function_n_kw(%p, %u)\n", fun, (unsigned)n_args_kw);
        finish(3);
    }
    exc_obj *e = fake_realloc(NULL, sizeof *e, false);
    e->type = fun;
    e->msg = args[0];
    return e;
}
static void f_raise(obj_t o) { raised = o; longjmp(raise_env, 1); }
static const void *f_get_type(const void *o)
{
    if ((uintptr_t)o & 3u)
        return &t_int;
    return ((const base_t *)o)->type;
}
static obj_t f_new_str(const char *data, size_t len)
{
    str_obj *s = fake_realloc(NULL, sizeof *s + len + 1, false);
    char *copy = (char *)(s + 1);
    memcpy(copy, data, len);
    copy[len] = 0;
    s->type = &t_str, s->len = len, s->data = copy;
    return s;
}
static bool f_get_buffer(obj_t o, buffer_info *info, uintptr_t flags)
{
    if (f_get_type(o) != &t_buffer)
        return false;
    buffer_obj *b = o;
    if ((flags & 2u) && !b->writable)
        return false;
    info->buf = b->buf, info->len = b->len, info->typecode = b->typecode;
    return true;
}
typedef struct { void *data; void (*print_strn)(void *, const char *, size_t); } print_t;
static int f_printf(const print_t *print, const char *fmt, ...)
{
    char buf[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    print->print_strn(print->data, buf, (size_t)n);
    return n;
}
static void unexpected(void) { out("FAIL: an unexpected mp_fun_table slot was called\n"); finish(3); }

static void *fun_table[87];
static void setup_fun_table(void)
{
    for (int i = 0; i < 87; i++)
        fun_table[i] = (void *)unexpected;
    fun_table[0] = (void *)&none_obj, fun_table[1] = (void *)&false_obj, fun_table[2] = (void *)&true_obj;
    fun_table[4] = (void *)f_native_to_obj;
    fun_table[5] = (void *)f_swap_globals;
    fun_table[7] = (void *)f_load_global;
    fun_table[13] = (void *)f_store_global;
    fun_table[27] = (void *)f_call_function_n_kw;
    fun_table[34] = (void *)f_raise;
    fun_table[50] = (void *)memset;
    fun_table[51] = (void *)memmove;
    fun_table[52] = (void *)fake_realloc;
    fun_table[53] = (void *)f_printf;
    fun_table[56] = (void *)f_get_type;
    fun_table[57] = (void *)f_new_str;
    fun_table[65] = (void *)f_get_buffer;
    fun_table[73] = (void *)&t_type, fun_table[74] = (void *)&t_str, fun_table[75] = (void *)&t_list;
    fun_table[76] = (void *)&t_dict, fun_table[77] = (void *)&t_fun0, fun_table[78] = (void *)&t_fun1;
    fun_table[79] = (void *)&t_fun2, fun_table[80] = (void *)&t_fun3, fun_table[81] = (void *)&t_funvar;
    fun_table[82] = (void *)&t_exc;
}

/* ---- the loader ---- */
static const uint8_t *rd;
static size_t vuint(void)
{
    size_t v = 0;
    uint8_t b;
    do {
        b = *rd++;
        v = v << 7 | (b & 0x7Fu);
    } while (b & 0x80u);
    return v;
}

/* The module's text runs from here: room for the engine with every dtype and kernel form (67 KiB at
 * armv7emsp today), and a module that would not fit is refused rather than copied past the end. */
static _Alignas(16) uint8_t text_ram[128 * 1024];
static uint8_t *bss;

static void load(void)
{
    rd = mpy_blob;
    if (rd[0] != 'M' || rd[1] != 6 || (rd[2] & 3) != 3 || ((rd[2] >> 2) != 7 && (rd[2] >> 2) != 8)) {
        out("FAIL header\n");
        finish(2);
    }
    outf("arch code %u\n", rd[2] >> 2);
    rd += 4;
    n_qstr = (unsigned)vuint();
    if (vuint() != 0 || n_qstr > MAX_QSTR)
        finish(2);
    for (unsigned i = 0; i < n_qstr; i++) {
        size_t len = vuint() >> 1;
        memcpy(qstr_names[i], rd, len);
        qstr_names[i][len] = 0;
        qstr_ids[i] = (uint16_t)(200 + i);
        rd += len + 1;
    }
    size_t head = vuint();
    if ((head & 7u) != 2)
        finish(2);
    size_t text_len = head >> 3;
    if (text_len > sizeof text_ram) {
        outf("text %u B does not fit the loader's %u B\n", (unsigned)text_len, (unsigned)sizeof text_ram);
        finish(2);
    }
    memcpy(text_ram, rd, text_len);
    rd += text_len;
    size_t flags = vuint();
    if (flags & 0x20)
        finish(2); /* this module has no separate rodata */
    if (flags & 0x40) {
        size_t bss_len = vuint();
        bss = fake_realloc(NULL, bss_len, false);
        memset(bss, 0, bss_len);
    }
    unsigned n_reloc = 0;
    if (flags & 0x10) {
        uintptr_t *addr = NULL;
        uint8_t op;
        while ((op = *rd++) != 0xFF) {
            if (op & 1) {
                size_t a = vuint();
                if (a & 1)
                    finish(2);
                addr = &((uintptr_t *)text_ram)[a >> 1];
            }
            op >>= 1;
            uintptr_t dest;
            size_t n = 1;
            if (op <= 5) {
                if (op & 1)
                    n = vuint();
                op >>= 1;
                dest = op == 0 ? (uintptr_t)text_ram : op == 2 ? (uintptr_t)bss : 0;
                if (op == 1)
                    finish(2);
            } else if (op == 6) {
                dest = (uintptr_t)qstr_ids;
            } else if (op == 8) {
                dest = (uintptr_t)fun_table;
            } else if (op >= 9) {
                dest = (uintptr_t)fun_table[op - 9];
            } else {
                finish(2);
            }
            while (n--) {
                *addr++ += dest;
                n_reloc++;
            }
        }
    }
    outf("loaded: text %u B, %u qstrs, %u relocations\n", (unsigned)text_len, n_qstr, n_reloc);
    __asm__ volatile("dsb\n isb" ::: "memory");
}

/* ---- the module's objects, as colibri_mp.c / mp_natmod.h lay them out ---- */
typedef struct {
    const void *type;
    uint16_t flags, name;
    uint8_t make_new, print, call, unary_op, binary_op, attr, subscr, iter, buffer, protocol, parent, locals_dict;
    const void *slots[12];
} full_type;
typedef obj_t (*make_new_fn)(const void *, size_t, size_t, const obj_t *);
typedef void (*attr_fn)(obj_t, size_t, obj_t *);
typedef void (*print_fn)(const print_t *, obj_t, int);
typedef struct { const void *type; void *fun; } builtin_fun;
typedef struct { obj_t key, value; } map_elem;
typedef struct { const void *type; size_t bits, alloc; map_elem *table; } dict_obj;

static void print_to_host(void *data, const char *s, size_t len)
{
    (void)data;
    char buf[256];
    if (len > 255)
        len = 255;
    memcpy(buf, s, len);
    buf[len] = 0;
    out(buf);
}

static void show_raised(const char *what)
{
    outf("RAISED %s %s: %s\n", what, ((const type_t *)raised->type)->name, raised->msg->data);
}

static void check(int ok, const char *what)
{
    if (!ok) {
        outf("FAIL %s\n", what);
        finish(1);
    }
}

int main(void)
{
    setup_fun_table();
    load();
    struct { const void *type; const void *context; } fun_bc;
    struct { const void *type; void *globals; } context = {0, (void *)0x1234};
    fun_bc.type = 0, fun_bc.context = &context;
    obj_t (*init)(void *, size_t, size_t, obj_t *) = (void *)((uintptr_t)text_ram | 1u);
    if (setjmp(raise_env)) {
        show_raised("mpy_init");
        finish(1);
    }
    obj_t r = init(&fun_bc, 0, 0, NULL);
    check(r == &none_obj, "mpy_init returns None");
    const full_type *model_type = global("Model");
    const builtin_fun *forward = global("forward"), *version = global("version");
    check(model_type && forward && version, "Model, forward and version registered");
    check(model_type->type == &t_type && forward->type == &t_fun3 && version->type == &t_fun0, "object types");
    check(!strcmp(qstr_name(model_type->name), "Model"), "type name");
    const dict_obj *locals = model_type->slots[model_type->locals_dict - 1];
    check(locals->type == &t_dict && locals->alloc == 1 && locals->table[0].value == forward
              && (uintptr_t)locals->table[0].key == ((qstr_find("forward") << 3) | 2u),
          "locals_dict {forward}");

    const str_obj *v = ((obj_t(*)(void))version->fun)();
    outf("version %s\n", v->data);

    static _Alignas(8) uint8_t image[256 * 1024];
    check(model_blob_len + 1 <= sizeof image, "image fits");
    memcpy(image, model_blob, model_blob_len);
    buffer_obj image_obj = {&t_buffer, image, model_blob_len, 'B', 0};
    make_new_fn make_new = (make_new_fn)model_type->slots[model_type->make_new - 1];
    obj_t args[1] = {&image_obj};

    /* a misaligned image is refused */
    memmove(image + 1, image, model_blob_len);
    image_obj.buf = image + 1;
    if (!setjmp(raise_env)) {
        make_new(model_type, 1, 0, args);
        check(0, "misaligned image refused");
    }
    show_raised("misaligned");
    memmove(image, image + 1, model_blob_len);
    image_obj.buf = image;

    obj_t model = NULL;
    if (setjmp(raise_env)) {
        show_raised("Model()");
        finish(1);
    }
    model = make_new(model_type, 1, 0, args);
    attr_fn attr = (attr_fn)model_type->slots[model_type->attr - 1];
    const char *names[] = {"input_size", "output_size", "num_experts", "max_batch", "arena_size"};
    for (int i = 0; i < 5; i++) {
        obj_t dest[2] = {NULL, NULL};
        attr(model, qstr_find(names[i]), dest);
        outf("ATTR %s %u\n", names[i], (unsigned)((uintptr_t)dest[0] >> 1));
    }
    print_t printer = {NULL, print_to_host};
    ((print_fn)model_type->slots[model_type->print - 1])(&printer, model, 1);
    out("\n");

    static float y[4096];
    buffer_obj in = {&t_buffer, (void *)input_blob, input_count * 4u, 'f', 0};
    buffer_obj outb = {&t_buffer, y, output_count * 4u, 'f', 1};
    obj_t (*fwd)(obj_t, obj_t, obj_t) = forward->fun;
    if (setjmp(raise_env)) {
        show_raised("forward");
        finish(1);
    }
    fwd(model, &in, &outb);
    for (unsigned i = 0; i < output_count; i++) {
        uint32_t bits;
        memcpy(&bits, &y[i], 4);
        outf("Y %u %08lx\n", i, (unsigned long)bits);
    }
    /* a wrong output length is refused, and the model still works after */
    buffer_obj short_out = {&t_buffer, y, 4, 'f', 1};
    if (!setjmp(raise_env)) {
        fwd(model, &in, &short_out);
        check(0, "short output refused");
    }
    show_raised("short output");
    if (setjmp(raise_env)) {
        show_raised("forward again");
        finish(1);
    }
    fwd(model, &in, &outb);
    out("END\n");
    finish(0);
}

/* ---- startup ---- */
extern uint32_t _sidata, _sdata, _edata, _sbss, _ebss, _estack;
void Reset_Handler(void);
void HardFault_Handler(void);
void HardFault_Handler(void) { out("FAIL HardFault\n"); finish(4); }
void Reset_Handler(void)
{
    *(volatile uint32_t *)0xE000ED88 |= 0xFu << 20; /* CPACR: FPU on */
    __asm__ volatile("dsb\n isb");
    uint32_t *src = &_sidata;
    for (uint32_t *d = &_sdata; d < &_edata;)
        *d++ = *src++;
    for (uint32_t *d = &_sbss; d < &_ebss;)
        *d++ = 0;
    main();
    finish(0);
}
__attribute__((section(".isr_vector"), used)) void *const vectors[16] = {
    &_estack, Reset_Handler, HardFault_Handler, HardFault_Handler, HardFault_Handler, HardFault_Handler,
    HardFault_Handler,
};
