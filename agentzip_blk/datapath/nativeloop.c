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
 *   raw or lz4, in a pool cell) is answered here; so is a WRITE of whole pages when warm
 *   pages are lz4 (compression.warm_algorithm): same-fill check, keyed hash, lz4, dedup
 *   against warm pages, pool cell, blob row, index entry and the slot switch, all on the
 *   store's own books (nativestore.c). Anything else (every other opcode, frames, the disk
 *   tier, dictionaries, a checksum or codec failure, no room without a new arena, a request
 *   not page-aligned) is handed up: serve() returns its length, the request still in rbuf,
 *   and Python serves it as it serves every request.
 *
 * The tables are the store's own numpy arrays. Python binds their addresses with `bind()`
 * under the store lock whenever one of them is reallocated; the native side reads and
 * writes them only while it holds the lock, so it never sees a table or an arena that
 * Python is changing or has freed.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <math.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <lz4.h>
#define ZSTD_STATIC_LINKING_ONLY /* ZSTD_c_format / ZSTD_d_format: magicless frames */
#include <zstd.h>

#include "nativestore.h"

#define FUSE_READ 15
#define FUSE_WRITE 16
#define FILE_ID 2
#define IN_HEADER 40
#define OUT_HEADER 16
#define RW_IN 40 /* fuse_read_in, fuse_write_in */
#define WRITE_OUT 8

#define NBUCKETS_MAX 32

/* -- StoreLock ------------------------------------------------------------------------ */

static double monotonic(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    atomic_int held; /* for locked(): a moment's view */
    /* Python's turns: tickets, served in order (lock_take says why) */
    pthread_mutex_t turn_mu;
    pthread_cond_t turn_cv;
    uint64_t next, serving;
} StoreLock;

static int StoreLock_init(StoreLock *self, PyObject *args, PyObject *kw) {
    if (!PyArg_ParseTuple(args, ""))
        return -1;
    pthread_mutex_init(&self->mu, NULL);
    atomic_store(&self->held, 0);
    pthread_mutex_init(&self->turn_mu, NULL);
    pthread_cond_init(&self->turn_cv, NULL);
    self->next = self->serving = 0;
    return 0;
}

static void StoreLock_dealloc(StoreLock *self) {
    pthread_mutex_destroy(&self->mu);
    pthread_mutex_destroy(&self->turn_mu);
    pthread_cond_destroy(&self->turn_cv);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The mutex once it is this Python thread's turn, without ever holding it while waiting for
 * the GIL: wait for it with the GIL released, let it go at once, take it with trylock once
 * the GIL is back (again if a native thread was first). Holding it across the GIL's
 * re-acquisition made every native request wait for whichever Python thread had the GIL:
 * reads waited 350-410 ms for the lock at density N = 16 while no Python hold was longer
 * than 41 ms (BENCHMARKS.md, "Reads before writes"). */
static void mutex_without_gil_wait(StoreLock *self) {
    for (;;) {
        if (pthread_mutex_trylock(&self->mu) == 0)
            return;
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&self->mu);
        pthread_mutex_unlock(&self->mu);
        Py_END_ALLOW_THREADS
    }
}

/* Python's acquire. Python threads take turns in the order they asked (a ticket each):
 * a thread that let the mutex go to wait for the GIL would otherwise lose it to a Python
 * thread that releases and retakes it in a loop (the maintainer's holds in shares), for
 * as long as the loop runs (`down`'s health check timed out after a density trial).
 * Native threads do not take turns: they take the mutex itself, for microseconds.
 * A timed or non-blocking acquire does not queue: it succeeds only when no Python thread
 * holds or waits for the lock (nothing in the project asks for one). */
static int lock_take(StoreLock *self, int blocking, double timeout) {
    pthread_mutex_lock(&self->turn_mu); /* held for a few instructions, never across a wait */
    if (self->next == self->serving && pthread_mutex_trylock(&self->mu) == 0) {
        self->next++;
        pthread_mutex_unlock(&self->turn_mu);
        goto taken;
    }
    if (!blocking || timeout >= 0) {
        pthread_mutex_unlock(&self->turn_mu);
        if (!blocking)
            return 0;
        double until = monotonic() + timeout;
        for (;;) {
            int ok = 0;
            Py_BEGIN_ALLOW_THREADS
            usleep(1000);
            pthread_mutex_lock(&self->turn_mu);
            if (self->next == self->serving && pthread_mutex_trylock(&self->mu) == 0) {
                self->next++;
                ok = 1;
            }
            pthread_mutex_unlock(&self->turn_mu);
            Py_END_ALLOW_THREADS
            if (ok)
                goto taken;
            if (monotonic() >= until)
                return 0;
        }
    }
    uint64_t ticket = self->next++;
    if (self->serving == ticket) {
        pthread_mutex_unlock(&self->turn_mu);
    } else {
        Py_BEGIN_ALLOW_THREADS
        while (self->serving != ticket)
            pthread_cond_wait(&self->turn_cv, &self->turn_mu);
        /* let turn_mu go before the GIL is waited for: lock_give takes it holding the GIL */
        pthread_mutex_unlock(&self->turn_mu);
        Py_END_ALLOW_THREADS
    }
    mutex_without_gil_wait(self);
taken:
    atomic_store(&self->held, 1);
    return 1;
}

static void lock_give(StoreLock *self) {
    atomic_store(&self->held, 0);
    pthread_mutex_unlock(&self->mu);
    pthread_mutex_lock(&self->turn_mu);
    self->serving++;
    pthread_cond_broadcast(&self->turn_cv);
    pthread_mutex_unlock(&self->turn_mu);
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
    atomic_ullong counts[NBUCKETS_MAX + 1];
    atomic_ullong sum_ns;
} Histogram;

/* The write queue (docs/ARCHITECTURE.md, "Reads before writes"). A worker that reads a WRITE
 * from /dev/fuse copies it here and goes back to read(2) at once; the writer threads
 * (serve_writes) take the queued writes in the order they were read and store them. Without
 * it a READ waits behind every WRITE the workers hold: a write costs its pages' compression
 * (~0.3-1 ms), a read ~50 us, and at density N = 16 the loop device saw reads wait 1.3 ms on
 * average behind 100+ writes in flight (BENCHMARKS.md). Only writes of up to WQ_PAGES pages
 * queue; larger ones, and any write while the queue is full or no writer runs, are served
 * by the worker that read them, as before. Two writes in flight at once have no order on a
 * block device, so two writers are as correct as the workers were. The buffers are mapped
 * and populated at start: nothing on the swap-out path allocates. */
#define WQ_SLOTS 32
#define WQ_PAGES 32
#define WQ_BYTES (IN_HEADER + RW_IN + WQ_PAGES * PAGE)

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t queued; /* a write was queued */
    uint8_t *buf;          /* WQ_SLOTS buffers of WQ_BYTES */
    ssize_t len[WQ_SLOTS];
    int order[WQ_SLOTS];   /* the buffers queued, oldest at head */
    int head, count;
    int unused[WQ_SLOTS];  /* the buffers neither queued nor being served */
    int nunused;
    int writers;           /* writer threads in serve_writes: 0, nothing is queued */
    atomic_ullong queued_total, inline_total;
} WriteQueue;

typedef struct {
    PyObject_HEAD
    StoreLock *lock;
    PyObject *keep;  /* the bound arrays, kept alive while their addresses are in use */
    Tables t;        /* read and written only under lock->mu */
    WriteParams wp;  /* set under lock->mu */
    DiskParams disk; /* set under lock->mu; fd -1: disk reads are Python's */
    _Atomic(DictEntry *) dicts[MAX_DICTS]; /* by dictionary id (set_dictionary) */
    DictEntry **made_dicts; /* every entry ever published, freed with the Path */
    size_t nmade;
    DiskFrees disk_frees; /* under lock->mu: extents native writes freed (take_disk_frees) */
    int bound;
    uint64_t size;
    double t0;          /* the store's clock origin, CLOCK_MONOTONIC seconds */
    int64_t tick_base;  /* PageStore.tick_base, under the lock */
    int checksums;
    double bounds[NBUCKETS_MAX];
    int nbounds;
    FrameCache fc;   /* under lock->mu */
    pthread_cond_t decoded; /* with lock->mu: a frame being decoded is done (fc.dec_*) */
    /* counters: atomics, read by Python without the lock */
    StoreCounters c;
    atomic_ullong handed_up, in_flight, reply_errors, disk_reads;
    Histogram read_latency, write_latency;
    WriteQueue wq;
    /* the recompressor's packer (one caller at a time: pack_mu) */
    pthread_mutex_t pack_mu;
    ZSTD_CCtx *pack_cctx;
    int pack_level, pack_pages;
    atomic_ullong packed, pack_raced, pack_kept, pack_bad;
} Path;

static void Path_dealloc(Path *self) {
    OPENSSL_cleanse(self->disk.key, sizeof self->disk.key);
    for (size_t i = 0; i < self->nmade; i++) {
        ZSTD_freeDDict(atomic_load(&self->made_dicts[i]->ddict));
        free(self->made_dicts[i]);
    }
    free(self->made_dicts);
    if (self->pack_cctx)
        ZSTD_freeCCtx(self->pack_cctx);
    if (self->fc.data)
        munmap(self->fc.data, (size_t)FRAME_CACHE_ENTRIES * FRAME_BYTES);
    pthread_mutex_destroy(&self->pack_mu);
    pthread_cond_destroy(&self->decoded);
    if (self->wq.buf)
        munmap(self->wq.buf, (size_t)WQ_SLOTS * WQ_BYTES);
    pthread_mutex_destroy(&self->wq.mu);
    pthread_cond_destroy(&self->wq.queued);
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
    memset(&self->wp, 0, sizeof self->wp);
    self->wp.doorbell = -1;
    self->wp.checksums = checksums;
    memset(&self->disk, 0, sizeof self->disk);
    self->disk.fd = -1;
    memset(&self->fc, 0, sizeof self->fc);
    pthread_cond_init(&self->decoded, NULL);
    pthread_mutex_init(&self->pack_mu, NULL);
    self->pack_cctx = NULL;
    memset(&self->wq, 0, sizeof self->wq);
    pthread_mutex_init(&self->wq.mu, NULL);
    pthread_cond_init(&self->wq.queued, NULL);
    void *buf = mmap(NULL, (size_t)WQ_SLOTS * WQ_BYTES, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    self->wq.buf = buf == MAP_FAILED ? NULL : buf; /* no buffers: writes are served inline */
    for (int i = 0; i < WQ_SLOTS; i++)
        self->wq.unused[i] = i;
    self->wq.nunused = WQ_SLOTS;
    return 0;
}

/* The address of a C-contiguous buffer of items of `itemsize` bytes, and their count, or
 * NULL with an exception. The caller keeps `obj` alive (numpy arrays keep their data while
 * alive). */
static void *address_of(PyObject *d, const char *key, Py_ssize_t itemsize, uint64_t *count) {
    PyObject *obj = PyDict_GetItemString(d, key);
    if (!obj) {
        PyErr_Format(PyExc_KeyError, "bind: no column %s", key);
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    void *addr = view.buf;
    Py_ssize_t got = view.itemsize;
    Py_ssize_t len = view.len;
    PyBuffer_Release(&view);
    if (got != itemsize) {
        PyErr_Format(PyExc_TypeError, "%s: items of %zd bytes, expected %zd", key, got, itemsize);
        return NULL;
    }
    *count = (uint64_t)(len / itemsize);
    return addr;
}

/* bind(tables: dict, tick_base: int, stride: int): under the store lock, from Python
 * (PageStore.columns). Every column the native path reads or writes, by name; the columns
 * of one table must agree in length. */
static PyObject *Path_bind(Path *self, PyObject *args) {
    PyObject *d;
    long long tick_base;
    unsigned int stride;
    if (!PyArg_ParseTuple(args, "O!LI", &PyDict_Type, &d, &tick_base, &stride))
        return NULL;
    if (stride == 0) {
        PyErr_SetString(PyExc_ValueError, "bind: stride 0");
        return NULL;
    }
    Tables t;
    memset(&t, 0, sizeof t);
    uint64_t n;
    int bad = 0;
    /* A table's length is its shortest column's: a column shorter than the others would be
     * a bug in the caller, and must not become a read past its end. */
#define COLUMN(field, key, type, len_field)                                                  \
    do {                                                                                     \
        t.field = (type *)address_of(d, key, sizeof(type), &n);                              \
        if (!t.field)                                                                        \
            return NULL;                                                                     \
        if (t.len_field == 0 || n < t.len_field)                                             \
            t.len_field = n;                                                                 \
        if (n == 0)                                                                          \
            bad = 1;                                                                         \
    } while (0)
    COLUMN(kind, "kind", uint8_t, nslots);
    COLUMN(handle, "handle", uint32_t, nslots);
    COLUMN(sub, "sub", uint8_t, nslots);
    COLUMN(srtime, "slot_rtime", uint16_t, nslots);
    COLUMN(chunk_live, "chunk_live", int32_t, nchunks);
    COLUMN(chunk_touched, "chunk_touched", uint8_t, nchunks);
    COLUMN(chunk_written, "chunk_written", uint8_t, nchunks);
    COLUMN(words, "words", uint64_t, nwords);
    uint64_t one;
#define STATE(field, key, need)                                                              \
    do {                                                                                     \
        t.field = (int64_t *)address_of(d, key, sizeof(int64_t), &one);                      \
        if (!t.field)                                                                        \
            return NULL;                                                                     \
        if (one < (need))                                                                    \
            bad = 1;                                                                         \
    } while (0)
    STATE(slot_state, "slot_state", 1);
    STATE(slot_switch, "slot_switch", 4);
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
    COLUMN(gen, "gen", uint32_t, nblobs);
    COLUMN(form, "form", uint8_t, nblobs);
    COLUMN(disk_off, "disk_off", uint64_t, nblobs);
    uint64_t members;
    t.members = (uint32_t *)address_of(d, "members", sizeof(uint32_t), &members);
    if (!t.members)
        return NULL;
    t.stride = stride;
    if (members / stride < t.nblobs)
        t.nblobs = members / stride;
    STATE(blob_state, "blob_state", 3);
    COLUMN(fps, "index_fps", uint16_t, icap);
    COLUMN(vals, "index_vals", uint32_t, icap);
    STATE(index_state, "index_state", 4);
    COLUMN(a_addr, "arena_addr", uint64_t, narenas);
    COLUMN(a_class, "arena_class", int16_t, narenas);
    COLUMN(a_used, "arena_used", int32_t, narenas);
    COLUMN(a_free_head, "arena_free_head", uint32_t, narenas);
    COLUMN(a_bump, "arena_bump", uint32_t, narenas);
    COLUMN(a_next, "arena_next", int32_t, narenas);
    COLUMN(a_prev, "arena_prev", int32_t, narenas);
    COLUMN(a_flags, "arena_flags", uint8_t, narenas);
    COLUMN(class_cell, "class_cell", uint32_t, nclasses);
    COLUMN(class_cells, "class_cells", uint32_t, nclasses);
    COLUMN(class_arena, "class_arena", uint32_t, nclasses);
    COLUMN(class_head, "class_head", int32_t, nclasses);
    STATE(pool_state, "pool_state", POOL_STATE_ITEMS);
    COLUMN(codec_pages, "codec_pages", int64_t, ncodecs);
#undef COLUMN
#undef STATE
    if (bad || t.ncodecs < 4 || t.nchunks < (t.nslots + CHUNK_SLOTS - 1) / CHUNK_SLOTS) {
        PyErr_SetString(PyExc_ValueError, "bind: a table is empty or too short");
        return NULL;
    }
    t.first_large = t.nclasses;
    for (uint64_t i = 0; i < t.nclasses; i++) {
        if (i && t.class_cell[i] <= t.class_cell[i - 1]) {
            PyErr_SetString(PyExc_ValueError, "bind: class sizes not increasing");
            return NULL;
        }
        if (t.class_cell[i] > MAX_COMPRESSED && t.first_large == t.nclasses)
            t.first_large = i;
    }
    if (t.first_large != MAX_COMPRESSED / 32 || t.class_cell[t.nclasses - 1] < PAGE) {
        PyErr_SetString(PyExc_ValueError, "bind: size classes are not the pool's");
        return NULL;
    }
    PyObject *keep = PyDict_Copy(d);
    if (!keep)
        return NULL;
    /* The caller holds the lock: no native thread reads the tables meanwhile. */
    Py_XSETREF(self->keep, keep);
    t.disk_frees = &self->disk_frees;
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

/* set_writes(enabled, dedup, seed, hot_ticks, reclaim_bytes, max_blobs, doorbell, dense,
 * frame_pages, level): under the store lock. enabled: native writes store pages as Python
 * would, warm (lz4 alone) or, with dense, in zstd frames of frame_pages at level. */
static PyObject *Path_set_writes(Path *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"enabled", "dedup", "seed", "hot_ticks", "reclaim_bytes",
                            "max_blobs", "doorbell", "dense", "frame_pages", "level", NULL};
    int enabled, dedup, doorbell, dense = 0, frame_pages = 1, level = 3;
    unsigned long long seed, max_blobs;
    long long hot_ticks, reclaim_bytes;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "ppKLLKi|pii", names, &enabled, &dedup, &seed,
                                     &hot_ticks, &reclaim_bytes, &max_blobs, &doorbell, &dense,
                                     &frame_pages, &level))
        return NULL;
    if (frame_pages < 1 || frame_pages > MAX_FRAME_PAGES || level < 1 || level > ZSTD_maxCLevel()) {
        PyErr_SetString(PyExc_ValueError, "set_writes: frame pages 1-16, a zstd level");
        return NULL;
    }
    self->wp.dense = dense;
    self->wp.frame_pages = frame_pages;
    self->wp.level = level;
    self->wp.enabled = enabled;
    self->wp.dedup = dedup;
    self->wp.seed = seed;
    self->wp.hot_ticks = hot_ticks;
    self->wp.reclaim_bytes = reclaim_bytes;
    self->wp.max_blobs = max_blobs;
    self->wp.doorbell = doorbell;
    Py_RETURN_NONE;
}

/* set_disk(fd, key): under the store lock. The disk tier's file (-1: none) and its sealer's
 * key (None: extents in the clear). */
static PyObject *Path_set_disk(Path *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"fd", "key", NULL};
    int fd;
    PyObject *key;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iO", names, &fd, &key))
        return NULL;
    Py_buffer k = {0};
    if (key != Py_None) {
        if (PyObject_GetBuffer(key, &k, PyBUF_SIMPLE) < 0)
            return NULL;
        if (k.len != DISK_KEY) {
            PyBuffer_Release(&k);
            PyErr_SetString(PyExc_ValueError, "set_disk: the key is 32 bytes (AES-256)");
            return NULL;
        }
    }
    OPENSSL_cleanse(self->disk.key, sizeof self->disk.key);
    self->disk.fd = fd;
    self->disk.sealed = key != Py_None;
    self->disk.overhead = self->disk.sealed ? DISK_NONCE + DISK_TAG : 0;
    if (self->disk.sealed) {
        memcpy(self->disk.key, k.buf, DISK_KEY);
        PyBuffer_Release(&k);
    }
    Py_RETURN_NONE;
}

/* set_dictionary(id, content, full): a dictionary reads may decode with (DictEntry). The
 * caller keeps `content` alive as long as this Path (NativePath keeps every one it gave).
 * content None: reads of blobs that name `id` are Python's from now on. Any thread, with or
 * without the store lock: readers see an entry whole or not at all. */
static PyObject *Path_set_dictionary(Path *self, PyObject *args) {
    int id, full;
    PyObject *content;
    if (!PyArg_ParseTuple(args, "iOp", &id, &content, &full))
        return NULL;
    if (id < 1 || id >= MAX_DICTS) {
        PyErr_SetString(PyExc_ValueError, "set_dictionary: an id of 1-255");
        return NULL;
    }
    DictEntry *e = NULL;
    if (content != Py_None) {
        if (!PyBytes_Check(content)) {
            PyErr_SetString(PyExc_TypeError, "set_dictionary: content is bytes");
            return NULL;
        }
        DictEntry **made = realloc(self->made_dicts, (self->nmade + 1) * sizeof *made);
        if (made == NULL || (e = calloc(1, sizeof *e)) == NULL) {
            if (made != NULL)
                self->made_dicts = made;
            return PyErr_NoMemory();
        }
        self->made_dicts = made;
        made[self->nmade++] = e;
        e->content = PyBytes_AS_STRING(content);
        e->len = (size_t)PyBytes_GET_SIZE(content);
        e->full = full;
        atomic_init(&e->ddict, NULL);
    }
    atomic_store(&self->dicts[id], e); /* a replaced entry stays in made_dicts */
    Py_RETURN_NONE;
}

/* take_disk_frees() -> [(offset, length)]: under the store lock. The extents of disk blobs
 * native writes released since the last call (DiskTier.settle gives them back). */
static PyObject *Path_take_disk_frees(Path *self, PyObject *unused) {
    DiskFrees *df = &self->disk_frees;
    PyObject *out = PyList_New(df->n);
    if (!out)
        return NULL;
    for (uint32_t i = 0; i < df->n; i++) {
        PyObject *pair = Py_BuildValue("(KI)", (unsigned long long)df->off[i], df->len[i]);
        if (!pair) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, pair);
    }
    df->n = 0;
    return out;
}

static void observe(Path *self, Histogram *h, double seconds) {
    int i = 0;
    while (i < self->nbounds && seconds > self->bounds[i])
        i++;
    atomic_fetch_add(&h->counts[i], 1);
    atomic_fetch_add(&h->sum_ns, (unsigned long long)(seconds * 1e9));
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

static void reply(Path *self, int fd, uint8_t *w, uint64_t unique, uint32_t total) {
    int32_t error = 0;
    memcpy(w, &total, 4);
    memcpy(w + 4, &error, 4);
    memcpy(w + 8, &unique, 8);
    int err = write_all(fd, w, total);
    if (err && err != ENOENT) /* ENOENT: the request was interrupted meanwhile; fine */
        atomic_fetch_add(&self->reply_errors, 1);
}

static int hand_up(Path *self, int reason) {
    atomic_fetch_add(&self->c.handed_up[reason], 1);
    return reason;
}

/* Per worker thread: what a request needs besides the request and reply buffers (~1.8 MiB,
 * made once, so that no request allocates on the swap-in or swap-out path): the prepared
 * pages of a write and their compressed bytes, a read's plan, the stored bytes of the dense
 * blobs it decodes after the lock and their decoded frames, and a zstd context. */
#define READ_JOBS_ROOM (8 * MAX_FRAME_PAGES * MAX_COMPRESSED)
/* a page's room per page of the request, and the slack a last frame's bound needs past them */
#define WRITE_SCRATCH (MAX_PAGES * PAGE + ZSTD_COMPRESSBOUND(FRAME_BYTES) - FRAME_BYTES)
typedef struct {
    WritePlan write;
    LZ4_stream_t lz4;
    uint8_t scratch[WRITE_SCRATCH];
    uint8_t frame[FRAME_BYTES];
    ZSTD_CCtx *cctx_frame, *cctx_page; /* dense writes, made at the first (cctx_level) */
    int cctx_level, cctx_pages;
    ReadPlan plan;
    uint8_t stored[READ_JOBS_ROOM];
    uint8_t frames[8 * FRAME_BYTES];
    ZSTD_DCtx *dctx;
    EVP_CIPHER_CTX *evp; /* disk extents */
} ThreadScratch;

static pthread_key_t scratch_key;

static void scratch_free(void *p) {
    ThreadScratch *s = p;
    EVP_CIPHER_CTX_free(s->evp);
    ZSTD_freeDCtx(s->dctx);
    ZSTD_freeCCtx(s->cctx_frame);
    ZSTD_freeCCtx(s->cctx_page);
    free(s);
}

/* A zstd compression context as codecs._page_params sets one up for `bytes` of input:
 * magicless, no content size or dictionary id, a content checksum for frames only. */
static ZSTD_CCtx *store_cctx(int level, int bytes) {
    ZSTD_CCtx *c = ZSTD_createCCtx();
    if (c == NULL)
        return NULL;
    size_t e = 0;
    e |= ZSTD_isError(ZSTD_CCtx_setParameter(c, ZSTD_c_compressionLevel, level));
    e |= ZSTD_isError(ZSTD_CCtx_setParameter(c, ZSTD_c_format, ZSTD_f_zstd1_magicless));
    e |= ZSTD_isError(ZSTD_CCtx_setParameter(c, ZSTD_c_contentSizeFlag, 0));
    e |= ZSTD_isError(ZSTD_CCtx_setParameter(c, ZSTD_c_checksumFlag, bytes > PAGE));
    e |= ZSTD_isError(ZSTD_CCtx_setParameter(c, ZSTD_c_dictIDFlag, 0));
    e |= ZSTD_isError(ZSTD_CCtx_setParameter(c, ZSTD_c_srcSizeHint, bytes));
    if (e) {
        ZSTD_freeCCtx(c);
        return NULL;
    }
    return c;
}

/* The thread's write plan for this store's settings: 0, or -1 when a context cannot be made. */
static int write_plan(ThreadScratch *s, const WriteParams *p) {
    if (p->dense && (s->cctx_frame == NULL || s->cctx_level != p->level ||
                     s->cctx_pages != p->frame_pages)) {
        ZSTD_freeCCtx(s->cctx_frame);
        ZSTD_freeCCtx(s->cctx_page);
        s->cctx_frame = store_cctx(p->level, p->frame_pages * PAGE);
        s->cctx_page = store_cctx(p->level, PAGE);
        s->cctx_level = p->level;
        s->cctx_pages = p->frame_pages;
        if (s->cctx_frame == NULL || s->cctx_page == NULL)
            return -1;
    }
    s->write.scratch = s->scratch;
    s->write.lz4 = &s->lz4;
    s->write.frame = s->frame;
    s->write.cctx_frame = s->cctx_frame;
    s->write.cctx_page = s->cctx_page;
    s->write.dctx = s->dctx;
    s->write.dec = s->frames;
    return 0;
}

static ZSTD_DCtx *magicless_dctx(void) {
    ZSTD_DCtx *d = ZSTD_createDCtx();
    if (d && ZSTD_isError(ZSTD_DCtx_setParameter(d, ZSTD_d_format, ZSTD_f_zstd1_magicless))) {
        ZSTD_freeDCtx(d);
        d = NULL;
    }
    return d;
}

static ThreadScratch *thread_scratch(void) {
    ThreadScratch *s = pthread_getspecific(scratch_key);
    if (s == NULL) {
        s = malloc(sizeof *s);
        if (s == NULL)
            return NULL;
        s->dctx = magicless_dctx();
        s->evp = EVP_CIPHER_CTX_new();
        s->cctx_frame = s->cctx_page = NULL;
        s->cctx_level = s->cctx_pages = 0;
        if (s->dctx == NULL || s->evp == NULL || pthread_setspecific(scratch_key, s) != 0) {
            EVP_CIPHER_CTX_free(s->evp);
            ZSTD_freeDCtx(s->dctx);
            free(s);
            return NULL;
        }
    }
    return s;
}

/* A READ request of `n` bytes in `r`: SERVED (answered), or the reason it is handed up. */
static int serve_read(Path *self, int fd, const uint8_t *r, ssize_t n, uint8_t *w, size_t wlen) {
    uint64_t unique, nodeid, offset;
    uint32_t size;
    if (n < IN_HEADER + RW_IN)
        return hand_up(self, UP_SHAPE);
    memcpy(&unique, r + 8, 8);
    memcpy(&nodeid, r + 16, 8);
    memcpy(&offset, r + IN_HEADER + 8, 8);
    memcpy(&size, r + IN_HEADER + 16, 4);
    if (nodeid != FILE_ID || offset >= self->size || offset % PAGE)
        return hand_up(self, UP_SHAPE);
    uint64_t len = size;
    if (len > self->size - offset)
        len = self->size - offset;
    if (len > MAX_IO)
        len = MAX_IO;
    if (len == 0 || len % PAGE || OUT_HEADER + len > wlen)
        return hand_up(self, UP_SHAPE);
    ThreadScratch *s = thread_scratch();
    if (s == NULL)
        return hand_up(self, UP_READ_BLOB);
    atomic_fetch_add(&self->in_flight, 1);
    double t0 = monotonic();
    int result = UP_UNBOUND;
    uint8_t *out = w + OUT_HEADER;
    uint64_t count = len / PAGE;
    pthread_mutex_lock(&self->lock->mu);
    for (int tries = 0; self->bound && tries < 8; tries++) {
        int64_t now = store_now(self->t0, self->tick_base);
        if (now >= TICK_REBASE || now < 1) {
            result = UP_UNBOUND; /* Python rebases the ticks */
            break;
        }
        result = native_read(&self->t, &self->fc, &self->disk, self->dicts, self->checksums,
                             now, offset / PAGE, count, out, &s->plan, s->stored,
                             sizeof s->stored);
        if (result != READ_WAIT)
            break;
        /* another request decodes a frame this one reads: its copy comes soon */
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_nsec += 5 * 1000 * 1000;
        if (until.tv_nsec >= 1000000000L) {
            until.tv_sec += 1;
            until.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&self->decoded, &self->lock->mu, &until);
    }
    if (result == READ_WAIT)
        result = UP_READ_BLOB; /* waited long enough: Python's */
    pthread_mutex_unlock(&self->lock->mu);
    if (result == SERVED && s->plan.njobs) { /* dense and disk blobs: without the lock */
        result = finish_read(&s->plan, &self->disk, s->stored, self->checksums, s->dctx,
                             s->evp, s->frames, out, count);
        if (result == SERVED)
            for (uint32_t j = 0; j < s->plan.njobs; j++)
                if (s->plan.jobs[j].on_disk)
                    atomic_fetch_add(&self->disk_reads, 1);
        pthread_mutex_lock(&self->lock->mu);
        if (result == SERVED && self->bound)
            cache_frames(&self->t, &self->fc, &s->plan, s->frames, (int)s->plan.njobs);
        end_decoding(&self->fc, &s->plan);
        pthread_cond_broadcast(&self->decoded);
        pthread_mutex_unlock(&self->lock->mu);
    }
    double elapsed = monotonic() - t0;
    atomic_fetch_sub(&self->in_flight, 1);
    if (result != SERVED)
        return hand_up(self, result);
    /* counted before the reply: once it is written, the client may ask for the stats */
    atomic_fetch_add(&self->c.reads, 1);
    atomic_fetch_add(&self->c.pages_read, len / PAGE);
    atomic_fetch_add(&self->c.bytes_read, len);
    observe(self, &self->read_latency, elapsed);
    reply(self, fd, w, unique, (uint32_t)(OUT_HEADER + len));
    return SERVED;
}

/* A WRITE request of `n` bytes in `r`: SERVED (answered), or the reason it is handed up. */
static int serve_write(Path *self, int fd, const uint8_t *r, ssize_t n, uint8_t *w, size_t wlen) {
    uint64_t unique, nodeid, offset;
    uint32_t size;
    if (!self->wp.enabled || n < IN_HEADER + RW_IN)
        return hand_up(self, UP_SHAPE);
    memcpy(&unique, r + 8, 8);
    memcpy(&nodeid, r + 16, 8);
    memcpy(&offset, r + IN_HEADER + 8, 8);
    memcpy(&size, r + IN_HEADER + 16, 4);
    if (nodeid != FILE_ID || offset % PAGE || size % PAGE || size == 0 || size > MAX_IO ||
        offset >= self->size || size > self->size - offset ||
        (uint64_t)n < (uint64_t)IN_HEADER + RW_IN + size || wlen < OUT_HEADER + WRITE_OUT)
        return hand_up(self, UP_SHAPE);
    ThreadScratch *s = thread_scratch();
    if (s == NULL || write_plan(s, &self->wp) < 0)
        return hand_up(self, UP_WRITE_ROOM);
    atomic_fetch_add(&self->in_flight, 1);
    double t0 = monotonic();
    uint64_t count = size / PAGE;
    for (uint64_t i = 0; i < count; i++)
        s->write.pages[i].found = 0;
    int result = WRITE_REGROUP;
    /* the expensive part (hashes, compression) before the lock, as Placer.prepare; again
     * if dense frames have to be grouped anew around pages found stored */
    for (int tries = 0; result == WRITE_REGROUP && tries < 3; tries++) {
        result = prepare_write(&self->wp, r + IN_HEADER + RW_IN, count, &s->write);
        if (result != SERVED)
            break;
        result = UP_UNBOUND;
        pthread_mutex_lock(&self->lock->mu);
        if (self->bound && self->wp.enabled) {
            int64_t now = store_now(self->t0, self->tick_base);
            if (now < TICK_REBASE && now >= 1)
                result = native_write(&self->t, &self->fc, &self->wp, &self->c, now,
                                      offset / PAGE, count, &s->write);
        }
        pthread_mutex_unlock(&self->lock->mu);
    }
    if (result == WRITE_REGROUP)
        result = UP_WRITE_DEDUP; /* the store kept changing under it: Python's */
    double elapsed = monotonic() - t0;
    atomic_fetch_sub(&self->in_flight, 1);
    if (result != SERVED)
        return hand_up(self, result);
    memcpy(w + OUT_HEADER, &size, 4);
    memset(w + OUT_HEADER + 4, 0, 4);
    observe(self, &self->write_latency, elapsed);
    reply(self, fd, w, unique, OUT_HEADER + WRITE_OUT);
    return SERVED;
}

/* A write a worker stores itself (queue_write did not take it). A worker that answers reads
 * at a real-time priority (datapath/priority.py, device.request_priority) stores it at the
 * normal one: compression is the sandboxes' kind of work, and at FIFO priority it would
 * also keep the other workers' reads waiting, since FIFO threads of one priority do not
 * share a CPU by slices. */
static int serve_write_inline(Path *self, int fd, const uint8_t *r, ssize_t n, uint8_t *w,
                              size_t wlen) {
    struct sched_param was;
    int lowered = sched_getscheduler(0) == SCHED_FIFO && sched_getparam(0, &was) == 0;
    if (lowered) {
        struct sched_param normal = {0};
        lowered = sched_setscheduler(0, SCHED_OTHER, &normal) == 0;
    }
    int result = serve_write(self, fd, r, n, w, wlen);
    if (lowered)
        sched_setscheduler(0, SCHED_FIFO, &was);
    return result;
}

/* A WRITE read by a worker, copied to the write queue: 1, or 0 when the worker serves it
 * itself (too large, the queue full, no writer running or the path not serving writes). */
static int queue_write(Path *self, const uint8_t *r, ssize_t n) {
    WriteQueue *q = &self->wq;
    if (q->buf == NULL || n > WQ_BYTES || !self->wp.enabled)
        return 0;
    pthread_mutex_lock(&q->mu);
    if (q->writers == 0 || q->nunused == 0) {
        pthread_mutex_unlock(&q->mu);
        atomic_fetch_add(&q->inline_total, 1);
        return 0;
    }
    int i = q->unused[--q->nunused];
    memcpy(q->buf + (size_t)i * WQ_BYTES, r, (size_t)n);
    q->len[i] = n;
    q->order[(q->head + q->count) % WQ_SLOTS] = i;
    q->count++;
    atomic_fetch_add(&self->in_flight, 1);
    pthread_cond_signal(&q->queued);
    pthread_mutex_unlock(&q->mu);
    atomic_fetch_add(&q->queued_total, 1);
    return 1;
}

/* serve_writes(fd, rbuf, wbuf, stop) -> int: a writer thread's loop, without the GIL.
 * Takes the queued writes in the order they were read; returns the length of one it does
 * not serve (copied to rbuf, handed up as serve() hands up), or -ECANCELED once `stop` is
 * set and the queue is empty (a pause: nothing read stays unanswered). */
static PyObject *Path_serve_writes(Path *self, PyObject *args) {
    int fd;
    Py_buffer rb, wb, sb;
    if (!PyArg_ParseTuple(args, "iw*w*y*", &fd, &rb, &wb, &sb))
        return NULL;
    WriteQueue *q = &self->wq;
    uint8_t *r = rb.buf, *w = wb.buf;
    const volatile uint8_t *stop = sb.len >= 1 ? sb.buf : NULL;
    size_t rlen = (size_t)rb.len, wlen = (size_t)wb.len;
    ssize_t result = -ECANCELED;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&q->mu);
    q->writers++;
    for (;;) {
        if (q->count == 0) {
            if (stop == NULL || *stop)
                break; /* paused, and nothing queued: no worker queues once writers is 0 */
            struct timespec until; /* a pause sets `stop` without a signal: look again soon */
            clock_gettime(CLOCK_REALTIME, &until);
            until.tv_nsec += 50 * 1000 * 1000;
            if (until.tv_nsec >= 1000000000L) {
                until.tv_sec += 1;
                until.tv_nsec -= 1000000000L;
            }
            pthread_cond_timedwait(&q->queued, &q->mu, &until);
            continue;
        }
        int i = q->order[q->head];
        q->head = (q->head + 1) % WQ_SLOTS;
        q->count--;
        ssize_t n = q->len[i];
        uint8_t *req = q->buf + (size_t)i * WQ_BYTES;
        pthread_mutex_unlock(&q->mu); /* buffer i is this thread's until it is unused again */
        int served = serve_write(self, fd, req, n, w, wlen) == SERVED;
        if (!served && (size_t)n <= rlen)
            memcpy(r, req, (size_t)n);
        pthread_mutex_lock(&q->mu);
        q->unused[q->nunused++] = i;
        atomic_fetch_sub(&self->in_flight, 1);
        if (!served) {
            result = (size_t)n <= rlen ? n : -EMSGSIZE;
            break;
        }
    }
    q->writers--;
    pthread_mutex_unlock(&q->mu);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&rb);
    PyBuffer_Release(&wb);
    PyBuffer_Release(&sb);
    if (result >= 0)
        atomic_fetch_add(&self->handed_up, 1);
    return PyLong_FromSsize_t(result);
}

/* serve(fd, rbuf, wbuf[, epfd, stop]) -> int: serve requests until one needs Python.
 * Returns its length (the request is in rbuf), 0 at end of file, or -errno when read(2)
 * failed. With `epfd` (an epoll set holding the non-blocking /dev/fuse descriptor and a wake
 * eventfd) and `stop` (a one-byte buffer): an empty queue waits in epoll_wait, and the loop
 * returns -ECANCELED before it reads another request once stop[0] is set. So a pause
 * (datapath.fuse.FuseFile.pause, the handover of a restart) finishes the requests already
 * read and takes no new one: those wait in the kernel's queue for the next server. */
static PyObject *Path_serve(Path *self, PyObject *args) {
    int fd, epfd = -1;
    Py_buffer rb, wb, sb = {0};
    if (!PyArg_ParseTuple(args, "iw*w*|iy*", &fd, &rb, &wb, &epfd, &sb))
        return NULL;
    uint8_t *r = rb.buf, *w = wb.buf;
    const volatile uint8_t *stop = sb.buf != NULL && sb.len >= 1 ? sb.buf : NULL;
    size_t rlen = (size_t)rb.len, wlen = (size_t)wb.len;
    ssize_t result;
    Py_BEGIN_ALLOW_THREADS
    for (;;) {
        if (stop != NULL && *stop) {
            result = -ECANCELED;
            break;
        }
        ssize_t n = read(fd, r, rlen);
        if (n < 0) {
            if (errno == EAGAIN && epfd >= 0) {
                struct epoll_event ev[2];
                if (epoll_wait(epfd, ev, 2, -1) < 0 && errno != EINTR) {
                    result = -errno;
                    break;
                }
                continue;
            }
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
        if (opcode == FUSE_WRITE && queue_write(self, r, n))
            continue;
        if (opcode == FUSE_WRITE && serve_write_inline(self, fd, r, n, w, wlen) == SERVED)
            continue;
        atomic_fetch_add(&self->handed_up, 1);
        result = n;
        break;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&rb);
    PyBuffer_Release(&wb);
    if (sb.buf != NULL)
        PyBuffer_Release(&sb);
    return PyLong_FromSsize_t(result);
}

/* set_packing(frame_pages, level): the recompressor's frames (compression.frame_pages,
 * algorithm zstd at `level`), as Placer.store_group compresses them: magicless frames
 * without content size or dictionary id, with zstd's content checksum, parameters for the
 * frame's size. */
static PyObject *Path_set_packing(Path *self, PyObject *args) {
    int pages, level;
    if (!PyArg_ParseTuple(args, "ii", &pages, &level))
        return NULL;
    if (pages < 1 || pages > MAX_FRAME_PAGES || level < 1 || level > ZSTD_maxCLevel()) {
        PyErr_SetString(PyExc_ValueError, "set_packing: frame pages 1-16, a zstd level");
        return NULL;
    }
    ZSTD_CCtx *c = ZSTD_createCCtx();
    if (c == NULL)
        return PyErr_NoMemory();
    size_t e = 0;
    e |= ZSTD_isError(ZSTD_CCtx_setParameter(c, ZSTD_c_compressionLevel, level));
    e |= ZSTD_isError(ZSTD_CCtx_setParameter(c, ZSTD_c_format, ZSTD_f_zstd1_magicless));
    e |= ZSTD_isError(ZSTD_CCtx_setParameter(c, ZSTD_c_contentSizeFlag, 0));
    /* the content checksum, as codecs._page_params writes it for frames (end to end) */
    e |= ZSTD_isError(ZSTD_CCtx_setParameter(c, ZSTD_c_checksumFlag, 1));
    e |= ZSTD_isError(ZSTD_CCtx_setParameter(c, ZSTD_c_dictIDFlag, 0));
    e |= ZSTD_isError(ZSTD_CCtx_setParameter(c, ZSTD_c_srcSizeHint, pages * PAGE));
    if (e) {
        ZSTD_freeCCtx(c);
        PyErr_SetString(PyExc_RuntimeError, "set_packing: libzstd refused a parameter");
        return NULL;
    }
    pthread_mutex_lock(&self->pack_mu);
    if (self->pack_cctx)
        ZSTD_freeCCtx(self->pack_cctx);
    self->pack_cctx = c;
    self->pack_level = level;
    self->pack_pages = pages;
    pthread_mutex_unlock(&self->pack_mu);
    Py_RETURN_NONE;
}

/* pack(blobs, gens, slots) -> (switched, raced, kept, bad, room): the recompressor's pass for
 * warm blobs held by one slot each (uint32, uint32, uint64 arrays of one length, in slot
 * order); takes the store lock itself, so the caller must not hold it. */
static PyObject *Path_pack(Path *self, PyObject *args) {
    Py_buffer b, g, sl;
    if (!PyArg_ParseTuple(args, "y*y*y*", &b, &g, &sl))
        return NULL;
    uint64_t n = (uint64_t)b.len / 4;
    PackResult r;
    memset(&r, 0, sizeof r);
    int result = SERVED;
    if ((uint64_t)g.len != n * 4 || (uint64_t)sl.len != n * 8) {
        PyBuffer_Release(&b);
        PyBuffer_Release(&g);
        PyBuffer_Release(&sl);
        PyErr_SetString(PyExc_ValueError, "pack: blobs, gens (uint32) and slots (uint64) of one length");
        return NULL;
    }
    ZSTD_DCtx *unused = NULL;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->pack_mu);
    if (self->pack_cctx == NULL || !self->bound) {
        result = UP_UNBOUND;
    } else {
        result = native_pack(&self->t, &self->wp, &self->lock->mu, b.buf, g.buf, sl.buf, n,
                             self->pack_pages, self->pack_cctx, unused, &r);
    }
    pthread_mutex_unlock(&self->pack_mu);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    PyBuffer_Release(&g);
    PyBuffer_Release(&sl);
    if (result == UP_UNBOUND) {
        PyErr_SetString(PyExc_RuntimeError, "pack: not bound, or set_packing not called");
        return NULL;
    }
    atomic_fetch_add(&self->packed, r.switched);
    atomic_fetch_add(&self->pack_raced, r.raced);
    atomic_fetch_add(&self->pack_kept, r.kept);
    atomic_fetch_add(&self->pack_bad, r.bad);
    return Py_BuildValue("(KKKKO)", (unsigned long long)r.switched, (unsigned long long)r.raced,
                         (unsigned long long)r.kept, (unsigned long long)r.bad,
                         result == SERVED ? Py_True : Py_False);
}

/* drop_idle(seconds): under the store lock (the caller holds it), from the maintainer: the
 * native frame cache's entries not used for that long go (HotCache.drop_idle). */
static PyObject *Path_drop_idle(Path *self, PyObject *args) {
    double idle;
    if (!PyArg_ParseTuple(args, "d", &idle))
        return NULL;
    frame_cache_drop_idle(&self->fc, idle);
    Py_RETURN_NONE;
}

static PyObject *histogram(Path *self, Histogram *h) {
    PyObject *counts = PyList_New(self->nbounds + 1);
    if (!counts)
        return NULL;
    for (int i = 0; i <= self->nbounds; i++)
        PyList_SET_ITEM(counts, i, PyLong_FromUnsignedLongLong(atomic_load(&h->counts[i])));
    return Py_BuildValue("(Nd)", counts, atomic_load(&h->sum_ns) * 1e-9);
}

static const char *const REASONS[UP_REASONS] = {
    "unbound", "shape", "read_blob", "corrupt", "write_word", "write_disk", "write_dedup",
    "write_room",
};

/* counters() -> dict: what the native path served, for stats and the metrics. */
static PyObject *Path_counters(Path *self, PyObject *unused) {
    PyObject *reasons = PyDict_New();
    if (!reasons)
        return NULL;
    for (int i = 0; i < UP_REASONS; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(atomic_load(&self->c.handed_up[i]));
        if (!v || PyDict_SetItemString(reasons, REASONS[i], v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(reasons);
            return NULL;
        }
        Py_DECREF(v);
    }
    StoreCounters *c = &self->c;
#define U(x) (unsigned long long)atomic_load(&(x))
    return Py_BuildValue(
        "{sKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsNsNsN}",
        "reads", U(c->reads), "pages_read", U(c->pages_read), "bytes_read", U(c->bytes_read),
        "writes", U(c->writes), "pages_written", U(c->pages_written),
        "bytes_written", U(c->bytes_written), "dedup_hits", U(c->dedup_hits),
        "dedup_compares", U(c->dedup_compares), "hash_collisions", U(c->hash_collisions),
        "pingpong", U(c->pingpong), "handed_up", U(self->handed_up),
        "units_written", U(c->units_written), "unit_fallbacks", U(c->unit_fallbacks),
        "units_incompressible", U(c->units_incompressible),
        "packed_pages", U(self->packed), "pack_raced", U(self->pack_raced),
        "pack_kept", U(self->pack_kept), "pack_bad", U(self->pack_bad),
        "frame_cache_hits", (unsigned long long)self->fc.hits,
        "frame_cache_misses", (unsigned long long)self->fc.misses,
        "frame_cache_waits", (unsigned long long)self->fc.waits,
        "frame_cache_bytes", (unsigned long long)frame_cache_bytes(&self->fc),
        "in_flight", U(self->in_flight), "reply_errors", U(self->reply_errors),
        "disk_reads", U(self->disk_reads),
        "writes_queued", U(self->wq.queued_total), "writes_inline", U(self->wq.inline_total),
        "handed_up_by", reasons, "read_latency", histogram(self, &self->read_latency),
        "write_latency", histogram(self, &self->write_latency));
#undef U
}

static PyObject *Path_in_flight(Path *self, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(atomic_load(&self->in_flight));
}

static PyMethodDef Path_methods[] = {
    {"bind", (PyCFunction)Path_bind, METH_VARARGS, "bind(tables, tick_base, stride), under the lock"},
    {"unbind", (PyCFunction)Path_unbind, METH_NOARGS, "unbind(), under the lock"},
    {"set_tick_base", (PyCFunction)Path_set_tick_base, METH_VARARGS, "under the lock"},
    {"set_writes", (PyCFunction)(void (*)(void))Path_set_writes, METH_VARARGS | METH_KEYWORDS,
     "set_writes(enabled, dedup, seed, hot_ticks, reclaim_bytes, max_blobs, doorbell, dense, frame_pages, level), under the lock"},
    {"set_disk", (PyCFunction)(void (*)(void))Path_set_disk, METH_VARARGS | METH_KEYWORDS,
     "set_disk(fd, key), under the lock"},
    {"take_disk_frees", (PyCFunction)Path_take_disk_frees, METH_NOARGS,
     "take_disk_frees() -> [(offset, length)], under the lock"},
    {"set_dictionary", (PyCFunction)Path_set_dictionary, METH_VARARGS,
     "set_dictionary(id, content or None, full): any thread; keep content alive"},
    {"serve", (PyCFunction)Path_serve, METH_VARARGS, "serve(fd, rbuf, wbuf[, epfd, stop]) -> int"},
    {"serve_writes", (PyCFunction)Path_serve_writes, METH_VARARGS,
     "serve_writes(fd, rbuf, wbuf, stop) -> int: a writer thread's loop"},
    {"set_packing", (PyCFunction)Path_set_packing, METH_VARARGS, "set_packing(frame_pages, level)"},
    {"pack", (PyCFunction)Path_pack, METH_VARARGS,
     "pack(blobs, gens, slots) -> (switched, raced, kept, bad, room); takes the lock itself"},
    {"drop_idle", (PyCFunction)Path_drop_idle, METH_VARARGS, "drop_idle(seconds), under the lock"},
    {"counters", (PyCFunction)Path_counters, METH_NOARGS, "counters() -> dict"},
    {"in_flight", (PyCFunction)Path_in_flight, METH_NOARGS, "requests being served now"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject PathType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "agentzip_blk.datapath.nativeloop.Path",
    .tp_basicsize = sizeof(Path),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Path(lock, size, t0, buckets, checksums=True): the native FUSE request path.",
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
    if (pthread_key_create(&scratch_key, scratch_free) != 0) {
        PyErr_SetString(PyExc_OSError, "pthread_key_create");
        return NULL;
    }
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
