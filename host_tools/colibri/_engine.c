/*
 * CPython binding of the Colibri C engine: colibri._engine.
 *
 * A Context keeps the image buffer exported (so it cannot move or shrink),
 * owns the arena, and releases the GIL during forward so contexts run in
 * parallel from Python threads. colibri/engine.py wraps it with numpy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <string.h>

#include "pythread.h"

#include "colibri.h"

/* setup.py passes the hash of the sources it builds from (colibri/sources.py), so
 * a checkout can tell this binary is stale after a C edit. A build without it
 * (`scripts/source_hash.py hash` gives the value) is refused in a checkout. */
#ifndef COLIBRI_SOURCE_HASH
#define COLIBRI_SOURCE_HASH "unknown"
#endif

typedef struct {
    PyObject_HEAD
    Py_buffer image_view; /* the caller's buffer, held for the context's life */
    void *image_copy;     /* aligned copy when the buffer is not 4-byte aligned */
    void *arena;
    colibri_ctx *ctx;
    colibri_model_info info;
    PyThread_type_lock lock; /* one forward at a time per context; contexts run in parallel */
    int has_view;
} ContextObject;

static PyObject *status_error(int status) {
    return Py_BuildValue("(is)", status, colibri_strerror(status));
}

/* Raises colibri._engine.EngineError(status, message); engine.py maps it to ColibriError subclasses. */
static PyObject *EngineError;

static PyObject *raise_status(int status) {
    PyObject *args = status_error(status);
    if (args != NULL) {
        PyErr_SetObject(EngineError, args);
        Py_DECREF(args);
    }
    return NULL;
}

static const void *image_bytes(ContextObject *self) {
    return self->image_copy != NULL ? self->image_copy : self->image_view.buf;
}

static void Context_dealloc(ContextObject *self) {
    if (self->ctx != NULL) {
        colibri_free(self->ctx);
    }
    if (self->lock != NULL) {
        PyThread_free_lock(self->lock);
    }
    PyMem_RawFree(self->arena);
    PyMem_RawFree(self->image_copy);
    if (self->has_view) {
        PyBuffer_Release(&self->image_view);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Context_init(ContextObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"image", "reference_kernels", NULL};
    PyObject *image;
    int reference = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|p", kwlist, &image, &reference)) {
        return -1;
    }
    if (self->has_view) {
        PyErr_SetString(PyExc_RuntimeError, "Context already initialised");
        return -1;
    }
    if (PyObject_GetBuffer(image, &self->image_view, PyBUF_CONTIG_RO) < 0) {
        return -1;
    }
    self->has_view = 1;
    size_t len = (size_t)self->image_view.len;
    if (((uintptr_t)self->image_view.buf & 3u) != 0) {
        self->image_copy = PyMem_RawMalloc(len ? len : 1);
        if (self->image_copy == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        memcpy(self->image_copy, self->image_view.buf, len);
    }
    size_t arena_size = 0;
    int st = colibri_model_size(image_bytes(self), len, &arena_size);
    if (st == COLIBRI_OK) {
        st = colibri_get_info(image_bytes(self), len, &self->info);
    }
    if (st != COLIBRI_OK) {
        raise_status(st);
        return -1;
    }
    self->lock = PyThread_allocate_lock();
    if (self->lock == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    self->arena = PyMem_RawMalloc(arena_size);
    if (self->arena == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    st = colibri_init(&self->ctx, self->arena, arena_size, image_bytes(self), len);
    if (st == COLIBRI_OK && reference) {
        st = colibri_set_kernels(self->ctx, COLIBRI_KERNELS_REFERENCE);
    }
    if (st != COLIBRI_OK) {
        self->ctx = NULL;
        raise_status(st);
        return -1;
    }
    return 0;
}

/* forward(input, output, batch): input/output are C-contiguous float32 buffers. */
static PyObject *Context_forward(ContextObject *self, PyObject *args) {
    PyObject *in_obj, *out_obj;
    Py_ssize_t batch;
    if (!PyArg_ParseTuple(args, "OOn", &in_obj, &out_obj, &batch)) {
        return NULL;
    }
    if (self->ctx == NULL) {
        return raise_status(COLIBRI_E_BAD_CONTEXT);
    }
    if (batch < 0) {
        return raise_status(COLIBRI_E_BAD_BATCH);
    }
    Py_buffer in, out;
    if (PyObject_GetBuffer(in_obj, &in, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        return NULL;
    }
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&in);
        return NULL;
    }
    PyObject *result = NULL;
    if (in.itemsize != 4 || out.itemsize != 4 || in.format == NULL || out.format == NULL ||
        strcmp(in.format, "f") != 0 || strcmp(out.format, "f") != 0) {
        PyErr_SetString(PyExc_TypeError, "input and output must be float32 buffers");
    } else {
        int st;
        Py_BEGIN_ALLOW_THREADS
        PyThread_acquire_lock(self->lock, WAIT_LOCK);
        st = colibri_forward(self->ctx, (size_t)batch, (const float *)in.buf, (size_t)(in.len / 4),
                             (float *)out.buf, (size_t)(out.len / 4));
        PyThread_release_lock(self->lock);
        Py_END_ALLOW_THREADS
        result = st == COLIBRI_OK ? (Py_INCREF(Py_None), Py_None) : raise_status(st);
    }
    PyBuffer_Release(&in);
    PyBuffer_Release(&out);
    return result;
}

/* colibri_exec.on_route into a Python callable: on_route(layer, experts, tokens) with the
 * expert records about to run (routed ones with tokens, then the shared ones) and each one's
 * token count. Runs with the GIL taken back; an exception stops the pass and is re-raised. */
typedef struct route_call {
    PyObject *fn;
    int raised;
} route_call;

static colibri_status py_on_route(void *user, const colibri_route *r) {
    route_call *rc = user;
    colibri_status st = COLIBRI_OK;
    PyGILState_STATE g = PyGILState_Ensure();
    PyObject *experts = PyList_New(0), *tokens = PyList_New(0), *res = NULL;
    int ok = experts && tokens;
    for (uint32_t i = 0; ok && i < r->experts + r->shared; i++) {
        size_t n = i < r->experts ? r->tokens[i] : r->batch;
        if (n == 0)
            continue;
        PyObject *e = PyLong_FromUnsignedLong(r->first_expert + i), *t = PyLong_FromSize_t(n);
        ok = e && t && PyList_Append(experts, e) == 0 && PyList_Append(tokens, t) == 0;
        Py_XDECREF(e);
        Py_XDECREF(t);
    }
    if (ok)
        res = PyObject_CallFunction(rc->fn, "IOO", (unsigned)r->layer, experts, tokens);
    if (!res) {
        rc->raised = 1;
        st = COLIBRI_E_BAD_EXEC;
    }
    Py_XDECREF(res);
    Py_XDECREF(experts);
    Py_XDECREF(tokens);
    PyGILState_Release(g);
    return st;
}

/* forward_ex(input, output, batch, on_route): colibri_forward_ex with a Python on_route. */
static PyObject *Context_forward_ex(ContextObject *self, PyObject *args) {
    PyObject *in_obj, *out_obj, *fn;
    Py_ssize_t batch;
    if (!PyArg_ParseTuple(args, "OOnO", &in_obj, &out_obj, &batch, &fn)) {
        return NULL;
    }
    if (!PyCallable_Check(fn)) {
        PyErr_SetString(PyExc_TypeError, "on_route must be callable");
        return NULL;
    }
    if (self->ctx == NULL) {
        return raise_status(COLIBRI_E_BAD_CONTEXT);
    }
    if (batch < 0) {
        return raise_status(COLIBRI_E_BAD_BATCH);
    }
    Py_buffer in, out;
    if (PyObject_GetBuffer(in_obj, &in, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        return NULL;
    }
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&in);
        return NULL;
    }
    PyObject *result = NULL;
    if (in.itemsize != 4 || out.itemsize != 4 || in.format == NULL || out.format == NULL ||
        strcmp(in.format, "f") != 0 || strcmp(out.format, "f") != 0) {
        PyErr_SetString(PyExc_TypeError, "input and output must be float32 buffers");
    } else {
        int st;
        route_call rc = {fn, 0};
        colibri_exec exec = COLIBRI_EXEC_INIT;
        exec.on_route = py_on_route;
        exec.on_route_user = &rc;
        Py_BEGIN_ALLOW_THREADS
        PyThread_acquire_lock(self->lock, WAIT_LOCK);
        st = colibri_forward_ex(self->ctx, &exec, (size_t)batch, (const float *)in.buf, (size_t)(in.len / 4),
                                (float *)out.buf, (size_t)(out.len / 4));
        PyThread_release_lock(self->lock);
        Py_END_ALLOW_THREADS
        if (rc.raised)
            result = NULL; /* the callback's exception is set */
        else
            result = st == COLIBRI_OK ? (Py_INCREF(Py_None), Py_None) : raise_status(st);
    }
    PyBuffer_Release(&in);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *Context_info(ContextObject *self, PyObject *Py_UNUSED(ignored)) {
    const colibri_model_info *i = &self->info;
    return Py_BuildValue(
        "{sIsIsIsIsIsIsIsIsIsIsIsKsn}", "format_version", i->format_version, "image_size", i->image_size,
        "flags", i->flags, "input_size", i->input_size, "output_size", i->output_size, "max_batch",
        i->max_batch, "num_layers", i->num_layers, "num_tensors", i->num_tensors, "num_moe_layers",
        i->num_moe_layers, "num_experts", i->num_experts, "num_shared_experts", i->num_shared_experts,
        "num_parameters", (unsigned long long)i->num_parameters, "arena_size", (Py_ssize_t)i->arena_size);
}

static PyObject *Context_kernels(ContextObject *self, PyObject *Py_UNUSED(ignored)) {
    return PyUnicode_FromString(colibri_kernels_name(self->ctx));
}

static PyMethodDef Context_methods[] = {
    {"kernels", (PyCFunction)Context_kernels, METH_NOARGS, "the kernels forward runs: 'reference' or the backend"},
    {"forward", (PyCFunction)Context_forward, METH_VARARGS, "forward(input, output, batch)"},
    {"forward_ex", (PyCFunction)Context_forward_ex, METH_VARARGS,
     "forward_ex(input, output, batch, on_route): colibri_forward_ex with on_route(layer, experts, tokens)"},
    {"info", (PyCFunction)Context_info, METH_NOARGS, "model info as a dict"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ContextType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "colibri._engine.Context",
    .tp_basicsize = sizeof(ContextObject),
    .tp_dealloc = (destructor)Context_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A Colibri engine context over one model image.",
    .tp_methods = Context_methods,
    .tp_init = (initproc)Context_init,
    .tp_new = PyType_GenericNew,
};

static PyObject *with_image(PyObject *obj, int (*fn)(const void *, size_t, void *), void *out) {
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_CONTIG_RO) < 0) {
        return NULL;
    }
    int st = fn(view.buf, (size_t)view.len, out);
    PyBuffer_Release(&view);
    return PyLong_FromLong(st);
}

static int do_validate(const void *img, size_t len, void *out) {
    (void)out;
    return colibri_validate(img, len);
}

static int do_size(const void *img, size_t len, void *out) {
    return colibri_model_size(img, len, (size_t *)out);
}

static PyObject *mod_validate(PyObject *self, PyObject *image) {
    (void)self;
    return with_image(image, do_validate, NULL);
}

static PyObject *mod_model_size(PyObject *self, PyObject *image) {
    (void)self;
    size_t size = 0;
    PyObject *st = with_image(image, do_size, &size);
    if (st == NULL) {
        return NULL;
    }
    return Py_BuildValue("(Nn)", st, (Py_ssize_t)size);
}

static PyObject *mod_strerror(PyObject *self, PyObject *code) {
    (void)self;
    long c = PyLong_AsLong(code);
    if (c == -1 && PyErr_Occurred()) {
        return NULL;
    }
    return PyUnicode_FromString(colibri_strerror((int)c));
}

static PyObject *mod_version(PyObject *self, PyObject *Py_UNUSED(ignored)) {
    (void)self;
    return PyUnicode_FromString(colibri_version());
}

static PyMethodDef module_methods[] = {
    {"validate", mod_validate, METH_O, "validate(image) -> status"},
    {"model_size", mod_model_size, METH_O, "model_size(image) -> (status, arena bytes)"},
    {"strerror", mod_strerror, METH_O, "strerror(status) -> str"},
    {"version", mod_version, METH_NOARGS, "engine version"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef engine_module = {
    PyModuleDef_HEAD_INIT, "colibri._engine", "The Colibri C engine.", -1, module_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__engine(void) {
    if (PyType_Ready(&ContextType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&engine_module);
    if (m == NULL) {
        return NULL;
    }
    EngineError = PyErr_NewException("colibri._engine.EngineError", NULL, NULL);
    Py_INCREF(&ContextType);
    if (EngineError == NULL || PyModule_AddObject(m, "Context", (PyObject *)&ContextType) < 0 ||
        PyModule_AddObject(m, "EngineError", EngineError) < 0 ||
        PyModule_AddStringConstant(m, "SOURCE_HASH", COLIBRI_SOURCE_HASH) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
