/* common/closer.h - the closes one owner waits for before it frees itself: every close started
 * is counted, every close callback gives one back, and the last frees the owner. The closing
 * function holds one of its own while it starts them, so a callback that comes at once cannot
 * free the owner half way through; it gives that one back last. */
#ifndef RF_CLOSER_H
#define RF_CLOSER_H

#include <assert.h>
#include <stdbool.h>

typedef struct rf_closer {
    int pending;  /* closes started and not finished, plus the closing function's own hold */
    bool closing; /* rf_closer_begin was called: the owner takes no new work */
} rf_closer;

/* Closing begins (once); the caller holds one until its rf_closer_done. */
static inline void rf_closer_begin(rf_closer *c)
{
    assert(!c->closing);
    c->closing = true;
    c->pending = 1;
}

/* One more close will call rf_closer_done when it finishes. */
static inline void rf_closer_add(rf_closer *c)
{
    assert(c->closing && c->pending > 0);
    c->pending++;
}

/* A close finished, or the caller gave its hold back: true when it was the last one, and the
 * owner must be freed now. */
static inline bool rf_closer_done(rf_closer *c)
{
    assert(c->closing && c->pending > 0);
    return --c->pending == 0;
}

#endif
