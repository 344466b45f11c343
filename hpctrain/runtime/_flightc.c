/* _flightc: the flight recorder's hot path in C (hpctrain/runtime/flight.py has the rest).

Every communication op runs through the recording wrapper; in Python its bytecode alone
(frames, *args, the sizing call, two method calls, the request object) costs several
microseconds per op inside a training step, where every line runs with cold caches. Here
the same work is a few dozen C calls. What is recorded is exactly what flight.py's pure
Python implementation records (it is kept as the fallback, and the tests run both).

Layout:

  Entry            one op: the ten Entry.FIELDS (seq, op, group, nbytes, dtype, peer, step,
                   phase, start, end) and the op's number on this rank (its key in
                   ``pending``); a sequence (``e[9]`` is the end, settable) with named
                   getters; flight.CEntry subclasses it (dtype names, as_dict). The times are
                   C doubles made floats when read (two allocations less per op).
  Recorder         the recorder's state and its start()/end(): ``enabled``, ``count``, the
                   ring (a collections.deque with maxlen), ``pending`` (dict: number ->
                   entry, in start order), ``seqs`` (dict: group key, + ':p2p' for
                   point-to-point ops -> last sequence number) and the mirror (a writable
                   mmap held through the buffer protocol). flight.FlightRecorder subclasses
                   it. Python readers (the watchdog's thread) see ordinary containers: C code
                   holding the GIL makes each start/end atomic with respect to them.
  Recorded         the wrapper of one Communicator method (recording._recorded): a method
                   descriptor with vectorcall (Py_TPFLAGS_METHOD_DESCRIPTOR), so
                   ``comm.allreduce(t)`` runs without a bound method, a frame or an args
                   tuple. It reads recording's ``_RECORDER`` at each call (tests swap it).
  RecordedRequest  a non-blocking op's request: ends the entry on wait() (on NCCL hands it
                   to rec.end_on_device, once), or on the first test() that returns True;
                   other attributes are the wrapped request's.

configure() hands in the Python objects read here: the Entry class to make, abort._context
(step, phase), the TIMELINE (ended ops are spans when --trace is on) and P2P_OPS.

Cost: in place (inside a training step, caches cold) about 2.5 us per op on a shared 2-core
machine, against 7-8 us in Python (``bench flight``); what remains is mostly cache misses of
what any recorder touches (the tensor's nbytes/dtype, the dicts, the ring's evicted entry).

Needs POSIX clock_gettime (CLOCK_REALTIME, as time.time()); the build is optional, so where
it fails hpctrain records in pure Python.

Errors: an exception from the op ends its entry and propagates; one from recording before
the op (sizing, a failed allocation) propagates without running the op and leaves no entry
pending; the mirror is best effort (a failure to write it is ignored: the ring has the op).
*/

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

/* ---- the mirror's binary format (flight.py: _HEADER, _NAMES; checked there at import) --- */
/* header "=qqddqq": count, seq, start, end (nan: pending), step (-1: none), names index */
#define HEADER_SIZE 48
#define END_AT 24
#define OP_LEN 24 /* names "=24s48s16s": op, group, phase */
#define GROUP_LEN 48
#define PHASE_LEN 16
#define NAMES_SIZE (OP_LEN + GROUP_LEN + PHASE_LEN)
#define NAME_SLOTS 1024
#define MIRROR_SIZE (HEADER_SIZE + NAME_SLOTS * NAMES_SIZE)

enum { F_SEQ, F_OP, F_GROUP, F_NBYTES, F_DTYPE, F_PEER, F_STEP, F_PHASE, F_START, F_END,
       F_NUMBER, NSLOTS };

/* how a wrapper sizes its op (recording._SIZERS) */
enum { SIZE_TENSOR, SIZE_PEER, SIZE_SCALARS, SIZE_CALL };

/* configured from flight.py */
static PyTypeObject *entry_type;  /* flight.Entry: what start() makes */
static PyObject *context;         /* abort._context */
static PyObject *timeline;        /* timeline.TIMELINE */
static PyObject *p2p_ops;         /* flight.P2P_OPS */
static PyObject *deque_type, *deque_append; /* collections.deque and its append */

static PyObject *S_RECORDER, *S_group_key, *S_size, *S_flight_key, *S_device_marker,
    *S_nbytes, *S_dtype, *S_tensor, *S_dest, *S_source, *S_values, *S_step, *S_phase,
    *S_enabled, *S_op, *S_wait, *S_test, *S_start, *S_end, *S_end_on_device, *S_p2p_suffix,
    *S_empty, *S_float64, *S_maxlen;
static PyObject *zero, *one;

static PyTypeObject EntryType, RecorderType, RecordedType, RecordedRequestType;

/* ---- small helpers ----------------------------------------------------------------------- */

/* time.time(): CLOCK_REALTIME in nanoseconds, converted as _PyTime_AsSecondsDouble does */
static double
wall_time(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    int64_t ns = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
    if (ns % 1000000000 == 0)
        return (double)(ns / 1000000000);
    return (double)ns / 1e9;
}

/* The exception being raised, taken out (normalized, traceback attached), and put back:
   an end() that fails while an op's exception propagates chains it as its context. */
static PyObject *
take_exception(void)
{
#if PY_VERSION_HEX >= 0x030C0000
    return PyErr_GetRaisedException();
#else
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL)
        PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
#endif
}

static void
restore_exception(PyObject *exc)
{
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(exc);
#else
    if (exc != NULL)
        PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(exc)), exc, PyException_GetTraceback(exc));
#endif
}

/* kwargs.get(name) of a vectorcall (borrowed; NULL when absent) */
static PyObject *
kwarg(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, PyObject *name)
{
    if (kwnames == NULL)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t i = 0; i < n; i++) { /* keyword names are interned: identity first */
        if (PyTuple_GET_ITEM(kwnames, i) == name)
            return args[nargs + i];
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyUnicode_Compare(PyTuple_GET_ITEM(kwnames, i), name) == 0)
            return args[nargs + i];
    }
    return NULL;
}

/* ---- Entry ------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *f[NSLOTS]; /* f[F_START] and f[F_END] unused (NULL), for: */
    double start, end;   /* times are kept as numbers, made floats when read */
    int ended;           /* end is set (else None) */
} Entry;

/* No GC traversal of the fields: an entry's fields (ints, strings, dtypes, a list of peers)
   never lead back to it. (flight.CEntry, a heap subclass, is still GC-tracked, for its type.) */
static void
entry_dealloc(Entry *self)
{
    for (int i = 0; i < NSLOTS; i++)
        Py_CLEAR(self->f[i]);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int entry_ass_item(Entry *self, Py_ssize_t i, PyObject *value);

/* Entry(items=()): slots from a sequence of at most 11 items, the rest None */
static PyObject *
entry_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *items = NULL;
    static char *kwlist[] = {"items", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O:Entry", kwlist, &items))
        return NULL;
    PyObject *seq = items ? PySequence_Fast(items, "Entry: a sequence of fields") : NULL;
    if (items && seq == NULL)
        return NULL;
    Py_ssize_t n = seq ? PySequence_Fast_GET_SIZE(seq) : 0;
    if (n > NSLOTS) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "Entry: at most %d fields, got %zd", NSLOTS, n);
    }
    Entry *self = (Entry *)type->tp_alloc(type, 0);
    if (self == NULL) {
        Py_XDECREF(seq);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < NSLOTS; i++) {
        if (i != F_START && i != F_END)
            self->f[i] = Py_NewRef(Py_None);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (entry_ass_item(self, i, PySequence_Fast_GET_ITEM(seq, i)) < 0) {
            Py_DECREF(seq);
            Py_DECREF(self);
            return NULL;
        }
    }
    Py_XDECREF(seq);
    return (PyObject *)self;
}

static Py_ssize_t
entry_length(PyObject *self)
{
    return NSLOTS;
}

static PyObject *
entry_item(Entry *self, Py_ssize_t i)
{
    if (i < 0 || i >= NSLOTS) {
        PyErr_SetString(PyExc_IndexError, "Entry index out of range");
        return NULL;
    }
    if (i == F_START)
        return PyFloat_FromDouble(self->start);
    if (i == F_END)
        return self->ended ? PyFloat_FromDouble(self->end) : Py_NewRef(Py_None);
    return Py_NewRef(self->f[i]);
}

static int
entry_ass_item(Entry *self, Py_ssize_t i, PyObject *value)
{
    if (i < 0 || i >= NSLOTS) {
        PyErr_SetString(PyExc_IndexError, "Entry index out of range");
        return -1;
    }
    if (value == NULL) {
        PyErr_SetString(PyExc_TypeError, "Entry fields cannot be deleted");
        return -1;
    }
    if (i == F_START || i == F_END) { /* a time (time.time()); the end may be None */
        if (i == F_END && value == Py_None) {
            self->ended = 0;
            return 0;
        }
        double t = PyFloat_AsDouble(value);
        if (t == -1.0 && PyErr_Occurred())
            return -1;
        if (i == F_START)
            self->start = t;
        else {
            self->end = t;
            self->ended = 1;
        }
        return 0;
    }
    Py_SETREF(self->f[i], Py_NewRef(value));
    return 0;
}

static PyObject *
entry_get(Entry *self, void *closure)
{
    return entry_item(self, (intptr_t)closure);
}

static int
entry_set(Entry *self, PyObject *value, void *closure)
{
    return entry_ass_item(self, (intptr_t)closure, value);
}

static PySequenceMethods entry_as_sequence = {
    .sq_length = entry_length,
    .sq_item = (ssizeargfunc)entry_item,
    .sq_ass_item = (ssizeobjargproc)entry_ass_item,
};

/* dtype is left to the subclass (it names the dtype when read) */
static PyGetSetDef entry_getset[] = {
    {"seq", (getter)entry_get, NULL, NULL, (void *)F_SEQ},
    {"op", (getter)entry_get, NULL, NULL, (void *)F_OP},
    {"group", (getter)entry_get, NULL, NULL, (void *)F_GROUP},
    {"nbytes", (getter)entry_get, NULL, NULL, (void *)F_NBYTES},
    {"peer", (getter)entry_get, NULL, NULL, (void *)F_PEER},
    {"step", (getter)entry_get, NULL, NULL, (void *)F_STEP},
    {"phase", (getter)entry_get, NULL, NULL, (void *)F_PHASE},
    {"start", (getter)entry_get, NULL, NULL, (void *)F_START},
    {"end", (getter)entry_get, (setter)entry_set, NULL, (void *)F_END},
    {NULL},
};

static PyTypeObject EntryType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hpctrain.runtime._flightc.Entry",
    .tp_doc = "One recorded op: the ten fields of flight.Entry.FIELDS and the op's number.",
    .tp_basicsize = sizeof(Entry),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_new = entry_new,
    .tp_dealloc = (destructor)entry_dealloc,
    .tp_as_sequence = &entry_as_sequence,
    .tp_getset = entry_getset,
};

/* ---- Recorder ---------------------------------------------------------------------------- */

/* names -> index lookups remembered by the names' identities (strings are immutable, and a
   slot holds them, so an address stays theirs): the op's name, the group key and the phase
   are the same objects op after op, and this saves a tuple and a dict lookup per op */
#define NAME_CACHE 64
typedef struct {
    PyObject *op, *key, *phase;
    long long index;
} NameSlot;

typedef struct {
    PyObject_HEAD
    int enabled;
    Py_ssize_t count;   /* ops started: the number of the last one */
    PyObject *ring;     /* deque(maxlen=capacity) of entries */
    PyObject *pending;  /* number -> entry, until the op ends */
    PyObject *seqs;     /* group key (+ ':p2p') -> last sequence number */
    PyObject *p2p_keys; /* group key -> group key + ':p2p' (made once, hash cached) */
    PyObject *names;    /* (op, group, phase) -> its index in the mirror's table (-1: full) */
    Py_buffer mirror;   /* valid when has_mirror */
    int has_mirror;
    NameSlot name_cache[NAME_CACHE]; /* of names */
} Recorder;

static void
clear_name_cache(Recorder *self)
{
    for (int i = 0; i < NAME_CACHE; i++) {
        Py_CLEAR(self->name_cache[i].op);
        Py_CLEAR(self->name_cache[i].key);
        Py_CLEAR(self->name_cache[i].phase);
    }
}

static PyObject *
recorder_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    Recorder *self = (Recorder *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->enabled = 1;
    self->pending = PyDict_New();
    self->seqs = PyDict_New();
    self->p2p_keys = PyDict_New();
    self->names = PyDict_New();
    if (!self->pending || !self->seqs || !self->p2p_keys || !self->names) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static int
recorder_init(Recorder *self, PyObject *args, PyObject *kwds)
{
    Py_ssize_t capacity = 4096;
    static char *kwlist[] = {"capacity", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|n:Recorder", kwlist, &capacity))
        return -1;
    if (capacity < 1) {
        PyErr_SetString(PyExc_ValueError, "Recorder: capacity must be at least 1");
        return -1;
    }
    PyObject *kw = Py_BuildValue("{On}", S_maxlen, capacity);
    if (kw == NULL)
        return -1;
    PyObject *empty = PyTuple_New(0);
    PyObject *ring = empty ? PyObject_Call(deque_type, empty, kw) : NULL;
    Py_XDECREF(empty);
    Py_DECREF(kw);
    if (ring == NULL)
        return -1;
    Py_XSETREF(self->ring, ring);
    return 0;
}

static void
release_mirror(Recorder *self)
{
    if (self->has_mirror) {
        self->has_mirror = 0;
        PyBuffer_Release(&self->mirror);
    }
}

static int
recorder_traverse(Recorder *self, visitproc visit, void *arg)
{
    Py_VISIT(self->ring);
    Py_VISIT(self->pending);
    Py_VISIT(self->seqs);
    Py_VISIT(self->p2p_keys);
    Py_VISIT(self->names);
    for (int i = 0; i < NAME_CACHE; i++) {
        Py_VISIT(self->name_cache[i].op);
        Py_VISIT(self->name_cache[i].key);
        Py_VISIT(self->name_cache[i].phase);
    }
    if (self->has_mirror)
        Py_VISIT(self->mirror.obj);
    return 0;
}

static int
recorder_clear(Recorder *self)
{
    release_mirror(self);
    clear_name_cache(self);
    Py_CLEAR(self->ring);
    Py_CLEAR(self->pending);
    Py_CLEAR(self->seqs);
    Py_CLEAR(self->p2p_keys);
    Py_CLEAR(self->names);
    return 0;
}

static void
recorder_dealloc(Recorder *self)
{
    PyObject_GC_UnTrack(self);
    recorder_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Write (op, group, phase) into the mirror's table once; its index, -1 when the table is
   full, -2 on an error (set). As flight.py: utf-8, cut to the field, padded with zeros. */
static long long
add_names(Recorder *self, PyObject *names, PyObject *op, PyObject *key, PyObject *phase)
{
    Py_ssize_t n = PyDict_GET_SIZE(self->names);
    long long index = n < NAME_SLOTS ? (long long)n : -1;
    if (index >= 0) {
        const char *text[3];
        Py_ssize_t len[3];
        const Py_ssize_t room[3] = {OP_LEN, GROUP_LEN, PHASE_LEN};
        PyObject *parts[3] = {op, key, phase == Py_None ? S_empty : phase};
        for (int i = 0; i < 3; i++) {
            text[i] = PyUnicode_AsUTF8AndSize(parts[i], &len[i]);
            if (text[i] == NULL)
                return -2;
        }
        char *at = (char *)self->mirror.buf + HEADER_SIZE + index * NAMES_SIZE;
        for (int i = 0; i < 3; i++) {
            Py_ssize_t k = len[i] < room[i] ? len[i] : room[i];
            memcpy(at, text[i], k);
            memset(at + k, 0, room[i] - k);
            at += room[i];
        }
    }
    PyObject *value = PyLong_FromLongLong(index);
    if (value == NULL || PyDict_SetItem(self->names, names, value) < 0) {
        Py_XDECREF(value);
        return -2;
    }
    Py_DECREF(value);
    return index;
}

/* The started op in the mirror's header: one 48-byte store (best effort: see the top) */
static void
mirror_start(Recorder *self, PyObject *op, PyObject *key, PyObject *phase, Py_ssize_t seq,
             double now, PyObject *step)
{
    long long index;
    PyObject *names = NULL;
    uintptr_t h = ((uintptr_t)op >> 4) * 961 + ((uintptr_t)key >> 4) * 31
                  + ((uintptr_t)phase >> 4);
    NameSlot *slot = &self->name_cache[h % NAME_CACHE];
    if (slot->op == op && slot->key == key && slot->phase == phase) {
        index = slot->index;
        goto write;
    }
    names = PyTuple_Pack(3, op, key, phase);
    if (names == NULL)
        goto fail;
    /* allocating a tuple may run a collection, finalizers, and so another thread: the
       watchdog's may have released the mirror meanwhile. Nothing below runs Python code. */
    if (!self->has_mirror) {
        Py_DECREF(names);
        return;
    }
    PyObject *known = PyDict_GetItemWithError(self->names, names);
    if (known != NULL) {
        index = PyLong_AsLongLong(known);
        if (index == -1 && PyErr_Occurred())
            goto fail;
    }
    else {
        if (PyErr_Occurred())
            goto fail;
        index = add_names(self, names, op, key, phase);
        if (index == -2)
            goto fail;
    }
    Py_DECREF(names);
    Py_XSETREF(slot->op, Py_NewRef(op));
    Py_XSETREF(slot->key, Py_NewRef(key));
    Py_XSETREF(slot->phase, Py_NewRef(phase));
    slot->index = index;
write:;
    struct {
        int64_t count, seq;
        double start, end;
        int64_t step, index;
    } header;
    _Static_assert(sizeof(header) == HEADER_SIZE, "the mirror's header is 6 x 8 bytes");
    header.count = self->count;
    header.seq = seq;
    header.start = now;
    header.end = NAN;
    header.step = -1; /* flight.py: step if step.__class__ is int else -1 */
    if (PyLong_CheckExact(step)) {
        int overflow;
        long long s = PyLong_AsLongLongAndOverflow(step, &overflow);
        if (!overflow && !(s == -1 && PyErr_Occurred()))
            header.step = s;
        PyErr_Clear();
    }
    header.index = index;
    memcpy(self->mirror.buf, &header, HEADER_SIZE);
    return;
fail:
    Py_XDECREF(names);
    PyErr_Clear();
}

/* Record the start of op ``op`` over group ``key``: a new reference to its entry, or NULL
   with an exception (nothing recorded then, but for seqs/count when a later step failed). */
static PyObject *
rec_start(Recorder *self, PyObject *key, PyObject *op, int p2p, PyObject *nbytes,
          PyObject *dtype, PyObject *peer)
{
    if (self->ring == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Recorder.__init__ was not called");
        return NULL;
    }
    PyObject *skey = key; /* borrowed */
    if (p2p) {
        skey = PyDict_GetItemWithError(self->p2p_keys, key);
        if (skey == NULL) {
            if (PyErr_Occurred())
                return NULL;
            PyObject *made = PyUnicode_Concat(key, S_p2p_suffix);
            if (made == NULL)
                return NULL;
            int err = PyDict_SetItem(self->p2p_keys, key, made);
            Py_DECREF(made); /* the dict keeps it */
            if (err < 0)
                return NULL;
            skey = made;
        }
    }
    Py_ssize_t seq = 1;
    PyObject *last = PyDict_GetItemWithError(self->seqs, skey);
    if (last != NULL) {
        seq = PyLong_AsSsize_t(last);
        if (seq == -1 && PyErr_Occurred())
            return NULL;
        seq += 1;
    }
    else if (PyErr_Occurred())
        return NULL;

    /* everything that can fail to allocate, before anything is changed */
    PyObject *seq_obj = PyLong_FromSsize_t(seq);
    PyObject *number = PyLong_FromSsize_t(self->count + 1);
    Entry *e = (Entry *)entry_type->tp_alloc(entry_type, 0);
    if (!seq_obj || !number || !e) {
        Py_XDECREF(seq_obj);
        Py_XDECREF(number);
        Py_XDECREF(e);
        return NULL;
    }
    e->f[F_SEQ] = seq_obj;
    e->f[F_NUMBER] = number;
    /* step and phase are borrowed from the context: held at once (an allocation in
       between could run a collection, finalizers, another thread that changes them) */
    PyObject *step = PyDict_GetItemWithError(context, S_step);
    PyObject *phase = step || !PyErr_Occurred() ? PyDict_GetItemWithError(context, S_phase)
                                                : NULL;
    if (PyErr_Occurred()) {
        Py_DECREF(e);
        return NULL;
    }
    e->f[F_STEP] = step = Py_NewRef(step ? step : Py_None);
    e->f[F_PHASE] = phase = Py_NewRef(phase ? phase : Py_None);
    e->f[F_OP] = Py_NewRef(op);
    e->f[F_GROUP] = Py_NewRef(key);
    e->f[F_NBYTES] = Py_NewRef(nbytes);
    e->f[F_DTYPE] = Py_NewRef(dtype);
    e->f[F_PEER] = Py_NewRef(peer);
    double now = wall_time();
    e->start = now;

    if (PyDict_SetItem(self->seqs, skey, seq_obj) < 0)
        goto fail;
    self->count += 1;
    PyObject *append_args[2] = {self->ring, (PyObject *)e};
    PyObject *res = PyObject_Vectorcall(deque_append, append_args, 2, NULL);
    if (res == NULL)
        goto fail;
    Py_DECREF(res);
    if (PyDict_SetItem(self->pending, number, (PyObject *)e) < 0)
        goto fail;
    if (self->has_mirror)
        mirror_start(self, op, key, phase, seq, now, step);
    return (PyObject *)e;
fail:
    Py_DECREF(e);
    return NULL;
}

/* Record the end (completion or failure) of ``e`` */
static int
rec_end(Recorder *self, Entry *e)
{
    double now = wall_time();
    e->end = now;
    e->ended = 1;
    if (PyDict_DelItem(self->pending, e->f[F_NUMBER]) < 0) { /* pending.pop(number, None) */
        if (!PyErr_ExceptionMatches(PyExc_KeyError))
            return -1;
        PyErr_Clear();
    }
    if (self->has_mirror) { /* the last op is the one in the mirror */
        Py_ssize_t number = PyLong_AsSsize_t(e->f[F_NUMBER]);
        if (number == -1 && PyErr_Occurred())
            PyErr_Clear();
        else if (number == self->count)
            memcpy((char *)self->mirror.buf + END_AT, &now, sizeof(double));
    }
    if (timeline != NULL) { /* --trace: every finished op is a span on the rank's comm row */
        PyObject *on = PyObject_GetAttr(timeline, S_enabled);
        if (on == NULL)
            return -1;
        int yes = PyObject_IsTrue(on);
        Py_DECREF(on);
        if (yes < 0)
            return -1;
        if (yes) {
            PyObject *res = PyObject_CallMethodOneArg(timeline, S_op, (PyObject *)e);
            if (res == NULL)
                return -1;
            Py_DECREF(res);
        }
    }
    return 0;
}

/* start(key, op, nbytes=0, dtype="", peer=None) */
static PyObject *
recorder_start(Recorder *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {"key", "op", "nbytes", "dtype", "peer"};
    PyObject *v[5] = {NULL, NULL, zero, S_empty, Py_None};
    if (nargs > 5)
        return PyErr_Format(PyExc_TypeError, "start() takes at most 5 arguments (%zd given)",
                            nargs);
    for (Py_ssize_t i = 0; i < nargs; i++)
        v[i] = args[i];
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t k = 0; k < nkw; k++) {
        const char *name = PyUnicode_AsUTF8(PyTuple_GET_ITEM(kwnames, k));
        if (name == NULL)
            return NULL;
        int i = 0;
        while (i < 5 && strcmp(name, names[i]) != 0)
            i++;
        if (i == 5)
            return PyErr_Format(PyExc_TypeError, "start() got an unexpected keyword argument "
                                "'%s'", name);
        if (i < nargs)
            return PyErr_Format(PyExc_TypeError, "start() got multiple values for argument "
                                "'%s'", name);
        v[i] = args[nargs + k];
    }
    if (v[0] == NULL || v[1] == NULL)
        return PyErr_Format(PyExc_TypeError, "start() missing required argument '%s'",
                            v[0] == NULL ? "key" : "op");
    int p2p = PySet_Contains(p2p_ops, v[1]);
    if (p2p < 0)
        return NULL;
    return rec_start(self, v[0], v[1], p2p, v[2], v[3], v[4]);
}

static PyObject *
recorder_end(Recorder *self, PyObject *e)
{
    if (!PyObject_TypeCheck(e, &EntryType))
        return PyErr_Format(PyExc_TypeError, "end() takes an Entry from start(), not %.100s",
                            Py_TYPE(e)->tp_name);
    if (rec_end(self, (Entry *)e) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* _set_mirror_buffer(mirror): hold a writable buffer of at least MIRROR_SIZE bytes (None:
   release it, e.g. before the mmap is closed) and forget the names written into the last */
static PyObject *
recorder_set_mirror_buffer(Recorder *self, PyObject *mirror)
{
    release_mirror(self);
    clear_name_cache(self);
    PyDict_Clear(self->names);
    if (mirror == Py_None)
        Py_RETURN_NONE;
    if (PyObject_GetBuffer(mirror, &self->mirror, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (self->mirror.len < MIRROR_SIZE) {
        PyBuffer_Release(&self->mirror);
        return PyErr_Format(PyExc_ValueError, "the mirror needs %d bytes, got %zd",
                            MIRROR_SIZE, self->mirror.len);
    }
    self->has_mirror = 1;
    Py_RETURN_NONE;
}

static PyObject *
recorder_get_enabled(Recorder *self, void *closure)
{
    return PyBool_FromLong(self->enabled);
}

static int
recorder_set_enabled(Recorder *self, PyObject *value, void *closure)
{
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "enabled cannot be deleted");
        return -1;
    }
    int yes = PyObject_IsTrue(value);
    if (yes < 0)
        return -1;
    self->enabled = yes;
    return 0;
}

static PyMethodDef recorder_methods[] = {
    {"start", (PyCFunction)(void (*)(void))recorder_start, METH_FASTCALL | METH_KEYWORDS,
     "start(key, op, nbytes=0, dtype='', peer=None) -> Entry: record the start of op over "
     "group key."},
    {"end", (PyCFunction)recorder_end, METH_O, "end(entry): record its completion (or failure)."},
    {"_set_mirror_buffer", (PyCFunction)recorder_set_mirror_buffer, METH_O,
     "Write the last op into this writable buffer (None: stop and release it)."},
    {NULL},
};

static PyMemberDef recorder_members[] = {
    {"count", T_PYSSIZET, offsetof(Recorder, count), 0, "operations started"},
    {"ring", T_OBJECT, offsetof(Recorder, ring), READONLY, "the last entries (a deque)"},
    {"pending", T_OBJECT, offsetof(Recorder, pending), READONLY,
     "op number -> entry, until it ends (in start order)"},
    {"seqs", T_OBJECT, offsetof(Recorder, seqs), READONLY,
     "group key (+ ':p2p') -> last sequence number"},
    {"_names", T_OBJECT, offsetof(Recorder, names), READONLY,
     "(op, group, phase) -> index in the mirror's table"},
    {NULL},
};

static PyGetSetDef recorder_getset[] = {
    {"enabled", (getter)recorder_get_enabled, (setter)recorder_set_enabled,
     "False: ops are not recorded", NULL},
    {NULL},
};

static PyTypeObject RecorderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hpctrain.runtime._flightc.Recorder",
    .tp_doc = "The flight recorder's state and start()/end() (flight.FlightRecorder).",
    .tp_basicsize = sizeof(Recorder),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = recorder_new,
    .tp_init = (initproc)recorder_init,
    .tp_dealloc = (destructor)recorder_dealloc,
    .tp_traverse = (traverseproc)recorder_traverse,
    .tp_clear = (inquiry)recorder_clear,
    .tp_methods = recorder_methods,
    .tp_members = recorder_members,
    .tp_getset = recorder_getset,
};

/* ---- any recorder: the C one directly, another (a test's) through its methods ------------ */

/* PyObject_TypeCheck(o, &RecorderType), remembering the subtype that passed (flight's
   FlightRecorder): for a subtype the check walks its MRO, more cold reads per op */
static PyTypeObject *recorder_subtype;

static int
is_recorder(PyObject *o)
{
    PyTypeObject *t = Py_TYPE(o);
    if (t == recorder_subtype || t == &RecorderType)
        return 1;
    if (!PyType_IsSubtype(t, &RecorderType))
        return 0;
    Py_XSETREF(recorder_subtype, (PyTypeObject *)Py_NewRef(t)); /* kept: its address stays its */
    return 1;
}

static int
is_entry(PyObject *o)
{
    return Py_TYPE(o) == entry_type || PyObject_TypeCheck(o, &EntryType);
}

static int
recorder_on(PyObject *rec)
{
    if (is_recorder(rec))
        return ((Recorder *)rec)->enabled;
    PyObject *on = PyObject_GetAttr(rec, S_enabled);
    if (on == NULL)
        return -1;
    int yes = PyObject_IsTrue(on);
    Py_DECREF(on);
    return yes;
}

static PyObject *
start_any(PyObject *rec, PyObject *key, PyObject *op, int p2p, PyObject *nbytes,
          PyObject *dtype, PyObject *peer)
{
    if (is_recorder(rec))
        return rec_start((Recorder *)rec, key, op, p2p, nbytes, dtype, peer);
    PyObject *args[6] = {rec, key, op, nbytes, dtype, peer};
    return PyObject_VectorcallMethod(S_start, args, 6, NULL);
}

static int
end_any(PyObject *rec, PyObject *entry)
{
    if (is_recorder(rec) && is_entry(entry))
        return rec_end((Recorder *)rec, (Entry *)entry);
    PyObject *res = PyObject_CallMethodOneArg(rec, S_end, entry);
    if (res == NULL)
        return -1;
    Py_DECREF(res);
    return 0;
}

/* entry[9] is None (1), is set (0), or -1 on an error */
static int
is_pending(PyObject *entry)
{
    if (is_entry(entry))
        return !((Entry *)entry)->ended;
    PyObject *end = PySequence_GetItem(entry, F_END);
    if (end == NULL)
        return -1;
    Py_DECREF(end);
    return end == Py_None;
}

/* The op completed: end its entry, on the device when the communicator gave a marker
   factory (comm._device_marker: rec.end_on_device(entry, marker())) */
static int
finish(PyObject *rec, PyObject *entry, PyObject *marker)
{
    if (marker == NULL)
        return end_any(rec, entry);
    PyObject *m = PyObject_CallNoArgs(marker);
    if (m == NULL)
        return -1;
    PyObject *args[3] = {rec, entry, m};
    PyObject *res = PyObject_VectorcallMethod(S_end_on_device, args, 3, NULL);
    Py_DECREF(m);
    if (res == NULL)
        return -1;
    Py_DECREF(res);
    return 0;
}

/* The op raised: end its entry (``only_pending``: unless it has ended) and keep the
   exception; an end that raises in turn gets it as its __context__, as
   ``except: rec.end(e); raise`` does */
static void
end_after_error(PyObject *rec, PyObject *entry, int only_pending)
{
    PyObject *exc = take_exception();
    int err = 0, pending = only_pending ? is_pending(entry) : 1;
    if (pending < 0)
        err = -1;
    else if (pending)
        err = end_any(rec, entry);
    if (err < 0) {
        PyObject *exc2 = take_exception();
        if (exc2 != NULL && exc != NULL)
            PyException_SetContext(exc2, exc); /* steals exc */
        else
            Py_XDECREF(exc);
        restore_exception(exc2);
        return;
    }
    restore_exception(exc);
}

/* comm._device_marker: a new reference, or NULL for None/absent (-1 on an error) */
static int
device_marker(PyObject *comm, PyObject **marker)
{
    *marker = NULL;
    PyObject *m = PyObject_GetAttr(comm, S_device_marker);
    if (m == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return -1;
        PyErr_Clear();
        return 0;
    }
    if (m == Py_None)
        Py_DECREF(m);
    else
        *marker = m;
    return 0;
}

/* ---- RecordedRequest --------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *req, *entry, *rec;
    PyObject *marker; /* comm._device_marker, or NULL */
    int finished;     /* ended, or handed to the device (whose end comes later): once */
} RecordedRequest;

static int
request_traverse(RecordedRequest *self, visitproc visit, void *arg)
{
    Py_VISIT(self->req);
    Py_VISIT(self->entry);
    Py_VISIT(self->rec);
    Py_VISIT(self->marker);
    return 0;
}

static int
request_clear(RecordedRequest *self)
{
    Py_CLEAR(self->req);
    Py_CLEAR(self->entry);
    Py_CLEAR(self->rec);
    Py_CLEAR(self->marker);
    return 0;
}

static void
request_dealloc(RecordedRequest *self)
{
    PyObject_GC_UnTrack(self);
    request_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* steals the four references (marker may be NULL) */
static PyObject *
request_make(PyObject *req, PyObject *entry, PyObject *rec, PyObject *marker)
{
    RecordedRequest *self = PyObject_GC_New(RecordedRequest, &RecordedRequestType);
    if (self == NULL) {
        Py_DECREF(req);
        Py_DECREF(entry);
        Py_DECREF(rec);
        Py_XDECREF(marker);
        return NULL;
    }
    self->req = req;
    self->entry = entry;
    self->rec = rec;
    self->marker = marker;
    self->finished = 0;
    PyObject_GC_Track(self);
    return (PyObject *)self;
}

static PyObject *
request_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *req, *entry, *rec, *marker = Py_None;
    static char *kwlist[] = {"request", "entry", "recorder", "marker", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO|O:RecordedRequest", kwlist, &req,
                                     &entry, &rec, &marker))
        return NULL;
    return request_make(Py_NewRef(req), Py_NewRef(entry), Py_NewRef(rec),
                        marker == Py_None ? NULL : Py_NewRef(marker));
}

/* wait(): the request's result; the entry ends whether it returned or raised */
static PyObject *
request_wait(RecordedRequest *self, PyObject *unused)
{
    PyObject *res = PyObject_CallMethodNoArgs(self->req, S_wait);
    if (res == NULL) {
        end_after_error(self->rec, self->entry, 1);
        return NULL;
    }
    if (self->finished)
        return res;
    self->finished = 1;
    /* NCCL: the wait only queued the stream behind the op, which ends on the device */
    int pending = is_pending(self->entry);
    if (pending < 0 || (pending && finish(self->rec, self->entry, self->marker) < 0)) {
        Py_DECREF(res);
        return NULL;
    }
    return res;
}

/* test(): the request's answer; True ends the entry (once) */
static PyObject *
request_test(RecordedRequest *self, PyObject *unused)
{
    PyObject *done = PyObject_CallMethodNoArgs(self->req, S_test);
    if (done == NULL)
        return NULL;
    int yes = PyObject_IsTrue(done);
    int pending = 0;
    if (yes > 0 && !self->finished) {
        self->finished = 1;
        pending = is_pending(self->entry);
    }
    /* True: complete, on the device too (NCCL's is_completed): ended now */
    if (yes < 0 || pending < 0 || (pending && end_any(self->rec, self->entry) < 0)) {
        Py_DECREF(done);
        return NULL;
    }
    return done;
}

/* other attributes (out, ...) are the wrapped request's */
static PyObject *
request_getattro(RecordedRequest *self, PyObject *name)
{
    PyObject *v = PyObject_GenericGetAttr((PyObject *)self, name);
    if (v != NULL || !PyErr_ExceptionMatches(PyExc_AttributeError))
        return v;
    PyErr_Clear();
    return PyObject_GetAttr(self->req, name);
}

static PyMethodDef request_methods[] = {
    {"wait", (PyCFunction)request_wait, METH_NOARGS,
     "The wrapped request's wait(); ends the flight entry."},
    {"test", (PyCFunction)request_test, METH_NOARGS,
     "The wrapped request's test(); True ends the flight entry."},
    {NULL},
};

static PyMemberDef request_members[] = {
    {"_req", T_OBJECT, offsetof(RecordedRequest, req), READONLY, "the wrapped request"},
    {"_entry", T_OBJECT, offsetof(RecordedRequest, entry), READONLY, "the flight entry"},
    {NULL},
};

static PyTypeObject RecordedRequestType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hpctrain.runtime._flightc.RecordedRequest",
    .tp_doc = "A non-blocking op's request whose completion ends its flight entry.",
    .tp_basicsize = sizeof(RecordedRequest),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = request_new,
    .tp_dealloc = (destructor)request_dealloc,
    .tp_traverse = (traverseproc)request_traverse,
    .tp_clear = (inquiry)request_clear,
    .tp_getattro = (getattrofunc)request_getattro,
    .tp_methods = request_methods,
    .tp_members = request_members,
};

/* ---- Recorded: the wrapper ---------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *name;   /* the op's name, recorded as is */
    PyObject *fn;     /* the wrapped method */
    PyObject *sizer;  /* SIZE_CALL: sizer(args, kwargs) -> (nbytes, dtype, peer) */
    PyObject *ns;     /* recording's globals: _RECORDER and group_key, read per call */
    PyObject *dict;   /* __name__, __qualname__, __doc__, __wrapped__, ... */
    int nonblocking, p2p, sizing, peer_at;
    vectorcallfunc vectorcall;
} Recorded;

/* (nbytes, dtype) of a tensor argument: t.nbytes, t.dtype, or (0, '') without them */
static int
size_tensor(PyObject *t, PyObject **nbytes, PyObject **dtype)
{
    if (t != NULL && t != Py_None) {
        PyObject *n = PyObject_GetAttr(t, S_nbytes);
        if (n != NULL) {
            PyObject *d = PyObject_GetAttr(t, S_dtype);
            if (d != NULL) {
                *nbytes = n;
                *dtype = d;
                return 0;
            }
            Py_DECREF(n);
        }
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return -1;
        PyErr_Clear();
    }
    *nbytes = Py_NewRef(zero);
    *dtype = Py_NewRef(S_empty);
    return 0;
}

/* recording._SIZERS in C; new references in the three outputs */
static int
size_op(Recorded *self, PyObject *const *pos, Py_ssize_t npos, PyObject *kwnames,
        PyObject **nbytes, PyObject **dtype, PyObject **peer)
{
    switch (self->sizing) {
    case SIZE_TENSOR:
        *peer = Py_NewRef(Py_None);
        return size_tensor(npos ? pos[0] : kwarg(pos, npos, kwnames, S_tensor), nbytes, dtype);
    case SIZE_PEER: {
        PyObject *p;
        if (npos > self->peer_at)
            p = pos[self->peer_at];
        else if ((p = kwarg(pos, npos, kwnames, S_dest)) == NULL)
            p = kwarg(pos, npos, kwnames, S_source);
        if (size_tensor(npos ? pos[0] : kwarg(pos, npos, kwnames, S_tensor), nbytes, dtype) < 0)
            return -1;
        *peer = Py_NewRef(p ? p : Py_None);
        return 0;
    }
    case SIZE_SCALARS: {
        PyObject *values = npos ? pos[0] : kwarg(pos, npos, kwnames, S_values);
        Py_ssize_t n = values ? PyObject_Size(values) : 0;
        if (n < 0)
            return -1;
        if ((*nbytes = PyLong_FromSsize_t(8 * n)) == NULL)
            return -1;
        *dtype = Py_NewRef(S_float64);
        *peer = Py_NewRef(Py_None);
        return 0;
    }
    default: { /* a Python sizing function (p2p_group: rare) */
        Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
        PyObject *args = PyTuple_New(npos), *kwargs = PyDict_New(), *res = NULL;
        if (args == NULL || kwargs == NULL)
            goto done;
        for (Py_ssize_t i = 0; i < npos; i++)
            PyTuple_SET_ITEM(args, i, Py_NewRef(pos[i]));
        for (Py_ssize_t i = 0; i < nkw; i++) {
            if (PyDict_SetItem(kwargs, PyTuple_GET_ITEM(kwnames, i), pos[npos + i]) < 0)
                goto done;
        }
        res = PyObject_CallFunctionObjArgs(self->sizer, args, kwargs, NULL);
        if (res != NULL && (!PyTuple_Check(res) || PyTuple_GET_SIZE(res) != 3)) {
            PyErr_SetString(PyExc_TypeError, "a sizing function returns (nbytes, dtype, peer)");
            Py_CLEAR(res);
        }
        if (res != NULL) {
            *nbytes = Py_NewRef(PyTuple_GET_ITEM(res, 0));
            *dtype = Py_NewRef(PyTuple_GET_ITEM(res, 1));
            *peer = Py_NewRef(PyTuple_GET_ITEM(res, 2));
        }
    done:
        Py_XDECREF(args);
        Py_XDECREF(kwargs);
        if (res == NULL)
            return -1;
        Py_DECREF(res);
        return 0;
    }
    }
}

/* comm._flight_key or group_key(comm): a new reference */
static PyObject *
group_of(Recorded *self, PyObject *comm)
{
    PyObject *key = PyObject_GetAttr(comm, S_flight_key);
    if (key == NULL)
        return NULL;
    if (PyUnicode_CheckExact(key) && PyUnicode_GET_LENGTH(key) > 0)
        return key;
    int yes = PyObject_IsTrue(key);
    if (yes != 0) {
        if (yes < 0)
            Py_CLEAR(key);
        return key;
    }
    Py_DECREF(key);
    PyObject *group_key = PyDict_GetItemWithError(self->ns, S_group_key);
    if (group_key == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_NameError, "name 'group_key' is not defined");
        return NULL;
    }
    return PyObject_CallOneArg(group_key, comm);
}

/* comm.size <= 1 (1), > 1 (0), -1 on an error */
static int
size_one(PyObject *comm)
{
    PyObject *size = PyObject_GetAttr(comm, S_size);
    if (size == NULL)
        return -1;
    int res;
    if (PyLong_CheckExact(size)) {
        int overflow;
        long n = PyLong_AsLongAndOverflow(size, &overflow);
        res = overflow ? overflow < 0 : n <= 1;
    }
    else
        res = PyObject_RichCompareBool(size, one, Py_LE);
    Py_DECREF(size);
    return res;
}

static PyObject *
recorded_vectorcall(Recorded *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs < 1)
        return PyErr_Format(PyExc_TypeError, "%U() needs the communicator as its first "
                            "argument", self->name);
    PyObject *comm = args[0];
    PyObject *rec = PyDict_GetItemWithError(self->ns, S_RECORDER);
    if (rec == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_NameError, "name '_RECORDER' is not defined");
        return NULL;
    }
    Py_INCREF(rec); /* the recorder that starts the entry ends it, even if _RECORDER changes */
    int on = recorder_on(rec);
    if (on > 0) { /* size-1 communicators are skipped: nothing can stall there */
        int small = size_one(comm);
        on = small < 0 ? -1 : !small;
    }
    if (on <= 0) {
        Py_DECREF(rec);
        return on < 0 ? NULL : PyObject_Vectorcall(self->fn, args, nargsf, kwnames);
    }
    PyObject *nbytes, *dtype, *peer, *entry = NULL;
    if (size_op(self, args + 1, nargs - 1, kwnames, &nbytes, &dtype, &peer) == 0) {
        PyObject *key = group_of(self, comm);
        if (key != NULL) {
            entry = start_any(rec, key, self->name, self->p2p, nbytes, dtype, peer);
            Py_DECREF(key);
        }
        Py_DECREF(nbytes);
        Py_DECREF(dtype);
        Py_DECREF(peer);
    }
    if (entry == NULL) {
        Py_DECREF(rec);
        return NULL;
    }
    PyObject *result = PyObject_Vectorcall(self->fn, args, nargsf, kwnames);
    if (result == NULL) {
        end_after_error(rec, entry, 0);
        Py_DECREF(entry);
        Py_DECREF(rec);
        return NULL;
    }
    PyObject *marker;
    if (device_marker(comm, &marker) < 0) {
        end_after_error(rec, entry, 0);
        Py_DECREF(result);
        Py_DECREF(entry);
        Py_DECREF(rec);
        return NULL;
    }
    if (self->nonblocking) {
        PyObject *req = request_make(Py_NewRef(result), Py_NewRef(entry), Py_NewRef(rec),
                                     Py_XNewRef(marker));
        if (req != NULL) {
            Py_DECREF(result);
            result = req;
        }
        else { /* no wrapper (out of memory): the op's own request, its entry ended now */
            PyErr_Clear();
            if (end_any(rec, entry) < 0)
                PyErr_Clear();
        }
        Py_XDECREF(marker);
        Py_DECREF(entry);
        Py_DECREF(rec);
        return result;
    }
    int err = finish(rec, entry, marker);
    Py_XDECREF(marker);
    Py_DECREF(entry);
    Py_DECREF(rec);
    if (err < 0) {
        Py_DECREF(result);
        return NULL;
    }
    return result;
}

static PyObject *
recorded_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *name, *fn, *sizing, *ns;
    int nonblocking;
    static char *kwlist[] = {"name", "fn", "nonblocking", "sizing", "namespace", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "UOpOO!:Recorded", kwlist, &name, &fn,
                                     &nonblocking, &sizing, &PyDict_Type, &ns))
        return NULL;
    if (p2p_ops == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_flightc.configure() was not called");
        return NULL;
    }
    int kind, peer_at = 0;
    if (PyCallable_Check(sizing))
        kind = SIZE_CALL;
    else if (PyUnicode_Check(sizing) && PyUnicode_CompareWithASCIIString(sizing, "tensor") == 0)
        kind = SIZE_TENSOR;
    else if (PyUnicode_Check(sizing) && PyUnicode_CompareWithASCIIString(sizing, "scalars") == 0)
        kind = SIZE_SCALARS;
    else if (PyTuple_Check(sizing) && PyTuple_GET_SIZE(sizing) == 2
             && PyUnicode_Check(PyTuple_GET_ITEM(sizing, 0))
             && PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(sizing, 0), "peer") == 0
             && PyLong_Check(PyTuple_GET_ITEM(sizing, 1))) {
        kind = SIZE_PEER;
        peer_at = (int)PyLong_AsLong(PyTuple_GET_ITEM(sizing, 1));
        if (peer_at < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "Recorded: the peer's position is >= 0");
            return NULL;
        }
    }
    else {
        PyErr_SetString(PyExc_ValueError, "Recorded: sizing is 'tensor', 'scalars', "
                        "('peer', position) or a function (args, kwargs) -> (nbytes, dtype, "
                        "peer)");
        return NULL;
    }
    int p2p = PySet_Contains(p2p_ops, name);
    if (p2p < 0)
        return NULL;
    Recorded *self = (Recorded *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->name = Py_NewRef(name);
    PyUnicode_InternInPlace(&self->name);
    self->fn = Py_NewRef(fn);
    self->sizer = kind == SIZE_CALL ? Py_NewRef(sizing) : NULL;
    self->ns = Py_NewRef(ns);
    self->nonblocking = nonblocking;
    self->p2p = p2p;
    self->sizing = kind;
    self->peer_at = peer_at;
    self->vectorcall = (vectorcallfunc)recorded_vectorcall;
    return (PyObject *)self;
}

static int
recorded_traverse(Recorded *self, visitproc visit, void *arg)
{
    Py_VISIT(self->name);
    Py_VISIT(self->fn);
    Py_VISIT(self->sizer);
    Py_VISIT(self->ns);
    Py_VISIT(self->dict);
    return 0;
}

static int
recorded_clear(Recorded *self)
{
    Py_CLEAR(self->name);
    Py_CLEAR(self->fn);
    Py_CLEAR(self->sizer);
    Py_CLEAR(self->ns);
    Py_CLEAR(self->dict);
    return 0;
}

static void
recorded_dealloc(Recorded *self)
{
    PyObject_GC_UnTrack(self);
    recorded_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* a method: comm.allreduce is bound (calls through LOAD_METHOD skip this) */
static PyObject *
recorded_get(PyObject *self, PyObject *obj, PyObject *type)
{
    if (obj == NULL || obj == Py_None)
        return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

static PyObject *
recorded_repr(Recorded *self)
{
    return PyUnicode_FromFormat("<recorded %U>", self->name);
}

static PyMemberDef recorded_members[] = {
    {"op", T_OBJECT, offsetof(Recorded, name), READONLY, "the op's name"},
    {"nonblocking", T_BOOL, offsetof(Recorded, nonblocking), READONLY,
     "returns a request that ends the entry"},
    {NULL},
};

static PyGetSetDef recorded_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL},
};

static PyTypeObject RecordedType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hpctrain.runtime._flightc.Recorded",
    .tp_doc = "Recorded(name, fn, nonblocking, sizing, namespace): fn recorded in the flight "
              "recorder namespace['_RECORDER'] (a Communicator method).",
    .tp_basicsize = sizeof(Recorded),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL
                | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_new = recorded_new,
    .tp_dealloc = (destructor)recorded_dealloc,
    .tp_traverse = (traverseproc)recorded_traverse,
    .tp_clear = (inquiry)recorded_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Recorded, vectorcall),
    .tp_descr_get = recorded_get,
    .tp_dictoffset = offsetof(Recorded, dict),
    .tp_repr = (reprfunc)recorded_repr,
    .tp_members = recorded_members,
    .tp_getset = recorded_getset,
};

/* ---- the module ---------------------------------------------------------------------------- */

static PyObject *
configure(PyObject *module, PyObject *args, PyObject *kwds)
{
    PyObject *etype, *ctx, *tl, *p2p;
    static char *kwlist[] = {"entry_type", "context", "timeline", "p2p_ops", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!OO!:configure", kwlist, &PyType_Type,
                                     &etype, &PyDict_Type, &ctx, &tl, &PyFrozenSet_Type, &p2p))
        return NULL;
    if (!PyType_IsSubtype((PyTypeObject *)etype, &EntryType)
        || ((PyTypeObject *)etype)->tp_basicsize != EntryType.tp_basicsize) {
        PyErr_SetString(PyExc_TypeError, "configure: entry_type is a subclass of Entry with "
                        "__slots__ = ()");
        return NULL;
    }
    Py_XSETREF(entry_type, (PyTypeObject *)Py_NewRef(etype));
    Py_XSETREF(context, Py_NewRef(ctx));
    Py_XSETREF(timeline, tl == Py_None ? NULL : Py_NewRef(tl));
    Py_XSETREF(p2p_ops, Py_NewRef(p2p));
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"configure", (PyCFunction)(void (*)(void))configure, METH_VARARGS | METH_KEYWORDS,
     "configure(entry_type, context, timeline, p2p_ops): the Python objects the hot path "
     "reads (flight.py calls it once)."},
    {NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "hpctrain.runtime._flightc",
    .m_doc = "The flight recorder's hot path (see hpctrain/runtime/flight.py).",
    .m_size = -1,
    .m_methods = module_methods,
};

static int
intern_all(void)
{
    struct { PyObject **at; const char *text; } strings[] = {
        {&S_RECORDER, "_RECORDER"}, {&S_group_key, "group_key"}, {&S_size, "size"},
        {&S_flight_key, "_flight_key"}, {&S_device_marker, "_device_marker"},
        {&S_nbytes, "nbytes"}, {&S_dtype, "dtype"}, {&S_tensor, "tensor"}, {&S_dest, "dest"},
        {&S_source, "source"}, {&S_values, "values"}, {&S_step, "step"}, {&S_phase, "phase"},
        {&S_enabled, "enabled"}, {&S_op, "op"}, {&S_wait, "wait"}, {&S_test, "test"},
        {&S_start, "start"}, {&S_end, "end"}, {&S_end_on_device, "end_on_device"},
        {&S_p2p_suffix, ":p2p"}, {&S_empty, ""}, {&S_float64, "float64"},
        {&S_maxlen, "maxlen"},
    };
    for (size_t i = 0; i < sizeof(strings) / sizeof(strings[0]); i++) {
        if ((*strings[i].at = PyUnicode_InternFromString(strings[i].text)) == NULL)
            return -1;
    }
    return 0;
}

PyMODINIT_FUNC
PyInit__flightc(void)
{
    if (intern_all() < 0)
        return NULL;
    if ((zero = PyLong_FromLong(0)) == NULL || (one = PyLong_FromLong(1)) == NULL)
        return NULL;
    PyObject *collections = PyImport_ImportModule("collections");
    if (collections == NULL)
        return NULL;
    deque_type = PyObject_GetAttrString(collections, "deque");
    Py_DECREF(collections);
    if (deque_type == NULL)
        return NULL;
    /* the unbound deque.append: one vectorcall per op, no method lookup */
    if ((deque_append = PyObject_GetAttrString(deque_type, "append")) == NULL)
        return NULL;
    entry_type = (PyTypeObject *)Py_NewRef(&EntryType);
    PyTypeObject *types[] = {&EntryType, &RecorderType, &RecordedType, &RecordedRequestType};
    for (size_t i = 0; i < 4; i++) {
        if (PyType_Ready(types[i]) < 0)
            return NULL;
    }
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL)
        return NULL;
    const char *names[] = {"Entry", "Recorder", "Recorded", "RecordedRequest"};
    for (size_t i = 0; i < 4; i++) {
        Py_INCREF(types[i]);
        if (PyModule_AddObject(m, names[i], (PyObject *)types[i]) < 0) {
            Py_DECREF(types[i]);
            Py_DECREF(m);
            return NULL;
        }
    }
    if (PyModule_AddIntConstant(m, "HEADER_SIZE", HEADER_SIZE) < 0
        || PyModule_AddIntConstant(m, "NAMES_SIZE", NAMES_SIZE) < 0
        || PyModule_AddIntConstant(m, "NAME_SLOTS", NAME_SLOTS) < 0
        || PyModule_AddIntConstant(m, "MIRROR_SIZE", MIRROR_SIZE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
