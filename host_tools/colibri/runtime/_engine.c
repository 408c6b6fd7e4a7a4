/*
 * CPython binding of the Colibri C engine: colibri.runtime._engine.
 *
 * A Context keeps the image buffer exported (so it cannot move or shrink),
 * owns the arena, and releases the GIL during forward so contexts run in
 * parallel from Python threads. colibri/runtime/engine.py wraps it with numpy.
 *
 * A File is a model file mapped by the POSIX layer (posix/colibri_file.h),
 * the same path as libcolibri's users: it exports the mapping as a read-only
 * buffer, so a Context over a File reads the weights in place, and checks
 * before each forward that the file was not truncated under the mapping.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <string.h>

#include "pythread.h"

#include "colibri.h"
#include "colibri_file.h"
#include "colibri_pool.h"
#include "colibri_tokenizer.h"

/* setup.py passes the hash of the sources it builds from (colibri/runtime/sources.py), so
 * a checkout can tell this binary is stale after a C edit. A build without it
 * (`scripts/source_hash.py hash` gives the value) is refused in a checkout. */
#ifndef COLIBRI_SOURCE_HASH
#define COLIBRI_SOURCE_HASH "unknown"
#endif

/* A context's arena (below: "Arena and Lease"). */
typedef struct {
    PyObject_HEAD
    void *mem;
    size_t size;
} ArenaObject;

/* ---- File: a mapped model file ---- */

typedef struct {
    PyObject_HEAD
    colibri_file *file;
    Py_ssize_t exports; /* buffers handed out: the mapping stays until they are released */
} FileObject;

static PyTypeObject FileType;

typedef struct {
    PyObject_HEAD
    Py_buffer image_view; /* the caller's buffer, held for the context's life */
    void *image_copy;     /* aligned copy when the buffer is not 4-byte aligned */
    void *arena;             /* arena_owner's memory */
    ArenaObject *arena_owner;
    colibri_ctx *ctx;
    colibri_model_info info;
    PyThread_type_lock lock; /* one forward at a time per context; contexts run in parallel */
    int has_view;
    FileObject *file;        /* the mapped file the image is, or NULL */
    int advise;              /* with a file: forward through colibri_file_on_route (WILLNEED + verify on use) */
    colibri_pool *pool;      /* workers > 1: the token model's threads (colibri_lm_forward_ex), else NULL */
    colibri_exec exec;       /* parallel_for over the pool */
    size_t arena_size;       /* bytes allocated: colibri_model_size_ex for the workers */
} ContextObject;


static PyObject *status_error(int status) {
    return Py_BuildValue("(is)", status, colibri_strerror(status));
}

/* Raises colibri.runtime._engine.EngineError(status, message); engine.py maps it to ColibriError subclasses. */
static PyObject *EngineError;

static PyObject *raise_status(int status) {
    PyObject *args = status_error(status);
    if (args != NULL) {
        PyErr_SetObject(EngineError, args);
        Py_DECREF(args);
    }
    return NULL;
}

/* File(path, verify=0, lock=0, lock_experts=()) -> raises EngineError(status, message, errno, memlock_limit,
 * lock_bytes) on failure. */
static int File_init(FileObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"path", "verify", "lock", "lock_experts", NULL};
    PyObject *path_obj, *experts = NULL;
    unsigned int verify = COLIBRI_VERIFY_ON_USE, lock = COLIBRI_LOCK_NONE;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&|IIO", kwlist, PyUnicode_FSConverter, &path_obj, &verify, &lock,
                                     &experts)) {
        return -1;
    }
    if (self->file != NULL) {
        Py_DECREF(path_obj);
        PyErr_SetString(PyExc_RuntimeError, "File already open");
        return -1;
    }
    colibri_file_options opts = {.lock = lock, .verify = verify};
    colibri_expert_id *ids = NULL;
    Py_ssize_t n = 0;
    if (experts != NULL && experts != Py_None) {
        PyObject *seq = PySequence_Fast(experts, "lock_experts must be a sequence of (layer, expert) pairs");
        if (seq == NULL) {
            Py_DECREF(path_obj);
            return -1;
        }
        n = PySequence_Fast_GET_SIZE(seq);
        ids = PyMem_RawCalloc(n ? (size_t)n : 1u, sizeof *ids);
        for (Py_ssize_t i = 0; ids != NULL && i < n; i++) {
            unsigned int l, e;
            if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "II", &l, &e)) {
                PyMem_RawFree(ids);
                Py_DECREF(seq);
                Py_DECREF(path_obj);
                return -1;
            }
            ids[i].layer = l;
            ids[i].expert = e;
        }
        Py_DECREF(seq);
        if (ids == NULL) {
            Py_DECREF(path_obj);
            PyErr_NoMemory();
            return -1;
        }
        opts.lock_experts = ids;
        opts.lock_count = (size_t)n;
    }
    colibri_file_diag diag;
    colibri_status st;
    const char *path = PyBytes_AS_STRING(path_obj);
    Py_BEGIN_ALLOW_THREADS
    st = colibri_file_open(&self->file, path, &opts, &diag);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(ids);
    Py_DECREF(path_obj);
    if (st != COLIBRI_OK) {
        PyObject *a = Py_BuildValue("(isiKKII)", (int)st, colibri_strerror(st), diag.sys_errno,
                                    (unsigned long long)diag.memlock_limit, (unsigned long long)diag.lock_bytes,
                                    diag.expert.layer, diag.expert.expert);
        if (a != NULL) {
            PyErr_SetObject(EngineError, a);
            Py_DECREF(a);
        }
        return -1;
    }
    return 0;
}

static void File_dealloc(FileObject *self) {
    colibri_file_close(self->file);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int File_getbuffer(FileObject *self, Py_buffer *view, int flags) {
    if (self->file == NULL) {
        PyErr_SetString(PyExc_ValueError, "model file is closed");
        view->obj = NULL;
        return -1;
    }
    if (PyBuffer_FillInfo(view, (PyObject *)self, (void *)(uintptr_t)colibri_file_data(self->file),
                          (Py_ssize_t)colibri_file_size(self->file), 1, flags) < 0) {
        return -1;
    }
    self->exports++;
    return 0;
}

static void File_releasebuffer(FileObject *self, Py_buffer *view) {
    (void)view;
    self->exports--;
}

static PyBufferProcs File_as_buffer = {
    .bf_getbuffer = (getbufferproc)File_getbuffer,
    .bf_releasebuffer = (releasebufferproc)File_releasebuffer,
};

static colibri_file *open_file(FileObject *self) {
    if (self->file == NULL) {
        PyErr_SetString(PyExc_ValueError, "model file is closed");
    }
    return self->file;
}

/* will_need(layer, experts) */
static PyObject *File_will_need(FileObject *self, PyObject *args) {
    unsigned int layer;
    PyObject *experts;
    colibri_file *f = open_file(self);
    if (f == NULL || !PyArg_ParseTuple(args, "IO", &layer, &experts)) {
        return NULL;
    }
    PyObject *seq = PySequence_Fast(experts, "experts must be a sequence of ints");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    uint32_t *ids = PyMem_RawCalloc(n ? (size_t)n : 1u, sizeof *ids);
    if (ids == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long v = PyLong_AsUnsignedLong(PySequence_Fast_GET_ITEM(seq, i));
        if (PyErr_Occurred()) {
            PyMem_RawFree(ids);
            Py_DECREF(seq);
            return NULL;
        }
        ids[i] = v > UINT32_MAX ? UINT32_MAX : (uint32_t)v;
    }
    Py_DECREF(seq);
    colibri_status st;
    Py_BEGIN_ALLOW_THREADS
    st = colibri_file_will_need(f, layer, ids, (size_t)n);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(ids);
    return st == COLIBRI_OK ? (Py_INCREF(Py_None), Py_None) : raise_status(st);
}

static PyObject *File_verify(FileObject *self, PyObject *Py_UNUSED(ignored)) {
    colibri_file *f = open_file(self);
    if (f == NULL) {
        return NULL;
    }
    colibri_status st;
    Py_BEGIN_ALLOW_THREADS
    st = colibri_file_verify(f);
    Py_END_ALLOW_THREADS
    return st == COLIBRI_OK ? (Py_INCREF(Py_None), Py_None) : raise_status(st);
}

static PyObject *File_verify_expert(FileObject *self, PyObject *args) {
    unsigned int layer, expert;
    colibri_file *f = open_file(self);
    if (f == NULL || !PyArg_ParseTuple(args, "II", &layer, &expert)) {
        return NULL;
    }
    colibri_status st = colibri_file_verify_expert(f, layer, expert);
    return st == COLIBRI_OK ? (Py_INCREF(Py_None), Py_None) : raise_status(st);
}

static PyObject *File_expert_range(FileObject *self, PyObject *args) {
    unsigned int layer, expert;
    size_t off = 0, size = 0;
    colibri_file *f = open_file(self);
    if (f == NULL || !PyArg_ParseTuple(args, "II", &layer, &expert)) {
        return NULL;
    }
    colibri_status st = colibri_file_expert_range(f, layer, expert, &off, &size);
    return st == COLIBRI_OK ? Py_BuildValue("(nn)", (Py_ssize_t)off, (Py_ssize_t)size) : raise_status(st);
}

static PyObject *File_experts(FileObject *self, PyObject *Py_UNUSED(ignored)) {
    colibri_file *f = open_file(self);
    if (f == NULL) {
        return NULL;
    }
    const uint32_t n = colibri_file_moe_layers(f);
    PyObject *out = PyList_New((Py_ssize_t)n);
    for (uint32_t i = 0; out != NULL && i < n; i++) {
        PyList_SET_ITEM(out, (Py_ssize_t)i, PyLong_FromUnsignedLong(colibri_file_layer_experts(f, i)));
    }
    return out;
}

static PyObject *File_check(FileObject *self, PyObject *Py_UNUSED(ignored)) {
    colibri_file *f = open_file(self);
    return f == NULL ? NULL : PyLong_FromLong(colibri_file_check(f));
}

static PyObject *File_replaced(FileObject *self, PyObject *Py_UNUSED(ignored)) {
    colibri_file *f = open_file(self);
    return f == NULL ? NULL : PyBool_FromLong(colibri_file_replaced(f));
}

static PyObject *File_resident(FileObject *self, PyObject *Py_UNUSED(ignored)) {
    colibri_file *f = open_file(self);
    return f == NULL ? NULL : PyLong_FromLongLong(colibri_file_resident(f));
}

static PyObject *File_set_ahead(FileObject *self, PyObject *args) {
    unsigned int stages;
    colibri_file *f = open_file(self);
    if (f == NULL || !PyArg_ParseTuple(args, "I", &stages)) {
        return NULL;
    }
    colibri_status st = colibri_file_set_ahead(f, stages);
    return st == COLIBRI_OK ? (Py_INCREF(Py_None), Py_None) : raise_status(st);
}

static PyObject *File_advice(FileObject *self, PyObject *Py_UNUSED(ignored)) {
    colibri_file_advice a;
    colibri_file *f = open_file(self);
    if (f == NULL) {
        return NULL;
    }
    colibri_status st = colibri_file_advice_counts(f, &a);
    if (st != COLIBRI_OK) {
        return raise_status(st);
    }
    return Py_BuildValue("(KKKKKKKK)", (unsigned long long)a.route_calls, (unsigned long long)a.route_bytes,
                         (unsigned long long)a.ahead_calls, (unsigned long long)a.ahead_bytes,
                         (unsigned long long)a.route_advised, (unsigned long long)a.ahead_advised,
                         (unsigned long long)a.requests, (unsigned long long)a.request_bytes);
}

static PyObject *File_set_request_bytes(FileObject *self, PyObject *args) {
    Py_ssize_t bytes;
    colibri_file *f = open_file(self);
    if (f == NULL || !PyArg_ParseTuple(args, "n", &bytes)) {
        return NULL;
    }
    if (bytes < 0) {
        return raise_status(COLIBRI_E_UNSUPPORTED);
    }
    colibri_status st = colibri_file_set_request_bytes(f, (size_t)bytes);
    return st == COLIBRI_OK ? (Py_INCREF(Py_None), Py_None) : raise_status(st);
}

static PyObject *File_ahead_ranges(FileObject *self, PyObject *args) {
    unsigned int stage;
    size_t count = 0;
    colibri_file *f = open_file(self);
    if (f == NULL || !PyArg_ParseTuple(args, "I", &stage)) {
        return NULL;
    }
    colibri_status st = colibri_file_ahead_ranges(f, stage, &count, NULL, 0);
    if (st != COLIBRI_OK) {
        return raise_status(st);
    }
    uint64_t *r = PyMem_RawMalloc(2u * (count ? count : 1u) * sizeof *r);
    if (r == NULL) {
        return PyErr_NoMemory();
    }
    st = colibri_file_ahead_ranges(f, stage, &count, r, 2u * count);
    PyObject *out = st == COLIBRI_OK ? PyList_New((Py_ssize_t)count) : raise_status(st);
    for (size_t i = 0; out != NULL && i < count; i++) {
        PyObject *t = Py_BuildValue("(KK)", (unsigned long long)r[2u * i], (unsigned long long)r[2u * i + 1u]);
        if (t == NULL) {
            Py_CLEAR(out);
        } else {
            PyList_SET_ITEM(out, (Py_ssize_t)i, t);
        }
    }
    PyMem_RawFree(r);
    return out;
}

static PyObject *File_close(FileObject *self, PyObject *Py_UNUSED(ignored)) {
    if (self->exports > 0) {
        PyErr_SetString(PyExc_BufferError, "model file still in use (a Model or memoryview holds its mapping)");
        return NULL;
    }
    colibri_file_close(self->file);
    self->file = NULL;
    Py_RETURN_NONE;
}

static PyMethodDef File_methods[] = {
    {"will_need", (PyCFunction)File_will_need, METH_VARARGS,
     "will_need(layer, experts): read-ahead requests for their missing pages (+ verify on use)"},
    {"verify", (PyCFunction)File_verify, METH_NOARGS, "verify every payload now"},
    {"verify_expert", (PyCFunction)File_verify_expert, METH_VARARGS, "verify_expert(layer, expert)"},
    {"expert_range", (PyCFunction)File_expert_range, METH_VARARGS, "expert_range(layer, expert) -> (offset, size)"},
    {"experts", (PyCFunction)File_experts, METH_NOARGS, "slots (routed + shared) of each MoE layer"},
    {"check", (PyCFunction)File_check, METH_NOARGS, "0, or FILE_CHANGED if the file's size changed under the mapping"},
    {"replaced", (PyCFunction)File_replaced, METH_NOARGS, "whether the path now names another file"},
    {"resident", (PyCFunction)File_resident, METH_NOARGS, "bytes of the mapping resident now (mincore)"},
    {"set_ahead", (PyCFunction)File_set_ahead, METH_VARARGS, "set_ahead(stages): colibri_file_set_ahead"},
    {"advice", (PyCFunction)File_advice, METH_NOARGS,
     "(route calls, route bytes, ahead calls, ahead bytes, route advised, ahead advised, requests, "
     "request bytes) so far"},
    {"set_request_bytes", (PyCFunction)File_set_request_bytes, METH_VARARGS,
     "set_request_bytes(n): colibri_file_set_request_bytes"},
    {"ahead_ranges", (PyCFunction)File_ahead_ranges, METH_VARARGS,
     "ahead_ranges(stage) -> [(start, end)]: the page ranges the advice ahead covers for a stage"},
    {"close", (PyCFunction)File_close, METH_NOARGS, "unmap (refused while a buffer is exported)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject FileType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "colibri.runtime._engine.File",
    .tp_basicsize = sizeof(FileObject),
    .tp_dealloc = (destructor)File_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A model file mapped read-only by the POSIX layer (posix/colibri_file.h).",
    .tp_methods = File_methods,
    .tp_as_buffer = &File_as_buffer,
    .tp_init = (initproc)File_init,
    .tp_new = PyType_GenericNew,
};

/* ---- Arena and Lease: memory lent to Python outlives the context that lent it ----
 *
 * A Context's arena is an Arena object, so the memory stays allocated while anything still
 * refers to it. The expert hook's rows are memoryviews of Lease objects: each a window onto the
 * arena (or onto the caller's input or output buffer, which the lease then holds) that keeps
 * its owner alive. When the call returns the lease is revoked (no new export) and its
 * memoryview released, so using it raises; an array the hook made from it and kept holds the
 * memory alive instead: writing it later changes numbers of a later pass at worst, never freed
 * memory. */

static void Arena_dealloc(ArenaObject *self) {
    PyMem_RawFree(self->mem);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject ArenaType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "colibri._engine.Arena",
    .tp_basicsize = sizeof(ArenaObject),
    .tp_dealloc = (destructor)Arena_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A context's arena, alive while a context or a lease refers to it.",
};

/* A new Arena of `bytes` (8-byte aligned, as PyMem_RawMalloc), or NULL with MemoryError. */
static ArenaObject *arena_new(size_t bytes) {
    ArenaObject *a = PyObject_New(ArenaObject, &ArenaType);
    if (a == NULL) {
        return NULL;
    }
    a->size = bytes;
    a->mem = PyMem_RawMalloc(bytes ? bytes : 1u);
    if (a->mem == NULL) {
        Py_DECREF(a);
        PyErr_NoMemory();
        return NULL;
    }
    return a;
}

typedef struct {
    PyObject_HEAD
    PyObject *owner; /* what keeps the memory allocated: an Arena or the caller's buffer object */
    void *buf;
    Py_ssize_t len;
    int readonly;
    int revoked;     /* the call returned: no new export */
} LeaseObject;

static void Lease_dealloc(LeaseObject *self) {
    Py_XDECREF(self->owner);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Lease_getbuffer(LeaseObject *self, Py_buffer *view, int flags) {
    if (self->revoked) {
        PyErr_SetString(PyExc_ValueError, "the engine's rows are valid during the expert call only");
        view->obj = NULL;
        return -1;
    }
    return PyBuffer_FillInfo(view, (PyObject *)self, self->buf, self->len, self->readonly, flags);
}

static PyBufferProcs Lease_as_buffer = {.bf_getbuffer = (getbufferproc)Lease_getbuffer};

static PyTypeObject LeaseType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "colibri._engine.Lease",
    .tp_basicsize = sizeof(LeaseObject),
    .tp_dealloc = (destructor)Lease_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A window onto memory the engine lends a callback for one call.",
    .tp_as_buffer = &Lease_as_buffer,
};

/* A memoryview of [p, p + bytes) through a new Lease holding `owner`; *lease receives it. */
static PyObject *lease_view(PyObject *owner, const void *p, size_t bytes, int writable, LeaseObject **lease) {
    LeaseObject *l = PyObject_New(LeaseObject, &LeaseType);
    *lease = NULL;
    if (l == NULL) {
        return NULL;
    }
    Py_INCREF(owner);
    l->owner = owner;
    l->buf = (void *)(uintptr_t)p;
    l->len = (Py_ssize_t)bytes;
    l->readonly = !writable;
    l->revoked = 0;
    PyObject *view = PyMemoryView_FromObject((PyObject *)l);
    if (view == NULL) {
        Py_DECREF(l);
        return NULL;
    }
    *lease = l;
    return view;
}

/* ---- Context ---- */

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
    colibri_pool_destroy(self->pool);
    Py_XDECREF(self->arena_owner); /* the memory goes with the last lease of it */
    PyMem_RawFree(self->image_copy);
    if (self->has_view) {
        PyBuffer_Release(&self->image_view);
    }
    Py_XDECREF(self->file);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Context_init(ContextObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"image", "reference_kernels", "check", "advise", "workers", NULL};
    PyObject *image;
    int reference = 0, advise = 1;
    unsigned int check = COLIBRI_CHECK_FULL;
    Py_ssize_t workers = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|pIpn", kwlist, &image, &reference, &check, &advise, &workers)) {
        return -1;
    }
    if (workers < 1 || (size_t)workers > COLIBRI_POOL_MAX_WORKERS) {
        raise_status(COLIBRI_E_BAD_EXEC);
        return -1;
    }
    self->advise = advise;
    if (self->has_view) {
        PyErr_SetString(PyExc_RuntimeError, "Context already initialised");
        return -1;
    }
    if (PyObject_GetBuffer(image, &self->image_view, PyBUF_CONTIG_RO) < 0) {
        return -1;
    }
    self->has_view = 1;
    if (PyObject_TypeCheck(image, &FileType)) {
        Py_INCREF(image);
        self->file = (FileObject *)image;
    }
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
    int st = colibri_model_size_ex(image_bytes(self), len, (size_t)workers, &arena_size);
    if (st == COLIBRI_OK && workers > 1) {
        self->exec = (colibri_exec)COLIBRI_EXEC_INIT;
        if ((st = colibri_pool_create(&self->pool, (size_t)workers)) == COLIBRI_OK) {
            colibri_pool_attach(self->pool, &self->exec);
        }
    }
    self->arena_size = arena_size;
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
    if ((self->arena_owner = arena_new(arena_size)) == NULL) {
        return -1;
    }
    self->arena = self->arena_owner->mem;
    st = colibri_init_ex(&self->ctx, self->arena, arena_size, image_bytes(self), len, check);
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

/* The context, or NULL with EngineError(BAD_CONTEXT) set: a Context made by __new__ without a
 * successful __init__ (or whose __init__ failed) has no engine context and no lock, and every
 * method refuses it rather than dereference either. */
static colibri_ctx *ready(ContextObject *self) {
    if (self->ctx == NULL || self->lock == NULL) {
        raise_status(COLIBRI_E_BAD_CONTEXT);
        return NULL;
    }
    return self->ctx;
}

/* COLIBRI_OK, or FILE_CHANGED once a mapped model's file no longer has the size that was mapped:
 * checked before every pass that reads the mapping, as the truncated pages would raise SIGBUS. */
static colibri_status file_unchanged(const ContextObject *self) {
    return self->file != NULL && self->file->file != NULL ? colibri_file_check(self->file->file) : COLIBRI_OK;
}

/* colibri_exec.on_route into a Python callable: on_route(layer, experts, tokens) with the
 * expert records about to run (routed ones with tokens, then the shared ones) and each one's
 * token count. Runs with the GIL taken back; an exception stops the pass and is re-raised. */
typedef struct route_call {
    PyObject *fn;
    int raised;
    colibri_file *file; /* a mapped model: its pages advised and experts verified first */
} route_call;

static colibri_status py_on_route(void *user, const colibri_route *r) {
    route_call *rc = user;
    colibri_status st = COLIBRI_OK;
    if (rc->file != NULL && (st = colibri_file_on_route(rc->file, r)) != COLIBRI_OK) {
        return st;
    }
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

/* The exec of a token-model call: the pool's parallel_for (workers > 1), and on_route: a Python
 * callable (rc->fn, which advises a mapped file first), else the file layer's own advice and verify
 * on use (a mapped model unless advise is off), else none. */
static colibri_exec lm_exec(const ContextObject *self, route_call *rc) {
    colibri_exec e = self->pool != NULL ? self->exec : (colibri_exec)COLIBRI_EXEC_INIT;
    if (rc->fn != NULL) {
        e.on_route = py_on_route;
        e.on_route_user = rc;
    } else if (rc->file != NULL) {
        e.on_route = colibri_file_on_route;
        e.on_route_user = rc->file;
    }
    return e;
}

/* colibri_exec.expert into a Python callable (the accelerator hook, include/colibri.h):
 * fn(layer, expert, kind, activation, d, hidden, payloads, n, x, x_rows, gate, y, y_rows) with
 * payloads the byte offsets in the image of (w1, w2, w3, b1, b2, b3), -1 for an absent one (engine.py
 * turns them into numpy views of the image), and x, x_rows, gate, y, y_rows memoryviews of the
 * engine's own rows, not copies: x [rows, d] f32, y [rows, d] f32 writable, with rows the batch
 * through an index list and n without one. They are released after the call: a view kept past it
 * would read the arena of a later pass. fn returns True once it has accumulated into y, False to
 * decline (the engine runs the expert); an exception stops the pass and is re-raised. */
typedef struct expert_hook {
    PyObject *fn;
    int raised;
    const uint8_t *image;
    size_t batch;
    /* Where rows may lie, each with the object that keeps it allocated: the arena, and the
     * caller's input and output (read or written in place by the first and last layers). */
    PyObject *owner[3];
    const uint8_t *start[3];
    size_t size[3];
} expert_hook;

static PyObject *rows_view(const expert_hook *h, const void *p, size_t bytes, int writable, LeaseObject **lease) {
    *lease = NULL;
    if (p == NULL) {
        Py_RETURN_NONE;
    }
    const uint8_t *b = p;
    for (int i = 0; i < 3; i++) {
        if (h->owner[i] != NULL && b >= h->start[i] && bytes <= h->size[i] && (size_t)(b - h->start[i]) <= h->size[i] - bytes) {
            return lease_view(h->owner[i], p, bytes, writable, lease);
        }
    }
    PyErr_SetString(PyExc_SystemError, "expert rows outside the arena and the caller's buffers");
    return NULL;
}

static colibri_status py_expert(void *user, const colibri_expert_call *c) {
    expert_hook *h = user;
    PyGILState_STATE g = PyGILState_Ensure();
    const void *payload[6] = {c->w1, c->w2, c->w3, c->b1, c->b2, c->b3};
    PyObject *offsets = PyTuple_New(6);
    const size_t x_n = c->x_rows ? h->batch : c->n, y_n = c->y_rows ? h->batch : c->n;
    LeaseObject *lease[5];
    PyObject *view[5] = {rows_view(h, c->x, x_n * c->d * sizeof(float), 0, &lease[0]),
                         rows_view(h, c->x_rows, c->n * sizeof(uint16_t), 0, &lease[1]),
                         rows_view(h, c->gate, c->n * sizeof(float), 0, &lease[2]),
                         rows_view(h, c->y, y_n * c->d * sizeof(float), 1, &lease[3]),
                         rows_view(h, c->y_rows, c->n * sizeof(uint16_t), 0, &lease[4])};
    int ok = offsets != NULL;
    for (int i = 0; i < 5; i++)
        ok = ok && view[i] != NULL;
    for (Py_ssize_t i = 0; ok && i < 6; i++) {
        PyObject *o = PyLong_FromSsize_t(payload[i] ? (Py_ssize_t)((const uint8_t *)payload[i] - h->image) : -1);
        ok = o != NULL;
        if (ok)
            PyTuple_SET_ITEM(offsets, i, o);
    }
    PyObject *res = NULL;
    if (ok)
        res = PyObject_CallFunction(h->fn, "IIIIIIOnOOOOO", (unsigned)c->layer, (unsigned)c->expert, (unsigned)c->kind,
                                    (unsigned)c->activation, (unsigned)c->d, (unsigned)c->hidden, offsets,
                                    (Py_ssize_t)c->n, view[0], view[1], view[2], view[3], view[4]);
    colibri_status st = COLIBRI_OK;
    int truth = res ? PyObject_IsTrue(res) : -1;
    if (truth < 0) {
        h->raised = 1;
        st = COLIBRI_E_BAD_EXEC;
    } else if (!truth) {
        st = COLIBRI_EXPERT_DECLINED;
    }
    Py_XDECREF(res);
    Py_XDECREF(offsets);
    /* The callable's exception waits while the views are released; a view still exported (an
     * array the callable kept) refuses, and stays valid only as long as the docs say: the call. */
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    for (int i = 0; i < 5; i++) {
        if (lease[i] != NULL) {
            lease[i]->revoked = 1;
        }
        if (view[i] != NULL && view[i] != Py_None) {
            PyObject *r = PyObject_CallMethod(view[i], "release", NULL);
            if (r == NULL)
                PyErr_Clear();
            Py_XDECREF(r);
        }
        Py_XDECREF(view[i]);
    }
    PyErr_Restore(type, value, tb);
    PyGILState_Release(g);
    return st;
}

/* forward_ex(input, output, batch, on_route): colibri_forward_ex with a Python on_route. */
/* One forward pass into Python: input/output are C-contiguous float32 buffers; fn, when not
 * NULL, is on_route(layer, experts, tokens). A mapped model checks its file first (truncated
 * in place it would SIGBUS the pass) and, unless advise is off, has the routed experts' pages
 * advised in and verified on first use before they run. */
static PyObject *context_forward(ContextObject *self, PyObject *in_obj, PyObject *out_obj, Py_ssize_t batch,
                                 PyObject *fn, PyObject *expert_fn) {
    if (ready(self) == NULL) {
        return NULL;
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
        route_call rc = {fn, 0, self->file != NULL && self->advise ? self->file->file : NULL};
        colibri_exec exec = COLIBRI_EXEC_INIT;
        expert_hook eh = {expert_fn, 0, image_bytes(self), (size_t)batch,
                          {(PyObject *)self->arena_owner, in_obj, out_obj},
                          {self->arena, in.buf, out.buf},
                          {self->arena_owner->size, (size_t)in.len, (size_t)out.len}};
        if (expert_fn != NULL) {
            exec.expert = py_expert;
            exec.expert_user = &eh;
        }
        if (fn != NULL) {
            exec.on_route = py_on_route;
            exec.on_route_user = &rc;
        } else if (rc.file != NULL) {
            exec.on_route = colibri_file_on_route;
            exec.on_route_user = rc.file;
        }
        Py_BEGIN_ALLOW_THREADS
        PyThread_acquire_lock(self->lock, WAIT_LOCK);
        st = file_unchanged(self);
        if (st == COLIBRI_OK && (exec.on_route != NULL || exec.expert != NULL))
            st = colibri_forward_ex(self->ctx, &exec, (size_t)batch, (const float *)in.buf, (size_t)(in.len / 4),
                                    (float *)out.buf, (size_t)(out.len / 4));
        else if (st == COLIBRI_OK)
            st = colibri_forward(self->ctx, (size_t)batch, (const float *)in.buf, (size_t)(in.len / 4),
                                 (float *)out.buf, (size_t)(out.len / 4));
        PyThread_release_lock(self->lock);
        Py_END_ALLOW_THREADS
        if (rc.raised || eh.raised)
            result = NULL; /* the callback's exception is set */
        else
            result = st == COLIBRI_OK ? (Py_INCREF(Py_None), Py_None) : raise_status(st);
    }
    PyBuffer_Release(&in);
    PyBuffer_Release(&out);
    return result;
}

/* forward(input, output, batch) */
static PyObject *Context_forward(ContextObject *self, PyObject *args) {
    PyObject *in_obj, *out_obj;
    Py_ssize_t batch;
    if (!PyArg_ParseTuple(args, "OOn", &in_obj, &out_obj, &batch)) {
        return NULL;
    }
    return context_forward(self, in_obj, out_obj, batch, NULL, NULL);
}

/* forward_ex(input, output, batch, on_route, expert=None): either callable may be None */
static PyObject *Context_forward_ex(ContextObject *self, PyObject *args) {
    PyObject *in_obj, *out_obj, *fn, *expert_fn = Py_None;
    Py_ssize_t batch;
    if (!PyArg_ParseTuple(args, "OOnO|O", &in_obj, &out_obj, &batch, &fn, &expert_fn)) {
        return NULL;
    }
    if (fn != Py_None && !PyCallable_Check(fn)) {
        PyErr_SetString(PyExc_TypeError, "on_route must be callable");
        return NULL;
    }
    if (expert_fn != Py_None && !PyCallable_Check(expert_fn)) {
        PyErr_SetString(PyExc_TypeError, "expert must be callable");
        return NULL;
    }
    return context_forward(self, in_obj, out_obj, batch, fn == Py_None ? NULL : fn,
                           expert_fn == Py_None ? NULL : expert_fn);
}

static PyObject *Context_info(ContextObject *self, PyObject *Py_UNUSED(ignored)) {
    const colibri_model_info *i = &self->info;
    return Py_BuildValue(
        "{sIsIsIsIsIsIsIsIsIsIsIsKsnsIsIsn}", "format_version", i->format_version, "image_size", i->image_size,
        "flags", i->flags, "input_size", i->input_size, "output_size", i->output_size, "max_batch",
        i->max_batch, "num_layers", i->num_layers, "num_tensors", i->num_tensors, "num_moe_layers",
        i->num_moe_layers, "num_experts", i->num_experts, "num_shared_experts", i->num_shared_experts,
        "num_parameters", (unsigned long long)i->num_parameters, "arena_size", (Py_ssize_t)i->arena_size,
        "vocab_size", i->vocab_size, "max_seq_len", i->max_seq_len, "kv_cache_bytes",
        (Py_ssize_t)i->kv_cache_bytes);
}

/* ---- Token models (docs/lm.md) ---- */

/* Under the context's lock, as every call that reads or writes the sequence: a reset from one
 * thread waits for a forward or a generation running in another instead of cutting into it. */
static PyObject *Context_lm_reset(ContextObject *self, PyObject *Py_UNUSED(ignored)) {
    if (ready(self) == NULL) {
        return NULL;
    }
    int st;
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(self->lock, WAIT_LOCK);
    st = colibri_lm_reset(self->ctx);
    PyThread_release_lock(self->lock);
    Py_END_ALLOW_THREADS
    if (st != COLIBRI_OK) {
        return raise_status(st);
    }
    Py_RETURN_NONE;
}

static PyObject *Context_lm_position(ContextObject *self, PyObject *Py_UNUSED(ignored)) {
    uint32_t pos = 0;
    if (ready(self) == NULL) {
        return NULL;
    }
    int st;
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(self->lock, WAIT_LOCK);
    st = colibri_lm_position(self->ctx, &pos);
    PyThread_release_lock(self->lock);
    Py_END_ALLOW_THREADS
    if (st != COLIBRI_OK) {
        return raise_status(st);
    }
    return PyLong_FromUnsignedLong(pos);
}

/* lm_forward(tokens, logits, n): tokens a C-contiguous int32 buffer of n ids, logits a
 * writable float32 buffer of n * vocab; colibri_lm_forward with the GIL released. */
static PyObject *Context_lm_forward(ContextObject *self, PyObject *args) {
    PyObject *tok_obj, *out_obj, *fn = Py_None;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "OOn|O", &tok_obj, &out_obj, &n, &fn) || ready(self) == NULL) {
        return NULL;
    }
    if (fn != Py_None && !PyCallable_Check(fn)) {
        PyErr_SetString(PyExc_TypeError, "on_route must be callable");
        return NULL;
    }
    if (n < 0 || n > (Py_ssize_t)UINT32_MAX) {
        return raise_status(COLIBRI_E_BAD_BATCH);
    }
    Py_buffer tok, out;
    if (PyObject_GetBuffer(tok_obj, &tok, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        return NULL;
    }
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&tok);
        return NULL;
    }
    PyObject *result = NULL;
    if (tok.itemsize != 4 || out.itemsize != 4 || tok.format == NULL || out.format == NULL ||
        (strcmp(tok.format, "i") != 0 && strcmp(tok.format, "=i") != 0 && strcmp(tok.format, "<i") != 0) ||
        strcmp(out.format, "f") != 0) {
        PyErr_SetString(PyExc_TypeError, "tokens must be an int32 buffer and logits a float32 buffer");
    } else if (tok.len / 4 < n) {
        PyErr_SetString(PyExc_ValueError, "fewer tokens than n");
    } else {
        int st;
        route_call rc = {fn == Py_None ? NULL : fn, 0, self->file != NULL && self->advise ? self->file->file : NULL};
        const colibri_exec exec = lm_exec(self, &rc);
        Py_BEGIN_ALLOW_THREADS
        PyThread_acquire_lock(self->lock, WAIT_LOCK);
        st = file_unchanged(self);
        if (st == COLIBRI_OK)
            st = colibri_lm_forward_ex(self->ctx, &exec, (const int32_t *)tok.buf, (uint32_t)n, (float *)out.buf,
                                       (size_t)(out.len / 4));
        PyThread_release_lock(self->lock);
        Py_END_ALLOW_THREADS
        if (rc.raised)
            result = NULL; /* the callback's exception is set */
        else
            result = st == COLIBRI_OK ? (Py_INCREF(Py_None), Py_None) : raise_status(st);
    }
    PyBuffer_Release(&tok);
    PyBuffer_Release(&out);
    return result;
}

/* lm_sample(logits float32, temperature, top_k, top_p, rng_state) -> (token, rng_state):
 * colibri_lm_sample on one row, the SplitMix64 state passed in and out (tests hold it to
 * reference.sample bit for bit). */
static PyObject *Context_lm_sample(ContextObject *self, PyObject *args) {
    PyObject *obj;
    float temperature, top_p;
    unsigned int top_k;
    unsigned long long state;
    if (!PyArg_ParseTuple(args, "OfIfK", &obj, &temperature, &top_k, &top_p, &state) || ready(self) == NULL) {
        return NULL;
    }
    Py_buffer row;
    if (PyObject_GetBuffer(obj, &row, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        return NULL;
    }
    PyObject *result = NULL;
    if (row.itemsize != 4 || row.format == NULL || strcmp(row.format, "f") != 0) {
        PyErr_SetString(PyExc_TypeError, "logits must be a float32 buffer");
    } else {
        const colibri_sampler sampler = {(uint32_t)sizeof(colibri_sampler), temperature, top_k, top_p};
        colibri_rng rng = {(uint64_t)state};
        int32_t token = -1;
        int st;
        PyThread_acquire_lock(self->lock, WAIT_LOCK);
        st = colibri_lm_sample(self->ctx, &sampler, (const float *)row.buf, (size_t)(row.len / 4), &rng, &token);
        PyThread_release_lock(self->lock);
        result = st == COLIBRI_OK ? Py_BuildValue("(lK)", (long)token, (unsigned long long)rng.state)
                                  : raise_status(st);
    }
    PyBuffer_Release(&row);
    return result;
}

/* lm_generate(prompt, max_new, temperature, top_k, top_p, seed[, stop]) -> list of new ids: reset, the
 * prompt in chunks of max_batch, then one token at a time, each drawn by colibri_lm_sample from
 * the last row's logits with a SplitMix64 seeded once. The whole loop runs in C without the GIL. */
static PyObject *Context_lm_generate(ContextObject *self, PyObject *args) {
    PyObject *prompt_obj;
    Py_ssize_t max_new;
    float temperature, top_p;
    unsigned int top_k;
    unsigned long long seed;
    long long stop = -1; /* an id that ends the generation once drawn (EOS); -1: none */
    if (!PyArg_ParseTuple(args, "OnfIfK|L", &prompt_obj, &max_new, &temperature, &top_k, &top_p, &seed, &stop) ||
        ready(self) == NULL) {
        return NULL;
    }
    if (max_new < 0) {
        PyErr_SetString(PyExc_ValueError, "max_new_tokens must be >= 0");
        return NULL;
    }
    Py_buffer prompt;
    if (PyObject_GetBuffer(prompt_obj, &prompt, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        return NULL;
    }
    const size_t vocab = self->info.output_size, chunk = self->info.max_batch;
    const size_t n_prompt = (size_t)prompt.len / 4;
    int32_t *ids = PyMem_RawMalloc(((size_t)max_new + 1) * sizeof *ids);
    float *logits = PyMem_RawMalloc(chunk * (vocab ? vocab : 1) * sizeof *logits);
    PyObject *result = NULL;
    if (prompt.itemsize != 4 || prompt.format == NULL ||
        (strcmp(prompt.format, "i") != 0 && strcmp(prompt.format, "=i") != 0 && strcmp(prompt.format, "<i") != 0)) {
        PyErr_SetString(PyExc_TypeError, "the prompt must be an int32 buffer");
    } else if (n_prompt == 0) {
        PyErr_SetString(PyExc_ValueError, "the prompt must hold at least one token");
    } else if (ids == NULL || logits == NULL) {
        PyErr_NoMemory();
    } else {
        int st = COLIBRI_OK;
        size_t made = 0;
        const int32_t *p = prompt.buf;
        route_call rc = {NULL, 0, self->file != NULL && self->advise ? self->file->file : NULL};
        const colibri_exec exec = lm_exec(self, &rc);
        Py_BEGIN_ALLOW_THREADS
        PyThread_acquire_lock(self->lock, WAIT_LOCK);
        colibri_rng rng;
        colibri_rng_seed(&rng, (uint64_t)seed);
        const colibri_sampler sampler = {(uint32_t)sizeof(colibri_sampler), temperature, top_k, top_p};
        st = colibri_lm_reset(self->ctx);
        size_t last = 0; /* the row of the latest token's logits */
        for (size_t at = 0; st == COLIBRI_OK && at < n_prompt; at += chunk) {
            const size_t n = n_prompt - at < chunk ? n_prompt - at : chunk;
            if ((st = file_unchanged(self)) == COLIBRI_OK)
                st = colibri_lm_forward_ex(self->ctx, &exec, p + at, (uint32_t)n, logits, n * vocab);
            last = n - 1;
        }
        while (st == COLIBRI_OK && made < (size_t)max_new) {
            st = colibri_lm_sample(self->ctx, &sampler, logits + last * vocab, vocab, &rng, &ids[made]);
            if (st != COLIBRI_OK)
                break;
            if ((long long)ids[made] == stop) {
                made++;
                break;
            }
            /* The last new token needs no forward: nothing reads its logits. */
            if (++made < (size_t)max_new && (st = file_unchanged(self)) == COLIBRI_OK) {
                st = colibri_lm_forward_ex(self->ctx, &exec, &ids[made - 1], 1, logits, vocab);
                last = 0;
            }
        }
        PyThread_release_lock(self->lock);
        Py_END_ALLOW_THREADS
        if (st != COLIBRI_OK) {
            raise_status(st);
        } else {
            result = PyList_New((Py_ssize_t)made);
            for (size_t i = 0; result != NULL && i < made; i++) {
                PyObject *v = PyLong_FromLong(ids[i]);
                if (v == NULL) {
                    Py_CLEAR(result);
                } else {
                    PyList_SET_ITEM(result, (Py_ssize_t)i, v);
                }
            }
        }
    }
    PyMem_RawFree(ids);
    PyMem_RawFree(logits);
    PyBuffer_Release(&prompt);
    return result;
}

static PyObject *Context_kernels(ContextObject *self, PyObject *Py_UNUSED(ignored)) {
    if (ready(self) == NULL) {
        return NULL;
    }
    return PyUnicode_FromString(colibri_kernels_name(self->ctx));
}

static PyObject *Context_arena_size(ContextObject *self, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromSize_t(self->arena_size);
}

static PyMethodDef Context_methods[] = {
    {"kernels", (PyCFunction)Context_kernels, METH_NOARGS, "the kernels forward runs: 'reference' or the backend"},
    {"arena_size", (PyCFunction)Context_arena_size, METH_NOARGS,
     "bytes of the arena allocated: colibri_model_size_ex for the context's workers"},
    {"forward", (PyCFunction)Context_forward, METH_VARARGS, "forward(input, output, batch)"},
    {"forward_ex", (PyCFunction)Context_forward_ex, METH_VARARGS,
     "forward_ex(input, output, batch, on_route, expert=None): colibri_forward_ex with on_route(layer, experts, tokens) and the expert hook"},
    {"info", (PyCFunction)Context_info, METH_NOARGS, "model info as a dict"},
    {"lm_reset", (PyCFunction)Context_lm_reset, METH_NOARGS, "colibri_lm_reset: empty the KV cache"},
    {"lm_position", (PyCFunction)Context_lm_position, METH_NOARGS, "colibri_lm_position: positions cached"},
    {"lm_forward", (PyCFunction)Context_lm_forward, METH_VARARGS,
     "lm_forward(tokens int32, logits float32 [n * vocab], n, on_route=None): colibri_lm_forward_ex"},
    {"lm_sample", (PyCFunction)Context_lm_sample, METH_VARARGS,
     "lm_sample(logits float32 [vocab], temperature, top_k, top_p, rng_state) -> (token, rng_state)"},
    {"lm_generate", (PyCFunction)Context_lm_generate, METH_VARARGS,
     "lm_generate(prompt int32, max_new, temperature, top_k, top_p, seed[, stop]) -> list of new token ids, "
     "ending after stop if drawn"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ContextType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "colibri.runtime._engine.Context",
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

static int do_validate_structure(const void *img, size_t len, void *out) {
    (void)out;
    return colibri_validate_ex(img, len, COLIBRI_CHECK_STRUCTURE);
}

static PyObject *mod_validate_structure(PyObject *self, PyObject *image) {
    (void)self;
    return with_image(image, do_validate_structure, NULL);
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

/* model_size_ex(image, workers) -> (status, arena bytes) */
static PyObject *mod_model_size_ex(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer view;
    Py_ssize_t workers;
    if (!PyArg_ParseTuple(args, "y*n", &view, &workers)) {
        return NULL;
    }
    size_t size = 0;
    int st = workers < 0 ? COLIBRI_E_BAD_EXEC
                         : colibri_model_size_ex(view.buf, (size_t)view.len, (size_t)workers, &size);
    PyBuffer_Release(&view);
    return Py_BuildValue("(in)", st, (Py_ssize_t)size);
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

/* TextDecoder(image): the image's tokenizer section (colibri_tokenizer.h) and one text stream.
 * push(id) -> the bytes that token completes, flush() -> the rest, piece(id) -> the token's own
 * bytes, info() -> dict. The image buffer is held (read in place) for the decoder's life. */
typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int has_view;
    colibri_tokenizer tok;
    colibri_text_stream stream;
    uint8_t *out;
    size_t out_cap;
} TextDecoderObject;

static int TextDecoder_init(TextDecoderObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"image", NULL};
    PyObject *image;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O", kwlist, &image)) {
        return -1;
    }
    if (self->has_view) {
        PyErr_SetString(PyExc_RuntimeError, "TextDecoder is already initialised");
        return -1;
    }
    if (PyObject_GetBuffer(image, &self->view, PyBUF_CONTIG_RO) < 0) {
        return -1;
    }
    self->has_view = 1;
    int st;
    Py_BEGIN_ALLOW_THREADS
    st = colibri_tokenizer_open(&self->tok, self->view.buf, (size_t)self->view.len);
    Py_END_ALLOW_THREADS
    if (st != COLIBRI_OK) {
        raise_status(st);
        return -1;
    }
    self->out_cap = COLIBRI_TOKENIZER_DECODE_BYTES(self->tok.max_piece);
    self->out = PyMem_Malloc(self->out_cap);
    if (self->out == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    colibri_text_stream_init(&self->stream);
    return 0;
}

static void TextDecoder_dealloc(TextDecoderObject *self) {
    if (self->has_view) {
        PyBuffer_Release(&self->view);
    }
    PyMem_Free(self->out);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int decoder_ready(TextDecoderObject *self) {
    if (!self->has_view || self->out == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "TextDecoder is not initialised");
        return 0;
    }
    return 1;
}

static int token_arg(PyObject *arg, int32_t *id) {
    long v = PyLong_AsLong(arg);
    if (v == -1 && PyErr_Occurred()) {
        return 0;
    }
    *id = v < INT32_MIN || v > INT32_MAX ? -1 : (int32_t)v;
    return 1;
}

static PyObject *TextDecoder_push(TextDecoderObject *self, PyObject *arg) {
    int32_t id;
    if (!decoder_ready(self) || !token_arg(arg, &id)) {
        return NULL;
    }
    size_t n = 0;
    int st = colibri_tokenizer_decode(&self->tok, &self->stream, id, self->out, self->out_cap, &n);
    return st == COLIBRI_OK ? PyBytes_FromStringAndSize((const char *)self->out, (Py_ssize_t)n) : raise_status(st);
}

static PyObject *TextDecoder_flush(TextDecoderObject *self, PyObject *Py_UNUSED(ignored)) {
    if (!decoder_ready(self)) {
        return NULL;
    }
    size_t n = 0;
    int st = colibri_tokenizer_flush(&self->stream, self->out, self->out_cap, &n);
    return st == COLIBRI_OK ? PyBytes_FromStringAndSize((const char *)self->out, (Py_ssize_t)n) : raise_status(st);
}

static PyObject *TextDecoder_piece(TextDecoderObject *self, PyObject *arg) {
    int32_t id;
    if (!decoder_ready(self) || !token_arg(arg, &id)) {
        return NULL;
    }
    const uint8_t *bytes;
    size_t n;
    int st = colibri_tokenizer_piece(&self->tok, id, &bytes, &n);
    return st == COLIBRI_OK ? PyBytes_FromStringAndSize((const char *)bytes, (Py_ssize_t)n) : raise_status(st);
}

/* encode(text: bytes | str) -> list[int]: colibri_tokenizer_encode with buffers of the documented bounds. */
static PyObject *TextDecoder_encode(TextDecoderObject *self, PyObject *arg) {
    if (!decoder_ready(self)) {
        return NULL;
    }
    Py_buffer text;
    PyObject *utf8 = NULL;
    if (PyUnicode_Check(arg)) {
        utf8 = PyUnicode_AsUTF8String(arg);
        if (utf8 == NULL) {
            return NULL;
        }
        arg = utf8;
    }
    if (PyObject_GetBuffer(arg, &text, PyBUF_CONTIG_RO) < 0) {
        Py_XDECREF(utf8);
        return NULL;
    }
    const size_t len = (size_t)text.len, cap = COLIBRI_TOKENIZER_ENCODE_MAX_IDS(len);
    const size_t work_bytes = COLIBRI_TOKENIZER_ENCODE_WORK_BYTES(len);
    int32_t *ids = PyMem_Malloc(cap * sizeof *ids);
    void *work = PyMem_Malloc(work_bytes);
    PyObject *out = NULL;
    if (ids == NULL || work == NULL) {
        PyErr_NoMemory();
    } else {
        size_t n = 0;
        int st;
        Py_BEGIN_ALLOW_THREADS
        st = colibri_tokenizer_encode(&self->tok, text.buf, len, ids, cap, &n, work, work_bytes);
        Py_END_ALLOW_THREADS
        if (st != COLIBRI_OK) {
            raise_status(st);
        } else if ((out = PyList_New((Py_ssize_t)n)) != NULL) {
            for (size_t i = 0; i < n; i++) {
                PyList_SET_ITEM(out, (Py_ssize_t)i, PyLong_FromLong(ids[i]));
            }
        }
    }
    PyMem_Free(ids);
    PyMem_Free(work);
    PyBuffer_Release(&text);
    Py_XDECREF(utf8);
    return out;
}

/* encode_into(text: bytes, ids_cap, work_bytes) -> (status, n, ids[:min(n, ids_cap)]): the C call with the
 * caller's sizes, for the tests of its bounds and statuses. */
static PyObject *TextDecoder_encode_into(TextDecoderObject *self, PyObject *args) {
    Py_buffer text;
    Py_ssize_t cap, work_bytes;
    if (!decoder_ready(self) || !PyArg_ParseTuple(args, "y*nn", &text, &cap, &work_bytes)) {
        return NULL;
    }
    if (cap < 0 || work_bytes < 0) {
        PyBuffer_Release(&text);
        PyErr_SetString(PyExc_ValueError, "ids_cap and work_bytes must be >= 0");
        return NULL;
    }
    int32_t *ids = PyMem_Malloc((size_t)cap * sizeof *ids + 1u);
    uint8_t *work = PyMem_Malloc((size_t)work_bytes + 1u);
    PyObject *out = NULL;
    if (ids == NULL || work == NULL) {
        PyErr_NoMemory();
    } else {
        size_t n = 0;
        int st = colibri_tokenizer_encode(&self->tok, text.buf, (size_t)text.len, ids, (size_t)cap, &n,
                                          work_bytes ? work : NULL, (size_t)work_bytes);
        PyObject *list = PyList_New(0);
        for (size_t i = 0; list != NULL && i < n && i < (size_t)cap; i++) {
            PyObject *v = PyLong_FromLong(ids[i]);
            if (v == NULL || PyList_Append(list, v) < 0) {
                Py_XDECREF(v);
                Py_CLEAR(list);
                break;
            }
            Py_DECREF(v);
        }
        if (list != NULL) {
            out = Py_BuildValue("(inN)", st, (Py_ssize_t)n, list);
        }
    }
    PyMem_Free(ids);
    PyMem_Free(work);
    PyBuffer_Release(&text);
    return out;
}

static PyObject *TextDecoder_info(TextDecoderObject *self, PyObject *Py_UNUSED(ignored)) {
    if (!decoder_ready(self)) {
        return NULL;
    }
    const colibri_tokenizer *t = &self->tok;
    return Py_BuildValue("{s:I,s:I,s:I,s:I,s:i,s:i,s:i,s:i}", "kind", t->kind, "flags", t->flags, "vocab_size",
                         t->vocab, "max_piece", t->max_piece, "bos", t->bos, "eos", t->eos, "pad", t->pad, "unk",
                         t->unk);
}

static PyMethodDef TextDecoder_methods[] = {
    {"push", (PyCFunction)TextDecoder_push, METH_O, "push(id) -> the bytes this token completes"},
    {"flush", (PyCFunction)TextDecoder_flush, METH_NOARGS, "flush() -> what the stream still holds (U+FFFD)"},
    {"piece", (PyCFunction)TextDecoder_piece, METH_O, "piece(id) -> the token's own bytes"},
    {"info", (PyCFunction)TextDecoder_info, METH_NOARGS, "info() -> kind, flags, vocab_size, special ids"},
    {"encode", (PyCFunction)TextDecoder_encode, METH_O, "encode(text) -> ids, by colibri_tokenizer_encode"},
    {"encode_into", (PyCFunction)TextDecoder_encode_into, METH_VARARGS,
     "encode_into(text, ids_cap, work_bytes) -> (status, n, ids): the C call with these buffer sizes"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject TextDecoderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "colibri.runtime._engine.TextDecoder",
    .tp_basicsize = sizeof(TextDecoderObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "TextDecoder(image): the C engine's streaming decoder over the image's tokenizer section",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)TextDecoder_init,
    .tp_dealloc = (destructor)TextDecoder_dealloc,
    .tp_methods = TextDecoder_methods,
};

static PyMethodDef module_methods[] = {
    {"validate", mod_validate, METH_O, "validate(image) -> status"},
    {"validate_structure", mod_validate_structure, METH_O, "validate_ex(image, COLIBRI_CHECK_STRUCTURE) -> status"},
    {"model_size", mod_model_size, METH_O, "model_size(image) -> (status, arena bytes)"},
    {"model_size_ex", mod_model_size_ex, METH_VARARGS, "model_size_ex(image, workers) -> (status, arena bytes)"},
    {"strerror", mod_strerror, METH_O, "strerror(status) -> str"},
    {"version", mod_version, METH_NOARGS, "engine version"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef engine_module = {
    PyModuleDef_HEAD_INIT, "colibri.runtime._engine", "The Colibri C engine.", -1, module_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__engine(void) {
    if (PyType_Ready(&ContextType) < 0 || PyType_Ready(&FileType) < 0 || PyType_Ready(&ArenaType) < 0 ||
        PyType_Ready(&LeaseType) < 0 || PyType_Ready(&TextDecoderType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&engine_module);
    if (m == NULL) {
        return NULL;
    }
    EngineError = PyErr_NewException("colibri.runtime._engine.EngineError", NULL, NULL);
    Py_INCREF(&ContextType);
    Py_INCREF(&FileType);
    Py_INCREF(&TextDecoderType);
    if (EngineError == NULL || PyModule_AddObject(m, "Context", (PyObject *)&ContextType) < 0 ||
        PyModule_AddObject(m, "File", (PyObject *)&FileType) < 0 ||
        PyModule_AddObject(m, "TextDecoder", (PyObject *)&TextDecoderType) < 0 ||
        PyModule_AddObject(m, "EngineError", EngineError) < 0 ||
        PyModule_AddStringConstant(m, "SOURCE_HASH", COLIBRI_SOURCE_HASH) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
