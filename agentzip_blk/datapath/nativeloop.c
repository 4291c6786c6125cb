/* The native request path (docs/ARCHITECTURE.md, "The native request path").
 *
 * Two things, nothing else:
 *
 * - StoreLock: the store's lock, a pthread mutex. Python takes it as it took a
 *   threading.Lock (`with store.lock:`), releasing the GIL only while it waits; native
 *   threads take the mutex itself, with no GIL at all. One lock, one protocol.
 *
 * - Path: a FUSE worker loop. `serve(fd, rbuf, wbuf)` releases the GIL and reads requests
 *   from /dev/fuse. A READ whose pages are all empty, zero-filled or warm (one page alone,
 *   raw or lz4, in a pool cell) is answered here: slot lookup, checksum, decode into the
 *   reply buffer, the same access ticks the Python path records, the reply write(2).
 *   Anything else (every other opcode, frames, the disk tier, dictionaries, a checksum or
 *   codec failure, a request not page-aligned) is handed up: serve() returns its length,
 *   the request still in rbuf, and Python serves it as it serves every request.
 *
 * The tables are the store's own numpy arrays (slots, blobs, the pool's arena addresses).
 * Python binds their addresses with `bind()` under the store lock whenever one of them is
 * reallocated; the native side reads them only while it holds the lock, so it never sees
 * a table or an arena that Python is changing or has freed.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <lz4.h>
#define XXH_INLINE_ALL
#include <xxhash.h>

#define PAGE 4096
#define FUSE_READ 15
#define FILE_ID 2
#define IN_HEADER 40
#define OUT_HEADER 16
#define READ_IN 40
#define MAX_IO (1 << 20)

/* slot kinds, blob tiers, codec ids: agentzip_blk.store.slots / blobs, codec.codecs */
#define KIND_EMPTY 0
#define KIND_SAME 1
#define KIND_BLOB 2
#define TIER_POOL 0
#define CODEC_RAW 0
#define CODEC_LZ4 2
#define CODEC_LZ4HC 3
#define TICK_MASK 0xFFFF
#define TICK_REBASE (1LL << 31)
#define TICKS_PER_SECOND 100

#define NBUCKETS_MAX 32

/* What serve_read decided. */
#define SERVED 0
#define HAND_UP 1

/* -- StoreLock ------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    atomic_int held; /* for locked(): a moment's view */
} StoreLock;

static int StoreLock_init(StoreLock *self, PyObject *args, PyObject *kw) {
    if (!PyArg_ParseTuple(args, ""))
        return -1;
    pthread_mutex_init(&self->mu, NULL);
    atomic_store(&self->held, 0);
    return 0;
}

static void StoreLock_dealloc(StoreLock *self) {
    pthread_mutex_destroy(&self->mu);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int lock_take(StoreLock *self, int blocking, double timeout) {
    if (pthread_mutex_trylock(&self->mu) == 0)
        goto taken;
    if (!blocking)
        return 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    if (timeout < 0) {
        rc = pthread_mutex_lock(&self->mu);
    } else {
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        double whole;
        double frac = modf(timeout, &whole);
        until.tv_sec += (time_t)whole;
        until.tv_nsec += (long)(frac * 1e9);
        if (until.tv_nsec >= 1000000000L) {
            until.tv_sec += 1;
            until.tv_nsec -= 1000000000L;
        }
        rc = pthread_mutex_timedlock(&self->mu, &until);
    }
    Py_END_ALLOW_THREADS
    if (rc != 0)
        return 0;
taken:
    atomic_store(&self->held, 1);
    return 1;
}

static void lock_give(StoreLock *self) {
    atomic_store(&self->held, 0);
    pthread_mutex_unlock(&self->mu);
}

static PyObject *StoreLock_acquire(StoreLock *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"blocking", "timeout", NULL};
    int blocking = 1;
    double timeout = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|pd", names, &blocking, &timeout))
        return NULL;
    return PyBool_FromLong(lock_take(self, blocking, timeout));
}

static PyObject *StoreLock_release(StoreLock *self, PyObject *unused) {
    if (!atomic_load(&self->held)) {
        PyErr_SetString(PyExc_RuntimeError, "release unlocked lock");
        return NULL;
    }
    lock_give(self);
    Py_RETURN_NONE;
}

static PyObject *StoreLock_enter(StoreLock *self, PyObject *unused) {
    lock_take(self, 1, -1);
    Py_RETURN_TRUE;
}

static PyObject *StoreLock_exit(StoreLock *self, PyObject *args) {
    lock_give(self);
    Py_RETURN_FALSE;
}

static PyObject *StoreLock_locked(StoreLock *self, PyObject *unused) {
    return PyBool_FromLong(atomic_load(&self->held));
}

static PyMethodDef StoreLock_methods[] = {
    {"acquire", (PyCFunction)(void (*)(void))StoreLock_acquire, METH_VARARGS | METH_KEYWORDS,
     "acquire(blocking=True, timeout=-1) -> bool"},
    {"release", (PyCFunction)StoreLock_release, METH_NOARGS, "release()"},
    {"locked", (PyCFunction)StoreLock_locked, METH_NOARGS, "locked() -> bool"},
    {"__enter__", (PyCFunction)StoreLock_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)StoreLock_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject StoreLockType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "agentzip_blk.datapath.nativeloop.StoreLock",
    .tp_basicsize = sizeof(StoreLock),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The store's lock: a pthread mutex shared by Python and the native path.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)StoreLock_init,
    .tp_dealloc = (destructor)StoreLock_dealloc,
    .tp_methods = StoreLock_methods,
};

/* -- Path ----------------------------------------------------------------------------- */

typedef struct {
    /* slot table */
    uint8_t *kind;
    uint32_t *handle;
    uint16_t *srtime;
    uint64_t nslots;
    /* blob table */
    int32_t *arena;
    uint32_t *cell;
    uint8_t *tier;
    uint16_t *length;
    uint8_t *pages;
    uint8_t *codec;
    uint8_t *dict_id;
    uint32_t *ref;
    uint32_t *atime;
    uint32_t *rtime;
    uint32_t *csum;
    uint64_t nblobs;
    /* pool: per arena id its address (0: none) and class; per class its cell size */
    uint64_t *a_addr;
    int16_t *a_class;
    uint64_t narenas;
    uint32_t *class_cell;
    uint64_t nclasses;
} Tables;

typedef struct {
    PyObject_HEAD
    StoreLock *lock;
    PyObject *keep; /* the bound arrays, kept alive while their addresses are in use */
    Tables t;       /* read and written only under lock->mu */
    int bound;
    uint64_t size;
    double t0;          /* the store's clock origin, CLOCK_MONOTONIC seconds */
    int64_t tick_base;  /* PageStore._tick_base, under the lock */
    int checksums;
    double bounds[NBUCKETS_MAX];
    int nbounds;
    /* counters: atomics, read by Python without the lock */
    atomic_ullong reads, pages_read, bytes_read, handed_up, in_flight, reply_errors;
    atomic_ullong counts[NBUCKETS_MAX + 1];
    atomic_ullong sum_ns;
} Path;

static double monotonic(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void Path_dealloc(Path *self) {
    Py_XDECREF(self->lock);
    Py_XDECREF(self->keep);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Path_init(Path *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"lock", "size", "t0", "buckets", "checksums", NULL};
    PyObject *lock, *buckets;
    unsigned long long size;
    double t0;
    int checksums = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!KdO|p", names, &StoreLockType, &lock, &size,
                                     &t0, &buckets, &checksums))
        return -1;
    PyObject *seq = PySequence_Fast(buckets, "buckets must be a sequence of seconds");
    if (!seq)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > NBUCKETS_MAX) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "too many latency buckets");
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        self->bounds[i] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(seq, i));
        if (PyErr_Occurred()) {
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    self->nbounds = (int)n;
    Py_INCREF(lock);
    Py_XSETREF(self->lock, (StoreLock *)lock);
    self->size = size;
    self->t0 = t0;
    self->checksums = checksums;
    self->bound = 0;
    return 0;
}

/* The address of a C-contiguous buffer of `count` items of `itemsize` bytes, or NULL with
 * an exception. The caller keeps `obj` alive (numpy arrays keep their data while alive). */
static void *address_of(PyObject *obj, Py_ssize_t itemsize, uint64_t *count, const char *name) {
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    void *addr = view.buf;
    Py_ssize_t got = view.itemsize;
    Py_ssize_t len = view.len;
    PyBuffer_Release(&view);
    if (got != itemsize) {
        PyErr_Format(PyExc_TypeError, "%s: items of %zd bytes, expected %zd", name, got, itemsize);
        return NULL;
    }
    *count = (uint64_t)(len / itemsize);
    return addr;
}

/* bind(tables: dict, tick_base: int): under the store lock, from Python. Every column the
 * native path reads, by name; their lengths must agree. */
static PyObject *Path_bind(Path *self, PyObject *args) {
    PyObject *d;
    long long tick_base;
    if (!PyArg_ParseTuple(args, "O!L", &PyDict_Type, &d, &tick_base))
        return NULL;
    Tables t;
    uint64_t n;
    memset(&t, 0, sizeof t);
#define COLUMN(field, key, type, len_field)                                                  \
    do {                                                                                     \
        PyObject *o = PyDict_GetItemString(d, key);                                          \
        if (!o) {                                                                            \
            PyErr_Format(PyExc_KeyError, "bind: no column %s", key);                         \
            return NULL;                                                                     \
        }                                                                                    \
        t.field = (type *)address_of(o, sizeof(type), &n, key);                              \
        if (!t.field)                                                                        \
            return NULL;                                                                     \
        if (t.len_field == 0 || n < t.len_field)                                             \
            t.len_field = n;                                                                 \
    } while (0)
    COLUMN(kind, "kind", uint8_t, nslots);
    COLUMN(handle, "handle", uint32_t, nslots);
    COLUMN(srtime, "slot_rtime", uint16_t, nslots);
    COLUMN(arena, "arena", int32_t, nblobs);
    COLUMN(cell, "cell", uint32_t, nblobs);
    COLUMN(tier, "tier", uint8_t, nblobs);
    COLUMN(length, "length", uint16_t, nblobs);
    COLUMN(pages, "pages", uint8_t, nblobs);
    COLUMN(codec, "codec", uint8_t, nblobs);
    COLUMN(dict_id, "dict_id", uint8_t, nblobs);
    COLUMN(ref, "ref", uint32_t, nblobs);
    COLUMN(atime, "atime", uint32_t, nblobs);
    COLUMN(rtime, "rtime", uint32_t, nblobs);
    COLUMN(csum, "csum", uint32_t, nblobs);
    COLUMN(a_addr, "arena_addr", uint64_t, narenas);
    COLUMN(a_class, "arena_class", int16_t, narenas);
    COLUMN(class_cell, "class_cell", uint32_t, nclasses);
#undef COLUMN
    PyObject *keep = PyDict_Copy(d);
    if (!keep)
        return NULL;
    /* The caller holds the lock: no native thread reads the tables meanwhile. */
    Py_XSETREF(self->keep, keep);
    self->t = t;
    self->tick_base = tick_base;
    self->bound = 1;
    Py_RETURN_NONE;
}

/* unbind(): under the store lock; the native path hands every request up from now on. */
static PyObject *Path_unbind(Path *self, PyObject *unused) {
    self->bound = 0;
    memset(&self->t, 0, sizeof self->t);
    Py_CLEAR(self->keep);
    Py_RETURN_NONE;
}

/* set_tick_base(n): under the store lock, after PageStore._rebase. */
static PyObject *Path_set_tick_base(Path *self, PyObject *args) {
    long long base;
    if (!PyArg_ParseTuple(args, "L", &base))
        return NULL;
    self->tick_base = base;
    Py_RETURN_NONE;
}

static void observe(Path *self, double seconds) {
    int i = 0;
    while (i < self->nbounds && seconds > self->bounds[i])
        i++;
    atomic_fetch_add(&self->counts[i], 1);
    atomic_fetch_add(&self->sum_ns, (unsigned long long)(seconds * 1e9));
}

/* Where a servable blob's bytes are, or NULL: the blob is not one warm pool page the
 * native path decodes. Under the lock. */
static const uint8_t *servable(const Tables *t, uint32_t blob) {
    if (blob >= t->nblobs || t->ref[blob] == 0 || t->pages[blob] != 1 ||
        t->tier[blob] != TIER_POOL || t->dict_id[blob] != 0)
        return NULL;
    uint8_t codec = t->codec[blob];
    uint16_t len = t->length[blob];
    if (codec == CODEC_RAW) {
        if (len != PAGE)
            return NULL;
    } else if (codec != CODEC_LZ4 && codec != CODEC_LZ4HC) {
        return NULL;
    }
    int32_t a = t->arena[blob];
    if (a < 0 || (uint64_t)a >= t->narenas || t->a_addr[a] == 0)
        return NULL;
    int16_t cls = t->a_class[a];
    if (cls < 0 || (uint64_t)cls >= t->nclasses || len > t->class_cell[cls] || len == 0)
        return NULL;
    return (const uint8_t *)(uintptr_t)(t->a_addr[a] + (uint64_t)t->cell[blob] * t->class_cell[cls]);
}

/* One aligned READ of `count` pages from slot `first` into `out`: SERVED, or HAND_UP with
 * nothing changed that the Python path would not also change (the read ticks). */
static int read_pages(Path *self, uint64_t first, uint64_t count, uint8_t *out) {
    int result = HAND_UP;
    pthread_mutex_lock(&self->lock->mu);
    const Tables *t = &self->t;
    if (!self->bound || first + count > t->nslots)
        goto done;
    int64_t now = (int64_t)((monotonic() - self->t0) * TICKS_PER_SECOND) + 1 - self->tick_base;
    if (now >= TICK_REBASE || now < 1)
        goto done; /* Python rebases the ticks */
    /* First every page is checked, so that a request is served whole or not at all; each
     * blob's bytes are found once, here. */
    const uint8_t *src[MAX_IO / PAGE];
    if (count > MAX_IO / PAGE)
        goto done;
    for (uint64_t i = 0; i < count; i++) {
        uint64_t slot = first + i;
        uint8_t kind = t->kind[slot];
        src[i] = NULL;
        if (kind == KIND_EMPTY)
            continue;
        if (kind == KIND_SAME) {
            if (t->handle[slot] != 0)
                goto done; /* a non-zero word: Python's table */
            continue;
        }
        if (kind != KIND_BLOB || !(src[i] = servable(t, t->handle[slot])))
            goto done;
    }
    /* Then each page decoded, and its access ticks recorded as PageStore._readinto_few
     * records them (a request handed up midway leaves only ticks Python sets again). */
    uint16_t low = (uint16_t)(now & TICK_MASK);
    for (uint64_t i = 0; i < count; i++) {
        uint8_t *dst = out + i * PAGE;
        if (src[i] == NULL) {
            memset(dst, 0, PAGE);
            continue;
        }
        uint64_t slot = first + i;
        uint32_t blob = t->handle[slot];
        uint16_t len = t->length[blob];
        if (self->checksums && (uint32_t)XXH3_64bits(src[i], len) != t->csum[blob])
            goto done; /* Python reads it again, counts the mismatch and answers EIO */
        if (t->codec[blob] == CODEC_RAW) {
            memcpy(dst, src[i], PAGE);
        } else if (LZ4_decompress_safe((const char *)src[i], (char *)dst, len, PAGE) != PAGE) {
            goto done;
        }
        t->rtime[blob] = (uint32_t)now;
        t->atime[blob] = (uint32_t)now;
        t->srtime[slot] = low ? low : 1;
    }
    result = SERVED;
done:
    pthread_mutex_unlock(&self->lock->mu);
    return result;
}

static int write_all(int fd, const uint8_t *buf, size_t len) {
    for (;;) {
        ssize_t n = write(fd, buf, len);
        if (n >= 0)
            return 0;
        if (errno == EINTR)
            continue;
        return errno;
    }
}

/* A READ request of `n` bytes in `r`: SERVED (answered), or HAND_UP. */
static int serve_read(Path *self, int fd, const uint8_t *r, ssize_t n, uint8_t *w, size_t wlen) {
    uint64_t unique, nodeid, offset;
    uint32_t size;
    if (n < IN_HEADER + READ_IN)
        return HAND_UP;
    memcpy(&unique, r + 8, 8);
    memcpy(&nodeid, r + 16, 8);
    memcpy(&offset, r + IN_HEADER + 8, 8);
    memcpy(&size, r + IN_HEADER + 16, 4);
    if (nodeid != FILE_ID || offset >= self->size || offset % PAGE)
        return HAND_UP;
    uint64_t len = size;
    if (len > self->size - offset)
        len = self->size - offset;
    if (len > MAX_IO)
        len = MAX_IO;
    if (len == 0 || len % PAGE || OUT_HEADER + len > wlen)
        return HAND_UP;
    atomic_fetch_add(&self->in_flight, 1);
    double t0 = monotonic();
    int result = read_pages(self, offset / PAGE, len / PAGE, w + OUT_HEADER);
    double elapsed = monotonic() - t0;
    atomic_fetch_sub(&self->in_flight, 1);
    if (result != SERVED)
        return HAND_UP;
    uint32_t total = (uint32_t)(OUT_HEADER + len);
    int32_t error = 0;
    memcpy(w, &total, 4);
    memcpy(w + 4, &error, 4);
    memcpy(w + 8, &unique, 8);
    int err = write_all(fd, w, total);
    if (err && err != ENOENT) /* ENOENT: the request was interrupted meanwhile; fine */
        atomic_fetch_add(&self->reply_errors, 1);
    atomic_fetch_add(&self->reads, 1);
    atomic_fetch_add(&self->pages_read, len / PAGE);
    atomic_fetch_add(&self->bytes_read, len);
    observe(self, elapsed);
    return SERVED;
}

/* serve(fd, rbuf, wbuf) -> int: serve requests until one needs Python. Returns its length
 * (the request is in rbuf), 0 at end of file, or -errno when read(2) failed. */
static PyObject *Path_serve(Path *self, PyObject *args) {
    int fd;
    Py_buffer rb, wb;
    if (!PyArg_ParseTuple(args, "iw*w*", &fd, &rb, &wb))
        return NULL;
    uint8_t *r = rb.buf, *w = wb.buf;
    size_t rlen = (size_t)rb.len, wlen = (size_t)wb.len;
    ssize_t result;
    Py_BEGIN_ALLOW_THREADS
    for (;;) {
        ssize_t n = read(fd, r, rlen);
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN)
                continue;
            result = -errno;
            break;
        }
        if (n == 0) {
            result = 0;
            break;
        }
        uint32_t opcode = 0;
        if (n >= IN_HEADER)
            memcpy(&opcode, r + 4, 4);
        if (opcode == FUSE_READ && serve_read(self, fd, r, n, w, wlen) == SERVED)
            continue;
        atomic_fetch_add(&self->handed_up, 1);
        result = n;
        break;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&rb);
    PyBuffer_Release(&wb);
    return PyLong_FromSsize_t(result);
}

/* counters() -> dict: what the native path served, for stats and the metrics. */
static PyObject *Path_counters(Path *self, PyObject *unused) {
    PyObject *counts = PyList_New(self->nbounds + 1);
    if (!counts)
        return NULL;
    for (int i = 0; i <= self->nbounds; i++)
        PyList_SET_ITEM(counts, i, PyLong_FromUnsignedLongLong(atomic_load(&self->counts[i])));
    return Py_BuildValue(
        "{sKsKsKsKsKsKsNsd}", "reads", (unsigned long long)atomic_load(&self->reads),
        "pages_read", (unsigned long long)atomic_load(&self->pages_read),
        "bytes_read", (unsigned long long)atomic_load(&self->bytes_read),
        "handed_up", (unsigned long long)atomic_load(&self->handed_up),
        "in_flight", (unsigned long long)atomic_load(&self->in_flight),
        "reply_errors", (unsigned long long)atomic_load(&self->reply_errors),
        "latency_counts", counts, "latency_sum_s", atomic_load(&self->sum_ns) * 1e-9);
}

static PyObject *Path_in_flight(Path *self, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(atomic_load(&self->in_flight));
}

static PyMethodDef Path_methods[] = {
    {"bind", (PyCFunction)Path_bind, METH_VARARGS, "bind(tables, tick_base), under the lock"},
    {"unbind", (PyCFunction)Path_unbind, METH_NOARGS, "unbind(), under the lock"},
    {"set_tick_base", (PyCFunction)Path_set_tick_base, METH_VARARGS, "under the lock"},
    {"serve", (PyCFunction)Path_serve, METH_VARARGS, "serve(fd, rbuf, wbuf) -> int"},
    {"counters", (PyCFunction)Path_counters, METH_NOARGS, "counters() -> dict"},
    {"in_flight", (PyCFunction)Path_in_flight, METH_NOARGS, "requests being served now"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject PathType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "agentzip_blk.datapath.nativeloop.Path",
    .tp_basicsize = sizeof(Path),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Path(lock, size, t0, buckets, checksums=True): the native FUSE read path.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Path_init,
    .tp_dealloc = (destructor)Path_dealloc,
    .tp_methods = Path_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "nativeloop", "The native request path (docs/ARCHITECTURE.md).", -1,
    NULL,
};

PyMODINIT_FUNC PyInit_nativeloop(void) {
    if (PyType_Ready(&StoreLockType) < 0 || PyType_Ready(&PathType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(&StoreLockType);
    Py_INCREF(&PathType);
    if (PyModule_AddObject(m, "StoreLock", (PyObject *)&StoreLockType) < 0 ||
        PyModule_AddObject(m, "Path", (PyObject *)&PathType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
