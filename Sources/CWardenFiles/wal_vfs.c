// A SQLite VFS over the unix one that gathers a connection's WAL writes into one write per
// commit. SQLite writes each WAL frame as two `pwrite`s (its 24-byte header, then its page):
// with about eighty frames a commit, a hundred and sixty system calls, each paying the
// kernel's whole write path. Gathered, a commit is one call for each 124 KiB.
//
// Only a WAL explicitly linked to its connection's database file (`warden_wal_link`) is
// gathered; every other file, and every call but a WAL's writes, goes straight to the unix VFS,
// whose file objects (and so its locks and shared memory) stay exactly as SQLite makes them.
// The connection must use SQLite's normal locking mode, in which every transaction takes and
// releases the WAL's write lock through the database file's shared-memory locks.
//
// What is gathered is one run of contiguous bytes that extends what the transaction wrote,
// later than everything already written. It goes to the file:
// - once a commit frame is whole (a frame's header names the database's size only in a
//   transaction's last frame), so that the commit is in the file before SQLite publishes it in
//   the WAL index, and a failure is reported to the write that completes the commit;
// - before SQLite publishes anything in the WAL index (the database file's shared-memory
//   barrier) and before the connection takes or releases any WAL lock but the write lock;
// - before any other call on the WAL (a read, a sync, its size, a truncation), and before a
//   write that does not continue the run.
// A write over bytes the transaction already wrote (SQLite rewrites a page it spilled, or the
// frames' checksums) goes to the file at once, after what is gathered.
//
// What is still gathered when the write lock is released belongs to a transaction that did not
// commit (a commit's bytes went to the file before it was published), and is dropped: nothing
// of a transaction reaches the file once another writer may have the lock. A write that fails
// drops what was gathered, and every later write of the transaction fails too (and every read
// of what it wrote): a failed transaction's frames never reach the file later, where a
// recovery of the WAL would take a whole commit among them for one.

#include <sqlite3.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "CWardenFiles.h"

#define WAL_FRAME_HEADER 24
#define WAL_WRITE_LOCK 0
// The unix VFS writes at most 128 KiB less one byte in a call (it masks larger lengths: a
// length of exactly 128 KiB writes nothing and reads as a full disk).
#define GATHERED_BYTES (124 * 1024)
#define ROUND8(n) (((n) + 7) & ~(size_t)7)

typedef struct WardenFile WardenFile;
struct WardenFile {
    sqlite3_file base;
    sqlite3_file *real;
    int isWAL;
    /// A database file: its connection's WAL, while linked.
    WardenFile *wal;
    /// A WAL: the database file it is linked to (writes are gathered only while linked).
    WardenFile *database;
    unsigned char *gathered;
    sqlite3_int64 start;
    int length;
    /// The last write was a commit frame's header: its page completes the commit.
    int commitFrameOpen;
    /// Where the bytes the current transaction wrote begin (-1 before its first write) and end
    /// (it began when the write lock was taken).
    sqlite3_int64 first;
    sqlite3_int64 written;
    /// A write of the current transaction failed with this code; 0 if none.
    int failed;
    /// Tests: writes to fail, with which code.
    int failWrites;
    int failCode;
    WardenWALCounts counts;
};

static sqlite3_vfs wardenVFS;
static const sqlite3_io_methods wardenMethods;

#define REAL(file) (((WardenFile *)(file))->real)

// One write to the file. A failure drops what is gathered and fails the transaction's later writes.
static int writeOut(WardenFile *wal, const void *data, int amount, sqlite3_int64 offset) {
    wal->counts.made++;
    int rc;
    if (wal->failWrites > 0) {
        wal->failWrites--;
        rc = wal->failCode;
    } else {
        rc = wal->real->pMethods->xWrite(wal->real, data, amount, offset);
    }
    if (rc != SQLITE_OK) {
        wal->failed = rc;
        wal->counts.dropped += wal->length;
        wal->length = 0;
        wal->commitFrameOpen = 0;
    }
    return rc;
}

static int flushGathered(WardenFile *wal) {
    if (wal->failed) return wal->failed;
    if (wal->length == 0) return SQLITE_OK;
    int rc = writeOut(wal, wal->gathered, wal->length, wal->start);
    if (rc == SQLITE_OK) wal->length = 0;
    return rc;
}

// A new transaction (the write lock taken), or none (released): nothing of an earlier one is
// kept or reported.
static void startTransaction(WardenFile *wal) {
    wal->counts.dropped += wal->length;
    wal->length = 0;
    wal->commitFrameOpen = 0;
    wal->first = -1;
    wal->written = 0;
    wal->failed = 0;
}

// Where the transaction's writes reach: a write, gathered or made.
static void extend(WardenFile *wal, sqlite3_int64 offset, sqlite3_int64 end) {
    if (wal->first < 0 || offset < wal->first) wal->first = offset;
    if (end > wal->written) wal->written = end;
}

// Before another call on the file: what is gathered goes first.
static int settle(WardenFile *file) {
    return file && file->length > 0 ? flushGathered(file) : SQLITE_OK;
}

static void unlink_(WardenFile *file) {
    if (file->wal) file->wal->database = NULL;
    if (file->database) file->database->wal = NULL;
    file->wal = NULL;
    file->database = NULL;
}

// ---- file methods

static int wClose(sqlite3_file *file) {
    WardenFile *f = (WardenFile *)file;
    // SQLite closes the WAL outside any transaction: what is gathered then is a transaction's
    // that did not commit.
    if (f->wal) startTransaction(f->wal);
    if (f->isWAL) startTransaction(f);
    unlink_(f);
    sqlite3_free(f->gathered);
    f->gathered = NULL;
    return f->real->pMethods->xClose(f->real);
}

static int wRead(sqlite3_file *file, void *data, int amount, sqlite3_int64 offset) {
    WardenFile *f = (WardenFile *)file;
    // After a failed write, what the transaction wrote may not be in the file: SQLite may go on
    // after some failures (a statement's), and must not read older bytes for its frames.
    if (f->failed && f->first >= 0 && offset + amount > f->first) return f->failed;
    int rc = settle(f);
    if (rc != SQLITE_OK) return rc;
    return REAL(file)->pMethods->xRead(REAL(file), data, amount, offset);
}

static int wWrite(sqlite3_file *file, const void *data, int amount, sqlite3_int64 offset) {
    WardenFile *f = (WardenFile *)file;
    if (!f->database) return f->real->pMethods->xWrite(f->real, data, amount, offset);
    if (f->failed) return f->failed;
    f->counts.received++;
    sqlite3_int64 end = offset + amount;
    int rc;
    if (end <= f->written || amount > GATHERED_BYTES) {
        // Over bytes this transaction wrote: after what is gathered, at once.
        if ((rc = flushGathered(f)) != SQLITE_OK) return rc;
        if (end <= f->written) f->counts.rewrites++;
        extend(f, offset, end);
        return writeOut(f, data, amount, offset);
    }
    if (f->length > 0 && (offset != f->start + f->length || amount > GATHERED_BYTES - f->length)) {
        if ((rc = flushGathered(f)) != SQLITE_OK) return rc;
    }
    if (!f->gathered && !(f->gathered = sqlite3_malloc(GATHERED_BYTES))) {
        extend(f, offset, end);
        return writeOut(f, data, amount, offset);
    }
    if (f->length == 0) f->start = offset;
    memcpy(f->gathered + f->length, data, (size_t)amount);
    f->length += amount;
    extend(f, offset, end);
    if (f->commitFrameOpen) {
        f->commitFrameOpen = 0;
        return flushGathered(f);
    }
    // A frame's header: bytes 4–7 hold the database's size in pages after a commit, and 0 in
    // every other frame.
    const unsigned char *header = data;
    if (amount == WAL_FRAME_HEADER && (header[4] | header[5] | header[6] | header[7]) != 0) f->commitFrameOpen = 1;
    return SQLITE_OK;
}

static int wTruncate(sqlite3_file *file, sqlite3_int64 size) {
    int rc = settle((WardenFile *)file);
    if (rc != SQLITE_OK) return rc;
    return REAL(file)->pMethods->xTruncate(REAL(file), size);
}

static int wSync(sqlite3_file *file, int flags) {
    WardenFile *f = (WardenFile *)file;
    int rc = settle(f);
    if (rc == SQLITE_OK) rc = settle(f->wal);
    if (rc != SQLITE_OK) return rc;
    return f->real->pMethods->xSync(f->real, flags);
}

static int wFileSize(sqlite3_file *file, sqlite3_int64 *size) {
    int rc = settle((WardenFile *)file);
    if (rc != SQLITE_OK) return rc;
    return REAL(file)->pMethods->xFileSize(REAL(file), size);
}

static int wLock(sqlite3_file *file, int lock) { return REAL(file)->pMethods->xLock(REAL(file), lock); }
static int wUnlock(sqlite3_file *file, int lock) { return REAL(file)->pMethods->xUnlock(REAL(file), lock); }
static int wCheckReservedLock(sqlite3_file *file, int *out) {
    return REAL(file)->pMethods->xCheckReservedLock(REAL(file), out);
}

static int wFileControl(sqlite3_file *file, int op, void *arg) {
    int rc = settle((WardenFile *)file);
    if (rc != SQLITE_OK) return rc;
    if (op == SQLITE_FCNTL_VFSNAME) {
        // The unix VFS's answer, prefixed with ours, as SQLite's own shims do.
        int found = REAL(file)->pMethods->xFileControl(REAL(file), op, arg);
        if (found == SQLITE_OK && *(char **)arg) {
            char *inner = *(char **)arg;
            *(char **)arg = sqlite3_mprintf("%s/%z", wardenVFS.zName, inner);
        } else if (found == SQLITE_NOTFOUND) {
            *(char **)arg = sqlite3_mprintf("%s", wardenVFS.zName);
            found = SQLITE_OK;
        }
        return found;
    }
    return REAL(file)->pMethods->xFileControl(REAL(file), op, arg);
}

static int wSectorSize(sqlite3_file *file) { return REAL(file)->pMethods->xSectorSize(REAL(file)); }
static int wDeviceCharacteristics(sqlite3_file *file) {
    return REAL(file)->pMethods->xDeviceCharacteristics(REAL(file));
}

static int wShmMap(sqlite3_file *file, int region, int size, int extend, void volatile **out) {
    return REAL(file)->pMethods->xShmMap(REAL(file), region, size, extend, out);
}

static int wShmLock(sqlite3_file *file, int offset, int n, int flags) {
    WardenFile *f = (WardenFile *)file;
    WardenFile *wal = f->wal;
    int writeLock = wal && offset == WAL_WRITE_LOCK && (flags & SQLITE_SHM_EXCLUSIVE);
    if (writeLock && (flags & SQLITE_SHM_UNLOCK)) {
        startTransaction(wal);
    } else if (wal && wal->length > 0) {
        wal->counts.late++;
        int rc = flushGathered(wal);
        if (rc != SQLITE_OK && (flags & SQLITE_SHM_LOCK)) return rc;
    }
    int rc = f->real->pMethods->xShmLock(f->real, offset, n, flags);
    if (writeLock && (flags & SQLITE_SHM_LOCK) && rc == SQLITE_OK) startTransaction(wal);
    return rc;
}

static void wShmBarrier(sqlite3_file *file) {
    WardenFile *f = (WardenFile *)file;
    WardenFile *wal = f->wal;
    if (wal && wal->length > 0) {
        wal->counts.late++;
        if (flushGathered(wal) != SQLITE_OK) {
            // SQLite may be publishing these frames in the WAL index, and this call cannot tell
            // it they are not in the file: readers would take what is there for them. Stopping
            // keeps the ledger whole (as a failed sync of the WAL does); a restart recovers the
            // index from the WAL's own checksums.
            fprintf(stderr, "warden: cannot write SQLite WAL frames before they are published; stopping\n");
            abort();
        }
    }
    if (wal) wal->commitFrameOpen = 0;
    f->real->pMethods->xShmBarrier(f->real);
}

static int wShmUnmap(sqlite3_file *file, int deleteFlag) {
    WardenFile *f = (WardenFile *)file;
    // The WAL index is let go with the WAL, outside any transaction.
    if (f->wal) startTransaction(f->wal);
    return f->real->pMethods->xShmUnmap(f->real, deleteFlag);
}

static int wFetch(sqlite3_file *file, sqlite3_int64 offset, int amount, void **out) {
    int rc = settle((WardenFile *)file);
    if (rc != SQLITE_OK) return rc;
    return REAL(file)->pMethods->xFetch(REAL(file), offset, amount, out);
}

static int wUnfetch(sqlite3_file *file, sqlite3_int64 offset, void *page) {
    return REAL(file)->pMethods->xUnfetch(REAL(file), offset, page);
}

static const sqlite3_io_methods wardenMethods = {
    3, wClose, wRead, wWrite, wTruncate, wSync, wFileSize, wLock, wUnlock, wCheckReservedLock,
    wFileControl, wSectorSize, wDeviceCharacteristics, wShmMap, wShmLock, wShmBarrier, wShmUnmap,
    wFetch, wUnfetch,
};

// ---- VFS methods: the unix VFS's, with its own object

#define INNER ((sqlite3_vfs *)wardenVFS.pAppData)

static int vOpen(sqlite3_vfs *vfs, sqlite3_filename name, sqlite3_file *file, int flags, int *outFlags) {
    (void)vfs;
    WardenFile *f = (WardenFile *)file;
    memset(f, 0, sizeof *f);
    f->real = (sqlite3_file *)((char *)f + ROUND8(sizeof(WardenFile)));
    f->first = -1;
    int rc = INNER->xOpen(INNER, name, f->real, flags, outFlags);
    if (f->real->pMethods == NULL) {
        f->base.pMethods = NULL;
        return rc;
    }
    if (f->real->pMethods->iVersion < 3) {
        // Every method is forwarded as version 3; the unix VFS has always been that.
        f->real->pMethods->xClose(f->real);
        f->base.pMethods = NULL;
        return SQLITE_CANTOPEN;
    }
    f->isWAL = (flags & SQLITE_OPEN_WAL) != 0;
    f->base.pMethods = &wardenMethods;
    return rc;
}

static int vDelete(sqlite3_vfs *v, const char *name, int syncDir) { (void)v; return INNER->xDelete(INNER, name, syncDir); }
static int vAccess(sqlite3_vfs *v, const char *name, int flags, int *out) { (void)v; return INNER->xAccess(INNER, name, flags, out); }
static int vFullPathname(sqlite3_vfs *v, const char *name, int n, char *out) { (void)v; return INNER->xFullPathname(INNER, name, n, out); }
static void *vDlOpen(sqlite3_vfs *v, const char *name) { (void)v; return INNER->xDlOpen(INNER, name); }
static void vDlError(sqlite3_vfs *v, int n, char *out) { (void)v; INNER->xDlError(INNER, n, out); }
static void (*vDlSym(sqlite3_vfs *v, void *handle, const char *symbol))(void) { (void)v; return INNER->xDlSym(INNER, handle, symbol); }
static void vDlClose(sqlite3_vfs *v, void *handle) { (void)v; INNER->xDlClose(INNER, handle); }
static int vRandomness(sqlite3_vfs *v, int n, char *out) { (void)v; return INNER->xRandomness(INNER, n, out); }
static int vSleep(sqlite3_vfs *v, int micros) { (void)v; return INNER->xSleep(INNER, micros); }
static int vCurrentTime(sqlite3_vfs *v, double *out) { (void)v; return INNER->xCurrentTime(INNER, out); }
static int vGetLastError(sqlite3_vfs *v, int n, char *out) { (void)v; return INNER->xGetLastError(INNER, n, out); }
static int vCurrentTimeInt64(sqlite3_vfs *v, sqlite3_int64 *out) { (void)v; return INNER->xCurrentTimeInt64(INNER, out); }
static int vSetSystemCall(sqlite3_vfs *v, const char *name, sqlite3_syscall_ptr call) { (void)v; return INNER->xSetSystemCall(INNER, name, call); }
static sqlite3_syscall_ptr vGetSystemCall(sqlite3_vfs *v, const char *name) { (void)v; return INNER->xGetSystemCall(INNER, name); }
static const char *vNextSystemCall(sqlite3_vfs *v, const char *name) { (void)v; return INNER->xNextSystemCall(INNER, name); }

static int registered = SQLITE_ERROR;
static pthread_once_t registration = PTHREAD_ONCE_INIT;

static void registerVFS(void) {
    sqlite3_vfs *inner = sqlite3_vfs_find("unix");
    if (!inner || inner->iVersion < 3) return;
    wardenVFS = (sqlite3_vfs){
        .iVersion = 3,
        .szOsFile = (int)(ROUND8(sizeof(WardenFile)) + (size_t)inner->szOsFile),
        .mxPathname = inner->mxPathname,
        .zName = WARDEN_WAL_VFS,
        .pAppData = inner,
        .xOpen = vOpen, .xDelete = vDelete, .xAccess = vAccess, .xFullPathname = vFullPathname,
        .xDlOpen = vDlOpen, .xDlError = vDlError, .xDlSym = vDlSym, .xDlClose = vDlClose,
        .xRandomness = vRandomness, .xSleep = vSleep, .xCurrentTime = vCurrentTime,
        .xGetLastError = vGetLastError, .xCurrentTimeInt64 = vCurrentTimeInt64,
        .xSetSystemCall = vSetSystemCall, .xGetSystemCall = vGetSystemCall, .xNextSystemCall = vNextSystemCall,
    };
    registered = sqlite3_vfs_register(&wardenVFS, 0);
}

int warden_wal_vfs_register(void) {
    pthread_once(&registration, registerVFS);
    return registered;
}

// The connection's database file and WAL, if both are this VFS's and the WAL is open.
static int linkedPair(sqlite3 *db, WardenFile **database, WardenFile **wal) {
    sqlite3_file *d = NULL, *w = NULL;
    if (sqlite3_file_control(db, "main", SQLITE_FCNTL_FILE_POINTER, &d) != SQLITE_OK || !d || d->pMethods != &wardenMethods)
        return 0;
    if (sqlite3_file_control(db, "main", SQLITE_FCNTL_JOURNAL_POINTER, &w) != SQLITE_OK || !w || w->pMethods != &wardenMethods)
        return 0;
    *database = (WardenFile *)d;
    *wal = (WardenFile *)w;
    return !(*database)->isWAL && (*wal)->isWAL;
}

int warden_wal_link(sqlite3 *db) {
    WardenFile *database, *wal;
    if (!linkedPair(db, &database, &wal)) return 0;
    if (database->wal && database->wal != wal) unlink_(database);
    if (wal->database && wal->database != database) unlink_(wal);
    database->wal = wal;
    wal->database = database;
    return 1;
}

int warden_wal_counts(sqlite3 *db, WardenWALCounts *counts) {
    WardenFile *database, *wal;
    if (!linkedPair(db, &database, &wal) || database->wal != wal) return 0;
    *counts = wal->counts;
    return 1;
}

int warden_wal_fail_writes(sqlite3 *db, int count, int code) {
    WardenFile *database, *wal;
    if (!linkedPair(db, &database, &wal) || database->wal != wal) return 0;
    wal->failWrites = count;
    wal->failCode = code;
    return 1;
}
