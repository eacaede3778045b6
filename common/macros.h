/* common/macros.h - the few macros every module needs. */
#ifndef RF_MACROS_H
#define RF_MACROS_H

#include <stddef.h>

/* The owner of an embedded member (libuv handles embedded in their owner). */
#ifndef container_of
#define container_of(ptr, type, member) ((type *)((char *)(ptr) - offsetof(type, member)))
#endif

#define RF_ARRAY_SIZE(a) (sizeof(a) / sizeof((a)[0]))

#endif
