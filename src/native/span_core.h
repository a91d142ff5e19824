/* The native span's fields (traintrace._span.SpanCore), shared by the two halves of the native
 * core: span.c makes and fills them on the training thread; encode.c reads them on the writer
 * thread directly, without a getter or a Python int per field.
 *
 * The encoder reads them only after traintrace._span has handed it the SpanCore type together
 * with SPAN_CORE_LAYOUT as span.c was compiled: a stale build of one module beside a new build of
 * the other (a different layout) leaves the encoder on its generic path, which reads the fields
 * through their getters. Change SPAN_CORE_VERSION whenever a field's meaning changes.
 */
#ifndef TRAINTRACE_SPAN_CORE_H
#define TRAINTRACE_SPAN_CORE_H

#include <Python.h>
#include <stddef.h>
#include <stdint.h>

typedef struct {
    PyObject_HEAD
    PyObject *name;
    PyObject *attrs;
    PyObject *level;
    PyObject *link;
    PyObject *rec;       /* None or a RecorderCore */
    PyObject *parent;    /* None or a SpanCore */
    PyObject *status;
    PyObject *metrics;
    int64_t id;
    int64_t t0;
    int64_t t1;
    unsigned long tid;
    long written;
    int has_t1;          /* t1 is not None */
    /* attrs holds the int step of training_iteration(step), and the dict {"step": step} it
     * stands for is made when attrs is first read (by the writer's generic path, or a user):
     * not on the training thread. */
    int attrs_step;
    /* The progress file's update word and phase start as this span found them (prev_t0 -1: not
     * read), put back at its stop when they were set within the enclosing standard phase: a phase
     * an integration times without a span (the Lightning callback's forward) outlives a span that
     * starts and stops inside it. */
    int64_t prev_word;
    int64_t prev_t0;
} SpanCore;

#define SPAN_CORE_VERSION 2L

/* The layout and version as one number, compared across the two modules. */
#define SPAN_CORE_LAYOUT                                                                            \
    ((((long)sizeof(SpanCore) * 1009L + (long)offsetof(SpanCore, id)) * 1013L +                     \
      (long)offsetof(SpanCore, attrs_step)) * 1019L + (long)offsetof(SpanCore, written) +           \
     SPAN_CORE_VERSION * 7919L)

/* What traintrace._span exports in its capsule "traintrace._span._core". */
typedef struct {
    long layout;          /* SPAN_CORE_LAYOUT as span.c saw it */
    PyTypeObject *type;   /* SpanCore */
} SpanCoreAPI;

#endif
