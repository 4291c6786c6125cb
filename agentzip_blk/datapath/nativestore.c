/* The native request path's work on the store's books (nativestore.h): a warm read and a
 * warm write, and the pool, index and blob-table operations they need. Each function names
 * the Python function it mirrors; the model tests hold the two to the same answers. */
#define _GNU_SOURCE /* fallocate */
#include "nativestore.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <lz4.h>
#define XXH_INLINE_ALL
#include <xxhash.h>
#define ZSTD_STATIC_LINKING_ONLY /* for ZSTD_d_format / ZSTD_c_format: magicless frames */
#include <zstd.h>
#include <pthread.h>

#define NO_CELL 0xFFFFFFFFu
#define NO_ARENA (-1)
#define NO_BLOB 0xFFFFFFFFu
#define SUB_BITS 4         /* dedup.SUB_BITS */
#define MAX_CANDIDATES 4   /* dedup.MAX_CANDIDATES */
#define MAX_PROBE 64       /* dedup.MAX_PROBE */
#define FP_EMPTY 0
#define FP_TOMBSTONE 1
#define INDEX_AHEAD_LOAD 0.6 /* dedup._AHEAD_LOAD */
#define INDEX_MAX_LOAD 0.7   /* dedup._MAX_LOAD */
#define BLOB_GROW_AHEAD 0.75 /* blobs.GROW_AHEAD */
#define ARENA_GROW_AHEAD 0.75 /* pool.GROW_AHEAD */

static uint8_t *cell_addr(const Tables *t, int32_t a, uint32_t cell);

int64_t store_now(double t0, int64_t tick_base) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    double now = (double)ts.tv_sec + ts.tv_nsec * 1e-9;
    return (int64_t)((now - t0) * TICKS_PER_SECOND) + 1 - tick_base; /* PageStore.now */
}

/* -- reads ----------------------------------------------------------------------------- */

/* A page stored alone in a form `decode_alone` decodes: raw, or lz4. */
static int alone_decodable(uint8_t codec, uint16_t len) {
    return codec == CODEC_RAW ? len == PAGE : codec == CODEC_LZ4 || codec == CODEC_LZ4HC;
}

/* Where a blob's bytes are, if it is one warm pool page the native path decodes (one page,
 * raw or lz4, no dictionary, in a pool cell), else NULL. */
static const uint8_t *servable(const Tables *t, uint32_t blob) {
    if (blob >= t->nblobs || t->ref[blob] == 0 || t->pages[blob] != 1 ||
        t->tier[blob] != TIER_POOL || t->dict_id[blob] != 0)
        return NULL;
    uint16_t len = t->length[blob];
    if (!alone_decodable(t->codec[blob], len))
        return NULL;
    int32_t a = t->arena[blob];
    if (a < 0 || (uint64_t)a >= t->narenas || t->a_addr[a] == 0)
        return NULL;
    int16_t cls = t->a_class[a];
    if (cls < 0 || (uint64_t)cls >= t->nclasses || len > t->class_cell[cls] || len == 0)
        return NULL;
    return (const uint8_t *)(uintptr_t)(t->a_addr[a] + (uint64_t)t->cell[blob] * t->class_cell[cls]);
}

/* The checksum of a page as the kernel wrote it (store.integrity: a page alone is checked
 * after decoding, so a codec or dictionary mix-up reads as a mismatch). */
static uint32_t page_csum(const uint8_t *page) {
    return (uint32_t)XXH3_64bits(page, PAGE);
}

/* A page stored alone (alone_decodable) decoded into `out`, verified against its checksum:
 * 1, or 0 on a mismatch or a codec failure (Python reads it again, counts it and answers
 * EIO). Takes the blob's columns as values: finish_read calls it after the lock. */
static int decode_alone(uint8_t codec, uint16_t len, uint32_t csum, int checksums,
                        const uint8_t *src, uint8_t *out) {
    if (codec == CODEC_RAW)
        memcpy(out, src, PAGE);
    else if (LZ4_decompress_safe((const char *)src, (char *)out, len, PAGE) != PAGE)
        return 0;
    return !checksums || page_csum(out) == csum;
}

/* One warm pool blob's page (servable) decoded, under the lock. */
static int decode_page(const Tables *t, int checksums, uint32_t blob, const uint8_t *src,
                       uint8_t *out) {
    return decode_alone(t->codec[blob], t->length[blob], t->csum[blob], checksums, src, out);
}

/* The dictionary a blob was compressed with, if it names one the native side has (NULL for
 * none, or for one only Python has: `*missing`). */
static DictEntry *dict_of(const Tables *t, _Atomic(DictEntry *) *dicts, uint32_t blob,
                          int *missing) {
    uint8_t id = t->dict_id[blob];
    DictEntry *e = id ? atomic_load(&dicts[id]) : NULL;
    *missing = id && (e == NULL || t->codec[blob] != CODEC_ZSTD);
    return e;
}

/* A blob the native side decodes after the lock: zstd in a pool cell, a dense frame or a
 * page alone (what Placer.store_group and the packer make), its dictionary checked by the
 * caller (dict_of). */
static int dense_servable(const Tables *t, uint32_t blob) {
    if (blob >= t->nblobs || t->ref[blob] == 0 || t->tier[blob] != TIER_POOL ||
        t->codec[blob] != CODEC_ZSTD)
        return 0;
    uint8_t pages = t->pages[blob];
    int32_t a = t->arena[blob];
    if (pages == 0 || pages > MAX_FRAME_PAGES || a < 0 || (uint64_t)a >= t->narenas ||
        t->a_addr[a] == 0)
        return 0;
    int16_t cls = t->a_class[a];
    uint16_t len = t->length[blob];
    return cls >= 0 && (uint64_t)cls < t->nclasses && len > 0 && len <= t->class_cell[cls];
}

/* A disk blob the native side reads (DiskParams): a zstd frame or page, or a page alone in
 * a form decode_alone decodes; its dictionary checked by the caller (dict_of). It stays on
 * disk: the page it answers is in RAM again, and its copy is needed only if the kernel
 * evicts that page clean (docs/ARCHITECTURE.md, "The native request path"); the Python
 * path promotes below the demotion target. */
static int disk_servable(const Tables *t, const DiskParams *disk, uint32_t blob) {
    if (disk->fd < 0 || blob >= t->nblobs || t->ref[blob] == 0 || t->tier[blob] != TIER_DISK)
        return 0;
    uint8_t pages = t->pages[blob], codec = t->codec[blob];
    uint16_t len = t->length[blob];
    if (len == 0 || pages == 0 || pages > MAX_FRAME_PAGES)
        return 0;
    return codec == CODEC_ZSTD || (pages == 1 && alone_decodable(codec, len));
}

static double seconds_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cache_find(FrameCache *fc, uint32_t blob, uint32_t gen) {
    if (fc->data == NULL)
        return -1;
    for (int c = 0; c < FRAME_CACHE_ENTRIES; c++)
        if (fc->valid[c] && fc->blob[c] == blob && fc->gen[c] == gen)
            return c;
    return -1;
}

#define MAX_JOBS 8 /* frames one request decodes after the lock; more: Python's */

/* PageStore._readinto_few for an aligned READ of `count` pages from slot `first`: SERVED,
 * or the reason it is handed up, with nothing changed but read ticks Python sets again.
 * Warm pages and pages of cached frames are answered here, under the lock; the dense
 * blobs left (plan->njobs) have their stored bytes copied to `scratch` for `finish_read`,
 * after the lock. */
/* A same-filled page (store.slots.SameWords: the word of a slot's id, set and dropped under
 * the lock): the word repeated. */
static void same_fill(uint8_t *dst, uint64_t word) {
    if (word == 0) {
        memset(dst, 0, PAGE);
        return;
    }
    for (size_t k = 0; k < PAGE; k += 8)
        memcpy(dst + k, &word, 8);
}

int native_read(const Tables *t, FrameCache *fc, const DiskParams *disk,
                _Atomic(DictEntry *) *dicts, int checksums, int64_t now, uint64_t first,
                uint64_t count, uint8_t *out, ReadPlan *plan, uint8_t *scratch, size_t room) {
    if (first + count > t->nslots || count > MAX_PAGES)
        return UP_SHAPE;
    /* First every page is checked, so that a request is served whole or not at all; each
     * blob's bytes are found once, here. */
    const uint8_t *src[MAX_PAGES];
    uint8_t cached[MAX_PAGES];
    size_t used = 0;
    double when = seconds_now();
    plan->njobs = 0;
    for (uint64_t i = 0; i < count; i++) {
        uint64_t slot = first + i;
        uint8_t kind = t->kind[slot];
        src[i] = NULL;
        cached[i] = 0;
        plan->job_of[i] = -1;
        if (kind == KIND_EMPTY)
            continue;
        if (kind == KIND_SAME) {
            if (t->handle[slot] >= t->nwords)
                return UP_READ_BLOB; /* not a word id: Python's to judge */
            continue;
        }
        if (kind != KIND_BLOB)
            return UP_READ_BLOB;
        uint32_t blob = t->handle[slot];
        if ((src[i] = servable(t, blob)) != NULL)
            continue;
        int on_disk = 0, missing;
        if (!dense_servable(t, blob)) {
            if (!disk_servable(t, disk, blob))
                return UP_READ_BLOB;
            on_disk = 1;
        }
        DictEntry *dict = dict_of(t, dicts, blob, &missing);
        if (missing)
            return UP_READ_BLOB;
        uint8_t sub = t->sub[slot];
        if (sub >= t->pages[blob])
            return UP_CORRUPT;
        int c = t->pages[blob] > 1 ? cache_find(fc, blob, t->gen[blob]) : -1;
        if (c >= 0) {
            src[i] = fc->data + (size_t)c * FRAME_BYTES + (size_t)sub * PAGE;
            cached[i] = 1;
            fc->used[c] = when;
            fc->hits++;
            continue;
        }
        uint32_t j = 0;
        while (j < plan->njobs && plan->jobs[j].blob != blob)
            j++;
        if (j == plan->njobs) {
            uint32_t len = t->length[blob];
            size_t need = len + (on_disk ? disk->overhead : 0);
            if (j == MAX_JOBS || used + need > room)
                return UP_READ_BLOB;
            FrameJob *job = &plan->jobs[plan->njobs++];
            job->blob = blob;
            job->gen = t->gen[blob];
            job->csum = t->csum[blob];
            job->pages = t->pages[blob];
            job->len = len;
            job->at = (uint32_t)used;
            job->decoding = -1;
            job->codec = t->codec[blob];
            job->on_disk = (uint8_t)on_disk;
            job->disk_off = on_disk ? t->disk_off[blob] : 0;
            job->dict = dict;
            if (!on_disk)
                memcpy(scratch + used, cell_addr(t, t->arena[blob], t->cell[blob]), len);
            used += need;
        }
        plan->job_of[i] = (int16_t)j;
        plan->sub_of[i] = sub;
    }
    /* A frame another request decodes now: wait for its copy (nothing is changed yet). */
    for (uint32_t j = 0; j < plan->njobs; j++) {
        const FrameJob *job = &plan->jobs[j];
        if (job->pages < 2)
            continue;
        for (int d = 0; d < MAX_DECODING; d++)
            if (fc->dec_active[d] && fc->dec_blob[d] == job->blob && fc->dec_gen[d] == job->gen) {
                fc->waits++;
                return READ_WAIT;
            }
    }
    /* Then each page answered (or left to finish_read), and its access ticks recorded as
     * PageStore._readinto_few records them (a request handed up midway leaves only ticks
     * Python sets again). */
    uint16_t low = (uint16_t)(now & TICK_MASK);
    for (uint64_t i = 0; i < count; i++) {
        uint8_t *dst = out + i * PAGE;
        uint64_t slot = first + i;
        if (t->kind[slot] == KIND_SAME) {
            same_fill(dst, t->words[t->handle[slot]]);
            continue;
        }
        if (t->kind[slot] != KIND_BLOB) {
            memset(dst, 0, PAGE);
            continue;
        }
        uint32_t blob = t->handle[slot];
        if (cached[i])
            memcpy(dst, src[i], PAGE);
        else if (src[i] != NULL && !decode_page(t, checksums, blob, src[i], dst))
            return UP_CORRUPT;
        t->rtime[blob] = (uint32_t)now;
        t->atime[blob] = (uint32_t)now;
        t->srtime[slot] = low ? low : 1;
    }
    /* Served, once finish_read has decoded the frames left: announced here, for the other
     * requests to wait on (end_decoding, whatever finish_read says) */
    for (uint32_t j = 0; j < plan->njobs; j++) {
        FrameJob *job = &plan->jobs[j];
        fc->misses++;
        if (job->pages < 2)
            continue;
        for (int d = 0; d < MAX_DECODING; d++)
            if (!fc->dec_active[d]) {
                fc->dec_active[d] = 1;
                fc->dec_blob[d] = job->blob;
                fc->dec_gen[d] = job->gen;
                job->decoding = (int16_t)d;
                break;
            }
    }
    return SERVED;
}

/* DiskTier.read for a job: its extent read into `ext` (len + overhead bytes) and opened in
 * place (the blob's bytes at ext + DISK_NONCE when sealed); 0, or -1 when the read is short
 * or fails or the tag does not match. Its cached pages are dropped as DiskTier._drop_cache
 * drops them: the tier is there to hold what memory does not. */
static int read_extent(const DiskParams *disk, EVP_CIPHER_CTX *evp, const FrameJob *job,
                       uint8_t *ext) {
    size_t size = job->len + disk->overhead;
    ssize_t got = pread(disk->fd, ext, size, (off_t)job->disk_off);
    if (got != (ssize_t)size)
        return -1;
    posix_fadvise(disk->fd, (off_t)job->disk_off, (off_t)size, POSIX_FADV_DONTNEED);
    if (!disk->sealed)
        return 0;
    uint8_t aad[20]; /* disk._AAD: <QIII offset, length, blob, generation */
    uint64_t off = job->disk_off;
    uint32_t len = job->len, blob = job->blob, gen = job->gen;
    memcpy(aad, &off, 8);
    memcpy(aad + 8, &len, 4);
    memcpy(aad + 12, &blob, 4);
    memcpy(aad + 16, &gen, 4);
    uint8_t *body = ext + DISK_NONCE;
    int n = 0, ok = EVP_DecryptInit_ex(evp, EVP_aes_256_gcm(), NULL, NULL, NULL) == 1 &&
        EVP_CIPHER_CTX_ctrl(evp, EVP_CTRL_GCM_SET_IVLEN, DISK_NONCE, NULL) == 1 &&
        EVP_DecryptInit_ex(evp, NULL, NULL, disk->key, ext) == 1 &&
        EVP_DecryptUpdate(evp, NULL, &n, aad, sizeof aad) == 1 &&
        EVP_DecryptUpdate(evp, body, &n, body, (int)len) == 1 && n == (int)len &&
        EVP_CIPHER_CTX_ctrl(evp, EVP_CTRL_GCM_SET_TAG, DISK_TAG, body + len) == 1 &&
        EVP_DecryptFinal_ex(evp, body + len, &n) == 1;
    return ok ? 0 : -1;
}

/* A dictionary's digested form, made by the first read that needs it (NULL: zstd refused
 * the content, or no memory; the read goes to Python). */
static ZSTD_DDict *ddict_of(DictEntry *e) {
    ZSTD_DDict *d = atomic_load(&e->ddict);
    if (d != NULL)
        return d;
    d = ZSTD_createDDict_advanced(e->content, e->len, ZSTD_dlm_byRef,
                                  e->full ? ZSTD_dct_fullDict : ZSTD_dct_rawContent,
                                  ZSTD_defaultCMem);
    if (d == NULL)
        return NULL;
    void *none = NULL;
    if (!atomic_compare_exchange_strong(&e->ddict, &none, d)) {
        ZSTD_freeDDict(d); /* another read made it first */
        return none;
    }
    return d;
}

/* After the lock: the blobs of `plan` (dense pool blobs, disk blobs) read, verified and
 * decoded (into `frames`, FRAME_BYTES each), their pages copied out. SERVED; UP_CORRUPT
 * (Python reads it again, counts the mismatch and answers EIO); UP_READ_BLOB when a disk
 * extent did not read or open (Python reads it again: a blob freed and its extent reused
 * meanwhile is read from where it is now, a disk error is counted). */
int finish_read(const ReadPlan *plan, const DiskParams *disk, uint8_t *scratch, int checksums,
                void *dctx, void *evp, uint8_t *frames, uint8_t *out, uint64_t count) {
    for (uint32_t j = 0; j < plan->njobs; j++) {
        const FrameJob *job = &plan->jobs[j];
        const uint8_t *stored = scratch + job->at;
        uint8_t *frame = frames + (size_t)j * FRAME_BYTES;
        if (job->on_disk) {
            if (read_extent(disk, evp, job, scratch + job->at) != 0)
                return UP_READ_BLOB;
            if (disk->sealed)
                stored += DISK_NONCE;
        }
        /* a frame: its stored bytes' checksum, then zstd checks the content checksum it
         * carries; a page alone: its page checksum after decoding (store.integrity) */
        if (checksums && job->pages > 1 && (uint32_t)XXH3_64bits(stored, job->len) != job->csum)
            return UP_CORRUPT;
        size_t want = (size_t)job->pages * PAGE;
        if (job->codec == CODEC_ZSTD) {
            ZSTD_DDict *dd = NULL;
            if (job->dict != NULL && (dd = ddict_of(job->dict)) == NULL)
                return UP_READ_BLOB;
            size_t got = dd ? ZSTD_decompress_usingDDict(dctx, frame, want, stored, job->len, dd)
                            : ZSTD_decompressDCtx(dctx, frame, want, stored, job->len);
            if (ZSTD_isError(got) || got != want)
                return UP_CORRUPT;
            if (checksums && job->pages == 1 && page_csum(frame) != job->csum)
                return UP_CORRUPT;
        } else if (!decode_alone(job->codec, (uint16_t)job->len, job->csum, checksums, stored,
                                 frame)) { /* a disk page alone (disk_servable) */
            return UP_CORRUPT;
        }
    }
    for (uint64_t i = 0; i < count; i++) {
        int16_t j = plan->job_of[i];
        if (j >= 0)
            memcpy(out + i * PAGE, frames + (size_t)j * FRAME_BYTES + (size_t)plan->sub_of[i] * PAGE,
                   PAGE);
    }
    return SERVED;
}

/* A decoded frame into the cache, in the place of the least recently used (under the lock). */
static void cache_put(FrameCache *fc, uint32_t blob, uint32_t gen, const uint8_t *data,
                      uint32_t pages, double when) {
    if (fc->data == NULL) {
        void *m = mmap(NULL, (size_t)FRAME_CACHE_ENTRIES * FRAME_BYTES, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED)
            return;
        madvise(m, (size_t)FRAME_CACHE_ENTRIES * FRAME_BYTES, MADV_DONTDUMP);
        fc->data = m;
    }
    int victim = 0;
    for (int c = 0; c < FRAME_CACHE_ENTRIES; c++) {
        if (!fc->valid[c]) {
            victim = c;
            break;
        }
        if (fc->used[c] < fc->used[victim])
            victim = c;
    }
    memcpy(fc->data + (size_t)victim * FRAME_BYTES, data, (size_t)pages * PAGE);
    fc->blob[victim] = blob;
    fc->gen[victim] = gen;
    fc->valid[victim] = 1;
    fc->resident[victim] = 1;
    fc->used[victim] = when;
}

/* Under the lock again: the frames just decoded kept for their neighbours' reads, if their
 * rows still hold them (Objects.adopt). */
void cache_frames(const Tables *t, FrameCache *fc, const ReadPlan *plan, const uint8_t *frames,
                  int nframes) {
    double when = seconds_now();
    for (int j = 0; j < nframes; j++) {
        const FrameJob *job = &plan->jobs[j];
        if (job->pages < 2 || job->blob >= t->nblobs || t->ref[job->blob] == 0 ||
            t->gen[job->blob] != job->gen || cache_find(fc, job->blob, job->gen) >= 0)
            continue;
        cache_put(fc, job->blob, job->gen, frames + (size_t)j * FRAME_BYTES, job->pages, when);
    }
}

/* Under the lock, after finish_read (whether it decoded or failed) and cache_frames: the
 * request's frames are no longer being decoded (Objects.settle); the caller wakes those
 * waiting for them. */
void end_decoding(FrameCache *fc, const ReadPlan *plan) {
    for (uint32_t j = 0; j < plan->njobs; j++) {
        int16_t d = plan->jobs[j].decoding;
        if (d >= 0)
            fc->dec_active[d] = 0;
    }
}

/* HotCache.drop_idle for the native frame cache: entries not used for `idle` seconds go,
 * and their memory goes back to the kernel. Under the lock. */
void frame_cache_drop_idle(FrameCache *fc, double idle) {
    if (fc->data == NULL)
        return;
    double cutoff = seconds_now() - idle;
    for (int c = 0; c < FRAME_CACHE_ENTRIES; c++) {
        if (fc->valid[c] && fc->used[c] > cutoff)
            continue;
        fc->valid[c] = 0;
        if (fc->resident[c]) {
            madvise(fc->data + (size_t)c * FRAME_BYTES, FRAME_BYTES, MADV_DONTNEED);
            fc->resident[c] = 0;
        }
    }
}

uint64_t frame_cache_bytes(const FrameCache *fc) {
    uint64_t n = 0;
    for (int c = 0; c < FRAME_CACHE_ENTRIES; c++)
        n += fc->resident[c];
    return n * FRAME_BYTES;
}

/* -- the pool (store.pool.Pool) --------------------------------------------------------- */

static uint8_t *cell_addr(const Tables *t, int32_t a, uint32_t cell) {
    return (uint8_t *)(uintptr_t)(t->a_addr[a] + (uint64_t)cell * t->class_cell[t->a_class[a]]);
}

/* Pool.class_for, for a stored length of 1..PAGE */
static uint64_t class_for(const Tables *t, uint16_t len) {
    if (len <= MAX_COMPRESSED)
        return (uint64_t)(len - 1) / 32;
    uint64_t lo = t->first_large, hi = t->nclasses - 1;
    while (lo < hi) {
        uint64_t mid = (lo + hi) / 2;
        if (t->class_cell[mid] >= len)
            hi = mid;
        else
            lo = mid + 1;
    }
    return lo;
}

static int64_t touched(uint32_t cell_size, uint64_t cells) { /* Pool._touched */
    return (int64_t)((cells * cell_size + PAGE - 1) / PAGE * PAGE);
}

static void partial_add(Tables *t, int32_t a) { /* Pool._partial_add */
    if (t->a_flags[a] & ARENA_PARTIAL)
        return;
    int16_t c = t->a_class[a];
    int32_t head = t->class_head[c];
    t->a_next[a] = head;
    t->a_prev[a] = NO_ARENA;
    if (head != NO_ARENA)
        t->a_prev[head] = a;
    t->class_head[c] = a;
    t->a_flags[a] |= ARENA_PARTIAL;
}

static void partial_remove(Tables *t, int32_t a) { /* Pool._partial_remove */
    if (!(t->a_flags[a] & ARENA_PARTIAL))
        return;
    int32_t prev = t->a_prev[a], next = t->a_next[a];
    if (prev != NO_ARENA)
        t->a_next[prev] = next;
    else
        t->class_head[t->a_class[a]] = next;
    if (next != NO_ARENA)
        t->a_prev[next] = prev;
    t->a_flags[a] &= (uint8_t)~ARENA_PARTIAL;
}

/* Pool.alloc, from arena `a` (its class's head: it has a free cell) */
static uint32_t pool_alloc(Tables *t, int32_t a, uint64_t cls) {
    uint32_t cs = t->class_cell[cls];
    uint32_t cell = t->a_free_head[a];
    if (cell != NO_CELL) {
        uint32_t next;
        memcpy(&next, cell_addr(t, a, cell), 4);
        t->a_free_head[a] = next;
    } else {
        cell = t->a_bump[a]++;
        t->pool_state[POOL_RESIDENT] += touched(cs, cell + 1) - touched(cs, cell);
    }
    int32_t used = ++t->a_used[a];
    if ((uint32_t)used == t->class_cells[cls])
        partial_remove(t, a);
    t->pool_state[POOL_LIVE_BYTES] += cs;
    t->pool_state[POOL_LIVE_CELLS] += 1;
    return cell;
}

/* Pool._new_arena: an arena mapped for class `cls`, at the head of its list; NO_ARENA when
 * the pool is at its cap (Python's write goes to the disk tier), the arena books are full
 * (the maintainer grows them ahead of need: Pool.wanted) or the kernel refuses. */
static int32_t new_arena(Tables *t, uint64_t cls) {
    int64_t *ps = t->pool_state;
    uint32_t size = t->class_arena[cls];
    if (ps[POOL_ALLOCATED] + size > ps[POOL_MAX_SIZE])
        return NO_ARENA;
    int64_t id = ps[POOL_FREE_ID];
    int fresh = id == NO_ARENA;
    if (fresh && (uint64_t)ps[POOL_IDS] >= t->narenas)
        return NO_ARENA;
    if (fresh)
        id = ps[POOL_IDS];
    /* pool.map_arena: id's place in the pool's memfd, shared (the memory outlives us) */
    void *addr = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, (int)ps[POOL_MEMFD],
                      (off_t)(id * ps[POOL_SPAN]));
    if (addr == MAP_FAILED)
        return NO_ARENA;
    madvise(addr, size, MADV_DONTDUMP); /* tenants' pages in the clear (pool.map_arena) */
    if (fresh)
        ps[POOL_IDS] = id + 1;
    else
        ps[POOL_FREE_ID] = t->a_next[id];
    t->a_class[id] = (int16_t)cls;
    t->a_addr[id] = (uint64_t)(uintptr_t)addr;
    t->a_used[id] = 0;
    t->a_free_head[id] = NO_CELL;
    t->a_bump[id] = 0;
    t->a_flags[id] = 0;
    ps[POOL_ALLOCATED] += size;
    ps[POOL_ARENAS] += 1;
    partial_add(t, (int32_t)id);
    return (int32_t)id;
}

static void release_arena(Tables *t, int32_t a) { /* Pool._release_arena */
    partial_remove(t, a);
    int16_t cls = t->a_class[a];
    uint32_t size = t->class_arena[cls];
    int64_t *ps = t->pool_state;
    /* pool.unmap_arena: a shared mapping's munmap frees nothing; the punch does */
    munmap((void *)(uintptr_t)t->a_addr[a], size);
    fallocate((int)ps[POOL_MEMFD], FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
              (off_t)(a * ps[POOL_SPAN]), size);
    t->a_addr[a] = 0;
    t->a_used[a] = 0;
    t->a_class[a] = -1;
    t->a_flags[a] = 0;
    t->a_next[a] = (int32_t)ps[POOL_FREE_ID];
    ps[POOL_FREE_ID] = a;
    ps[POOL_ALLOCATED] -= size;
    ps[POOL_RESIDENT] -= touched(t->class_cell[cls], t->a_bump[a]);
    ps[POOL_ARENAS] -= 1;
}

/* Pool.free */
static void pool_free(Tables *t, int32_t a, uint32_t cell) {
    int32_t used = t->a_used[a];
    if (used <= 0 || t->a_addr[a] == 0)
        return; /* cannot happen: a blob's cell is live (store.check() would say) */
    int16_t cls = t->a_class[a];
    uint32_t cs = t->class_cell[cls];
    t->pool_state[POOL_LIVE_BYTES] -= cs;
    t->pool_state[POOL_LIVE_CELLS] -= 1;
    if (used == 1) {
        release_arena(t, a);
        return;
    }
    uint32_t next = t->a_free_head[a];
    memcpy(cell_addr(t, a, cell), &next, 4);
    t->a_free_head[a] = cell;
    t->a_used[a] = used - 1;
    if ((uint32_t)used == t->class_cells[cls] && !(t->a_flags[a] & ARENA_EVACUATING))
        partial_add(t, a);
}

/* -- the dedup index (store.dedup.DedupIndex) -------------------------------------------- */

static uint32_t index_key(uint64_t lo) { /* dedup.index_key */
    uint32_t key = (uint32_t)(lo >> 32);
    return key > FP_TOMBSTONE ? key : key + 2;
}

static uint16_t fingerprint(uint32_t key) { /* dedup.fingerprint */
    uint16_t fp = (uint16_t)(key & 0xFFFF);
    return fp > FP_TOMBSTONE ? fp : (uint16_t)(fp + 2);
}

static uint64_t home(const Tables *t, uint32_t key) {
    return ((uint64_t)key * t->icap) >> 32;
}

/* DedupIndex.insert, without inline growth (a maintainer grows the table) */
static void index_insert(Tables *t, const WriteParams *p, uint32_t key, uint32_t value) {
    int64_t *st = t->index_state;
    if (!p->dedup) {
        st[INDEX_UNINDEXED] += 1;
        return;
    }
    if ((double)(st[INDEX_COUNT] + st[INDEX_TOMBSTONES] + 1) > INDEX_MAX_LOAD * (double)t->icap) {
        st[INDEX_UNINDEXED] += 1;
        st[INDEX_STARVED] = 1;
        return;
    }
    uint16_t fp = fingerprint(key);
    uint64_t pos = home(t, key);
    int64_t free = -1;
    int same = 0;
    for (int i = 0; i < MAX_PROBE; i++) { /* DedupIndex._place */
        uint16_t k = t->fps[pos];
        if (k == fp) {
            if (++same >= MAX_CANDIDATES) {
                st[INDEX_UNINDEXED] += 1;
                return;
            }
        } else if (k <= FP_TOMBSTONE && free < 0) {
            free = (int64_t)pos;
        }
        if (k == FP_EMPTY)
            break;
        if (++pos == t->icap)
            pos = 0;
    }
    if (free < 0) {
        st[INDEX_UNINDEXED] += 1;
        return;
    }
    if (t->fps[free] == FP_TOMBSTONE)
        st[INDEX_TOMBSTONES] -= 1;
    t->fps[free] = fp;
    t->vals[free] = value;
    st[INDEX_COUNT] += 1;
}

static void index_remove(Tables *t, uint32_t key, uint32_t value) { /* DedupIndex.remove */
    uint16_t fp = fingerprint(key);
    uint64_t pos = home(t, key);
    for (int i = 0; i < MAX_PROBE; i++) {
        uint16_t k = t->fps[pos];
        if (k == FP_EMPTY)
            break;
        if (k == fp && t->vals[pos] == value) {
            t->fps[pos] = FP_TOMBSTONE;
            t->index_state[INDEX_COUNT] -= 1;
            t->index_state[INDEX_TOMBSTONES] += 1;
            return;
        }
        if (++pos == t->icap)
            pos = 0;
    }
    t->index_state[INDEX_UNINDEXED] -= 1;
}

/* -- blobs (store.blobs.BlobTable, store.objects.Objects) --------------------------------- */

static void ref_blob(Tables *t, uint32_t blob) { /* Objects.ref */
    t->ref[blob] += 1;
    t->codec_pages[t->codec[blob]] += 1;
}

/* Objects.release: one reference fewer; with the last, the blob and its books go (a cached
 * copy needs no word: the caches are keyed by the row's generation, which this bumps). A
 * disk blob's extent goes to the queue Python empties (DiskFrees); the caller has made sure
 * it has room. */
static void release(Tables *t, uint32_t blob) {
    t->codec_pages[t->codec[blob]] -= 1;
    uint32_t ref = t->ref[blob] - 1;
    if (ref > 0) {
        t->ref[blob] = ref;
        return;
    }
    for (uint32_t sub = 0; sub < t->pages[blob]; sub++)
        index_remove(t, t->members[(uint64_t)blob * t->stride + sub], blob << SUB_BITS | sub);
    if (t->tier[blob] == TIER_POOL) {
        pool_free(t, t->arena[blob], t->cell[blob]);
    } else if (t->disk_frees->n < DISK_FREES) {
        DiskFrees *df = t->disk_frees;
        df->off[df->n] = t->disk_off[blob];
        df->len[df->n] = t->length[blob];
        df->n++;
    } /* else a bug: the extent leaks, and store.check() says so */
    /* BlobTable.delete */
    t->ref[blob] = 0;
    t->gen[blob] += 1;
    t->arena[blob] = (int32_t)t->blob_state[BLOB_FREE_HEAD];
    t->blob_state[BLOB_FREE_HEAD] = blob;
    t->blob_state[BLOB_COUNT] -= 1;
}

/* Objects.new_page / new_frame -> BlobTable.new: a blob of `pages` pages (their index keys
 * in `keys`) in a pool cell, one reference per page, or NO_BLOB with nothing changed when
 * there is no room (the pool at its cap, no free blob row or arena id: Python's). */
static uint32_t new_blob(Tables *t, const WriteParams *p, const uint8_t *stored, uint32_t len,
                         uint8_t codec, uint32_t pages, const uint32_t *keys, uint32_t csum,
                         uint8_t form, int64_t now) {
    int64_t *bs = t->blob_state;
    uint64_t next = (uint64_t)bs[BLOB_NEXT_UNUSED];
    if (bs[BLOB_FREE_HEAD] < 0 && (next >= t->nblobs || next >= p->max_blobs))
        return NO_BLOB; /* the maintainer grows the table ahead of need */
    if (len == 0 || len > t->class_cell[t->nclasses - 1])
        return NO_BLOB;
    uint64_t cls = class_for(t, (uint16_t)len);
    int32_t a = t->class_head[cls];
    if (a == NO_ARENA && (a = new_arena(t, cls)) == NO_ARENA)
        return NO_BLOB;
    uint32_t blob;
    if (bs[BLOB_FREE_HEAD] >= 0) {
        blob = (uint32_t)bs[BLOB_FREE_HEAD];
        bs[BLOB_FREE_HEAD] = t->arena[blob];
    } else {
        blob = (uint32_t)next;
        bs[BLOB_NEXT_UNUSED] = (int64_t)next + 1;
    }
    uint32_t cell = pool_alloc(t, a, cls);
    memcpy(cell_addr(t, a, cell), stored, len);
    t->arena[blob] = a;
    t->cell[blob] = cell;
    t->length[blob] = (uint16_t)len;
    t->pages[blob] = (uint8_t)pages;
    t->codec[blob] = codec;
    t->dict_id[blob] = 0;
    t->ref[blob] = pages;
    t->tier[blob] = TIER_POOL;
    t->atime[blob] = (uint32_t)now;
    t->rtime[blob] = 0;
    t->csum[blob] = csum;
    t->form[blob] = form;
    bs[BLOB_COUNT] += 1;
    for (uint32_t k = 0; k < pages; k++) {
        t->members[(uint64_t)blob * t->stride + k] = keys[k];
        index_insert(t, p, keys[k], blob << SUB_BITS | k);
    }
    t->codec_pages[codec] += pages;
    return blob;
}

/* Placer.store_warm: a warm page alone */
static uint32_t new_warm(Tables *t, const WriteParams *p, const WritePage *w, int64_t now) {
    return new_blob(t, p, w->stored, w->len, w->codec, 1, &w->key, w->csum, FORM_WARM, now);
}

/* Placer.lookup: a stored page equal to `page`: 1 (found: *blob, *sub), 0 (none), or -1
 * with *reason when a candidate is one the native side cannot compare (a frame, a disk
 * blob: Python's frame cache and disk tier) or does not verify. */
/* Page `sub` of a dense blob (zstd, no dictionary, in a pool cell), for a dedup comparison
 * (Objects.page): from the frame cache, or decoded into `buf` (FRAME_BYTES) under the lock
 * and the frame cached, as the Python path's comparison does. NULL when it does not
 * verify or decode (Python counts it). */
static const uint8_t *dense_page_of(const Tables *t, FrameCache *fc, void *dctx, uint8_t *buf,
                                    int checksums, uint32_t b, uint8_t sub) {
    uint32_t pages = t->pages[b];
    double when = seconds_now();
    if (pages > 1) {
        int c = cache_find(fc, b, t->gen[b]);
        if (c >= 0) {
            fc->used[c] = when;
            fc->hits++;
            return fc->data + (size_t)c * FRAME_BYTES + (size_t)sub * PAGE;
        }
    }
    const uint8_t *src = cell_addr(t, t->arena[b], t->cell[b]);
    uint16_t len = t->length[b];
    if (checksums && pages > 1 && (uint32_t)XXH3_64bits(src, len) != t->csum[b])
        return NULL;
    size_t got = ZSTD_decompressDCtx(dctx, buf, (size_t)pages * PAGE, src, len);
    if (ZSTD_isError(got) || got != (size_t)pages * PAGE)
        return NULL;
    if (checksums && pages == 1 && page_csum(buf) != t->csum[b])
        return NULL;
    if (pages > 1) {
        fc->misses++;
        cache_put(fc, b, t->gen[b], buf, pages, when);
    }
    return buf + (size_t)sub * PAGE;
}

static int lookup(const Tables *t, FrameCache *fc, const WritePlan *plan, int checksums,
                  const WritePage *w, const uint8_t *page, uint32_t *blob, uint8_t *sub,
                  uint64_t *compares, uint64_t *collisions, int *reason) {
    uint8_t decoded[PAGE];
    uint16_t fp = fingerprint(w->key);
    uint64_t pos = home(t, w->key);
    int tried = 0;
    for (int i = 0; i < MAX_PROBE; i++) {
        uint16_t k = t->fps[pos];
        if (k == FP_EMPTY)
            return 0;
        if (k == fp) {
            if (tried++ >= MAX_CANDIDATES)
                return 0;
            uint32_t value = t->vals[pos];
            uint32_t b = value >> SUB_BITS;
            uint8_t s = (uint8_t)(value & ((1u << SUB_BITS) - 1));
            if (b < t->nblobs && s < t->stride &&
                t->members[(uint64_t)b * t->stride + s] == w->key) {
                const uint8_t *src = servable(t, b);
                const uint8_t *stored_page = decoded;
                if (src != NULL && s == 0) {
                    if (!decode_page(t, checksums, b, src, decoded)) {
                        *reason = UP_CORRUPT;
                        return -1;
                    }
                } else if (dense_servable(t, b) && s < t->pages[b] && plan->dec != NULL) {
                    stored_page = dense_page_of(t, fc, plan->dctx, plan->dec, checksums, b, s);
                    if (stored_page == NULL) {
                        *reason = UP_CORRUPT;
                        return -1;
                    }
                } else { /* on disk, with a dictionary: Python's */
                    *reason = UP_WRITE_DEDUP;
                    return -1;
                }
                *compares += 1;
                if (memcmp(stored_page, page, PAGE) == 0) {
                    *blob = b;
                    *sub = s;
                    return 1;
                }
                *collisions += 1;
            }
        }
        if (++pos == t->icap)
            pos = 0;
    }
    return 0;
}

/* -- writes ---------------------------------------------------------------------------- */

/* A page compressed alone with zstd (codecs.encode_page with the writer: a page that does
 * not pay is stored raw), into `out` (MAX_COMPRESSED bytes). */
static void dense_page(const WriteParams *p, void *cctx, const uint8_t *page, uint8_t *out,
                       WritePage *w) {
    size_t n = ZSTD_compress2(cctx, out, MAX_COMPRESSED, page, PAGE);
    if (!ZSTD_isError(n) && n > 0) {
        w->stored = out;
        w->len = (uint16_t)n;
        w->codec = CODEC_ZSTD;
    } else {
        w->stored = page;
        w->len = PAGE;
        w->codec = CODEC_RAW;
    }
}

/* Placer.prepare, without the lock (and without the GIL): for each page, same-filled or
 * not, its keyed hash and an equal earlier page of the request; then the stored bytes of
 * the new pages: warm, lz4 alone (or the page itself when that does not pay); dense, the
 * groups of frame_pages new pages (not found stored at the last try) compressed as one zstd
 * frame, and the pages of a group of one or of a frame that does not pay compressed alone.
 * SERVED, or UP_WRITE_WORD for a same-filled page other than zero (the words table is
 * Python's). `plan->pages[i].found` is kept from the last try. */
int prepare_write(const WriteParams *p, const uint8_t *data, uint64_t count, WritePlan *plan) {
    WritePage *wp = plan->pages;
    for (uint64_t i = 0; i < count; i++) {
        const uint8_t *page = data + i * PAGE;
        WritePage *w = &wp[i];
        w->page = page;
        w->repeat_of = -1;
        w->blob = NO_BLOB;
        w->sub = 0;
        w->stored = NULL;
        /* placement.same_filled: one 64-bit word repeated <=> the page equals itself
         * shifted by a word */
        w->same = memcmp(page, page + 8, PAGE - 8) == 0;
        if (w->same) {
            uint64_t word;
            memcpy(&word, page, 8);
            if (word != 0)
                return UP_WRITE_WORD;
            continue;
        }
        w->lo = w->hi = 0; /* placement._NO_HASH: dedup off */
        if (p->dedup) {
            XXH128_hash_t h = XXH3_128bits_withSeed(page, PAGE, p->seed);
            w->lo = h.low64;
            w->hi = h.high64;
            /* placement.first_copies: equal hashes are a hint, the bytes decide */
            for (uint64_t j = 0; j < i; j++) {
                const WritePage *e = &wp[j];
                if (!e->same && e->repeat_of < 0 && e->lo == w->lo && e->hi == w->hi &&
                    memcmp(data + j * PAGE, page, PAGE) == 0) {
                    w->repeat_of = (int16_t)j;
                    break;
                }
            }
        }
        w->key = index_key(w->lo);
        w->csum = p->checksums ? page_csum(page) : 0;
        if (w->repeat_of >= 0 || p->dense)
            continue;
        uint8_t *out = plan->scratch + i * PAGE;
        /* python-lz4's call (a fresh stream, compress_fast_continue): its output, which
         * is smaller than one-shot LZ4_compress_fast's on these pages, at the same speed */
        LZ4_stream_t *stream = LZ4_initStream(plan->lz4, sizeof(LZ4_stream_t));
        int n = LZ4_compress_fast_continue(stream, (const char *)page, (char *)out, PAGE,
                                           MAX_COMPRESSED, 1);
        if (n > 0) { /* codecs.pays: it fit in MAX_COMPRESSED */
            w->stored = out;
            w->len = (uint16_t)n;
            w->codec = CODEC_LZ4;
        } else {
            w->stored = page;
            w->len = PAGE;
            w->codec = CODEC_RAW;
        }
    }
    plan->ngroups = 0;
    if (!p->dense)
        return SERVED;
    /* the groups: runs of frame_pages new pages, in order, wherever they are */
    WriteGroup *g = NULL;
    for (uint64_t i = 0; i < count; i++) {
        const WritePage *w = &wp[i];
        if (w->same || w->repeat_of >= 0 || w->found)
            continue;
        if (g == NULL || g->m == p->frame_pages) {
            g = &plan->groups[plan->ngroups++];
            g->m = 0;
            g->len = 0;
        }
        g->pos[g->m++] = (uint16_t)i;
    }
    for (uint32_t k = 0; k < plan->ngroups; k++) {
        WriteGroup *grp = &plan->groups[k];
        /* its output at its first page's place, whole: the next group starts past its last
         * page, and what runs past that (a frame that did not compress) is only ever read
         * here, before the next group writes there (the scratch's slack covers the last) */
        uint8_t *out = plan->scratch + (size_t)grp->pos[0] * PAGE;
        grp->incompressible = 0;
        if (grp->m > 1) {
            for (uint16_t j = 0; j < grp->m; j++)
                memcpy(plan->frame + (size_t)j * PAGE, wp[grp->pos[j]].page, PAGE);
            /* whole, so that a frame that does not pay says by its length whether its
             * pages may pay alone (codecs.alone_may_pay) */
            size_t n = ZSTD_compress2(plan->cctx_frame, out,
                                      ZSTD_COMPRESSBOUND((size_t)grp->m * PAGE), plan->frame,
                                      (size_t)grp->m * PAGE);
            if (ZSTD_isError(n) || n == 0)
                n = (size_t)grp->m * PAGE; /* as if it did not compress */
            if (n <= (size_t)grp->m * MAX_COMPRESSED) { /* codecs.pays */
                grp->len = (uint32_t)n;
                grp->stored = out;
                grp->csum = p->checksums ? (uint32_t)XXH3_64bits(out, n) : 0;
                continue;
            }
            if ((int64_t)grp->m * PAGE - (int64_t)n + FRAME_HEADERS < PAGE - MAX_COMPRESSED) {
                grp->incompressible = 1; /* random bytes: no page pays alone either */
                for (uint16_t j = 0; j < grp->m; j++) {
                    WritePage *w = &wp[grp->pos[j]];
                    w->stored = w->page;
                    w->len = PAGE;
                    w->codec = CODEC_RAW;
                }
                continue;
            }
        }
        for (uint16_t j = 0; j < grp->m; j++) { /* alone (Placer.store_group's fallback) */
            uint16_t i = grp->pos[j];
            dense_page(p, plan->cctx_page, wp[i].page, plan->scratch + (size_t)i * PAGE,
                       &wp[i]);
        }
    }
    return SERVED;
}

/* PageStore._pingpong: slots read within hot_threshold_ms (the slot's low 16 bits of its
 * last read, and its blob's full tick). */
static uint64_t pingpong(const Tables *t, int64_t hot, int64_t now, uint64_t first,
                         uint64_t count) {
    uint64_t n = 0;
    for (uint64_t s = first; s < first + count; s++) {
        uint16_t rt = t->srtime[s];
        if (!rt)
            continue;
        if (hot <= TICK_MASK / 2 && ((now - rt) & TICK_MASK) > hot)
            continue;
        uint32_t h = t->handle[s];
        if (h >= t->nblobs)
            continue;
        int64_t blob_rt = t->rtime[h];
        if (blob_rt > 0 && now - blob_rt <= hot)
            n++;
    }
    return n;
}

/* PageStore._write_pages for `count` prepared pages at slot `first`, under the lock:
 * SERVED, or a hand-up reason with the books exactly as they were (ticks aside). As in
 * Python, every new page gets its home first (staged); only then are the old contents
 * released and the slots switched. */
int native_write(Tables *t, FrameCache *fc, const WriteParams *p, StoreCounters *c,
                 int64_t now, uint64_t first, uint64_t count, WritePlan *plan) {
    WritePage *wp = plan->pages;
    if (first + count > t->nslots || count > MAX_PAGES)
        return UP_SHAPE;
    /* 1. what the slots hold now must be ours to release: blobs (a disk blob's extent with
     * room in the queue for Python), the zero word */
    uint32_t on_disk = 0;
    for (uint64_t s = first; s < first + count; s++) {
        uint8_t kind = t->kind[s];
        uint32_t h = t->handle[s];
        if (kind == KIND_SAME) {
            if (h != 0)
                return UP_WRITE_WORD;
        } else if (kind == KIND_BLOB) {
            if (h >= t->nblobs || t->ref[h] == 0)
                return UP_CORRUPT;
            if (t->tier[h] != TIER_POOL && t->disk_frees->n + ++on_disk > DISK_FREES)
                return UP_WRITE_DISK;
        } else if (kind != KIND_EMPTY) {
            return UP_CORRUPT;
        }
    }
    /* 2. dedup: stored pages equal to new ones (nothing changes here; the counts are
     * kept until the request is served, so a hand-up does not count twice) */
    uint64_t compares = 0, collisions = 0, hits = 0, pp = 0;
    for (uint64_t i = 0; p->dedup && i < count; i++) {
        WritePage *w = &wp[i];
        if (w->same || w->repeat_of >= 0)
            continue;
        int reason = SERVED;
        int found = lookup(t, fc, plan, p->checksums, w, w->page, &w->blob, &w->sub,
                           &compares, &collisions, &reason);
        if (found < 0)
            return reason;
        if (!found)
            w->blob = NO_BLOB;
    }
    if (p->dense) { /* the groups were made for the pages found at the last try */
        int regroup = 0;
        for (uint64_t i = 0; i < count; i++) {
            WritePage *w = &wp[i];
            if (w->same || w->repeat_of >= 0)
                continue;
            uint8_t found = w->blob != NO_BLOB;
            if (found != w->found) {
                w->found = found;
                regroup = 1;
            }
        }
        if (regroup)
            return WRITE_REGROUP;
    }
    /* 3. stage: one reference per page, new blobs for the pages not found: warm pages, or
     * dense frames and pages alone */
    uint32_t staged[MAX_PAGES];
    uint64_t nstaged = 0;
    uint64_t units = 0, fallbacks = 0, incompressible = 0;
    for (uint32_t k = 0; k < plan->ngroups; k++) {
        WriteGroup *grp = &plan->groups[k];
        if (grp->len == 0) {
            fallbacks += grp->m > 1;
            incompressible += grp->incompressible;
            continue; /* its pages alone, below */
        }
        uint32_t keys[MAX_FRAME_PAGES];
        for (uint16_t j = 0; j < grp->m; j++)
            keys[j] = wp[grp->pos[j]].key;
        uint32_t blob = new_blob(t, p, grp->stored, grp->len, CODEC_ZSTD, grp->m, keys,
                                 grp->csum, FORM_DENSE, now);
        if (blob == NO_BLOB) {
            for (uint64_t q = 0; q < nstaged; q++)
                release(t, staged[q]);
            ring_doorbell(p, c, now);
            return UP_WRITE_ROOM;
        }
        for (uint16_t j = 0; j < grp->m; j++) {
            wp[grp->pos[j]].blob = blob;
            wp[grp->pos[j]].sub = (uint8_t)j;
            staged[nstaged++] = blob;
        }
        units++;
    }
    for (uint64_t i = 0; i < count; i++) {
        WritePage *w = &wp[i];
        if (w->same || w->repeat_of >= 0 || (p->dense && w->stored == NULL && !w->found))
            continue; /* a repeat, or a page of a frame staged above */
        if (w->blob != NO_BLOB) { /* Placer.lookup's share */
            ref_blob(t, w->blob);
            t->atime[w->blob] = (uint32_t)now;
            hits++;
            int64_t rt = t->rtime[w->blob];
            if (rt && now - rt <= p->hot_ticks)
                pp++; /* the same content came back right after a read */
        } else {
            w->blob = p->dense ? new_blob(t, p, w->stored, w->len, w->codec, 1, &w->key,
                                          w->csum, FORM_DENSE, now)
                               : new_warm(t, p, w, now);
            w->sub = 0;
            if (w->blob == NO_BLOB) {
                for (uint64_t k = 0; k < nstaged; k++)
                    release(t, staged[k]);
                ring_doorbell(p, c, now);
                return UP_WRITE_ROOM;
            }
        }
        staged[nstaged++] = w->blob;
    }
    for (uint64_t i = 0; i < count; i++) {
        WritePage *w = &wp[i];
        if (w->same || w->repeat_of < 0)
            continue;
        const WritePage *e = &wp[w->repeat_of];
        w->blob = e->blob;
        w->sub = e->sub;
        ref_blob(t, w->blob);
        hits++;
    }
    /* 4. ping-pong, the old contents released, the slots switched (PageStore._write_pages:
     * _pingpong, _release_slots, SlotTable.fill) */
    pp += pingpong(t, p->hot_ticks, now, first, count);
    int64_t same = 0;
    for (uint64_t i = 0; i < count; i++) {
        uint64_t s = first + i;
        uint8_t kind = t->kind[s];
        if (kind == KIND_BLOB)
            release(t, t->handle[s]);
        else if (kind == KIND_SAME)
            same--;
        WritePage *w = &wp[i];
        uint8_t nkind = w->same ? KIND_SAME : KIND_BLOB;
        t->chunk_live[s / CHUNK_SLOTS] += (kind == KIND_EMPTY);
        t->chunk_touched[s / CHUNK_SLOTS] = 1;
        t->chunk_written[s / CHUNK_SLOTS] = 1;
        t->kind[s] = nkind;
        t->handle[s] = w->same ? 0 : w->blob;
        t->sub[s] = w->same ? 0 : w->sub;
        t->srtime[s] = 0;
        same += w->same;
    }
    t->slot_state[0] += same;
    atomic_fetch_add(&c->writes, 1);
    atomic_fetch_add(&c->pages_written, count);
    atomic_fetch_add(&c->bytes_written, count * PAGE);
    atomic_fetch_add(&c->dedup_hits, hits);
    atomic_fetch_add(&c->dedup_compares, compares);
    atomic_fetch_add(&c->hash_collisions, collisions);
    atomic_fetch_add(&c->pingpong, pp);
    atomic_fetch_add(&c->units_written, units);
    atomic_fetch_add(&c->unit_fallbacks, fallbacks);
    atomic_fetch_add(&c->units_incompressible, incompressible);
    /* the maintainer, now rather than at its next round: the pool past its threshold, the
     * index, the blob table or the arena books near full */
    const int64_t *is = t->index_state;
    if (t->pool_state[POOL_ALLOCATED] >= p->reclaim_bytes ||
        (double)(is[INDEX_COUNT] + is[INDEX_TOMBSTONES] + 1) > INDEX_AHEAD_LOAD * (double)t->icap ||
        (double)t->blob_state[BLOB_NEXT_UNUSED] > BLOB_GROW_AHEAD * (double)t->nblobs ||
        (double)t->pool_state[POOL_IDS] > ARENA_GROW_AHEAD * (double)t->narenas)
        ring_doorbell(p, c, now);
    return SERVED;
}

void ring_doorbell(const WriteParams *p, StoreCounters *c, int64_t now) {
    if (p->doorbell < 0 || atomic_exchange(&c->last_ring, now) == now)
        return; /* rung this tick already */
    uint64_t one = 1;
    ssize_t n = write(p->doorbell, &one, sizeof one);
    (void)n; /* EAGAIN: the counter is saturated, rung enough */
}

/* -- packing (store.recompress) ------------------------------------------------------------ */

#define PACK_MAX 256 /* recompress.CHUNK_PAGES */

typedef struct {
    uint32_t blob, gen, csum, key, atime, rtime;
    uint64_t slot;
    uint16_t len;
    uint8_t codec;
    uint8_t ok;  /* copied and decoded */
    uint8_t bad; /* its bytes did not verify or decode */
} PackPage;

/* Recompressor._unchanged for a blob held by one slot: still the warm page the pick saw. */
static int pack_unchanged(const Tables *t, uint32_t blob, uint32_t gen, uint64_t slot) {
    return blob < t->nblobs && t->ref[blob] == 1 && t->gen[blob] == gen &&
           t->form[blob] == FORM_WARM && t->tier[blob] == TIER_POOL && t->pages[blob] == 1 &&
           slot < t->nslots && t->kind[slot] == KIND_BLOB && t->handle[slot] == blob &&
           t->sub[slot] == 0;
}

/* Recompressor.pass_once's pick, decode, compress and switch for warm blobs held by one slot
 * each: under the lock the pages still as picked are copied; without it they are verified,
 * decoded and compressed in groups of `frame_pages` (in the order given: slot order); under
 * it again each group whose pages are all unchanged becomes one dense frame (or a dense
 * page alone, for a group of one) and the warm blobs go (Objects.release). A group that
 * changed meanwhile is left as it is (raced); one that does not pay keeps its pages as they
 * are, marked dense so that they are not picked again (kept, and counted as switched: they
 * are in their dense form); a page that does not verify is
 * marked dense and left to the reads (bad). Returns SERVED, or UP_WRITE_ROOM when the pool
 * had no room for a frame (the rest stays warm). */
int native_pack(Tables *t, const WriteParams *p, void *lock, const uint32_t *blobs,
                const uint32_t *gens, const uint64_t *slots, uint64_t n, int frame_pages,
                void *cctx, void *dctx, PackResult *r) {
    pthread_mutex_t *mu = lock;
    memset(r, 0, sizeof *r);
    if (n > PACK_MAX)
        n = PACK_MAX;
    if (frame_pages < 1 || frame_pages > MAX_FRAME_PAGES || n == 0)
        return SERVED;
    PackPage *pp = calloc(n, sizeof *pp);
    uint8_t *in = malloc(n * PAGE);        /* stored bytes as copied */
    uint8_t *dec = malloc(n * PAGE);       /* decoded pages */
    uint8_t *frame = malloc(FRAME_BYTES);  /* one group's pages, contiguous */
    uint8_t *out = malloc(n * PAGE);       /* compressed groups, at their first page's place */
    size_t *outlen = calloc(n, sizeof *outlen);
    int result = SERVED;
    if (!pp || !in || !dec || !frame || !out || !outlen) {
        result = UP_WRITE_ROOM;
        goto done;
    }
    /* 1. copy, under the lock */
    pthread_mutex_lock(mu);
    for (uint64_t i = 0; i < n; i++) {
        PackPage *q = &pp[i];
        q->blob = blobs[i];
        q->gen = gens[i];
        q->slot = slots[i];
        const uint8_t *src;
        if (!pack_unchanged(t, q->blob, q->gen, q->slot) || !(src = servable(t, q->blob)))
            continue;
        q->len = t->length[q->blob];
        q->codec = t->codec[q->blob];
        q->csum = t->csum[q->blob];
        q->key = t->members[(uint64_t)q->blob * t->stride];
        q->atime = t->atime[q->blob];
        q->rtime = t->rtime[q->blob];
        memcpy(in + i * PAGE, src, q->len);
        q->ok = 1;
    }
    pthread_mutex_unlock(mu);
    /* 2. verify and decode, without it */
    uint64_t good[PACK_MAX], ngood = 0;
    for (uint64_t i = 0; i < n; i++) {
        PackPage *q = &pp[i];
        if (!q->ok)
            continue;
        const uint8_t *stored = in + i * PAGE;
        int fine = 1;
        if (q->codec == CODEC_RAW)
            memcpy(dec + i * PAGE, stored, PAGE);
        else
            fine = LZ4_decompress_safe((const char *)stored, (char *)(dec + i * PAGE), q->len,
                                       PAGE) == PAGE;
        fine = fine && (!p->checksums || page_csum(dec + i * PAGE) == q->csum);
        if (!fine) {
            q->ok = 0;
            q->bad = 1;
            continue;
        }
        good[ngood++] = i;
    }
    /* 3. compress the groups (runs of frame_pages good pages, in order), without it */
    for (uint64_t g = 0; g < ngood; g += (uint64_t)frame_pages) {
        uint64_t m = ngood - g < (uint64_t)frame_pages ? ngood - g : (uint64_t)frame_pages;
        for (uint64_t k = 0; k < m; k++)
            memcpy(frame + k * PAGE, dec + good[g + k] * PAGE, PAGE);
        size_t cap = m * MAX_COMPRESSED; /* codecs.pays */
        size_t len = ZSTD_compress2(cctx, out + good[g] * PAGE, cap, frame, m * PAGE);
        outlen[good[g]] = ZSTD_isError(len) ? 0 : len;
    }
    (void)dctx;
    /* 4. switch, under the lock again */
    pthread_mutex_lock(mu);
    for (uint64_t g = 0; g < ngood; g += (uint64_t)frame_pages) {
        uint64_t m = ngood - g < (uint64_t)frame_pages ? ngood - g : (uint64_t)frame_pages;
        int same = 1;
        for (uint64_t k = 0; k < m && same; k++) {
            const PackPage *q = &pp[good[g + k]];
            same = pack_unchanged(t, q->blob, q->gen, q->slot);
        }
        if (!same) {
            r->raced++;
            continue;
        }
        size_t len = outlen[good[g]];
        if (len == 0) {
            /* does not pay: the pages stay as they are, dense from now on (Python stores
             * them alone, raw where they are raw: the same, in new rows) */
            for (uint64_t k = 0; k < m; k++)
                t->form[pp[good[g + k]].blob] = FORM_DENSE;
            r->kept += m;
            r->switched += m;
            continue;
        }
        uint64_t cls = class_for(t, (uint16_t)len);
        int32_t a = t->class_head[cls];
        if (a == NO_ARENA && (a = new_arena(t, cls)) == NO_ARENA) {
            result = UP_WRITE_ROOM; /* the pool is at its cap: demotion comes next */
            break;
        }
        uint32_t cell = pool_alloc(t, a, cls);
        memcpy(cell_addr(t, a, cell), out + good[g] * PAGE, len);
        uint32_t atime = 0, rtime = 0;
        for (uint64_t k = 0; k < m; k++) {
            const PackPage *q = &pp[good[g + k]];
            atime = q->atime > atime ? q->atime : atime; /* the pages keep their age */
            rtime = q->rtime > rtime ? q->rtime : rtime; /* and their last read */
            release(t, q->blob);
        }
        /* a row the warm pages just freed: the frames fill the table from below */
        int64_t *bs = t->blob_state;
        uint32_t blob = (uint32_t)bs[BLOB_FREE_HEAD];
        bs[BLOB_FREE_HEAD] = t->arena[blob];
        t->arena[blob] = a;
        t->cell[blob] = cell;
        t->length[blob] = (uint16_t)len;
        t->pages[blob] = (uint8_t)m;
        t->codec[blob] = CODEC_ZSTD;
        t->dict_id[blob] = 0;
        t->ref[blob] = (uint32_t)m;
        t->tier[blob] = TIER_POOL;
        t->atime[blob] = atime;
        t->rtime[blob] = rtime;
        /* a frame: its stored bytes (zstd checks the content); a page alone: the page */
        uint32_t csum = m > 1 ? (uint32_t)XXH3_64bits(out + good[g] * PAGE, len)
                              : page_csum(dec + good[g] * PAGE);
        t->csum[blob] = p->checksums ? csum : 0;
        t->form[blob] = FORM_DENSE;
        bs[BLOB_COUNT] += 1;
        for (uint64_t k = 0; k < m; k++) {
            const PackPage *q = &pp[good[g + k]];
            t->members[(uint64_t)blob * t->stride + k] = q->key;
            index_insert(t, p, q->key, blob << SUB_BITS | (uint32_t)k);
            /* announced first: a crash between the two stores is finished by recovery
             * (store.shared, SlotTable.switch) */
            t->slot_switch[0] = (int64_t)q->slot;
            t->slot_switch[1] = blob;
            t->slot_switch[2] = (int64_t)k;
            /* compiler barriers: the stores must reach memory in this order, a SIGKILL stops
             * the process between any two of them */
            __asm__ __volatile__("" ::: "memory");
            t->slot_switch[3] = 1;
            __asm__ __volatile__("" ::: "memory");
            t->handle[q->slot] = blob;
            t->sub[q->slot] = (uint8_t)k;
            __asm__ __volatile__("" ::: "memory");
            t->slot_switch[3] = 0;
        }
        t->codec_pages[CODEC_ZSTD] += (int64_t)m;
        r->switched += m;
    }
    for (uint64_t i = 0; i < n; i++) { /* unreadable: leave it to the reads (EIO) */
        const PackPage *q = &pp[i];
        if (q->bad && pack_unchanged(t, q->blob, q->gen, q->slot)) {
            t->form[q->blob] = FORM_DENSE;
            r->bad++;
        }
    }
    pthread_mutex_unlock(mu);
done:
    free(pp);
    free(in);
    free(dec);
    free(frame);
    free(out);
    free(outlen);
    return result;
}
