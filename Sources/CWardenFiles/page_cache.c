// SQLite's page cache, with one page number kept out of it: the one SQLite lends a page for a
// moment while it swaps two pages' numbers.
//
// When a b-tree balance leaves sibling pages out of page-number order, SQLite swaps two pages'
// numbers through a third, the number of the page holding the locking bytes (1 GiB into the
// file; 262,145 with 4 KiB pages), which never holds data. The default page cache remembers the
// largest number it was given, and at the end of every transaction drops the pages past the
// database's end: it walks only the slots those pages can be in, unless the largest number is
// further past the end than the cache has slots. After a swap it is, and it walks every page it
// holds: with the ledger writer's 64 MiB cache (16,384 pages), a cache miss per page, at the end
// of every transaction that swapped. Claims of random jtis split the (issuer, jti) index's pages
// in no order, and most of the writer's transactions swap: a profile of the writer with actions
// put 14 % of its time in that walk.
//
// This cache is the default one, given page number 0 (no page has it) in place of the lent one
// for the page SQLite parks there. SQLite looks for the lent number before the first
// renumbering (and finds nothing, as before); between the three renumberings of a swap it only
// looks for the two swapped numbers; after the third, no page is at 0. Any other use of the
// lent number (a corrupt database's locking page) goes to the default cache unchanged.
//
// Installed before SQLite's first use in the process (a constructor): SQLite takes a page cache
// only before it is initialised. Where it was already initialised, the default cache stays
// (`installed` is 0: it is set when SQLite initialises a cache through this one).

#include <sqlite3.h>
#include <stdatomic.h>
#include "CWardenFiles.h"

/// SQLite's `PENDING_BYTE`: the locking bytes' offset, whose page holds no data.
#define LOCKING_BYTES_OFFSET 0x40000000u
#define LENT_NUMBER_STAND_IN 0u

typedef struct {
    sqlite3_pcache *inner;
    /// The number SQLite lends during a swap: the locking bytes' page.
    unsigned lent;
    /// The page at the stand-in number, between a swap's first and last renumbering.
    sqlite3_pcache_page *lentPage;
    /// Index of the cache's page size in `swapsBySize` (-1: none).
    int sizeIndex;
} WardenCache;

static sqlite3_pcache_methods2 defaultCache;
static atomic_llong lentNumbersGiven;
static atomic_int installed;
/// Swaps counted by the page size of the cache they were in (512 B to 64 KiB: 2^9 to 2^16).
static atomic_llong swapsBySize[8];

/// A page size's index in `swapsBySize`, or -1.
static int sizeIndex(int pageSize) {
    for (int i = 0; i < 8; i++) {
        if (pageSize == 512 << i) return i;
    }
    return -1;
}

/// Counts the default cache being given the lent number as a page's (which it then remembers).
static void note(WardenCache *c, unsigned key) {
    if (key == c->lent) atomic_fetch_add_explicit(&lentNumbersGiven, 1, memory_order_relaxed);
}

static int cInit(void *arg) {
    int rc = defaultCache.xInit(defaultCache.pArg);
    if (rc == SQLITE_OK) atomic_store(&installed, 1);
    return rc;
}
static void cShutdown(void *arg) { if (defaultCache.xShutdown) defaultCache.xShutdown(defaultCache.pArg); }

static sqlite3_pcache *cCreate(int pageSize, int extraSize, int purgeable) {
    WardenCache *c = sqlite3_malloc(sizeof(WardenCache));
    if (!c) return NULL;
    if (!(c->inner = defaultCache.xCreate(pageSize, extraSize, purgeable))) {
        sqlite3_free(c);
        return NULL;
    }
    c->lent = pageSize > 0 ? LOCKING_BYTES_OFFSET / (unsigned)pageSize + 1 : 0xffffffffu;
    c->lentPage = NULL;
    c->sizeIndex = sizeIndex(pageSize);
    return (sqlite3_pcache *)c;
}

#define INNER(p) (((WardenCache *)(p))->inner)

static void cCachesize(sqlite3_pcache *p, int size) { defaultCache.xCachesize(INNER(p), size); }
static int cPagecount(sqlite3_pcache *p) { return defaultCache.xPagecount(INNER(p)); }

/// Puts the parked page back at the lent number, as the default cache would have it. Never
/// needed within a swap (SQLite holds its pages throughout, and truncates only after it).
static void unpark(WardenCache *c) {
    note(c, c->lent);
    defaultCache.xRekey(c->inner, c->lentPage, LENT_NUMBER_STAND_IN, c->lent);
    c->lentPage = NULL;
}

static sqlite3_pcache_page *cFetch(sqlite3_pcache *p, unsigned key, int create) {
    WardenCache *c = (WardenCache *)p;
    if (key == c->lent && c->lentPage) key = LENT_NUMBER_STAND_IN;
    if (create) note(c, key);
    return defaultCache.xFetch(c->inner, key, create);
}

static void cUnpin(sqlite3_pcache *p, sqlite3_pcache_page *page, int discard) {
    WardenCache *c = (WardenCache *)p;
    if (page == c->lentPage) {
        // A page discarded goes from 0 as from anywhere; one kept, back to its number.
        if (discard) c->lentPage = NULL; else unpark(c);
    }
    defaultCache.xUnpin(c->inner, page, discard);
}

static void cRekey(sqlite3_pcache *p, sqlite3_pcache_page *page, unsigned from, unsigned to) {
    WardenCache *c = (WardenCache *)p;
    if (from == c->lent && page == c->lentPage) {
        from = LENT_NUMBER_STAND_IN;
        c->lentPage = NULL;
    }
    if (to == c->lent && !c->lentPage) {
        to = LENT_NUMBER_STAND_IN;
        c->lentPage = page;
        if (c->sizeIndex >= 0) atomic_fetch_add_explicit(&swapsBySize[c->sizeIndex], 1, memory_order_relaxed);
    }
    note(c, to);
    defaultCache.xRekey(c->inner, page, from, to);
}

static void cTruncate(sqlite3_pcache *p, unsigned limit) {
    WardenCache *c = (WardenCache *)p;
    // The parked page past the limit goes, as the default cache drops it.
    if (c->lentPage && limit <= c->lent) unpark(c);
    defaultCache.xTruncate(c->inner, limit);
}

static void cDestroy(sqlite3_pcache *p) {
    defaultCache.xDestroy(INNER(p));
    sqlite3_free(p);
}

static void cShrink(sqlite3_pcache *p) { defaultCache.xShrink(INNER(p)); }

/// Runs once, as the library loads, before any thread of the process can use SQLite.
__attribute__((constructor)) static void install(void) {
    sqlite3_pcache_methods2 found;
    if (sqlite3_config(SQLITE_CONFIG_GETPCACHE2, &found) != SQLITE_OK) return;
    if (found.iVersion < 1 || !found.xCreate || !found.xFetch || !found.xRekey || !found.xTruncate || !found.xUnpin
        || !found.xDestroy || !found.xCachesize || !found.xPagecount || !found.xShrink || !found.xInit) {
        return;
    }
    defaultCache = found;
    static const sqlite3_pcache_methods2 methods = {
        .iVersion = 1,
        .pArg = NULL,
        .xInit = cInit,
        .xShutdown = cShutdown,
        .xCreate = cCreate,
        .xCachesize = cCachesize,
        .xPagecount = cPagecount,
        .xFetch = cFetch,
        .xUnpin = cUnpin,
        .xRekey = cRekey,
        .xTruncate = cTruncate,
        .xDestroy = cDestroy,
        .xShrink = cShrink,
    };
    sqlite3_config(SQLITE_CONFIG_PCACHE2, &methods);
}

void warden_page_cache_counts(int pageSize, WardenPageCacheCounts *counts) {
    counts->installed = atomic_load(&installed);
    int i = sizeIndex(pageSize);
    counts->swapsOfPageSize = i >= 0 ? atomic_load_explicit(&swapsBySize[i], memory_order_relaxed) : 0;
    counts->lentNumbersGiven = atomic_load_explicit(&lentNumbersGiven, memory_order_relaxed);
}
