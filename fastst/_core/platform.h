/* What the operating system offers the compiled core, in one place: each call that
   only some systems have, behind its guard, with what the core does where it is
   missing. Linux has every one. macOS takes the fallbacks (`nox -s macos` compiles
   the core for it); Windows is not supported: the core reads with mmap, pread and
   POSIX threads throughout.

   The features the rest of the core tests, rather than testing systems:
   FASTST_CAN_WATCH        files watched for changes (inotify), not checked each batch
   FASTST_CAN_POPULATE     a map's pages read ahead in one call (MADV_POPULATE_READ,
                           Linux 5.14), by threads of the core's own
   FASTST_CAN_HUGE_PAGES   fresh arrays and cached spans in 2 MiB pages (MADV_HUGEPAGE)
   FASTST_CAN_DROP_CACHE   a file's cached pages dropped (POSIX_FADV_DONTNEED)

   What the Python layer finds out for itself, where Python tells it: the CPUs this
   process may use (os.sched_getaffinity, usable_cpus), O_DIRECT (Reader._open_direct),
   posix_fadvise(WILLNEED) (Reader._will_need) and free huge pages (/proc/buddyinfo). */
#ifndef FASTST_PLATFORM_H
#define FASTST_PLATFORM_H

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#ifdef __linux__
#include <sys/inotify.h>
#include <sys/vfs.h>
#define FASTST_CAN_WATCH 1
#elif defined(__APPLE__)
#include <sys/mount.h>
#include <sys/param.h>
#endif

#ifdef MADV_POPULATE_READ
#define FASTST_CAN_POPULATE 1
#endif
#ifdef MADV_HUGEPAGE
#define FASTST_CAN_HUGE_PAGES 1
#endif
#ifdef POSIX_FADV_DONTNEED
#define FASTST_CAN_DROP_CACHE 1
#endif

/* What a read of a file's bytes will be like, told to the kernel (fastst_advise_file). */
enum {
    FASTST_ADVISE_NORMAL,          /* forget what was said: the default read-ahead */
    FASTST_ADVISE_SEQUENTIAL,      /* read once, in order: a larger read-ahead */
    FASTST_ADVISE_DONTNEED         /* drop its cached pages */
};

/* Tell the kernel how bytes [offset, offset + length) of `fd` will be read (length 0:
   to the end of the file): posix_fadvise. 0 when told; an errno when the kernel
   refused, ENOSYS where the system takes no such advice (macOS), and nothing changes. */
static inline int fastst_advise_file(int fd, int64_t offset, int64_t length, int advice) {
#ifdef POSIX_FADV_NORMAL
    static const int codes[] = {POSIX_FADV_NORMAL, POSIX_FADV_SEQUENTIAL,
                                POSIX_FADV_DONTNEED};
    return posix_fadvise(fd, (off_t)offset, (off_t)length, codes[advice]);
#else
    (void)fd; (void)offset; (void)length; (void)advice;
    return ENOSYS;
#endif
}

/* The magic number of the file system holding `path`, as Linux's statfs gives it in
   f_type (linux/magic.h; it fits 32 bits): on macOS, its name (f_fstypename) told by the
   number Linux gives the same kind, for the kinds whose reads cross a network or a
   daemon, and 0 for the others. 0 where the system tells nothing; -1 with errno set
   where the path cannot be looked up. */
static inline int64_t fastst_file_system_type(const char *path) {
#ifdef __linux__
    struct statfs info;
    if (statfs(path, &info) != 0) return -1;
    return (int64_t)(uint32_t)info.f_type;
#elif defined(__APPLE__)
    static const struct { const char *name; int64_t linux_magic; } kinds[] = {
        {"nfs", 0x6969}, {"smbfs", 0xFE534D42},
        {"macfuse", 0x65735546}, {"osxfuse", 0x65735546}};   /* FUSE 4, and 3 */
    struct statfs info;
    size_t k;
    if (statfs(path, &info) != 0) return -1;
    for (k = 0; k < sizeof kinds / sizeof kinds[0]; k++)
        if (strncmp(info.f_fstypename, kinds[k].name, sizeof info.f_fstypename) == 0)
            return kinds[k].linux_magic;
    return 0;
#else
    (void)path;
    return 0;
#endif
}

/* Whether the file open as `fd` is on a local file system whose changes inotify
   reports whoever makes them (a network file system's made elsewhere go unreported):
   ext2-4, XFS, Btrfs, tmpfs, F2FS, overlayfs, ZFS, bcachefs, SquashFS, EROFS. 0 where
   files cannot be watched. */
static inline int fastst_watchable(int fd) {
#ifdef FASTST_CAN_WATCH
    static const unsigned long local[] = {
        0xEF53, 0x58465342, 0x9123683E, 0x01021994, 0xF2F52010, 0x794C7630,
        0x2FC12FC1, 0xCA451A4E, 0x73717368, 0xE0F5E1E2};
    struct statfs about;
    size_t k;
    if (fstatfs(fd, &about) != 0) return 0;
    for (k = 0; k < sizeof local / sizeof local[0]; k++)
        if ((unsigned long)about.f_type == local[k]) return 1;
#else
    (void)fd;
#endif
    return 0;
}

/* Read into `parts` from `offset` of `fd` only what the page cache holds, never waiting
   for a disk: preadv2 with RWF_NOWAIT (Linux 4.14). The bytes read, which may be fewer
   than asked; -EAGAIN where the first of them would wait; -ENOSYS where the system
   cannot be asked so (macOS), and nothing is read. */
static inline ssize_t fastst_pread_cached(int fd, const struct iovec *parts, int count,
                                          int64_t offset) {
#if defined(__linux__) && defined(RWF_NOWAIT)
    ssize_t got = preadv2(fd, parts, count, (off_t)offset, RWF_NOWAIT);
    return got < 0 ? -errno : got;
#else
    (void)fd; (void)parts; (void)count; (void)offset;
    return -ENOSYS;
#endif
}

/* Which pages of [start, start + length) (start on a page boundary) the page cache
   holds: bit 0 of `resident`'s byte for each page. 0, or -1 with errno set. (macOS
   declares the bytes as char, Linux as unsigned char.) */
static inline int fastst_mincore(void *start, size_t length, unsigned char *resident) {
    return mincore(start, length, (void *)resident);
}

/* Name the calling thread, as tools that list threads show it (from itself: naming
   another thread goes through /proc on Linux, and is not possible on macOS). */
static inline void fastst_name_thread(const char *name) {
#ifdef __linux__
    pthread_setname_np(pthread_self(), name);
#elif defined(__APPLE__)
    pthread_setname_np(name);
#else
    (void)name;
#endif
}

#endif
