#ifndef CWARDEN_FILES_H
#define CWARDEN_FILES_H

/// Starts the writeback of a file's dirty pages, without waiting for it or flushing the disk's
/// cache (Linux `sync_file_range` with `SYNC_FILE_RANGE_WRITE`, which Swift's Glibc module
/// does not declare). 0, or -1 with errno set.
int warden_start_writeback(int fd);

#endif
