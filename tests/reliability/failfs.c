/* failfs: a FUSE passthrough of one directory that fails on command (tests only).
 *
 *   failfs SRC CTL MOUNTPOINT      (foreground, single-threaded)
 *
 * Every operation reads the small file CTL; each letter in it arms one fault:
 *   r  read     -> EIO        w  write     -> EIO        s  fsync -> EIO
 *   n  write and fallocate -> ENOSPC                     a  fallocate -> EIO
 * An empty or missing CTL means no faults. File data never touches the page cache
 * (direct_io), so a fault is seen by the very next read or write. */
#define FUSE_USE_VERSION 31
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <fuse.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

static const char *src_dir;
static const char *ctl_path;

static int armed(char fault)
{
    char buf[64];
    int fd = open(ctl_path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = 0;
    return strchr(buf, fault) != NULL;
}

static void real(char *out, const char *path)
{
    snprintf(out, PATH_MAX, "%s%s", src_dir, path);
}

static void *ff_init(struct fuse_conn_info *conn, struct fuse_config *cfg)
{
    (void) conn;
    cfg->direct_io = 1;
    cfg->kernel_cache = 0;
    cfg->attr_timeout = 0;
    cfg->entry_timeout = 0;
    cfg->negative_timeout = 0;
    return NULL;
}

static int ff_getattr(const char *path, struct stat *st, struct fuse_file_info *fi)
{
    char p[PATH_MAX];
    int r = fi ? fstat((int) fi->fh, st) : (real(p, path), lstat(p, st));
    return r < 0 ? -errno : 0;
}

static int ff_readdir(const char *path, void *buf, fuse_fill_dir_t fill, off_t off,
                      struct fuse_file_info *fi, enum fuse_readdir_flags flags)
{
    (void) off; (void) fi; (void) flags;
    char p[PATH_MAX];
    real(p, path);
    DIR *d = opendir(p);
    if (!d)
        return -errno;
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        fill(buf, e->d_name, NULL, 0, 0);
    closedir(d);
    return 0;
}

static int ff_mkdir(const char *path, mode_t mode)
{
    char p[PATH_MAX];
    real(p, path);
    return mkdir(p, mode) < 0 ? -errno : 0;
}

static int ff_unlink(const char *path)
{
    char p[PATH_MAX];
    real(p, path);
    return unlink(p) < 0 ? -errno : 0;
}

static int ff_rmdir(const char *path)
{
    char p[PATH_MAX];
    real(p, path);
    return rmdir(p) < 0 ? -errno : 0;
}

static int ff_create(const char *path, mode_t mode, struct fuse_file_info *fi)
{
    char p[PATH_MAX];
    real(p, path);
    int fd = open(p, fi->flags | O_CLOEXEC, mode);
    if (fd < 0)
        return -errno;
    fi->fh = (uint64_t) fd;
    fi->direct_io = 1;
    return 0;
}

static int ff_open(const char *path, struct fuse_file_info *fi)
{
    char p[PATH_MAX];
    real(p, path);
    int fd = open(p, fi->flags | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    fi->fh = (uint64_t) fd;
    fi->direct_io = 1;
    return 0;
}

static int ff_read(const char *path, char *buf, size_t size, off_t off,
                   struct fuse_file_info *fi)
{
    (void) path;
    if (armed('r'))
        return -EIO;
    ssize_t n = pread((int) fi->fh, buf, size, off);
    return n < 0 ? -errno : (int) n;
}

static int ff_write(const char *path, const char *buf, size_t size, off_t off,
                    struct fuse_file_info *fi)
{
    (void) path;
    if (armed('n'))
        return -ENOSPC;
    if (armed('w'))
        return -EIO;
    ssize_t n = pwrite((int) fi->fh, buf, size, off);
    return n < 0 ? -errno : (int) n;
}

static int ff_fsync(const char *path, int datasync, struct fuse_file_info *fi)
{
    (void) path;
    if (armed('s'))
        return -EIO;
    int r = datasync ? fdatasync((int) fi->fh) : fsync((int) fi->fh);
    return r < 0 ? -errno : 0;
}

static int ff_fallocate(const char *path, int mode, off_t off, off_t len,
                        struct fuse_file_info *fi)
{
    (void) path;
    if (armed('n'))
        return -ENOSPC;
    if (armed('a'))
        return -EIO;
    return fallocate((int) fi->fh, mode, off, len) < 0 ? -errno : 0;
}

static int ff_truncate(const char *path, off_t size, struct fuse_file_info *fi)
{
    char p[PATH_MAX];
    int r = fi ? ftruncate((int) fi->fh, size) : (real(p, path), truncate(p, size));
    return r < 0 ? -errno : 0;
}

static int ff_release(const char *path, struct fuse_file_info *fi)
{
    (void) path;
    close((int) fi->fh);
    return 0;
}

static int ff_statfs(const char *path, struct statvfs *st)
{
    (void) path;
    return statvfs(src_dir, st) < 0 ? -errno : 0;
}

static int ff_chmod(const char *path, mode_t mode, struct fuse_file_info *fi)
{
    char p[PATH_MAX];
    int r = fi ? fchmod((int) fi->fh, mode) : (real(p, path), chmod(p, mode));
    return r < 0 ? -errno : 0;
}

static int ff_utimens(const char *path, const struct timespec tv[2], struct fuse_file_info *fi)
{
    char p[PATH_MAX];
    int r = fi ? futimens((int) fi->fh, tv) : (real(p, path), utimensat(AT_FDCWD, p, tv, 0));
    return r < 0 ? -errno : 0;
}

static const struct fuse_operations ops = {
    .init = ff_init, .getattr = ff_getattr, .readdir = ff_readdir, .mkdir = ff_mkdir,
    .unlink = ff_unlink, .rmdir = ff_rmdir, .create = ff_create, .open = ff_open,
    .read = ff_read, .write = ff_write, .fsync = ff_fsync, .fallocate = ff_fallocate,
    .truncate = ff_truncate, .release = ff_release, .statfs = ff_statfs,
    .chmod = ff_chmod, .utimens = ff_utimens,
};

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: %s SRC CTL MOUNTPOINT\n", argv[0]);
        return 2;
    }
    src_dir = argv[1];
    ctl_path = argv[2];
    char *fargs[] = {argv[0], argv[3], "-f", "-s", NULL};
    return fuse_main(4, fargs, &ops, NULL);
}
