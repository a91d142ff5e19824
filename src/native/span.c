/* traintrace._span: the training thread's half of the native recording core.
 *
 * SpanCore is the base of traintrace.Span: the span's fields as C members and
 * __init__/__enter__/__exit__ in C, with exactly the semantics of the
 * pure-Python core in _recorder.py (_PySpanCore), which stays the reference.
 * RecorderCore is the base of traintrace's Recorder: the few fields the hot
 * path reads (queue, capacity, level, listeners, progress file), as C members,
 * so that a span reads them without a dictionary look-up.
 *
 * Rules kept throughout:
 *  - every pointer into a Python object is owned (a reference held) across any
 *    call that can run Python code (a listener, a warning, a __hash__ or __eq__
 *    of a user's name, a finalizer run by a decref);
 *  - the progress file's pointer is re-read after any such call, never cached;
 *  - slow or rare paths (warnings, a full queue, a failed progress store, a
 *    span stopped twice or after close, an exception leaving a span) call the
 *    same Python functions the pure core calls.
 *
 * SpanCore is not tracked by the garbage collector (no Py_TPFLAGS_HAVE_GC): a
 * queued span is invisible to it, so a full queue never makes a collection
 * slow. The price: a reference cycle through a span (a span in its own attrs
 * or metrics) is never collected.
 */
#if defined(__GNUC__)
#pragma GCC diagnostic ignored "-Wunused-parameter"
#endif
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>

#include "span_core.h"

/* The progress file's int64 slots (_progress.py; checked against it at import). */
#define S_COUNTER 8
#define S_STEP 9
#define S_PHASE_T0 11
#define S_UPDATED 12
#define S_COLLECTIVE 13
#define S_ITERATIONS 16
#define S_LAST_DONE 17
#define S_STEP_T0 18
#define S_LAST_STEP_NS 19
#define S_COLLECTIVE_T0 20
#define S_STEPS_DONE 21
#define S_FIRST_STEP_T0 23
#define PHASE_MASK 0xff /* the phase code's bits in the update word (_progress.PHASE_BITS) */
#define N_SLOTS 24

/* Span.written when its start did not fit in the queue (_recorder._START_DROPPED). */
#define START_DROPPED 3

static inline int64_t
now_ns(void)
{
#if PY_VERSION_HEX >= 0x030D0000
    PyTime_t t = 0;
    (void)PyTime_PerfCounterRaw(&t);
    return (int64_t)t;
#else
    return (int64_t)_PyTime_GetPerfCounter();
#endif
}

/* ------------------------------------------------------------------ letting the writer in */

#ifndef _WIN32
#include <pthread.h>
#include <time.h>
#define HANDOFF 1
/*
 * When (now_ns) the writer thread began to wait for the GIL with records still queued
 * (traintrace._encode.write_pause sets it, 0 once it has the GIL). A thread holding the GIL
 * lets it go only when it blocks or after the switch interval (5 ms), and a training loop
 * that runs Python back to back would hand it over once per interval: the writer would fall
 * behind and drop, and each hand-over would stall the loop for the writer's whole turn. Here
 * the training thread lets the writer in at its next span stop instead; the writer keeps its
 * turn short (_pipeline._SLICE_NS).
 */
static int64_t gil_wanted_since = 0;
/* A wish older than this is stale (the writer thread is gone: interpreter shutdown). */
#define HANDOFF_STALE_NS 50000000LL
/* How long the training thread waits for the writer to take the GIL it let go. */
#define HANDOFF_WAIT_NS 200000LL

/*
 * The writer's last sign of work while it has work (now_ns; the encoder sets it as it converts and
 * when it takes the GIL back), 0 while it waits by choice (traintrace._encode: writer_beat). When a
 * training loop holds the GIL and the writer's slice outlasts the switch interval (the machine took
 * its CPU away, say), CPython takes the GIL from the writer for the loop, and gives it back after
 * the switch interval at best: seconds were seen with other threads waiting too. A beat older than
 * WRITER_STARVED_NS while the loop runs means the writer waits for the GIL: the loop lets it in,
 * briefly and at most once per NUDGE_EVERY_NS (a writer in a slow system call is not waiting for
 * the GIL, and must not slow the loop much).
 */
static int64_t writer_beat = 0;
static int64_t last_nudge = 0;
#define WRITER_STARVED_NS 2000000LL
#define WRITER_BEAT_STALE_NS 2000000000LL /* the writer thread is gone (it clears its beat on exit) */
#define NUDGE_EVERY_NS 1000000LL
#define NUDGE_WAIT_NS 100000LL

static void
handoff_reset_child(void)
{
    gil_wanted_since = 0; /* the writer thread does not exist in a forked child */
    writer_beat = 0;
    last_nudge = 0;
}

/* A starved writer (above): the loop lets go of the GIL until the writer beats again, briefly. */
static void
nudge_writer(int64_t now)
{
    int64_t beat = __atomic_load_n(&writer_beat, __ATOMIC_RELAXED);
    if (beat == 0 || now - beat < WRITER_STARVED_NS || now - beat > WRITER_BEAT_STALE_NS ||
        now - last_nudge < NUDGE_EVERY_NS)
        return;
    last_nudge = now;
    Py_BEGIN_ALLOW_THREADS
    struct timespec step = {0, 20000};
    int64_t until = now + NUDGE_WAIT_NS;
    do
        nanosleep(&step, NULL);
    while (__atomic_load_n(&writer_beat, __ATOMIC_ACQUIRE) == beat && now_ns() < until);
    Py_END_ALLOW_THREADS
}

static void
let_writer_in(int64_t now)
{
    int64_t since = __atomic_load_n(&gil_wanted_since, __ATOMIC_RELAXED);
    if (since == 0 || now - since > HANDOFF_STALE_NS) {
        nudge_writer(now);
        return;
    }
    Py_BEGIN_ALLOW_THREADS
    /* Sleep, not spin: the writer wakes on the core this thread leaves free. */
    struct timespec step = {0, 20000};
    int64_t until = now + HANDOFF_WAIT_NS;
    do
        nanosleep(&step, NULL);
    while (__atomic_load_n(&gil_wanted_since, __ATOMIC_ACQUIRE) != 0 && now_ns() < until);
    Py_END_ALLOW_THREADS
}
#endif

/* ------------------------------------------------------------------ state */

static int installed = 0;
static PyObject *g_namespace = NULL;   /* _recorder's globals: _active is read from it */
static PyObject *g_current = NULL;     /* the _current ContextVar */
static PyObject *g_phases = NULL;      /* _progress.PHASE_CODES */
static long g_iteration_code = -1;
static long g_collective_code = -1;
/* The phase codes of the checkpoint saves (sync, async, finalization), found in `phases`. */
static long g_save_codes[3] = {-1, -1, -1};
static PyObject *g_iteration_name = NULL;
static PyObject *g_info = NULL;        /* the default level */
static PyObject *g_ids = NULL;         /* the span id Counter, shared with record_span */
static PyObject *g_adopt = NULL;       /* _progress.adopt(rec, span) */
static PyObject *g_failed = NULL;      /* _progress.failed(rec, span=None, t0=0) */
static PyObject *g_reused = NULL;      /* warns once: a span entered twice */

static PyObject *s_active, *s_span_started, *s_span_stopped, *s_overflow, *s_start_resolved;
static PyObject *s_late_stop, *s_span_failed, *s_step, *s_ok, *s_append, *s_wake;

/* ---------------------------------------------------------------- Counter */

typedef struct {
    PyObject_HEAD
    int64_t value;
    int64_t step;
} Counter;

static PyTypeObject CounterType;

static PyObject *
counter_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    long long start = 0, step = 1;
    static char *kwlist[] = {"start", "step", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|LL:Counter", kwlist, &start, &step))
        return NULL;
    Counter *self = (Counter *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->value = start;
    self->step = step;
    return (PyObject *)self;
}

static PyObject *
counter_next(Counter *self)
{
    int64_t value = self->value;
    if (__builtin_add_overflow(value, self->step, &self->value)) {
        self->value = value;
        PyErr_SetString(PyExc_OverflowError, "Counter past int64");
        return NULL;
    }
    return PyLong_FromLongLong(value);
}

static PyObject *
counter_repr(Counter *self)
{
    return PyUnicode_FromFormat("Counter(%lld, %lld)", (long long)self->value, (long long)self->step);
}

static PyTypeObject CounterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "traintrace._span.Counter",
    .tp_basicsize = sizeof(Counter),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "itertools.count for int64 values, read directly by the native core.",
    .tp_new = counter_new,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)counter_next,
    .tp_repr = (reprfunc)counter_repr,
};

/* The next value of a counter (a Counter, or any iterator of ints). */
static int
next_value(PyObject *it, int64_t *out)
{
    if (Py_IS_TYPE(it, &CounterType)) {
        Counter *c = (Counter *)it;
        int64_t value = c->value;
        if (__builtin_add_overflow(value, c->step, &c->value)) {
            c->value = value;
            PyErr_SetString(PyExc_OverflowError, "Counter past int64");
            return -1;
        }
        *out = value;
        return 0;
    }
    if (!PyIter_Check(it)) {
        PyErr_SetString(PyExc_TypeError, "not an iterator");
        return -1;
    }
    Py_INCREF(it);
    PyObject *value = PyIter_Next(it);
    Py_DECREF(it);
    if (value == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetNone(PyExc_StopIteration);
        return -1;
    }
    long long v = PyLong_AsLongLong(value);
    Py_DECREF(value);
    if (v == -1 && PyErr_Occurred())
        return -1;
    *out = v;
    return 0;
}

/* ----------------------------------------------------------- RecorderCore */

typedef struct {
    PyObject_HEAD
    PyObject *queue;
    PyObject *append;      /* queue.append, bound once */
    Py_ssize_t cap;
    PyObject *max_level;
    PyObject *listeners;   /* a tuple */
    PyObject *pipeline;
    int closed;
    PyObject *progress;    /* None, or the int64 view the pointer below belongs to */
    Py_buffer buf;
    int64_t *prog;         /* NULL when there is no progress file */
    unsigned long progress_tid;
    PyObject *seq;
    PyObject *iterations;
    PyObject *steps_done;
} RecorderCore;

static PyTypeObject RecorderCoreType;
#define RecorderCore_Check(op) PyObject_TypeCheck(op, &RecorderCoreType)

static PyObject *
recorder_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    RecorderCore *self = (RecorderCore *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->queue = Py_NewRef(Py_None);
    self->append = Py_NewRef(Py_None);
    self->max_level = PyLong_FromLong(-1);
    self->listeners = PyTuple_New(0);
    self->pipeline = Py_NewRef(Py_None);
    self->progress = Py_NewRef(Py_None);
    self->seq = Py_NewRef(Py_None);
    self->iterations = Py_NewRef(Py_None);
    self->steps_done = Py_NewRef(Py_None);
    if (self->max_level == NULL || self->listeners == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static void
recorder_release_progress(RecorderCore *self)
{
    if (self->prog != NULL) {
        self->prog = NULL;
        PyBuffer_Release(&self->buf);
    }
}

static int
recorder_traverse(RecorderCore *self, visitproc visit, void *arg)
{
    Py_VISIT(self->queue);
    Py_VISIT(self->append);
    Py_VISIT(self->max_level);
    Py_VISIT(self->listeners);
    Py_VISIT(self->pipeline);
    Py_VISIT(self->progress);
    if (self->prog != NULL)
        Py_VISIT(self->buf.obj);
    Py_VISIT(self->seq);
    Py_VISIT(self->iterations);
    Py_VISIT(self->steps_done);
    return 0;
}

static int
recorder_clear(RecorderCore *self)
{
    recorder_release_progress(self);
    Py_CLEAR(self->queue);
    Py_CLEAR(self->append);
    Py_CLEAR(self->max_level);
    Py_CLEAR(self->listeners);
    Py_CLEAR(self->pipeline);
    Py_CLEAR(self->progress);
    Py_CLEAR(self->seq);
    Py_CLEAR(self->iterations);
    Py_CLEAR(self->steps_done);
    return 0;
}

static void
recorder_dealloc(RecorderCore *self)
{
    PyObject_GC_UnTrack(self);
    recorder_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

#define NO_DELETE(value, what)                                              \
    if ((value) == NULL) {                                                  \
        PyErr_SetString(PyExc_TypeError, "cannot delete " what);            \
        return -1;                                                          \
    }

/* A plain object field: get it, set anything, never delete. */
#define OBJECT_FIELD(T, field, pyname)                                      \
    static PyObject *T##_get_##field(T *self, void *closure)                \
    {                                                                       \
        return Py_NewRef(self->field);                                      \
    }                                                                       \
    static int T##_set_##field(T *self, PyObject *value, void *closure)     \
    {                                                                       \
        NO_DELETE(value, pyname)                                            \
        Py_SETREF(self->field, Py_NewRef(value));                           \
        return 0;                                                           \
    }

OBJECT_FIELD(RecorderCore, max_level, "max_level")
OBJECT_FIELD(RecorderCore, pipeline, "_pipeline")
OBJECT_FIELD(RecorderCore, seq, "_progress_seq")
OBJECT_FIELD(RecorderCore, iterations, "_progress_iterations")
OBJECT_FIELD(RecorderCore, steps_done, "_progress_steps_done")

static PyObject *
RecorderCore_get_queue(RecorderCore *self, void *closure)
{
    return Py_NewRef(self->queue);
}

static int
RecorderCore_set_queue(RecorderCore *self, PyObject *value, void *closure)
{
    NO_DELETE(value, "_queue")
    PyObject *append = PyObject_GetAttr(value, s_append);
    if (append == NULL)
        return -1;
    Py_SETREF(self->queue, Py_NewRef(value));
    Py_SETREF(self->append, append);
    return 0;
}

static PyObject *
RecorderCore_get_listeners(RecorderCore *self, void *closure)
{
    return Py_NewRef(self->listeners);
}

static int
RecorderCore_set_listeners(RecorderCore *self, PyObject *value, void *closure)
{
    NO_DELETE(value, "_listeners")
    if (!PyTuple_Check(value)) {
        PyErr_SetString(PyExc_TypeError, "_listeners must be a tuple");
        return -1;
    }
    Py_SETREF(self->listeners, Py_NewRef(value));
    return 0;
}

static PyObject *
RecorderCore_get_cap(RecorderCore *self, void *closure)
{
    return PyLong_FromSsize_t(self->cap);
}

static int
RecorderCore_set_cap(RecorderCore *self, PyObject *value, void *closure)
{
    NO_DELETE(value, "_cap")
    Py_ssize_t cap = PyNumber_AsSsize_t(value, PyExc_OverflowError);
    if (cap == -1 && PyErr_Occurred())
        return -1;
    self->cap = cap;
    return 0;
}

static PyObject *
RecorderCore_get_closed(RecorderCore *self, void *closure)
{
    return PyBool_FromLong(self->closed);
}

static int
RecorderCore_set_closed(RecorderCore *self, PyObject *value, void *closure)
{
    NO_DELETE(value, "closed")
    int truth = PyObject_IsTrue(value);
    if (truth < 0)
        return -1;
    self->closed = truth;
    return 0;
}

static PyObject *
RecorderCore_get_progress_tid(RecorderCore *self, void *closure)
{
    return PyLong_FromUnsignedLong(self->progress_tid);
}

static int
RecorderCore_set_progress_tid(RecorderCore *self, PyObject *value, void *closure)
{
    NO_DELETE(value, "_progress_tid")
    unsigned long tid = PyLong_AsUnsignedLong(value);
    if (tid == (unsigned long)-1 && PyErr_Occurred())
        return -1;
    self->progress_tid = tid;
    return 0;
}

static PyObject *
RecorderCore_get_progress(RecorderCore *self, void *closure)
{
    return Py_NewRef(self->progress);
}

/* None, or a writable, C-contiguous buffer of int64 holding every slot the hot path stores. */
static int
RecorderCore_set_progress(RecorderCore *self, PyObject *value, void *closure)
{
    NO_DELETE(value, "_progress")
    if (value == Py_None) {
        recorder_release_progress(self);
        Py_SETREF(self->progress, Py_NewRef(Py_None));
        return 0;
    }
    Py_buffer buf;
    if (PyObject_GetBuffer(value, &buf, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    const char *format = buf.format ? buf.format : "B";
    if (format[0] == '@' || format[0] == '=' || format[0] == '<')
        format++;
    if (buf.itemsize != 8 || (strcmp(format, "q") != 0 && strcmp(format, "l") != 0) ||
        buf.len < (Py_ssize_t)(N_SLOTS * sizeof(int64_t)) || ((uintptr_t)buf.buf % sizeof(int64_t)) != 0) {
        PyBuffer_Release(&buf);
        PyErr_SetString(PyExc_TypeError, "_progress must be None or an int64 view of the progress file");
        return -1;
    }
    recorder_release_progress(self);
    self->buf = buf;
    self->prog = (int64_t *)buf.buf;
    Py_SETREF(self->progress, Py_NewRef(value));
    return 0;
}

static PyGetSetDef recorder_getset[] = {
    {"_queue", (getter)RecorderCore_get_queue, (setter)RecorderCore_set_queue, NULL, NULL},
    {"_cap", (getter)RecorderCore_get_cap, (setter)RecorderCore_set_cap, NULL, NULL},
    {"max_level", (getter)RecorderCore_get_max_level, (setter)RecorderCore_set_max_level, NULL, NULL},
    {"_listeners", (getter)RecorderCore_get_listeners, (setter)RecorderCore_set_listeners, NULL, NULL},
    {"_pipeline", (getter)RecorderCore_get_pipeline, (setter)RecorderCore_set_pipeline, NULL, NULL},
    {"closed", (getter)RecorderCore_get_closed, (setter)RecorderCore_set_closed, NULL, NULL},
    {"_progress", (getter)RecorderCore_get_progress, (setter)RecorderCore_set_progress, NULL, NULL},
    {"_progress_tid", (getter)RecorderCore_get_progress_tid, (setter)RecorderCore_set_progress_tid, NULL, NULL},
    {"_progress_seq", (getter)RecorderCore_get_seq, (setter)RecorderCore_set_seq, NULL, NULL},
    {"_progress_iterations", (getter)RecorderCore_get_iterations, (setter)RecorderCore_set_iterations, NULL, NULL},
    {"_progress_steps_done", (getter)RecorderCore_get_steps_done, (setter)RecorderCore_set_steps_done, NULL, NULL},
    {NULL},
};

static PyTypeObject RecorderCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "traintrace._span.RecorderCore",
    .tp_basicsize = sizeof(RecorderCore),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The fields of a Recorder that the native span reads.",
    .tp_new = recorder_new,
    .tp_dealloc = (destructor)recorder_dealloc,
    .tp_traverse = (traverseproc)recorder_traverse,
    .tp_clear = (inquiry)recorder_clear,
    .tp_getset = recorder_getset,
};

/* --------------------------------------------------------------- SpanCore */


static PyTypeObject SpanCoreType;
#define SpanCore_Check(op) PyObject_TypeCheck(op, &SpanCoreType)
static int untracked_layout(PyTypeObject *type);

static PyObject *
span_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    SpanCore *self = (SpanCore *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->name = Py_NewRef(Py_None);
    self->attrs = Py_NewRef(Py_None);
    self->level = Py_NewRef(g_info != NULL ? g_info : Py_None);
    self->link = Py_NewRef(Py_None);
    self->rec = Py_NewRef(Py_None);
    self->parent = Py_NewRef(Py_None);
    self->status = Py_NewRef(s_ok);
    self->metrics = Py_NewRef(Py_None);
    self->prev_t0 = -1;
    if (PyType_IS_GC(type) && untracked_layout(type))
        PyObject_GC_UnTrack(self);
    return (PyObject *)self;
}

/* Since Python 3.11 every heap type's instances are tracked by the garbage
 * collector, so traintrace.Span (a Python subclass with __slots__ = ()) would be.
 * A subclass that adds no field (no __dict__, no slot, no __weakref__) holds
 * nothing the collector could follow but the C fields above, which it never
 * visits: its instances are untracked as they are made. A subclass with a
 * __dict__ stays tracked (a cycle through its __dict__ is collected). */
static int
untracked_layout(PyTypeObject *type)
{
    if (type->tp_basicsize != SpanCoreType.tp_basicsize || type->tp_dictoffset != 0 || type->tp_weaklistoffset != 0)
        return 0;
#ifdef Py_TPFLAGS_MANAGED_DICT
    if (type->tp_flags & Py_TPFLAGS_MANAGED_DICT)
        return 0;
#endif
#ifdef Py_TPFLAGS_MANAGED_WEAKREF
    if (type->tp_flags & Py_TPFLAGS_MANAGED_WEAKREF)
        return 0;
#endif
    return 1;
}

/* Span(name, attrs=None, level=INFO, link=None) */
static int
span_init(SpanCore *self, PyObject *args, PyObject *kwds)
{
    PyObject *name, *attrs = Py_None, *level = g_info != NULL ? g_info : Py_None, *link = Py_None;
    if (kwds == NULL || PyDict_GET_SIZE(kwds) == 0) {
        Py_ssize_t n = PyTuple_GET_SIZE(args);
        if (n < 1 || n > 4) {
            PyErr_Format(PyExc_TypeError, "Span() takes from 1 to 4 positional arguments (%zd given)", n);
            return -1;
        }
        name = PyTuple_GET_ITEM(args, 0);
        if (n > 1)
            attrs = PyTuple_GET_ITEM(args, 1);
        if (n > 2)
            level = PyTuple_GET_ITEM(args, 2);
        if (n > 3)
            link = PyTuple_GET_ITEM(args, 3);
    }
    else {
        static char *kwlist[] = {"name", "attrs", "level", "link", NULL};
        if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|OOO:Span", kwlist, &name, &attrs, &level, &link))
            return -1;
    }
    Py_SETREF(self->name, Py_NewRef(name));
    Py_SETREF(self->attrs, Py_NewRef(attrs));
    self->attrs_step = 0;
    Py_SETREF(self->level, Py_NewRef(level));
    Py_SETREF(self->link, Py_NewRef(link));
    Py_SETREF(self->rec, Py_NewRef(Py_None));
    return 0;
}

/* Frees a chain of parents (or links) one by one: a chain of a million unstopped
 * spans must not recurse a million deep in dealloc. */
static void
release_chain(PyObject *obj, int use_link)
{
    while (obj != NULL && Py_REFCNT(obj) == 1 && SpanCore_Check(obj)) {
        SpanCore *span = (SpanCore *)obj;
        PyObject **slot = use_link ? &span->link : &span->parent;
        PyObject *next = *slot;
        *slot = Py_NewRef(Py_None);
        Py_DECREF(obj);
        obj = next;
    }
    Py_XDECREF(obj);
}

static void
span_dealloc(SpanCore *self)
{
    PyTypeObject *type = Py_TYPE(self);
    if (PyType_IS_GC(type))
        PyObject_GC_UnTrack(self); /* a user's subclass with a __dict__ */
    PyObject *parent = self->parent, *link = self->link;
    self->parent = NULL;
    self->link = NULL;
    Py_CLEAR(self->name);
    Py_CLEAR(self->attrs);
    Py_CLEAR(self->level);
    Py_CLEAR(self->rec);
    Py_CLEAR(self->status);
    Py_CLEAR(self->metrics);
    release_chain(parent, 0);
    release_chain(link, 1);
    type->tp_free((PyObject *)self);
}

OBJECT_FIELD(SpanCore, name, "name")

static PyObject *
SpanCore_get_attrs(SpanCore *self, void *closure)
{
    if (self->attrs_step) {
        PyObject *attrs = PyDict_New();
        if (attrs == NULL || PyDict_SetItem(attrs, s_step, self->attrs) < 0) {
            Py_XDECREF(attrs);
            return NULL;
        }
        self->attrs_step = 0;
        Py_SETREF(self->attrs, attrs);
    }
    return Py_NewRef(self->attrs);
}

/* The step an iteration's attrs stand for while they are not made yet, else None (tests). */
static PyObject *
SpanCore_get_attrs_step(SpanCore *self, void *closure)
{
    return Py_NewRef(self->attrs_step ? self->attrs : Py_None);
}

static int
SpanCore_set_attrs(SpanCore *self, PyObject *value, void *closure)
{
    NO_DELETE(value, "attrs")
    self->attrs_step = 0;
    Py_SETREF(self->attrs, Py_NewRef(value));
    return 0;
}
OBJECT_FIELD(SpanCore, level, "level")
OBJECT_FIELD(SpanCore, link, "link")
OBJECT_FIELD(SpanCore, status, "status")
OBJECT_FIELD(SpanCore, metrics, "metrics")

static PyObject *
SpanCore_get_rec(SpanCore *self, void *closure)
{
    return Py_NewRef(self->rec);
}

static int
SpanCore_set_rec(SpanCore *self, PyObject *value, void *closure)
{
    NO_DELETE(value, "_rec")
    if (value != Py_None && !RecorderCore_Check(value)) {
        PyErr_SetString(PyExc_TypeError, "_rec must be None or a Recorder");
        return -1;
    }
    Py_SETREF(self->rec, Py_NewRef(value));
    return 0;
}

static PyObject *
SpanCore_get_parent(SpanCore *self, void *closure)
{
    return Py_NewRef(self->parent);
}

static int
SpanCore_set_parent(SpanCore *self, PyObject *value, void *closure)
{
    NO_DELETE(value, "parent")
    if (value != Py_None && !SpanCore_Check(value)) {
        PyErr_SetString(PyExc_TypeError, "parent must be None or a Span");
        return -1;
    }
    Py_SETREF(self->parent, Py_NewRef(value));
    return 0;
}

static int
as_int64(PyObject *value, int64_t *out)
{
    if (!PyLong_Check(value)) {
        PyErr_SetString(PyExc_TypeError, "an int is required");
        return -1;
    }
    long long v = PyLong_AsLongLong(value);
    if (v == -1 && PyErr_Occurred())
        return -1;
    *out = v;
    return 0;
}

#define INT64_FIELD(field, pyname)                                           \
    static PyObject *SpanCore_get_##field(SpanCore *self, void *closure)     \
    {                                                                        \
        return PyLong_FromLongLong(self->field);                             \
    }                                                                        \
    static int SpanCore_set_##field(SpanCore *self, PyObject *value, void *c) \
    {                                                                        \
        NO_DELETE(value, pyname)                                             \
        return as_int64(value, &self->field);                                \
    }

INT64_FIELD(id, "id")
INT64_FIELD(t0, "t0")

static PyObject *
SpanCore_get_t1(SpanCore *self, void *closure)
{
    if (!self->has_t1)
        Py_RETURN_NONE;
    return PyLong_FromLongLong(self->t1);
}

static int
SpanCore_set_t1(SpanCore *self, PyObject *value, void *closure)
{
    NO_DELETE(value, "t1")
    if (value == Py_None) {
        self->has_t1 = 0;
        return 0;
    }
    if (as_int64(value, &self->t1) < 0)
        return -1;
    self->has_t1 = 1;
    return 0;
}

static PyObject *
SpanCore_get_tid(SpanCore *self, void *closure)
{
    return PyLong_FromUnsignedLong(self->tid);
}

static int
SpanCore_set_tid(SpanCore *self, PyObject *value, void *closure)
{
    NO_DELETE(value, "tid")
    unsigned long tid = PyLong_AsUnsignedLong(value);
    if (tid == (unsigned long)-1 && PyErr_Occurred())
        return -1;
    self->tid = tid;
    return 0;
}

static PyObject *
SpanCore_get_written(SpanCore *self, void *closure)
{
    return PyLong_FromLong(self->written);
}

static int
SpanCore_set_written(SpanCore *self, PyObject *value, void *closure)
{
    NO_DELETE(value, "written")
    long written = PyLong_AsLong(value);
    if (written == -1 && PyErr_Occurred())
        return -1;
    self->written = written;
    return 0;
}

/* ----------------------------------------------------------- the hot path */

/* self.level > rec.max_level, as Python compares them. */
static int
level_above(PyObject *level, PyObject *max_level)
{
    if (PyLong_CheckExact(level) && PyLong_CheckExact(max_level)) {
        int o1 = 0, o2 = 0;
        long a = PyLong_AsLongAndOverflow(level, &o1);
        long b = PyLong_AsLongAndOverflow(max_level, &o2);
        if (!o1 && !o2)
            return a > b;
    }
    Py_INCREF(level);
    Py_INCREF(max_level);
    int above = PyObject_RichCompareBool(level, max_level, Py_GT);
    Py_DECREF(level);
    Py_DECREF(max_level);
    return above;
}

/* The answers of phase_code for the last exact str names asked about, by the name object (held):
 * a span's start, its stop and its parent's each ask, with the same few names. */
#define PHASE_CACHE 16 /* a power of two */
static PyObject *phase_names[PHASE_CACHE];
static long phase_codes[PHASE_CACHE]; /* -1: not a standard phase */

static void
phase_cache_clear(void)
{
    for (int i = 0; i < PHASE_CACHE; i++)
        Py_CLEAR(phase_names[i]);
}

/* `name in PHASE_CODES`: 1 (and *code), 0, or -1 with an exception (a user's __hash__). */
static int
phase_code(PyObject *name, long *code)
{
    unsigned slot = ((unsigned)((uintptr_t)name >> 4) * 0x9E3779B1u) >> 28; /* 4 bits: PHASE_CACHE */
    if (phase_names[slot] == name) {
        *code = phase_codes[slot];
        return *code >= 0;
    }
    Py_INCREF(name);
    PyObject *value = PyDict_GetItemWithError(g_phases, name);
    if (value == NULL && PyErr_Occurred()) {
        Py_DECREF(name);
        return -1;
    }
    long found = value == NULL ? -1 : PyLong_AsLong(value);
    if (found == -1 && value != NULL && PyErr_Occurred()) {
        Py_DECREF(name);
        return -1;
    }
    if (PyUnicode_CheckExact(name)) {
        Py_XSETREF(phase_names[slot], Py_NewRef(name));
        phase_codes[slot] = found;
    }
    Py_DECREF(name);
    *code = found;
    return found >= 0;
}

/* A progress store raised: as the pure core's `except Exception`, call
 * _progress.failed; anything else (KeyboardInterrupt) propagates. */
static int
progress_failed(PyObject *rec, PyObject *span, int64_t t0)
{
    if (!PyErr_ExceptionMatches(PyExc_Exception))
        return -1;
    PyErr_Clear();
    PyObject *result;
    if (span == NULL) {
        result = PyObject_CallOneArg(g_failed, rec);
    }
    else {
        PyObject *when = PyLong_FromLongLong(t0);
        if (when == NULL)
            return -1;
        result = PyObject_CallFunctionObjArgs(g_failed, rec, span, when, NULL);
        Py_DECREF(when);
    }
    if (result == NULL)
        return -1;
    Py_DECREF(result);
    return 0;
}

static int
progress_enter(SpanCore *self, RecorderCore *R, int64_t t0)
{
    PyObject *rec = (PyObject *)R;
    long code = 0;
    int found = phase_code(self->name, &code);
    if (found <= 0)
        return found < 0 ? progress_failed(rec, (PyObject *)self, t0) : 0;
    int64_t step = -1, iterations = 0, seq = 0;
    int iteration = code == g_iteration_code, collective = code == g_collective_code;
    if (iteration) {
        PyObject *attrs = Py_NewRef(self->attrs);
        if (self->attrs_step || PyDict_CheckExact(attrs)) {
            PyObject *value = self->attrs_step ? attrs : PyDict_GetItemWithError(attrs, s_step);
            if (value != NULL && PyLong_CheckExact(value)) {
                int overflow = 0;
                long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
                if (overflow) {
                    Py_DECREF(attrs);
                    PyErr_SetString(PyExc_ValueError, "step is no int64");
                    return progress_failed(rec, (PyObject *)self, t0);
                }
                step = v;
            }
            else if (value == NULL && PyErr_Occurred()) {
                Py_DECREF(attrs);
                return progress_failed(rec, (PyObject *)self, t0);
            }
        }
        Py_DECREF(attrs);
        if (next_value(R->iterations, &iterations) < 0)
            return progress_failed(rec, (PyObject *)self, t0);
    }
    if (next_value(R->seq, &seq) < 0)
        return progress_failed(rec, (PyObject *)self, t0);
    volatile int64_t *prog = R->prog; /* read after every call that could have released it */
    if (prog == NULL)
        return 0;
    if (iteration) {
        prog[S_STEP] = step;
        prog[S_STEP_T0] = t0;
        prog[S_ITERATIONS] = iterations;
        if (iterations == 1)
            prog[S_FIRST_STEP_T0] = t0;
    }
    else if (collective) {
        int64_t count = prog[S_COLLECTIVE];
        if (count == INT64_MAX) {
            PyErr_SetString(PyExc_ValueError, "collective count past int64");
            return progress_failed(rec, (PyObject *)self, t0);
        }
        prog[S_COLLECTIVE] = count + 1;
        prog[S_COLLECTIVE_T0] = t0;
    }
    self->prev_word = prog[S_COUNTER];
    self->prev_t0 = prog[S_PHASE_T0];
    prog[S_PHASE_T0] = t0;
    prog[S_COUNTER] = seq | code;
    return 0;
}

static int
progress_exit(SpanCore *self, RecorderCore *R, int64_t t1)
{
    PyObject *rec = (PyObject *)R;
    long code = 0, outer = 0;
    int found = phase_code(self->name, &code);
    if (found <= 0)
        return found < 0 ? progress_failed(rec, NULL, 0) : 0;
    int iteration = code == g_iteration_code, collective = code == g_collective_code;
    int64_t done = 0, last = 0, seq = 0;
    /* An iteration that failed (an exception, a status set) did not complete its step. */
    int completed = iteration && (self->status == s_ok || (PyUnicode_Check(self->status) &&
                                                           PyUnicode_CompareWithASCIIString(self->status, "ok") == 0));
    if (completed) {
        if (next_value(R->steps_done, &done) < 0)
            return progress_failed(rec, NULL, 0);
        if (__builtin_sub_overflow(t1, self->t0, &last)) {
            PyErr_SetString(PyExc_ValueError, "duration is no int64");
            return progress_failed(rec, NULL, 0);
        }
    }
    /* Back in the enclosing standard phase (0: none), or where the file was when this span started,
     * if that was set within the enclosing phase (a phase timed without a span, see prev_word). */
    int64_t outer_t0 = 0;
    PyObject *parent = Py_NewRef(self->parent);
    while (parent != Py_None) {
        int in_phase = phase_code(((SpanCore *)parent)->name, &outer);
        if (in_phase < 0) {
            Py_DECREF(parent);
            return progress_failed(rec, NULL, 0);
        }
        if (in_phase) {
            outer_t0 = ((SpanCore *)parent)->t0;
            break;
        }
        PyObject *next = Py_NewRef(((SpanCore *)parent)->parent);
        Py_DECREF(parent);
        parent = next;
    }
    if (parent == Py_None)
        outer = 0;
    Py_DECREF(parent);
    if (next_value(R->seq, &seq) < 0)
        return progress_failed(rec, NULL, 0);
    volatile int64_t *prog = R->prog;
    if (prog == NULL)
        return 0;
    if (completed) {
        prog[S_STEPS_DONE] = done;
        prog[S_LAST_STEP_NS] = last;
        prog[S_LAST_DONE] = prog[S_ITERATIONS];
    }
    else if (collective && prog[S_COLLECTIVE] > 0) {
        prog[S_COLLECTIVE] -= 1;
    }
    prog[S_UPDATED] = t1;
    if (self->prev_t0 >= outer_t0 && self->prev_t0 <= self->t0) {
        prog[S_PHASE_T0] = self->prev_t0;
        outer = (long)(self->prev_word & PHASE_MASK);
    }
    prog[S_COUNTER] = seq | outer;
    return 0;
}

/* The listeners' span_started/span_stopped (NVTX), in order; an exception propagates. */
static int
call_listeners(RecorderCore *R, PyObject *method, PyObject *span)
{
    PyObject *listeners = Py_NewRef(R->listeners);
    Py_ssize_t n = PyTuple_GET_SIZE(listeners);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *result = PyObject_CallMethodOneArg(PyTuple_GET_ITEM(listeners, i), method, span);
        if (result == NULL) {
            Py_DECREF(listeners);
            return -1;
        }
        Py_DECREF(result);
    }
    Py_DECREF(listeners);
    return 0;
}

static int
queue_append(RecorderCore *R, PyObject *item)
{
    PyObject *append = Py_NewRef(R->append);
    PyObject *result = PyObject_CallOneArg(append, item);
    Py_DECREF(append);
    if (result == NULL)
        return -1;
    Py_DECREF(result);
    return 0;
}

/* len(rec._queue) < rec._cap: 1, 0, or -1 with an exception. */
static int
queue_has_room(RecorderCore *R)
{
    PyObject *queue = Py_NewRef(R->queue);
    Py_ssize_t length = PyObject_Length(queue);
    Py_DECREF(queue);
    if (length < 0)
        return -1;
    return length < R->cap;
}

static PyObject *
span_enter(SpanCore *self, PyObject *unused)
{
    if (!installed)
        return Py_NewRef(self);
    PyObject *rec = PyDict_GetItemWithError(g_namespace, s_active);
    if (rec == NULL) {
        if (PyErr_Occurred())
            return NULL;
        return Py_NewRef(self);
    }
    if (rec == Py_None || !RecorderCore_Check(rec))
        return Py_NewRef(self);
    Py_INCREF(rec);
    RecorderCore *R = (RecorderCore *)rec;
    PyObject *current = NULL;

    int above = level_above(self->level, R->max_level);
    if (above != 0) {
        Py_DECREF(rec);
        return above < 0 ? NULL : Py_NewRef(self);
    }
    if (self->rec != Py_None) {
        PyObject *result = PyObject_CallOneArg(g_reused, (PyObject *)self);
        Py_DECREF(rec);
        if (result == NULL)
            return NULL;
        Py_DECREF(result);
        return Py_NewRef(self);
    }
    /* The innermost open span of this context: closed parents are skipped. */
    if (PyContextVar_Get(g_current, Py_None, &current) < 0)
        goto error;
    while (current != Py_None && SpanCore_Check(current) && ((SpanCore *)current)->has_t1) {
        PyObject *next = Py_NewRef(((SpanCore *)current)->parent);
        Py_DECREF(current);
        current = next;
    }
    if (current != Py_None && !SpanCore_Check(current))
        Py_SETREF(current, Py_NewRef(Py_None));
    Py_SETREF(self->parent, current); /* the reference moves */
    current = NULL;
    if (next_value(g_ids, &self->id) < 0)
        goto error;
    self->tid = PyThread_get_thread_ident();
    Py_SETREF(self->metrics, Py_NewRef(Py_None));
    Py_SETREF(self->status, Py_NewRef(s_ok));
    self->written = 0;
    self->has_t1 = 0;
    self->prev_t0 = -1;
    Py_SETREF(self->rec, Py_NewRef(rec));
    PyObject *token = PyContextVar_Set(g_current, (PyObject *)self);
    if (token == NULL)
        goto error;
    Py_DECREF(token);
    if (PyTuple_GET_SIZE(R->listeners) && call_listeners(R, s_span_started, (PyObject *)self) < 0)
        goto error;
    int64_t t0 = now_ns();
    self->t0 = t0;
    if (R->prog != NULL) {
        int ours = self->tid == R->progress_tid;
        if (!ours) {
            /* _progress.adopt: only an iteration can make this the training thread. */
            PyObject *name = self->name;
            int maybe = 1;
            if (PyUnicode_CheckExact(name))
                maybe = PyUnicode_Compare(name, g_iteration_name) == 0;
            if (maybe) {
                PyObject *result = PyObject_CallFunctionObjArgs(g_adopt, rec, (PyObject *)self, NULL);
                if (result == NULL)
                    goto error;
                ours = PyObject_IsTrue(result);
                Py_DECREF(result);
                if (ours < 0)
                    goto error;
            }
        }
        if (ours && R->prog != NULL && progress_enter(self, R, t0) < 0)
            goto error;
    }
    int room = queue_has_room(R);
    if (room < 0)
        goto error;
    if (room) {
        if (queue_append(R, (PyObject *)self) < 0)
            goto error;
    }
    else {
        /* Counted when its stop is dropped too (or at close, if it never stops). */
        PyObject *pipeline = Py_NewRef(R->pipeline);
        PyObject *zero = PyLong_FromLong(0);
        PyObject *result = zero ? PyObject_CallMethodObjArgs(pipeline, s_overflow, (PyObject *)self, zero, NULL) : NULL;
        Py_XDECREF(zero);
        Py_DECREF(pipeline);
        if (result == NULL)
            goto error;
        int queued = PyObject_IsTrue(result);
        Py_DECREF(result);
        if (queued < 0)
            goto error;
        if (!queued)
            self->written = START_DROPPED;
    }
    Py_DECREF(rec);
    return Py_NewRef(self);
error:
    Py_XDECREF(current);
    Py_DECREF(rec);
    return NULL;
}

/* A checkpoint save that ended has the writer write it now, not at the end of the flush
 * interval: a job killed within that time would lose the record, and with it the steps the
 * checkpoint holds (_recorder._PySpanCore.__exit__ does the same). The wake-up is an
 * optimisation: its failure is cleared, except what must propagate (KeyboardInterrupt). */
static int
wake_after_save(SpanCore *self, PyObject *rec)
{
    long code = 0;
    int found = phase_code(self->name, &code);
    if (found == 0 || (found > 0 && code != g_save_codes[0] && code != g_save_codes[1] && code != g_save_codes[2]))
        return 0;
    if (found > 0) {
        PyObject *result = PyObject_CallMethodNoArgs(rec, s_wake);
        if (result != NULL) {
            Py_DECREF(result);
            return 0;
        }
    }
    if (!PyErr_ExceptionMatches(PyExc_Exception))
        return -1;
    PyErr_Clear();
    return 0;
}

static PyObject *
span_exit(SpanCore *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t t1 = now_ns();
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "__exit__ takes 3 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *exc = args[1];
    if (self->rec == Py_None)
        Py_RETURN_NONE;
    PyObject *rec = Py_NewRef(self->rec);
    RecorderCore *R = (RecorderCore *)rec;
    PyObject *when = NULL, *result = NULL;

    if (self->has_t1 || R->closed) {
        when = PyLong_FromLongLong(t1);
        if (when == NULL)
            goto error;
        result = PyObject_CallMethodObjArgs(rec, s_late_stop, (PyObject *)self, when, NULL);
        if (result == NULL)
            goto error;
        goto done;
    }
    if (exc != Py_None) {
        when = PyLong_FromLongLong(t1);
        if (when == NULL)
            goto error;
        Py_INCREF(exc);
        result = PyObject_CallMethodObjArgs(rec, s_span_failed, (PyObject *)self, exc, when, NULL);
        Py_DECREF(exc);
        if (result == NULL)
            goto error;
        Py_CLEAR(result);
    }
    self->t1 = t1;
    self->has_t1 = 1;
    /* _current is left on this span, as in the pure core: every reader skips closed spans up
     * to the innermost open one, and a set per stop (a new context mapping and a token) cost
     * about 100 ns of the span's 500. The next start in this context moves it on. */
    if (PyTuple_GET_SIZE(R->listeners) && call_listeners(R, s_span_stopped, (PyObject *)self) < 0)
        goto error;
    if (R->prog != NULL && self->tid == R->progress_tid && progress_exit(self, R, t1) < 0)
        goto error;
    if (self->written != START_DROPPED) {
        /* No room check: the queue exceeds its bound by at most the open spans. */
        if (queue_append(R, (PyObject *)self) < 0)
            goto error;
    }
    else {
        PyObject *pipeline = Py_NewRef(R->pipeline);
        result = PyObject_CallMethodNoArgs(pipeline, s_start_resolved);
        Py_DECREF(pipeline);
        if (result == NULL)
            goto error;
        Py_CLEAR(result);
        int room = queue_has_room(R);
        if (room < 0)
            goto error;
        if (room) {
            self->written = 0; /* the writer sees it once, ended: one complete record */
            if (queue_append(R, (PyObject *)self) < 0)
                goto error;
        }
        else {
            pipeline = Py_NewRef(R->pipeline);
            result = PyObject_CallMethodOneArg(pipeline, s_overflow, (PyObject *)self);
            Py_DECREF(pipeline);
            if (result == NULL)
                goto error;
        }
    }
    if (wake_after_save(self, rec) < 0)
        goto error;
done:
    Py_XDECREF(result);
    Py_XDECREF(when);
    Py_DECREF(rec);
#ifdef HANDOFF
    let_writer_in(t1);
#endif
    Py_RETURN_NONE;
error:
    Py_XDECREF(when);
    Py_DECREF(rec);
    return NULL;
}

/* --------------------------------------------------------- record_span */

static PyObject *g_span_class = NULL; /* traintrace.Span: what record_span makes */
#define MAX_NS (((int64_t)1) << 62)   /* _recorder._MAX_NS */

/* An exact int in [0, MAX_NS): 1 (and *out), else 0. */
static int
plain_ns(PyObject *value, int64_t *out)
{
    if (!PyLong_CheckExact(value))
        return 0;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (overflow || v < 0 || v >= MAX_NS)
        return 0; /* (-1 with no error is out of range too) */
    *out = v;
    return 1;
}

/*
 * Recorder.record_span(name, t0, t1, *, parent=None, metrics=None, level=INFO, status="ok").
 * The case framework callbacks make per training phase (a str name, two perf_counter_ns
 * readings in order, an int level, a str status, no metrics or a dict of them, a Span or
 * no parent) is done here; anything else goes to _record_span_checked, the Python method,
 * which warns about what it must.
 */
static PyObject *
recorder_record_span(PyObject *self, PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    RecorderCore *R = (RecorderCore *)self;
    PyObject *parent = Py_None, *metrics = Py_None, *level = g_info, *status = s_ok;
    int64_t t0 = 0, t1 = 0;
    int plain = g_span_class != NULL && level != NULL && nargs == 3;
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t i = 0; plain && i < nkw; i++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, i), *value = args[nargs + i];
        if (PyUnicode_CompareWithASCIIString(key, "parent") == 0)
            parent = value;
        else if (PyUnicode_CompareWithASCIIString(key, "metrics") == 0)
            metrics = value;
        else if (PyUnicode_CompareWithASCIIString(key, "level") == 0)
            level = value;
        else if (PyUnicode_CompareWithASCIIString(key, "status") == 0)
            status = value;
        else
            plain = 0;
    }
    plain = plain && PyUnicode_CheckExact(args[0]) && plain_ns(args[1], &t0) && plain_ns(args[2], &t1) && t0 <= t1 &&
            PyLong_CheckExact(level) && PyUnicode_CheckExact(status) &&
            (metrics == Py_None || PyDict_CheckExact(metrics)) &&
            (parent == Py_None || PyObject_TypeCheck(parent, (PyTypeObject *)g_span_class));
    if (!plain) {
        PyObject *checked = PyObject_GetAttrString(self, "_record_span_checked");
        if (checked == NULL)
            return NULL;
        PyObject *result = PyObject_Vectorcall(checked, args, nargs, kwnames);
        Py_DECREF(checked);
        return result;
    }
    if (R->closed)
        Py_RETURN_NONE;
    int above = level_above(level, R->max_level);
    if (above != 0)
        return above < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *attrs = Py_None;
    if (metrics != Py_None && PyDict_GET_SIZE(metrics) > 0) {
        attrs = PyDict_Copy(metrics); /* a snapshot, as as_attrs takes */
        if (attrs == NULL)
            return NULL;
    }
    else {
        Py_INCREF(attrs);
    }
    PyObject *obj = span_new((PyTypeObject *)g_span_class, NULL, NULL);
    if (obj == NULL) {
        Py_DECREF(attrs);
        return NULL;
    }
    SpanCore *span = (SpanCore *)obj;
    Py_SETREF(span->name, Py_NewRef(args[0]));
    Py_SETREF(span->attrs, attrs);
    Py_SETREF(span->level, Py_NewRef(level));
    Py_SETREF(span->parent, Py_NewRef(parent));
    Py_SETREF(span->status, Py_NewRef(status));
    if (next_value(g_ids, &span->id) < 0)
        goto error;
    span->tid = PyThread_get_thread_ident();
    span->written = 0;
    span->t0 = t0;
    span->t1 = t1;
    span->has_t1 = 1;
    Py_SETREF(span->rec, Py_NewRef(self));
    /* Seen twice by the writer, like any span: once to write it, once as its end. */
    int room = queue_has_room(R);
    if (room < 0)
        goto error;
    if (room) {
        if (queue_append(R, obj) < 0 || queue_append(R, obj) < 0)
            goto error;
    }
    else {
        PyObject *pipeline = Py_NewRef(R->pipeline);
        PyObject *result = PyObject_CallMethodOneArg(pipeline, s_overflow, obj);
        Py_DECREF(pipeline);
        if (result == NULL)
            goto error;
        int queued = PyObject_IsTrue(result);
        Py_DECREF(result);
        if (queued < 0 || (queued && queue_append(R, obj) < 0))
            goto error;
    }
    return obj;
error:
    Py_DECREF(obj);
    return NULL;
}

static PyMethodDef recorder_methods[] = {
    {"record_span", (PyCFunction)(void (*)(void))recorder_record_span, METH_FASTCALL | METH_KEYWORDS,
     "record_span(name, t0, t1, *, parent=None, metrics=None, level=INFO, status='ok')\n--\n\n"
     "Record a span that already ended, timed by two time.perf_counter_ns() readings."},
    {NULL},
};

/* InertSpan's start and stop: nothing, at the cost of a C call. */
static PyObject *
span_noop_enter(PyObject *self, PyObject *unused)
{
    return Py_NewRef(self);
}

static PyObject *
span_noop_exit(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_RETURN_NONE;
}

static PyMethodDef span_methods[] = {
    {"_noop_enter", (PyCFunction)span_noop_enter, METH_NOARGS, "__enter__ of a span that records nothing."},
    {"_noop_exit", (PyCFunction)(void (*)(void))span_noop_exit, METH_FASTCALL, "__exit__ of a span that records nothing."},
    {"__enter__", (PyCFunction)span_enter, METH_NOARGS, "Start the span (when a recorder is configured)."},
    {"__exit__", (PyCFunction)(void (*)(void))span_exit, METH_FASTCALL, "Stop the span."},
    {NULL},
};

static PyGetSetDef span_getset[] = {
    {"name", (getter)SpanCore_get_name, (setter)SpanCore_set_name, NULL, NULL},
    {"attrs", (getter)SpanCore_get_attrs, (setter)SpanCore_set_attrs, NULL, NULL},
    {"_attrs_step", (getter)SpanCore_get_attrs_step, NULL, "The int step that attrs stand for until read, or None.",
     NULL},
    {"level", (getter)SpanCore_get_level, (setter)SpanCore_set_level, NULL, NULL},
    {"link", (getter)SpanCore_get_link, (setter)SpanCore_set_link, NULL, NULL},
    {"_rec", (getter)SpanCore_get_rec, (setter)SpanCore_set_rec, NULL, NULL},
    {"parent", (getter)SpanCore_get_parent, (setter)SpanCore_set_parent, NULL, NULL},
    {"id", (getter)SpanCore_get_id, (setter)SpanCore_set_id, NULL, NULL},
    {"tid", (getter)SpanCore_get_tid, (setter)SpanCore_set_tid, NULL, NULL},
    {"t0", (getter)SpanCore_get_t0, (setter)SpanCore_set_t0, NULL, NULL},
    {"t1", (getter)SpanCore_get_t1, (setter)SpanCore_set_t1, NULL, NULL},
    {"status", (getter)SpanCore_get_status, (setter)SpanCore_set_status, NULL, NULL},
    {"written", (getter)SpanCore_get_written, (setter)SpanCore_set_written, NULL, NULL},
    {"metrics", (getter)SpanCore_get_metrics, (setter)SpanCore_set_metrics, NULL, NULL},
    {NULL},
};

static PyTypeObject SpanCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "traintrace._span.SpanCore",
    .tp_basicsize = sizeof(SpanCore),
    /* No Py_TPFLAGS_HAVE_GC on purpose: see the top of this file. */
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "The native base of traintrace.Span.",
    .tp_new = span_new,
    .tp_init = (initproc)span_init,
    .tp_dealloc = (destructor)span_dealloc,
    .tp_methods = span_methods,
    .tp_getset = span_getset,
};

/* ---------------------------------------------------------------- Factory */

/* The span helpers' fast path (tt.forward(), tt.training_iteration(step)): a callable
 * that makes the span itself in the common cases (no argument; an iteration's int
 * step) exactly as the Python helper it wraps would, and calls that helper for
 * everything else. Its attributes (__doc__, __name__, __wrapped__...) are the helper's. */
typedef struct {
    PyObject_HEAD
    PyObject *fallback;   /* the Python helper */
    PyObject *cls;        /* the span class it makes */
    PyObject *name;
    PyObject *level;
    PyObject *inert;      /* what it returns when nothing would record */
    int iteration;        /* training_iteration(step): attrs {"step": step} */
    vectorcallfunc vectorcall;
} Factory;

static PyTypeObject FactoryType;

/* attrs_step: attrs is the step of training_iteration(step) (see SpanCore.attrs_step) */
static PyObject *
new_span(PyObject *cls, PyObject *name, PyObject *attrs, int attrs_step, PyObject *level)
{
    PyObject *obj = span_new((PyTypeObject *)cls, NULL, NULL);
    if (obj == NULL)
        return NULL;
    SpanCore *span = (SpanCore *)obj;
    Py_SETREF(span->name, Py_NewRef(name));
    Py_SETREF(span->attrs, Py_NewRef(attrs));
    span->attrs_step = attrs_step;
    Py_SETREF(span->level, Py_NewRef(level));
    return obj;
}

static PyObject *
make_span(Factory *self, PyObject *attrs, int attrs_step)
{
    return new_span(self->cls, self->name, attrs, attrs_step, self->level);
}

static PyObject *
factory_vectorcall(Factory *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    int plain = (kwnames == NULL || PyTuple_GET_SIZE(kwnames) == 0) &&
                (nargs == 0 || (self->iteration && nargs == 1 && PyLong_CheckExact(args[0])));
    if (plain && installed) {
        PyObject *rec = PyDict_GetItemWithError(g_namespace, s_active);
        if (rec == NULL && PyErr_Occurred())
            return NULL;
        if (rec == NULL || rec == Py_None)
            return Py_NewRef(self->inert);
        if (RecorderCore_Check(rec)) {
            Py_INCREF(rec);
            int above = level_above(self->level, ((RecorderCore *)rec)->max_level);
            Py_DECREF(rec);
            if (above < 0)
                return NULL;
            if (above)
                return Py_NewRef(self->inert);
            if (nargs == 0)
                return make_span(self, Py_None, 0);
            return make_span(self, args[0], 1);
        }
    }
    return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
}

static PyObject *
factory_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *fallback, *cls, *name, *level, *inert;
    int iteration;
    if (!PyArg_ParseTuple(args, "OO!OOOp:Factory", &fallback, &PyType_Type, &cls, &name, &level, &inert, &iteration))
        return NULL;
    if (!PyType_IsSubtype((PyTypeObject *)cls, &SpanCoreType) || ((PyTypeObject *)cls)->tp_new != span_new ||
        ((PyTypeObject *)cls)->tp_init != (initproc)span_init) {
        PyErr_SetString(PyExc_TypeError, "Factory: the class must be a Span that keeps SpanCore's __new__ and __init__");
        return NULL;
    }
    Factory *self = (Factory *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->fallback = Py_NewRef(fallback);
    self->cls = Py_NewRef(cls);
    self->name = Py_NewRef(name);
    self->level = Py_NewRef(level);
    self->inert = Py_NewRef(inert);
    self->iteration = iteration;
    self->vectorcall = (vectorcallfunc)factory_vectorcall;
    return (PyObject *)self;
}

static int
factory_traverse(Factory *self, visitproc visit, void *arg)
{
    Py_VISIT(self->fallback);
    Py_VISIT(self->cls);
    Py_VISIT(self->name);
    Py_VISIT(self->level);
    Py_VISIT(self->inert);
    return 0;
}

static int
factory_clear(Factory *self)
{
    Py_CLEAR(self->fallback);
    Py_CLEAR(self->cls);
    Py_CLEAR(self->name);
    Py_CLEAR(self->level);
    Py_CLEAR(self->inert);
    return 0;
}

static void
factory_dealloc(Factory *self)
{
    PyObject_GC_UnTrack(self);
    factory_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The helper's own attributes: its name, documentation and signature (via __wrapped__). */
static PyObject *
factory_getattro(Factory *self, PyObject *name)
{
    if (PyUnicode_Check(name)) {
        if (PyUnicode_CompareWithASCIIString(name, "__wrapped__") == 0)
            return Py_NewRef(self->fallback);
        if (PyUnicode_CompareWithASCIIString(name, "__class__") != 0 &&
            PyUnicode_CompareWithASCIIString(name, "__call__") != 0 && PyUnicode_GET_LENGTH(name) > 4 &&
            PyUnicode_READ_CHAR(name, 0) == '_' && PyUnicode_READ_CHAR(name, 1) == '_' && self->fallback != NULL)
            return PyObject_GetAttr(self->fallback, name);
    }
    PyObject *found = PyObject_GenericGetAttr((PyObject *)self, name);
    if (found == NULL && self->fallback != NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
        return PyObject_GetAttr(self->fallback, name);
    }
    return found;
}

static PyObject *
factory_repr(Factory *self)
{
    return PyObject_Repr(self->fallback);
}

static PyTypeObject FactoryType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "traintrace._span.Factory",
    .tp_basicsize = sizeof(Factory),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = factory_new,
    .tp_dealloc = (destructor)factory_dealloc,
    .tp_traverse = (traverseproc)factory_traverse,
    .tp_clear = (inquiry)factory_clear,
    .tp_vectorcall_offset = offsetof(Factory, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_getattro = (getattrofunc)factory_getattro,
    .tp_repr = (reprfunc)factory_repr,
};

/* ----------------------------------------------------------------- module */

static PyObject *
install(PyObject *module, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"namespace", "current", "phases", "iteration_code", "collective_code", "iteration_name",
                             "info", "ids", "adopt", "failed", "reused", "span", NULL};
    PyObject *namespace, *current, *phases, *iteration_name, *info, *ids, *adopt, *failed, *reused, *span;
    long iteration_code, collective_code;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!OO!llUOO!OOOO!:install", kwlist, &PyDict_Type, &namespace,
                                     &current, &PyDict_Type, &phases, &iteration_code, &collective_code,
                                     &iteration_name, &info, &CounterType, &ids, &adopt, &failed, &reused,
                                     &PyType_Type, &span))
        return NULL;
    if (!PyType_IsSubtype((PyTypeObject *)span, &SpanCoreType) || ((PyTypeObject *)span)->tp_new != span_new ||
        ((PyTypeObject *)span)->tp_init != (initproc)span_init) {
        PyErr_SetString(PyExc_TypeError, "span must be a Span that keeps SpanCore's __new__ and __init__");
        return NULL;
    }
    if (!PyContextVar_CheckExact(current)) {
        PyErr_SetString(PyExc_TypeError, "current must be a ContextVar");
        return NULL;
    }
    Py_XSETREF(g_namespace, Py_NewRef(namespace));
    Py_XSETREF(g_current, Py_NewRef(current));
    Py_XSETREF(g_phases, Py_NewRef(phases));
    phase_cache_clear();
    Py_XSETREF(g_iteration_name, Py_NewRef(iteration_name));
    Py_XSETREF(g_info, Py_NewRef(info));
    Py_XSETREF(g_ids, Py_NewRef(ids));
    Py_XSETREF(g_adopt, Py_NewRef(adopt));
    Py_XSETREF(g_failed, Py_NewRef(failed));
    Py_XSETREF(g_reused, Py_NewRef(reused));
    Py_XSETREF(g_span_class, Py_NewRef(span));
    g_iteration_code = iteration_code;
    g_collective_code = collective_code;
    static const char *saves[3] = {"checkpoint_save_sync", "checkpoint_save_async", "checkpoint_save_finalization"};
    for (int i = 0; i < 3; i++) {
        PyObject *code = PyDict_GetItemString(phases, saves[i]); /* borrowed */
        g_save_codes[i] = code != NULL && PyLong_Check(code) ? PyLong_AsLong(code) : -1;
        if (g_save_codes[i] == -1 && PyErr_Occurred())
            return NULL;
    }
    installed = 1;
    Py_RETURN_NONE;
}

/* _step_span(cls, name, step, level): a span as training_iteration(step) makes it, its attrs the
 * int step until first read (tests: the writer reads such a span's step without making the dict). */
static PyObject *
step_span(PyObject *module, PyObject *args)
{
    PyObject *cls, *name, *step, *level;
    if (!PyArg_ParseTuple(args, "O!OOO:_step_span", &PyType_Type, &cls, &name, &step, &level))
        return NULL;
    if (!PyType_IsSubtype((PyTypeObject *)cls, &SpanCoreType) || ((PyTypeObject *)cls)->tp_new != span_new ||
        !PyLong_CheckExact(step)) {
        PyErr_SetString(PyExc_TypeError, "_step_span: a Span class that keeps SpanCore's __new__, and an int step");
        return NULL;
    }
    return new_span(cls, name, step, 1, level);
}

/* ------------------------------------------------------------ StepHooks */

/*
 * The Lightning callback's four per-step hooks (integrations/lightning.py), in C: Lightning calls
 * them between torch's operators, where the interpreter's caches are cold, and a step's worth of
 * their Python (four frames, some thirty attribute reads, the calls into the recorder) cost tens of
 * microseconds there. Each hook here does what the callback's Python hook does, on the same
 * attributes of the same callback (the rest of the callback reads and writes them as before), for
 * the configuration the callback installs it in (TraintraceCallback._install_native_hooks: spans
 * for the phases, no span listener, no batch or token function, no FLOP counter). A state the
 * common path does not cover (a live phase span, a FLOP counter running, timings pending, a step
 * whose logged metrics are read) is left whole to the Python hook, before anything is changed.
 */

enum { H_BATCH_START, H_BEFORE_BACKWARD, H_BEFORE_OPTIMIZER, H_BATCH_END, N_HOOKS };
#define H_END_ITERATION N_HOOKS /* TraintraceCallback._end_iteration(span, trainer, loss) */

typedef struct {
    PyObject_HEAD
    PyObject *cb;                  /* the callback */
    PyObject *fallback[N_HOOKS + 1]; /* TraintraceCallback's Python hooks (plain functions), _end_iteration */
    PyObject *batch_info;          /* integrations._common.batch_info */
    PyObject *loss_of;             /* integrations.lightning._loss_of */
    PyObject *names[5];            /* iteration, forward, backward, optimizer step, data loading */
    PyObject *levels[3];           /* iteration, phase, wait */
    long codes[5];                 /* the names' phase codes */
} StepHooks;

enum { N_ITERATION, N_FORWARD, N_BACKWARD, N_OPTIMIZER, N_WAIT };
enum { L_ITERATION, L_PHASE, L_WAIT };

static PyObject *h_wait_t0, *h_wait_span, *h_rec, *h_loop, *h_epoch, *h_flops, *h_iter, *h_phase, *h_phase_span,
    *h_mark, *h_flop_counter, *h_log_metrics, *h_every, *h_timings, *h_global_step, *h_current_epoch, *h_shape,
    *h_loss, *h_metrics, *h_exit, *h_record_span, *h_batch_idx, *h_batch_size, *h_tokens, *h_flops_key, *h_epoch_key,
    *h_kw_phase, *h_kw_wait, *h_zero, *h_enter, *h_wait_collective;

static int
hooks_intern(void)
{
    if (h_zero != NULL)
        return 0;
#define INTERN(var, text)                                  \
    if ((var = PyUnicode_InternFromString(text)) == NULL) \
        return -1;
    INTERN(h_wait_t0, "_wait_t0")
    INTERN(h_wait_span, "_wait_span")
    INTERN(h_wait_collective, "_wait_collective")
    INTERN(h_rec, "_rec")
    INTERN(h_loop, "_loop")
    INTERN(h_epoch, "_epoch")
    INTERN(h_flops, "_flops")
    INTERN(h_iter, "_iter")
    INTERN(h_phase, "_phase")
    INTERN(h_phase_span, "_phase_span")
    INTERN(h_mark, "_mark")
    INTERN(h_flop_counter, "_flop_counter")
    INTERN(h_log_metrics, "log_metrics")
    INTERN(h_every, "_every")
    INTERN(h_timings, "_timings")
    INTERN(h_global_step, "global_step")
    INTERN(h_current_epoch, "current_epoch")
    INTERN(h_shape, "shape")
    INTERN(h_loss, "loss")
    INTERN(h_metrics, "metrics")
    INTERN(h_exit, "__exit__")
    INTERN(h_enter, "__enter__")
    INTERN(h_record_span, "record_span")
    INTERN(h_batch_idx, "batch_idx")
    INTERN(h_batch_size, "batch_size")
    INTERN(h_tokens, "tokens")
    INTERN(h_flops_key, "flops")
    INTERN(h_epoch_key, "epoch")
#undef INTERN
    if ((h_kw_phase = Py_BuildValue("(ss)", "parent", "level")) == NULL ||
        (h_kw_wait = Py_BuildValue("(sss)", "parent", "level", "status")) == NULL)
        return -1;
    h_zero = PyLong_FromLong(0);
    return h_zero == NULL ? -1 : 0;
}

static PyTypeObject StepHooksType;

/* StepHooks(callback, fallbacks, batch_info, loss_of, names, levels) */
static PyObject *
hooks_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *cb, *fallbacks, *batch_info, *loss_of, *names, *levels;
    if (!PyArg_ParseTuple(args, "OO!OOO!O!:StepHooks", &cb, &PyTuple_Type, &fallbacks, &batch_info, &loss_of,
                          &PyTuple_Type, &names, &PyTuple_Type, &levels))
        return NULL;
    if (PyTuple_GET_SIZE(fallbacks) != N_HOOKS + 1 || PyTuple_GET_SIZE(names) != 5 || PyTuple_GET_SIZE(levels) != 3) {
        PyErr_SetString(PyExc_TypeError, "StepHooks: 5 fallbacks, 5 names and 3 levels");
        return NULL;
    }
    if (!installed || hooks_intern() < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "StepHooks: the native core is not installed");
        return NULL;
    }
    long codes[5];
    for (int i = 0; i < 5; i++) {
        PyObject *name = PyTuple_GET_ITEM(names, i);
        int found = PyUnicode_Check(name) ? phase_code(name, &codes[i]) : 0;
        if (found <= 0) {
            if (found == 0)
                PyErr_Format(PyExc_ValueError, "StepHooks: %R is not a standard phase", name);
            return NULL;
        }
    }
    StepHooks *self = (StepHooks *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->cb = Py_NewRef(cb);
    for (int i = 0; i <= N_HOOKS; i++)
        self->fallback[i] = Py_NewRef(PyTuple_GET_ITEM(fallbacks, i));
    self->batch_info = Py_NewRef(batch_info);
    self->loss_of = Py_NewRef(loss_of);
    for (int i = 0; i < 5; i++) {
        self->names[i] = Py_NewRef(PyTuple_GET_ITEM(names, i));
        self->codes[i] = codes[i];
    }
    for (int i = 0; i < 3; i++)
        self->levels[i] = Py_NewRef(PyTuple_GET_ITEM(levels, i));
    return (PyObject *)self;
}

static int
hooks_traverse(StepHooks *self, visitproc visit, void *arg)
{
    Py_VISIT(self->cb);
    for (int i = 0; i <= N_HOOKS; i++)
        Py_VISIT(self->fallback[i]);
    Py_VISIT(self->batch_info);
    Py_VISIT(self->loss_of);
    for (int i = 0; i < 5; i++)
        Py_VISIT(self->names[i]);
    for (int i = 0; i < 3; i++)
        Py_VISIT(self->levels[i]);
    return 0;
}

static int
hooks_clear(StepHooks *self)
{
    Py_CLEAR(self->cb);
    for (int i = 0; i <= N_HOOKS; i++)
        Py_CLEAR(self->fallback[i]);
    Py_CLEAR(self->batch_info);
    Py_CLEAR(self->loss_of);
    for (int i = 0; i < 5; i++)
        Py_CLEAR(self->names[i]);
    for (int i = 0; i < 3; i++)
        Py_CLEAR(self->levels[i]);
    return 0;
}

static void
hooks_dealloc(StepHooks *self)
{
    PyObject_GC_UnTrack(self);
    hooks_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The Python hook `which`, with the hook's own arguments. */
static PyObject *
hooks_fallback(StepHooks *self, int which, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf), total = nargs + (kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames));
    PyObject *small[9], **stack = small;
    if (total + 1 > 9 && (stack = PyMem_Malloc((size_t)(total + 1) * sizeof(PyObject *))) == NULL)
        return PyErr_NoMemory();
    stack[0] = self->cb;
    for (Py_ssize_t i = 0; i < total; i++)
        stack[i + 1] = args[i];
    PyObject *result = PyObject_Vectorcall(self->fallback[which], stack, (size_t)nargs + 1, kwnames);
    if (stack != small)
        PyMem_Free(stack);
    return result;
}

/* Positional arguments only, as Lightning passes them: else the Python hook takes the call. */
#define HOOK_ARGS(which, expected)                                                   \
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);                                   \
    if (nargs != (expected) || (kwnames != NULL && PyTuple_GET_SIZE(kwnames) > 0)) \
        return hooks_fallback(self, (which), args, nargsf, kwnames);

/* 1 if the callback's attribute `name` is None, 0 if not, -1 on error. */
static int
attr_is_none(PyObject *cb, PyObject *name)
{
    PyObject *value = PyObject_GetAttr(cb, name);
    if (value == NULL)
        return -1;
    int none = value == Py_None;
    Py_DECREF(value);
    return none;
}

/* _progress.enter_timed_phase(rec, code, t0): two stores; a failing store is _progress.failed(rec). */
static int
hooks_timed_phase(PyObject *rec, long code, int64_t t0)
{
    if (!RecorderCore_Check(rec))
        return 0;
    RecorderCore *R = (RecorderCore *)rec;
    if (R->progress == Py_None || R->prog == NULL)
        return 0;
    int64_t seq = 0;
    if (next_value(R->seq, &seq) < 0)
        return progress_failed(rec, NULL, 0);
    volatile int64_t *prog = R->prog;
    if (prog == NULL)
        return 0;
    prog[S_PHASE_T0] = t0;
    prog[S_COUNTER] = seq | code;
    return 0;
}

/* rec.record_span(name, t0, t1, parent=parent, level=level[, status="ok"]); the span made is dropped. */
static int
hooks_record(PyObject *rec, PyObject *name, PyObject *t0, int64_t t1, PyObject *parent, PyObject *level, int status)
{
    PyObject *end = PyLong_FromLongLong(t1);
    if (end == NULL)
        return -1;
    PyObject *stack[7] = {rec, name, t0, end, parent, level, s_ok};
    PyObject *made = PyObject_VectorcallMethod(h_record_span, stack, 4 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                               status ? h_kw_wait : h_kw_phase);
    Py_DECREF(end);
    if (made == NULL)
        return -1;
    Py_DECREF(made);
    return 0;
}

/* The callback's _phase_to(name) where no phase is a live span (name NULL: end the phase only). */
static int
hooks_phase_to(StepHooks *self, int name)
{
    PyObject *cb = self->cb;
    int64_t now = now_ns();
    PyObject *current = PyObject_GetAttr(cb, h_phase);
    if (current == NULL)
        return -1;
    if (current != Py_None) {
        int rc = PyObject_SetAttr(cb, h_phase, Py_None);
        PyObject *rec = rc < 0 ? NULL : PyObject_GetAttr(cb, h_rec);
        if (rec == NULL) {
            Py_DECREF(current);
            return -1;
        }
        if (rec != Py_None) {
            PyObject *mark = PyObject_GetAttr(cb, h_mark);
            PyObject *iter = mark == NULL ? NULL : PyObject_GetAttr(cb, h_iter);
            rc = iter == NULL ? -1 : hooks_record(rec, current, mark, now, iter, self->levels[L_PHASE], 0);
            Py_XDECREF(mark);
            Py_XDECREF(iter);
        }
        Py_DECREF(rec);
        if (rc < 0) {
            Py_DECREF(current);
            return -1;
        }
    }
    Py_DECREF(current);
    if (name < 0)
        return 0;
    int no_iter = attr_is_none(cb, h_iter);
    if (no_iter != 0)
        return no_iter < 0 ? -1 : 0;
    if (PyObject_SetAttr(cb, h_phase, self->names[name]) < 0)
        return -1;
    PyObject *mark = PyLong_FromLongLong(now);
    if (mark == NULL)
        return -1;
    int rc = PyObject_SetAttr(cb, h_mark, mark);
    Py_DECREF(mark);
    PyObject *rec = rc < 0 ? NULL : PyObject_GetAttr(cb, h_rec);
    if (rec == NULL)
        return -1;
    rc = hooks_timed_phase(rec, self->codes[name], now);
    Py_DECREF(rec);
    return rc;
}

/* No live phase or wait span, no FLOP counter: the state the hooks here cover. 1, 0 (leave it to
 * Python) or -1. */
static int
hooks_common_state(PyObject *cb)
{
    int ok = attr_is_none(cb, h_phase_span);
    if (ok == 1)
        ok = attr_is_none(cb, h_wait_span);
    if (ok == 1)
        ok = attr_is_none(cb, h_flop_counter);
    return ok;
}

/* (batch size, tokens) of a tuple or list whose first item has a non-empty shape, as batch_info's
 * first case reads it; 0 where batch_info must decide, -1 on error. */
static int
hooks_batch_size(PyObject *batch, PyObject **size)
{
    *size = NULL;
    if (!(PyTuple_CheckExact(batch) || PyList_CheckExact(batch)) || PySequence_Fast_GET_SIZE(batch) == 0)
        return 0;
    PyObject *first = PySequence_Fast_GET_ITEM(batch, 0);
    Py_INCREF(first);
    PyObject *shape = PyObject_GetAttr(first, h_shape);
    Py_DECREF(first);
    if (shape == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return -1;
        PyErr_Clear();
        return 0;
    }
    int found = 0;
    if (shape != Py_None && PyTuple_Check(shape) && PyTuple_GET_SIZE(shape) > 0 &&
        PyLong_CheckExact(PyTuple_GET_ITEM(shape, 0))) {
        *size = Py_NewRef(PyTuple_GET_ITEM(shape, 0)); /* torch.Size is a tuple of ints */
        found = 1;
    }
    Py_DECREF(shape);
    return found;
}

static PyObject *
hooks_batch_start(StepHooks *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    PyObject *cb = self->cb;
    HOOK_ARGS(H_BATCH_START, 4)
    int common = hooks_common_state(cb);
    if (common == 1) /* a collective inside the wait (Lightning's SIGTERM broadcast): Python records it with it */
        common = attr_is_none(cb, h_wait_collective);
    if (common <= 0)
        return common < 0 ? NULL : hooks_fallback(self, H_BATCH_START, args, nargsf, kwnames);
    PyObject *trainer = args[0], *batch = args[2], *batch_idx = args[3];
    /* _end_wait() */
    PyObject *t0 = PyObject_GetAttr(cb, h_wait_t0);
    if (t0 == NULL)
        return NULL;
    if (t0 != Py_None) {
        int64_t now = now_ns();
        PyObject *rec = PyObject_SetAttr(cb, h_wait_t0, Py_None) < 0 ? NULL : PyObject_GetAttr(cb, h_rec);
        int rc = rec == NULL ? -1 : 0;
        if (rec != NULL && rec != Py_None) {
            PyObject *loop = PyObject_GetAttr(cb, h_loop);
            rc = loop == NULL ? -1 : hooks_record(rec, self->names[N_WAIT], t0, now, loop, self->levels[L_WAIT], 1);
            Py_XDECREF(loop);
        }
        Py_XDECREF(rec);
        if (rc < 0) {
            Py_DECREF(t0);
            return NULL;
        }
    }
    Py_DECREF(t0);
    PyObject *attrs = PyDict_New();
    if (attrs == NULL)
        return NULL;
    PyObject *step = PyObject_GetAttr(trainer, h_global_step);
    PyObject *epoch = step == NULL ? NULL : PyObject_GetAttr(cb, h_epoch);
    if (epoch == Py_None) {
        Py_DECREF(epoch);
        epoch = PyObject_GetAttr(trainer, h_current_epoch);
    }
    int rc = epoch == NULL || PyDict_SetItem(attrs, s_step, step) < 0 ||
                     PyDict_SetItem(attrs, h_batch_idx, batch_idx) < 0 || PyDict_SetItem(attrs, h_epoch_key, epoch) < 0
                 ? -1
                 : 0;
    Py_XDECREF(step);
    Py_XDECREF(epoch);
    PyObject *size = NULL, *tokens = NULL;
    if (rc == 0) {
        int found = hooks_batch_size(batch, &size);
        if (found < 0) {
            rc = -1;
        }
        else if (found == 0) {
            PyObject *info = PyObject_CallOneArg(self->batch_info, batch);
            if (info == NULL || !PyTuple_Check(info) || PyTuple_GET_SIZE(info) != 2) {
                if (info != NULL)
                    PyErr_SetString(PyExc_TypeError, "batch_info: expected a pair");
                rc = -1;
            }
            else {
                size = Py_NewRef(PyTuple_GET_ITEM(info, 0));
                tokens = Py_NewRef(PyTuple_GET_ITEM(info, 1));
            }
            Py_XDECREF(info);
        }
    }
    if (rc == 0 && size != NULL && size != Py_None)
        rc = PyDict_SetItem(attrs, h_batch_size, size);
    if (rc == 0 && tokens != NULL && tokens != Py_None)
        rc = PyDict_SetItem(attrs, h_tokens, tokens);
    Py_XDECREF(size);
    Py_XDECREF(tokens);
    if (rc == 0) {
        PyObject *flops = PyObject_GetAttr(cb, h_flops);
        rc = flops == NULL ? -1 : flops != Py_None ? PyDict_SetItem(attrs, h_flops_key, flops) : 0;
        Py_XDECREF(flops);
    }
    if (rc < 0) {
        Py_DECREF(attrs);
        return NULL;
    }
    /* self._iter = self._start(ITERATION, attrs, level) */
    PyObject *span_args[3] = {self->names[N_ITERATION], attrs, self->levels[L_ITERATION]};
    PyObject *span = PyObject_Vectorcall(g_span_class, span_args, 3, NULL);
    Py_DECREF(attrs);
    if (span == NULL)
        return NULL;
    PyObject *entered = PyObject_CallMethodNoArgs(span, h_enter);
    if (entered == NULL) {
        Py_DECREF(span);
        return NULL;
    }
    Py_DECREF(entered);
    PyObject *held = ((SpanCore *)span)->rec != Py_None ? span : Py_None;
    rc = PyObject_SetAttr(cb, h_iter, held);
    Py_DECREF(span);
    if (rc < 0 || hooks_phase_to(self, N_FORWARD) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
hooks_phase_hook(StepHooks *self, int which, int name, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    HOOK_ARGS(which, 3)
    int common = attr_is_none(self->cb, h_phase_span);
    if (common <= 0)
        return common < 0 ? NULL : hooks_fallback(self, which, args, nargsf, kwnames);
    if (hooks_phase_to(self, name) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
hooks_before_backward(StepHooks *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    return hooks_phase_hook(self, H_BEFORE_BACKWARD, N_BACKWARD, args, nargsf, kwnames);
}

static PyObject *
hooks_before_optimizer(StepHooks *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    return hooks_phase_hook(self, H_BEFORE_OPTIMIZER, N_OPTIMIZER, args, nargsf, kwnames);
}

/* Whether _end_iteration would only put the loss on the span: no phase timings pending and, where logged
 * metrics are read, not a step they are read at (evaluated as _end_iteration does). 1, 0 or -1. */
static int
hooks_loss_only(PyObject *cb, PyObject *trainer)
{
    PyObject *timings = PyObject_GetAttr(cb, h_timings);
    if (timings == NULL)
        return -1;
    int empty = PyDict_CheckExact(timings) && PyDict_GET_SIZE(timings) == 0;
    Py_DECREF(timings);
    if (!empty)
        return 0;
    PyObject *log = PyObject_GetAttr(cb, h_log_metrics);
    if (log == NULL)
        return -1;
    int logging = PyObject_IsTrue(log);
    Py_DECREF(log);
    if (logging <= 0)
        return logging < 0 ? -1 : 1;
    PyObject *step = PyObject_GetAttr(trainer, h_global_step);
    PyObject *every = step == NULL ? NULL : PyObject_GetAttr(cb, h_every);
    PyObject *rest = every == NULL ? NULL : PyNumber_Remainder(step, every);
    Py_XDECREF(step);
    Py_XDECREF(every);
    if (rest == NULL)
        return -1;
    int at_log = PyObject_RichCompareBool(rest, h_zero, Py_EQ);
    Py_DECREF(rest);
    return at_log < 0 ? -1 : !at_log;
}

/* _loss_of(outputs) (new reference) */
static PyObject *
hooks_loss(StepHooks *self, PyObject *outputs)
{
    if (outputs == Py_None)
        return Py_NewRef(Py_None);
    if (PyDict_CheckExact(outputs)) {
        PyObject *loss = PyDict_GetItemWithError(outputs, h_loss);
        return loss != NULL ? Py_NewRef(loss) : PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    }
    return PyObject_CallOneArg(self->loss_of, outputs);
}

/* _end_iteration(span, trainer, loss) where it only puts the loss on the span and ends it; else the Python
 * method. */
static int
hooks_end_iteration(StepHooks *self, PyObject *span, PyObject *trainer, PyObject *loss)
{
    int plain = hooks_loss_only(self->cb, trainer);
    if (plain < 0)
        return -1;
    if (!plain) {
        PyObject *stack[4] = {self->cb, span, trainer, loss};
        PyObject *done = PyObject_Vectorcall(self->fallback[H_END_ITERATION], stack, 4, NULL);
        Py_XDECREF(done);
        return done == NULL ? -1 : 0;
    }
    if (loss != Py_None) {
        /* add_metrics(loss=loss) without its call, as the Python method does */
        PyObject *held = PyObject_GetAttr(span, h_metrics);
        if (held == NULL)
            return -1;
        int rc;
        if (held == Py_None) {
            PyObject *metrics = Py_BuildValue("{OO}", h_loss, loss);
            rc = metrics == NULL ? -1 : PyObject_SetAttr(span, h_metrics, metrics);
            Py_XDECREF(metrics);
        }
        else {
            rc = PyObject_SetItem(held, h_loss, loss);
        }
        Py_DECREF(held);
        if (rc < 0)
            return -1;
    }
    PyObject *stack[4] = {span, Py_None, Py_None, Py_None};
    PyObject *done = PyObject_VectorcallMethod(h_exit, stack, 4 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    Py_XDECREF(done);
    return done == NULL ? -1 : 0;
}

static PyObject *
hooks_batch_end(StepHooks *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    PyObject *cb = self->cb;
    HOOK_ARGS(H_BATCH_END, 5)
    int common = hooks_common_state(cb);
    if (common <= 0)
        return common < 0 ? NULL : hooks_fallback(self, H_BATCH_END, args, nargsf, kwnames);
    int no_phase = attr_is_none(cb, h_phase);
    if (no_phase < 0 || (!no_phase && hooks_phase_to(self, -1) < 0))
        return NULL;
    PyObject *span = PyObject_GetAttr(cb, h_iter);
    if (span == NULL)
        return NULL;
    if (span != Py_None) {
        PyObject *loss = PyObject_SetAttr(cb, h_iter, Py_None) < 0 ? NULL : hooks_loss(self, args[2]);
        int rc = loss == NULL ? -1 : hooks_end_iteration(self, span, args[0], loss);
        Py_XDECREF(loss);
        if (rc < 0) {
            Py_DECREF(span);
            return NULL;
        }
    }
    Py_DECREF(span);
    /* _begin_wait() */
    int64_t now = now_ns();
    PyObject *t0 = PyLong_FromLongLong(now);
    if (t0 == NULL)
        return NULL;
    int rc = PyObject_SetAttr(cb, h_wait_t0, t0);
    Py_DECREF(t0);
    PyObject *rec = rc < 0 ? NULL : PyObject_GetAttr(cb, h_rec);
    if (rec == NULL)
        return NULL;
    rc = hooks_timed_phase(rec, self->codes[N_WAIT], now);
    Py_DECREF(rec);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef hooks_methods[] = {
    {"on_train_batch_start", (PyCFunction)(void (*)(void))hooks_batch_start, METH_FASTCALL | METH_KEYWORDS,
     "on_train_batch_start(trainer, pl_module, batch, batch_idx)"},
    {"on_before_backward", (PyCFunction)(void (*)(void))hooks_before_backward, METH_FASTCALL | METH_KEYWORDS,
     "on_before_backward(trainer, pl_module, loss)"},
    {"on_before_optimizer_step", (PyCFunction)(void (*)(void))hooks_before_optimizer, METH_FASTCALL | METH_KEYWORDS,
     "on_before_optimizer_step(trainer, pl_module, optimizer)"},
    {"on_train_batch_end", (PyCFunction)(void (*)(void))hooks_batch_end, METH_FASTCALL | METH_KEYWORDS,
     "on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)"},
    {NULL},
};

static PyTypeObject StepHooksType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "traintrace._span.StepHooks",
    .tp_doc = "The Lightning callback's per-step hooks, in C (integrations/lightning.py).",
    .tp_basicsize = sizeof(StepHooks),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = hooks_new,
    .tp_traverse = (traverseproc)hooks_traverse,
    .tp_clear = (inquiry)hooks_clear,
    .tp_dealloc = (destructor)hooks_dealloc,
    .tp_methods = hooks_methods,
};

static PyMethodDef module_methods[] = {
    {"_step_span", step_span, METH_VARARGS, "A span whose attrs are an int step until first read (tests)."},
    {"install", (PyCFunction)(void (*)(void))install, METH_VARARGS | METH_KEYWORDS,
     "Hand the native core the recorder module's state (called once by _recorder)."},
    {NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "traintrace._span",
    .m_doc = "The native recording core: span start and stop on the training thread.",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__span(void)
{
#define INTERN(var, text)                                  \
    if ((var = PyUnicode_InternFromString(text)) == NULL) \
        return NULL;
    INTERN(s_active, "_active")
    INTERN(s_span_started, "span_started")
    INTERN(s_span_stopped, "span_stopped")
    INTERN(s_overflow, "overflow")
    INTERN(s_start_resolved, "start_resolved")
    INTERN(s_late_stop, "_late_stop")
    INTERN(s_wake, "wake")
    INTERN(s_span_failed, "_span_failed")
    INTERN(s_step, "step")
    INTERN(s_ok, "ok")
    INTERN(s_append, "append")
#undef INTERN
    RecorderCoreType.tp_methods = recorder_methods;
    if (PyType_Ready(&CounterType) < 0 || PyType_Ready(&RecorderCoreType) < 0 || PyType_Ready(&SpanCoreType) < 0 ||
        PyType_Ready(&FactoryType) < 0 || PyType_Ready(&StepHooksType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL)
        return NULL;
    PyObject *slots = Py_BuildValue("{sisisisisisisisisisisisisisi}", "S_COUNTER", S_COUNTER, "S_STEP", S_STEP,
                                    "S_PHASE_T0", S_PHASE_T0, "S_UPDATED", S_UPDATED, "S_COLLECTIVE", S_COLLECTIVE,
                                    "S_ITERATIONS", S_ITERATIONS, "S_STEP_T0", S_STEP_T0, "S_LAST_STEP_NS",
                                    S_LAST_STEP_NS, "S_COLLECTIVE_T0", S_COLLECTIVE_T0, "S_STEPS_DONE", S_STEPS_DONE,
                                    "S_LAST_DONE", S_LAST_DONE, "S_FIRST_STEP_T0", S_FIRST_STEP_T0, "PHASE_MASK",
                                    PHASE_MASK, "START_DROPPED", START_DROPPED);
    if (slots == NULL || PyModule_AddObject(module, "SLOTS", slots) < 0) {
        Py_XDECREF(slots);
        Py_DECREF(module);
        return NULL;
    }
    Py_INCREF(&CounterType);
    Py_INCREF(&RecorderCoreType);
    Py_INCREF(&SpanCoreType);
    Py_INCREF(&FactoryType);
    Py_INCREF(&StepHooksType);
#ifdef HANDOFF
    PyObject *wanted = PyCapsule_New(&gil_wanted_since, "traintrace._span._gil_wanted", NULL);
    if (wanted == NULL || PyModule_AddObject(module, "_gil_wanted", wanted) < 0) {
        Py_XDECREF(wanted);
        Py_DECREF(module);
        return NULL;
    }
    pthread_atfork(NULL, NULL, handoff_reset_child);
    PyObject *beat = PyCapsule_New(&writer_beat, "traintrace._span._writer_beat", NULL);
    if (beat == NULL || PyModule_AddObject(module, "_writer_beat", beat) < 0) {
        Py_XDECREF(beat);
        Py_DECREF(module);
        return NULL;
    }
#endif
    /* The span's layout for the writer's encoder (span_core.h). */
    static SpanCoreAPI core_api;
    core_api.layout = SPAN_CORE_LAYOUT;
    core_api.type = &SpanCoreType;
    PyObject *core = PyCapsule_New(&core_api, "traintrace._span._core", NULL);
    if (core == NULL || PyModule_AddObject(module, "_core", core) < 0) {
        Py_XDECREF(core);
        Py_DECREF(module);
        return NULL;
    }
    if (PyModule_AddObject(module, "Factory", (PyObject *)&FactoryType) < 0 ||
        PyModule_AddObject(module, "Counter", (PyObject *)&CounterType) < 0 ||
        PyModule_AddObject(module, "RecorderCore", (PyObject *)&RecorderCoreType) < 0 ||
        PyModule_AddObject(module, "SpanCore", (PyObject *)&SpanCoreType) < 0 ||
        PyModule_AddObject(module, "StepHooks", (PyObject *)&StepHooksType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
