#ifndef CWARDEN_FILES_H
#define CWARDEN_FILES_H

/// Starts the writeback of a file's dirty pages, without waiting for it or flushing the disk's
/// cache (Linux `sync_file_range` with `SYNC_FILE_RANGE_WRITE`, which Swift's Glibc module
/// does not declare). 0, or -1 with errno set.
int warden_start_writeback(int fd);

struct sqlite3;

/// The name of the SQLite VFS that gathers a linked WAL's writes into one per commit (over the
/// unix VFS; see wal_vfs.c).
#define WARDEN_WAL_VFS "warden-wal"

/// Registers that VFS (once; not as the default). SQLITE_OK once registered.
int warden_wal_vfs_register(void);

/// Links a connection opened with that VFS to its open WAL, whose writes are then gathered.
/// 1 if linked; 0 if the connection's files are not that VFS's or its WAL is not open. Called on
/// the connection's own thread, outside any statement, for a connection in SQLite's normal
/// locking mode (each transaction takes and releases the WAL's write lock).
int warden_wal_link(struct sqlite3 *db);

/// What became of a linked WAL's writes.
typedef struct {
    /// Writes SQLite made.
    long long received;
    /// Writes made to the file (failed ones included).
    long long made;
    /// Gathered bytes written only when SQLite published frames or changed a lock (a commit's
    /// go to the file with its last frame).
    long long late;
    /// Writes over bytes their transaction had written (rewritten pages and checksums).
    long long rewrites;
    /// Bytes of transactions that did not commit (or whose write failed), dropped.
    long long dropped;
} WardenWALCounts;

/// A connection's linked WAL's counts. 1, or 0 if the connection has no linked WAL.
int warden_wal_counts(struct sqlite3 *db, WardenWALCounts *counts);

/// Tests: the next `count` writes to a connection's linked WAL fail with `code`, writing
/// nothing. 1, or 0 if the connection has no linked WAL.
int warden_wal_fail_writes(struct sqlite3 *db, int count, int code);

/// SQLite's page cache as this process has it (see page_cache.c, installed as it loads).
typedef struct {
    /// 1 once SQLite initialised its page cache through the one that keeps the number SQLite
    /// lends a page during a swap of two pages' numbers out of its default cache; 0 if SQLite
    /// was initialised before it could be installed, or is not initialised yet.
    int installed;
    /// Pages given the lent number (each swap of two pages' numbers gives one), in every
    /// connection whose pages are of the size asked for.
    long long swapsOfPageSize;
    /// Times the default cache was given the lent number for a page (then remembering it as
    /// its largest, and walking every page it holds at the end of the transaction).
    long long lentNumbersGiven;
} WardenPageCacheCounts;

/// The counts; `swapsOfPageSize` those of caches of `pageSize` bytes.
void warden_page_cache_counts(int pageSize, WardenPageCacheCounts *counts);

/// 1 if SQLite counts the memory it holds (a mutex taken at every allocation and free; see
/// memory_count.c, which turns the count off as the library loads), 0 if not, -1 if it cannot tell.
int warden_sqlite_counts_memory(void);

#endif
