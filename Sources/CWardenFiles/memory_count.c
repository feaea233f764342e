// SQLite's count of the memory it holds, turned off.
//
// With the count on (SQLite's default), every allocation and free SQLite makes takes one
// process-wide mutex to keep it. The ledger's writer allocates for every row it makes longer
// than a lookaside slot (each event's token and audit record) and frees it when the statement
// ends: in a profile of the writer recording steps' outcomes, taking and giving back that mutex
// was 4 % of its time. Nothing here reads the count, and without it SQLite has no soft or hard
// heap limit, which Warden does not set.
//
// Set as the library loads (a constructor), before SQLite is initialised: SQLite takes this
// setting only then. Where it was already initialised, the count stays on
// (`warden_sqlite_counts_memory` then says so).

#include <sqlite3.h>
#include "CWardenFiles.h"

__attribute__((constructor)) static void stopCountingMemory(void) {
    sqlite3_config(SQLITE_CONFIG_MEMSTATUS, 0);
}

int warden_sqlite_counts_memory(void) {
    sqlite3_int64 current = 0, highest = 0;
    if (sqlite3_status64(SQLITE_STATUS_MEMORY_USED, &current, &highest, 0) != SQLITE_OK) return -1;
    // With the count off, SQLite reports nothing held.
    return current != 0 || highest != 0;
}
