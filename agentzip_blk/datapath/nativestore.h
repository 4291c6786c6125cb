/* The store's books as the native request path sees them (docs/ARCHITECTURE.md, "The
 * native request path"): the same numpy columns Python uses, by address, and the few
 * operations a warm read or write needs on them. Everything here runs with the store lock
 * held (StoreLock's mutex) unless its comment says otherwise, and never with the GIL.
 *
 * Each operation mirrors one Python function, named in its comment; the model tests run
 * both paths over the same requests (tests/datapath/test_native.py), so a change to one
 * side must be made to the other.
 */
#ifndef AGENTZIP_NATIVESTORE_H
#define AGENTZIP_NATIVESTORE_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define PAGE 4096
#define MAX_IO (1 << 20)
#define MAX_PAGES (MAX_IO / PAGE)

/* slot kinds, blob tiers and forms, codec ids: agentzip_blk.store.slots / blobs,
 * codec.codecs */
#define KIND_EMPTY 0
#define KIND_SAME 1
#define KIND_BLOB 2
#define TIER_POOL 0
#define TIER_DISK 1
#define FORM_DENSE 0
#define FORM_WARM 1
#define MAX_FRAME_PAGES 16 /* config.MAX_FRAME_PAGES */
#define FRAME_BYTES (MAX_FRAME_PAGES * PAGE)
#define CODEC_RAW 0
#define CODEC_ZSTD 1
#define CODEC_LZ4 2
#define CODEC_LZ4HC 3
#define MAX_COMPRESSED 3072 /* codecs.MAX_COMPRESSED: above this a page is stored raw */
#define FRAME_HEADERS 64 /* codecs._FRAME_HEADERS (codecs.alone_may_pay) */
#define CHUNK_SLOTS 512     /* slots.CHUNK_SLOTS */
#define TICK_MASK 0xFFFF
#define TICK_REBASE (1LL << 31)
#define TICKS_PER_SECOND 100

/* state arrays: store.blobs, store.slots, store.dedup, store.pool */
#define BLOB_FREE_HEAD 0
#define BLOB_NEXT_UNUSED 1
#define BLOB_COUNT 2
#define INDEX_COUNT 0
#define INDEX_TOMBSTONES 1
#define INDEX_UNINDEXED 2
#define INDEX_STARVED 3
#define POOL_ALLOCATED 0
#define POOL_RESIDENT 1
#define POOL_LIVE_BYTES 2
#define POOL_LIVE_CELLS 3
#define POOL_ARENAS 4
#define POOL_IDS 5
#define POOL_FREE_ID 6
#define POOL_MAX_SIZE 7
#define POOL_MEMFD 8 /* the arenas' memfd: arena id a maps at a * POOL_SPAN (store.pool) */
#define POOL_SPAN 9
#define POOL_STATE_ITEMS 10 /* pool.STATE_ITEMS: what bind() must find in pool_state */
#define ARENA_PARTIAL 1
#define ARENA_EVACUATING 2

/* Disk extents that native writes freed (Objects.release of a disk blob: a slot written
 * again), for Python to give back to the tier's books (DiskTier.settle -> DiskTier.free)
 * under the lock: the tier's free map is Python's. A write whose disk blobs would not fit
 * is Python's (UP_WRITE_DISK). */
#define DISK_FREES 4096
typedef struct {
    uint64_t off[DISK_FREES];
    uint32_t len[DISK_FREES];
    uint32_t n;
} DiskFrees;

typedef struct {
    /* slot table (store.slots) */
    uint8_t *kind;
    uint32_t *handle;
    uint8_t *sub;
    uint16_t *srtime;
    uint64_t nslots;
    int32_t *chunk_live;
    uint8_t *chunk_touched;
    uint8_t *chunk_written;
    uint64_t nchunks;
    int64_t *slot_state; /* same_pages */
    int64_t *slot_switch; /* a slot switched outside a request (store.shared SWITCH_*) */
    uint64_t *words; /* same-fill words by id (store.slots.SameWords), id 0 the zero word */
    uint64_t nwords;
    /* blob table (store.blobs) */
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
    uint32_t *gen;
    uint8_t *form;
    uint64_t *disk_off; /* a disk blob's extent in the tier file */
    DiskFrees *disk_frees; /* the Path's queue (bind) */
    uint32_t *members; /* nblobs rows of `stride` keys */
    uint32_t stride;
    uint64_t nblobs;
    int64_t *blob_state;
    /* dedup index (store.dedup) */
    uint16_t *fps;
    uint32_t *vals;
    uint64_t icap;
    int64_t *index_state;
    /* pool (store.pool) */
    uint64_t *a_addr;
    int16_t *a_class;
    int32_t *a_used;
    uint32_t *a_free_head;
    uint32_t *a_bump;
    int32_t *a_next;
    int32_t *a_prev;
    uint8_t *a_flags;
    uint64_t narenas;
    uint32_t *class_cell;
    uint32_t *class_cells;
    uint32_t *class_arena;
    int32_t *class_head;
    uint64_t nclasses;
    uint64_t first_large; /* the first class above MAX_COMPRESSED */
    int64_t *pool_state;
    /* store.objects: slot references per codec id */
    int64_t *codec_pages;
    uint64_t ncodecs;
} Tables;

/* What the write path needs to know besides the tables (set by Python, under the lock). */
typedef struct {
    int enabled;         /* native writes may serve (warm lz4, or dense frames: `dense`) */
    int dense;           /* warm_algorithm none: new pages go into zstd frames at once */
    int frame_pages;     /* compression.frame_pages (dense) */
    int level;           /* compression.level (dense: zstd) */
    int dedup;           /* compression.dedup */
    int checksums;       /* store.integrity.CHECKSUMS */
    uint64_t seed;       /* dedup.PageHasher's seed */
    int64_t hot_ticks;   /* policy.hot_threshold_ms in ticks (ping-pong) */
    int64_t reclaim_bytes;
    uint64_t max_blobs;  /* dedup.MAX_BLOBS */
    int doorbell;        /* the maintainer's eventfd (store.doorbell), or -1 */
} WriteParams;

/* The disk tier as a read needs it (store.disk.DiskTier; set by Python under the lock):
 * a disk blob's extent is read with pread(2) after the lock, opened with AES-256-GCM
 * (nonce, ciphertext, tag; the associated data names its offset, length, blob and
 * generation, so an extent freed and reused meanwhile fails to open and the request goes to
 * Python, which reads it again), then decoded as a pool blob is. */
#define DISK_NONCE 12
#define DISK_TAG 16
#define DISK_KEY 32
typedef struct {
    int fd;                 /* the tier file, or -1: every disk read is Python's */
    int sealed;             /* extents are encrypted (disk.ENCRYPT) */
    uint32_t overhead;      /* DISK_NONCE + DISK_TAG when sealed, else 0 */
    uint8_t key[DISK_KEY];
} DiskParams;

/* A dictionary the native side decodes with (codec.dictionaries: a blob names it by its id,
 * 1..255). Python registers each one's content (set_dictionary) and keeps the bytes alive;
 * the digested form is made on the first read that needs it. An entry, once published, is
 * never freed while the Path lives (an unregistered one is only unpublished): a read that
 * planned with it under the lock decodes with it after the lock. */
#define MAX_DICTS 256
typedef struct {
    const void *content;
    size_t len;
    int full;                   /* a trained dictionary (codecs.DICT_KINDS "full"), or raw */
    _Atomic(void *) ddict;      /* ZSTD_DDict, made once (a race frees the loser's) */
} DictEntry;

/* Why a request was handed up to Python, for the counters. */
enum {
    UP_UNBOUND,     /* tables not bound, or a tick rebase is due */
    UP_SHAPE,       /* not whole pages in the device, or not a READ/WRITE this path serves */
    UP_READ_BLOB,   /* a read of a dictionary blob, a bad word id, a disk blob whose
                       extent did not open (moved, or a disk error) */
    UP_CORRUPT,     /* a checksum or codec failure: Python counts it and answers EIO */
    UP_WRITE_WORD,  /* a write of a same-filled page other than zero, or over one */
    UP_WRITE_DISK,  /* a write over disk blobs while the freed-extent queue is full */
    UP_WRITE_DEDUP, /* a dedup candidate the native side cannot compare (frame, disk) */
    UP_WRITE_ROOM,  /* the pool at its cap (the disk tier is Python's), or the blob table or
                       the arena books full until the maintainer grows them */
    UP_REASONS
};

typedef struct {
    atomic_ullong reads, pages_read, bytes_read;
    atomic_ullong writes, pages_written, bytes_written;
    atomic_ullong dedup_hits, dedup_compares, hash_collisions, pingpong;
    atomic_ullong units_written, unit_fallbacks, units_incompressible;
    atomic_ullong handed_up[UP_REASONS];
    atomic_llong last_ring; /* the tick of the last doorbell ring */
} StoreCounters;

/* Served, or handed up with the reason; both leave the store's books whole. */
#define SERVED (-1)
/* native_read: a frame it needs is being decoded by another request; wait, then ask again */
#define READ_WAIT (-2)

int64_t store_now(double t0, int64_t tick_base);

/* Decoded dense frames, for the reads of their other pages (the kernel reads a frame's pages
 * one request after another): store.objects' frame cache, on the native side. Under the
 * store lock; its memory is one mapping, and an entry idle for `idle` seconds gives its
 * pages back (MADV_DONTNEED). */
#define FRAME_CACHE_ENTRIES 32
/* Frames being decoded now, by the request that took them: readahead sends a frame's
 * neighbouring pages in concurrent requests, which wait for its copy instead of decoding
 * the same frame again (objects.Decoding on the Python side). */
#define MAX_DECODING 16
typedef struct {
    uint8_t *data; /* FRAME_CACHE_ENTRIES * FRAME_BYTES, mapped on first use */
    uint32_t blob[FRAME_CACHE_ENTRIES];
    uint32_t gen[FRAME_CACHE_ENTRIES];
    uint8_t valid[FRAME_CACHE_ENTRIES];
    uint8_t resident[FRAME_CACHE_ENTRIES]; /* its pages were written since the last drop */
    double used[FRAME_CACHE_ENTRIES];
    uint32_t dec_blob[MAX_DECODING];
    uint32_t dec_gen[MAX_DECODING];
    uint8_t dec_active[MAX_DECODING];
    uint64_t hits, misses, waits;
} FrameCache;

/* A read's frames to decode after the lock (at most one per page of the request). */
typedef struct {
    uint32_t blob, gen, csum;
    uint16_t pages;
    uint32_t len;
    uint32_t at;        /* offset of its stored bytes in the request's scratch */
    uint8_t codec;
    uint8_t on_disk;    /* read from disk_off after the lock, into scratch at `at` */
    uint64_t disk_off;
    DictEntry *dict;    /* zstd with a dictionary, or NULL */
    int16_t decoding;   /* its entry in FrameCache.dec_*, or -1 */
} FrameJob;

typedef struct {
    FrameJob jobs[MAX_PAGES];
    uint32_t njobs;
    int16_t job_of[MAX_PAGES]; /* per page of the request: its job, or -1 */
    uint8_t sub_of[MAX_PAGES];
} ReadPlan;

int native_read(const Tables *t, FrameCache *fc, const DiskParams *disk,
                _Atomic(DictEntry *) *dicts, int checksums, int64_t now, uint64_t first,
                uint64_t count, uint8_t *out, ReadPlan *plan, uint8_t *scratch, size_t room);
int finish_read(const ReadPlan *plan, const DiskParams *disk, uint8_t *scratch, int checksums,
                void *dctx, void *evp, uint8_t *frame, uint8_t *out, uint64_t count);
void cache_frames(const Tables *t, FrameCache *fc, const ReadPlan *plan, const uint8_t *frames,
                  int nframes);
void end_decoding(FrameCache *fc, const ReadPlan *plan);
void frame_cache_drop_idle(FrameCache *fc, double idle);
uint64_t frame_cache_bytes(const FrameCache *fc);

/* The recompressor's native core (store.recompress.Recompressor.pass_once for blobs held by
 * one slot each): `n` warm blobs in slot order, each with the generation and slot the
 * Python pick saw. It takes the lock itself (twice) and compresses between. */
typedef struct {
    uint64_t switched, raced, bad, kept;
} PackResult;

int native_pack(Tables *t, const WriteParams *p, void *lock, const uint32_t *blobs,
                const uint32_t *gens, const uint64_t *slots, uint64_t n, int frame_pages,
                void *cctx, void *dctx, PackResult *r);

/* Per request, before the lock: what each page is (same-filled, a repeat of an earlier
 * page, or to be stored compressed). */
typedef struct {
    const uint8_t *page; /* the bytes the kernel wrote */
    uint8_t same;      /* zero-filled */
    int16_t repeat_of; /* an earlier page of the request with equal bytes, or -1 */
    uint64_t lo, hi;   /* keyed hash (dedup.PageHasher) */
    uint32_t key;      /* dedup.index_key(lo) */
    uint16_t len;      /* stored bytes */
    uint8_t codec;     /* CODEC_LZ4, or CODEC_RAW when compression does not pay */
    uint32_t csum;
    const uint8_t *stored;
    uint8_t found;     /* dense: found stored at the last try, so in no frame */
    /* placed under the lock */
    uint32_t blob;
    uint8_t sub;
} WritePage;

/* Dense writes (warm_algorithm none): the request's new pages in frames of frame_pages, as
 * Placer.prepare groups them; a group of one, or one whose frame does not pay, is stored
 * page by page (each in `pages`). */
typedef struct {
    uint16_t m;                    /* pages */
    uint16_t pos[MAX_FRAME_PAGES]; /* their places in the request */
    uint32_t len;                  /* the frame's bytes; 0: stored page by page */
    const uint8_t *stored;
    uint32_t csum;
    uint8_t incompressible;        /* stored page by page, raw: the frame did not compress */
} WriteGroup;

typedef struct {
    WritePage pages[MAX_PAGES];
    WriteGroup groups[MAX_PAGES];
    uint32_t ngroups;
    uint8_t *scratch;     /* page i's stored bytes at i * PAGE; a frame's from its first
                           * page's place, up to zstd's bound (nativeloop.c WRITE_SCRATCH) */
    void *lz4;            /* an LZ4_stream_t's room */
    void *cctx_frame;     /* ZSTD_CCtx for frames (dense), for pages alone */
    void *cctx_page;
    uint8_t *frame;       /* FRAME_BYTES: a group's pages, contiguous */
    void *dctx;           /* ZSTD_DCtx and FRAME_BYTES for dedup comparisons with frames */
    uint8_t *dec;
} WritePlan;

/* native_write, dense: a page found stored that is in a frame (or one found before that is
 * not found now): the groups change; prepare again (the marks kept), then write again */
#define WRITE_REGROUP (-3)

int prepare_write(const WriteParams *p, const uint8_t *data, uint64_t count, WritePlan *plan);
int native_write(Tables *t, FrameCache *fc, const WriteParams *p, StoreCounters *c,
                 int64_t now, uint64_t first, uint64_t count, WritePlan *plan);
void ring_doorbell(const WriteParams *p, StoreCounters *c, int64_t now);

#endif
