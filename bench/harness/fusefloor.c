/* The C floor: one in-memory file served over FUSE with libfuse3's low-level API.
 *
 *   cc -O2 -o fusefloor bench/harness/fusefloor.c $(pkg-config --cflags --libs fuse3)
 *   fusefloor MOUNTPOINT SIZE_BYTES [mt]
 *
 * Serves MOUNTPOINT/device (SIZE bytes, 0600) from a calloc'd buffer: read, write,
 * fallocate (punch/zero = memset 0), flush/fsync. Nothing else happens per request, so a
 * 4 KiB read through loop -> this file is the least any userspace chain can cost here
 * (bench/frontdoor.py, bench/latency.py). Single-threaded loop unless "mt".
 * Exits on unmount (umount/fusermount3 -u) or SIGTERM/SIGINT.
 */
#define FUSE_USE_VERSION 34
#include <fuse_lowlevel.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define FILE_INO 2
static char *data;
static off_t size;

static void fill(fuse_ino_t ino, struct stat *st)
{
    memset(st, 0, sizeof *st);
    st->st_ino = ino;
    if (ino == FUSE_ROOT_ID) {
        st->st_mode = S_IFDIR | 0700;
        st->st_nlink = 2;
    } else {
        st->st_mode = S_IFREG | 0600;
        st->st_nlink = 1;
        st->st_size = size;
        st->st_blksize = 4096;
    }
}

static void ff_init(void *ud, struct fuse_conn_info *conn)
{
    (void) ud;
    conn->max_write = 1 << 20;
    conn->max_read = 1 << 20; /* must equal the max_read mount option */
    if (conn->capable & FUSE_CAP_ASYNC_DIO)
        conn->want |= FUSE_CAP_ASYNC_DIO;
}

static void ff_lookup(fuse_req_t req, fuse_ino_t parent, const char *name)
{
    struct fuse_entry_param e;
    if (parent != FUSE_ROOT_ID || strcmp(name, "device") != 0) {
        fuse_reply_err(req, ENOENT);
        return;
    }
    memset(&e, 0, sizeof e);
    e.ino = FILE_INO;
    e.attr_timeout = e.entry_timeout = 1e6;
    fill(FILE_INO, &e.attr);
    fuse_reply_entry(req, &e);
}

static void ff_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    struct stat st;
    (void) fi;
    if (ino != FUSE_ROOT_ID && ino != FILE_INO) {
        fuse_reply_err(req, ENOENT);
        return;
    }
    fill(ino, &st);
    fuse_reply_attr(req, &st, 1e6);
}

static void ff_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    if (ino != FILE_INO) {
        fuse_reply_err(req, EISDIR);
        return;
    }
    fi->direct_io = 1;
    fuse_reply_open(req, fi);
}

static void ff_read(fuse_req_t req, fuse_ino_t ino, size_t n, off_t off,
                    struct fuse_file_info *fi)
{
    (void) ino; (void) fi;
    if (off >= size)
        n = 0;
    else if ((off_t) n > size - off)
        n = size - off;
    fuse_reply_buf(req, data + off, n);
}

static void ff_write(fuse_req_t req, fuse_ino_t ino, const char *buf, size_t n, off_t off,
                     struct fuse_file_info *fi)
{
    (void) ino; (void) fi;
    if (off + (off_t) n > size) {
        fuse_reply_err(req, ENOSPC);
        return;
    }
    memcpy(data + off, buf, n);
    fuse_reply_write(req, n);
}

static void ff_fallocate(fuse_req_t req, fuse_ino_t ino, int mode, off_t off, off_t len,
                         struct fuse_file_info *fi)
{
    (void) ino; (void) fi;
    if (off + len > size) {
        fuse_reply_err(req, EINVAL);
        return;
    }
    if (mode & (0x02 | 0x10)) /* PUNCH_HOLE, ZERO_RANGE */
        memset(data + off, 0, len);
    fuse_reply_err(req, 0);
}

static void ff_ok(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    (void) ino; (void) fi;
    fuse_reply_err(req, 0);
}

static void ff_fsync(fuse_req_t req, fuse_ino_t ino, int datasync, struct fuse_file_info *fi)
{
    (void) ino; (void) datasync; (void) fi;
    fuse_reply_err(req, 0);
}

static const struct fuse_lowlevel_ops ops = {
    .init = ff_init, .lookup = ff_lookup, .getattr = ff_getattr, .open = ff_open,
    .read = ff_read, .write = ff_write, .fallocate = ff_fallocate, .flush = ff_ok,
    .release = ff_ok, .fsync = ff_fsync,
};

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: %s MOUNTPOINT SIZE [mt]\n", argv[0]);
        return 2;
    }
    size = strtoll(argv[2], NULL, 0);
    data = calloc(1, size);
    if (!data)
        return 1;
    char *fargv[] = {argv[0], "-o", "allow_other,default_permissions,max_read=1048576", NULL};
    struct fuse_args args = FUSE_ARGS_INIT(3, fargv);
    struct fuse_session *se = fuse_session_new(&args, &ops, sizeof ops, NULL);
    if (!se || fuse_set_signal_handlers(se) != 0 || fuse_session_mount(se, argv[1]) != 0)
        return 1;
    int rc;
    if (argc > 3 && strcmp(argv[3], "mt") == 0) {
        struct fuse_loop_config cfg = {.clone_fd = 0, .max_idle_threads = 10};
        rc = fuse_session_loop_mt(se, &cfg);
    } else {
        rc = fuse_session_loop(se);
    }
    fuse_session_unmount(se);
    fuse_remove_signal_handlers(se);
    fuse_session_destroy(se);
    free(data);
    return rc ? 1 : 0;
}
