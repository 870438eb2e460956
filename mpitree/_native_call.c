/*
 * mpitree._native_call: one CPython function, for the hottest call mpitree makes.
 *
 *   call(fn, step, out) -> int
 *
 * calls the compiled library's ``int fn(mpitree_step *step, void *out)`` at address
 * ``fn`` (mpitree_step_run), with the address of ``step`` (a writable buffer of exactly
 * sizeof(mpitree_step) bytes: the library's ctypes struct, which the caller's partial
 * thereby keeps alive) and the address ``out`` (an int). Every bound step's one
 * compiled call (mpitree/_steps.py Bound.run: a later decode layer's, a plan's, a
 * recurring one-shot call's) goes through it: through ctypes, a layer's costs 2-3 us more
 * on the caches the model's dense layers cooled (docs/benchmarks.md). Like ctypes, it
 * calls what ``fn`` and the struct's addresses name: a wrong address crashes the
 * process; it refuses only what it can tell is wrong (arguments of other types, a NULL
 * fn, a step buffer read-only or of another size). It is an extension of its own: the library is plain
 * C, with no Python.h, and builds where Python's headers are missing; without this
 * one, the call goes through ctypes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_native.h"

typedef int (*mpitree_call_fn)(mpitree_step *, void *);

static PyObject *call(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    mpitree_call_fn fn;
    void *out;
    int code;
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "call(fn, step, out) takes 3 arguments");
        return NULL;
    }
    fn = (mpitree_call_fn)PyLong_AsVoidPtr(args[0]);
    if (fn == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "call: fn is NULL");
        return NULL;
    }
    out = PyLong_AsVoidPtr(args[2]);
    if (out == NULL && PyErr_Occurred())
        return NULL;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_WRITABLE) != 0)
        return NULL;
    if (view.len != (Py_ssize_t)sizeof(mpitree_step)) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "call: step is %zd bytes, not sizeof(mpitree_step) = %zu",
                     view.len, sizeof(mpitree_step));
        return NULL;
    }
    /* Without the GIL, as ctypes calls: the step blocks in MPI collectives, and another
     * thread of this process may be what another rank waits for (a thread per
     * communicator). The step touches no Python object. */
    Py_BEGIN_ALLOW_THREADS
    code = fn((mpitree_step *)view.buf, out);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyLong_FromLong(code);
}

static PyMethodDef methods[] = {
    {"call", (PyCFunction)(void (*)(void))call, METH_FASTCALL,
     "call(fn, step, out) -> int: the compiled int fn(mpitree_step *, void *)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "mpitree._native_call", NULL, -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native_call(void)
{
    PyObject *m = PyModule_Create(&module);
    /* the step's size as built: mpitree/_library.py uses this module only where it
     * equals its ctypes mirror's (a stale build would refuse every step) */
    if (m != NULL && PyModule_AddIntConstant(m, "STEP_SIZE", (long)sizeof(mpitree_step)) != 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
